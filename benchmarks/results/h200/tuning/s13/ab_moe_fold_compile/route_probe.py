"""Session 13 probe: route_topk's launch (num_warps 1 / 2 / 4) for 1 and 8 tokens, 256 experts, top-8 + shared gate,
timed from a CUDA graph of 40 launches over distinct inputs (as the layers of a verify)."""
import json, sys
import torch, triton
from wmtp.bench.timing import cold_ms_per_call
from wmtp.kernels.moe import _route_topk_kernel
from wmtp.kernels.common import pdl
out = {}
for T in (1, 8):
    layers = [(torch.randn(T, 256, device="cuda", dtype=torch.bfloat16), torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)) for _ in range(40)]
    w = torch.empty(T, 8, device="cuda"); i = torch.empty(T, 8, device="cuda", dtype=torch.int32); sl = torch.empty(T, device="cuda")
    for nw in (1, 2, 4, 8):
        def f(l, nw=nw):
            lg, x, g = l
            _route_topk_kernel[(T,)](lg, w, i, x, g, sl, 256, 2048, TOP_K=8, K_P=8, NORM=True, SHARED=True, BLOCK_E=256,
                                     BLOCK_H=1024, num_warps=nw, **pdl(lg.device))
        ms = cold_ms_per_call(f, layers)
        out[f"T{T}_w{nw}"] = ms * 1e3
        print(f"route_topk T={T} num_warps={nw}: {ms*1e3:.2f} us", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
