"""Launch-configuration sweep of the Mamba2 decode mixer (``mamba2_decode``: conv + SSD) on the
Nemotron-3-Super Mamba2 shape (128 heads of 64, state 128, 8 groups): per token count T (1 = dense
decode; 8 = a d = 7 verify, which records each token's SSD inputs and the conv window and leaves the
state), the time of each (block_p, num_warps) from CUDA graphs, next to the state bytes it must
move (decode: read + write the fp32 state; verify: read it), and the rollback of that verify.

    python benchmarks/tune_mamba2.py --out tune_mamba2.json
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
    from wmtp.config import Mamba2Shape
    from wmtp.kernels.mamba2 import mamba2_decode, rollback_states
    from wmtp.kernels.torch_mamba2 import record_width

    m = Mamba2Shape(heads=128, head_dim=64, state=128, groups=8, conv_kernel=4, chunk=128,
                    dt_limit=(0.001, float("inf")), conv_bias=True)
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    C = m.conv_dim
    conv_w = torch.randn(C, 4, device=dev, dtype=bf, generator=g) * 0.5
    conv_b = torch.randn(C, device=dev, dtype=bf, generator=g) * 0.1
    dt_bias, A_log, D = (torch.randn(m.heads, device=dev, generator=g) * 0.5 for _ in range(3))
    conv_state = torch.randn(4, C, 3, device=dev, dtype=bf, generator=g)
    state = torch.randn(4, m.heads, m.head_dim, m.state, device=dev, generator=g) * 0.01
    slots = torch.tensor([2], device=dev)
    state_bytes = m.heads * m.head_dim * m.state * 4
    results = []
    for T in (int(t) for t in a.tokens.split(",")):
        xbc = torch.randn(T, C, device=dev, dtype=bf, generator=g)
        dt = torch.randn(T, m.heads, device=dev, dtype=bf, generator=g)
        off, qlen = (torch.tensor([v], device=dev, dtype=torch.int32) for v in (0, T))
        record = T > 1
        rec = (torch.empty(T, record_width(m.heads, m.head_dim, m.groups, m.state), device=dev),
               torch.empty(1, 3 + T, C, device=dev, dtype=bf))
        floor_bytes = state_bytes * (1 if record else 2)
        for block_p, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8)):
            def fn():
                mamba2_decode(xbc, dt, conv_w, conv_b, dt_bias, A_log, D, conv_state, state, slots, off, qlen, m,
                              T if record else None, rec if record else None, block_p=block_p, num_warps=warps)
            fn()
            us = triton.testing.do_bench_cudagraph(fn) * 1e3
            results.append({"T": T, "block_p": block_p, "num_warps": warps, "us": us, "floor_bytes": floor_bytes,
                            "tb_per_s": floor_bytes / us / 1e6})
            print(f"T={T} block_p={block_p:2d} warps={warps} {us:7.2f} us  {floor_bytes / us / 1e6:5.2f} TB/s", flush=True)
        best = min((r for r in results if r["T"] == T), key=lambda r: r["us"])
        print(f"T={T}: best {best}", flush=True)
        if record:  # the rollback of this verify, accepting all but the last token (one layer)
            acc = torch.tensor([T - 2], device=dev)
            us = triton.testing.do_bench_cudagraph(
                lambda: rollback_states(conv_state[None], state[None], rec[0][None], rec[1][None], slots, acc, T)) * 1e3
            results.append({"T": T, "rollback_us": us, "floor_bytes": 2 * state_bytes})
            print(f"T={T} rollback {us:7.2f} us  {2 * state_bytes / us / 1e6:5.2f} TB/s", flush=True)
    with open(a.out, "w") as f:
        json.dump({"commit": revision(),
                   "command": "python benchmarks/tune_mamba2.py --tokens " + a.tokens, "shape": "nemotron-3-super mamba2",
                   "hardware": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
