"""The prefill MoE's expert GEMMs over quantized experts, side by side on one GPU: dequantize every
expert (``quant_tiles.dequantize``) then ``F.grouped_mm`` (the engine's default) against
``grouped.grouped_quant_mm`` (the packed experts read inside the GEMM, ``WMTP_FUSED_QUANT_MOE=1``)
at each tile of a grid, for a prefill chunk of T tokens routed top-k over E experts (the 35B's
gate_up [256, 1024, 2048] and down [256, 2048, 512] by default). Prints each one's time and TFLOP/s
and the largest difference from the default path's output.

    python benchmarks/tune_grouped.py --quantize nvfp4 --tokens 8192,16384 --out tune_grouped.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

# (block_m, block_n, block_k, num_warps): tiles that compile for sm_90 without spills (tests/hopper_compile.py)
GRID = [(64, 128, 128, 8), (64, 64, 128, 4), (64, 128, 64, 4), (128, 128, 64, 8), (128, 128, 128, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantize", choices=("nvfp4", "fp8"), default="nvfp4")
    ap.add_argument("--tokens", default="8192,16384", help="comma-separated prefill chunk sizes")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import triton.testing

    from wmtp.bench.step import revision
    from wmtp.kernels.grouped import grouped_quant_mm
    from wmtp.kernels.quant_tiles import dequantize
    from wmtp.quant import FORMATS, QuantWeight

    fmt, E, k = FORMATS[a.quantize](), a.experts, a.top_k
    rows = []
    for name, N, K in (("gate_up", 2 * a.inter, a.hidden), ("down", a.hidden, a.inter)):
        dense = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        parts = [fmt.to_model(fmt.quantize(dense[e]), N) for e in range(E)]
        w = QuantWeight(fmt, {s: torch.stack([p[s] for p in parts]) for s in fmt.suffixes}, K)
        del dense, parts
        for T in map(int, a.tokens.split(",")):
            M = T * k
            counts = torch.bincount(torch.randint(0, E, (M,), device="cuda"), minlength=E)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            flop = 2 * M * N * K

            def default() -> torch.Tensor:
                return F.grouped_mm(x, dequantize(w, x.dtype).transpose(1, 2), offs=offs)

            ref = default()
            base = triton.testing.do_bench(default)
            row = {"case": name, "tokens": T, "N": N, "K": K, "default_ms": base, "tiles": []}
            print(f"{name} T={T}: dequantize + F.grouped_mm {base:.3f} ms ({flop / base / 1e9:.0f} TFLOP/s)", flush=True)
            for bm, bn, bk, nw in GRID:
                if a.quantize == "fp8" and bk > 128:
                    continue
                try:
                    got = grouped_quant_mm(x, w, offs, bm, bn, bk, nw)
                    ms = triton.testing.do_bench(lambda: grouped_quant_mm(x, w, offs, bm, bn, bk, nw))
                except Exception as e:  # resources exceeded for this tile
                    row["tiles"].append({"tiles": [bm, bn, bk, nw], "error": type(e).__name__})
                    continue
                err = (got.float() - ref.float()).abs().max().item()
                row["tiles"].append({"tiles": [bm, bn, bk, nw], "ms": ms, "max_abs_err": err})
                print(f"  grouped_quant_mm {bm}x{bn}x{bk}, {nw} warps: {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s, "
                      f"{base / ms:.2f}x), max |diff| {err:.3g}", flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"commit": revision(), "kind": "grouped_tuning", "hardware": torch.cuda.get_device_name(),
                   "quantize": a.quantize, "command": "python benchmarks/tune_grouped.py " + " ".join(sys.argv[1:]),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
