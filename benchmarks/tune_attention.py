"""Launch-configuration sweep of the paged attention kernel at long context (H200 tuning input).

For each q_len (decode 1, verify 2..9) times the kernel from a CUDA graph over S keys for every
(BLOCK_N, num_warps, num_stages) and prints the best, its KV read bandwidth and the default's
time. The verify at q_len 5..8 runs ~2x the decode time at the default (0.96 vs 0.50 ms at 1.04M):
this says which configuration to take.

    python benchmarks/tune_attention.py --context 1040000 --out tune_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main() -> None:
    import triton.testing

    from wmtp.bench.step import revision
    from wmtp.kernels.paged_attention import AttentionMeta, paged_attention
    from wmtp.models.context import ForwardContext, PagedSlots

    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1_040_000)
    ap.add_argument("--q-lens", default="1,2,4,5,7,8,9")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pool-layers", type=int, default=1,
                    help="allocate an engine-like pool [layers, 2, slots, kv_heads, D] and time its middle layer")
    ap.add_argument("--table", default="random", choices=("random", "contiguous"))
    ap.add_argument("--rows", default="64", help="max_rows candidates (query rows x GQA group per tile)")
    ap.add_argument("--block-n", default="16,32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--splits", default="0", help="num_splits candidates (0 = the kernel's choice)")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "fp8_e4m3"), help="the pool's K / V")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    S, page, D = a.context, a.page_size, a.head_dim
    n_pages = -(-S // page)
    pool = torch.randn(a.pool_layers, 2, n_pages * page, a.kv_heads, D, device=dev, dtype=dt)
    if a.kv_dtype == "fp8_e4m3":
        pool = pool.to(torch.float8_e4m3fn)
    k_cache, v_cache = pool[a.pool_layers // 2, 0], pool[a.pool_layers // 2, 1]
    order = torch.randperm(n_pages, device=dev) if a.table == "random" else torch.arange(n_pages, device=dev)
    table = order[None].to(torch.int32)
    kv_bytes = 2 * S * a.kv_heads * D * k_cache.element_size()
    rows = []
    for q_len in map(int, a.q_lens.split(",")):
        q = torch.randn(q_len, a.heads, D, device=dev, dtype=dt)
        meta = AttentionMeta.from_context(ForwardContext([S - q_len], [q_len], PagedSlots(table, page), device=dev), dev)

        def run(**cfg):
            fn = lambda: paged_attention(q, k_cache, v_cache, meta, D**-0.5, **cfg)  # noqa: E731
            fn()
            return triton.testing.do_bench_cudagraph(fn)

        default = run()
        results = []
        grid = [[int(x) for x in v.split(",")] for v in (a.rows, a.block_n, a.warps, a.stages, a.splits)]
        for mr, bn, nw, ns, sp in itertools.product(*grid):
            cfg = {"max_rows": mr, "block_n": bn, "num_warps": nw, "num_stages": ns, "num_splits": sp or None}
            try:
                results.append({**cfg, "ms": run(**cfg)})
            except Exception as e:  # out of shared memory / registers for this tile: not a candidate
                results.append({**cfg, "error": type(e).__name__})
        best = min((r for r in results if "ms" in r), key=lambda r: r["ms"])
        rows.append({"q_len": q_len, "default_ms": default, "best": best, "all": results})
        print(f"q_len {q_len}: default {default:.3f} ms ({kv_bytes / default / 1e9:.2f} TB/s) | best {best['ms']:.3f} ms "
              f"({kv_bytes / best['ms'] / 1e9:.2f} TB/s) at rows={best['max_rows']} block_n={best['block_n']} warps={best['num_warps']} "
              f"stages={best['num_stages']} splits={best['num_splits'] or 'auto'}", flush=True)
    meta = {"hardware": torch.cuda.get_device_name(), "S": S, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": D,
            "page_size": page, "pool_layers": a.pool_layers, "table": a.table, "dtype": "bfloat16", "kv_dtype": a.kv_dtype, "timing": "triton.testing.do_bench_cudagraph"}
    with open(a.out, "w") as f:
        json.dump({"commit": revision(),
                   "kind": "attention_tuning", "meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
