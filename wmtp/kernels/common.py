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
MAX_COUNTERS = 1 << 16


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for launches whose last-arriving program of a group finishes the
    group's work (and zeroes its counter again). One fixed buffer per device, never reallocated:
    captured CUDA graphs keep its address. Such launches run on one stream at a time, as the
    engine's do."""
    if n > MAX_COUNTERS:
        raise ValueError(f"arrival_counters: {n} groups in one launch; at most {MAX_COUNTERS}")
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, device=device, dtype=torch.int32)
    return c
