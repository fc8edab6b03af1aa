#!/usr/bin/env bash
# session 11 call 2: read-bandwidth variants; paged attention GPU tests; wip branch new GPU tests, conv tune, TTFT main vs wip
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
log() { echo "$@" | tee -a $OUT/log.txt; }
t0=$SECONDS
timeout 150 python3 .bisect/read_explore.py $OUT/read_explore.json > $OUT/read_explore.log 2>&1; tail -2 $OUT/read_explore.log | tee -a $OUT/log.txt
log "read wall $((SECONDS-t0))"; t0=$SECONDS
timeout 90 python3 -m pytest -q tests/test_paged_attention.py 2>&1 | tail -3 | tee -a $OUT/log.txt
log "paged tests wall $((SECONDS-t0))"; t0=$SECONDS
mkdir -p /tmp/wip && tar -xf .bisect/wip.tar -C /tmp/wip
(cd /tmp/wip && PYTHONPATH=/tmp/wip:/tmp/site timeout 120 python3 -m pytest -q tests/test_gdn_kernel.py tests/test_moe_kernel.py -k "conv_prefill or combine_sorted" 2>&1 | tail -4 | tee -a $OUT/log.txt)
log "wip tests wall $((SECONDS-t0))"; t0=$SECONDS
(cd /tmp/wip && PYTHONPATH=/tmp/wip:/tmp/site timeout 100 python3 benchmarks/tune_conv_prefill.py --out $OUT/tune_conv_prefill_s11.json 2>&1 | tail -3 | tee -a $OUT/log.txt)
log "conv tune wall $((SECONDS-t0))"
ttft() { local tag=$1 dir=$2 n=$3 t0=$SECONDS
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 80 python3 -m wmtp bench ttft --preset qwen3.6-35b-a3b --modes windowed \
     --tokens 131072 --chunk 8192 --out $OUT/ttft_${tag}_$n.json > $OUT/ttft_${tag}_$n.log 2>&1)
  local v=$(python3 -c "import json;print(round(json.load(open('$OUT/ttft_${tag}_$n.json'))['rows'][0]['ttft_s'],3))" 2>/dev/null)
  log "ttft $tag $n windowed ${v:-FAILED} s (wall $((SECONDS-t0)) s)"; }
ttft main $PWD 1; ttft wip /tmp/wip 1; ttft main $PWD 2; ttft wip /tmp/wip 2
