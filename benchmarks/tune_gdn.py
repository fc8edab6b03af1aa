"""Launch-configuration sweep of the GDN decode mixer (``gdn_decode``: conv + gated delta rule) on
the 35B GDN shape (16 k-heads, 32 v-heads of 128): per token count T (1 = dense decode, 8 = a
d = 7 verify, which also records every per-token state and the conv window), the time of each
(block_v, num_warps) from CUDA graphs, next to the state bytes' floor (read + write the state,
write the records).

    python benchmarks/tune_gdn.py --out tune_gdn.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import triton.testing

    from wmtp.bench.step import revision
    from wmtp.kernels.gdn import gdn_decode

    hk, hv, dk, dv, dev = 16, 32, 128, 128, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for T in (int(t) for t in a.tokens.split(",")):
        C = 2 * hk * dk + hv * dv
        x = torch.randn(T, C, device=dev, dtype=torch.bfloat16, generator=g)
        conv_w = torch.randn(C, 4, device=dev, dtype=torch.bfloat16, generator=g) * 0.5
        conv_state = torch.randn(4, C, 3, device=dev, dtype=torch.bfloat16, generator=g)
        ba = torch.randn(T, hk, 2 * hv // hk, device=dev, dtype=torch.bfloat16, generator=g)
        b, a_ = ba.split([hv // hk, hv // hk], dim=-1)
        A_log, dt_bias = torch.zeros(hv, device=dev), torch.ones(hv, device=dev)
        state = torch.randn(4, hv, dk, dv, device=dev, generator=g) * 0.01
        rec = (torch.empty(T, hv, dk, dv, device=dev), torch.empty(1, 3 + T, C, device=dev, dtype=torch.bfloat16))
        slots = torch.tensor([2], device=dev)
        off, qlen = (torch.tensor([x], device=dev, dtype=torch.int32) for x in (0, T))
        record = T > 1
        floor_bytes = 2 * hv * dk * dv * 4 + (T * hv * dk * dv * 4 if record else 0)
        for block_v, warps in itertools.product((8, 16, 32, 64), (1, 2, 4, 8)):
            def fn():
                gdn_decode(x, conv_w, conv_state, a_, b, A_log, dt_bias, state, slots, off, qlen,
                           T if record else None, rec if record else None, block_v=block_v, num_warps=warps)
            fn()
            us = triton.testing.do_bench_cudagraph(fn) * 1e3
            results.append({"T": T, "block_v": block_v, "num_warps": warps, "us": us, "floor_bytes": floor_bytes})
            print(f"T={T} block_v={block_v:2d} warps={warps} {us:7.2f} us", flush=True)
        best = min((r for r in results if r["T"] == T), key=lambda r: r["us"])
        print(f"T={T}: best {best}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"commit": revision(),
                   "command": "python benchmarks/tune_gdn.py --tokens " + a.tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
