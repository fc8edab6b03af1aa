#!/usr/bin/env bash
# session 13 call 3: same-lease A/B main / compiled steps / + one iteration graph / + draft lm_head skinny (windowed,
# 2 rounds); the GDN replay-exactness test on main and on the tip (it failed once on the tip in call 2)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
timeout 400 bash benchmarks/ab_step.sh run 2 windowed 2>&1 | tail -6 | tee $OUT/log.txt
for rev in $(sed -n 1p .ab/order) $(sed -n 4p .ab/order); do
  echo "== rollback exactness test, $rev" | tee -a $OUT/log.txt
  (cd /tmp/ab/$rev && PYTHONPATH=/tmp/ab/$rev:/tmp/site timeout 60 python3 -m pytest -q -rA tests/test_gdn_kernel.py -k "replays" 2>&1 \
    | grep -E "^E |FAILED|PASSED|passed|failed|Error" | head -12) | tee -a $OUT/log.txt
done
