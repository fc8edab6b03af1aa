"""one-off: cuBLASLt FP8 (torch._scaled_mm, x quantized per tensor) against the engine's weight-only FP8 skinny
linear, on Nemotron-3-Super's per-tensor FP8 projections, cold weights (cold_ms_per_call)."""
import json, sys
import torch
import torch.nn.functional as F
from wmtp.bench.timing import cold_ms_per_call
from wmtp.kernels.linear import decode_linear
from wmtp.quant import FP8Tensor, QuantWeight

SHAPES = [("mamba_in_proj", 18560, 4096), ("mamba_out_proj", 4096, 8192), ("shared_up", 5376, 4096),
          ("shared_down", 4096, 5376), ("o_proj", 4096, 4096), ("latent_fc1", 1024, 4096), ("latent_fc2", 4096, 1024)]
fmt = FP8Tensor()
rows = []
for name, N, K in SHAPES:
    copies = max(1, int(256e6 // (N * K)))
    dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(copies)]
    raw = [fmt.quantize(w) for w in dense]
    qw = [QuantWeight(fmt, fmt.to_model(r, N), K) for r in raw]
    fp8 = [(r["weight"], r["weight_scale"].float().reshape(())) for r in raw]
    one = torch.ones((), device="cuda")
    for T in (1, 8, 16):
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        xq = x.to(torch.float8_e4m3fn)
        row = {"case": name, "N": N, "K": K, "tokens": T}
        if T <= 16:
            row["engine_us"] = cold_ms_per_call(lambda w: decode_linear(x, w), qw) * 1e3
        row["bf16_cublas_us"] = cold_ms_per_call(lambda w: F.linear(x, w), dense) * 1e3
        for fast in (False, True):
            try:
                f = lambda p, fast=fast: torch._scaled_mm(xq, p[0].t(), scale_a=one, scale_b=p[1], out_dtype=torch.bfloat16,
                                                         use_fast_accum=fast)
                row[f"scaled_mm{'_fast' if fast else ''}_us"] = cold_ms_per_call(f, fp8) * 1e3
                g = lambda p, fast=fast: torch._scaled_mm(x.to(torch.float8_e4m3fn), p[0].t(), scale_a=one, scale_b=p[1],
                                                         out_dtype=torch.bfloat16, use_fast_accum=fast)
                row[f"quant_x+scaled_mm{'_fast' if fast else ''}_us"] = cold_ms_per_call(g, fp8) * 1e3
            except Exception as e:
                row[f"scaled_mm{'_fast' if fast else ''}_err"] = f"{type(e).__name__}: {str(e)[:200]}"
        try:  # per-token x scales (rowwise): scale_a [T, 1], scale_b [1, N]
            sa = (x.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
            xr = (x.float() / sa).to(torch.float8_e4m3fn)
            rw = [(p[0], p[1].expand(1, N).contiguous()) for p in fp8]
            h = lambda p: torch._scaled_mm(xr, p[0].t(), scale_a=sa, scale_b=p[1], out_dtype=torch.bfloat16)
            row["rowwise_scaled_mm_us"] = cold_ms_per_call(h, rw) * 1e3
            ref = F.linear(x.float(), (fp8[0][0].float() * fp8[0][1]))
            row["rowwise_err"] = (h(rw[0]).float() - ref).abs().max().item()
            row["engine_err"] = (decode_linear(x, qw[0]).float() - ref).abs().max().item()
            row["pertensor_err"] = (torch._scaled_mm(xq, fp8[0][0].t(), scale_a=one, scale_b=fp8[0][1], out_dtype=torch.bfloat16).float() - ref).abs().max().item()
        except Exception as e:
            row["rowwise_err_msg"] = f"{type(e).__name__}: {str(e)[:200]}"
        mb = N * K / 1e6
        print(name, T, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k not in ("case", "N", "K", "tokens")},
              f"({mb:.1f} MB fp8)", flush=True)
        rows.append(row)
json.dump({"kind": "fp8_scaled_mm_vs_engine", "hardware": torch.cuda.get_device_name(), "rows": rows},
          open(sys.argv[1], "w"), indent=1)
