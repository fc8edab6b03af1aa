#!/usr/bin/env bash
# session 12 call 1: PDL probe; same-lease A/B main vs wip/gated-norm-out-proj; the branch's GPU tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 120 python3 .bisect/pdl_probe.py $OUT/pdl_probe.json 2>&1 | tail -12 | tee $OUT/log.txt
timeout 300 bash benchmarks/ab_step.sh run 3 windowed 2>&1 | tail -8 | tee -a $OUT/log.txt
br=$(tail -1 .ab/order)
(cd /tmp/ab/$br && PYTHONPATH=/tmp/ab/$br:/tmp/site timeout 150 python3 -m pytest -q -x tests/test_linear_kernel.py tests/test_gdn_kernel.py tests/test_decode_graphs.py 2>&1 | tail -4 | tee -a $OUT/log.txt)
