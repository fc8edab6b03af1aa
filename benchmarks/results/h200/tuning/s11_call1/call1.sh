#!/usr/bin/env bash
# session 11 call 1: GPU tests (main), full step on the read bandwidth (no admission), cold MoE tune; wip branch GPU tests + conv tune
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
log() { echo "$@" | tee -a $OUT/log.txt; }
t0=$SECONDS
timeout 130 python3 -m pytest -q -x tests/test_stream_kernel.py tests/test_paged_attention.py 2>&1 | tail -3 | tee -a $OUT/log.txt
log "tests wall $((SECONDS-t0))"; t0=$SECONDS
timeout 150 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --context 1040000 -d 7 --iters 60 --kernels \
  --out $OUT/step_1m_read_bw.json 2>&1 | tail -24 | tee -a $OUT/log.txt
log "step wall $((SECONDS-t0))"; t0=$SECONDS
mkdir -p /tmp/wip && tar -xf .bisect/wip.tar -C /tmp/wip
(cd /tmp/wip && PYTHONPATH=/tmp/wip:/tmp/site timeout 120 python3 -m pytest -q -x tests/test_gdn_kernel.py tests/test_moe_kernel.py 2>&1 | tail -3 | tee -a $OUT/log.txt)
log "wip tests wall $((SECONDS-t0))"; t0=$SECONDS
(cd /tmp/wip && PYTHONPATH=/tmp/wip:/tmp/site timeout 60 python3 benchmarks/tune_conv_prefill.py --out $OUT/tune_conv_prefill_s11.json 2>&1 | tail -5 | tee -a $OUT/log.txt)
log "conv tune wall $((SECONDS-t0))"; t0=$SECONDS
timeout 150 python3 benchmarks/tune_moe.py --tokens 1,7 --layers 4 --out $OUT/tune_moe_cold_s11.json 2>&1 | tail -8 | tee -a $OUT/log.txt
log "moe tune wall $((SECONDS-t0))"
