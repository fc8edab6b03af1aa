"""Routed experts with quantized weights (NVFP4 or block FP8, ``wmtp.quant``) at decode sizes: the
pair-wise SwiGLU GEMV and the down projection + weighted combine of ``kernels.moe``, each weight
tile read in its packed form and dequantized in registers, so a decode step reads the experts'
4- or 8-bit bytes once. No host sync anywhere: the decode graphs capture it.

- ``quant_swiglu``: program (pair p, block of N rows): ``silu(gate[e] @ x[t]) * (up[e] @ x[t])`` for
  expert e = idx[p], token t = p // top_k, the gate and up rows of one packed gate_up weight.
- ``quant_down_combine``: program (token t, block of N rows): ``sum_k w[t, k] * down[e_k] @ h[t, k]``.
Per element, a weight is ``value(code) * group scale`` (NVFP4: e2m1 code from its byte's nibble,
times the fp8 scale of its 16 inputs; FP8: the fp8 value times its 128-input block scale); the
per-row second level (NVFP4) multiplies the row's sum once. Sums are fp32, and each projection is
rounded to the activations' dtype where the reference (``TorchBackend.moe`` over the dequantized
weights) rounds it. The shared expert, routing and the router GEMM are those of the float path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wmtp.kernels.common import SharedExpert, launch_tile, pdl
from wmtp.kernels.linear import MAX_ROWS, decode_linear
from wmtp.kernels.moe import route_topk
from wmtp.quant import FP8Block, NVFP4, QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from wmtp.kernels.common import wait_prior
    from wmtp.kernels.quant_linear import e2m1_values

    @triton.jit
    def _dq(W, S, w_offs, s_offs, ks, m, FORMAT: tl.constexpr):
        """fp32 weights at ``w_offs`` (a tile of row offsets + the inputs ``ks``) of a quantized weight:
        FORMAT 0 NVFP4 (W bytes at k // 2, S fp8 per 16 inputs), 1 FP8 (W fp8, S fp32 per 128)."""
        if FORMAT == 0:
            b = tl.load(W + w_offs + ks // 2, mask=m, other=0)
            v = e2m1_values(tl.where(ks % 2 == 0, b & 15, b >> 4))
            return v * tl.load(S + s_offs + ks // 16, mask=m, other=0.0).to(tl.float32)
        else:
            v = tl.load(W + w_offs + ks, mask=m, other=0.0).to(tl.float32)
            return v * tl.load(S + s_offs + ks // 128, mask=m, other=0.0)

    @triton.jit
    def _quant_swiglu_kernel(X, W, S, R, IDX, OUT, N, K, stride_we, stride_wn, stride_se, stride_sn, stride_re,
                             TOP_K: tl.constexpr, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        p = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        e = tl.load(IDX + p).to(tl.int64)
        tok = p // TOP_K
        g = tl.zeros([BLOCK_N], tl.float32)
        u = tl.zeros([BLOCK_N], tl.float32)
        wg = e * stride_we + rows[:, None] * stride_wn  # gate rows; up rows N further down
        sg = e * stride_se + rows[:, None] * stride_sn
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            m = row_ok[:, None] & k_ok[None, :]
            xv = tl.load(X + tok * K + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            g += tl.sum(_dq(W, S, wg, sg, ks[None, :], m, FORMAT) * xv, 1)
            u += tl.sum(_dq(W, S, wg + N * stride_wn, sg + N * stride_sn, ks[None, :], m, FORMAT) * xv, 1)
        if FORMAT == 0:
            g = g * tl.load(R + e * stride_re + rows, mask=row_ok, other=0.0)
            u = u * tl.load(R + e * stride_re + N + rows, mask=row_ok, other=0.0)
        dt = OUT.dtype.element_ty
        g = g.to(dt).to(tl.float32)  # the reference rounds each projection to the activation dtype
        u = u.to(dt).to(tl.float32)
        h = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        tl.store(OUT + p * N + rows, h.to(dt), mask=row_ok)

    @triton.jit
    def _quant_down_combine_kernel(H, W, S, R, IDX, TW, OUT, N, K, stride_we, stride_wn, stride_se, stride_sn,
                                   stride_re, TOP_K: tl.constexpr, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        t = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        dt = OUT.dtype.element_ty
        out = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):  # k in order, as the reference sums them
            p = t * TOP_K + j
            e = tl.load(IDX + p).to(tl.int64)
            acc = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                m = row_ok[:, None] & k_ok[None, :]
                w = _dq(W, S, e * stride_we + rows[:, None] * stride_wn, e * stride_se + rows[:, None] * stride_sn,
                        ks[None, :], m, FORMAT)
                acc += tl.sum(w * tl.load(H + p * K + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :], 1)
            if FORMAT == 0:
                acc = acc * tl.load(R + e * stride_re + rows, mask=row_ok, other=0.0)
            out += acc.to(dt).to(tl.float32) * tl.load(TW + p)  # each expert rounded as the reference's
        tl.store(OUT + t * N + rows, out.to(dt), mask=row_ok)


def _layout(name: str, w: QuantWeight, k: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FORMAT, packed weight, group scales, per-row scales) of experts ``w`` [E, N, k]."""
    if len(w.shape) != 3 or w.shape[2] != k:
        raise ValueError(f"{name}: experts {tuple(w.shape)} must be [E, N, {k}]")
    t = w.tensors
    if isinstance(w.format, NVFP4):
        return 0, t["weight"], t["weight_scale"], t["weight_scale_2"]
    if isinstance(w.format, FP8Block) and w.format.block[1] == 128:
        return 1, t["weight"], t["weight_scale_inv"], t["weight_scale_inv"]
    raise ValueError(f"{name}: no kernel for {w.format.name} experts")


def _strides(weight: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> tuple[int, ...]:
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("quantized experts: rows must be contiguous")
    return weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1), rows.stride(0)


def quant_swiglu(x: torch.Tensor, gate_up: QuantWeight, idx: torch.Tensor, top_k: int, block_n: int | None = None,
                 block_k: int | None = None) -> torch.Tensor:
    """``silu(gate[e] @ x[t]) * (up[e] @ x[t])`` for every pair p (e = idx[p], t = p // top_k); gate_up
    [E, 2I, K] quantized (gate rows first). Returns [P, I] in x's dtype."""
    T, K = x.shape
    fmt, w, s, r = _layout("quant_swiglu", gate_up, K)
    P, N = T * top_k, gate_up.shape[1] // 2
    if idx.shape != (P,):
        raise ValueError(f"quant_swiglu: idx {tuple(idx.shape)} must be [{P}] (tokens x top_k)")
    out = torch.empty(P, N, device=x.device, dtype=x.dtype)
    if P:
        bn, bk = block_n or launch_tile(16, N), block_k or launch_tile(128, K)
        _quant_swiglu_kernel[(P, triton.cdiv(N, bn))](x.contiguous(), w, s, r, idx.contiguous(), out, N, K,
                                                      *_strides(w, s, r), TOP_K=top_k, FORMAT=fmt, BLOCK_N=bn,
                                                      BLOCK_K=bk, num_warps=4, **pdl(x.device))
    return out


def quant_down_combine(h: torch.Tensor, down: QuantWeight, idx: torch.Tensor, top_w: torch.Tensor, top_k: int,
                       block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """``out[t] = sum_k top_w[t, k] * down[idx[t, k]] @ h[t * top_k + k]``; down [E, N, K] quantized.
    Returns [T, N] in h's dtype."""
    P, K = h.shape
    if top_k < 1 or P % top_k or idx.numel() != P or top_w.numel() != P:
        raise ValueError(f"quant_down_combine: h {tuple(h.shape)}, idx {tuple(idx.shape)}, top_w "
                         f"{tuple(top_w.shape)} must be [T * {top_k}, K], [T, {top_k}], [T, {top_k}]")
    fmt, w, s, r = _layout("quant_down_combine", down, K)
    T, N = P // top_k, down.shape[1]
    out = torch.empty(T, N, device=h.device, dtype=h.dtype)
    if T:
        bn, bk = block_n or launch_tile(16, N), block_k or launch_tile(128, K)
        _quant_down_combine_kernel[(T, triton.cdiv(N, bn))](
            h.contiguous(), w, s, r, idx.contiguous(), top_w.float().contiguous(), out, N, K, *_strides(w, s, r),
            TOP_K=top_k, FORMAT=fmt, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, **pdl(h.device))
    return out


def _linear(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
    """The shared expert's projections: quantized (``quant_linear``, or dequantized above its rows)
    or float (``decode_linear``); no host sync either way."""
    if not isinstance(w, QuantWeight):
        return decode_linear(x, w)
    from wmtp.kernels.quant_linear import quant_linear

    return quant_linear(x, w) if x.shape[0] <= MAX_ROWS else F.linear(x, w.dequantize(x.dtype))


def quant_moe_gemv(x: torch.Tensor, router_weight: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, top_k: int,
                   norm_topk_prob: bool, shared: SharedExpert | None = None) -> torch.Tensor:
    """``Backend.moe``'s contract with quantized routed experts, at decode sizes (``moe_gemv``'s
    routing; the shared expert, quantized or not, through the linears)."""
    r = route_topk(decode_linear(x, router_weight), top_k, norm_topk_prob, x, None if shared is None else shared.gate)
    out = quant_down_combine(quant_swiglu(x, gate_up, r.experts.view(-1), top_k), down, r.experts, r.weights, top_k)
    if shared is None:
        return out
    hs = F.silu(_linear(x, shared.gate_proj)) * _linear(x, shared.up_proj)
    return out + torch.sigmoid(r.shared_logit.to(x.dtype))[:, None] * _linear(hs, shared.down_proj)
