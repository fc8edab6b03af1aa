"""Triton MoE for decode-sized batches (B·d tokens): routing, SwiGLU experts (routed and shared)
and the weighted combine in three launches after the router GEMM, no host sync.

At decode / verify / draft sizes each (token, chosen expert) pair is a matrix-vector product, so
the cost is reading the chosen experts' weights; what PyTorch adds around it (softmax, top-k sort,
renormalise, repeat the tokens per pair, silu·mul, weight, sum, the shared expert's gate) is a
dozen tiny kernels per layer, which dominate a CUDA-graph replay at B = 1. Here:

- ``route_topk``: softmax over the router logits, top-k by repeated max of packed (probability,
  index) keys, renormalise (fp32);
  and the shared expert's gate logit (a [H] dot per token).
- ``swiglu_gemv_with_shared``: ``silu(W_gate[e] x) * (W_up[e] x)`` per pair, the token row read
  as ``p // top_k`` (no repeated copy of x), and in the same launch T more rows, one per token,
  with the shared expert's weights (its own intermediate size). A separate launch for the shared
  expert had too few programs to reach bandwidth (7.5 us for a 1 us weight read on the H200).
  ``swiglu_gemv`` is the routed part alone (no shared expert). NVFP4 experts against 16-bit x run
  it as ``_pair_hfma_kernel``: x laid out once per launch in fp16 (``x_groups``), each group's
  products summed by f16x2 FMAs (``quant_tiles.hfma_group``).
- ``down_combine``: ``sum_k w[t,k] * W_down[e_k] h[t,k]`` per token, the top_k experts' tiles
  loaded together (one [top_k, rows, BLOCK_K] load per K step, not top_k dependent loops), plus
  the shared expert's down projection times ``sigmoid(logit[t])``, written once in the output dtype.

The reference (``TorchBackend.moe``) loops over the distinct experts with ``torch.unique`` (a host
sync per layer); ``tests/test_moe_kernel.py`` compares every kernel and the whole path with it.
Rounding follows the reference: each projection is rounded to the activation dtype (as F.linear's
output is), and expert outputs are rounded before the weighted sum.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from wmtp.kernels.act_mul import SILU, act_mul
from wmtp.kernels.common import SharedExpert, SigmoidRouting, launch_tile, pdl
from wmtp.kernels.linear import decode_linear, fp32_linear
from wmtp.kernels.quant_tiles import (FLOAT, FP8_CODE, NVFP4_CODE, KernelWeight, dequantize, e2m1_cvt, hfma_default,
                                       hfma_ready, kernel_weight, same_layout, x_groups)
from wmtp.quant import QuantWeight, dense

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Above this many (token, expert) pairs the grouped GEMM path (prefill, large batches) wins.
MAX_GEMV_PAIRS = 256
# quantized ungated (ReLU²) experts take the pair-wise GEMV up to this many tokens, whatever their
# pairs: the grouped path dequantizes every expert first (Nemotron-3-Super: 11 GB a layer)
QUANT_GEMV_TOKENS = 64
# The experts' activation in ``_swiglu_gemv_kernel`` (ACT): SwiGLU, ReLU², or none (a down projection)
SWIGLU, RELU2, LINEAR = 0, 1, 2
# down_combine holds a token's experts as one [TOP_K_P, BLOCK_N, BLOCK_K] register tile; past this many
# experts a token the tile leaves BLOCK_N too few rows for the grid to fill the GPU (Nemotron-3-Super's
# 22 NVFP4 experts: 172 us a token at the default tile, 86 at the best, 0.2-0.4 TB/s; tune_moe.py), so
# the experts' rows run pair by pair and a second launch combines them (its windowed step at 1.04M
# 66.5 -> 26.2 ms on the H200, benchmarks/ab_step.sh)
MAX_FUSED_TOP_K = 8


if triton is not None:
    from wmtp.kernels.common import wait_prior
    from wmtp.kernels.quant_tiles import fma_sum, hfma_step, row_scale, weight_dot, weight_fma, x_step

    @triton.jit
    def _route_topk_kernel(LOGITS, W_OUT, I_OUT, X, SG, SG_OUT, BIAS, E, HID, scale, TOP_K: tl.constexpr,
                           K_P: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SIGMOID: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """Softmax routing; or (SIGMOID) sigmoid scores whose top-k is chosen by score + BIAS[e] and
        weighted by the unbiased score, renormalised with 1e-20 in the denominator, times ``scale``."""
        wait_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        if SHARED:  # the shared expert's gate logit x[t] . w, rounded to x's dtype as F.linear's is
            z = tl.zeros([BLOCK_H], tl.float32)
            for h0 in range(0, HID, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                z += tl.load(X + t * HID + hs, mask=hs < HID, other=0.0).to(tl.float32) * \
                    tl.load(SG + hs, mask=hs < HID, other=0.0).to(tl.float32)
            tl.store(SG_OUT + t, tl.sum(z, 0).to(X.dtype.element_ty).to(tl.float32))
        es = tl.arange(0, BLOCK_E)
        z = tl.load(LOGITS + t * E + es, mask=es < E, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            p = 1.0 / (1.0 + tl.exp(-z))
            choice = p + tl.load(BIAS + es, mask=es < E, other=0.0).to(tl.float32)
        else:
            z_max = tl.max(z, 0)
            p = tl.exp(z - z_max)
            p_sum = tl.sum(p, 0)
            p = p / p_sum
            choice = p
        # key = (choice's bits made order-preserving as an int32, then BLOCK_E-1-index) as int64,
        # which orders by choice and then the lowest index first among ties (as torch.topk); padding
        # has int64's least value, below every choice's key (-(1 << 62) was above those of choices <= -2)
        bits = choice.to(tl.int32, bitcast=True)
        bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
        key = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - es).to(tl.int64)
        key = tl.where(es < E, key, -(1 << 63))
        ks = tl.arange(0, K_P)
        # the K_P largest keys in descending order (a bitonic top-k: 9 barriers for 22 of 512, where a
        # block-wide max and sum per pick took 131 in the sm_90 SASS); past TOP_K, not stored
        sel_i = BLOCK_E - 1 - (tl.topk(key, K_P) & 0xFFFFFFFF).to(tl.int32)
        # the picks' scores again from their logits, in p's arithmetic (so bit for bit p's)
        zk = tl.load(LOGITS + t * E + sel_i, mask=ks < TOP_K, other=0.0).to(tl.float32)
        sel_w = 1.0 / (1.0 + tl.exp(-zk)) if SIGMOID else tl.exp(zk - z_max) / p_sum
        sel_w = tl.where(ks < TOP_K, sel_w, 0.0)
        if NORM:
            if SIGMOID:
                sel_w = sel_w / (tl.sum(sel_w, 0) + 1e-20)
            else:
                sel_w = sel_w / tl.sum(sel_w, 0)
        sel_w = sel_w * scale
        tl.store(W_OUT + t * TOP_K + ks, sel_w, mask=ks < TOP_K)
        tl.store(I_OUT + t * TOP_K + ks, sel_i, mask=ks < TOP_K)

    @triton.jit
    def _pair_operands(p, P, N, NS, IDX, WG, WU, CG, CU, SG, SU, SCG, SCU, OUT, stride_we, stride_wn, stride_ce,
                       stride_cn, stride_sn, stride_scn, TOP_K: tl.constexpr):
        """Row p of a pair-wise launch: (shared, expert, gate / up weight and scale bases, token, its
        output width, weight and scale row strides, output row). Rows p < P: routed pair p (expert
        idx[p], token p // TOP_K) into OUT[:P*N] as [P, N]; rows p >= P: the shared expert for token
        p - P into OUT[P*N:] as [T, NS]. Selected by value, not by branching, so both kinds of program
        run the same loop."""
        sh = p >= P
        e = tl.load(IDX + p, mask=p < P, other=0).to(tl.int64)
        return (sh, e, tl.where(sh, SG, WG + e * stride_we), tl.where(sh, SU, WU + e * stride_we),
                tl.where(sh, SCG, CG + e * stride_ce), tl.where(sh, SCU, CU + e * stride_ce),
                tl.where(sh, p - P, p // TOP_K), tl.where(sh, NS, N), tl.where(sh, stride_sn, stride_wn),
                tl.where(sh, stride_scn, stride_cn), OUT + tl.where(sh, P * N + (p - P) * NS, p * N))

    @triton.jit
    def _activation(g, u, OUT, ACT: tl.constexpr):
        """The experts' activation (``SWIGLU``, ``RELU2``, ``LINEAR``) of the projections g (gate) and
        u (up), in OUT's dtype: each projection rounded to it first, as the reference's F.linear."""
        dt = OUT.dtype.element_ty
        u = u.to(dt).to(tl.float32)
        if ACT == 0:
            g = g.to(dt).to(tl.float32)
            h = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        elif ACT == 1:
            h = tl.maximum(u, 0.0)
            h = h * h
        else:
            h = u
        return h.to(dt)

    @triton.jit
    def _swiglu_gemv_kernel(X, WG, WU, CG, CU, RG, RU, IDX, SG, SU, SCG, SCU, SRG, SRU, OUT, P, N, NS, K,
                            stride_we, stride_wn, stride_ce, stride_cn, stride_re, stride_sn, stride_scn,
                            TOP_K: tl.constexpr, FORMAT: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, CVT: tl.constexpr, FMA: tl.constexpr, PDL: tl.constexpr):
        """Weights in FORMAT (``quant_tiles``): routed gate / up W*, their group scales C*, per-row
        scales R* (leading expert strides *_e); the shared expert's S*, SC*, SR*. ACT ``SWIGLU``:
        ``silu(gate x) * (up x)``; ``RELU2``: ``relu(up x)^2``; ``LINEAR``: ``up x`` (the gate
        arguments unread but by SwiGLU). FMA: products summed once after the K loop
        (``weight_fma``) instead of at every step (``weight_dot``); ``pair_tiles`` says where."""
        wait_prior(PDL)
        GATED: tl.constexpr = ACT == 0
        p = tl.program_id(0)
        nb = tl.program_id(1)
        sh, e, wg, wu, cg, cu, tok, n, stride_n, stride_c, out = _pair_operands(
            p, P, N, NS, IDX, WG, WU, CG, CU, SG, SU, SCG, SCU, OUT, stride_we, stride_wn, stride_ce, stride_cn,
            stride_sn, stride_scn, TOP_K)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n  # the grid spans max(N, NS) rows: the narrower kind masks the rest
        x_off = tok * K
        if FMA:
            ga = tl.zeros([BLOCK_N, BLOCK_K // 16, 8] if FORMAT == 1 else [BLOCK_N, BLOCK_K], tl.float32)
            ua = tl.zeros_like(ga)
            for k0 in range(0, K, BLOCK_K):
                xs = x_step(X, x_off, k0, K, FORMAT, BLOCK_K)
                if GATED:
                    ga = weight_fma(wg, cg, rows * stride_n, rows * stride_c, row_ok, xs, k0, K, ga, FORMAT, BLOCK_K, CVT)
                ua = weight_fma(wu, cu, rows * stride_n, rows * stride_c, row_ok, xs, k0, K, ua, FORMAT, BLOCK_K, CVT)
            g = fma_sum(ga, FORMAT)
            u = fma_sum(ua, FORMAT)
        else:
            g = tl.zeros([BLOCK_N], tl.float32)
            u = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = x_step(X, x_off, k0, K, FORMAT, BLOCK_K)  # once for gate and up
                if GATED:
                    g += weight_dot(wg, cg, rows * stride_n, rows * stride_c, row_ok, xs, k0, K, FORMAT, BLOCK_K, CVT)
                u += weight_dot(wu, cu, rows * stride_n, rows * stride_c, row_ok, xs, k0, K, FORMAT, BLOCK_K, CVT)
        u = row_scale(u, tl.where(sh, SRU, RU + e * stride_re), rows, row_ok, FORMAT)
        if GATED:
            g = row_scale(g, tl.where(sh, SRG, RG + e * stride_re), rows, row_ok, FORMAT)
        tl.store(out + rows, _activation(g, u, OUT, ACT), mask=row_ok)

    @triton.jit
    def _pair_hfma_kernel(XW, XINV, WG, WU, CG, CU, RG, RU, IDX, SG, SU, SCG, SCU, SRG, SRU, OUT, P, N, NS, K,
                          stride_we, stride_wn, stride_ce, stride_cn, stride_re, stride_sn, stride_scn, XS0,
                          TOP_K: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          MASKED: tl.constexpr, CVT: tl.constexpr, PDL: tl.constexpr):
        """``_swiglu_gemv_kernel``'s rows (routed pairs, then the shared expert's) over NVFP4 weights by
        ``hfma_step``: x as ``x_groups`` words XW with their inverse scales XINV, the weights' packed
        bytes as int64 words (strides ``stride_we``, ``stride_wn``, ``stride_sn`` in words); the
        shared rows read x from row XS0 on (0: the tokens' rows; P: rows of their own after the pairs')."""
        wait_prior(PDL)
        GATED: tl.constexpr = ACT == 0
        p = tl.program_id(0)
        nb = tl.program_id(1)
        sh, e, wg, wu, cg, cu, tok, n, stride_n, stride_c, out = _pair_operands(
            p, P, N, NS, IDX, WG, WU, CG, CU, SG, SU, SCG, SCU, OUT, stride_we, stride_wn, stride_ce, stride_cn,
            stride_sn, stride_scn, TOP_K)
        tok = (tok + tl.where(sh, XS0, 0)).to(tl.int64)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        ga = tl.zeros([BLOCK_N, BLOCK_K // 16], tl.float32)
        ua = tl.zeros_like(ga)
        w_rows, c_rows, x_off = rows * stride_n, rows * stride_c, tok * (K // 4)
        for k0 in range(0, K, BLOCK_K):  # one x tile for both weights
            if GATED:
                ga = hfma_step(wg, cg, XW, w_rows, c_rows, x_off, row_ok, k0, K, ga, BLOCK_K, CVT, MASKED)
            ua = hfma_step(wu, cu, XW, w_rows, c_rows, x_off, row_ok, k0, K, ua, BLOCK_K, CVT, MASKED)
        inv = tl.load(XINV + tok) * 64.0  # x's power of 2, and the e4m3 decode's 1 / 64
        u = row_scale(tl.sum(ua, 1) * inv, tl.where(sh, SRU, RU + e * stride_re), rows, row_ok, 1)
        g = u
        if GATED:
            g = row_scale(tl.sum(ga, 1) * inv, tl.where(sh, SRG, RG + e * stride_re), rows, row_ok, 1)
        tl.store(out + rows, _activation(g, u, OUT, ACT), mask=row_ok)

    @triton.jit
    def _combine_sorted_kernel(Y, POS, TW, SL, OUT, P, N, TOP_K: tl.constexpr, SORTED: tl.constexpr,
                               SHARED: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """Token t's output columns: its top-k expert rows, found in the expert-sorted Y at POS (in
        pair order without SORTED), weighted by TW and summed in fp32 (k in order); SHARED: plus
        ``sigmoid(SL[t])`` times the shared expert's row, Y's row P + t."""
        wait_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):
            if SORTED:
                row = tl.load(POS + t * TOP_K + j).to(tl.int64)
            else:
                row = t * TOP_K + j
            acc += tl.load(TW + t * TOP_K + j) * tl.load(Y + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        if SHARED:
            ys = tl.load(Y + (P + t) * N + cols, mask=ok, other=0.0).to(tl.float32)
            acc += ys / (1.0 + tl.exp(-tl.load(SL + t)))
        tl.store(OUT + t * N + cols, acc.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _down_combine_kernel(H, W, C, R, IDX, TW, HS, WS, CS, RS, SL, OUT, N, K, KS, stride_we, stride_wn, stride_ce,
                             stride_cn, stride_re, stride_ws, stride_cs, TOP_K: tl.constexpr, TOP_K_P: tl.constexpr,
                             SHARED: tl.constexpr, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             CVT: tl.constexpr, PDL: tl.constexpr):
        """Weights in FORMAT (``quant_tiles``): routed W, C, R (expert strides *_e), shared WS, CS, RS."""
        wait_prior(PDL)
        t = tl.program_id(0)
        nb = tl.program_id(1)
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        dt = OUT.dtype.element_ty
        # all top_k experts of token t at once: one [TOP_K_P, BLOCK_N, BLOCK_K] weight tile per K step
        # keeps top_k expert reads in flight (a loop over the experts issued them one after another)
        sel = tl.arange(0, TOP_K_P)
        sel_ok = sel < TOP_K
        p = t * TOP_K + sel
        e = tl.load(IDX + p, mask=sel_ok, other=0).to(tl.int64)
        w_base = W + e[:, None] * stride_we  # [TOP_K_P, 1] pointers; the rows' offsets beside them
        w_rows = rows[None, :] * stride_wn
        c_rows = e[:, None] * stride_ce + rows[None, :] * stride_cn
        ok = sel_ok[:, None] & row_ok[None, :]
        h_off = tl.where(sel_ok, p, 0) * K  # padded experts read a valid row (their weights are 0)
        acc = tl.zeros([TOP_K_P, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = x_step(H, h_off, k0, K, FORMAT, BLOCK_K)
            acc += weight_dot(w_base, C, w_rows, c_rows, ok, xs, k0, K, FORMAT, BLOCK_K, CVT)
        acc = row_scale(acc, R, e[:, None] * stride_re + rows[None, :], ok, FORMAT)
        tw = tl.load(TW + p, mask=sel_ok, other=0.0)  # padded experts weigh 0 (and their acc is 0)
        out = tl.sum(acc.to(dt).to(tl.float32) * tw[:, None], 0)  # each expert rounded as the reference's
        if SHARED:  # + sigmoid(logit[t]) * (W_shared_down @ h_shared[t]), the projection rounded as F.linear's
            acc_s = tl.zeros([BLOCK_N], tl.float32)
            hs_off = t * KS
            for k0 in range(0, KS, BLOCK_K):
                acc_s += weight_dot(WS, CS, rows * stride_ws, rows * stride_cs, row_ok,
                                    x_step(HS, hs_off, k0, KS, FORMAT, BLOCK_K), k0, KS, FORMAT, BLOCK_K, CVT)
            acc_s = row_scale(acc_s, RS, rows, row_ok, FORMAT)
            out += acc_s.to(dt).to(tl.float32) / (1.0 + tl.exp(-tl.load(SL + t)))
        tl.store(OUT + t * N + rows, out.to(dt), mask=row_ok)


class Routing(NamedTuple):
    """``route_topk``'s result: top-k weights (fp32) and expert ids (int32), both [T, k], largest
    first; and the shared expert's gate logits [T] (fp32) when its gate weight was given."""

    weights: torch.Tensor
    experts: torch.Tensor
    shared_logit: torch.Tensor | None


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, x: torch.Tensor | None = None,
               shared_gate: torch.Tensor | None = None, sigmoid_bias: torch.Tensor | None = None,
               scale: float = 1.0) -> Routing:
    """Softmax over router ``logits`` [T, E] and its top-k (renormalised if asked); with ``x`` [T, H]
    and ``shared_gate`` [1, H] also the shared expert's gate logit ``x @ shared_gate.T``. With
    ``sigmoid_bias`` [E]: Nemotron-H's sigmoid routing (``torch_relu2_moe.sigmoid_route``, one
    group), the weights times ``scale``."""
    T, E = logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"route_topk: top_k={top_k} must be in [1, {E}] (experts)")
    if sigmoid_bias is not None and sigmoid_bias.shape != (E,):
        raise ValueError(f"route_topk: sigmoid_bias {tuple(sigmoid_bias.shape)} must be [{E}] (experts)")
    shared = shared_gate is not None
    if shared and (x is None or x.shape[0] != T or shared_gate.shape != (1, x.shape[1])):
        raise ValueError(f"route_topk: shared_gate {tuple(shared_gate.shape)} must be [1, H] for x "
                         f"{None if x is None else tuple(x.shape)} of {T} tokens")
    w = torch.empty(T, top_k, device=logits.device, dtype=torch.float32)
    i = torch.empty(T, top_k, device=logits.device, dtype=torch.int32)
    sl = torch.empty(T, device=logits.device, dtype=torch.float32) if shared else None
    if T:
        xs = x.contiguous() if shared else w
        hid = x.shape[1] if shared else 1
        bias = w if sigmoid_bias is None else sigmoid_bias.contiguous()
        _route_topk_kernel[(T,)](logits.contiguous(), w, i, xs, shared_gate if shared else w, w if sl is None else sl,
                                 bias, E, hid, float(scale), TOP_K=top_k, K_P=triton.next_power_of_2(top_k),
                                 NORM=norm_topk_prob, SHARED=shared, SIGMOID=sigmoid_bias is not None,
                                 BLOCK_E=triton.next_power_of_2(E),
                                 BLOCK_H=min(1024, triton.next_power_of_2(hid)), **pdl(logits.device))
    return Routing(w, i, sl)


