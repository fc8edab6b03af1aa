"""Model-shape presets (DESIGN §7) as HF config.json dicts, for random-weight cost runs and tests.

A preset is exactly what ``make-checkpoint`` writes as config.json, so transformers loads the
result (the quantized presets: the base shape with the public releases' ``quantization_config``). The large shapes follow the public configs; the 1M-context ones carry the YaRN factor-4
rope scaling the paper uses to extend Qwen's 262,144-token native context to 1M.
"""

from __future__ import annotations

import copy
from typing import Any

from wmtp.config import ModelConfig
from wmtp.errors import ConfigError

_YARN_1M = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}


def _qwen35_moe(hidden: int, layers: int, heads: int, gdn_v_heads: int, expert_inter: int, vocab: int = 248320,
                experts: int = 256, top_k: int = 8, **extra: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": gdn_v_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_inter,
        "shared_expert_intermediate_size": expert_inter,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, **_YARN_1M},
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": 0,
        "dtype": "bfloat16",
    }
    cfg.update(extra)
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.6-35b-a3b": _qwen35_moe(hidden=2048, layers=40, heads=16, gdn_v_heads=32, expert_inter=512),
    "qwen3.5-122b-a10b": _qwen35_moe(hidden=3072, layers=48, heads=32, gdn_v_heads=64, expert_inter=1024),
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, **_YARN_1M},
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "eos_token_id": 0,
        "dtype": "bfloat16",
    },
    # the public Nemotron-3-Super config (NoPE attention: nothing positional bounds the context)
    "nemotron-3-super-120b-a12b": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": 131072,
        "hidden_size": 4096,
        "num_hidden_layers": 88,
        "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
                                   "EMEMEMEME",
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 2688,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "mlp_hidden_act": "relu2",
        "n_routed_experts": 512,
        "num_experts_per_tok": 22,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2688,
        "moe_shared_expert_intermediate_size": 5376,
        "moe_latent_size": 1024,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 5.0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*E",
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    },
    # ---- tiny shapes: the same code paths, for CPU tests and the demo ----
    "tiny-qwen3.5-moe": _qwen35_moe(
        hidden=64, layers=4, heads=4, gdn_v_heads=4, expert_inter=32, vocab=512, experts=8, top_k=2,
        head_dim=16, num_key_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, max_position_embeddings=65536,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        dtype="float32",
    ),
    "tiny-qwen3-next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "eos_token_id": 0,
        "dtype": "float32",
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 65536,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True,
        "num_nextn_predict_layers": 1,
        "eos_token_id": 0,
        "dtype": "float32",
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "num_nextn_predict_layers": 1,
        "eos_token_id": 0,
        "dtype": "float32",
    },
    "tiny-nemotron-h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "layers_block_type": ["mamba", "moe", "full_attention", "mamba", "mlp"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "use_conv_bias": True,
        "time_step_min": 0.001,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "moe_latent_size": 32,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "mtp_layers_block_type": ["full_attention", "moe"],
        "eos_token_id": 0,
        "dtype": "float32",
    },
}


def _quantized(base: str, fmt: str) -> dict[str, Any]:
    """``base`` with the quantization config of the public ``-NVFP4`` / ``-FP8`` releases (random
    weights quantized to nearest, DESIGN §9): a config.json dict as make-checkpoint writes it."""
    from wmtp.quant import DEFAULT_EXCLUDE, default_config

    return {**copy.deepcopy(PRESETS[base]), "quantization_config": default_config(fmt, DEFAULT_EXCLUDE).config_entries()[1]}


def _nemotron_nvfp4(base: str) -> dict[str, Any]:
    """``base`` with the Nemotron-3-Super NVFP4 release's per-module formats (``NEMOTRON_SUPER_LAYERS``)."""
    from wmtp.quant import NEMOTRON_SUPER_LAYERS, mixed_config

    q = mixed_config(NEMOTRON_SUPER_LAYERS, f"preset {base}-nvfp4").config_entries()[1]
    return {**copy.deepcopy(PRESETS[base]), "quantization_config": q}


PRESETS.update({
    "nemotron-3-super-120b-a12b-nvfp4": _nemotron_nvfp4("nemotron-3-super-120b-a12b"),
    "tiny-nemotron-h-nvfp4": _nemotron_nvfp4("tiny-nemotron-h"),
    "qwen3.6-35b-a3b-nvfp4": _quantized("qwen3.6-35b-a3b", "nvfp4"),
    "qwen3.5-122b-a10b-nvfp4": _quantized("qwen3.5-122b-a10b", "nvfp4"),
    "qwen3.6-35b-a3b-fp8": _quantized("qwen3.6-35b-a3b", "fp8"),
    "tiny-qwen3.5-moe-nvfp4": _quantized("tiny-qwen3.5-moe", "nvfp4"),
})


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return ModelConfig.from_dict(copy.deepcopy(PRESETS[name]))
