"""MTP head parity: wmtp's MTP forward vs an independent composition built from transformers' own
layer classes (its decoder layer forced to full attention, its RMSNorm, its rotary embedding), fed
the same token embeddings and target hidden states (DESIGN §2: slot p = (embed(x_{p+1}), h_p))."""

from __future__ import annotations

import pytest
import torch

import wmtp
from tests.helpers import max_abs_diff, scramble_
from wmtp.models.loader import unpacked_state_dict

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _reference_parts(model):
    """(decoder layer class, norm class, rotary class, hf config) for the model's family."""
    cfg = dict(model.config.raw)
    mt = model.config.model_type
    if mt == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        conf = transformers.Qwen3NextConfig(**{**cfg, "layer_types": ["full_attention"], "num_hidden_layers": 1,
                                               "mlp_only_layers": []})
        return m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm, m.Qwen3NextRotaryEmbedding, conf
    if mt == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        conf = transformers.Qwen3_5MoeTextConfig(**{**cfg, "layer_types": ["full_attention"], "num_hidden_layers": 1})
        return m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, m.Qwen3_5MoeTextRotaryEmbedding, conf
    from transformers.models.llama import modeling_llama as m

    return m.LlamaDecoderLayer, m.LlamaRMSNorm, m.LlamaRotaryEmbedding, transformers.LlamaConfig(**cfg)


def _norm(norm_cls, weight: torch.Tensor, eps: float):
    n = norm_cls(weight.shape[0], eps=eps)
    n.weight.data.copy_(weight)
    return n


@torch.no_grad()
def _reference_mtp_logits(model, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    layer_cls, norm_cls, rope_cls, conf = _reference_parts(model)
    conf._attn_implementation = "eager"
    eps = model.config.rms_norm_eps
    layer = layer_cls(conf, 0).eval()
    head = model.mtp
    if model.config.is_hybrid:  # Qwen form: shared fc + norms around mtp.layers[0]
        ours_layer = head.layers[0]
        proj, e_norm, h_norm, out_norm = head.fc, head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm
    else:  # DeepSeek form: everything on mtp.layers[0]
        ours_layer = head.layers[0]
        proj, e_norm, h_norm, out_norm = ours_layer.eh_proj, ours_layer.enorm, ours_layer.hnorm, ours_layer.shared_head.norm
    block_state = {k: v for k, v in unpacked_state_dict(ours_layer).items()
                   if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head"))}
    missing, unexpected = layer.load_state_dict(block_state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    fc = torch.nn.Linear(proj.in_features, proj.out_features, bias=False)
    fc.weight.data.copy_(proj.weight)
    e_n, h_n, o_n = (_norm(norm_cls, n.weight, eps) for n in (e_norm, h_norm, out_norm))

    n = ids.numel() - 1
    emb = model.model.embed_tokens.weight[ids[1:]]
    x = fc(torch.cat([e_n(emb), h_n(hidden[:-1])], dim=-1))[None]
    pos = torch.arange(n)[None]
    rope_pos = pos.expand(3, 1, n) if model.config.model_type.startswith("qwen3_5") else pos
    cos_sin = rope_cls(conf)(x, rope_pos)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    return model.compute_logits(o_n(out[0]))


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-qwen3.5-moe", "tiny-llama"])
def test_mtp_head_matches_transformers_composition(preset):
    model = scramble_(wmtp.load_model(preset, dtype="float32"), seed=3)
    ids = torch.randint(0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), model.private_cache(1, ids.numel()) as cache:
        hidden = model(ids, cache.context([0], [ids.numel()]))
        n = ids.numel() - 1
        ours = model.compute_logits(model.mtp_forward(ids[1:], hidden[:-1], cache.context([0], [n])))
    expected = _reference_mtp_logits(model, ids, hidden)
    assert expected.std() > 0.1
    diff = max_abs_diff(ours, expected)
    print(f"\n{preset}: MTP head max |Δlogits| = {diff:.3e}")
    assert diff <= TOL
