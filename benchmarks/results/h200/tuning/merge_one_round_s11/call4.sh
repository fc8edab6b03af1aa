#!/usr/bin/env bash
# session 11 call 4: one-round split merge: GPU tests, windowed A/B against HEAD (interleaved, same lease)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
log() { echo "$@" | tee -a $OUT/log.txt; }
mkdir -p /tmp/base && tar -xf .bisect/base.tar -C /tmp/base
step() { local tag=$1 dir=$2 n=$3 t0=$SECONDS
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 70 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --modes windowed \
     --context 1040000 -d 7 --iters 60 --out $OUT/step_windowed_${tag}_$n.json 2>&1 | grep "windowed\]" | tee -a $OUT/log.txt)
  log "step $tag $n wall $((SECONDS-t0)) s"; }
t0=$SECONDS
timeout 90 python3 -m pytest -q tests/test_paged_attention.py -k "splits or gate or draft or decode_and_verify or bf16 or random" 2>&1 | tail -2 | tee -a $OUT/log.txt
log "tests wall $((SECONDS-t0))"
step merge1round $PWD 1; step base /tmp/base 1; step merge1round $PWD 2; step base /tmp/base 2
