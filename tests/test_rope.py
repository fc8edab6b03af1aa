"""wmtp.models.rope against transformers 5.17 (test-only reference)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from wmtp.models.rope import (
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    apply_rotary,
    normalize_rope_config,
    rope_inv_freq,
)

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Qwen3NextConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as qwen3_next_apply  # noqa: E402

# Positions spanning the 1M-context range, including the YaRN / llama3 band edges.
POSITIONS = torch.tensor(
    [0, 1, 2, 3, 17, 255, 4095, 4096, 8191, 8192, 32767, 65535, 131071, 262143, 262144, 500_000, 999_999, 1_000_000]
)

# (id, model family, head_dim, max_position_embeddings, transformers-5 rope_parameters)
CASES: list[tuple[str, str, int, int, dict[str, Any]]] = [
    ("default", "llama", 128, 8192, {"rope_type": "default", "rope_theta": 500000.0}),
    ("default_partial_0.25", "qwen3_next", 256, 262144,
     {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}),
    ("default_partial_1.0", "qwen3_next", 128, 262144,
     {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 1.0}),
    ("linear", "llama", 128, 16384, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ("linear_partial", "qwen3_next", 128, 16384,
     {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5}),
    ("llama3_3.1", "llama", 128, 131072,
     {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen3 2507 1M setting
    ("yarn_qwen_1m", "llama", 128, 1_010_000,
     {"rope_type": "yarn", "rope_theta": 5_000_000.0, "factor": 4.0, "original_max_position_embeddings": 262144}),
    ("yarn_qwen3_next_1m_partial", "qwen3_next", 256, 1_010_000,
     {"rope_type": "yarn", "rope_theta": 10_000_000.0, "factor": 4.0,
      "original_max_position_embeddings": 262144, "partial_rotary_factor": 0.25}),
    ("yarn_qwen_1m_attention_factor", "llama", 128, 1_010_000,
     {"rope_type": "yarn", "rope_theta": 5_000_000.0, "factor": 4.0, "original_max_position_embeddings": 262144,
      "attention_factor": 0.8}),
    ("yarn_qwen_1m_mscale_only", "llama", 128, 1_010_000,  # mscale without mscale_all_dim is ignored
     {"rope_type": "yarn", "rope_theta": 5_000_000.0, "factor": 4.0, "original_max_position_embeddings": 262144,
      "mscale": 0.707}),
    ("yarn_attention_factor_beats_mscale", "llama", 128, 1_010_000,
     {"rope_type": "yarn", "rope_theta": 5_000_000.0, "factor": 4.0, "original_max_position_embeddings": 262144,
      "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.25}),
    # DeepSeek-V3 (qk_rope_head_dim 64): mscale == mscale_all_dim -> scaling exactly 1
    ("yarn_deepseek_v3", "llama", 64, 163840,
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("yarn_deepseek_mscale_ratio", "llama", 64, 163840,
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}),
    ("yarn_factor_null", "llama", 64, 163840,  # factor implied by max_position_embeddings / original
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 4096}),
    # gpt-oss style: no truncation of the correction range
    ("yarn_no_truncate", "llama", 64, 131072,
     {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
]
CASE_IDS = [c[0] for c in CASES]


def _to_legacy(model: str, params: dict[str, Any]) -> dict[str, Any]:
    """The same rope settings spelled the transformers-4 way (top-level theta / partial, rope_scaling)."""
    p = dict(params)
    raw: dict[str, Any] = {"rope_theta": p.pop("rope_theta")}
    if "partial_rotary_factor" in p:
        raw["partial_rotary_factor"] = p.pop("partial_rotary_factor")
    rope_type = p.pop("rope_type")
    # alternate the legacy "type" spelling with "rope_type"
    raw["rope_scaling"] = None if rope_type == "default" else {("type" if len(p) % 2 else "rope_type"): rope_type, **p}
    return raw


def _raw_config(model: str, head_dim: int, max_pos: int, params: dict[str, Any], style: str) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "num_hidden_layers": 4,
        "intermediate_size": 16,
        "vocab_size": 32,
        "max_position_embeddings": max_pos,
    }
    if model == "qwen3_next":
        raw.update(linear_num_key_heads=1, linear_num_value_heads=1, num_experts=2, num_experts_per_tok=1,
                   moe_intermediate_size=8, shared_expert_intermediate_size=8)
    if style == "new":
        raw["rope_parameters"] = copy.deepcopy(params)
    else:
        raw.update(_to_legacy(model, copy.deepcopy(params)))
    return raw


def _hf(model: str, raw: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
    if model == "llama":
        cls, rot_cls = LlamaConfig, LlamaRotaryEmbedding
    else:
        cls, rot_cls = Qwen3NextConfig, Qwen3NextRotaryEmbedding
    cfg = cls(**copy.deepcopy(raw))
    return cfg, rot_cls(cfg)


def _hf_inv_freq(model: str, cfg: Any) -> tuple[torch.Tensor, float]:
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        rot_cls = LlamaRotaryEmbedding if model == "llama" else Qwen3NextRotaryEmbedding
        return rot_cls.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](cfg)


@pytest.mark.parametrize("style", ["new", "legacy"])
@pytest.mark.parametrize(("name", "model", "head_dim", "max_pos", "params"), CASES, ids=CASE_IDS)
def test_inv_freq_and_scaling_match_transformers(name, model, head_dim, max_pos, params, style):
    raw = _raw_config(model, head_dim, max_pos, params, style)
    cfg, _ = _hf(model, raw)
    ref_inv, ref_scale = _hf_inv_freq(model, cfg)

    rope = normalize_rope_config(raw)
    inv, scale = rope_inv_freq(rope, head_dim, max_pos)

    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    assert inv.dtype == torch.float32 and inv.shape == (rot_dim // 2,)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert math.isclose(scale, float(ref_scale), rel_tol=1e-6)
    if "attention_factor" in params:
        assert scale == pytest.approx(params["attention_factor"])
    # our normalised dict agrees with transformers' standardised rope_parameters
    for key, val in rope.items():
        assert cfg.rope_parameters.get(key, 1.0 if key == "partial_rotary_factor" else None) == val, key


@pytest.mark.parametrize(("name", "model", "head_dim", "max_pos", "params"), CASES, ids=CASE_IDS)
def test_cos_sin_match_transformers_up_to_1m(name, model, head_dim, max_pos, params):
    raw = _raw_config(model, head_dim, max_pos, params, "new")
    _, hf_rot = _hf(model, raw)
    x = torch.zeros(1, len(POSITIONS), head_dim, dtype=torch.float32)
    ref_cos, ref_sin = hf_rot(x, POSITIONS[None])

    emb = RotaryEmbedding(normalize_rope_config(raw), head_dim, max_pos)
    cos, sin = emb(POSITIONS)
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    assert cos.shape == sin.shape == (len(POSITIONS), rot_dim)
    assert cos.dtype == sin.dtype == torch.float32
    # same fp32 inv_freq and same fp32 products -> agreement far below fp32 angle error at 1e6
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)


def test_rotary_embedding_keeps_fp32_through_module_casts():
    rope = normalize_rope_config({"rope_parameters": CASES[6][4]})
    emb = RotaryEmbedding(rope, 128, 1_010_000)
    cos0, sin0 = emb(POSITIONS)
    emb = emb.to(torch.bfloat16)
    assert emb.inv_freq.dtype == torch.float32
    cos1, sin1 = emb(POSITIONS)
    assert torch.equal(cos0, cos1) and torch.equal(sin0, sin1)
    assert emb.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert "inv_freq" not in emb.state_dict()


@pytest.mark.parametrize("prf", [0.25, 0.5, 1.0])
def test_apply_rotary_matches_transformers(prf):
    head_dim, heads, max_pos = 128, 3, 262144
    params = {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0, "original_max_position_embeddings": 65536,
              "partial_rotary_factor": prf}
    emb = RotaryEmbedding(normalize_rope_config({"rope_parameters": params}), head_dim, max_pos)
    gen = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 5, 77, 4096, 100_000, 262_143])
    q = torch.randn(len(pos), heads, head_dim, generator=gen)
    k = torch.randn(len(pos), heads, head_dim, generator=gen)
    cos, sin = emb(pos)

    ref_q, ref_k = qwen3_next_apply(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k, rtol=0, atol=1e-6)
    rot_dim = int(head_dim * prf)
    assert torch.equal(apply_rotary(q, cos, sin)[..., rot_dim:], q[..., rot_dim:])
    if prf == 1.0:
        ref_q2, _ = llama_apply(q, k, cos, sin, unsqueeze_dim=1)
        torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q2, rtol=0, atol=1e-6)

    # low-precision input: computed in fp32, returned in the input dtype
    qb = q.to(torch.bfloat16)
    out = apply_rotary(qb, cos, sin)
    assert out.dtype == torch.bfloat16
    ref_b, _ = qwen3_next_apply(qb.float(), qb.float(), cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(out, ref_b.to(torch.bfloat16), rtol=0, atol=0)


def test_apply_rotary_rejects_bad_width():
    cos = torch.ones(2, 6)
    with pytest.raises(ValueError, match="head_dim 4"):
        apply_rotary(torch.zeros(2, 1, 4), cos, cos)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["dynamic", "longrope", "mrope", "proportional"])
def test_unsupported_rope_type(bad):
    for call in (
        lambda: rope_inv_freq({"rope_type": bad, "rope_theta": 1e4, "factor": 2.0}, 128, 4096),
        lambda: normalize_rope_config({"rope_theta": 1e4, "rope_scaling": {"type": bad, "factor": 2.0}}),
        lambda: normalize_rope_config({"rope_parameters": {"rope_type": bad, "rope_theta": 1e4}}),
    ):
        with pytest.raises(ValueError) as ei:
            call()
        msg = str(ei.value)
        assert "rope_scaling.rope_type" in msg and repr(bad) in msg
        assert all(t in msg for t in SUPPORTED_ROPE_TYPES)


def test_yarn_missing_factor():
    rope = normalize_rope_config(
        {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32768}}
    )
    with pytest.raises(ValueError, match=r"rope_scaling\.factor"):
        rope_inv_freq(rope, 128, 131072)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "factor"),
    ],
)
def test_missing_required_params(params, field):
    with pytest.raises(ValueError, match=rf"rope_scaling\.{field}'"):
        rope_inv_freq({"rope_theta": 1e4, **params}, 128, 4096)


def test_odd_rotary_dim_rejected():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inv_freq({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}, 10, 4096)


# ---------------------------------------------------------------------------------------------
# normalize_rope_config
# ---------------------------------------------------------------------------------------------
def test_normalize_legacy_llama31():
    raw = {
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    }
    assert normalize_rope_config(raw) == {
        "rope_type": "llama3", "rope_theta": 500000.0, "partial_rotary_factor": 1.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }


def test_normalize_legacy_defaults_and_type_key():
    assert normalize_rope_config({"rope_scaling": None}) == {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
    }
    # Qwen3-Next legacy: top-level theta and partial_rotary_factor
    assert normalize_rope_config({"rope_theta": 10000000, "partial_rotary_factor": 0.25, "rope_scaling": None}) == {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
    }
    # Qwen2.5 legacy YaRN spelled with "type"
    got = normalize_rope_config(
        {"rope_theta": 1e6, "max_position_embeddings": 131072,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    )
    assert got == {"rope_type": "yarn", "rope_theta": 1e6, "partial_rotary_factor": 1.0, "factor": 4.0,
                   "original_max_position_embeddings": 32768}


def test_normalize_new_style_qwen35_ignores_mrope():
    raw = {
        "max_position_embeddings": 262144,
        "partial_rotary_factor": 0.5,  # the rope_parameters value wins
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    }
    assert normalize_rope_config(raw) == {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}


def test_normalize_original_max_position_embeddings_rules():
    # missing -> max_position_embeddings (transformers' standardisation)
    got = normalize_rope_config({"max_position_embeddings": 40960,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}})
    assert got["original_max_position_embeddings"] == 40960
    # a top-level value wins over the one inside the rope dict
    got = normalize_rope_config({"max_position_embeddings": 40960, "original_max_position_embeddings": 8192,
                                 "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                  "original_max_position_embeddings": 4096}})
    assert got["original_max_position_embeddings"] == 8192
    # non-scaled types do not get it
    assert "original_max_position_embeddings" not in normalize_rope_config({"max_position_embeddings": 4096})


def test_normalize_rejects_per_layer_rope():
    raw = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="per-layer"):
        normalize_rope_config(raw)
