"""Nemotron-H (DESIGN §10) on the CPU reference path: config parsing (current and legacy spellings,
errors naming the field), and parity with transformers 5.17's NemotronHForCausalLM on tiny random
checkpoints it writes (Mamba2 with one or two groups over several SSD chunks, NoPE attention,
ReLU² MLP, sigmoid-routed MoE with and without the latent projection, group-limited routing):
logits of 3 sequences within 1e-4, a chunked prefill followed by decode steps equal to one
forward, the MTP head against transformers' blocks, and the engine's greedy output in every mode
equal to transformers' greedy continuation."""

from __future__ import annotations

import json

import pytest
import torch

import wmtp
import wmtp.presets
from wmtp.config import ModelConfig
from wmtp.errors import ConfigError

hf = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, chunk_size=8,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            moe_shared_expert_intermediate_size=40)
CASES = {
    "latent-moe": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
                       n_groups=2, moe_latent_size=16),
    "grouped-routing": dict(layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "moe"],
                            n_groups=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False),
}


def _checkpoint(tmp_path, case: str):
    torch.manual_seed(0)
    ref = hf.NemotronHForCausalLM(hf.NemotronHConfig(**BASE, **CASES[case])).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers' init leaves biases at 0 and norms at 1: move every tensor
        for name, p in ref.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if name.endswith(("A_log", "dt_bias", "D")) else 0.05))
        for mod in ref.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(mod.e_score_correction_bias.shape, generator=g) * 0.1)
    ref.save_pretrained(tmp_path / case)
    return ref, tmp_path / case


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, path = _checkpoint(tmp_path, case)
    model = wmtp.load_model(str(path), dtype="float32")
    g = torch.Generator().manual_seed(2)
    for n in (40, 23, 9):  # several SSD chunks of 8, partial last ones
        ids = torch.randint(0, BASE["vocab_size"], (n,), generator=g)
        with torch.no_grad():
            want = ref(ids[None]).logits[0]
        assert (model.score(ids) - want).abs().max().item() <= 1e-4
    ids = torch.randint(0, BASE["vocab_size"], (30,), generator=g)
    whole = model.score(ids)
    assert (model.score(ids, [13, 8, 1, 1, 7]) - whole).abs().max().item() <= 1e-5  # prefill chunks, then decode


def test_config_spellings_and_errors(tmp_path):
    legacy = {**BASE, "model_type": "nemotron_h", "hybrid_override_pattern": "M-*E", "mamba_n_groups": 2,
              "mamba_d_conv": 3, "mamba_chunk_size": 16, "num_hidden_layers": 99}
    cfg = ModelConfig.from_dict(legacy)
    assert cfg.layer_types == ["mamba", "mlp", "full_attention", "moe"] and cfg.num_layers == 4
    assert (cfg.mamba.groups, cfg.mamba.conv_kernel, cfg.mamba.chunk) == (2, 3, 16)
    assert cfg.full_attention_layers == [2] and not cfg.qk_norm and not cfg.gated_attention
    with pytest.raises(ConfigError, match=r"'hybrid_override_pattern' has unsupported value\(s\) \['X'\]"):
        ModelConfig.from_dict({**legacy, "hybrid_override_pattern": "MX"})
    with pytest.raises(ConfigError, match="'mlp_hidden_act'='gelu' is not supported"):
        ModelConfig.from_dict({**legacy, "mlp_hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="mamba_num_heads=4 is not a multiple of n_groups=3"):
        ModelConfig.from_dict({**legacy, "mamba_n_groups": 3})
    with pytest.raises(ConfigError, match="'n_routed_experts' is required"):
        ModelConfig.from_dict({k: v for k, v in legacy.items() if k != "n_routed_experts"})
    super_ = wmtp.presets.preset_config("nemotron-3-super-120b-a12b")  # the public config, as shipped
    assert super_.layer_types.count("mamba") == super_.layer_types.count("moe") == 40
    assert super_.full_attention_layers == [7, 16, 25, 36, 47, 58, 69, 78] and super_.mtp_layer_types == ["full_attention", "moe"]
    with pytest.raises(ConfigError, match="more than one attention block"):
        ModelConfig.from_dict({**legacy, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "**E"})
    (tmp_path / "config.json").write_text(json.dumps({**legacy, "architectures": ["NemotronHForCausalLM"]}))
    assert ModelConfig.from_file(tmp_path / "config.json").model_type == "nemotron_h"


def test_engine_greedy_equals_transformers_in_every_mode(tmp_path):
    """The engine (Mamba2 state pools, chunked prefill, speculative verify + Mamba2 rollback, the
    windowed draft on a ring) emits transformers' own greedy continuation of the checkpoint."""
    ref, path, _ = _mtp_checkpoint(tmp_path)
    model = wmtp.load_model(str(path), dtype="float32")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (30, 7)]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(10):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(p):])
    for spec in (wmtp.SpecConfig(mode="dense"), wmtp.SpecConfig(mode="native", num_draft_tokens=3),
                 wmtp.SpecConfig(mode="windowed", num_draft_tokens=3, sink=2, window=6)):
        llm = wmtp.LLM(model, spec=spec, max_model_len=64, max_num_seqs=2, page_size=8, prefill_chunk=11)
        out = llm.generate(prompts, wmtp.SamplingParams(max_tokens=10, ignore_eos=True))
        assert [o.token_ids for o in out] == want, spec.mode
        assert all(v == 0 for v in llm.engine.memory.usage().values())


