"""Prefill attention against torch SDPA, side by side in one run (H200 input for the prefill target:
the paged prefill kernel at >= 0.85x SDPA's causal rate at the same head shape).

For each context S: the paged kernel (``paged_attention``, prefill tiles) over one chunk of C queries
at the end of S keys held in pages (``--table random``: a serving pool's order; ``contiguous``),
FlashAttention-4 over the same pages where it is installed (``flash_prefill``: what the engine
runs then), and
SDPA per backend (cuDNN, flash, memory-efficient) over contiguous K / V on two problems that make up
such a chunk: the square causal C x C block (``is_causal``; top-left and bottom-right alignment agree
when square) and the C queries against the S - C earlier keys without a mask. SDPA gets K / V
expanded to the query heads (the same FLOPs; GQA support differs by backend), so it is timed on a
problem at least as easy. FLOPs count 4 H D per (query, key) pair attended, causal pairs only.

    python benchmarks/prefill_attention.py --contexts 131072,1040000 --chunk 16384 --out prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="131072,1040000", help="comma-separated S (keys at the chunk's end)")
    ap.add_argument("--chunk", type=int, default=16384, help="C: queries of one prefill chunk")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--table", default="random", choices=("random", "contiguous"))
    ap.add_argument("--backends", default="cudnn,flash,efficient", help="SDPA backends to time (those that run)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def sdpa_ms(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float | str:
    """SDPA's time on [1, H, *, D] tensors with only ``backend`` enabled, or the error's name."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    try:
        with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
            fn()
            return triton.testing.do_bench(fn)
    except RuntimeError as e:  # this backend does not take the shape / dtype here
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main() -> None:
    a = parse_args()
    import triton.testing

    from wmtp.bench.step import hardware_name, revision
    from wmtp.kernels import flash_prefill
    from wmtp.kernels.paged_attention import AttentionMeta, paged_attention
    from wmtp.models.context import ForwardContext, PagedSlots

    dev, dt, H, KV, D, C, page = torch.device("cuda"), torch.bfloat16, a.heads, a.kv_heads, a.head_dim, a.chunk, a.page_size
    scale, rows = D**-0.5, []
    for S in map(int, a.contexts.split(",")):
        if S < C:
            raise SystemExit(f"prefill_attention: context {S} is shorter than the chunk {C}")
        n_pages = -(-S // page)
        k_pool = torch.randn(n_pages * page, KV, D, device=dev, dtype=dt)
        v_pool = torch.randn_like(k_pool)
        order = torch.randperm(n_pages, device=dev) if a.table == "random" else torch.arange(n_pages, device=dev)
        table = order[None].to(torch.int32)
        q = torch.randn(C, H, D, device=dev, dtype=dt)
        ctx = ForwardContext([S - C], [C], PagedSlots(table, page), device=dev)
        meta = AttentionMeta.from_context(ctx, dev)
        ours = triton.testing.do_bench(lambda: paged_attention(q, k_pool, v_pool, meta, scale))
        flops = 4 * H * D * (C * (S - C) + C * (C + 1) / 2)
        row = {"S": S, "chunk": C, "paged_ms": ours, "paged_tflops": flops / ours / 1e9, "sdpa": {}}
        if flash_prefill.applies(q, k_pool, ctx):
            fmeta = flash_prefill.FlashMeta.from_context(ctx, dev)
            fa = lambda: flash_prefill.flash_prefill(q, k_pool, v_pool, fmeta, scale)  # noqa: E731
            err = (fa().float() - paged_attention(q, k_pool, v_pool, meta, scale).float()).abs().max().item()
            row["flash_attn_4"] = {"ms": (ms := triton.testing.do_bench(fa)), "tflops": flops / ms / 1e9,
                                   "max_abs_diff_vs_paged": err}
        # the request's keys in position order, contiguous, expanded to the query heads: [1, H, S, D]
        slots = (order[:, None] * page + torch.arange(page, device=dev)).flatten()[:S]
        kc = k_pool[slots].repeat_interleave(H // KV, 1).transpose(0, 1).contiguous()[None]
        vc = v_pool[slots].repeat_interleave(H // KV, 1).transpose(0, 1).contiguous()[None]
        qc = q.transpose(0, 1).contiguous()[None]
        for b in a.backends.split(","):
            if b not in BACKENDS:
                raise SystemExit(f"prefill_attention: unknown backend {b!r}; known: {list(BACKENDS)}")
            square = sdpa_ms(b, qc, kc[:, :, S - C:], vc[:, :, S - C:], causal=True)
            prefix = sdpa_ms(b, qc, kc[:, :, :S - C], vc[:, :, :S - C], causal=False) if S > C else 0.0
            r = {"causal_square_ms": square, "prefix_ms": prefix}
            if isinstance(square, float):
                r["causal_square_tflops"] = 4 * H * D * C * (C + 1) / 2 / square / 1e9
            if isinstance(prefix, float) and S > C:
                r["prefix_tflops"] = 4 * H * D * C * (S - C) / prefix / 1e9
            if isinstance(square, float) and isinstance(prefix, float):
                r["chunk_ms"] = square + prefix  # the chunk as SDPA's two calls (their merge not counted)
                r["paged_over_sdpa_speed"] = r["chunk_ms"] / ours
            row["sdpa"][b] = r
        rows.append(row)
        fa4 = row.get("flash_attn_4")
        print(f"S {S}: paged {ours:.2f} ms ({row['paged_tflops']:.0f} TFLOP/s) | "
              + (f"flash-attn-4 {fa4['ms']:.2f} ms ({fa4['tflops']:.0f}) | " if fa4 else "")
              + " | ".join(f"{b} {r.get('chunk_ms', float('nan')):.2f} ms (causal {r.get('causal_square_tflops', 0):.0f},"
                           f" prefix {r.get('prefix_tflops', 0):.0f} TFLOP/s)" for b, r in row["sdpa"].items()), flush=True)
        del k_pool, v_pool, kc, vc
        torch.cuda.empty_cache()
    meta = {"hardware": hardware_name("cuda"), "heads": H, "kv_heads": KV, "head_dim": D, "page_size": page,
            "table": a.table, "dtype": "bfloat16", "timing": "triton.testing.do_bench",
            "flash_attn_4": flash_prefill.library_version(dev),
            "command": "python benchmarks/prefill_attention.py " + " ".join(sys.argv[1:])}
    with open(a.out, "w") as f:
        json.dump({"commit": revision(), "kind": "prefill_attention", "meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
