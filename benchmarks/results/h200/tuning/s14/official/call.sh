#!/usr/bin/env bash
# session 14 final call: GPU tests of the attention and the decode graphs, then the official step
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
timeout 130 python3 -m wmtp bench step --preset qwen3.6-35b-a3b --context 1040000 -d 7 --iters 60 --kernels --admission \
  --out $OUT/step_1m_qwen3.6-35b-a3b.json 2>&1 | grep -v Warn > $OUT/official_log.txt; echo "bench rc $?" >> $OUT/official_log.txt
grep -E "bandwidth|t_iter |native /|paged|draft attn" $OUT/official_log.txt | head -20
timeout 330 python3 -m pytest -rA -p no:cacheprovider tests/test_paged_attention.py tests/test_decode_graphs.py 2>&1 | tail -60 > $OUT/tests_log.txt; echo "pytest rc ${PIPESTATUS[0]}" >> $OUT/tests_log.txt
grep -cE "^PASSED" $OUT/tests_log.txt; grep -E "FAILED|ERROR|passed|failed|pytest rc" $OUT/tests_log.txt | tail -8
