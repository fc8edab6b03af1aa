"""Skinny linear layers for decode-sized inputs (1..16 token rows): ``x @ w.T (+ bias)`` in one launch.

At B·d rows a projection is a weight read; cuBLAS picks tiles made for larger M and, for the
4096 -> 2048 projections, a split-K GEMM plus a separate reduction kernel (7.4 + 1.8 us for a 3.9 us
read on the H200). Here each program multiplies a [rows, BLOCK_N] column block of the weight over
its share of K with one dot per K step (the token rows padded to the dot's 16), and split-K partials
(fp32) are summed by the column block's last program to arrive, in split order (deterministic), so
a split-K projection is still one launch. Quantized weights (NVFP4, block FP8; ``quant_tiles``) take
the same kernel, each weight tile dequantized in registers before its dot, up to ``QUANT_MAX_ROWS``.

The twin is ``F.linear`` (``TorchBackend.linear``, over ``QuantWeight.dequantize`` for quantized
weights); ``tests/test_linear_kernel.py`` and ``tests/test_quant_linear.py`` compare them.
Under the CPU interpreter, whose bf16 dot is wrong, 16-bit operands are widened to fp32 first
(exact products, fp32 accumulation, as on the GPU).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from wmtp.kernels.common import arrival_counters, launch_tile, linear_epilogue, pdl
from wmtp.kernels.quant_tiles import FP8_CODE, NVFP4_CODE, dequantize, e2m1_cvt, kernel_weight
from wmtp.quant import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_ROWS = 16  # token rows one launch takes (a dot's minimum M)
# quantized weights: up to a batched verify's rows, in launches of MAX_ROWS (dequantizing the weight
# for a GEMM instead reads and writes it in bf16 every call)
QUANT_MAX_ROWS = 64


class LinearTiles(NamedTuple):
    """Launch configuration: column block, K step, K splits (programs per column block), warps,
    software-pipeline stages; ``gemv``: a quantized weight's one-row launch by FMA (``weight_fma``:
    products kept per input position and summed once after the K loop, so the weight never goes
    through shared memory to reach a dot's layout) instead of tensor-core dots."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int = 3  # Triton's default on NVIDIA GPUs
    gemv: bool = False


