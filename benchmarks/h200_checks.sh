#!/usr/bin/env bash
# Issue 4 checks on one H200, in one device call: the GPU tests (kernels against their twins, the
# captured decode graphs against the eager iteration), greedy token identity across modes, T_iter
# at S = 1.04M per mode with CUDA graphs (+ admission), TTFT of a 131,072-token prefill, and the
# batch sweep at 131K (where the ring's extra seat shows). Together longer than one 10-minute
# device call: split them with PARTS.
#   run from the repo root; results go to $OUT (default ./h200_out). Pure-Python wheels in .whl/
#   (fla-core, einops) are installed first when present.
set -o pipefail
OUT=${OUT:-h200_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
parts=${PARTS:-tests,identity,step,ttft,batch}
run() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$OUT/log.txt"; }
[[ $parts == *tests* ]] && run tests python3 -m pytest -q -x tests/test_decode_graphs.py tests/test_paged_attention.py \
  tests/test_gdn_kernel.py tests/test_moe_kernel.py tests/test_norm_kernel.py tests/test_linear_kernel.py tests/test_argmax_kernel.py tests/test_stream_kernel.py
[[ $parts == *identity* ]] && run identity python3 benchmarks/gpu_identity.py --prompts 8 --max-tokens 32 --out "$OUT/gpu_identity.json"
[[ $parts == *step* ]] && run step python3 -m wmtp bench step --context 1040000 -d 7 --iters 60 --kernels --admission \
  ${STEP_ARGS:-} --out "$OUT/step_1m.json"
[[ $parts == *ttft* ]] && run ttft python3 -m wmtp bench ttft --modes native,windowed --tokens 131072 --chunk 8192 \
  --out "$OUT/ttft_131k.json"
[[ $parts == *batch* ]] && run batch python3 -m wmtp bench suite --out "$OUT/sweeps_131k" --sweeps batch --context 131072 \
  --batch-ladder 1,4,16 --iters 30
exit 0
