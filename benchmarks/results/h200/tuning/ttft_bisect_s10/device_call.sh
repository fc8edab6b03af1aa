#!/usr/bin/env bash
# session 10 call 1: windowed TTFT bisect (7 revisions x 2, interleaved), grouped-MoE GPU tests + sweep, in-situ A/B
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
mkdir -p /tmp/o /tmp/r; for t in .bisect/*.tar; do tar -xf $t -C /tmp/o; done
REVS="63e1ce9 334e487 1304fda e2f726e 3ee0562 f912df3 231d375"
log() { echo "$@" | tee -a $OUT/log.txt; }
ttft() { local rev=$1 n=$2 t0=$SECONDS
  (cd /tmp/o/$rev && PYTHONPATH=/tmp/o/$rev:/tmp/site timeout 120 python3 -m wmtp bench ttft --preset qwen3.6-35b-a3b \
     --modes windowed --tokens 131072 --chunk 8192 --out /tmp/r/ttft_${rev}_$n.json > /tmp/r/ttft_${rev}_$n.log 2>&1)
  local v=$(python3 -c "import json;print(round(json.load(open('/tmp/r/ttft_${rev}_$n.json'))['rows'][0]['ttft_s'],3))" 2>/dev/null)
  log "ttft $rev round $n windowed ${v:-FAILED} s (wall $((SECONDS-t0)) s)"
  echo "{\"rev\":\"$rev\",\"round\":$n,\"ttft_s\":${v:-null}}" >> $OUT/ttft_bisect.jsonl; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,temperature.gpu --format=csv | tee -a $OUT/log.txt
for r in $REVS; do ttft $r 1; done
timeout 60 python3 -m pytest -q -x tests/test_moe_kernel.py 2>&1 | tail -5 | tee -a $OUT/log.txt
timeout 120 python3 benchmarks/tune_moe.py --tokens 7 --cases swiglu_routed_shared,swiglu_grouped --out $OUT/tune_moe_grouped_s10.json 2>&1 | tail -8 | tee -a $OUT/log.txt
step() { local tag=$1 dir=$2 t0=$SECONDS
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 150 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --modes windowed \
     --context 1040000 -d 7 --iters 60 --out $OUT/step_windowed_$tag.json 2>&1 | tail -4 | tee -a $OUT/log.txt)
  log "step $tag wall $((SECONDS-t0)) s"; }
step main /tmp/o/231d375; step grouped $PWD
for r in $REVS; do ttft $r 2; done
