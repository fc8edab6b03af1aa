"""Weight tiles of the decode kernels (``linear``, ``moe``) in any of the model's weight formats: read
in the stored form and dequantized in registers (DESIGN §9: at decode sizes a projection is a weight
read, and 4 or 8 bits a weight read a quarter or half the bytes of bf16).

A kernel takes a weight as ``KernelWeight`` (``kernel_weight``): a FORMAT code and three tensors:
- ``FLOAT`` (0): the weight itself (scale tensors unused);
- ``NVFP4`` (1): packed e2m1 bytes [.., N, K/2] (input 2j in the low nibble, 2j + 1 in the high),
  fp8-e4m3 scales per 16 inputs [.., N, K/16], and the per-row fp32 second level [.., N];
- ``FP8`` (2): fp8-e4m3 weights [.., N, K] and fp32 scales per row and 128 inputs [.., N, K/128]
  (block FP8's, or per-tensor FP8's one scale repeated so).

``weight_dot`` is one K step of ``W[rows] @ x`` for rows of any shape, over the step's inputs that
``x_step`` loaded once for every weight reading them; the NVFP4 tile is loaded as [rows, groups, 8]
bytes (each group's 8 bytes contiguous: one vector load, its scale once) against the even and odd
inputs of x, and the group scale multiplies the group's sum; the second level
(``row_scale``) multiplies the row's total once. e2m1 codes decode by bit placement, not by a table
or exp2: on GPUs of compute capability 8.9+ (``e2m1_cvt``) into e4m3 bytes that one instruction
converts two at a time (``e2m1_pairs``), elsewhere into fp16 bits (``e2m1_values``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from wmtp.kernels.common import gpu_feature, pdl
from wmtp.quant import FP8Block, FP8Tensor, NVFP4, QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

FLOAT, NVFP4_CODE, FP8_CODE = 0, 1, 2


class KernelWeight(NamedTuple):
    """A weight as the kernels take it (module docstring): ``format`` code, the stored weight, its
    group scales and per-row scales (the weight again where the format has none), and K."""

    format: int
    weight: torch.Tensor
    scale: torch.Tensor
    rows: torch.Tensor
    k: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.k)

    def strides(self) -> tuple[int, int, int, int]:
        """(weight, scale) strides of the last two dims but one: the row stride of each, and of a
        leading (expert) dim when there is one (else 0)."""
        lead = (lambda t: t.stride(0) if t.dim() == 3 else 0)
        return lead(self.weight), self.weight.stride(-2), lead(self.scale), self.scale.stride(-2)

    def rows_stride(self) -> int:
        """The per-row scales' leading (expert) stride (their rows are unit-strided)."""
        return self.rows.stride(0) if self.rows.dim() == 2 else 0


def kernel_weight(name: str, w: torch.Tensor | QuantWeight) -> KernelWeight:
    """``w`` as the kernels take it; an error naming ``name`` where no kernel reads its format or
    its rows are not unit-strided."""
    if isinstance(w, QuantWeight):
        t = w.tensors
        if isinstance(w.format, NVFP4):
            kw = KernelWeight(NVFP4_CODE, t["weight"], t["weight_scale"], t["weight_scale_2"], w.in_features)
        elif isinstance(w.format, FP8Block) and w.format.block[1] == 128:
            kw = KernelWeight(FP8_CODE, t["weight"], t["weight_scale_inv"], t["weight_scale_inv"], w.in_features)
        elif isinstance(w.format, FP8Tensor):  # its per-tensor scale held in block FP8's per-row layout
            kw = KernelWeight(FP8_CODE, t["weight"], t["weight_scale"], t["weight_scale"], w.in_features)
        else:
            raise ValueError(f"{name}: no kernel reads {w.format.name} weights with blocks {getattr(w.format, 'block', None)}")
        if kw.rows.stride(-1) != 1 or kw.scale.stride(-1) != 1:
            raise ValueError(f"{name}: the {w.format.name} scales' rows must be unit-strided")
    else:
        kw = KernelWeight(FLOAT, w, w, w, w.shape[-1])
    if kw.weight.stride(-1) != 1:
        raise ValueError(f"{name}: weight {tuple(kw.shape)} must have unit stride on K")
    return kw


