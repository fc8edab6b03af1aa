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
(``row_scale``) multiplies the row's total once; ``weight_fma`` is the same step with the products
kept per input position and summed after the K loop. ``weight_tile_dot`` is a K step of the skinny
linears' tensor-core dot: the weight tile dequantized exactly to fp16 (``e2m1_scaled_f16``) against
x scaled into fp16 by a power of 2 per row (``f16_rows``). e2m1 codes decode by bit placement, not
by a table or exp2: on GPUs of compute capability 8.9+ (``e2m1_cvt``) into e4m3 bytes that one
instruction converts two at a time (``e2m1_pairs``, ``e2m1_scaled_f16``), elsewhere into fp16 bits
(``_e2m1_f16``). ``hfma_step`` is a K step of the pair-wise MoE GEMV over NVFP4 weights against
16-bit x by f16x2 FMAs, x laid out in fp16 beforehand (``x_groups``).
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


def same_layout(a: KernelWeight, b: KernelWeight) -> bool:
    """Whether one kernel argument set (format, dtypes, strides) can stand for both ``a`` and ``b``."""
    return (a.format == b.format and a.weight.dtype == b.weight.dtype and a.shape == b.shape
            and a.strides() == b.strides() and a.rows_stride() == b.rows_stride())


if triton is not None:
    from wmtp.kernels.common import wait_prior

    # PTX of the e2m1 decode (``e2m1_pairs``, ``e2m1_scaled_f16``): the nibbles of four packed bytes
    # (register IN) moved where e4m3 bytes have their bits, then converted two an instruction: p0, p1
    # the low nibbles' f16x2 pairs (bytes 0-1, 2-3), p2, p3 the high nibbles'
    _E2M1_TO_F16X2 = """
    .reg .b32 lo, hi, t, p<4>;
    .reg .b16 l<2>, h<2>, f<8>;
    and.b32 lo, IN, 0x07070707;
    shl.b32 lo, lo, 2;
    and.b32 t, IN, 0x08080808;
    shl.b32 t, t, 4;
    or.b32 lo, lo, t;
    shr.u32 hi, IN, 2;
    and.b32 hi, hi, 0x1C1C1C1C;
    and.b32 t, IN, 0x80808080;
    or.b32 hi, hi, t;
    mov.b32 {l0, l1}, lo;
    mov.b32 {h0, h1}, hi;
    cvt.rn.f16x2.e4m3x2 p0, l0;
    cvt.rn.f16x2.e4m3x2 p1, l1;
    cvt.rn.f16x2.e4m3x2 p2, h0;
    cvt.rn.f16x2.e4m3x2 p3, h1;
    """
    # eight fp32 outputs ($0..$7: the low nibbles' values, then the high ones') from input $8
    _E2M1_PAIRS_F32 = tl.constexpr("{" + _E2M1_TO_F16X2.replace("IN", "$8") + """
    mov.b32 {f0, f1}, p0;
    mov.b32 {f2, f3}, p1;
    mov.b32 {f4, f5}, p2;
    mov.b32 {f6, f7}, p3;
    cvt.f32.f16 $0, f0;
    cvt.f32.f16 $1, f1;
    cvt.f32.f16 $2, f2;
    cvt.f32.f16 $3, f3;
    cvt.f32.f16 $4, f4;
    cvt.f32.f16 $5, f5;
    cvt.f32.f16 $6, f6;
    cvt.f32.f16 $7, f7;
    }""")
    # four f16x2 outputs ($0, $1 low nibbles, $2, $3 high) from input $4, times the scales $5, $6
    _E2M1_SCALED_F16 = tl.constexpr("{" + _E2M1_TO_F16X2.replace("IN", "$4") + """
    mul.rn.f16x2 $0, p0, $5;
    mul.rn.f16x2 $1, p1, $6;
    mul.rn.f16x2 $2, p2, $5;
    mul.rn.f16x2 $3, p3, $6;
    }""")

    # one NVFP4 group (16 inputs) of ``hfma_group``: $1 its 8 packed bytes, $2..$5 its x in fp16 as
    # ``x_groups`` lays them out (even inputs 0-6, 8-14, odd inputs 1-7, 9-15), $6 the group scale,
    # $7 the accumulator in; each word's products summed by f16x2 FMAs (p0..p3 pair inputs (0, 2),
    # (4, 6), (1, 3), (5, 7) of its 8), the 16 summed once in fp32, times the scale, into $0
    _HFMA_GROUP = tl.constexpr(
        "{\n.reg .b32 w0, w1, s, u, e<4>, o<4>;\n.reg .b16 sl, sh;\n.reg .f32 f0, f1;\n"
        "mov.b64 {w0, w1}, $1;\nmov.b64 {e0, e1}, $2;\nmov.b64 {e2, e3}, $3;\nmov.b64 {o0, o1}, $4;\n"
        "mov.b64 {o2, o3}, $5;\n{" + _E2M1_TO_F16X2.replace("IN", "w0") + """
    mul.rn.f16x2 s, p0, e0;
    fma.rn.f16x2 s, p1, e1, s;
    fma.rn.f16x2 s, p2, o0, s;
    fma.rn.f16x2 s, p3, o1, s;
    }
    {""" + _E2M1_TO_F16X2.replace("IN", "w1") + """
    mul.rn.f16x2 u, p0, e2;
    fma.rn.f16x2 u, p1, e3, u;
    fma.rn.f16x2 u, p2, o2, u;
    fma.rn.f16x2 u, p3, o3, u;
    }
    add.rn.f16x2 s, s, u;
    mov.b32 {sl, sh}, s;
    cvt.f32.f16 f0, sl;
    cvt.f32.f16 f1, sh;
    add.f32 f0, f0, f1;
    fma.rn.f32 $0, f0, $6, $7;
    }""")

    @triton.jit
    def _e2m1_f16(codes):
        """e2m1 codes (uint8, 0..15; bit 3 the sign) -> their values times 2^-14 in fp32: the
        magnitude bits e e m placed as an fp16's lowest exponent bits and first mantissa bit give
        2^(e-15)(1 + m/2), or the subnormal m 2^-15 for e = 0."""
        c = codes.to(tl.uint16)
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def e2m1_pairs(b, CVT: tl.constexpr):
        """Each packed byte's two e2m1 values (low nibble, high nibble) in fp32, divided by 64 (the
        callers fold the 64 into the group scale: a power of 2, exact). With CVT each nibble's bits go
        where an e4m3 byte has them (s to bit 7, e e m to bits 4..2), which encodes the value / 64,
        subnormals included; four bytes' nibbles move at once in one 32-bit register and
        ``cvt.rn.f16x2.e4m3x2`` converts two values an instruction (sm_89+), against about ten
        integer and float ops a value for the fp16 bit placement, which bound the NVFP4 GEMVs."""
        if CVT:
            return tl.inline_asm_elementwise(asm=_E2M1_PAIRS_F32, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
                                             args=[b], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            return _e2m1_f16(b & 15) * 256.0, _e2m1_f16(b >> 4) * 256.0

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
    def weight_fma(W, S, w_rows, s_rows, row_ok, xs, k0, K, acc, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                   CVT: tl.constexpr):
        """``acc`` plus K step ``[k0, k0 + BLOCK_K)``'s products of every row's weights (group scales
        applied) and the step's inputs ``xs`` (``x_step``), kept per input position: NVFP4 [rows,
        BLOCK_K / 16, 8] (each byte's even and odd input summed), FP8 and float [rows, BLOCK_K]. The
        sum over K (``fma_sum``) waits for the caller's end of the loop: a step moves nothing between
        threads, and the weight never passes through shared memory (the tensor-core tiles' fp16
        weights do, twice: ncu on an H100 found ``skinny_linear``'s one-row NVFP4 launch bound by L1 /
        shared-memory traffic at 80% of its peak, DRAM at 17%: ``h100/tuning/ncu_skinny_linear_nvfp4.txt``).
        Products exact (fp16 weight times fp32 x), accumulated in fp32."""
        ok = tl.expand_dims(row_ok, -1)
        xe, xo = xs
        if FORMAT == 1:
            G: tl.constexpr = BLOCK_K // 16
            g = tl.arange(0, G)
            kb = k0 // 2 + g[:, None] * 8 + tl.arange(0, 8)[None, :]
            b = tl.load(tl.expand_dims(tl.expand_dims(W + w_rows, -1), -1) + kb,
                        mask=tl.expand_dims(ok, -1) & (kb < K // 2), other=0)
            sc = tile_scales(S, s_rows, row_ok, k0, K, FORMAT, BLOCK_K)
            lo, hi = e2m1_scaled_f16(b, tl.broadcast_to(tl.expand_dims(sc, -1), b.shape), CVT)
            return acc + lo.to(tl.float32) * tl.expand_dims(xe, -3) + hi.to(tl.float32) * tl.expand_dims(xo, -3)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(tl.expand_dims(W + w_rows, -1) + ks, mask=ok & (ks < K), other=0.0).to(tl.float32)
            if FORMAT == 2:
                w = w * tl.expand_dims(tile_scales(S, s_rows, row_ok, k0, K, FORMAT, BLOCK_K), -1)
            return acc + w * tl.expand_dims(xe, -2)

    @triton.jit
    def fma_sum(acc, FORMAT: tl.constexpr):
        """A ``weight_fma`` accumulator's rows summed: [rows]."""
        if FORMAT == 1:
            return tl.sum(tl.sum(acc, 2), 1)
        else:
            return tl.sum(acc, 1)

    @triton.jit
    def row_scale(acc, R, r_rows, row_ok, FORMAT: tl.constexpr):
        """``acc`` (rows' sums, broadcastable to ``r_rows``' shape) times NVFP4's per-row second-level
        scale at ``R + r_rows``; other formats have none (no op: the float kernels stay as they were)."""
        if FORMAT == 1:
            acc = acc * tl.load(R + r_rows, mask=row_ok, other=0.0)
        return acc

    @triton.jit
    def e2m1_scaled_f16(b, scale, CVT: tl.constexpr):
        """Each packed byte's two e2m1 values times their group's ``scale`` (fp16, broadcast to b's
        shape, the e4m3 scale times 64) as fp16: exact, since the product has at most 6 significant
        bits between 2^-10 and 2688. With CVT the nibbles become e4m3 bytes (``e2m1_pairs``), one
        instruction converts two to an f16x2 and one f16x2 multiply scales them: no fp32 on the way,
        which left the tensor-core linears issuing about 18 instructions a weight byte."""
        if CVT:
            return tl.inline_asm_elementwise(asm=_E2M1_SCALED_F16, constraints="=r,=r,=r,=r,r,r,r",
                                             args=[b, scale], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:  # the fp16 bit placement's value * 2^-14, times 256: value / 64 (exact, subnormals too)
            return (_e2m1_f16(b & 15).to(tl.float16) * 256.0) * scale, (_e2m1_f16(b >> 4).to(tl.float16) * 256.0) * scale

    @triton.jit
    def f16_rows(xv):
        """x [rows, k] (16-bit or fp32) times a power of 2 per row that puts its largest |x| in
        [2^14, 2^15), as fp16 (exact for 16-bit x down to 2^-38 of the row's largest), and the
        inverse powers [rows, 1] in fp32: an fp16 dot of it, times the inverse, is the dot of x."""
        xf = xv.to(tl.float32)
        up, down = _f16_powers(tl.max(tl.abs(xf), 1))
        return (xf * up[:, None]).to(tl.float16), down[:, None]

    @triton.jit
    def _f16_powers(amax):
        """The power of 2 that puts ``amax`` in [2^14, 2^15) (at most 2^126), and its inverse."""
        eb = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 255, 15)  # amax < 2^(eb - 126)
        up = ((268 - eb) << 23).to(tl.float32, bitcast=True)  # 2^(141 - eb)
        down = ((eb - 14) << 23).to(tl.float32, bitcast=True)  # 2^(eb - 141)
        return up, down

    @triton.jit
    def tile_scales(S, s_rows, row_ok, k0, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
        """The scales of K step ``[k0, k0 + BLOCK_K)`` for the weight rows at offsets ``s_rows`` into
        S: NVFP4's group scales times 64 as fp16 [rows, BLOCK_K / 16] (e2m1 values decode / 64),
        FP8's block scale [rows] (fp32), nothing for float weights. ``split_dot`` loads FP8's a step
        ahead (a load in the step itself left the memory latency in every step) and NVFP4's in the
        step: carried from the step before, they fixed the decoded tile's register layout to theirs,
        and the tile then reached the dot through shared memory."""
        if FORMAT == 1:
            gs = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            return tl.load(S + tl.expand_dims(s_rows, -1) + gs, mask=tl.expand_dims(row_ok, -1) & (gs < K // 16),
                           other=0.0).to(tl.float16) * 64.0
        elif FORMAT == 2:
            return tl.load(S + s_rows + k0 // 128, mask=row_ok & (k0 < K), other=0.0)
        else:
            return tl.zeros([1], tl.float32)

    @triton.jit
    def weight_tile_dot(X, W, stride_xt, stride_wn, ts, t_ok, cols, col_ok, k0, K, sc, acc,
                        FORMAT: tl.constexpr, WIDEN: tl.constexpr, PREC: tl.constexpr, BLOCK_K: tl.constexpr,
                        CVT: tl.constexpr):
        """``acc + X[ts, k0:k0+BLOCK_K] @ weight[cols, k0:k0+BLOCK_K].T`` by tensor-core dots (rows of X
        padded to the dot's 16). A quantized weight tile is dequantized to fp16, exactly (an NVFP4
        value times its fp8 scale has at most 6 significant bits, an fp8 value 4, all inside fp16's
        range), and a 16-bit X's step scaled into fp16 by a power of 2 per row (``f16_rows``; an
        fp32 X multiplies the fp32 weights); FP8's block scale (BLOCK_K divides 128) multiplies the
        step's dot. ``sc``: the step's ``tile_scales``. NVFP4's second level: not here.

        NVFP4 (``acc`` its transpose, [len(cols), len(ts)]): the weight is the dot's first operand, which
        Hopper's wgmma reads from registers where it is decoded (the second comes from shared memory,
        so the decoded weight would pass through it), and its bytes load as [cols, bytes] tiles, a
        row's bytes across neighbouring threads (a [cols, groups, 8] load put the threads along the
        rows: ncu counted 68% of the sectors in excess, ``h100/tuning/ncu_skinny_linear_nvfp4_rows8.txt``)."""
        BN: tl.constexpr = cols.shape[0]
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xv = tl.load(X + ts[:, None] * stride_xt + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        if FORMAT == 0:
            wv = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if WIDEN:
                xv = xv.to(tl.float32)
                wv = wv.to(tl.float32)
            return tl.dot(xv, tl.trans(wv), acc, input_precision=PREC)
        F32X: tl.constexpr = X.dtype.element_ty == tl.float32  # fp32 x: fp32 dots over the exact weights
        if FORMAT == 1:
            G: tl.constexpr = BLOCK_K // 16
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(W + cols[:, None] * stride_wn + kb[None, :], mask=col_ok[:, None] & (kb < K // 2)[None, :],
                        other=0)
            b = tl.reshape(b, (BN, G, 8))
            lo, hi = e2m1_scaled_f16(b, tl.broadcast_to(sc[:, :, None], (BN, G, 8)), CVT)
            wv = tl.reshape(tl.join(lo, hi), (BN, BLOCK_K))  # input 2j + 1 beside 2j: K's own order
        else:
            wv = tl.load(W + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float16)
        if F32X:
            xs = xv
        else:
            xs, down = f16_rows(xv)
        if F32X or WIDEN:
            xs, wv = xs.to(tl.float32), wv.to(tl.float32)
        if FORMAT == 1:
            part = tl.dot(wv, tl.trans(xs), input_precision=PREC)
            if not F32X:
                part = part * tl.trans(down)
        else:
            part = tl.dot(xs, tl.trans(wv), input_precision=PREC)
            if not F32X:
                part = part * down
            if FORMAT == 2:
                part = part * sc[None, :]
        return acc + part

    @triton.jit
    def _x_half(words, q):
        """fp16 number ``q`` (0..3) of each int64 of ``words``, as fp32."""
        return ((words >> (16 * q)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def hfma_group(w, xea, xeb, xoa, xob, sc, acc, CVT: tl.constexpr):
        """``acc + sc * sum_i value_i / 64 * x_i`` over one NVFP4 group of 16 inputs for every element:
        ``w`` its packed bytes as an int64, ``xea .. xob`` its inputs as ``x_groups`` lays them out
        (int64s of four fp16: even inputs 0-6 and 8-14, odd 1-7 and 9-15), ``sc`` the e4m3 group
        scale in fp32. With CVT (``_HFMA_GROUP``) the products are summed by f16x2 FMAs, eight to a
        lane, then in fp32: about 3.5 instructions an input against 8 for the fp32 forms, whose
        decoded values each took a conversion and an FFMA. fp16 is safe here: e2m1 / 64 times x in
        [2^14, 2^15) is exact (10 significant bits), eight such sum to under 24576. Without CVT (the
        interpreter) the same sum in fp32."""
        if CVT:
            return tl.inline_asm_elementwise(asm=_HFMA_GROUP, constraints="=r,l,l,l,l,l,r,r",
                                             args=[w, xea, xeb, xoa, xob, sc, acc], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:  # input i: nibble i of w, fp16 (i // 2) % 4 of the word its parity and half pick
            i = tl.arange(0, 16).to(tl.int64)
            v = _e2m1_f16((tl.expand_dims(w, -1) >> (4 * i)) & 15) * 256.0
            lo = i < 8
            word = tl.where(i % 2 == 0, tl.where(lo, tl.expand_dims(xea, -1), tl.expand_dims(xeb, -1)),
                            tl.where(lo, tl.expand_dims(xoa, -1), tl.expand_dims(xob, -1)))
            return acc + tl.sum(v * _x_half(word, (i // 2) % 4), -1) * sc

    @triton.jit
    def hfma_load(W, C, XW, w_rows, c_rows, x_off, row_ok, k0, K, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
        """K step ``[k0, k0 + BLOCK_K)``'s tiles for ``hfma_group``, [rows, BLOCK_K / 16] each (a cell an
        NVFP4 group): the weight rows at ``W + w_rows`` (their packed bytes as int64 words), their e4m3
        scales at ``C + c_rows``, and the four ``x_groups`` words of each group at ``XW + x_off``, loaded
        as one row and broadcast: the groups run along the tile's contiguous dimension, so each thread
        holds its groups for every row and reads their inputs once for all of them (x loaded per row
        was four times the weight bytes through L1, the kernel's bound on an H100). MASKED: K or the
        rows (``row_ok``) may end inside the tile (a step at or past K loads nothing)."""
        c = tl.arange(0, BLOCK_K // 16)[None, :]
        cell = k0 // 16 + c
        w_ptr = W + w_rows[:, None] + cell
        # the scales' bytes as runs of 2 (a 32-input block's pair), as the weight words load: one layout
        # for every tile, no conversion through shared memory
        c_ptr = C + c_rows[:, None] + k0 // 16 + 2 * (c // 2) + c % 2
        xw = XW + x_off + k0 // 4 + 8 * (c // 2) + c % 2  # block c // 2's words of parity c % 2
        if MASKED:
            k_ok = k0 + 32 * (c // 2) < K  # per 32-input block (K is a multiple of 32), as the loads' vectors
            m = row_ok[:, None] & k_ok
            w = tl.load(w_ptr, mask=m, other=0)
            sc = tl.load(c_ptr, mask=m, other=0.0)
            x = (tl.load(xw, mask=k_ok, other=0), tl.load(xw + 2, mask=k_ok, other=0),
                 tl.load(xw + 4, mask=k_ok, other=0), tl.load(xw + 6, mask=k_ok, other=0))
        else:
            w = tl.load(w_ptr)
            sc = tl.load(c_ptr)
            x = tl.load(xw), tl.load(xw + 2), tl.load(xw + 4), tl.load(xw + 6)
        return (w, sc, tl.broadcast(w, x[0])[1], tl.broadcast(w, x[1])[1], tl.broadcast(w, x[2])[1],
                tl.broadcast(w, x[3])[1])

    @triton.jit
    def hfma_step(W, C, XW, w_rows, c_rows, x_off, row_ok, k0, K, acc, BLOCK_K: tl.constexpr, CVT: tl.constexpr,
                  MASKED: tl.constexpr):
        """``acc`` [rows, BLOCK_K / 16] (fp32) plus K step ``[k0, k0 + BLOCK_K)`` of ``hfma_group`` over
        ``hfma_load``'s tiles."""
        w, sc, xea, xeb, xoa, xob = hfma_load(W, C, XW, w_rows, c_rows, x_off, row_ok, k0, K, BLOCK_K, MASKED)
        return hfma_group(w, xea, xeb, xoa, xob, sc.to(tl.float32), acc, CVT)

    @triton.jit
    def _x_groups_kernel(X, XH, XINV, K, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Row t of X (16-bit) as ``x_groups`` lays it out, and its inverse scale."""
        wait_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK)
        x = tl.load(X + t * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        up, down = _f16_powers(tl.max(tl.abs(x), 0))  # f16_rows' scaling (a [1, K] tile of it spilled)
        m = (ks % 16) // 2
        dest = (ks // 32) * 32 + ((ks % 2) * 4 + (m // 4) * 2 + (ks // 16) % 2) * 4 + m % 4
        tl.store(XH + t * K + dest, (x * up).to(tl.float16), mask=ks < K)
        tl.store(XINV + t, down)

    @triton.jit
    def _dequantize_kernel(W, S, R, OUT, K, stride_w, stride_s, FORMAT: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr, CVT: tl.constexpr, PDL: tl.constexpr):
        """OUT[r, k] = value(r, k) * group scale (* NVFP4's row scale), in the twin's order and dtype.
        NVFP4: each packed byte loaded once, its two values decoded together (``e2m1_pairs``) and
        interleaved back into K's order."""
        wait_prior(PDL)
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = (ks < K)[None, :]
        if FORMAT == 1:
            bs = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            mb = (bs < K // 2)[None, :]
            b = tl.load(W + rows[:, None] * stride_w + bs[None, :], mask=mb, other=0)
            s = tl.load(S + rows[:, None] * stride_s + bs[None, :] // 8, mask=mb, other=0.0).to(tl.float32)
            r = tl.load(R + rows)[:, None]
            lo, hi = e2m1_pairs(b, CVT)  # the values / 64: times 64 exact, then the twin's products
            v = tl.interleave(lo * 64.0 * s * r, hi * 64.0 * s * r)
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
            FORMAT=kw.format, BLOCK_R=block_r, BLOCK_K=512, **e2m1_cvt(kw.weight.device), **pdl(kw.weight.device))
    return out


def hfma_ready(kw: KernelWeight, x: torch.Tensor) -> bool:
    """Whether ``hfma_step`` can read ``kw`` against ``x``: NVFP4 weights (their packed bytes viewed
    as int64 words: rows, experts and offsets in whole words) of K a multiple of 32, 16-bit x, where
    the group decodes through e4m3 (``e2m1_cvt``) or under the interpreter (its fp32 twin)."""
    if kw.format != NVFP4_CODE or kw.k % 32 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.device.type == "cuda" and not e2m1_cvt(x.device)["CVT"]:
        return False
    w = kw.weight
    return w.storage_offset() % 8 == 0 and all(st % 8 == 0 for st in w.stride()[:-1])


def hfma_default(device: torch.device) -> bool:
    """Whether the kernels take the f16x2 form by default where ``hfma_ready``: on GPUs that decode
    through e4m3, not with ``WMTP_HFMA=0`` (the fp32 forms, for A/B runs) and not under the
    interpreter (its fp32 twin of the form is for the kernel tests, which ask for it)."""
    return e2m1_cvt(device)["CVT"] and os.environ.get("WMTP_HFMA") != "0"


def x_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (16-bit, K a multiple of 32) laid out for ``hfma_group``: each row times a power of 2
    that puts its largest |x| in [2^14, 2^15), as fp16 (exact: ``f16_rows``), each 32 inputs as
    eight int64s (of four fp16 each): the even inputs of the first and second 16 (0-6 / 16-22 in
    words 0 / 1, 8-14 / 24-30 in 2 / 3), then the odd ones alike (words 4-7). Returns the words [T,
    K / 4] and the inverse powers [T] (fp32)."""
    T, K = x.shape
    if K % 32 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x_groups: x {tuple(x.shape)} {x.dtype} must be 16-bit with K a multiple of 32")
    xh = torch.empty(T, K, device=x.device, dtype=torch.float16)
    inv = torch.empty(T, device=x.device, dtype=torch.float32)
    if T:
        _x_groups_kernel[(T,)](x.contiguous(), xh, inv, K, BLOCK=triton.next_power_of_2(K), **pdl(x.device))
    return xh.view(torch.int64), inv


def x_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_groups`` in PyTorch: the same words and inverse powers."""
    T, K = x.shape
    xf = x.float()
    amax = xf.abs().amax(1)
    e = torch.frexp(amax)[1].float()  # amax in [2^(e-1), 2^e)
    e = torch.where(amax > 0, e.clamp(min=-111), -111.0)
    up, inv = torch.exp2(15.0 - e), torch.exp2(e - 15.0)
    xs = (xf * up[:, None]).half()
    # input 32b + 16g + 8a + 2q + p (group g, half a of its 8 pairs, pair q, parity p) to fp16 16p + 8a + 4g + q
    words = xs.view(T, K // 32, 2, 2, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(T, K)
    return words.contiguous().view(torch.int64), inv
