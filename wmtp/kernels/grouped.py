"""Grouped GEMM over quantized experts for prefill-sized batches: ``F.grouped_mm(x, w.T, offs=offs)``
with ``w`` a ``QuantWeight`` [E, N, K] (NVFP4 or block FP8) read packed and dequantized tile by tile
in registers, instead of dequantizing every expert to bf16 first (``quant_tiles.dequantize``: at
a 16,384-token chunk all 256 experts of a 35B layer, 1.6 GB written and read again each chunk).

x's rows are sorted by expert, expert e's rows ending at ``offs[e]`` (``F.grouped_mm``'s contract;
``moe.grouped_experts`` counts them on the device). Each program takes BLOCK_M rows of one expert:
the tile schedule (every expert's row blocks, numbered in expert order) is a cumulative count on
the device, and a program finds its expert by binary search over it, so there is no host sync and
the launch holds at most ``cdiv(M, BLOCK_M) + E`` row blocks. A K step is ``linear.split_dot``'s:
the weight tile exact in fp16 against x scaled into fp16 per row (``quant_tiles.weight_tile_dot``).

A candidate against the dequantize-then-``F.grouped_mm`` path, which the engine keeps unless
``WMTP_FUSED_QUANT_MOE=1`` (not yet timed on a GPU). The twin is ``F.linear`` per expert over
``QuantWeight.dequantize`` (``tests/test_grouped_kernel.py``).
"""

from __future__ import annotations

import os

import torch

from wmtp.kernels.common import pdl
from wmtp.kernels.linear import dot_flags
from wmtp.kernels.quant_tiles import NVFP4_CODE, e2m1_cvt, kernel_weight
from wmtp.quant import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from wmtp.kernels.common import wait_prior
    from wmtp.kernels.linear import split_dot
    from wmtp.kernels.quant_tiles import row_scale

    @triton.jit
    def _grouped_quant_mm_kernel(X, W, S, R, OUT, OFFS, TILE_ENDS, E, N, K, stride_xt, stride_we, stride_wn,
                                 stride_se, stride_sn, stride_re, stride_ot, FORMAT: tl.constexpr,
                                 WIDEN: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CVT: tl.constexpr,
                                 PDL: tl.constexpr):
        """OUT[rows of expert e] = X[rows] @ dequantize(W[e]).T; TILE_ENDS[e]: the row blocks of
        experts 0..e (cumulative), OFFS[e]: the end of expert e's rows."""
        wait_prior(PDL)
        t = tl.program_id(0)
        if t < tl.load(TILE_ENDS + E - 1):
            lo = 0
            hi = E - 1
            while lo < hi:  # the first expert whose row blocks end past t
                mid = (lo + hi) // 2
                if tl.load(TILE_ENDS + mid) > t:
                    hi = mid
                else:
                    lo = mid + 1
            e = lo
            first_tile = tl.load(TILE_ENDS + e - 1, mask=e > 0, other=0)
            row_begin = tl.load(OFFS + e - 1, mask=e > 0, other=0)
            rows = row_begin + (t - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
            r_ok = rows < tl.load(OFFS + e)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            c_ok = cols < N
            e64 = e.to(tl.int64)
            acc = split_dot(X, W + e64 * stride_we, S + e64 * stride_se, stride_xt, stride_wn, stride_sn, rows, r_ok,
                            cols, c_ok, 0, K, K, FORMAT, WIDEN, PREC, BLOCK_K, CVT, PAIRS=True)
            acc = row_scale(acc, R + e64 * stride_re, cols[None, :], c_ok[None, :], FORMAT)
            tl.store(OUT + rows[:, None].to(tl.int64) * stride_ot + cols[None, :], acc.to(OUT.dtype.element_ty),
                     mask=r_ok[:, None] & c_ok[None, :])


def fused_quant_moe() -> bool:
    """Whether the engine's prefill MoE takes ``grouped_quant_mm`` (``WMTP_FUSED_QUANT_MOE=1``)."""
    return os.environ.get("WMTP_FUSED_QUANT_MOE", "0") == "1"


def grouped_quant_mm(x: torch.Tensor, w: QuantWeight, offs: torch.Tensor, block_m: int = 64, block_n: int = 128,
                     block_k: int = 128, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """``F.grouped_mm(x, dequantize(w).transpose(1, 2), offs=offs)`` for x [M, K] (rows sorted by
    expert), w [E, N, K] quantized, offs [E] int32 (cumulative row counts, the last M; on the
    device, so not checked here: rows past it are left unwritten): [M, N] in x's dtype."""
    kw = kernel_weight("grouped_quant_mm", w)
    if kw.weight.dim() != 3 or x.dim() != 2 or x.shape[1] != kw.k:
        raise ValueError(f"grouped_quant_mm: x {tuple(x.shape)} must be [M, {kw.k}] against experts "
                         f"{tuple(kw.shape)} [E, N, K]")
    E, N = kw.weight.shape[0], kw.weight.shape[1]
    if offs.shape != (E,):
        raise ValueError(f"grouped_quant_mm: offs {tuple(offs.shape)} must be [{E}] (one end per expert)")
    if block_k < 16 or block_k & (block_k - 1) or kw.format != NVFP4_CODE and block_k > 128:
        raise ValueError(f"grouped_quant_mm: block_k {block_k} must be a power of 2 >= 16 (at most 128 for FP8: "
                         f"within a scale block)")
    M = x.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M and N:
        x = x if x.stride(1) == 1 else x.contiguous()
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        tile_ends = torch.cumsum((counts + block_m - 1) // block_m, 0, dtype=torch.int32)
        grid = (triton.cdiv(M, block_m) + E, triton.cdiv(N, block_n))
        we, wn, se, sn = kw.strides()
        _grouped_quant_mm_kernel[grid](
            x, kw.weight, kw.scale, kw.rows, out, offs.to(torch.int32), tile_ends, E, N, kw.k, x.stride(0), we, wn, se,
            sn, kw.rows_stride(), out.stride(0), FORMAT=kw.format, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages, **dot_flags(x.dtype), **e2m1_cvt(x.device), **pdl(x.device))
    return out
