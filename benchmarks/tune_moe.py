"""Launch-configuration sweep of the decode MoE kernels on the 35B expert shape (H200 tuning input).

Times, from CUDA graphs, the launches of ``moe_gemv`` for each configuration of a per-kernel grid:

- ``swiglu_routed_shared``: ``swiglu_gemv_with_shared``, T tokens x top-8 of 256 routed experts
  plus the shared expert's T rows in one launch;
- ``down_combine_shared``: ``down_combine`` of the top-8 experts' down projections (the experts
  loaded as one [top_k, BLOCK_N, BLOCK_K] tile per K step) plus the shared expert's, gated;
- ``router_topk``: the router GEMM with the routing in its last program, on cold router weights,
  against the router GEMM (``decode_linear``) followed by ``route_topk`` (two launches).

Prints each case's best next to its default and the weight-read bandwidth (bytes of the distinct
experts hit plus the shared expert's).

    python benchmarks/tune_moe.py --out tune_moe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Callable

import torch

# Per-kernel grids of launch overrides. down_combine holds top_k x BLOCK_N x BLOCK_K weights in
# registers, so its tiles stay smaller than the SwiGLU GEMV's; router_topk's programs each take all
# experts over one K split.
GRIDS = {
    "swiglu_routed_shared": [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                             for bn, bk, nw, ns in itertools.product((8, 16, 32), (128, 256), (4, 8), (2, 3, 4))],
    "down_combine_shared": [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                            for bn, bk, nw, ns in itertools.product((4, 8, 16), (64, 128, 256), (4, 8), (2, 3, 4))],
    "router_topk": [dict(BLOCK_K=bk, splits=sp, num_warps=nw)
                    for bk, sp, nw in itertools.product((32, 64, 128, 256), (4, 8, 16, 32), (4, 8))],
}
ROUTER_COPIES = 64  # router weights cycled through per timing (64 MiB: more than L2, as in a forward)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,7", help="comma-separated token counts (T)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512, help="routed experts' intermediate size")
    ap.add_argument("--shared-inter", type=int, default=512, help="shared expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--cases", default=",".join(GRIDS), help="comma-separated kernels to sweep (default: all)")
    ap.add_argument("--out", required=True, help="JSON file for every configuration's timing")
    return ap.parse_args(argv)


def sweep(name: str, fn: Callable[..., object], nbytes: int, T: int, calls: int = 1,
          baseline: Callable[[], object] | None = None) -> dict:
    """Times ``fn(**cfg)`` for every configuration of ``GRIDS[name]``, ``fn()`` (the defaults) and
    ``baseline()`` if given, each per call when one ``fn`` makes ``calls`` of them."""
    import triton.testing

    def bench(f: Callable[[], object]) -> float:
        f()
        return triton.testing.do_bench_cudagraph(f) / calls

    results = []
    for cfg in GRIDS[name]:
        try:
            results.append({**cfg, "ms": bench(lambda: fn(**cfg))})
        except Exception as e:  # resources exceeded for this tile: not a candidate
            results.append({**cfg, "error": type(e).__name__})
    default = bench(fn)
    base = None if baseline is None else bench(baseline)
    best = min((r for r in results if "ms" in r), key=lambda r: r["ms"])
    print(f"{name} T={T}: default {default * 1e3:.1f} us ({nbytes / default / 1e9:.2f} TB/s) | best "
          f"{best['ms'] * 1e3:.1f} us ({nbytes / best['ms'] / 1e9:.2f} TB/s) at {best}"
          + ("" if base is None else f" | baseline {base * 1e3:.1f} us"), flush=True)
    return {"case": name, "tokens": T, "weight_bytes": nbytes, "default_ms": default, "baseline_ms": base,
            "best": best, "all": results}


def main() -> None:
    a = parse_args()
    from wmtp.kernels.linear import decode_linear
    from wmtp.kernels.moe import down_combine, route_topk, router_topk, swiglu_gemv_with_shared

    dev, dt, E, H, I, Is, k = "cuda", torch.bfloat16, a.experts, a.hidden, a.inter, a.shared_inter, a.top_k
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    sg, su = (torch.randn(Is, H, device=dev, dtype=dt) * H**-0.5 for _ in range(2))
    sdown = torch.randn(H, Is, device=dev, dtype=dt) * Is**-0.5
    routers = [torch.randn(E, H, device=dev, dtype=dt) * H**-0.5 for _ in range(ROUTER_COPIES)]
    sgate = torch.randn(1, H, device=dev, dtype=dt) * H**-0.5
    rows = []
    for T in map(int, a.tokens.split(",")):
        x = torch.randn(T, H, device=dev, dtype=dt)
        w, i, _ = route_topk(torch.randn(T, E, device=dev), k, True)
        h, hs = swiglu_gemv_with_shared(x, gate_up[:, :I], gate_up[:, I:], i.view(-1), k, sg, su)
        shared = (hs, sdown, torch.randn(T, device=dev))
        distinct = int(torch.unique(i).numel())
        cases = a.cases.split(",")
        if "swiglu_routed_shared" in cases:
            rows.append(sweep("swiglu_routed_shared", lambda **c: swiglu_gemv_with_shared(
                x, gate_up[:, :I], gate_up[:, I:], i.view(-1), k, sg, su, **c), (distinct * I + Is) * 2 * H * 2, T))
        if "down_combine_shared" in cases:
            rows.append(sweep("down_combine_shared", lambda **c: down_combine(h, down, i, w, k, shared=shared, **c),
                              (distinct * I + Is) * H * 2, T))
        if "router_topk" in cases:  # baseline: the router GEMM (decode_linear), then route_topk, two launches
            rows.append(sweep("router_topk", lambda **c: [router_topk(x, r, k, True, sgate, **c) for r in routers],
                              E * H * 2, T, ROUTER_COPIES,
                              lambda: [route_topk(decode_linear(x, r), k, True, x, sgate) for r in routers]))
    with open(a.out, "w") as f:
        json.dump({"kind": "moe_tuning", "hardware": torch.cuda.get_device_name(),
                   "command": "python benchmarks/tune_moe.py " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
