#!/usr/bin/env bash
# The GPU checks and the results behind the README and the report, on one H200: the GPU tests
# (kernels against their twins, the captured decode graphs against the eager iteration), greedy
# token identity across modes, T_iter at S = 1.04M per mode (+ kernels, admission), TTFT of a
# 131,072-token prefill, admission at 131K, the sweep suite at 1.04M and the batch sweep at 131K.
# Together longer than one 10-minute device call: pick with PARTS (comma-separated names below)
# and the models of step / ttft / seats with PRESETS (comma-separated preset names), the formats
# whose decode kernels' tiles are swept with QTUNE (nvfp4,fp8), the tiny presets of identity with
# IDENTITY (default: all), the multi-turn runs with MULTITURN (off,on), the 1M prefix-cache TTFT modes with
# TTFT1M (dense,native,windowed), the presets profiled at 1.04M with PROFILE; the suite
# resumes from $WORK (kept on the machine between calls); every part stops by $DEADLINE seconds.
#   run from the repo root with WMTP_COMMIT set to the commit the tree holds; everything lands in
#   $OUT/results.tgz (+ log.txt), refreshed after each part. Pure-Python wheels in .whl/ (fla-core;
#   on a fresh checkout `pip download --no-deps fla-core==0.6.0 -d .whl`, carried as ".whl") are
#   installed first.
set -o pipefail
OUT=${OUT:-h200_out}
WORK=${WORK:-/tmp/wmtp_results}
mkdir -p "$OUT" "$WORK"
# FlashAttention-4's wheels, carried in two calls (benchmarks/flash_wheels.sh), join the rest
if [[ -d .flash1 && -d .flash2 ]]; then bash benchmarks/flash_wheels.sh join || exit 1; fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  # the CUTLASS DSL (FlashAttention-4's) puts its packages on the path from a .pth, which PYTHONPATH skips
  [[ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
parts=${PARTS:-tests,identity,step,ttft,suite,batch}
IFS=, read -r -a presets <<< "${PRESETS:-qwen3.6-35b-a3b}"
start=$SECONDS
left() { echo $(( ${DEADLINE:-540} - (SECONDS - start) )); }
run() {
  echo "== $1 ($((SECONDS - start)) s)" | tee -a "$WORK/log.txt"; shift
  timeout "$(left)" "$@" 2>&1 | grep -v Warning | tee -a "$WORK/log.txt"
  tar -czf "$OUT/results.tgz" -C "$WORK" . && cp "$WORK/log.txt" "$OUT/log.txt"
}
# the GPU compiles every test's kernels: all of these together ran past 570 s in one call; TESTS picks some
# (space-separated test files)
kernel_tests=${TESTS:-"tests/test_decode_graphs.py tests/test_paged_attention.py tests/test_gdn_kernel.py
  tests/test_moe_kernel.py tests/test_norm_kernel.py tests/test_linear_kernel.py tests/test_argmax_kernel.py
  tests/test_stream_kernel.py tests/test_mamba2_kernel.py tests/test_relu2_moe_kernel.py tests/test_flash_prefill.py"}
quant_tests="tests/test_quant_linear.py tests/test_quant_moe.py tests/test_linear_kernel.py tests/test_moe_kernel.py
  tests/test_relu2_moe_kernel.py tests/test_quantized_model.py::test_triton_backend_emits_the_twins_tokens
  tests/test_quantized_model.py::test_grouped_moe_over_quantized_experts_matches_the_twin"
[[ $parts == *qtests* ]] && run qtests python3 -m pytest -q -p no:cacheprovider $quant_tests
for q in ${QTUNE//,/ }; do  # the quantized decode kernels' tile sweeps, per format
  run "tune linear $q" python3 benchmarks/tune_linear.py --quantize "$q" --tokens 1,7 --out "$WORK/tune_linear_$q.json"
  run "tune moe $q" python3 benchmarks/tune_moe.py --quantize "$q" --tokens 1,7 --out "$WORK/tune_moe_$q.json"
done
# the quantized MoE kernels' sweeps on the other families' expert shapes (QTUNE's formats, nvfp4 by default):
# Nemotron-3-Super's latent ReLU² experts (22 of 512) and the 122B's SwiGLU experts (8 of 256)
if [[ $parts == *moeshapes* ]]; then
  qs=${QTUNE:-nvfp4}
  for q in ${qs//,/ }; do
    run "tune moe $q nemotron" python3 benchmarks/tune_moe.py --quantize "$q" --experts 512 --hidden 1024 --inter 2688 \
      --shared-inter 128 --top-k 22 --tokens 1,8 --cases relu2_up,down_pairs \
      --out "$WORK/tune_moe_${q}_nemotron.json"
    run "tune moe $q 122b" python3 benchmarks/tune_moe.py --quantize "$q" --experts 256 --hidden 3072 --inter 1024 \
      --shared-inter 1024 --top-k 8 --tokens 1,8 --cases swiglu_routed_shared,down_combine_shared \
      --out "$WORK/tune_moe_${q}_122b.json"
  done
fi
[[ $parts == *,tests* || $parts == tests* ]] && run tests python3 -m pytest -q -x -p no:cacheprovider $kernel_tests
[[ $parts == *identity* ]] && run identity python3 benchmarks/gpu_identity.py --prompts 8 --max-tokens 32 \
  ${IDENTITY:+--presets "$IDENTITY"} --out "$WORK/gpu_identity.json"
for p in "${presets[@]}"; do
  [[ $parts == *step* ]] && run "step $p" python3 -m wmtp bench step --preset "$p" --context 1040000 -d 7 --iters 60 \
    --kernels --admission --out "$WORK/step_1m_$p.json"
  [[ $parts == *seats* ]] && run "seats $p" python3 -m wmtp bench step --preset "$p" --context 131072 -d 7 --iters 20 \
    --admission --max-admit 64 --out "$WORK/step_131k_$p.json"
  [[ $parts == *ttft* ]] && run "ttft $p" python3 -m wmtp bench ttft --preset "$p" --modes native,windowed --tokens 131072 \
    --chunk 8192 --split --out "$WORK/ttft_131k_$p.json"
  [[ $parts == *kvfp8* ]] && run "kv fp8 $p" python3 -m wmtp bench step --preset "$p" --context 1040000 -d 7 --iters 60 \
    --modes dense,dense:kv-fp8,native,native:kv-fp8,windowed,windowed:kv-fp8 --admission \
    --out "$WORK/step_1m_kv_fp8_$p.json"
done
# a 1.04M-token prompt and another sharing all but its last 200 tokens, one mode per call (TTFT1M, comma-separated;
# each takes about 5 minutes with the model load), merged into one file per preset (PRESETS)
for p in "${presets[@]}"; do
  for m in ${TTFT1M//,/ }; do
    run "ttft 1m $p $m" python3 -m wmtp bench ttft --preset "$p" --tokens 1040000 --repeat-suffix 200 --chunk 16384 \
      --modes "$m" --split --out "$WORK/prefix_ttft_1m_$p.json"
  done
done
# the multi-turn serving run needs the serve extra's wheels in .whl/ (fastapi, starlette, uvicorn, httpx and
# their dependencies); cache off and on in separate calls, merged into one file
for c in ${MULTITURN//,/ }; do
  run "multiturn cache $c" python3 -m wmtp bench multiturn --doc-tokens 131072 --users 4 --turns 8 --cache "$c" \
    --out "$WORK/multiturn_131k_qwen3.6-35b-a3b.json"
done
# the verify tile past 64 rows (rows): 64- against 128-row tiles at 8 and 9 verify queries (16 / 2 heads) and at 7
# (32 / 2 heads, the 122B and 120B shape); the adaptive depth replaying the CPU sweep's acceptance traces (replay);
# the depth sweep d = 2..9 at 1.04M (depth)
if [[ $parts == *rows* ]]; then
  run "tune attention rows" python3 benchmarks/tune_attention.py --q-lens 8,9 --rows 64,128 --block-n 32,64 \
    --warps 4,8 --stages 2,3 --out "$WORK/tune_attention_rows.json"
  run "tune attention rows 32 heads" python3 benchmarks/tune_attention.py --q-lens 7 --heads 32 --rows 64,128 \
    --block-n 32,64 --warps 4,8 --stages 2,3 --out "$WORK/tune_attention_rows_32h.json"
fi
# the prefill attention kernel against SDPA's backends at the same head shape, side by side (prefill)
[[ $parts == *prefill* ]] && run "prefill attention" python3 benchmarks/prefill_attention.py --contexts 131072,1040000 \
  --chunk 16384 --out "$WORK/prefill_attention.json"
[[ $parts == *replay* ]] && run "depth replay" python3 -m wmtp bench depth-replay \
  --traces benchmarks/results/acceptance/depth_traces.json --context 1040000 --depths auto,2,7,3,4,5,6,8 \
  --out "$WORK/depth_replay_1m_qwen3.6-35b-a3b.json"
[[ $parts == *depth* ]] && run "depth sweep" python3 -m wmtp bench suite --sweeps depth --out "$WORK/sweeps_1m_depth" \
  --runs 2 --iters 30 --warmup 3 --deadline "$(left)" --resume
[[ $parts == *suite* ]] && run suite python3 -m wmtp bench suite --out "$WORK/sweeps_1m" --runs 2 --iters 30 --warmup 3 \
  --k-iters 12 --batch-ladder 1,2 --deadline "$(left)" --resume
[[ $parts == *batch* ]] && run batch python3 -m wmtp bench suite --out "$WORK/sweeps_131k" --sweeps batch \
  --context 131072 --runs 2 --batch-ladder 1,4,16 --iters 30 --warmup 3 --deadline "$(left)" --resume
# torch.profiler over captured decode iterations at 1.04M, dense and windowed, per preset in PROFILE
for p in ${PROFILE//,/ }; do
  run "profile $p" python3 benchmarks/profile_step.py --preset "$p" --modes dense,windowed --graphs auto \
    --out "$WORK/profile_1m_$p.txt" --timeline "$WORK/timeline_1m_$p.json"
done
exit 0
