"""Weight-only quantized linear layers for decode-sized inputs (1..16 token rows): ``x @ w.T (+ bias)``
where w is an NVFP4 or block-FP8 ``QuantWeight`` (``wmtp.quant``), read once in its packed form and
dequantized in registers (DESIGN §9: at B·d rows a projection is a weight read, and 4 or 8 bits a
weight read a quarter or half the bytes of bf16).

A program owns a [rows, BLOCK_N] block of the output and walks K in BLOCK_K steps:
- NVFP4: the step's packed bytes [BLOCK_N, BLOCK_K / 2] are split into their nibbles (input 2j low,
  2j + 1 high) and decoded to e2m1 values, times the fp8 scale of each 16 inputs, then one dot with
  the token rows; the per-row second-level scale multiplies the accumulator once at the end;
- FP8: the step's fp8 values [BLOCK_N, BLOCK_K] in one dot, whose result is scaled by the rows'
  block scale for that K block (BLOCK_K divides the format's 128-input blocks).
Operands of the dot are in the activations' dtype: a decoded NVFP4 value times its fp8 scale has at
most 7 significant bits, an fp8 value 4, so both are exact in bf16 (fp32 activations: ieee fp32
products; under the CPU interpreter, whose bf16 dot is wrong, both widened to fp32 as
``linear.dot_flags`` says). Accumulation is fp32.

The twin is ``F.linear(x, w.dequantize(x.dtype))`` (``TorchBackend.linear``);
``tests/test_quant_linear.py`` compares them.
"""

from __future__ import annotations

import torch

from wmtp.kernels.common import launch_tile, pdl
from wmtp.kernels.linear import MAX_ROWS, dot_flags, skinny_rows
from wmtp.quant import FP8Block, NVFP4, QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from wmtp.kernels.common import wait_prior

    @triton.jit
    def e2m1_values(codes):
        """e2m1 codes (uint8, 0..15) -> fp32 values: magnitude index e·2 + m -> 0.5·m (e = 0) or
        2^(e-1)·(1 + m/2); bit 3 is the sign."""
        mag = codes & 7
        e = (mag >> 1).to(tl.float32)
        m = (mag & 1).to(tl.float32)
        val = tl.where(e == 0.0, 0.5 * m, tl.exp2(e - 1.0) * (1.0 + 0.5 * m))
        return tl.where(codes >= 8, -val, val)

    @triton.jit
    def _quant_linear_kernel(X, W, S, R, BIAS, OUT, T, N, K, stride_xt, stride_wn, stride_sn, stride_ot,
                             FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr, PREC: tl.constexpr,
                             T_P: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """FORMAT 0: NVFP4 (W packed bytes [N, K/2], S fp8 [N, K/16], R fp32 [N]); 1: FP8 (W fp8
        [N, K], S fp32 [N, K/128] per row, R unused)."""
        wait_prior(PDL)
        nb = tl.program_id(0)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ts = tl.arange(0, T_P)
        t_ok = ts < T
        acc = tl.zeros([T_P, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(X + ts[:, None] * stride_xt + ks[None, :], mask=t_ok[:, None] & (ks < K)[None, :], other=0.0)
            if WIDEN:
                xv = xv.to(tl.float32)
            if FORMAT == 0:
                kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b = tl.load(W + cols[:, None] * stride_wn + kb[None, :], mask=col_ok[:, None] & (kb < K // 2)[None, :],
                            other=0)
                codes = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K))  # input 2j low, 2j + 1 high
                ksc = k0 // 16 + tl.arange(0, BLOCK_K // 16)
                sc = tl.load(S + cols[:, None] * stride_sn + ksc[None, :],
                             mask=col_ok[:, None] & (ksc < K // 16)[None, :], other=0.0).to(tl.float32)
                wv = tl.reshape(tl.reshape(e2m1_values(codes), (BLOCK_N, BLOCK_K // 16, 16)) * sc[:, :, None],
                                (BLOCK_N, BLOCK_K))
                acc = tl.dot(xv, tl.trans(wv.to(xv.dtype)), acc, input_precision=PREC)
            else:
                wv = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :],
                             other=0.0).to(tl.float32)
                sc = tl.load(S + cols * stride_sn + k0 // 128, mask=col_ok, other=0.0)
                acc += tl.dot(xv, tl.trans(wv.to(xv.dtype)), input_precision=PREC) * sc[None, :]
        if FORMAT == 0:
            acc = acc * tl.load(R + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + ts[:, None] * stride_ot + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=t_ok[:, None] & col_ok[None, :])


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """``F.linear(x, w.dequantize(x.dtype), bias)`` for x [..., K] of at most ``MAX_ROWS`` rows
    (flattened) and a quantized [N, K] weight, reading the weight in its packed form.
    ``block_n`` / ``block_k`` override the tiles (FP8: ``block_k`` must divide 128)."""
    if triton is None:
        raise RuntimeError("quant_linear needs triton (pip install 'wmtp[gpu]' or triton==3.6.0)")
    K = x.shape[-1]
    if len(w.shape) != 2 or w.shape[1] != K:
        raise ValueError(f"quant_linear: weight {tuple(w.shape)} must be [N, {K}] (x {tuple(x.shape)})")
    x2, out = skinny_rows("quant_linear", x, w.shape[0], bias)
    T, N = out.shape
    if not (T and N):
        return out.view(*x.shape[:-1], N)
    t = w.tensors
    if isinstance(w.format, NVFP4):
        fmt, weight, scale, rows = 0, t["weight"], t["weight_scale"], t["weight_scale_2"]
        bk = block_k or launch_tile(128, K)
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"quant_linear: NVFP4 block_k {bk} must be a power of 2 >= 16")
    elif isinstance(w.format, FP8Block) and w.format.block[1] == 128:
        fmt, weight, scale, rows = 1, t["weight"], t["weight_scale_inv"], t["weight_scale_inv"]
        bk = block_k or 128
        if 128 % bk or bk < 16:
            raise ValueError(f"quant_linear: FP8 block_k {bk} must divide the 128-input scale blocks")
    else:
        raise ValueError(f"quant_linear: no kernel for {w.format.name} with blocks {getattr(w.format, 'block', None)}")
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("quant_linear: the weight's and scales' rows must be contiguous")
    bn = block_n or launch_tile(32, N)
    _quant_linear_kernel[(triton.cdiv(N, bn),)](
        x2, weight, scale, rows, out if bias is None else bias, out, T, N, K, x2.stride(0), weight.stride(0),
        scale.stride(0), out.stride(0), FORMAT=fmt, HAS_BIAS=bias is not None, **dot_flags(x.dtype),
        T_P=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps, **pdl(x.device))
    return out.view(*x.shape[:-1], N)
