#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 100 python3 -m pytest -q -x tests/test_paged_attention.py 2>&1 | tail -3 | tee $OUT/log.txt
timeout 120 python3 -m wmtp bench ttft --preset qwen3.6-35b-a3b --modes native,windowed --tokens 131072 --chunk 8192 \
  --out $OUT/ttft_131k_qwen3.6-35b-a3b.json 2>&1 | tail -3 | tee -a $OUT/log.txt
timeout 60 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --modes windowed --context 1040000 -d 7 --iters 60 \
  --out $OUT/step_windowed_lease4.json 2>&1 | tail -4 | tee -a $OUT/log.txt