def e2m1_cvt(device: torch.device) -> dict[str, bool]:
    """The ``CVT`` launch argument of the kernels that read NVFP4 tiles at decode sizes: the e2m1
    codes decode through ``cvt.rn.f16x2.e4m3x2`` (``e2m1_pairs``) on CUDA devices of compute
    capability 8.9+; off under the CPU interpreter and with ``WMTP_E2M1_CVT=0``. Both decodes give
    the same values: the kernels' results do not depend on it."""
    return {"CVT": gpu_feature(device, (8, 9), "WMTP_E2M1_CVT")}


def quant_mma() -> bool:
    """Whether the quantized decode kernels' default tiles take the weight as the dot's first operand
    (``weight_tile_mma``): with ``WMTP_QUANT_MMA=1`` only, until timed against ``weight_tile_dot`` /
    ``weight_dot`` on a GPU (``benchmarks/ab_step.sh env``)."""
    return os.environ.get("WMTP_QUANT_MMA") == "1"


def mma_words(kw: KernelWeight) -> KernelWeight:
    """``kw`` as ``weight_tile_mma`` reads it: NVFP4's packed bytes as int32 words (4 bytes, 8
    inputs; K a multiple of 16 keeps every row and expert word-aligned), other formats as they are."""
    return kw._replace(weight=kw.weight.view(torch.int32)) if kw.format == NVFP4_CODE else kw


def same_layout(a: KernelWeight, b: KernelWeight) -> bool:
    """Whether one kernel argument set (format, dtypes, strides) can stand for both ``a`` and ``b``."""
    return (a.format == b.format and a.weight.dtype == b.weight.dtype and a.shape == b.shape
            and a.strides() == b.strides() and a.rows_stride() == b.rows_stride())


# PTX shared by the e4m3-conversion decodes: the packed bytes in $B (4 bytes, 8 e2m1 values) ->
# p0..p3 (f16x2: the low nibbles of bytes 0,1 and 2,3, then the high nibbles), each value / 64
_E2M1_E4M3 = """
.reg .b32 lo, hi, t, p<4>;
.reg .b16 l<2>, h<2>;
and.b32 lo, $B, 0x07070707;
shl.b32 lo, lo, 2;
and.b32 t, $B, 0x08080808;
shl.b32 t, t, 4;
or.b32 lo, lo, t;
shr.u32 hi, $B, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 t, $B, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 p0, l0;
cvt.rn.f16x2.e4m3x2 p1, l1;
cvt.rn.f16x2.e4m3x2 p2, h0;
cvt.rn.f16x2.e4m3x2 p3, h1;
"""