if triton is not None:
    from wmtp.kernels.common import last_to_arrive, wait_prior
    from wmtp.kernels.quant_tiles import fma_sum, row_scale, tile_scales, weight_fma, weight_tile_dot, x_step

    @triton.jit
    def split_dot(X, W, S, stride_xt, stride_wn, stride_sn, ts, t_ok, cols, col_ok, k_lo, K_SPLIT, K,
                  FORMAT: tl.constexpr, WIDEN: tl.constexpr, PREC: tl.constexpr, BLOCK_K: tl.constexpr,
                  CVT: tl.constexpr):
        """fp32 ``X[ts] @ W[cols].T`` over this program's K split ``[k_lo, k_lo + K_SPLIT)``, one dot
        per K step (``weight_tile_dot``, any weight format): a [len(ts), len(cols)] tile (rows and
        columns past ``t_ok`` / ``col_ok`` are 0). NVFP4 accumulates the transpose (``weight_tile_dot``)
        and turns it once, after the K loop."""
        acc = tl.zeros([cols.shape[0], ts.shape[0]] if FORMAT == 1 else [ts.shape[0], cols.shape[0]], tl.float32)
        sc = tile_scales(S, cols * stride_sn, col_ok, k_lo, K, FORMAT, BLOCK_K)
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
            if FORMAT == 1:  # in the step: scales carried from the step before fix the decoded weight's
                # layout to theirs, and it then reaches the dot through shared memory
                sc = tile_scales(S, cols * stride_sn, col_ok, k0, K, FORMAT, BLOCK_K)
                nxt = sc
            else:
                nxt = tile_scales(S, cols * stride_sn, col_ok, k0 + BLOCK_K, K, FORMAT, BLOCK_K)  # a step ahead
            acc = weight_tile_dot(X, W, stride_xt, stride_wn, ts, t_ok, cols, col_ok, k0, K, sc, acc,
                                  FORMAT, WIDEN, PREC, BLOCK_K, CVT)
            sc = nxt
        return tl.trans(acc) if FORMAT == 1 else acc

    @triton.jit
    def _finish(acc, R, BIAS, ADD, OUT, stride_at, ts, cols, col_ok, out_ok, FORMAT: tl.constexpr,
                HAS_BIAS: tl.constexpr, RELU2: tl.constexpr, HAS_ADD: tl.constexpr):
        """The output tile from the fp32 sums: NVFP4's row scale, the bias, rounded to OUT's dtype; then
        RELU2 ``relu(y)^2`` and HAS_ADD ``y + ADD[ts, cols]``, each rounded to OUT's dtype as the
        PyTorch ops after ``F.linear`` round."""
        dt = OUT.dtype.element_ty
        acc = row_scale(acc, R, cols[None, :], col_ok[None, :], FORMAT)
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt)
        if RELU2:
            r = tl.maximum(y.to(tl.float32), 0.0)
            y = (r * r).to(dt)
        if HAS_ADD:
            a = tl.load(ADD + ts[:, None] * stride_at + cols[None, :], mask=out_ok, other=0.0)
            y = (y.to(tl.float32) + a.to(tl.float32)).to(dt)
        return y

    @triton.jit
    def _skinny_linear_kernel(X, W, S, R, BIAS, ADD, OUT, PART, COUNT, T, N, K, stride_xt, stride_wn, stride_sn,
                              stride_at, stride_ot, K_SPLIT, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              RELU2: tl.constexpr, HAS_ADD: tl.constexpr, SPLITS: tl.constexpr,
                              WIDEN: tl.constexpr, PREC: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, CVT: tl.constexpr, GEMV: tl.constexpr, PDL: tl.constexpr):
        """``_finish(x @ W.T)`` for the rows ``ts`` < T (T_P of them; one with GEMV) and column block
        ``program_id(0)``, over K split ``program_id(1)`` of SPLITS: split partial sums go to PART and
        the column block's last program to arrive (COUNT) sums them in split order."""
        wait_prior(PDL)
        nb = tl.program_id(0)
        s = tl.program_id(1)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ts = tl.arange(0, T_P)
        t_ok = ts < T
        if GEMV:  # one row (T_P = 1)
            k_lo = s * K_SPLIT
            acc3 = tl.zeros([BLOCK_N, BLOCK_K // 16, 8] if FORMAT == 1 else [BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
                acc3 = weight_fma(W, S, cols * stride_wn, cols * stride_sn, col_ok, x_step(X, 0, k0, K, FORMAT, BLOCK_K),
                                  k0, K, acc3, FORMAT, BLOCK_K, CVT)
            acc = fma_sum(acc3, FORMAT)[None, :]
        else:
            acc = split_dot(X, W, S, stride_xt, stride_wn, stride_sn, ts, t_ok, cols, col_ok, s * K_SPLIT, K_SPLIT, K,
                            FORMAT, WIDEN, PREC, BLOCK_K, CVT)
        out_ptr = OUT + ts[:, None] * stride_ot + cols[None, :]
        out_ok = t_ok[:, None] & col_ok[None, :]
        if SPLITS == 1:
            tl.store(out_ptr, _finish(acc, R, BIAS, ADD, OUT, stride_at, ts, cols, col_ok, out_ok, FORMAT, HAS_BIAS,
                                      RELU2, HAS_ADD), mask=out_ok)
        else:
            part = PART + ts[:, None] * N + cols[None, :]
            tl.store(part + s * T * N, acc, mask=out_ok)
            if last_to_arrive(COUNT, nb, SPLITS):  # the column block's last program sums the splits in order
                total = tl.zeros([T_P, BLOCK_N], tl.float32)
                for j in range(SPLITS):
                    total += tl.load(part + j * T * N, mask=out_ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr, _finish(total, R, BIAS, ADD, OUT, stride_at, ts, cols, col_ok, out_ok, FORMAT,
                                          HAS_BIAS, RELU2, HAS_ADD), mask=out_ok)


def linear_tiles(rows: int, n: int, k: int) -> LinearTiles | None:
    """The kernel's tiles for ``rows`` x [n, k], or None where cuBLAS is as fast or it was not
    measured: more than ``MAX_ROWS`` rows, outputs between 4096 and 12288 wide or over 16384.
    Measured on the H200 against cuBLAS (``benchmarks/tune_linear.py``):
    4096 -> 2048 at 32 x 256 tiles in 4 K splits, 7.8 us against 8.9 (1 row) / 9.8 (8 rows); the
    2048 -> 256 router at 16 x 128 in 8 splits, 3.9 against 5.7-5.8; the GDN in_proj 2048 -> 12352
    unsplit at 32 x 128, 4 stages, 14.1 / 14.5 against 15.5 / 15.9; the attention qkv 2048 -> 9216
    lost at every tile (12.0 at best against 11.6-11.8), so that width stays on cuBLAS. A draft step's
    lm_head (1 row, 2048 -> 248,320) at 64 x 256: 276.4 us against 279.6 alone
    (timed alone), and in a graph without cuBLAS's memset and the ~2-5 us gap
    before its kernel; at 8 rows cuBLAS wins (266.0 against 280.8 at best)."""
    if rows == 1 and n > 16384:
        return LinearTiles(64, 256, 1, 4)
    if not 0 < rows <= MAX_ROWS or 4096 < n < 12288 or n > 16384:
        return None
    if n <= 1024:
        return LinearTiles(16, 128, 8, 4)
    if n >= 12288:
        return LinearTiles(32, 128, 1, 4, 4)
    return LinearTiles(32, 256, 4 if k >= 4096 else 1, 4)


def quant_tiles(rows: int, n: int, k: int, fmt: int) -> LinearTiles:
    """Tiles for ``rows`` x a quantized [n, k] weight of kernel format ``fmt`` (no cuBLAS alternative
    short of dequantizing it).

    One row of NVFP4: the FMA path (``gemv``) in 8-wide column blocks, 2 K splits from 8192 outputs
    (else 4), K steps of 256 (512 at K = 4096). On an H100 (``tune_linear.py --quantize nvfp4 --tokens
    1,7``, at f5d33f0 / 5951afc; ``h100/tuning/``) the best or within 4% of the sweep's best over the
    35B's and the 122B's projections but the 122B's shared gate / up 2048 x 3072 (6.5 against 5.3 us
    in 8 splits): 9216 x 2048 12.1 us, 12352 x 2048 13.8, 20608 x 3072 30.2, 17408 x 3072 24.9,
    2048 x 4096 6.3, 3072 x 8192 12.8, 3072 x 6144 10.4, 3072 x 1024 4.2; the 35B's at the tensor-core
    tiles below took 18.7 / 19.3 / 9.6 us for 9216 x 2048 / 12352 x 2048 / 2048 x 4096.

    More rows of NVFP4 (the FMA path over a verify's 7 rows, each weight value dequantized once for
    all of them, took 2.2-3.0x the tensor-core tiles' time on the 35B's projections at 5b250f6,
    ``h100/tuning/tune_linear_nvfp4_fma_rows.json``): 64-wide column blocks, K steps of 256, one stage
    (Triton's pipelining stages these tiles through shared memory: 2-3 stages took 1.1-1.6x as long),
    as many K splits (8, 4, 2) as keep the launch within 800 programs. At 8 rows on an H100 at 495c93a
    (``h100/tuning/tune_linear_nvfp4_verify_layouts.json``) the sweep's best of 24 tiles for the 35B's
    12352 x 2048 / 9216 x 2048 / 2048 x 4096: 15.0 / 12.6 / 8.1 us (the tiles before, 128 x 128 in 4 / 4
    / 8 splits and 3 stages: 17.7 / 16.8 / 8.1; b18c8bb's kernel at its tiles 19.3 / 19.3 / 9.3).

    FP8 (more rows, or one row past 4096 outputs): K steps of 128 inputs; columns in blocks of 32
    up to 1024 outputs, 64 up to 4096 and above 16384, 128 between; as many K splits (8, 4, 2) as
    keep the launch within 600 programs (at 3e78b3e, 1 / 7 rows: 2048 x 4096 at 64 x 128 in 8 splits
    9.4 / 9.3 us; 9216 x 2048 at 128 x 128 in 8 splits 18.9 / 19.2 us and 12352 x 2048 in 4 splits
    19.4 / 19.1 us, against 21.0 / 21.1 and 23.7 / 23.6 at 64-wide blocks, NVFP4 then). Over
    Nemotron-3-Super's FP8 projections the sweep's best was 0-23% faster (1.3 us at most), at a
    different tile per shape (``h100/tuning/tune_linear_fp8_nemotron.json``); its Mamba in_proj
    (18560 x 4096) at 64 x 128 in 2 splits, the best there and in two later sweeps on H100s: 33.8 /
    34.8 us against 36.9 / 38.6 at 128 x 128 in 4, at 1 / 8 rows (``tune_linear_fp8_in_proj_*.json``;
    pipeline depths 1-4 and FMA K steps of up to 512 no faster). One FP8 row of up to 4096 outputs
    takes the FMA path in 32-wide blocks at 8 warps (the splits as above), on an H100 faster than
    those tiles over every such projection of the 35B and Nemotron-3-Super (2048 x 4096 6.4 against
    7.2 us, 4096 x 4096 9.9 / 11.2, 4096 x 1024 4.5 / 5.7, 512 x 2048 3.3 / 3.7; ``tune_linear_fp8.json``,
    at 0466e6e); wider ones lost there (12352 x 2048 15.1 against 12.6, 5376 x 4096 15.5 / 12.5)."""
    if rows == 1 and fmt == NVFP4_CODE:
        splits = 2 if n >= 8192 else 4
        return LinearTiles(8, 512 if k == 4096 else 256, max(1, min(splits, k // 256)), 4, gemv=True)
    if fmt == NVFP4_CODE:
        return LinearTiles(64, 256, _splits(-(-n // 64), 800, k // 256), 4, 1)
    fp8_gemv = rows == 1 and fmt == FP8_CODE and n <= 4096
    block_n = 32 if n <= 1024 or fp8_gemv else 64 if n <= 4096 or n > 16384 else 128
    return LinearTiles(block_n, 128, _splits(-(-n // block_n), 600, k // 128), 8 if fp8_gemv else 4, gemv=fp8_gemv)


def _splits(blocks: int, programs: int, steps: int) -> int:
    """As many K splits (8, 4, 2) as keep ``blocks`` column blocks within ``programs`` programs, at
    most ``steps`` (one K step a split at least)."""
    return max(1, min(next(s for s in (8, 4, 2, 1) if s == 1 or blocks * s <= programs), steps))


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """``split_dot``'s WIDEN / PREC for operands of ``dtype``: ieee fp32 products for fp32 (tf32
    would round them); 16-bit operands widened under the CPU interpreter (its bf16 dot is wrong)."""
    return {"WIDEN": dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
            "PREC": "ieee" if dtype == torch.float32 else "tf32"}


def skinny_rows(name: str, x: torch.Tensor, n: int, bias: torch.Tensor | None, max_rows: int = MAX_ROWS,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks a skinny kernel's input passes (at most ``max_rows`` rows, a bias of ``n``): x as
    [T, K] with unit-stride rows, and the empty [T, n] output (x's dtype, or ``out_dtype``)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > max_rows:
        raise ValueError(f"{name}: x has {x2.shape[0]} rows; at most {max_rows}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} must be [{n}]")
    out = torch.empty(x2.shape[0], n, device=x.device, dtype=out_dtype or x.dtype)
    return (x2 if x2.stride(1) == 1 else x2.contiguous()), out


def _takes(dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """A float weight the kernel reads for products in ``dtype`` (x's, or fp32 for an fp32 result):
    that dtype, or 16 bits for fp32 (an fp32 x's products or a router's fp32 logits over its bf16
    checkpoint weight, without an fp32 copy of it)."""
    return weight.dtype == dtype or dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None,
                  tiles: LinearTiles | None = None, relu2: bool = False, add: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] of at most ``MAX_ROWS`` rows (flattened; a
    quantized weight takes up to ``QUANT_MAX_ROWS``); weight [N, K] with unit stride on K, in x's
    dtype (or 16-bit for an fp32 x) or quantized (``wmtp.quant``: read packed, dequantized in
    registers). ``tiles`` overrides ``linear_tiles``' / ``quant_tiles``' choice (``linear_tiles``
    falls back to a single 16 x 128 program per K split where it would choose cuBLAS). In the
    same launch, as ``linear_epilogue`` after ``F.linear``: ``relu2``, then ``add`` (x's leading
    shape by N). ``out_dtype=torch.float32`` for a 16-bit x over a float weight: ``F.linear(x.float(),
    weight.float())``. Over a weight of x's dtype that is the 16-bit dot with fp32 sums: a product of
    two 16-bit values is exact in fp32, so only the sums' order and rounding differ from ieee fp32 dots
    (max error against an fp64 product 1.3e-6 against their 6.8e-7 for Nemotron-3-Super's 512 x 4096
    router), at a fifth of their time (on an H100 4.9 against 23.5 us timed alone, 11 against 64 us each
    inside a dense step under PDL); a weight of the other 16-bit dtype is widened in registers."""
    K = x.shape[-1]
    quant = isinstance(weight, QuantWeight)
    if out_dtype not in (None, x.dtype) and (quant or out_dtype != torch.float32 or add is not None):
        raise ValueError(f"skinny_linear: out_dtype {out_dtype} for {x.dtype} x: only torch.float32, over a float "
                         f"weight, without add")
    wide = out_dtype == torch.float32  # an fp32 result from a 16-bit x
    if len(weight.shape) != 2 or weight.shape[1] != K or not quant and (
            weight.stride(1) != 1 or not _takes(torch.float32 if wide else x.dtype, weight)):
        kind = weight.format.name if quant else weight.dtype
        raise ValueError(f"skinny_linear: weight {tuple(weight.shape)} {kind} must be [N, {K}] {'' if quant else x.dtype} "
                         f"with unit stride on K (x {tuple(x.shape)})")
    kw = kernel_weight("skinny_linear", weight)
    x2, out = skinny_rows("skinny_linear", x, weight.shape[0], bias, QUANT_MAX_ROWS if quant else MAX_ROWS, out_dtype)
    T, N = out.shape
    if add is not None:
        if add.shape != (*x.shape[:-1], N) or add.dtype != x.dtype or add.stride(-1) != 1:
            raise ValueError(f"skinny_linear: add {tuple(add.shape)} {add.dtype} must be {(*x.shape[:-1], N)} "
                             f"{x.dtype} with unit stride on N")
        add = add.reshape(T, N)
    if T and N:
        default = quant_tiles(T, N, K, kw.format) if quant else linear_tiles(T, N, K) or LinearTiles(16, 128, 1, 4)
        cfg = tiles or default
        if tiles is None:  # (one K split when a whole-K step covers K)
            cfg = cfg._replace(block_n=launch_tile(cfg.block_n, N), block_k=launch_tile(cfg.block_k, K, 128 if quant else 1024))
        bk = cfg.block_k
        if kw.format == NVFP4_CODE and (bk < 16 or bk & (bk - 1)):
            raise ValueError(f"skinny_linear: NVFP4 block_k {bk} must be a power of 2 >= 16")
        if kw.format == FP8_CODE and (128 % bk or bk < 16):
            raise ValueError(f"skinny_linear: FP8 block_k {bk} must divide the 128-input scale blocks")
        if cfg.gemv and (T != 1 or not quant):
            raise ValueError(f"skinny_linear: gemv tiles take one row of a quantized weight (x {tuple(x.shape)}, "
                             f"weight {kw.format})")
        k_split = triton.cdiv(triton.cdiv(K, cfg.splits), bk) * bk  # a multiple of the K step
        splits = triton.cdiv(K, k_split)
        blocks = triton.cdiv(N, cfg.block_n)
        # launches of at most MAX_ROWS rows: a 64-row NVFP4 tile gave wrong bf16 results on the H200
        # (Triton 3.6; the 16-row dot is what the kernel is verified with), so more rows re-read the weight
        for lo in range(0, T, MAX_ROWS):
            xs, outs, t = x2[lo:lo + MAX_ROWS], out[lo:lo + MAX_ROWS], min(MAX_ROWS, T - lo)
            adds = outs if add is None else add[lo:lo + MAX_ROWS]
            part = torch.empty(splits, t, N, device=x.device, dtype=torch.float32) if splits > 1 else outs
            _skinny_linear_kernel[(blocks, splits)](
                xs, kw.weight, kw.scale, kw.rows, outs if bias is None else bias, adds, outs, part,
                arrival_counters(x.device, blocks), t, N, K, xs.stride(0), kw.weight.stride(0), kw.scale.stride(0),
                adds.stride(0), outs.stride(0), k_split, FORMAT=kw.format, HAS_BIAS=bias is not None, RELU2=relu2,
                HAS_ADD=add is not None, SPLITS=splits,
                T_P=1 if cfg.gemv else MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=bk, GEMV=cfg.gemv,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **dot_flags(torch.float32 if wide and weight.dtype != x.dtype else x.dtype), **e2m1_cvt(x.device),
                **pdl(x.device))
    return out.view(*x.shape[:-1], N)


def decode_linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None,
                  relu2: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_epilogue(F.linear(x, weight, bias), relu2, add)``, through ``skinny_linear`` (the
    epilogue in its launch) where ``linear_tiles`` picks the kernel over cuBLAS (and for an fp32 x
    over a 16-bit weight, read as it is, up to ``MAX_ROWS`` rows); a quantized weight through
    ``skinny_linear`` up to ``QUANT_MAX_ROWS`` rows, above them dequantized, then one GEMM (prefill)."""
    rows = x.numel() // max(x.shape[-1], 1)
    fused = add is None or (add.dtype == x.dtype and add.stride(-1) == 1)
    if isinstance(weight, QuantWeight):
        if rows <= QUANT_MAX_ROWS and x.dtype != torch.float64 and fused:
            return skinny_linear(x, weight, bias, relu2=relu2, add=add)
        return linear_epilogue(F.linear(x, dequantize(weight, x.dtype), bias), relu2, add)
    if weight.dtype != x.dtype:
        if _takes(x.dtype, weight) and rows <= MAX_ROWS and weight.stride(-1) == 1 and fused:
            return skinny_linear(x, weight, bias, relu2=relu2, add=add)
        return linear_epilogue(F.linear(x, weight.to(x.dtype), bias), relu2, add)
    tiles = linear_tiles(rows, weight.shape[0], weight.shape[1])
    if tiles is None or x.dtype == torch.float64 or weight.stride(-1) != 1 or not fused:
        return linear_epilogue(F.linear(x, weight, bias), relu2, add)
    return skinny_linear(x, weight, bias, relu2=relu2, add=add)  # which takes linear_tiles' choice itself


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``decode_linear(x.float(), weight)`` (a router's fp32 logits over its 16-bit weight); a 16-bit x
    of up to ``MAX_ROWS`` rows through ``skinny_linear(..., out_dtype=torch.float32)`` instead (no fp32
    copy of x; the same products, summed in fp32 on the tensor cores)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and weight.stride(-1) == 1 \
            and _takes(torch.float32, weight):
        return skinny_linear(x, weight, out_dtype=torch.float32)
    return decode_linear(x.float(), weight)
