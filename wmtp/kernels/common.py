"""Small helpers shared by the reference ops."""

from typing import NamedTuple

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the reference ops: fp32, or fp64 for fp64 inputs (exactness tests)."""
    return torch.promote_types(t.dtype, torch.float32)


class SharedExpert(NamedTuple):
    """The sigmoid-gated shared expert of a MoE layer: SwiGLU weights gate_proj, up_proj [I, H],
    down_proj [H, I] and the gate [1, H] (``out += sigmoid(gate @ x) * mlp(x)``)."""

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate: torch.Tensor
