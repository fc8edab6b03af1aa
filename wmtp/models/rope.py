"""Rotary position embeddings (RoPE): config normalisation, inverse frequencies, cos/sin, apply.

Semantics follow transformers 5.17 (``modeling_rope_utils``) for the rope types we support:

    default   inv_freq[i] = theta ** (-2i / rot_dim)
    linear    default / factor
    llama3    Llama-3.1 wavelength-banded scaling with a linear blend between the bands
    yarn      per-dimension blend of interpolated (/ factor) and original frequencies, plus an
              attention scaling ("mscale") that multiplies cos and sin

``rot_dim = int(head_dim * partial_rotary_factor)``: only the first ``rot_dim`` channels of each
head are rotated, in the "rotate_half" layout (channel j pairs with channel j + rot_dim // 2).

All frequency math is fp32 and follows the same operation order as transformers so that inv_freq
is bit-identical; that matters because at position 1e6 a one-ulp change in inv_freq moves the
angle by ~0.06 rad.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "RotaryEmbedding",
    "apply_rotary",
    "normalize_rope_config",
    "rope_inv_freq",
]

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")

#: Scaling parameters kept by ``normalize_rope_config`` (spelled as in HF config.json).
_PARAM_KEYS: tuple[str, ...] = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)
#: Rope types whose pretraining length defaults to max_position_embeddings (as in transformers).
_USES_ORIGINAL_MAX = ("llama3", "yarn")
_DEFAULT_THETA = 10000.0


# ---------------------------------------------------------------------------------------------
# config normalisation
# ---------------------------------------------------------------------------------------------
def _check_rope_type(rope_type: Any) -> str:
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json field 'rope_scaling.rope_type'={rope_type!r} is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def normalize_rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Turn a raw (text-level) HF config dict into the normalised rope dict.

    Accepts transformers-5 ``rope_parameters`` and legacy ``rope_theta`` / ``rope_scaling`` /
    ``partial_rotary_factor``. Precedence mirrors transformers: a non-empty ``rope_scaling`` wins
    over ``rope_parameters``; keys inside the rope dict win over top-level ``rope_theta`` /
    ``partial_rotary_factor``; ``rope_type`` wins over legacy ``type``; a top-level
    ``original_max_position_embeddings`` wins over the one in the rope dict (llama3 / yarn), which
    otherwise defaults to ``max_position_embeddings``. Unknown keys (e.g. Qwen3.5's
    ``mrope_section`` / ``mrope_interleaved``) are dropped.
    """
    src = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(src, dict):
        raise ValueError(f"config.json field 'rope_scaling' must be a dict or null, got {type(src).__name__}")
    if src and all(isinstance(v, dict) or v is None for v in src.values()):
        raise ValueError(
            "config.json field 'rope_parameters' is a per-layer-type dict "
            f"(keys {sorted(src)}); only a single global rope config is supported"
        )

    rope_type = _check_rope_type(src.get("rope_type") or src.get("type") or "default")
    theta = src.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta")
    if theta is None:
        theta = _DEFAULT_THETA
    prf = src.get("partial_rotary_factor")
    if prf is None:
        prf = cfg.get("partial_rotary_factor")
    if prf is None:
        prf = 1.0

    out: dict[str, Any] = {
        "rope_type": rope_type,
        "rope_theta": float(theta),
        "partial_rotary_factor": float(prf),
    }
    for key in _PARAM_KEYS:
        if key in src:
            out[key] = src[key]
    if rope_type in _USES_ORIGINAL_MAX:
        top = cfg.get("original_max_position_embeddings")
        if top is not None:
            out["original_max_position_embeddings"] = top
        elif out.get("original_max_position_embeddings") is None and cfg.get("max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    return out


# ---------------------------------------------------------------------------------------------
# inverse frequencies
# ---------------------------------------------------------------------------------------------
def _number(rope: dict[str, Any], key: str, rope_type: str, default: float | None = None) -> float:
    """A required (default None) or optional numeric rope parameter, with a field-naming error."""
    val = rope.get(key, default)
    if val is None:
        raise ValueError(f"config.json field 'rope_scaling.{key}' is required for rope_type={rope_type!r}")
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise ValueError(f"config.json field 'rope_scaling.{key}'={val!r} must be a number")
    return val


def _exponents(rot_dim: int) -> Tensor:
    """``2i / rot_dim`` for i in [0, rot_dim / 2), fp32."""
    return torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    rope: dict[str, Any], theta: float, rot_dim: int, max_position_embeddings: int
) -> tuple[Tensor, float]:
    if "factor" not in rope:
        raise ValueError("config.json field 'rope_scaling.factor' is required for rope_type='yarn'")
    orig = _number(rope, "original_max_position_embeddings", "yarn", max_position_embeddings)
    factor = rope["factor"]
    if factor is None:  # DeepSeek-V3 style: implied by the context extension ratio
        factor = max_position_embeddings / orig
    factor = _number({"factor": factor}, "factor", "yarn")

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # both must be set (and non-zero) to be used
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    # falsy (None / 0) betas fall back to the paper's 32 / 1
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def dim_for_rotations(n_rot: float) -> float:
        # the (fractional) dim index whose wavelength fits n_rot times into the original context
        return rot_dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot_dim - 1)
    if lo == hi:
        hi += 0.001

    wavelen_base = theta ** _exponents(rot_dim)
    extrapolated = 1.0 / wavelen_base  # unscaled (high-frequency dims)
    interpolated = 1.0 / (factor * wavelen_base)  # position-interpolated (low-frequency dims)
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # weight of the unscaled frequency
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(rope: dict[str, Any], base_inv_freq: Tensor, max_position_embeddings: int) -> Tensor:
    factor = _number(rope, "factor", "llama3")
    low = _number(rope, "low_freq_factor", "llama3")
    high = _number(rope, "high_freq_factor", "llama3")
    orig = _number(rope, "original_max_position_embeddings", "llama3", max_position_embeddings)
    if high == low:
        raise ValueError(
            "config.json fields 'rope_scaling.high_freq_factor' and 'rope_scaling.low_freq_factor' must differ"
        )
    long_wavelen = orig / low  # wavelengths above this are divided by factor
    short_wavelen = orig / high  # wavelengths below this are kept

    wavelen = 2 * math.pi / base_inv_freq
    scaled = torch.where(wavelen > long_wavelen, base_inv_freq / factor, base_inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = ~(wavelen < short_wavelen) * ~(wavelen > long_wavelen)
    return torch.where(in_between, blended, scaled)


def rope_inv_freq(rope: dict[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """Inverse frequencies (fp32, length ``rot_dim // 2``) and the cos/sin attention scaling.

    ``rope`` is a dict from ``normalize_rope_config``. ``max_position_embeddings`` is the model's
    (post-extension) context length: the default for ``original_max_position_embeddings`` and,
    for YaRN with ``factor: null``, the numerator of the implied factor.
    """
    rope_type = _check_rope_type(rope.get("rope_type", "default"))
    theta = float(_number(rope, "rope_theta", rope_type, _DEFAULT_THETA))
    prf = _number(rope, "partial_rotary_factor", rope_type, 1.0)
    if not 0.0 < prf <= 1.0:
        raise ValueError(f"config.json field 'partial_rotary_factor'={prf!r} must be in (0, 1]")
    rot_dim = int(head_dim * prf)
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(
            f"rotary dim int(head_dim * partial_rotary_factor) = int({head_dim} * {prf}) = {rot_dim} "
            "must be a positive even number"
        )

    if rope_type == "yarn":
        return _yarn_inv_freq(rope, theta, rot_dim, max_position_embeddings)
    inv_freq = 1.0 / (theta ** _exponents(rot_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / _number(rope, "factor", "linear")
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(rope, inv_freq, max_position_embeddings)
    return inv_freq, 1.0


# ---------------------------------------------------------------------------------------------
# cos / sin and application
# ---------------------------------------------------------------------------------------------
class RotaryEmbedding(torch.nn.Module):
    """Maps positions to (cos, sin), each fp32 ``[..., rot_dim]`` and pre-multiplied by the scaling."""

    inv_freq: Tensor

    def __init__(self, rope: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(rope, head_dim, max_position_embeddings)
        self._inv_freq_fp32 = inv_freq  # master copy: dtype casts of the module must not touch it
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        # [inv_freq, inv_freq]: cos / sin come out at full rot_dim width with no cat (3 kernels, not 6)
        self.register_buffer("inv_freq2", torch.cat((inv_freq, inv_freq)), persistent=False)
        self.attention_scaling: float = scaling
        self.head_dim: int = head_dim
        self.rot_dim: int = 2 * inv_freq.numel()

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        """Follow device moves but keep inv_freq fp32 (e.g. through ``module.to(torch.bfloat16)``)."""
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)
        self.inv_freq2 = torch.cat((self.inv_freq, self.inv_freq))
        return self

    def forward(self, positions: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``positions`` (int, any shape, e.g. ``[T]``) -> (cos, sin) of shape ``[*positions.shape, rot_dim]``,
        written into ``out`` when given (static buffers of that shape)."""
        inv_freq = self.inv_freq2
        # fp32 outer product (the int positions promote to fp32 inside the multiply: exact up to 2**24)
        freqs = positions.to(inv_freq.device).unsqueeze(-1) * inv_freq
        if out is None:
            cos, sin = freqs.cos(), freqs.sin()
        else:
            cos, sin = torch.cos(freqs, out=out[0]), torch.sin(freqs, out=out[1])
        if self.attention_scaling != 1.0:
            cos, sin = cos.mul_(self.attention_scaling), sin.mul_(self.attention_scaling)
        return cos, sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rot_dim={self.rot_dim}, attention_scaling={self.attention_scaling}"


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``rot_dim = cos.shape[-1]`` channels of ``x`` (rotate_half layout).

    ``x``: ``[T, heads, head_dim]`` (any leading dims matching cos's); ``cos`` / ``sin``:
    ``[T, rot_dim]`` from ``RotaryEmbedding``. Channels past ``rot_dim`` pass through unchanged.
    Computes in fp32 and returns ``x.dtype``.
    """
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim > x.shape[-1]:
        raise ValueError(f"cos/sin width {rot_dim} must be even and <= head_dim {x.shape[-1]}")
    half = rot_dim // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    c = cos[..., :half].unsqueeze(-2).to(acc)  # broadcast over heads
    s = sin[..., :half].unsqueeze(-2).to(acc)
    x1 = x[..., :half].to(acc)
    x2 = x[..., half:rot_dim].to(acc)
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rot_dim < x.shape[-1]:
        parts.append(x[..., rot_dim:].to(acc))
    return torch.cat(parts, dim=-1).to(x.dtype)
