"""Launch-configuration sweep of the decode MoE kernels on the 35B expert shape (H200 tuning input).

Times, from CUDA graphs, the two weight-reading launches of ``moe_gemv`` for each (BLOCK_N,
BLOCK_K, num_warps, num_stages) of a per-kernel grid:

- ``swiglu_routed_shared``: ``swiglu_gemv_with_shared``, T tokens x top-8 of 256 routed experts
  plus the shared expert's T rows in one launch;
- ``down_combine_shared``: ``down_combine`` of the top-8 experts' down projections (the experts
  loaded as one [top_k, BLOCK_N, BLOCK_K] tile per K step) plus the shared expert's, gated;
- ``down_pairs``: ``down_combine`` without a shared expert (past ``MAX_FUSED_TOP_K`` experts a token:
  the pair-wise GEMV's tile, then the combine);
- ``relu2_up``: ``relu2_gemv``, the ungated up projection of Nemotron-H's experts (T x top-k pairs).

Other expert shapes take ``--experts / --hidden / --inter / --top-k`` (Nemotron-3-Super's latent
experts: 512 x [2688, 1024], top 22, ``--hidden 1024 --inter 2688``).

Weights are cold as in a decode iteration, where every layer reads its own experts: each timed
graph runs the launch over ``--layers`` sets of weights in turn (the same routing) and the time is
per launch. Prints each case's best next to its default and the weight-read bandwidth (bytes of the
distinct experts hit plus the shared expert's).

    python benchmarks/tune_moe.py --out tune_moe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Callable

import torch

# Per-kernel grids of (BLOCK_N, BLOCK_K, num_warps, num_stages). down_combine holds top_k x BLOCK_N x
# BLOCK_K weights in registers, so its tiles stay smaller than the SwiGLU GEMV's.
GRIDS = {
    "swiglu_routed_shared": list(itertools.product((8, 16, 32), (128, 256), (4, 8), (2, 3, 4))),
    "down_combine_shared": list(itertools.product((2, 4, 8, 16), (64, 128, 256, 512), (4, 8), (2, 3))),
    "relu2_up": list(itertools.product((8, 16, 32), (128, 256), (4, 8), (2, 3, 4))),
    "down_pairs": list(itertools.product((8, 16, 32), (128, 256), (4, 8), (2, 3, 4))),
}
# quantized experts (--quantize): fewer stages / warps, K steps the format allows (FP8: within a
# 128-input scale block); the pair-wise kernels also with their FMA candidate (FMA=True: the sum over K
# once after the loop) and NVFP4's f16x2 form (HFMA)
HFMA_GRID = list(itertools.product((4, 8, 16), (256, 512, 1024), (1, 2, 4), (1,), ("hfma",)))  # NVFP4's f16x2 form
QUANT_GRIDS = {
    "nvfp4": {"swiglu_routed_shared": list(itertools.product((8, 16), (128, 256, 512), (4, 8), (3,), (False, True)))
              + HFMA_GRID,
              "down_combine_shared": list(itertools.product((2, 4, 8, 16), (64, 128, 256), (4, 8), (2,))) + HFMA_GRID,
              "relu2_up": list(itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (3,), (False, True))) + HFMA_GRID,
              "down_pairs": list(itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (3,), (False, True)))
              + HFMA_GRID},
    "fp8": {"swiglu_routed_shared": list(itertools.product((8, 16, 32), (64, 128), (4, 8), (3,), (False, True))),
            "down_combine_shared": list(itertools.product((4, 8, 16), (64, 128), (4, 8), (2,))),
            "relu2_up": list(itertools.product((8, 16, 32), (64, 128), (4, 8), (3,), (False, True))),
            "down_pairs": list(itertools.product((8, 16, 32), (64, 128), (4, 8), (3,), (False, True)))},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,7", help="comma-separated token counts (T)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512, help="routed experts' intermediate size")
    ap.add_argument("--shared-inter", type=int, default=512, help="shared expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=0,
                    help="weight sets cycled through per timing (cold weights); 0: enough that a token's experts over "
                         "all of them are 3x L2")
    ap.add_argument("--cases", default=",".join(GRIDS), help="comma-separated cases of GRIDS to sweep")
    ap.add_argument("--quantize", choices=sorted(QUANT_GRIDS), default=None,
                    help="the experts (routed and shared) in this format, its grid (QUANT_GRIDS)")
    ap.add_argument("--forms", choices=("all", "hfma"), default="all",
                    help="hfma: only NVFP4's f16x2 form's tiles (with --quantize nvfp4)")
    ap.add_argument("--out", required=True, help="JSON file for every configuration's timing")
    return ap.parse_args(argv)


def sweep(name: str, fn: Callable[..., torch.Tensor], layers: int, nbytes: int, T: int, grid: list) -> dict:
    """Times ``fn(layer, **cfg)`` per launch, over every layer's weights in one graph, for every
    configuration of ``grid`` and for the defaults."""
    from wmtp.bench.timing import cold_ms_per_call

    def per_launch(**cfg) -> float:
        return cold_ms_per_call(lambda layer: fn(layer, **cfg), range(layers))

    results = []
    for bn, bk, nw, ns, *form in grid:
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns,
               "HFMA": form == ["hfma"], **({"FMA": form[0]} if form and form != ["hfma"] else {})}
        try:
            results.append({**cfg, "ms": per_launch(**cfg)})
        except Exception as e:  # resources exceeded for this tile: not a candidate
            results.append({**cfg, "error": type(e).__name__})
    default = per_launch()
    best = min((r for r in results if "ms" in r), key=lambda r: r["ms"])
    # beside the f16x2 form's tiles, the fp32 forms' default in the same run
    fp32 = per_launch(HFMA=False) if any(r["HFMA"] for r in results) else None
    print(f"{name} T={T}: default {default * 1e3:.1f} us ({nbytes / default / 1e9:.2f} TB/s) | best "
          f"{best['ms'] * 1e3:.1f} us ({nbytes / best['ms'] / 1e9:.2f} TB/s) at {best}"
          + (f" | fp32 forms' default {fp32 * 1e3:.1f} us" if fp32 else ""), flush=True)
    return {"case": name, "tokens": T, "weight_bytes": nbytes, "default_ms": default, "best": best,
            "fp32_default_ms": fp32, "all": results}


def main() -> None:
    a = parse_args()
    from wmtp.bench.step import revision
    from wmtp.kernels.moe import MAX_FUSED_TOP_K, down_combine, relu2_gemv, route_topk, swiglu_gemv_with_shared

    dev, dt, E, H, I, Is, k = "cuda", torch.bfloat16, a.experts, a.hidden, a.inter, a.shared_inter, a.top_k
    cases = set(a.cases.split(","))
    if cases - set(GRIDS):
        raise SystemExit(f"tune_moe: unknown --cases {sorted(cases - set(GRIDS))}; known: {list(GRIDS)}")

    from wmtp.quant import FORMATS, QuantWeight

    fmt = FORMATS[a.quantize]() if a.quantize else None
    grids = QUANT_GRIDS[a.quantize] if a.quantize else GRIDS
    if a.forms == "hfma":
        if a.quantize != "nvfp4":
            raise SystemExit("tune_moe: --forms hfma needs --quantize nvfp4")
        grids = {c: [g for g in grid if g[4:] == ("hfma",)] for c, grid in grids.items()}

    def randn(*shape: int) -> torch.Tensor | QuantWeight:
        if fmt is None:
            return torch.randn(*shape, device=dev, dtype=dt) * shape[-1] ** -0.5
        # experts quantized 16 at a time: the quantizer's fp32 temporaries of all 512 of Nemotron-3-Super's
        # at once outgrow an H100
        lead, (n, kk) = shape[:-2], shape[-2:]
        chunks = [(min(16, lead[0] - e),) for e in range(0, lead[0], 16)] if lead else [()]
        parts = [fmt.to_model(fmt.quantize(torch.randn(*c, n, kk, device=dev, dtype=dt) * kk ** -0.5), n) for c in chunks]
        return QuantWeight(fmt, {s: torch.cat([p[s] for p in parts]) for s in parts[0]}, kk)

    def nbytes(n: int, kk: int) -> int:
        return n * kk * 2 if fmt is None else fmt.weight_bytes(n, kk)

    def rows(w, lo: int, hi: int):
        return w[:, lo:hi] if fmt is None else w.rows(slice(lo, hi))

    # a token's down projections (the fewest bytes a launch reads) over all weight sets at least 3x L2, so
    # every launch reads from HBM (with fewer sets the 122B's 8 experts of 1.8 MB stayed in L2); as many
    # as 60% of the free memory holds at most
    if not a.layers:
        touched = k * nbytes(H, I)
        per_layer = E * 3 * nbytes(I, H) + 3 * nbytes(Is, H)
        a.layers = max(2, -(-3 * torch.cuda.get_device_properties(dev).L2_cache_size // touched))
        fits = int(0.6 * torch.cuda.mem_get_info()[0] // per_layer)
        if fits < a.layers:
            print(f"tune_moe: {fits} weight sets fit, not the {a.layers} that read a token's experts from HBM; "
                  "small launches may read some weights from L2", flush=True)
            a.layers = max(1, fits)
    # per layer: routed gate/up [E, 2I, H], down [E, H, I]; shared gate, up [Is, H], down [H, Is]
    weights = [(randn(E, 2 * I, H), randn(E, H, I), randn(Is, H), randn(Is, H), randn(H, Is)) for _ in range(a.layers)]
    out = []
    for T in map(int, a.tokens.split(",")):
        x = torch.randn(T, H, device=dev, dtype=dt)
        w, i, _ = route_topk(torch.randn(T, E, device=dev), k, True)
        idx = i.view(-1)

        def swiglu(layer: int, **c) -> tuple[torch.Tensor, torch.Tensor]:
            gate_up, _, sg, su, _ = weights[layer]
            return swiglu_gemv_with_shared(x, rows(gate_up, 0, I), rows(gate_up, I, 2 * I), idx, k, sg, su, **c)

        hs = [swiglu(layer) for layer in range(a.layers)]
        gate_s = torch.randn(T, device=dev)

        def combine(layer: int, **c) -> torch.Tensor:
            h, h_shared = hs[layer]
            return down_combine(h, weights[layer][1], i, w, k, shared=(h_shared, weights[layer][4], gate_s), **c)

        def relu2(layer: int, **c) -> torch.Tensor:
            return relu2_gemv(x, rows(weights[layer][0], 0, I), idx, k, **c)

        def pairs(layer: int, **c) -> torch.Tensor:
            return down_combine(hs[layer][0], weights[layer][1], i, w, k, **c)

        distinct = int(torch.unique(i).numel())
        if "swiglu_routed_shared" in cases:
            out.append(sweep("swiglu_routed_shared", swiglu, a.layers, 2 * (distinct * nbytes(I, H) + nbytes(Is, H)), T,
                             grids["swiglu_routed_shared"]))
        if "down_combine_shared" in cases:
            out.append(sweep("down_combine_shared", combine, a.layers, distinct * nbytes(H, I) + nbytes(H, Is), T,
                             grids["down_combine_shared"]))
        if "down_pairs" in cases:
            # within MAX_FUSED_TOP_K experts a token down_combine's fused kernel runs, which has no FMA form
            grid = grids["down_pairs"] if k > MAX_FUSED_TOP_K else [g[:4] for g in grids["down_pairs"] if not any(g[4:])]
            out.append(sweep("down_pairs", pairs, a.layers, distinct * nbytes(H, I), T, grid))
        if "relu2_up" in cases:
            out.append(sweep("relu2_up", relu2, a.layers, distinct * nbytes(I, H), T, grids["relu2_up"]))
    with open(a.out, "w") as f:
        json.dump({"commit": revision(),
                   "kind": "moe_tuning", "hardware": torch.cuda.get_device_name(), "layers": a.layers,
                   "quantize": a.quantize, "command": "python benchmarks/tune_moe.py " + " ".join(sys.argv[1:]),
                   "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
