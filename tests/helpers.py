"""Shared test utilities: random re-initialisation, the chi-square harness and deliberately broken
acceptance rules (so statistical tests can be shown to fail)."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.stats import chisquare


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


def close_to_twin(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A quantized-weight kernel's output against its twin's, same dtype and shape: fp32 within 1e-5
    of the largest value (sums in another order); bf16 within an output rounding (2^-8) plus the CPU
    interpreter's truncating casts (1e-2)."""
    rel = 1e-5 if want.dtype == torch.float32 else 1e-2
    return got.dtype == want.dtype and got.shape == want.shape and \
        (got.float() - want.float()).abs().max().item() <= rel * want.float().abs().max().item()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def broken_accept_q_over_p(
    d: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None
) -> tuple[int, int]:
    """WRONG on purpose: accepts with min(1, q/p) instead of min(1, p/q)."""
    g = d.shape[0]
    for i in range(g):
        u = torch.rand((), generator=gen)
        if not bool(u * p[i, d[i]] < q[i, d[i]]):
            res = (p[i] - q[i]).clamp_min(0)
            res = res if bool(res.sum() > 0) else p[i]
            return i, int(torch.multinomial(res, 1, generator=gen))
    return g, int(torch.multinomial(p[g], 1, generator=gen))


def broken_accept_resample_p(
    d: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None
) -> tuple[int, int]:
    """WRONG on purpose: on rejection resamples from p instead of normalize(max(p - q, 0))."""
    g = d.shape[0]
    for i in range(g):
        u = torch.rand((), generator=gen)
        if not bool(u * q[i, d[i]] < p[i, d[i]]):
            return i, int(torch.multinomial(p[i], 1, generator=gen))
    return g, int(torch.multinomial(p[g], 1, generator=gen))


def chi2_pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled into one cell.

    Draws in a zero-probability cell are an outright failure (p-value 0)."""
    n = counts.sum()
    expected = joint * n
    if counts[expected == 0].sum() > 0:
        return 0.0
    support = expected > 0
    small = support & (expected < 5)
    big = support & ~small
    f_obs = list(counts[big].astype(float))
    f_exp = list(expected[big])
    if small.any():
        f_obs.append(float(counts[small].sum()))
        f_exp.append(float(expected[small].sum()))
    f_exp_arr = np.asarray(f_exp)
    f_exp_arr *= n / f_exp_arr.sum()  # remove float drift so scipy's sum check passes
    return float(chisquare(np.asarray(f_obs), f_exp_arr).pvalue)


def tiny_model(preset: str, device: str = "cpu", backend: str = "torch", seed: int = 0, quantize: str | None = None,
               dtype: torch.dtype | None = None, **overrides):
    """A tiny preset's random-weight model with the fewest layers that keep every mechanism: one
    attention layer, plus one GDN layer (dense MLP) on hybrids, whose attention layer then carries
    the MoE; ``overrides`` change other config fields; ``quantize`` as ``load_model``'s (a quantized
    preset's own config without it); ``dtype`` instead of the preset's. Interpreted
    runs cost per layer."""
    from wmtp.config import ModelConfig
    from wmtp.models.loader import build_model, init_random_
    from wmtp.presets import PRESETS

    raw = dict(PRESETS[preset])
    if "layers_block_type" in raw:  # Nemotron-H: one block of each kind that carries state or routing
        overrides.setdefault("layers_block_type", ["mamba", "full_attention", "moe"])
    elif "num_hidden_layers" not in overrides:
        hybrid = raw.get("full_attention_interval") or "linear_num_value_heads" in raw
        overrides["num_hidden_layers"] = 2 if hybrid else 1
        if hybrid:
            overrides.setdefault("full_attention_interval", 2)
            overrides.setdefault("mlp_only_layers", [0] if "mlp_only_layers" in raw else [])
    cfg = ModelConfig.from_dict({**raw, **overrides})
    from wmtp.quant import DEFAULT_EXCLUDE, QuantConfig, default_config

    quant = default_config(quantize, DEFAULT_EXCLUDE) if quantize is not None else (
        None if "quantization_config" not in raw else QuantConfig.from_config_dict(raw["quantization_config"], preset))
    model = build_model(cfg, device, dtype or getattr(torch, raw.get("dtype", "float32")), backend, quant)
    return init_random_(model, seed)
