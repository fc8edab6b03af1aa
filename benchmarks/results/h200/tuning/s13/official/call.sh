#!/usr/bin/env bash
# session 13 call 4 (the tip to land): official 1M step (all modes, kernels, admission); greedy identity on the GPU;
# GPU tests of what changed (GDN replay bound, skinny linear, decode graphs with compiled steps / iteration graph)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 150 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --context 1040000 -d 7 --iters 60 --kernels --admission \
  --out $OUT/step_1m_qwen3.6-35b-a3b.json 2>&1 | grep -v Warn | tail -24 | tee $OUT/log.txt
timeout 220 python3 benchmarks/gpu_identity.py --prompts 8 --max-tokens 32 --out $OUT/gpu_identity.json 2>&1 | tail -8 | tee -a $OUT/log.txt
timeout 60 python3 -m pytest -q -rfE tests/test_gdn_kernel.py tests/test_linear_kernel.py 2>&1 | grep -E "^E |FAILED|passed|failed|error" | head -8 | tee -a $OUT/log.txt
echo "== decode graphs" >> $OUT/log.txt
timeout 150 python3 -m pytest -q -rfE tests/test_decode_graphs.py 2>&1 | grep -E "^E |FAILED|passed|failed|error|^[.sFE]+ " | head -8 | tee -a $OUT/log.txt
