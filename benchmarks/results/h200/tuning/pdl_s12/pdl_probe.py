"""Does programmatic dependent launch (PDL) shorten a CUDA graph of chained skinny GEMVs on this GPU?

A chain of L layers, each y = W_i x (8 token rows, bf16), alternating 2048->4096 and 4096->2048,
every layer its own weights (cold: the chain reads ~L x 16.8 MB, far over L2). Variants:
  base      : plain launches
  pdl       : launch_pdl=True, gdc_wait + gdc_launch_dependents at program start
  pdl_pref  : as pdl, and each program first prefetches its weight slice into L2 (before the wait)
Each captured in a CUDA graph; replay time (median of 50) vs bytes / read bandwidth.
"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv(X, W, Y, T, N, K, PDL: tl.constexpr, PREFETCH: tl.constexpr, T_P: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_LINES: tl.constexpr):
    nb = tl.program_id(0)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:
        lines = tl.arange(0, K_LINES) * 64
        ptrs = W + cols[:, None].to(tl.int64) * K + lines[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    ts = tl.arange(0, T_P)
    t_ok = ts < T
    acc = tl.zeros([T_P, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(X + ts[:, None] * K + ks[None, :], mask=t_ok[:, None], other=0.0)
        wv = tl.load(W + cols[:, None].to(tl.int64) * K + ks[None, :])
        acc = tl.dot(xv, tl.trans(wv), acc)
    tl.store(Y + ts[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=t_ok[:, None])


def main(out_path):
    dev = torch.device("cuda")
    T, L = 8, 80
    dims = [(4096, 2048), (2048, 4096)]  # (N, K)
    ws = [torch.randn(*dims[i % 2], device=dev, dtype=torch.bfloat16) * 0.01 for i in range(L)]
    bufs = [torch.randn(T, 2048, device=dev, dtype=torch.bfloat16)] + \
           [torch.empty(T, dims[i % 2][0], device=dev, dtype=torch.bfloat16) for i in range(L)]
    nbytes = sum(w.numel() * 2 for w in ws)

    def chain(pdl, pref, block_n):
        for i, w in enumerate(ws):
            N, K = w.shape
            kw = {"launch_pdl": True} if pdl else {}
            _gemv[(N // block_n,)](bufs[i], w, bufs[i + 1], T, N, K, PDL=pdl, PREFETCH=pref, T_P=16,
                                   BLOCK_N=block_n, BLOCK_K=256, K_LINES=K // 64, num_warps=4, **kw)

    res = {}
    ref = None
    for name, pdl, pref in (("base", False, False), ("pdl", True, False), ("pdl_pref", True, True),
                            ("pref_only", False, True)):
        for block_n in (16, 32):
            chain(pdl, pref, block_n)
            torch.cuda.synchronize()
            out = bufs[-1].clone()
            if ref is None:
                ref = out
            ok = torch.equal(out, ref)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain(pdl, pref, block_n)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                chain(pdl, pref, block_n)
            bufs[-1].zero_()
            g.replay()
            torch.cuda.synchronize()
            ok = ok and torch.equal(bufs[-1], ref)
            times = []
            for _ in range(60):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            t = sorted(times[10:])[len(times[10:]) // 2]
            res[f"{name}_bn{block_n}"] = {"t_us": t * 1e6, "tb_s": nbytes / t / 1e12, "per_kernel_us": t * 1e6 / L,
                                          "identical": ok}
            print(name, block_n, f"{t * 1e6:.1f} us, {nbytes / t / 1e12:.2f} TB/s, {t * 1e6 / L:.2f} us/kernel, same={ok}",
                  flush=True)
    json.dump({"layers": L, "rows": T, "bytes": nbytes, "results": res}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
