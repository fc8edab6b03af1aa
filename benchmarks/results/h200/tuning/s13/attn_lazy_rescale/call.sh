#!/usr/bin/env bash
# session 13 call 1: GPU test of the lazy-rescale branch; same-lease A/B main vs lazy rescale (windowed, 3 rounds);
# windowed profiles of main with kernel timelines, PDL off (clean kernel durations) and on
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
rev=$(sed -n 2p .ab/order); mkdir -p /tmp/ab/$rev && tar -xf .ab/$rev.tar -C /tmp/ab/$rev
(cd /tmp/ab/$rev && PYTHONPATH=/tmp/ab/$rev:/tmp/site timeout 150 python3 -m pytest -q -x tests/test_paged_attention.py 2>&1 | tail -3) | tee $OUT/log.txt
timeout 330 bash benchmarks/ab_step.sh run 3 windowed 2>&1 | tail -6 | tee -a $OUT/log.txt
export PYTHONPATH=$PWD:/tmp/site
WMTP_PDL=0 timeout 100 python3 benchmarks/profile_step.py --modes windowed --graphs auto --iters 5 \
  --out $OUT/profile_windowed_nopdl.txt --timeline $OUT/timeline_nopdl.json 2>&1 | tail -2 | tee -a $OUT/log.txt
timeout 100 python3 benchmarks/profile_step.py --modes windowed --graphs auto --iters 5 \
  --out $OUT/profile_windowed_pdl.txt --timeline $OUT/timeline_pdl.json 2>&1 | tail -2 | tee -a $OUT/log.txt
