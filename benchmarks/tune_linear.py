"""Skinny-linear timing on the 35B-A3B decode shapes (H200 tuning input for ``wmtp.kernels.linear``).

For each weight shape [N, K] (bf16) and token count M, times F.linear (cuBLAS) and ``skinny_linear``
at its default configuration and over a sweep of (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
num_stages), all from CUDA graphs, and prints each case's times, the weight-read bandwidth and the
F.linear / skinny_linear time ratio (> 1: the kernel is faster). BLOCK_M 16 in the sweep is the
tl.dot path for fewer rows; configurations the GPU cannot run are recorded with their error.

Each timed call reads a different copy of the weight, ``--rotate-mb`` of them in all, so weights
smaller than the L2 (50 MB) are read from HBM as in a decode step, not from the previous call's L2.

    python benchmarks/tune_linear.py --out tune_linear.json
    python benchmarks/tune_linear.py --shapes out_proj,router --tokens 7 --out part.json  # a slice

The full sweep (9 shapes x 2 token counts x ~100 configurations) takes several minutes; --shapes,
--tokens and the candidate lists cut it down.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from collections.abc import Callable

import torch

# out_features x in_features of the dense linears in a decode / verify step
SHAPES = {
    "gdn_in_proj_qkvz": (12288, 2048),
    "gdn_in_proj_ba": (64, 2048),
    "out_proj": (2048, 4096),  # GDN out_proj, attention o_proj and the MTP fc share it
    "q_proj_gated": (8192, 2048),
    "kv_proj": (512, 2048),
    "router": (256, 2048),
    "shared_gate_up": (1024, 2048),
    "shared_down": (2048, 512),
    "lm_head": (248320, 2048),
}


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names from {list(SHAPES)}")
    ap.add_argument("--tokens", default="1,7", help="M values (rows of x)")
    ap.add_argument("--block-m", default="0,16", help="BLOCK_M candidates (0 = next pow2 of M; 16 = tl.dot)")
    ap.add_argument("--block-n", default="4,8,16,64")
    ap.add_argument("--block-k", default="128,256,1024")
    ap.add_argument("--split-k", default="1,2,4")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--no-sweep", action="store_true", help="time F.linear and the default configuration only")
    ap.add_argument("--rotate-mb", type=int, default=128,
                    help="weight copies cycled per timing, in MB (0: one copy, L2-warm numbers)")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _configs(a: argparse.Namespace, M: int, K: int) -> list[dict[str, int]]:
    """The sweep for M rows: BLOCK_M from next_pow2(M) to 16 (tl.dot wants BLOCK_N, BLOCK_K >= 16),
    BLOCK_K no wider than K needs."""
    import triton

    bm_min = triton.next_power_of_2(M)
    out = []
    for bm, bn, bk, sk, nw, ns in itertools.product(*(_ints(v) for v in (a.block_m, a.block_n, a.block_k, a.split_k,
                                                                       a.warps, a.stages))):
        bm = bm or bm_min
        if bm < bm_min or (bm >= 16 and min(bn, bk) < 16) or bk > max(16, triton.next_power_of_2(K)):
            continue
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": nw, "num_stages": ns}
        if cfg not in out:
            out.append(cfg)
    return out


def _time_us(fn: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Median microseconds of one ``fn(w)``, replayed from a CUDA graph that calls it on every copy
    in ``weights`` in turn (run once first: compile, warm up)."""
    import triton.testing

    def run() -> None:
        for w in weights:
            fn(w)

    run()
    return triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3 / len(weights)


def _entry(us: float, nbytes: int, torch_us: float, **extra) -> dict:
    return {**extra, "us": us, "GBps": nbytes / us / 1e3, "ratio_vs_torch": torch_us / us}


def main() -> None:
    a = _args()
    import torch.nn.functional as F
    import triton

    from wmtp.kernels.linear import default_launch, skinny_linear

    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = torch.randn(N, K, device=dev, dtype=dt) * K**-0.5
        nbytes = w.numel() * w.element_size()
        ws = [w] + [w.clone() for _ in range(-(-(a.rotate_mb << 20) // nbytes) - 1)]
        for M in _ints(a.tokens):
            x = torch.randn(M, K, device=dev, dtype=dt)
            err = (skinny_linear(x, w).float() - F.linear(x, w).float()).abs().max().item()
            torch_us = _time_us(lambda v: F.linear(x, v), ws)
            cfg = default_launch(triton.next_power_of_2(M), N, K, w.element_size(), sms)
            default = _entry(_time_us(lambda v: skinny_linear(x, v), ws), nbytes, torch_us, **cfg)
            results = []
            for c in [] if a.no_sweep else _configs(a, M, K):
                try:
                    results.append(_entry(_time_us(lambda v: skinny_linear(x, v, **c), ws), nbytes, torch_us, **c))
                except Exception as e:  # out of registers / shared memory for this tile: not a candidate
                    results.append({**c, "error": type(e).__name__})
            best = min((r for r in results if "us" in r), key=lambda r: r["us"], default=default)
            rows.append({"shape": name, "N": N, "K": K, "tokens": M, "weight_bytes": nbytes, "max_abs_err": err,
                         "torch": {"us": torch_us, "GBps": nbytes / torch_us / 1e3}, "default": default, "best": best,
                         "weight_copies": len(ws), "all": results})
            print(f"{name} [{N}x{K}] M={M}: F.linear {torch_us:.1f} us ({nbytes / torch_us / 1e3:.0f} GB/s) | default "
                  f"{default['us']:.1f} us ({default['GBps']:.0f} GB/s, x{default['ratio_vs_torch']:.2f}) | best "
                  f"{best['us']:.1f} us ({best['GBps']:.0f} GB/s, x{best['ratio_vs_torch']:.2f}) at "
                  f"{ {k: best[k] for k in cfg} } | err {err:.2e}", flush=True)
    meta = {"hardware": torch.cuda.get_device_name(), "sms": sms, "dtype": "bfloat16",
            "timing": "triton.testing.do_bench_cudagraph (median) over --rotate-mb of weight copies"}
    with open(a.out, "w") as f:
        json.dump({"kind": "linear_tuning", "command": "python " + shlex.join(sys.argv), "meta": meta, "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
