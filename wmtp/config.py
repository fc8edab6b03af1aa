"""ModelConfig: one normalised view of every supported HF config.json.

HF configs for the same architecture come in several spellings (transformers 4 vs 5 rope fields,
Qwen3.5's nested ``text_config``, Qwen3-Next's ``mtp_num_hidden_layers`` vs DeepSeek's
``num_nextn_predict_layers``). Everything downstream reads only this dataclass, so each spelling is
handled here once, and every unsupported value fails here with the field name in the message.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from wmtp.errors import ConfigError

# model_type -> family. "hybrid" = Gated DeltaNet + gated attention + MoE; "dense" = Llama-style.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen3_next": "hybrid",
    "qwen3_5_moe": "hybrid",
    "qwen3_5_moe_text": "hybrid",
    "llama": "dense",
    "qwen3": "dense",
}
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}
LayerType = Literal["full_attention", "linear_attention"]


@dataclass
class ModelConfig:
    """Normalised model shape. Invariant: ``len(layer_types) == num_layers``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: list[str]
    rope: dict[str, Any]
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # dense MLP (Llama layers, Qwen3-Next mlp_only_layers)
    intermediate_size: int = 0
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # MTP head
    num_nextn_predict_layers: int = 0
    # misc
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # the raw (un-nested) dict this came from, written back by make-checkpoint
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    # ---- derived properties -------------------------------------------------------------
    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def is_hybrid(self) -> bool:
        return self.family == "hybrid"

    @property
    def gated_attention(self) -> bool:
        """Qwen3-Next / 3.5 attention: q_proj doubled into query + sigmoid output gate."""
        return self.is_hybrid

    @property
    def qk_norm(self) -> bool:
        return self.model_type != "llama"

    @property
    def norm_offset(self) -> bool:
        """Qwen3-Next / 3.5 RMSNorm computes x * (1 + w) with w initialised at zero."""
        return self.is_hybrid

    @property
    def gdn_fused_projections(self) -> bool:
        """Qwen3-Next stores in_proj_qkvz / in_proj_ba; Qwen3.5 splits them into four."""
        return self.model_type == "qwen3_next"

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def layer_is_moe(self, layer_idx: int) -> bool:
        """Which FFN a target layer uses (the MTP layer uses the model's sparse FFN if it has one)."""
        if self.num_experts <= 0 or layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def mtp_is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.gdn_value_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def draft_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """One MTP attention layer: K and V, kv_heads x head_dim each (DESIGN §4)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def target_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return len(self.full_attention_layers) * self.draft_kv_bytes_per_token(dtype_bytes)

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- (de)serialisation ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return _parse(raw)


def _text_config(raw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Resolve model_type and the dict holding the language-model fields."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type is None and archs:
        model_type = SUPPORTED_ARCHITECTURES.get(archs[0])
    if model_type not in SUPPORTED_MODEL_TYPES:
        what = f"model_type={model_type!r}" + (f", architectures={archs}" if archs else "")
        raise ConfigError(
            f"unknown architecture ({what}); supported model_type: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    text = raw
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        text = {**raw["text_config"]}
        for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
            if k not in text and k in raw:
                text[k] = raw[k]
    return model_type, text


def _require(text: dict[str, Any], key: str, model_type: str) -> Any:
    if key not in text or text[key] is None:
        raise ConfigError(f"config.json field {key!r} is required for model_type {model_type!r}")
    return text[key]


def _layer_types(text: dict[str, Any], n_layers: int, family: str) -> list[str]:
    lt = text.get("layer_types")
    if family == "dense":
        if text.get("use_sliding_window"):
            raise ConfigError("config.json field 'use_sliding_window'=true is not supported; supported: [false]")
        bad = sorted({t for t in (lt or []) if t != "full_attention"})
        if bad:
            raise ConfigError(
                f"config.json field 'layer_types' has unsupported value(s) {bad}; supported: ['full_attention']"
            )
        return ["full_attention"] * n_layers
    if lt is None:
        interval = text.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"config.json field 'full_attention_interval'={interval!r} must be an int >= 1")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    legacy = {"attention": "full_attention", "linear": "linear_attention"}
    out = [legacy.get(t, t) for t in lt]
    bad = sorted({t for t in out if t not in ("full_attention", "linear_attention")})
    if bad:
        raise ConfigError(
            f"config.json field 'layer_types' has unsupported value(s) {bad}; "
            "supported: ['full_attention', 'linear_attention']"
        )
    if len(out) != n_layers:
        raise ConfigError(f"config.json field 'layer_types' has {len(out)} entries, num_hidden_layers={n_layers}")
    return out


def _parse(raw: dict[str, Any]) -> ModelConfig:
    from wmtp.models.rope import normalize_rope_config

    model_type, text = _text_config(raw)
    family = SUPPORTED_MODEL_TYPES[model_type]
    req = lambda k: _require(text, k, model_type)  # noqa: E731
    hidden = int(req("hidden_size"))
    n_heads = int(req("num_attention_heads"))
    n_layers = int(req("num_hidden_layers"))
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json field 'hidden_act'={act!r} is not supported; supported: ['silu']")
    head_dim = text.get("head_dim") or hidden // n_heads
    rope_params = text.get("rope_parameters") or {}
    if family == "hybrid" and "partial_rotary_factor" not in text and "partial_rotary_factor" not in rope_params:
        text = {**text, "partial_rotary_factor": 0.25}  # transformers' default for Qwen3-Next / 3.5
    try:
        rope = normalize_rope_config(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    dtype = text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(text.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        layer_types=_layer_types(text, n_layers, family),
        rope=rope,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        attention_bias=bool(text.get("attention_bias", False)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        torch_dtype=str(dtype),
        bos_token_id=text.get("bos_token_id"),
        eos_token_id=text.get("eos_token_id"),
        num_nextn_predict_layers=int(
            text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0
        ),
        raw=raw,
    )
    if text.get("mlp_bias"):
        raise ConfigError("config.json field 'mlp_bias'=true is not supported; supported: [false]")
    if family == "hybrid":
        _parse_hybrid(cfg, text, model_type)
    elif cfg.intermediate_size <= 0:
        raise ConfigError(f"config.json field 'intermediate_size' is required for model_type {model_type!r}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads={cfg.num_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_kv_heads}"
        )
    return cfg


def _parse_hybrid(cfg: ModelConfig, text: dict[str, Any], model_type: str) -> None:
    req = lambda k: int(_require(text, k, model_type))  # noqa: E731
    cfg.linear_num_key_heads = req("linear_num_key_heads")
    cfg.linear_num_value_heads = req("linear_num_value_heads")
    cfg.linear_key_head_dim = req("linear_key_head_dim")
    cfg.linear_value_head_dim = req("linear_value_head_dim")
    cfg.linear_conv_kernel_dim = int(text.get("linear_conv_kernel_dim", 4))
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"config.json: linear_num_value_heads={cfg.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads={cfg.linear_num_key_heads}"
        )
    cfg.num_experts = int(text.get("num_experts") or 0)
    if cfg.num_experts > 0:
        cfg.num_experts_per_tok = req("num_experts_per_tok")
        cfg.moe_intermediate_size = req("moe_intermediate_size")
        cfg.shared_expert_intermediate_size = int(text.get("shared_expert_intermediate_size") or 0)
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(
                f"config.json field 'num_experts_per_tok'={cfg.num_experts_per_tok} must be in "
                f"[1, num_experts={cfg.num_experts}]"
            )
    # Qwen3.5 MoE has no norm_topk_prob field: its router always renormalises.
    cfg.norm_topk_prob = bool(text.get("norm_topk_prob", True))
    if model_type == "qwen3_next":
        cfg.mlp_only_layers = list(text.get("mlp_only_layers") or [])
        cfg.decoder_sparse_step = int(text.get("decoder_sparse_step", 1))
    if any(not cfg.layer_is_moe(i) for i in range(cfg.num_layers)) and cfg.intermediate_size <= 0:
        raise ConfigError("config.json field 'intermediate_size' is required: some layers use a dense MLP")