Weight = torch.Tensor | QuantWeight


def _experts(name: str, x: torch.Tensor, w: Weight, k_dim: int) -> KernelWeight:
    if len(w.shape) != 3 or w.shape[2] != k_dim:
        raise ValueError(f"{name}: weight {tuple(w.shape)} must be [E, N, {k_dim}] with unit stride on the last dim "
                         f"(x {tuple(x.shape)})")
    return kernel_weight(name, w)


def pair_tiles(fmt: int, act: int, big: bool, k: int) -> tuple[tuple[int, int], int, bool]:
    """The pair-wise GEMV's default ((BLOCK_N, BLOCK_K), num_warps, FMA) for weights of kernel format
    ``fmt`` (``quant_tiles``), activation ``act``, ``big`` (32 or more rows of pairs: a verify's) and
    ``k`` inputs; FP8's K step within its 128-input scale block (``_k_step``)."""
    fma = False
    if fmt == FLOAT:
        # 8 x 256 for a token's 8 pairs, 16 x 128 for a verify's 56: best on the H200 for the 35B
        # shape with the shared rows folded in (9.8 / 52.7 us; benchmarks/tune_moe.py)
        (bn, bk), warps = ((16, 128) if big else (8, 256)), 8
    elif fmt == NVFP4_CODE and not (act == RELU2 and big):
        # FMA products summed after the K loop, 8 x 256 at 4 warps (SwiGLU: K steps of 512 up to 2048
        # inputs). On an H100 (tune_moe.py --quantize nvfp4, h100/tuning/tune_moe_nvfp4_*.json) against
        # the best dot tiles: the 35B's SwiGLU 9.7 / 46.5 us at 1 / 7 tokens against 11.3 / 52.2, the
        # 122B's 21.0 / 139.8 against 26.5 / 160.6 (K 3072, where 8 x 512 took 25.4 at a token);
        # Nemotron-3-Super's 22 latent experts a token, up (ReLU²) 26.7 against 29.1, down 29.5 / 182.2
        # against 33.6 / 215.6
        (bn, bk), warps, fma = (8, 512 if act == SWIGLU and not big and k <= 2048 else 256), 4, True
    elif act != SWIGLU:
        # ungated quantized (one weight tile a K step, fewer registers): 28.5 / 185.2 us against 36.3 /
        # 243.8 at the gated tiles for Nemotron-3-Super's 22 experts of [2688, 1024] on the H200
        # (tune_moe.py --quantize nvfp4 --top-k 22); NVFP4's ReLU² verify keeps 32 x 256 (186.4 us
        # against 189.9 by FMA for Nemotron-3-Super's 8 tokens, H100)
        (bn, bk), warps = ((32, 256) if big else (8, 256)), 4
    else:
        # FP8 SwiGLU: the FMA form 16 x 128 at 8 warps for a token, dots 32 x 128 at 4 for a verify:
        # 13.0 / 42.0 us against 13.8 / 48.4 at the tiles before (dots 16 x 128, 8 / 4 warps; the 35B
        # shape on an H100, h100/tuning/tune_moe_fp8.json)
        (bn, bk), warps, fma = ((32, 128), 4, False) if big else ((16, 128), 8, True)
    return (bn, _k_step(fmt, bk)), warps, fma


