#!/usr/bin/env bash
# session 12 call 4: GPU tests of the GDN replay branch (gdn kernels incl. the bit-exact replay, decode graphs);
# same-lease A/B main vs branch, windowed
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 90 python3 -m pytest -q -x tests/test_gdn_kernel.py 2>&1 | tail -3 | tee $OUT/log.txt
timeout 160 bash benchmarks/ab_step.sh run 2 windowed 2>&1 | tail -6 | tee -a $OUT/log.txt
timeout 150 python3 -m pytest -q -x tests/test_decode_graphs.py 2>&1 | tail -3 | tee -a $OUT/log.txt
