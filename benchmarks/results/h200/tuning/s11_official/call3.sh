#!/usr/bin/env bash
# session 11 call 3 (official): new kernels' GPU tests, identity, full step (read bandwidth, admission), TTFT 131K
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
log() { echo "$@" | tee -a $OUT/log.txt; }
t0=$SECONDS
timeout 90 python3 -m pytest -q tests/test_stream_kernel.py tests/test_gdn_kernel.py -k "stream or conv_prefill" 2>&1 | tail -2 | tee -a $OUT/log.txt
log "tests wall $((SECONDS-t0))"; t0=$SECONDS
timeout 220 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --context 1040000 -d 7 --iters 60 --kernels --admission \
  --out $OUT/step_1m_qwen3.6-35b-a3b.json 2>&1 | tail -24 | tee -a $OUT/log.txt
log "step wall $((SECONDS-t0))"; t0=$SECONDS
timeout 130 python3 -m wmtp bench ttft --preset qwen3.6-35b-a3b --modes native,windowed --tokens 131072 --chunk 8192 \
  --out $OUT/ttft_131k_qwen3.6-35b-a3b.json 2>&1 | tail -3 | tee -a $OUT/log.txt
log "ttft wall $((SECONDS-t0))"; t0=$SECONDS
timeout 120 python3 benchmarks/gpu_identity.py --prompts 8 --max-tokens 32 --out $OUT/gpu_identity.json 2>&1 | tail -6 | tee -a $OUT/log.txt
log "identity wall $((SECONDS-t0))"
