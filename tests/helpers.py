"""Shared test utilities: tiny transformers reference models and random re-initialisation."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def scramble_(model: torch.nn.Module, seed: int = 0, gain: float = 0.6) -> torch.nn.Module:
    """Re-draw every parameter with enough variance that logits differ strongly between tokens
    (default inits make tiny models nearly constant, which would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            # Moderate decay: with A up to 16 the fp32 reference itself (transformers' chunked GDN)
            # drifts by ~3e-4 from fp64, above the 1e-4 parity tolerance.
            p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), 0.0, generator=gen))
        elif leaf == "dt_bias":
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif p.ndim == 1:  # norms (offset or plain) and biases: around their identity values
            base = 1.0 if _plain_norm(name, model) else 0.0
            p.copy_(base + torch.randn(p.shape, generator=gen) * 0.2)
        else:
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=gen) * gain / math.sqrt(fan_in))
    return model


def _plain_norm(name: str, model: torch.nn.Module) -> bool:
    """Plain ``w * x`` RMSNorms (Llama, Qwen3, GDN's gated norm) sit around 1; Qwen3-Next's ``(1 + w)`` ones around 0."""
    cls = type(model).__name__
    hybrid = "Qwen3Next" in cls or "Qwen3_5" in cls or getattr(model, "config", None) is not None and getattr(
        getattr(model, "config", None), "is_hybrid", False
    )
    return (not hybrid) or name.endswith("linear_attn.norm.weight")


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
