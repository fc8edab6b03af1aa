"""wmtp: Windowed-MTP inference engine. Heavy imports are lazy so ``import wmtp`` stays light."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from wmtp.models.model import CausalLM


def load_model(path_or_preset: str, device: str = "cpu", dtype: Any = None, seed: int = 0, backend: str = "torch") -> "CausalLM":
    """A checkpoint directory (config.json + safetensors) or a preset name (random weights made
    directly on ``device``). ``dtype`` defaults to the checkpoint's / preset's own."""
    from pathlib import Path

    from wmtp.models.loader import build_model, init_random_, load_checkpoint, resolve_dtype
    from wmtp.presets import PRESETS, preset_config

    if Path(path_or_preset).is_dir():
        return load_checkpoint(path_or_preset, device=device, dtype=dtype, backend=backend)
    if path_or_preset not in PRESETS and ("/" in path_or_preset or Path(path_or_preset).exists()):
        from wmtp.errors import CheckpointError

        raise CheckpointError(f"{path_or_preset}: no such checkpoint directory (and not a preset name)")
    cfg = preset_config(path_or_preset)
    model = build_model(cfg, device, resolve_dtype(dtype, cfg.torch_dtype), backend)
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
