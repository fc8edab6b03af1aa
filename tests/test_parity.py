"""Parity with transformers on tiny random checkpoints built IN transformers (fp32, CPU).

For each architecture: build the model with transformers, save_pretrained, load with wmtp, compare
logits on 3 sequences of >= 80 tokens (crossing the conv window and several GDN chunk boundaries:
sequences up to 150 tokens with 64-token chunks). Tolerance 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import wmtp
from tests.helpers import max_abs_diff, scramble_

transformers = pytest.importorskip("transformers")

TOL = 1e-4
SEQ_LENS = (80, 131, 150)

_HYBRID_COMMON = dict(
    vocab_size=160, hidden_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
    moe_intermediate_size=20, shared_expert_intermediate_size=24, max_position_embeddings=4096,
)


def _qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        **_HYBRID_COMMON, intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    return transformers.Qwen3NextForCausalLM(cfg)


def _qwen3_5_moe_vl():
    text = dict(**_HYBRID_COMMON, full_attention_interval=2)
    cfg = transformers.Qwen3_5MoeConfig(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=48),
    )
    return transformers.Qwen3_5MoeForConditionalGeneration(cfg)


def _qwen3_5_moe_text():
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**_HYBRID_COMMON))


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=160, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256, "rope_theta": 500000.0},
    )
    return transformers.LlamaForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3Config(
        vocab_size=160, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    return transformers.Qwen3ForCausalLM(cfg)


BUILDERS = {
    "qwen3_next": _qwen3_next,
    "qwen3_5_moe": _qwen3_5_moe_vl,
    "qwen3_5_moe_text": _qwen3_5_moe_text,
    "llama": _llama,
    "qwen3": _qwen3,
}


def pack_experts(ckpt: Path) -> None:
    """Rewrite a per-expert checkpoint with packed ``experts.gate_up_proj`` / ``experts.down_proj``."""
    state = load_file(ckpt / "model.safetensors")
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(state):
        if ".experts." in name and name.endswith("_proj.weight"):
            base, e, kind, _ = name.rsplit(".", 3)
            groups.setdefault(base, {}).setdefault(int(e), {})[kind] = state.pop(name)
    for base, experts in groups.items():
        order = sorted(experts)
        state[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
        )
        state[f"{base}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """arch -> (transformers model, checkpoint dir), built once per module."""
    out = {}
    for arch, build in BUILDERS.items():
        torch.manual_seed(0)
        model = scramble_(build().eval(), seed=1)
        ckpt = tmp_path_factory.mktemp(arch)
        model.save_pretrained(ckpt)
        out[arch] = (model, ckpt)
    return out


def _sequences(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in SEQ_LENS]


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_logits_match_transformers(reference, arch, record_property):
    ref, ckpt = reference[arch]
    ours = wmtp.load_model(str(ckpt), dtype="float32")
    worst = 0.0
    for ids in _sequences(ours.config.vocab_size):
        expected = _reference_logits(ref, ids)
        assert expected.std() > 0.1, "reference logits are nearly constant: the test would be too weak"
        worst = max(worst, max_abs_diff(ours.score(ids), expected))
    record_property("max_abs_diff", worst)
    print(f"\n{arch}: max |Δlogits| = {worst:.3e}")
    assert worst <= TOL


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_packed_expert_layout_matches(reference, arch, tmp_path):
    ref, ckpt = reference[arch]
    packed = tmp_path / "packed"
    packed.mkdir()
    for f in ckpt.iterdir():
        (packed / f.name).write_bytes(f.read_bytes())
    pack_experts(packed)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(packed / "model.safetensors"))
    ours = wmtp.load_model(str(packed), dtype="float32")
    for ids in _sequences(ours.config.vocab_size):
        assert max_abs_diff(ours.score(ids), _reference_logits(ref, ids)) <= TOL


def test_nested_text_config_is_read(reference):
    _, ckpt = reference["qwen3_5_moe"]
    raw = json.loads((ckpt / "config.json").read_text())
    assert "text_config" in raw and raw["model_type"] == "qwen3_5_moe"
    cfg = wmtp.load_model(str(ckpt), dtype="float32").config
    assert cfg.hidden_size == raw["text_config"]["hidden_size"]
    assert cfg.layer_types == raw["text_config"]["layer_types"]


# ---- incremental decoding ------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_incremental_decoding_matches_full(reference, arch):
    """Prefill N tokens (in two chunks), then one token at a time with KV + recurrent state carried."""
    _, ckpt = reference[arch]
    model = wmtp.load_model(str(ckpt), dtype="float32")
    ids = _sequences(model.config.vocab_size)[1]
    full = model.score(ids)
    n_prefill, first_chunk = 70, 33
    with torch.no_grad(), model.private_cache(1, len(ids)) as cache:
        parts = [
            model.compute_logits(model(ids[:first_chunk], cache.context([0], [first_chunk]))),
            model.compute_logits(
                model(ids[first_chunk:n_prefill], cache.context([first_chunk], [n_prefill - first_chunk]))
            ),
        ]
        for p in range(n_prefill, len(ids)):
            parts.append(model.compute_logits(model(ids[p : p + 1], cache.context([p], [1]))))
    assert max_abs_diff(torch.cat(parts), full) <= TOL


@pytest.mark.parametrize("arch", ["qwen3_next", "llama"])
def test_batched_varlen_forward_matches_single(reference, arch):
    """Requests of different lengths in one flat forward (prefill of one + decode of another)."""
    _, ckpt = reference[arch]
    model = wmtp.load_model(str(ckpt), dtype="float32")
    a, b = _sequences(model.config.vocab_size)[:2]
    with torch.no_grad(), model.private_cache(2, 160) as cache:
        model(a[:50], cache.context([0], [50], requests=[0]))
        out = model.compute_logits(
            model(torch.cat([a[50:51], b[:90]]), cache.context([50, 0], [1, 90], requests=[0, 1]))
        )
    assert max_abs_diff(out[0], model.score(a[:51])[-1]) <= TOL
    assert max_abs_diff(out[1:], model.score(b[:90])) <= TOL
