"""Launch-configuration sweep of the decode MoE kernels on the 35B expert shape (H200 tuning input).

Times ``swiglu_gemv`` (routed: T tokens x top-8 of 256 experts; shared: one expert) and
``down_combine`` from CUDA graphs for each (BLOCK_N, BLOCK_K, num_warps, num_stages), and prints
each case's best next to its default and the weight-read bandwidth.

    python benchmarks/tune_moe.py --out tune_moe.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main() -> None:
    import triton.testing

    from wmtp.kernels.moe import down_combine, route_topk, swiglu_gemv

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,7")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev, dt, E, H, I, k = "cuda", torch.bfloat16, a.experts, a.hidden, a.inter, a.top_k
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H**-0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt) * I**-0.5
    sg, su = (torch.randn(1, I, H, device=dev, dtype=dt) for _ in range(2))
    rows = []
    for T in map(int, a.tokens.split(",")):
        x = torch.randn(T, H, device=dev, dtype=dt)
        w, i, _ = route_topk(torch.randn(T, E, device=dev), k, True)
        h = swiglu_gemv(x, gate_up[:, :I], gate_up[:, I:], i.view(-1), k)
        distinct = int(torch.unique(i).numel())
        cases = {
            "routed_swiglu": (lambda **c: swiglu_gemv(x, gate_up[:, :I], gate_up[:, I:], i.view(-1), k, **c),
                              distinct * 2 * I * H * 2),
            "shared_swiglu": (lambda **c: swiglu_gemv(x, sg, su, None, **c), 2 * I * H * 2),
            "down_combine": (lambda **c: down_combine(h, down, i, w, k, **c), distinct * H * I * 2),
        }
        for name, (fn, nbytes) in cases.items():
            results = []
            for bn, bk, nw, ns in itertools.product((8, 16, 32), (128, 256), (4, 8), (2, 3, 4)):
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
                try:
                    fn(**cfg)
                    results.append({**cfg, "ms": triton.testing.do_bench_cudagraph(lambda: fn(**cfg))})
                except Exception as e:  # resources exceeded for this tile: not a candidate
                    results.append({**cfg, "error": type(e).__name__})
            fn()
            default = triton.testing.do_bench_cudagraph(fn)
            best = min((r for r in results if "ms" in r), key=lambda r: r["ms"])
            rows.append({"case": name, "tokens": T, "weight_bytes": nbytes, "default_ms": default, "best": best,
                         "all": results})
            print(f"{name} T={T}: default {default * 1e3:.1f} us ({nbytes / default / 1e9:.2f} TB/s) | best "
                  f"{best['ms'] * 1e3:.1f} us ({nbytes / best['ms'] / 1e9:.2f} TB/s) at {best}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"kind": "moe_tuning", "hardware": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
