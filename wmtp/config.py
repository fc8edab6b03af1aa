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

# model_type -> family. "hybrid" = Gated DeltaNet + gated attention + MoE; "dense" = Llama-style;
# "mamba_hybrid" = Nemotron-H: one mixer per block (Mamba2, NoPE attention, ReLU² MLP or latent MoE).
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "nemotron_h": "mamba_hybrid",
    "qwen3_next": "hybrid",
    "qwen3_5_moe": "hybrid",
    "qwen3_5_moe_text": "hybrid",
    "llama": "dense",
    "qwen3": "dense",
}
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "NemotronHForCausalLM": "nemotron_h",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}
LayerType = Literal["full_attention", "linear_attention", "mamba", "mlp", "moe"]
# Nemotron-H block types: transformers 5's names, its legacy ones and the pattern string's letters
NEMOTRON_BLOCKS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba", "full_attention": "full_attention",
                   "attention": "full_attention", "*": "full_attention", "mlp": "mlp", "-": "mlp", "moe": "moe",
                   "E": "moe"}


@dataclass(frozen=True)
class Mamba2Shape:
    """A Nemotron-H Mamba2 mixer: ``heads`` x ``head_dim`` channels sharing B / C of ``groups``
    groups of ``state``; the conv over ``x | B | C`` (kernel ``conv_kernel``, with a bias if
    ``conv_bias``); prefill in chunks of ``chunk``; dt clamped to ``dt_limit``."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv_kernel: int
    chunk: int
    dt_limit: tuple[float, float]
    conv_bias: bool

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


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
    # Nemotron-H: the Mamba2 mixers; the routed experts' latent width (0: none); sigmoid routing with
    # a score-correction bias over n_group groups (topk_group kept), weights times the scaling factor
    mamba: Mamba2Shape | None = None
    moe_latent_size: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # MTP head (Nemotron-H: the block types of its layers)
    num_nextn_predict_layers: int = 0
    mtp_layer_types: list[str] = field(default_factory=list)
    # misc
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # the raw (un-nested) dict this came from, written back by make-checkpoint
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def first_layers(self, n: int) -> ModelConfig:
        """This shape with only its first ``n`` layers (and its MTP layers): a shortened model whose
        every layer costs what it does in the whole one, for cost runs on a GPU the whole model does
        not fit. ``raw`` names the shortened layer count (what a writer would write)."""
        if not 0 < n <= self.num_layers:
            raise ConfigError(f"layers={n}: the model has {self.num_layers} layers; keep between 1 and "
                              f"{self.num_layers}")
        raw = {**self.raw, "num_hidden_layers": n}
        for key in ("layer_types", "layers_block_type"):
            if isinstance(raw.get(key), list):
                raw[key] = raw[key][:n]
        if isinstance(raw.get("hybrid_override_pattern"), str):
            raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][:n]
        return dataclasses.replace(self, num_layers=n, layer_types=self.layer_types[:n],
                                   mlp_only_layers=[i for i in self.mlp_only_layers if i < n], raw=raw)

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
        return self.model_type not in ("llama", "nemotron_h")

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

    @property
    def num_mtp_attention_layers(self) -> int:
        """Attention layers of the MTP head: one per MTP layer (Qwen, DeepSeek), or those of each
        step's block pattern (Nemotron-H)."""
        if self.family == "mamba_hybrid":
            return self.num_nextn_predict_layers * self.mtp_layer_types.count("full_attention")
        return self.num_nextn_predict_layers

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
    if family == "mamba_hybrid":
        return _parse_nemotron_h(raw, text)
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


def _blocks(value: Any, field_name: str) -> list[str]:
    """Nemotron-H block types from a list of names or a pattern string (``M*-E``)."""
    items = list(value) if not isinstance(value, str) else list(value)
    bad = sorted({str(t) for t in items if t not in NEMOTRON_BLOCKS})
    if bad or not items:
        raise ConfigError(f"config.json field {field_name!r} has unsupported value(s) {bad or items}; "
                          f"supported: {sorted(NEMOTRON_BLOCKS)}")
    return [NEMOTRON_BLOCKS[t] for t in items]


