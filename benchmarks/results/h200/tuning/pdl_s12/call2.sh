#!/usr/bin/env bash
# session 12 call 2: same-lease A/B main / PDL / PDL + skinny first-tile preload (windowed, dense); GPU tests of
# the PDL revision; lm_head probe
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
timeout 400 bash benchmarks/ab_step.sh run 2 windowed,dense 2>&1 | tail -12 | tee $OUT/log.txt
br=$(tail -1 .ab/order)
cd /tmp/ab/$br && export PYTHONPATH=/tmp/ab/$br:/tmp/site
timeout 60 python3 $OLDPWD/.bisect/lm_head_probe.py $OUT/lm_head_probe.json 2>&1 | tail -20 | tee -a $OUT/log.txt
timeout 100 python3 -m pytest -q -x tests/test_decode_graphs.py 2>&1 | tail -3 | tee -a $OUT/log.txt
