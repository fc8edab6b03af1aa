"""``act(a) * b`` in one pass, rounded as PyTorch's two ops round (the activation to the dtype, then
the product): SwiGLU's ``silu(gate) * up`` over the grouped experts' rows and the attention output
gate ``out * sigmoid(gate)`` of prefill chunks, where PyTorch reads and writes every element two or
three times (a 16,384-token prefill of the 35B spent 32 ms in such ops on an H100,
``benchmarks/results/h100/tuning/profile_prefill_16k_*.txt``). The twin is ``act_mul_reference``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wmtp.kernels.common import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

SILU, SIGMOID = 0, 1

if triton is not None:
    from wmtp.kernels.common import wait_prior

    @triton.jit
    def _act_mul_kernel(A, B, OUT, R, C, stride_a, stride_b, ACT: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Rows ``pid * ROWS ..`` and columns of block ``program_id(1)`` of the R x C operands (rows
        ``stride_a`` / ``stride_b`` apart, unit column strides; OUT contiguous)."""
        wait_prior(PDL)
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
        ok = (rows < R) & (cols < C)
        a = tl.load(A + rows * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
        if ACT == 0:
            g = a / (1.0 + tl.exp(-a))
        else:
            g = 1.0 / (1.0 + tl.exp(-a))
        g = g.to(OUT.dtype.element_ty).to(tl.float32)
        b = tl.load(B + rows * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + rows * C + cols, (g * b).to(OUT.dtype.element_ty), mask=ok)


def act_mul_reference(a: torch.Tensor, b: torch.Tensor, act: int) -> torch.Tensor:
    """The twin: PyTorch's ops."""
    return (F.silu(a) if act == SILU else torch.sigmoid(a)) * b


def _rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` as rows of its last dim: itself and its row stride where its leading dims collapse into
    one (a slice of a wider row, a per-head view into a fused projection), else a contiguous copy."""
    if t.stride(-1) == 1 and all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2)):
        return t, (t.stride(-2) if t.dim() > 1 else t.shape[-1])
    t = t.contiguous()
    return t, t.shape[-1]


def act_mul(a: torch.Tensor, b: torch.Tensor, act: int) -> torch.Tensor:
    """``act(a) * b`` (``act``: SILU or SIGMOID) for a, b of one shape and dtype; a new contiguous
    tensor."""
    if a.shape != b.shape or a.dtype != b.dtype or not a.dim() or act not in (SILU, SIGMOID):
        raise ValueError(f"act_mul: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must match (at "
                         f"least one dim), act {act} must be SILU ({SILU}) or SIGMOID ({SIGMOID})")
    out = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    C = a.shape[-1]
    R = out.numel() // C if C else 0
    if R:
        (av, sa), (bv, sb) = _rows_of(a), _rows_of(b)
        block = min(1024, triton.next_power_of_2(C))
        rows = max(1, 2048 // block)  # about 2048 elements a program
        _act_mul_kernel[(triton.cdiv(R, rows), triton.cdiv(C, block))](
            av, bv, out, R, C, sa, sb, ACT=act, ROWS=rows, BLOCK=block, **pdl(a.device))
    return out
