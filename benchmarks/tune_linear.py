"""The skinny linear kernel against cuBLAS (``F.linear``) on the 35B decode projections (H200 input).

For each projection shape and token count it times, from CUDA graphs with cold weights (each graph
runs the projection on ``--copies`` weight copies in turn, more bytes than L2 holds), ``F.linear``,
``decode_linear`` (what the engine runs: the kernel at ``linear_tiles``, or cuBLAS where that is None) and,
unless ``--no-sweep``, every configuration of a per-shape grid.
Prints each case's times and weight-read bandwidth.

    python benchmarks/tune_linear.py --out tune_linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

# (name, N, K, grid) of the qwen3.6-35b-a3b decode projections (out features, in features) with the
# (block_n, block_k, splits, num_warps, num_stages) swept for each: split-K for the 4096-deep ones
GRID_DEEP = list(itertools.product((32, 64), (128, 256), (4, 8), (4, 8), (2, 3, 4)))
GRID_WIDE = list(itertools.product((16, 32, 64), (128, 256), (1, 2), (4, 8), (3, 4)))
SHAPES = [("o_proj / out_proj / mtp fc", 2048, 4096, GRID_DEEP),
          ("router", 256, 2048, list(itertools.product((16, 32), (128, 256), (4, 8), (4,), (3,)))),
          ("attention qkv", 9216, 2048, GRID_WIDE), ("gdn in_proj", 12352, 2048, GRID_WIDE)]


# quantized weights (--quantize): (block_n, block_k, splits, num_warps, num_stages), K steps the
# format allows (FP8: within a 128-input scale block)
# and, at one row, the FMA candidate (LinearTiles.gemv) over narrower blocks. NVFP4's tensor-core form
# (the weight the dot's first operand) at one or two stages: three took 1.1-1.6x as long at K steps of 256
QUANT_GRIDS = {"nvfp4": list(itertools.product((64, 128), (128, 256), (2, 4, 8), (4, 8), (1, 2), (False,)))
               + list(itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8), (4, 8), (3,), (True,))),
               "fp8": list(itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4, 8), (3,), (False,)))
               + list(itertools.product((8, 16, 32), (64, 128), (2, 4, 8), (4, 8), (3,), (True,)))}
QUANT_SHAPES = SHAPES[:1] + SHAPES[2:] + [("shared expert gate / up", 512, 2048, None),
                                          ("shared expert down", 2048, 512, None)]


def quant_grid(quantize: str, stages: str) -> list[tuple]:
    """``QUANT_GRIDS[quantize]``, each tile at every stage count in ``stages`` (comma-separated) if given."""
    grid = QUANT_GRIDS[quantize]
    if not stages:
        return grid
    if not all(s.isdigit() and int(s) > 0 for s in stages.split(",")):
        raise SystemExit(f"tune_linear: --stages {stages!r} must be positive integers, comma-separated")
    counts = sorted({int(s) for s in stages.split(",")})
    return sorted({(*g[:4], s, g[5]) for g in grid for s in counts})


def parse_shape(spec: str) -> tuple[str, int, int, list]:
    """``NAME=NxK`` -> (name, N, K, bf16 grid); a clear error for any other spelling."""
    name, _, nk = spec.rpartition("=")
    n, _, k = nk.partition("x")
    if not name or not n.isdigit() or not k.isdigit() or not int(n) or not int(k):
        raise SystemExit(f"tune_linear: --shape {spec!r} must be NAME=NxK with N, K positive integers")
    return name, int(n), int(k), GRID_DEEP if int(k) >= 4096 else GRID_WIDE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--copies-bytes", type=float, default=256e6, help="weight bytes cycled through per timing")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shapes", default="", help="comma-separated case names to run (default: all)")
    ap.add_argument("--quantize", choices=sorted(QUANT_GRIDS), default=None,
                    help="the weights in this format (its QUANT_GRIDS); cuBLAS then runs on the bf16 weights")
    ap.add_argument("--shape", action="append", default=[], metavar="NAME=NxK",
                    help="another model's projection (N outputs, K inputs) instead of the 35B's, repeatable: "
                         "swept over the format's grid (GRID_WIDE / GRID_DEEP by K in bf16)")
    ap.add_argument("--stages", default="", metavar="S,S",
                    help="with --quantize: software-pipeline stages to sweep instead of the grid's")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from wmtp.bench.step import revision
    from wmtp.bench.timing import cold_ms_per_call
    from wmtp.kernels.linear import LinearTiles, decode_linear, linear_tiles, quant_tiles, skinny_linear
    from wmtp.kernels.quant_tiles import kernel_weight
    from wmtp.quant import FORMATS, QuantWeight

    dt, rows = torch.bfloat16, []
    fmt = FORMATS[a.quantize]() if a.quantize else None
    shapes = [s for s in (QUANT_SHAPES if fmt else SHAPES) if not a.shapes or s[0] in a.shapes.split(",")]
    if a.shape:
        shapes = [parse_shape(s) for s in a.shape]
    for (name, N, K, grid), T in itertools.product(shapes, map(int, a.tokens.split(","))):
        nbytes = N * K * 2 if fmt is None else fmt.weight_bytes(N, K)
        copies = max(1, int(a.copies_bytes // nbytes))
        dense = [torch.randn(N, K, device="cuda", dtype=dt) * K**-0.5 for _ in range(copies)]
        ws = dense if fmt is None else [QuantWeight(fmt, fmt.to_model(fmt.quantize(w), N), K) for w in dense]
        grid = grid if fmt is None else quant_grid(a.quantize, a.stages)
        x = torch.randn(T, K, device="cuda", dtype=dt)

        def bench(fn, weights=ws) -> float:
            return cold_ms_per_call(fn, weights)

        cublas = bench(lambda w: F.linear(x, w), dense)
        chosen = linear_tiles(T, N, K) if fmt is None else quant_tiles(T, N, K, kernel_weight(name, ws[0]).format)
        chosen_ms = bench(lambda w: decode_linear(x, w))  # what the engine runs: the kernel, or cuBLAS where None
        ref = F.linear(x, ws[0] if fmt is None else ws[0].dequantize(dt))
        err = (skinny_linear(x, ws[0]).float() - ref.float()).abs().max().item()
        results = []
        for cfg in [] if a.no_sweep else grid:
            tiles = LinearTiles(*cfg)
            if tiles.gemv and T != 1:
                continue
            try:
                tile_err = (skinny_linear(x, ws[0], tiles=tiles).float() - ref.float()).abs().max().item()
                results.append({**tiles._asdict(), "ms": bench(lambda w: skinny_linear(x, w, tiles=tiles)),
                                "max_abs_err_vs_cublas": tile_err})
            except Exception as e:  # resources exceeded for this tile
                results.append({**tiles._asdict(), "error": type(e).__name__})
        best = min((r for r in results if "ms" in r), key=lambda r: r["ms"], default={"ms": chosen_ms})
        tb = nbytes / 1e9  # TB/s = weight bytes / 1e12 / (ms / 1e3)
        print(f"{name:28s} T={T}: cuBLAS (bf16) {cublas * 1e3:6.1f} us ({N * K * 2 / 1e9 / cublas:.2f} TB/s) | engine "
              f"{chosen} {chosen_ms * 1e3:6.1f} us ({tb / chosen_ms:.2f}) | best {best['ms'] * 1e3:6.1f} us "
              f"({tb / best['ms']:.2f}) {best} | max err {err:.3g}", flush=True)
        rows.append({"case": name, "N": N, "K": K, "tokens": T, "copies": copies, "cublas_ms": cublas,
                     "chosen_ms": chosen_ms, "chosen_tiles": None if chosen is None else chosen._asdict(), "best": best,
                     "max_abs_err_vs_cublas": err, "all": results})
    with open(a.out, "w") as f:
        json.dump({"commit": revision(),
                   "kind": "linear_tuning", "hardware": torch.cuda.get_device_name(), "quantize": a.quantize,
                   "command": "python benchmarks/tune_linear.py " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
