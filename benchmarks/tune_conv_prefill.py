"""The GDN prefill conv (``causal_conv1d_prefill``, kernel 4 + SiLU) against the torch twin on a 35B
prefill chunk (T x C = 8192 x 8192 bf16, rows strided as the packed in_proj's view): the time of
each (block_t, block_c, num_warps), next to the bytes' floor (read x, write y).

    python benchmarks/tune_conv_prefill.py --out tune_conv_prefill.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--channels", type=int, default=8192)
    ap.add_argument("--row-width", type=int, default=12352, help="the packed projection's row (x is a view)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import triton.testing

    from wmtp.bench.step import revision
    from wmtp.kernels.gdn import causal_conv1d_prefill
    from wmtp.kernels.torch_gdn import causal_conv1d

    T, C, dev, dt = a.tokens, a.channels, torch.device("cuda"), torch.bfloat16
    x = torch.randn(T, a.row_width, device=dev, dtype=dt)[:, :C]
    w = torch.randn(C, 4, device=dev, dtype=dt) * 0.5
    state = torch.randn(C, 3, device=dev, dtype=dt)
    floor_bytes = 2 * T * C * x.element_size()
    torch_ms = triton.testing.do_bench(lambda: causal_conv1d(x, w, state))
    want = causal_conv1d(x, w, state)[0]
    rows = []
    for bt, bc, nw in itertools.product((8, 16, 32, 64), (64, 128, 256), (2, 4, 8)):
        ms = triton.testing.do_bench(lambda: causal_conv1d_prefill(x, w, state, bt, bc, nw))
        err = (causal_conv1d_prefill(x, w, state, bt, bc, nw)[0].float() - want.float()).abs().max().item()
        rows.append({"block_t": bt, "block_c": bc, "num_warps": nw, "ms": ms, "max_abs_err": err})
    best = min(rows, key=lambda r: r["ms"])
    print(f"torch {torch_ms * 1e3:.0f} us | kernel best {best['ms'] * 1e3:.0f} us "
          f"({floor_bytes / best['ms'] / 1e9:.2f} TB/s) at {best}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"commit": revision(),
                   "kind": "conv_prefill_tuning", "hardware": torch.cuda.get_device_name(), "T": T, "C": C,
                   "torch_ms": torch_ms, "floor_bytes": floor_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
