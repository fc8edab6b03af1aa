#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/o; tar -xf .bisect/1304fda.tar -C /tmp/o
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 .bisect/prof_prefill.py $OUT/prefill_profile_head.txt 2>&1 | head -60
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 benchmarks/tune_attention.py --context 73728 --q-lens 8192 --rows 64,128,256 \
  --block-n 32,64 --warps 4,8 --stages 1,2,3 --table contiguous --out $OUT/tune_attention_prefill.json 2>&1 | tail -5
PYTHONPATH=$PWD:/tmp/site timeout 60 python3 - <<'PY' 2>&1 | tee $OUT/sdpa_ref.txt
import torch, triton.testing
from torch.nn.attention import sdpa_kernel, SDPBackend
q = torch.randn(1, 16, 8192, 256, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 16, 73728, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    try:
        with sdpa_kernel(be):
            ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"sdpa {be.name} q 8192 x k 73728 non-causal hd256: {ms:.2f} ms, {4*16*256*8192*73728/ms/1e9:.0f} TFLOP/s")
    except Exception as e:
        print(f"sdpa {be.name}: {type(e).__name__} {str(e)[:200]}")
PY
(cd /tmp/o/1304fda && PYTHONPATH=/tmp/o/1304fda:/tmp/site timeout 150 python3 $OLDPWD/.bisect/prof_prefill.py $OUT/prefill_profile_1304fda.txt 2>&1 | head -30)
