#!/usr/bin/env bash
# session 13 call 2: same-lease A/B main / down_combine shared-in-loop / + compiled bookkeeping (windowed, 2 rounds);
# route_topk warps probe; GPU tests of the branch (moe kernels, rollback, decode graphs incl. the compiled steps)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
timeout 330 bash benchmarks/ab_step.sh run 2 windowed 2>&1 | tail -8 | tee $OUT/log.txt
export PYTHONPATH=$PWD:/tmp/site
timeout 40 python3 .bisect/route_probe.py $OUT/route_probe.json 2>&1 | tail -8 | tee -a $OUT/log.txt
timeout 200 python3 -m pytest -q -x tests/test_moe_kernel.py tests/test_decode_graphs.py 2>&1 | tail -4 | tee -a $OUT/log.txt
timeout 60 python3 -m pytest -q -x tests/test_gdn_kernel.py -k rollback 2>&1 | tail -3 | tee -a $OUT/log.txt
