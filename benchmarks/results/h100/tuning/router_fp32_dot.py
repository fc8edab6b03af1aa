"""A router's fp32 logits (`fp32_linear`, bf16 x and weight) on the GPU under three dot forms, cold weights:
ieee fp32 dots over widened operands, the bf16 dot with fp32 sums, tf32 dots over widened operands; errors
against the fp64 product. ``cublas_fp32_us``: F.linear over fp32 copies of x and the weight, the casts included.
    python router_fp32_dot.py OUT.json
"""
import json, os, sys
import torch, torch.nn.functional as F
import wmtp.kernels.linear as L
from wmtp.bench.timing import cold_ms_per_call
orig = L.dot_flags
variants = {"ieee_widen": lambda dt: {"WIDEN": True, "PREC": "ieee"}, "bf16dot": lambda dt: {"WIDEN": False, "PREC": "tf32"},
            "tf32_widen": lambda dt: {"WIDEN": True, "PREC": "tf32"}}
rows = []
for N, K in ((512, 4096), (256, 2048), (256, 3072)):
    for T in (1, 8):
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(max(1, int(256e6 // (N * K * 2))))]
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.double(), ws[0].double())
        r = {"N": N, "K": K, "T": T, "cublas_fp32_us": 1e3 * cold_ms_per_call(lambda w: F.linear(x.float(), w.float()), ws)}
        for name, fl in variants.items():
            L.dot_flags = fl
            r[name + "_us"] = 1e3 * cold_ms_per_call(lambda w: L.fp32_linear(x, w), ws)
            r[name + "_err"] = (L.fp32_linear(x, ws[0]).double() - ref).abs().max().item()
        L.dot_flags = orig
        print(json.dumps(r), flush=True)
        rows.append(r)
from wmtp.bench.step import revision
json.dump({"commit": revision(), "hardware": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
