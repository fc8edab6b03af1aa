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


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for launches whose last-arriving program of a group finishes the
    group's work (and zeroes its counter again). Kept per device across launches and CUDA-graph
    replays; such launches run on one stream at a time, as the engine's do."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return c
