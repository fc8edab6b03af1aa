#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 90 python3 -m pytest -q -x tests/test_paged_attention.py 2>&1 | tail -3 | tee $OUT/log.txt
timeout 120 python3 -m wmtp bench ttft --preset qwen3.6-35b-a3b --modes native,windowed --tokens 131072 --chunk 8192 \
  --out $OUT/ttft_131k_qwen3.6-35b-a3b.json 2>&1 | tail -3 | tee -a $OUT/log.txt
timeout 200 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --context 1040000 -d 7 --iters 60 --kernels --admission \
  --out $OUT/step_1m_qwen3.6-35b-a3b.json 2>&1 | tail -22 | tee -a $OUT/log.txt
timeout 80 python3 .bisect/prof_prefill.py $OUT/prefill_profile_gate_unfused.txt 2>&1 | sed -n 1,8p
timeout 70 python3 benchmarks/tune_attention.py --context 73728 --q-lens 8192 --rows 64,128 --block-n 32,64 --warps 4,8 \
  --stages 2 --table contiguous --out $OUT/tune_attention_prefill.json 2>&1 | tail -3