def _parse_nemotron_h(raw: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
    """Nemotron-H as transformers 5.17 reads it: blocks from ``layers_block_type`` (or the legacy
    ``hybrid_override_pattern``; ``num_hidden_layers`` is ignored as there), the Mamba2 fields under
    their current or ``mamba_*`` names, NoPE attention, ReLU² MLPs, sigmoid-routed latent MoE. dt is
    clamped to [time_step_min, inf), as transformers' mixer does whatever ``time_step_limit`` says."""
    mt = "nemotron_h"
    req = lambda k: _require(text, k, mt)  # noqa: E731
    # the legacy name wins where both are given, as in transformers
    get = lambda k, legacy, default: text.get(legacy, text.get(k, default))  # noqa: E731
    if "layers_block_type" in text and text["layers_block_type"] is not None:
        blocks = _blocks(text["layers_block_type"], "layers_block_type")
    else:
        blocks = _blocks(req("hybrid_override_pattern"), "hybrid_override_pattern")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if text.get(key, want) != want:
            raise ConfigError(f"config.json field {key!r}={text[key]!r} is not supported; supported: [{want!r}]")
    for key in ("mlp_bias", "attention_bias", "use_bias", "mamba_proj_bias"):
        if text.get(key):
            raise ConfigError(f"config.json field {key!r}=true is not supported; supported: [false]")
    hidden, n_heads = int(req("hidden_size")), int(req("num_attention_heads"))
    mamba = Mamba2Shape(heads=int(req("mamba_num_heads")), head_dim=int(req("mamba_head_dim")),
                        state=int(req("ssm_state_size")), groups=int(get("n_groups", "mamba_n_groups", 8)),
                        conv_kernel=int(get("conv_kernel", "mamba_d_conv", 4)),
                        chunk=int(get("chunk_size", "mamba_chunk_size", 128)),
                        dt_limit=(float(get("time_step_min", "mamba_dt_min", 0.001)), float("inf")),
                        conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)))
    if mamba.heads % mamba.groups:
        raise ConfigError(f"config.json: mamba_num_heads={mamba.heads} is not a multiple of n_groups={mamba.groups}")
    n_mtp = int(text.get("num_nextn_predict_layers") or 0)
    mtp_blocks = text.get("mtp_layers_block_type") or text.get("mtp_hybrid_override_pattern") or ["full_attention", "moe"]
    cfg = ModelConfig(
        model_type=mt, vocab_size=int(req("vocab_size")), hidden_size=hidden, num_layers=len(blocks),
        num_heads=n_heads, num_kv_heads=int(text.get("num_key_value_heads") or n_heads),
        head_dim=int(text.get("head_dim") or hidden // n_heads), layer_types=blocks, rope={"rope_type": "none"},
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(text.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
        bos_token_id=text.get("bos_token_id"), eos_token_id=text.get("eos_token_id"),
        mamba=mamba, num_nextn_predict_layers=n_mtp, mtp_layer_types=_blocks(mtp_blocks, "mtp_layers_block_type"),
        raw=raw,
    )
    if "mamba" in cfg.mtp_layer_types or cfg.mtp_layer_types.count("full_attention") > 1:
        # the draft's KV of a slot must depend on that slot alone (its windowed prefill writes K/V
        # without attention, DESIGN §4): at most one attention block per step, no recurrence
        raise ConfigError(f"config.json field 'mtp_layers_block_type'={cfg.mtp_layer_types}: MTP steps with Mamba2 "
                          "blocks or more than one attention block are not supported; supported: at most one "
                          "attention block with mlp and moe blocks")
    if "moe" in blocks + (cfg.mtp_layer_types if n_mtp else []):
        cfg.num_experts = int(req("n_routed_experts"))
        cfg.num_experts_per_tok = int(req("num_experts_per_tok"))
        cfg.moe_intermediate_size = int(req("moe_intermediate_size"))
        cfg.shared_expert_intermediate_size = int(text.get("moe_shared_expert_intermediate_size") or 0)
        cfg.moe_latent_size = int(text.get("moe_latent_size") or 0)
        cfg.routed_scaling_factor = float(text.get("routed_scaling_factor", 1.0))
        cfg.n_group, cfg.topk_group = int(text.get("n_group", 1)), int(text.get("topk_group", 1))
        cfg.norm_topk_prob = bool(text.get("norm_topk_prob", True))
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts or cfg.num_experts % cfg.n_group:
            raise ConfigError(f"config.json: num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, "
                              f"n_routed_experts={cfg.num_experts}], which n_group={cfg.n_group} must divide")
        if int(text.get("n_shared_experts", 1)) != 1:
            raise ConfigError(f"config.json field 'n_shared_experts'={text['n_shared_experts']!r}; supported: [1]")
    if "mlp" in blocks and cfg.intermediate_size <= 0:
        raise ConfigError("config.json field 'intermediate_size' is required: some blocks are MLPs")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"config.json: num_attention_heads={cfg.num_heads} is not a multiple of "
                          f"num_key_value_heads={cfg.num_kv_heads}")
    return cfg
