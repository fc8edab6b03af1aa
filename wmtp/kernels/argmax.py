"""Row-wise arg-max of logits in one launch: greedy decoding's token choice over a 150-250K vocab.

PyTorch's reduction runs one row on few blocks (9 us for one 248K-entry bf16 row on the H200, where
the read is 0.5 MB) and its result needs a copy into the iteration's output buffer. Here each row is
split over ``splits`` programs; each writes its chunk's (max, first index), and the last program of
the row to arrive (an arrival counter) reduces the partials and writes the index straight into the
(strided) destination. Ties go to the lowest index and NaN counts as +inf, so the index is always in
range; the twin is ``torch.argmax`` (``TorchBackend.argmax``), compared in ``tests/test_argmax_kernel.py``.
"""

from __future__ import annotations

import torch

from wmtp.kernels.common import arrival_counters, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

CHUNK = 8192  # entries per program
BLOCK = 4096  # entries per load

if triton is not None:
    from wmtp.kernels.common import last_to_arrive, wait_prior

    @triton.jit
    def _argmax_kernel(X, OUT, PART_V, PART_I, COUNT, V, stride_x, out_n1, out_s0, out_s1, SPLITS,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS_P: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        lo = s * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        best_v = float("-inf")
        best_i = lo  # an all -inf chunk reports its first index, as torch.argmax does
        for c0 in range(lo, hi, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < hi
            x = tl.load(X + t * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)
            m = tl.max(x, 0)
            i = tl.min(tl.where(ok & (x == m), cols, V), 0)
            take = m > best_v  # strictly: an earlier block keeps a tie
            best_i = tl.where(take, i, best_i)
            best_v = tl.where(take, m, best_v)
        tl.store(PART_V + t * SPLITS_P + s, best_v)
        tl.store(PART_I + t * SPLITS_P + s, best_i)
        if last_to_arrive(COUNT, t, SPLITS):  # the row's last program reduces the partials
            ss = tl.arange(0, SPLITS_P)
            ok = ss < SPLITS
            pv = tl.load(PART_V + t * SPLITS_P + ss, mask=ok, other=float("-inf"), cache_modifier=".cg")
            pi = tl.load(PART_I + t * SPLITS_P + ss, mask=ok, other=0, cache_modifier=".cg")
            m = tl.max(pv, 0)
            i = tl.min(tl.where(ok & (pv == m), pi, V), 0)
            tl.store(OUT + (t // out_n1) * out_s0 + (t % out_n1) * out_s1, i.to(tl.int64))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` of x [T, V] (unit stride on V) as int64 [T], written into ``out`` when
    given: [T] or [B, n] with B·n = T (row-major order), any strides, e.g. a column of an output
    buffer. Returns ``out``."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: x {tuple(x.shape)} must be [T, V] with V > 0 and unit stride on V")
    T, V = x.shape
    if out is None:
        out = torch.empty(T, device=x.device, dtype=torch.int64)
    if out.dtype != torch.int64 or out.numel() != T or out.dim() not in (1, 2):
        raise ValueError(f"argmax_rows: out {tuple(out.shape)} {out.dtype} must be int64 [{T}] or [B, n] with B*n = {T}")
    if T:
        splits = triton.cdiv(V, CHUNK)
        sp = triton.next_power_of_2(splits)
        part_v = torch.empty(T, sp, device=x.device, dtype=torch.float32)
        part_i = torch.empty(T, sp, device=x.device, dtype=torch.int32)
        n1, s0, s1 = (T, 0, out.stride(0)) if out.dim() == 1 else (out.shape[1], out.stride(0), out.stride(1))
        _argmax_kernel[(T, splits)](x, out, part_v, part_i, arrival_counters(x.device, T), V, x.stride(0), n1, s0,
                                    s1, splits, CHUNK=CHUNK, BLOCK=min(BLOCK, triton.next_power_of_2(V)), SPLITS_P=sp,
                                    **pdl(x.device))
    return out