if triton is not None:
    from wmtp.kernels.common import wait_prior

    # e2m1_pairs' PTX: _E2M1_E4M3's f16 pairs widened to fp32
    _PAIRS_F32 = tl.constexpr("{\n.reg .b16 f<8>;\n" + _E2M1_E4M3.replace("$B", "$8") + "".join(
        f"mov.b32 {{f{2 * i}, f{2 * i + 1}}}, p{i};\n" for i in range(4)) + "".join(
        f"cvt.f32.f16 ${i}, f{i};\n" for i in range(8)) + "}")
    # e2m1_word's PTX: the f16 pairs times the word's f16 scale ($9), out as 8 f16 values
    _WORD_F16_SCALED = tl.constexpr("{\n.reg .b32 sc;\nmov.b32 sc, {$9, $9};\n" + _E2M1_E4M3.replace("$B", "$8") +
                                    "".join(f"mul.rn.f16x2 p{i}, p{i}, sc;\nmov.b32 {{${2 * i}, ${2 * i + 1}}}, p{i};\n"
                                            for i in range(4)) + "}")

    @triton.jit
    def _e2m1_f16(codes):
        """e2m1 codes (uint8, 0..15; bit 3 the sign) -> their values times 2^-14 in fp32: the
        magnitude bits e e m placed as an fp16's lowest exponent bits and first mantissa bit give
        2^(e-15)(1 + m/2), or the subnormal m 2^-15 for e = 0."""
        c = codes.to(tl.uint16)
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def e2m1_values(codes):
        """e2m1 codes -> their fp32 values."""
        return _e2m1_f16(codes) * 16384.0

    @triton.jit
    def e2m1_pairs(b, CVT: tl.constexpr):
        """Each packed byte's two e2m1 values (low nibble, high nibble) in fp32, divided by 64 (the
        callers fold the 64 into the group scale: a power of 2, exact). With CVT each nibble's bits go
        where an e4m3 byte has them (s to bit 7, e e m to bits 4..2), which encodes the value / 64,
        subnormals included; four bytes' nibbles move at once in one 32-bit register and
        ``cvt.rn.f16x2.e4m3x2`` converts two values an instruction (sm_89+), against about ten
        integer and float ops a value for the fp16 bit placement, which bound the NVFP4 GEMVs."""
        if CVT:
            return tl.inline_asm_elementwise(
                asm=_PAIRS_F32,
                constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
                args=[b], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            return _e2m1_f16(b & 15) * 256.0, _e2m1_f16(b >> 4) * 256.0

    @triton.jit
    def e2m1_word(w, sc, CVT: tl.constexpr, DTYPE: tl.constexpr):
        """The 8 inputs of each packed int32 word of ``w`` [R, C] (4 bytes, 2 e2m1 values each), in
        input order, times ``sc`` / 4 (``sc``: the words' group scales, w's shape) in DTYPE: [R, 8 C]. Exact: a value's 2 significant bits times an e4m3 scale's 4 fit fp16's 11,
        and / 4 keeps the smallest product (2^-12) normal in fp16 and the largest (672) in range.
        With CVT (``e2m1_pairs``' conversion) a word takes 4 ``cvt`` and 4 ``mul.rn.f16x2``."""
        if CVT:
            s16 = (sc.to(tl.float32) * 16.0).to(tl.float16)  # at most 7168: fp16 holds it
            lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = tl.inline_asm_elementwise(
                asm=_WORD_F16_SCALED, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h", args=[w, s16],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            s = sc.to(tl.float32) * 4096.0  # _e2m1_f16's 2^-14, and the / 4
            lo0 = (_e2m1_f16(w & 15) * s).to(DTYPE)
            hi0 = (_e2m1_f16((w >> 4) & 15) * s).to(DTYPE)
            lo1 = (_e2m1_f16((w >> 8) & 15) * s).to(DTYPE)
            hi1 = (_e2m1_f16((w >> 12) & 15) * s).to(DTYPE)
            lo2 = (_e2m1_f16((w >> 16) & 15) * s).to(DTYPE)
            hi2 = (_e2m1_f16((w >> 20) & 15) * s).to(DTYPE)
            lo3 = (_e2m1_f16((w >> 24) & 15) * s).to(DTYPE)
            hi3 = (_e2m1_f16((w >> 28) & 15) * s).to(DTYPE)
        # byte i holds inputs 2i (low nibble) and 2i + 1; each join adds the fastest-varying dim, so the
        # outermost picks lo / hi, the next byte 0 or 1 of a pair, the innermost the pair
        v = tl.join(tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3)), tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3)))
        return tl.reshape(v, (w.shape[0], w.shape[1] * 8))

    @triton.jit
    def x_pow2(X, stride_xt, ts, t_ok, k_lo, k_hi, BLOCK_K: tl.constexpr):
        """Per row of ``X[ts, k_lo:k_hi]``, the power of 2 that takes its largest |x| into
        [2^13, 2^14) (fp32, [len(ts)]): x times it converts to fp16 without overflow, and keeps
        every element above 2^-27 of the row's largest a normal fp16 (all-zero rows: 1)."""
        m = tl.zeros([ts.shape[0], BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(X + ts[:, None] * stride_xt + ks[None, :], mask=t_ok[:, None] & (ks < k_hi)[None, :], other=0.0)
            m = tl.maximum(m, tl.abs(xv.to(tl.float32)))
        e = ((tl.max(m, 1).to(tl.int32, bitcast=True) >> 23) & 255) - 127  # the exponent of the largest
        e = tl.where(e < -100, 0, e)
        return ((127 + 13 - e) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def weight_tile_mma(X, W, S, stride_xt, stride_wn, stride_sn, ts, t_ok, xs, cols, col_ok, k0, K, acc,
                        FORMAT: tl.constexpr, PREC: tl.constexpr, BLOCK_K: tl.constexpr, CVT: tl.constexpr):
        """``weight_tile_dot`` with the operands swapped, for NVFP4 and FP8: ``acc [len(cols), len(ts)] + weight[cols,
        k0:k0+BLOCK_K] @ (X[ts, k0:k0+BLOCK_K] * xs[ts]).T``. The dequantized weight tile is the
        dot's first operand, which Hopper's wgmma reads from registers (64 and more columns at 4
        warps), so it is dequantized where it is loaded and the x tile goes to shared memory once for
        the program rather than once a warp. 16-bit x runs in fp16 (``xs`` from ``x_pow2``, so no
        row overflows), fp32 x in fp32: the weight values are exact in either (``e2m1_word``;
        e4m3 in fp16). NVFP4's W is its bytes viewed as int32 words (stride_wn in words). The caller
        divides by ``xs`` (and for NVFP4 multiplies by 4: ``e2m1_word``)."""
        DT: tl.constexpr = tl.float32 if X.dtype.element_ty == tl.float32 else tl.float16
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xv = tl.load(X + ts[None, :] * stride_xt + ks[:, None], mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        xv = (xv.to(tl.float32) * xs[None, :]).to(DT)
        if FORMAT == 1:  # W: the packed bytes as int32 words, stride_wn in words
            j = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            j_ok = col_ok[:, None] & (j < K // 8)[None, :]
            wd = tl.load(W + cols[:, None] * stride_wn + j[None, :], mask=j_ok, other=0)
            sc = tl.load(S + cols[:, None] * stride_sn + (j // 2)[None, :], mask=j_ok, other=0.0)
            return tl.dot(e2m1_word(wd, sc, CVT, DT), xv, acc, input_precision=PREC)
        else:
            wv = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(wv.to(DT), xv, input_precision=PREC)
            return acc + part * tl.load(S + cols * stride_sn + k0 // 128, mask=col_ok, other=0.0)[:, None]

    @triton.jit
    def x_step(X, x_off, k0, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
        """The inputs ``weight_dot`` multiplies in K step ``[k0, k0 + BLOCK_K)``, in fp32, loaded once
        for every weight that reads them: ``X[x_off + k]`` for ``x_off`` of the weight rows' shape
        less the last dim (a scalar for one vector). Float / FP8: [.., BLOCK_K] (and the same again);
        NVFP4: the even and odd inputs of each packed byte, [.., BLOCK_K / 16, 8] each."""
        if FORMAT == 1:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 16)[:, None] * 8 + tl.arange(0, 8)[None, :]
            xp = X + tl.expand_dims(tl.expand_dims(x_off, -1), -1) + 2 * kb
            kb_ok = kb < K // 2
            return (tl.load(xp, mask=kb_ok, other=0.0).to(tl.float32),
                    tl.load(xp + 1, mask=kb_ok, other=0.0).to(tl.float32))
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(X + tl.expand_dims(x_off, -1) + ks, mask=ks < K, other=0.0).to(tl.float32)
            return xv, xv

    @triton.jit
    def weight_dot(W, S, w_rows, s_rows, row_ok, xs, k0, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                   CVT: tl.constexpr):
        """fp32 ``sum_k weight[row, k] * x[k]`` over ``k`` in ``[k0, k0 + BLOCK_K)`` (and < K) for
        every row: ``w_rows`` / ``s_rows`` the rows' offsets into W / S (any shape; W may be a tensor of
        pointers broadcastable to it, as an expert's base beside its rows' offsets), ``xs`` the step's
        inputs (``x_step``, one row of x per row of ``w_rows`` less its last dim). Group scales
        applied, not NVFP4's per-row second level (``row_scale``). FP8: BLOCK_K divides 128. CVT:
        ``e2m1_pairs``."""
        ok = tl.expand_dims(row_ok, -1)
        xe, xo = xs
        if FORMAT == 1:
            G: tl.constexpr = BLOCK_K // 16
            g = tl.arange(0, G)
            kb = k0 // 2 + g[:, None] * 8 + tl.arange(0, 8)[None, :]  # [G, 8] bytes: inputs 2kb, 2kb + 1
            b = tl.load(tl.expand_dims(tl.expand_dims(W + w_rows, -1), -1) + kb,
                        mask=tl.expand_dims(ok, -1) & (kb < K // 2), other=0)
            xe, xo = tl.expand_dims(xe, -3), tl.expand_dims(xo, -3)  # beside the rows
            lo, hi = e2m1_pairs(b, CVT)
            part = tl.sum(lo * xe + hi * xo, -1)
            gs = k0 // 16 + g
            sc = tl.load(S + tl.expand_dims(s_rows, -1) + gs, mask=ok & (gs < K // 16), other=0.0)
            return tl.sum(part * (sc.to(tl.float32) * 64.0), -1)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(tl.expand_dims(W + w_rows, -1) + ks, mask=ok & (ks < K), other=0.0).to(tl.float32)
            acc = tl.sum(w * tl.expand_dims(xe, -2), -1)
            if FORMAT == 2:
                acc = acc * tl.load(S + s_rows + k0 // 128, mask=row_ok, other=0.0)
            return acc

    @triton.jit
    def row_scale(acc, R, r_rows, row_ok, FORMAT: tl.constexpr):
        """``acc`` (rows' sums, broadcastable to ``r_rows``' shape) times NVFP4's per-row second-level
        scale at ``R + r_rows``; other formats have none (no op: the float kernels stay as they were)."""
        if FORMAT == 1:
            acc = acc * tl.load(R + r_rows, mask=row_ok, other=0.0)
        return acc

    @triton.jit
    def weight_tile_dot(X, W, S, stride_xt, stride_wn, stride_sn, ts, t_ok, cols, col_ok, k0, K, acc,
                        FORMAT: tl.constexpr, WIDEN: tl.constexpr, PREC: tl.constexpr, BLOCK_K: tl.constexpr,
                        CVT: tl.constexpr):
        """``acc + X[ts, k0:k0+BLOCK_K] @ weight[cols, k0:k0+BLOCK_K].T`` by tensor-core dots (rows of X
        padded to the dot's 16): the weight tile dequantized to X's dtype first, where it is exact
        (an NVFP4 value times its fp8 scale has at most 7 significant bits, an fp8 value 4); FP8's
        block scale (BLOCK_K divides 128) multiplies the step's dot. NVFP4's second level: not here."""
        BN: tl.constexpr = cols.shape[0]
        if FORMAT == 1:
            G: tl.constexpr = BLOCK_K // 16
            g = tl.arange(0, G)
            kb = k0 // 2 + g[:, None] * 8 + tl.arange(0, 8)[None, :]
            kb_ok = kb < K // 2
            b = tl.load(W + cols[:, None, None] * stride_wn + kb, mask=col_ok[:, None, None] & kb_ok, other=0)
            gs = k0 // 16 + g
            sc = tl.load(S + cols[:, None] * stride_sn + gs[None, :], mask=col_ok[:, None] & (gs < K // 16)[None, :],
                         other=0.0).to(tl.float32)[:, :, None] * 64.0  # e2m1_pairs' values are / 64
            h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            x_ok = t_ok[:, None] & (h < K // 2)[None, :]
            xe = tl.load(X + ts[:, None] * stride_xt + 2 * h[None, :], mask=x_ok, other=0.0)
            xo = tl.load(X + ts[:, None] * stride_xt + 2 * h[None, :] + 1, mask=x_ok, other=0.0)
            lo, hi = e2m1_pairs(b, CVT)
            lo = tl.reshape(lo * sc, (BN, BLOCK_K // 2))
            hi = tl.reshape(hi * sc, (BN, BLOCK_K // 2))
            if WIDEN:
                xe = xe.to(tl.float32)
                xo = xo.to(tl.float32)
            acc = tl.dot(xe, tl.trans(lo.to(xe.dtype)), acc, input_precision=PREC)
            return tl.dot(xo, tl.trans(hi.to(xo.dtype)), acc, input_precision=PREC)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xv = tl.load(X + ts[:, None] * stride_xt + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            wv = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if WIDEN:
                xv = xv.to(tl.float32)
                wv = wv.to(tl.float32)
            if FORMAT == 2:
                sc = tl.load(S + cols * stride_sn + k0 // 128, mask=col_ok, other=0.0)
                return acc + tl.dot(xv, tl.trans(wv.to(xv.dtype)), input_precision=PREC) * sc[None, :]
            else:
                return tl.dot(xv, tl.trans(wv), acc, input_precision=PREC)

    @triton.jit
    def _dequantize_kernel(W, S, R, OUT, K, stride_w, stride_s, FORMAT: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """OUT[r, k] = value(r, k) * group scale (* NVFP4's row scale), in the twin's order and dtype."""
        wait_prior(PDL)
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = (ks < K)[None, :]
        if FORMAT == 1:
            b = tl.load(W + rows[:, None] * stride_w + ks[None, :] // 2, mask=m, other=0)
            v = e2m1_values(tl.where(ks[None, :] % 2 == 0, b & 15, b >> 4))
            v = v * tl.load(S + rows[:, None] * stride_s + ks[None, :] // 16, mask=m, other=0.0).to(tl.float32)
            v = v * tl.load(R + rows)[:, None]
        else:
            v = tl.load(W + rows[:, None] * stride_w + ks[None, :], mask=m, other=0.0).to(tl.float32)
            v = v * tl.load(S + rows[:, None] * stride_s + ks[None, :] // 128, mask=m, other=0.0)
        tl.store(OUT + rows[:, None] * K + ks[None, :], v.to(OUT.dtype.element_ty), mask=m)


def dequantize(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """``w.dequantize(dtype)`` (its twin, equal to the bit) in one pass: the packed bytes and scales
    read once, the [.., N, K] weight written once. What prefill-sized GEMMs over quantized weights
    read; the PyTorch twin's unpack / table / repeat_interleave temporaries are fp32 and int64 tensors
    several times the weight's bytes."""
    kw = kernel_weight("dequantize", w)
    lead = kw.weight.shape[:-1]
    rows = kw.weight.numel() // kw.weight.shape[-1]
    flat = {n: t.reshape(rows, -1) for n, t in (("w", kw.weight), ("s", kw.scale))}
    out = torch.empty(*lead, kw.k, device=kw.weight.device, dtype=dtype)
    if rows and kw.k:
        block_r = 4 if rows % 4 == 0 else 1  # rows divide the tile: no row mask
        _dequantize_kernel[(rows // block_r, triton.cdiv(kw.k, 512))](
            flat["w"], flat["s"], kw.rows.reshape(rows) if kw.format == NVFP4_CODE else flat["s"], out, kw.k,
            flat["w"].stride(0), flat["s"].stride(0),
            FORMAT=kw.format, BLOCK_R=block_r, BLOCK_K=512, **pdl(kw.weight.device))
    return out