def hfma_tiles(act: int, big: bool, k: int) -> tuple[tuple[int, int], int]:
    """``_pair_hfma_kernel``'s default ((BLOCK_N, BLOCK_K), num_warps) for activation ``act``, ``big``
    (a verify's 32 or more rows of pairs) and ``k`` inputs. A verify's: one warp over 8 rows, K steps
    of 1024 (SwiGLU) or 512, but ungated rows of up to 1024 inputs (``down_combine``'s pairs) two warps
    over 16 rows, K steps of 256; a token's: two warps, K steps of 512, over 4 rows for two weight tiles a
    step (SwiGLU) or long rows, 8 otherwise. On an H100 over weights read from HBM, with ``x_groups``
    (h100/tuning/tune_moe_nvfp4_hfma_*.json, the sweep's best or within 2%): the 35B's SwiGLU with
    its shared expert 8.2 / 27.7 us at 1 / 7 tokens, the 122B's 15.5 / 69.7; Nemotron-3-Super's 22
    latent experts, up 16.8 / 89.2 at 1 / 8 tokens, down 20.4 / 97.7 (the fp32 forms' defaults in the
    same runs: 10.4 / 47.0, 21.3 / 122.7, 26.8 / 186.3, 29.8 / 181.8). ``down_combine``'s pairs with
    the shared rows (h100/tuning/tune_moe_nvfp4_down_pairs_*.json): the 35B's 7 tokens 18.2 us at
    16 x 256 against 23.1 at 8 x 512 on one warp, the 122B's 8 tokens 46.2 against 46.6."""
    if big and act == LINEAR and k <= 1024:
        return (16, 256), 2
    if big:
        return (8, 1024 if act == SWIGLU else 512), 1
    return ((8 if act != SWIGLU and k <= 1024 else 4), 512), 2


