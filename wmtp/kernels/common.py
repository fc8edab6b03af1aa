"""Small helpers shared by the reference ops."""

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype of the reference ops: fp32, or fp64 for fp64 inputs (exactness tests)."""
    return torch.promote_types(t.dtype, torch.float32)