def _mtp_checkpoint(tmp_path):
    """The latent-moe checkpoint plus an MTP head (``mtp.layers.0`` attention with the fusion,
    ``mtp.layers.1`` MoE with the final norm) built from transformers' own NemotronH modules;
    returns (target, path, (blocks, enorm, hnorm, final, eh_proj))."""
    from safetensors.torch import save_file
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    ref, path = _checkpoint(tmp_path, "latent-moe")
    hcfg = hf.NemotronHConfig(**BASE, **{**CASES["latent-moe"], "layers_block_type": ["full_attention", "moe"]})
    hcfg._attn_implementation = "sdpa"
    torch.manual_seed(3)
    blocks = [m.NemotronHBlock(hcfg, 0).eval(), m.NemotronHBlock(hcfg, 1).eval()]
    h = BASE["hidden_size"]
    enorm, hnorm, final = (m.NemotronHRMSNorm(h, eps=1e-5) for _ in range(3))
    eh_proj = torch.nn.Linear(2 * h, h, bias=False)
    g = torch.Generator().manual_seed(4)
    tensors = {}
    with torch.no_grad():
        for prefix, mod in (("mtp.layers.0", blocks[0]), ("mtp.layers.1", blocks[1]), ("mtp.layers.0.enorm", enorm),
                            ("mtp.layers.0.hnorm", hnorm), ("mtp.layers.1.final_layernorm", final),
                            ("mtp.layers.0.eh_proj", eh_proj)):
            for name, p in list(mod.named_parameters()) + list(mod.named_buffers()):  # (built outside a model:
                base = 1.0 if name.endswith("norm.weight") or name == "weight" and p.dim() == 1 else 0.0  # uninitialised)
                p.copy_(base + torch.randn(p.shape, generator=g) * (0.05 if base else 0.2))
                key = f"{prefix}.{name}"
                tensors[key] = p.detach().clone() if ".experts." not in key else None
            if prefix == "mtp.layers.1":  # experts per expert, as checkpoints hold them
                del tensors["mtp.layers.1.mixer.experts.up_proj"], tensors["mtp.layers.1.mixer.experts.down_proj"]
                for e in range(BASE["n_routed_experts"]):
                    tensors[f"{prefix}.mixer.experts.{e}.up_proj.weight"] = mod.mixer.experts.up_proj[e].clone()
                    tensors[f"{prefix}.mixer.experts.{e}.down_proj.weight"] = mod.mixer.experts.down_proj[e].clone()
    save_file({k: v.contiguous() for k, v in tensors.items() if v is not None}, path / "mtp.safetensors")
    return ref, path, (blocks, enorm, hnorm, final, eh_proj)


def test_mtp_head_matches_transformers_blocks(tmp_path):
    """The MTP step against the same computation from transformers' own NemotronH modules."""
    ref, path, (blocks, enorm, hnorm, final, eh_proj) = _mtp_checkpoint(tmp_path)
    model = wmtp.load_model(str(path), dtype="float32")
    n, h = 21, BASE["hidden_size"]
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, BASE["vocab_size"], (n,), generator=g)
    hidden = torch.randn(n, h, generator=g)
    with torch.no_grad():
        x = eh_proj(torch.cat([enorm(ref.model.embeddings(ids)), hnorm(hidden)], -1))[None]
        want = final(blocks[1](blocks[0](x)))[0]
        with model.private_cache(1, n) as cache:
            got = model.mtp_forward(ids, hidden, cache.context([0], [n]))
    assert model.mtp is not None and model.config.num_nextn_predict_layers == 1
    assert (got - want).abs().max().item() <= 1e-5