def down_combine_tiles(fmt: int, tokens: int, top_k: int, k: int) -> tuple[tuple[int, int], int]:
    """``down_combine``'s default ((BLOCK_N, BLOCK_K), num_warps) for ``k`` inputs (the experts'
    intermediate size): its [top_k, BLOCK_N, BLOCK_K] weight tile is held in registers, so more
    experts a token take as many fewer rows."""
    if fmt == FLOAT:
        # 8 x 8 x 128 at 8 warps is 32 values a thread for top_k 8; best on the H200 at 1 and 7
        # tokens (5.1 / 31.0 us, vs 9.2 / 40.2 at 4 warps; benchmarks/tune_moe.py)
        (rows, bk), warps = (8, 128), 8
    elif fmt == NVFP4_CODE:
        # with the shared term, on an H100: the 35B's 512 inputs 8.8 / 35.1 us at 1 / 7 tokens against
        # 9.4 / 39.8 at 16 x 256 / 32 x 256 and 8 warps; the 122B's 1024 inputs 20.7 / 118.8 against
        # 23.2 / 123.1 (and 23.8 / 140.7 at the 35B's tiles; h100/tuning/tune_moe_nvfp4_down.json,
        # _122b_down.json). Over weights read from HBM (*_cold.json) still the best of the grid:
        # 10.5 / 35.2 and 22.5 / 118.5 us
        if tokens == 1:
            (rows, bk), warps = (8, 256), (8 if k <= 512 else 4)
        else:
            (rows, bk), warps = ((16, 128), 4) if k <= 512 else ((16, 256), 8)
    else:  # FP8: 8.6 / 27.0 us against 9.5 / 29.8 at 4 rows, 8 / 4 warps (the 35B shape on an H100, tune_moe_fp8.json)
        (rows, bk), warps = ((4, 128) if tokens == 1 else (16, 128)), 4
    return (max(2, rows * 8 // triton.next_power_of_2(top_k)), _k_step(fmt, bk)), warps


def _k_step(fmt: int, tile: int) -> int:
    """``tile``, at most one 128-input scale block for FP8 (whose steps must divide it)."""
    return min(tile, 128) if fmt == FP8_CODE else tile


def _block_k(kw: KernelWeight, tile: int, k: int) -> int:
    """The K step of a launch over ``k`` inputs: ``_k_step``, or under ``whole_tiles`` the whole K."""
    return launch_tile(_k_step(kw.format, tile), k, 128 if kw.format == FP8_CODE else 1024)


def swiglu_gemv(x: torch.Tensor, w_gate: Weight, w_up: Weight, idx: torch.Tensor, top_k: int = 1,
                **launch) -> torch.Tensor:
    """``silu(w_gate[idx[p]] @ x[p // top_k]) * (w_up[idx[p]] @ x[p // top_k])`` for every pair p.
    x [T, K]; w_gate, w_up [E, N, K] in x's dtype or quantized (``wmtp.quant``), same format and
    strides (views of one packed tensor are fine); idx [T * top_k]. Returns [T * top_k, N] in x's
    dtype. ``launch`` overrides BLOCK_N / BLOCK_K / num_warps / num_stages (``benchmarks/tune_moe.py``)."""
    return _swiglu_launch("swiglu_gemv", x, w_gate, w_up, idx, top_k, None, launch)[0]


def relu2_gemv(x: torch.Tensor, w_up: Weight, idx: torch.Tensor, top_k: int = 1, **launch) -> torch.Tensor:
    """``relu(w_up[idx[p]] @ x[p // top_k])^2`` for every pair p (ungated experts, Nemotron-H); the
    rest as ``swiglu_gemv``."""
    return _swiglu_launch("relu2_gemv", x, w_up, w_up, idx, top_k, None, launch, act=RELU2)[0]


def expert_gemv(name: str, h: torch.Tensor, w: Weight, idx: torch.Tensor, **launch) -> torch.Tensor:
    """``w[idx[p]] @ h[p]`` for every pair p, rounded to h's dtype: h [P, K], w [E, N, K], idx [P].
    Returns [P, N]."""
    return _swiglu_launch(name, h, w, w, idx, 1, None, launch, act=LINEAR)[0]


def swiglu_gemv_with_shared(x: torch.Tensor, w_gate: Weight, w_up: Weight, idx: torch.Tensor, top_k: int,
                            shared_gate: Weight, shared_up: Weight, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_gemv``'s routed rows and the shared expert's ``silu(shared_gate @ x[t]) *
    (shared_up @ x[t])`` for every token t, in one launch. shared_gate, shared_up [Ns, K] (the
    routed weights' format and strides; Ns may differ from the routed N). Returns the routed rows
    [T * top_k, N] and the shared rows [T, Ns], both contiguous views of one buffer."""
    return _swiglu_launch("swiglu_gemv_with_shared", x, w_gate, w_up, idx, top_k, (shared_gate, shared_up), launch)


def shared_fits(routed: Weight, *shared: Weight) -> bool:
    """Whether the shared expert's weights can ride in the routed experts' launches: one format
    (and float dtype) for all."""
    fmt = lambda w: w.format.name if isinstance(w, QuantWeight) else w.dtype  # noqa: E731
    return all(fmt(w) == fmt(routed) for w in shared)


def _check_shared_swiglu(name: str, routed: KernelWeight, sg: KernelWeight, su: KernelWeight) -> None:
    """The shared expert's gate / up weights share one pointer type and stride with the routed
    ones in the kernel: [Ns, K], unit-strided along K, the routed format, equal strides."""
    K = routed.k
    if len(sg.shape) != 2 or sg.k != K or sg.format != routed.format or sg.weight.dtype != routed.weight.dtype:
        raise ValueError(f"{name}: shared_gate {tuple(sg.shape)} {sg.weight.dtype} must be [Ns, {K}] in the routed "
                         f"experts' format ({routed.weight.dtype}) with unit stride on the last dim")
    if not same_layout(sg, su):
        raise ValueError(f"{name}: shared_up {tuple(su.shape)} must match shared_gate {tuple(sg.shape)}, "
                         f"its format and strides")


def _swiglu_launch(name: str, x: torch.Tensor, w_gate: Weight, w_up: Weight, idx: torch.Tensor,
                   top_k: int, shared: tuple[Weight, Weight] | None, launch: dict[str, int],
                   act: int = SWIGLU) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks and launches ``_swiglu_gemv_kernel`` over the P routed rows and, with ``shared``, the T
    shared-expert rows; returns (routed [P, N], shared [T, Ns] or None)."""
    T, K = x.shape
    g, u = _experts(name, x, w_gate, K), kernel_weight(name, w_up)
    if not same_layout(g, u):
        raise ValueError(f"{name}: w_up {tuple(w_up.shape)} must match w_gate {tuple(w_gate.shape)}, its format and strides")
    P = T * top_k
    if idx.shape != (P,):
        raise ValueError(f"{name}: idx {tuple(idx.shape)} must be [{P}] (tokens x top_k)")
    N = g.shape[1]
    sg, su = (kernel_weight(name, w) for w in shared) if shared is not None else (g, u)  # no shared rows: never read
    if shared is not None:
        _check_shared_swiglu(name, g, sg, su)
    Ts, Ns = (T, sg.shape[0]) if shared is not None else (0, N)
    buf = torch.empty(P * N + Ts * Ns, device=x.device, dtype=x.dtype)
    launch = dict(launch)
    hfma, ready = launch.pop("HFMA", None), all(hfma_ready(w, x) for w in (g, u, sg, su))
    if hfma and not ready:
        raise ValueError(f"{name}: HFMA=True needs NVFP4 weights (K a multiple of 32) against 16-bit x, "
                         f"read through the e4m3 decode; got {x.dtype} x, K={K}")
    if P + Ts and (ready and "FMA" not in launch and hfma_default(x.device) if hfma is None else hfma):
        _pair_hfma_launch(x, g, u, sg, su, idx, buf, top_k, act, Ts, Ns, launch)
    elif P + Ts:
        (bn, bk), warps, fma = pair_tiles(g.format, act, P + Ts >= 32, K)
        cfg = {"BLOCK_N": launch_tile(bn, max(N, Ns)), "BLOCK_K": _block_k(g, bk, K), "num_warps": warps, "FMA": fma,
               **launch}
        we, wn, ce, cn = g.strides()
        _swiglu_gemv_kernel[(P + Ts, triton.cdiv(max(N, Ns), cfg["BLOCK_N"]))](
            x.contiguous(), g.weight, u.weight, g.scale, u.scale, g.rows, u.rows, idx.contiguous(),
            sg.weight, su.weight, sg.scale, su.scale, sg.rows, su.rows, buf, P, N, Ns, K,
            we, wn, ce, cn, g.rows_stride(), sg.weight.stride(-2), sg.scale.stride(-2), TOP_K=top_k, FORMAT=g.format,
            ACT=act, **cfg, **e2m1_cvt(x.device), **pdl(x.device))
    return buf[:P * N].view(P, N), None if shared is None else buf[P * N:].view(T, Ns)


def _pair_hfma_launch(x: torch.Tensor, g: KernelWeight, u: KernelWeight, sg: KernelWeight, su: KernelWeight,
                      idx: torch.Tensor, buf: torch.Tensor, top_k: int, act: int, Ts: int, Ns: int,
                      launch: dict[str, int], shared_x_row: int = 0) -> None:
    """``_swiglu_launch``'s rows by ``_pair_hfma_kernel`` (every weight ``hfma_ready``) into ``buf``;
    the shared rows read x from row ``shared_x_row`` on."""
    K = x.shape[1]
    P, N = idx.numel(), g.shape[1]
    (bn, bk), warps = hfma_tiles(act, P + Ts >= 32, K)
    # one stage: Triton's software pipelining would stage the tiles through shared memory (5x slower)
    cfg = {"BLOCK_N": launch_tile(bn, max(N, Ns)), "BLOCK_K": max(32, launch_tile(bk, K, 512)), "num_warps": warps,
           "num_stages": 1, **launch}
    words = lambda w: w.weight.view(torch.int64)  # noqa: E731
    masked = bool(K % cfg["BLOCK_K"] or max(N, Ns) % cfg["BLOCK_N"] or (Ts and N != Ns))
    xw, inv = x_groups(x)
    we, wn, ce, cn = g.strides()
    _pair_hfma_kernel[(P + Ts, triton.cdiv(max(N, Ns), cfg["BLOCK_N"]))](
        xw, inv, words(g), words(u), g.scale, u.scale, g.rows, u.rows, idx.contiguous(), words(sg), words(su),
        sg.scale, su.scale, sg.rows, su.rows, buf, P, N, Ns, K, we // 8, wn // 8, ce, cn, g.rows_stride(),
        sg.weight.stride(-2) // 8, sg.scale.stride(-2), shared_x_row, TOP_K=top_k, ACT=act, MASKED=masked, **cfg,
        **e2m1_cvt(x.device), **pdl(x.device))


def down_combine(h: torch.Tensor, down: Weight, idx: torch.Tensor, top_w: torch.Tensor, top_k: int,
                 shared: tuple[torch.Tensor, Weight, torch.Tensor] | None = None, **launch) -> torch.Tensor:
    """``out[t] = sum_k top_w[t,k] * down[idx[t,k]] @ h[t*top_k + k]``, plus, with ``shared`` =
    (h_s [T, Ks], down_s [N, Ks], logit [T]), ``sigmoid(logit[t]) * down_s @ h_s[t]`` (the shared
    expert's down projection and gate, no separate GEMM). h [T * top_k, K]; down [E, N, K] in h's
    dtype or quantized (down_s in the same format); idx, top_w [T, top_k]. Returns [T, N] in h's
    dtype. ``launch`` as for ``swiglu_gemv``. Past ``MAX_FUSED_TOP_K`` experts a token and without a
    shared expert, or by pairs (``_down_pairs``, NVFP4 experts: ``HFMA=True`` in ``launch``, or by
    default where the f16x2 form is): each pair's row, and each token's shared row, by
    the pair-wise GEMV (``launch`` its tile), then ``combine_sorted``; the same rounding (each
    expert's row to h's dtype, the weighted sum in fp32)."""
    P, K = h.shape
    if top_k < 1 or P % top_k:
        raise ValueError(f"down_combine: h {tuple(h.shape)} must be [T * top_k, K] for top_k={top_k}")
    T = P // top_k
    d = _experts("down_combine", h, down, K)
    if idx.numel() != P or top_w.numel() != P:
        raise ValueError(f"down_combine: idx {tuple(idx.shape)} and top_w {tuple(top_w.shape)} must be "
                         f"[{T}, {top_k}] for h {tuple(h.shape)}")
    N = d.shape[1]
    ds = d
    if shared is not None:
        hs, ws, sl = shared
        ds = kernel_weight("down_combine", ws)
        if hs.shape[0] != T or ds.shape != (N, hs.shape[1]) or sl.numel() != T or ds.format != d.format:
            raise ValueError(f"down_combine: shared h {tuple(hs.shape)}, down {tuple(ds.shape)}, logit {tuple(sl.shape)} "
                             f"must be [{T}, Ks], [{N}, Ks] (unit stride on Ks, the routed format) and [{T}]")
    launch = dict(launch)
    hfma = launch.pop("HFMA", None)
    ready = hfma_ready(d, h) and hfma_ready(ds, h) and (shared is None or shared[0].shape[1] == K)
    if hfma and not ready:
        raise ValueError(f"down_combine: HFMA=True needs NVFP4 weights (K a multiple of 32) against 16-bit h, the "
                         f"shared h as wide as the routed one; got {h.dtype} h {tuple(h.shape)}"
                         + ("" if shared is None else f", shared h {tuple(shared[0].shape)}"))
    # by pairs: on an H100 (tune_moe.py --quantize nvfp4 --forms hfma --cases down_combine_shared,
    # h100/tuning/tune_moe_nvfp4_down_pairs_*.json) the 35B's 7 tokens with the shared expert 18.2 us
    # against the fused kernel's 35.1, the 122B's 8 tokens 46.2 against 119.1; a token 6.6 against
    # 10.5 (35B) and 11.2 against 22.5 (122B; *_down_pairs_token_*.json): the fused kernel's
    # [top_k, rows, groups, 8] byte tile puts a warp's threads along experts and rows, 8 bytes each
    if hfma or hfma is None and ready and hfma_default(h.device):
        return _down_pairs(h, d, ds, idx, top_w, top_k, shared, launch)
    if shared is None and top_k > MAX_FUSED_TOP_K:
        y = expert_gemv("down_combine", h, down, idx.reshape(-1), HFMA=hfma, **launch)
        return combine_sorted(y, None, top_w.reshape(T, top_k))
    out = torch.empty(T, N, device=h.device, dtype=h.dtype)
    if T:
        (rows, bk), warps = down_combine_tiles(d.format, T, top_k, K)
        cfg = {"BLOCK_N": launch_tile(rows, N), "BLOCK_K": _block_k(d, bk, K), "num_warps": warps, **launch}
        hs, sl = (out, out) if shared is None else (shared[0].contiguous(), shared[2].float().contiguous())
        we, wn, ce, cn = d.strides()
        _down_combine_kernel[(T, triton.cdiv(N, cfg["BLOCK_N"]))](
            h.contiguous(), d.weight, d.scale, d.rows, idx.contiguous(), top_w.float().contiguous(), hs,
            ds.weight, ds.scale, ds.rows, sl, out, N, K, hs.shape[-1], we, wn, ce, cn, d.rows_stride(),
            ds.weight.stride(-2), ds.scale.stride(-2), TOP_K=top_k, TOP_K_P=triton.next_power_of_2(top_k),
            SHARED=shared is not None, FORMAT=d.format, **cfg, **e2m1_cvt(h.device), **pdl(h.device))
    return out


def _down_pairs(h: torch.Tensor, d: KernelWeight, ds: KernelWeight, idx: torch.Tensor, top_w: torch.Tensor,
                top_k: int, shared: tuple[torch.Tensor, Weight, torch.Tensor] | None,
                launch: dict[str, int]) -> torch.Tensor:
    """``down_combine`` by ``_pair_hfma_kernel`` (every weight ``hfma_ready``): the P pairs' rows and
    the T shared rows (x: h, then the shared h) in one launch, then ``combine_sorted``."""
    P, K = h.shape
    T, N = P // top_k, d.shape[1]
    x, Ts = h, 0
    if shared is not None:
        hs, Ts = shared[0], T
        same = h.is_contiguous() and hs.is_contiguous() and h.dtype == hs.dtype and \
            h.untyped_storage().data_ptr() == hs.untyped_storage().data_ptr() and \
            hs.data_ptr() == h.data_ptr() + h.numel() * h.element_size()
        # swiglu_gemv_with_shared's rows follow each other in one buffer: read them as one tensor, no copy
        x = torch.as_strided(h, (P + T, K), (K, 1)) if same else torch.cat([h, hs])
    buf = torch.empty((P + Ts) * N, device=h.device, dtype=h.dtype)
    if P + Ts:
        _pair_hfma_launch(x, d, d, ds, ds, idx.reshape(-1), buf, 1, LINEAR, Ts, N, launch, shared_x_row=P)
    return combine_sorted(buf.view(P + Ts, N), None, top_w.reshape(T, top_k),
                          shared_logit=None if shared is None else shared[2])


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router (the reference): top-k weights (fp32, renormalised if ``norm_topk_prob``) and
    expert ids [N, k]."""
    probs = torch.softmax(F.linear(x, router_weight), dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w, top_i


def shared_expert_reference(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """``sigmoid(gate(x)) * down(silu(gate_proj(x)) * up_proj(x))`` in plain PyTorch (quantized
    weights through their reference dequantization)."""
    h = F.silu(F.linear(x, dense(shared.gate_proj, x.dtype))) * F.linear(x, dense(shared.up_proj, x.dtype))
    return torch.sigmoid(F.linear(x, shared.gate)) * F.linear(h, dense(shared.down_proj, x.dtype))


def shared_expert(x: torch.Tensor, shared: SharedExpert, gate_logit: torch.Tensor | None = None) -> torch.Tensor:
    """``shared_expert_reference``'s arithmetic through ``decode_linear``: quantized weights read by
    the skinny kernels, or for a prefill's GEMMs dequantized by the Triton kernel in one launch (the
    reference unpacks them with a dozen PyTorch ops a weight, every chunk). ``gate_logit`` [T]: the
    shared gate's logit where the router already computed it (``route_topk``)."""
    h = act_mul(decode_linear(x, shared.gate_proj), decode_linear(x, shared.up_proj), SILU)
    logit = decode_linear(x, shared.gate) if gate_logit is None else gate_logit.to(x.dtype)[:, None]
    return torch.sigmoid(logit) * decode_linear(h, shared.down_proj)


def moe_gemv(x: torch.Tensor, router_weight: torch.Tensor, gate_up: Weight, down: Weight, top_k: int,
             norm_topk_prob: bool, shared: SharedExpert | None = None) -> torch.Tensor:
    """Same contract as ``Backend.moe`` (softmax router, top-k SwiGLU experts, optional shared
    expert) at decode sizes, the experts in x's dtype or quantized: the router GEMM
    (``decode_linear``) and three launches (route + shared gate, routed and shared SwiGLU, down
    projections + combine). A shared expert in another format than the routed experts' runs
    through the linears instead."""
    r = route_topk(decode_linear(x, router_weight), top_k, norm_topk_prob, x, None if shared is None else shared.gate)
    inter = down.shape[-1]
    rows = (lambda w, s: w.rows(s)) if isinstance(gate_up, QuantWeight) else (lambda w, s: w[:, s])  # noqa: E731
    gate, up, idx = rows(gate_up, slice(0, inter)), rows(gate_up, slice(inter, None)), r.experts.view(-1)
    if shared is None or not shared_fits(gate_up, shared.gate_proj, shared.up_proj, shared.down_proj):
        out = down_combine(swiglu_gemv(x, gate, up, idx, top_k), down, r.experts, r.weights, top_k)
        return out if shared is None else out + shared_expert(x, shared, r.shared_logit)
    h, hs = swiglu_gemv_with_shared(x, gate, up, idx, top_k, shared.gate_proj, shared.up_proj)
    return down_combine(h, down, r.experts, r.weights, top_k, shared=(hs, shared.down_proj, r.shared_logit))


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM (CUTLASS) takes bf16 on CUDA GPUs of sm80+."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def combine_sorted(y_sorted: torch.Tensor, pos: torch.Tensor | None, top_w: torch.Tensor,
                   block_n: int = 256, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k top_w[t, k] * y[t * top_k + k]`` (fp32, rounded once to y's dtype) where pair p's row
    ``y[p]`` is ``y_sorted[pos[p]]``: the grouped GEMM's expert-sorted output combined in one read,
    without scattering it back to pair order or widening it to fp32 first. y_sorted [P, N]; pos [P],
    or None for rows already in pair order; top_w [T, top_k] fp32, P = T * top_k. With
    ``shared_logit`` [T], y_sorted holds T more rows, the shared expert's, each added times
    ``sigmoid(shared_logit[t])``. Returns [T, N]."""
    T, top_k = top_w.shape
    P = T * top_k
    rows, N = y_sorted.shape
    if rows != P + (0 if shared_logit is None else T) or (pos is not None and pos.shape != (P,)) or (
            shared_logit is not None and shared_logit.numel() != T):
        raise ValueError(f"combine_sorted: y_sorted {tuple(y_sorted.shape)}, pos {None if pos is None else tuple(pos.shape)} "
                         f"and shared_logit {None if shared_logit is None else tuple(shared_logit.shape)} must hold "
                         f"the {T} x {top_k} pairs of top_w {tuple(top_w.shape)} (and {T} shared rows)")
    out = torch.empty(T, N, device=y_sorted.device, dtype=y_sorted.dtype)
    if T:
        y = y_sorted.contiguous()
        sl = out if shared_logit is None else shared_logit.float().contiguous()
        _combine_sorted_kernel[(T, triton.cdiv(N, block_n))](y, y if pos is None else pos.contiguous(),
                                                           top_w.float().contiguous(), sl, out, P, N, TOP_K=top_k,
                                                           SORTED=pos is not None, SHARED=shared_logit is not None,
                                                           BLOCK_N=block_n, **pdl(out.device))
    return out


def routed_experts_grouped(x, router_weight, gate_up, down, top_k, norm_topk_prob,
                           shared: SharedExpert | None = None) -> torch.Tensor:
    """Same contract as ``Backend.moe`` for many tokens (prefill, large batches): softmax routing,
    then ``grouped_experts`` (SwiGLU)."""
    top_w, top_i = route(x, router_weight, top_k, norm_topk_prob)
    out = grouped_experts(x, gate_up, down, top_w, top_i, gated=True)
    return out if shared is None else out + shared_expert(x, shared)


def _grouped_mm(x: torch.Tensor, w: Weight, offs: torch.Tensor) -> torch.Tensor:
    """x's expert-sorted rows times their experts' ``w`` [E, N, K]: torch's grouped GEMM, quantized
    experts dequantized for it in one pass. A Triton grouped GEMM reading the packed NVFP4 experts
    inside its loop reached 0.41-0.60x of this on an H100 at 8K- and 16K-token chunks of the 35B
    shape (125 against 302 TFLOP/s at best; f5d33f0's ``tune_grouped.py``, ``h100/tuning/``): the dequantize
    pass costs less than Triton's wgmma falls short of CUTLASS's."""
    if isinstance(w, QuantWeight):
        w = dequantize(w, x.dtype)
    return F.grouped_mm(x, w.transpose(1, 2), offs=offs)


def grouped_experts(x: torch.Tensor, first: Weight, down: Weight, top_w: torch.Tensor,
                    top_i: torch.Tensor, gated: bool) -> torch.Tensor:
    """``sum_k top_w[t, k] * expert_{top_i[t, k]}(x[t])`` for many tokens: the (token, expert) pairs
    sorted by expert and each expert's rows through two grouped GEMMs (``first`` gate_up [E, 2I, H]
    for SwiGLU, up [E, I, H] for ReLU² when not ``gated``; down [E, H, I]; float or quantized).
    Expert offsets are counted on the device (no host sync, so it is graph-capturable too)."""
    top_k = top_i.shape[1]
    n_exp, inter = first.shape[0], down.shape[-1]
    flat = top_i.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_exp, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = _grouped_mm(x[order // top_k], first, offs)
    h = act_mul(h[:, :inter], h[:, inter:], SILU) if gated else F.relu(h).square()
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=x.device)
    return combine_sorted(_grouped_mm(h, down, offs), pos, top_w)


def relu2_moe_gemv(x: torch.Tensor, routing: SigmoidRouting, up: Weight, down: Weight,
                   latent_proj: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``Backend.relu2_moe`` at decode sizes (one router group): the router GEMM in fp32 over its
    16-bit weight (``fp32_linear``) and the sigmoid route, then ``latent_proj``'s launches, then
    two (ReLU² up per pair, down + combine)."""
    r = route_topk(fp32_linear(x, routing.weight), routing.top_k, routing.norm_topk_prob,
                   sigmoid_bias=routing.bias, scale=routing.scale)
    latent = x if latent_proj is None else latent_proj(x)
    h = relu2_gemv(latent, up, r.experts.view(-1), routing.top_k)
    return down_combine(h, down, r.experts, r.weights, routing.top_k)
