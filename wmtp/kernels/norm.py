"""Triton RMSNorm: plain (``w * norm(x)``), Qwen3-Next offset (``norm(x) * (1 + w)``) and the GDN
gated form (``w * norm(x) * silu(z)``), one program per row, fp32 statistics.

At decode sizes each norm is a handful of tiny elementwise kernels in PyTorch (cast, square,
mean, rsqrt, multiplies); one launch instead matters once the step is replayed from a CUDA graph.
The twins are ``TorchBackend.rms_norm`` and ``torch_gdn.gated_rms_norm`` (same cast points, so
bf16 results round the same way); ``tests/test_norm_kernel.py`` compares them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Z, RES, SUM_OUT, OUT, D, eps, OFFSET: tl.constexpr, GATED: tl.constexpr,
                         RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(X + row * D + cols, mask=ok, other=0.0)
        if RESIDUAL:  # x + residual, rounded to the activation dtype as the reference's add is
            x = x + tl.load(RES + row * D + cols, mask=ok, other=0.0)
            tl.store(SUM_OUT + row * D + cols, x, mask=ok)
        x = x.to(tl.float32)
        h = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:
            y = h * (1.0 + w)
        else:  # the reference casts the norm to the input dtype before the weight multiply
            y = (h.to(OUT.dtype.element_ty).to(tl.float32) * w).to(W.dtype.element_ty).to(tl.float32)
        if GATED:
            z = tl.load(Z + row * D + cols, mask=ok, other=0.0).to(tl.float32)
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(OUT + row * D + cols, y.to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` [..., D] (``gate``: same shape, the gated GDN form)."""
    D = x.shape[-1]
    if weight.shape != (D,) or (gate is not None and gate.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"gate {None if gate is None else tuple(gate.shape)} disagree")
    x2 = x.reshape(-1, D).contiguous()
    out = torch.empty_like(x2)
    z = x2 if gate is None else gate.reshape(-1, D).contiguous()
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, z, x2, x2, out, D, eps, OFFSET=offset, GATED=gate is not None,
                                         RESIDUAL=False, BLOCK_D=triton.next_power_of_2(D))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``rms_norm(s)`` in one launch; returns (normed, s)."""
    D = x.shape[-1]
    if weight.shape != (D,) or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} "
                         f"{residual.dtype}, weight {tuple(weight.shape)} disagree")
    x2, r2 = x.reshape(-1, D).contiguous(), residual.reshape(-1, D).contiguous()
    out, summed = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, x2, r2, summed, out, D, eps, OFFSET=offset, GATED=False,
                                         RESIDUAL=True, BLOCK_D=triton.next_power_of_2(D))
    return out.view(x.shape), summed.view(x.shape)
