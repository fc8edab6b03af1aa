"""wmtp: Windowed-MTP inference engine. Heavy imports are lazy so ``import wmtp`` stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from wmtp.models.base import TargetLM


def load_model(path_or_preset: str, device: str = "cpu", dtype: Any = None, seed: int = 0, backend: str = "torch",
               quantize: str | None = None, tp: Any = None, layers: int | None = None) -> "TargetLM":
    """A checkpoint directory (config.json + safetensors; quantized ones as their config says) or a
    preset name (random weights made directly on ``device``; quantized as the preset says, or to
    ``quantize`` = ``nvfp4`` | ``fp8`` by round-to-nearest). ``dtype`` (of what stays unquantized)
    defaults to the checkpoint's / preset's own. ``tp`` (a ``wmtp.models.parallel.TPGroup``): only
    that rank's shard, the same weights as the whole model's (a preset's too). ``layers``: a preset's
    first that many layers only (``ModelConfig.first_layers``: cost runs where the whole does not fit)."""
    from pathlib import Path

    from wmtp.errors import CheckpointError
    from wmtp.models.loader import build_model, init_random_, load_checkpoint, resolve_dtype
    from wmtp.presets import PRESETS, preset_config
    from wmtp.quant import DEFAULT_EXCLUDE, QuantConfig, default_config

    if Path(path_or_preset).is_dir():
        if quantize is not None:
            raise CheckpointError(f"{path_or_preset}: quantize={quantize!r} applies to presets; a checkpoint "
                                  "carries its own format")
        if layers is not None:
            raise CheckpointError(f"{path_or_preset}: layers={layers} applies to presets; a checkpoint loads whole")
        return load_checkpoint(path_or_preset, device=device, dtype=dtype, backend=backend, tp=tp)
    if path_or_preset not in PRESETS and ("/" in path_or_preset or Path(path_or_preset).exists()):
        raise CheckpointError(f"{path_or_preset}: no such checkpoint directory (and not a preset name)")
    cfg = preset_config(path_or_preset)
    if layers is not None:
        cfg = cfg.first_layers(layers)
    raw_quant = PRESETS[path_or_preset].get("quantization_config")
    if quantize is not None:
        quant = default_config(quantize, DEFAULT_EXCLUDE)
    else:
        quant = None if raw_quant is None else QuantConfig.from_config_dict(raw_quant, f"preset {path_or_preset}")
    model = build_model(cfg, device, resolve_dtype(dtype, cfg.torch_dtype), backend, quant, tp)
    return init_random_(model, seed)


_LAZY = {
    "LLM": "wmtp.engine.llm",
    "SpecConfig": "wmtp.engine.config",
    "SamplingParams": "wmtp.engine.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'wmtp' has no attribute {name!r}")
