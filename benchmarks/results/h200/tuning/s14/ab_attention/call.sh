#!/usr/bin/env bash
# session 14 call: windowed A/B of the attention change (2 rounds), attention sweep, GPU attention tests
export PYTHONUNBUFFERED=1
bash benchmarks/ab_step.sh run 2 windowed 2>&1 | tail -6 | tee $OUT/log.txt
PYTHONPATH=$PWD timeout 120 python3 benchmarks/tune_attention.py --q-lens 1,7 --table random --rows 64 --block-n 32,64 --warps 4 --stages 3,4 \
  --pool-layers 10 --out $OUT/tune_attention.json 2>&1 | grep -v Warn | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -rfE tests/test_paged_attention.py 2>&1 | grep -E "^E |FAILED|passed|failed|error" | head -8 | tee -a $OUT/log.txt
