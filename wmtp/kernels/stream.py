"""A streaming read: the HBM read bandwidth the bytes floor is divided by (DESIGN §6).

``stream_xor`` reads every int32 of a buffer once and writes one XOR of its words per program, so
nothing but the read is timed (XOR: any memory contents, no overflow). Programs stride over the
buffer in blocks; each loop iteration issues ``unroll`` independent block loads (blocks p,
p + programs, ...), which keeps more bytes in flight than a single load: on the H200, 4.45 against
4.40 TB/s for the best single-load launch and 4.03 for the one-block configuration it replaced
(1826005). Twin: the XOR of the whole buffer (``stream_xor_reference``)."""

from __future__ import annotations

import functools
import operator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _stream_xor_kernel(X, OUT, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        pid = tl.program_id(0)
        stride = tl.num_programs(0) * BLOCK
        tile = tl.arange(0, UNROLL)[:, None] * stride + tl.arange(0, BLOCK)[None, :]
        acc = tl.zeros([UNROLL, BLOCK], tl.int32)
        for start in range(pid * BLOCK, n, stride * UNROLL):
            offs = start + tile
            acc ^= tl.load(X + offs, mask=offs < n, other=0)
        tl.store(OUT + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def stream_xor(x: torch.Tensor, programs: int, block: int = 2048, num_warps: int = 8, unroll: int = 4) -> torch.Tensor:
    """Per-program XORs of the 1-D int32 ``x`` (program p reads blocks p, p + programs, ...,
    ``unroll`` of them per loop iteration): [programs] int32."""
    if x.dtype != torch.int32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"stream_xor: x must be a contiguous 1-D int32 tensor, got {x.dtype} {tuple(x.shape)}")
    if x.numel() + programs * block * unroll >= 2**31:
        raise ValueError(f"stream_xor: {x.numel()} elements plus one round of {programs} x {unroll} blocks of "
                         f"{block} must stay below 2**31 (int32 offsets)")
    out = torch.empty(programs, device=x.device, dtype=torch.int32)
    _stream_xor_kernel[(programs,)](x, out, x.numel(), BLOCK=block, UNROLL=unroll, num_warps=num_warps)
    return out


def stream_xor_reference(x: torch.Tensor) -> int:
    """The XOR of every word of ``x`` (that of ``stream_xor``'s partials)."""
    return functools.reduce(operator.xor, x.cpu().tolist(), 0)
