"""Target model (hybrid GDN-MoE or Llama-family dense) and its MTP draft heads.

State-dict names equal the HF checkpoint names (``model.*``, ``lm_head.*``, ``mtp.*``), except that
routed experts are always held packed; ``wmtp.models.loader`` maps the other spellings.
"""

from __future__ import annotations

import torch
from torch import nn

from wmtp.config import ModelConfig
from wmtp.models.backend import Backend, get_backend
from wmtp.models.base import TargetLM
from wmtp.models.context import ForwardContext
from wmtp.models.layers import DecoderLayer, Linear, embed_norm_cat, finish, make_norm
from wmtp.models.rope import RotaryEmbedding


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, t, cfg.layer_is_moe(i), backend) for i, t in enumerate(cfg.layer_types)
        )
        self.norm = make_norm(cfg, cfg.hidden_size, backend)


class QwenMTPHead(nn.Module):
    """Qwen3-Next / 3.5 MTP: shared fc and pre-fc norms, ``n`` full-attention layers, final norm."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, False, backend)
        self.pre_fc_norm_embedding = make_norm(cfg, h, backend)
        self.pre_fc_norm_hidden = make_norm(cfg, h, backend)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, -1, "full_attention", cfg.mtp_is_moe, backend)
            for _ in range(cfg.num_nextn_predict_layers)
        )
        self.norm = make_norm(cfg, h, backend)

    def fuse(self, ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, idx: int) -> torch.Tensor:
        """The decoder layer's input at each slot: fc(cat(norm(embedding(ids)), norm(hidden)))."""
        return self.fc(embed_norm_cat(ids, embedding, hidden, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden))

    def step(self, ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, cos_sin, ctx: ForwardContext,
             idx: int) -> torch.Tensor:
        return finish(self.norm, self.layers[idx](self.fuse(ids, embedding, hidden, idx), cos_sin, ctx))


class DeepSeekMTPLayer(DecoderLayer):
    """DeepSeek-style MTP module: enorm/hnorm and eh_proj in front of one decoder block (whose
    weights sit on the module itself, as in DeepSeek-V3), then shared_head.norm."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__(cfg, -1, "full_attention", cfg.mtp_is_moe, backend)
        h = cfg.hidden_size
        self.enorm = make_norm(cfg, h, backend)
        self.hnorm = make_norm(cfg, h, backend)
        self.eh_proj = Linear(2 * h, h, False, backend)
        self.shared_head = nn.Module()
        self.shared_head.norm = make_norm(cfg, h, backend)


class DeepSeekMTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DeepSeekMTPLayer(cfg, backend) for _ in range(cfg.num_nextn_predict_layers))

    def fuse(self, ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, idx: int) -> torch.Tensor:
        layer = self.layers[idx]
        return layer.eh_proj(embed_norm_cat(ids, embedding, hidden, layer.enorm, layer.hnorm))

    def step(self, ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, cos_sin, ctx: ForwardContext,
             idx: int) -> torch.Tensor:
        layer = self.layers[idx]
        return finish(layer.shared_head.norm,
                      DecoderLayer.forward(layer, self.fuse(ids, embedding, hidden, idx), cos_sin, ctx))


def mtp_style(cfg: ModelConfig) -> str:
    """Hybrid Qwen models ship the Qwen MTP form; dense Llama-family targets take DeepSeek-style heads."""
    return "qwen" if cfg.is_hybrid else "deepseek"


class CausalLM(TargetLM):
    """Qwen hybrid GDN (-MoE) and Llama-family dense targets with their MTP heads (``TargetLM``)."""

    static_decode = True

    def __init__(self, cfg: ModelConfig, backend: Backend | str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.model = Backbone(cfg, self.backend)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # computed, never loaded: keep it real even when built on meta
            self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.mtp: QwenMTPHead | DeepSeekMTPHead | None = None
        if cfg.num_nextn_predict_layers > 0:
            self.mtp = QwenMTPHead(cfg, self.backend) if mtp_style(cfg) == "qwen" else DeepSeekMTPHead(cfg, self.backend)

    # ---- target -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope(ctx)
        h, residual = x, None
        for layer in self.model.layers:
            h, residual = layer(h, cos_sin, ctx, residual)
        return finish(self.model.norm, (h, residual))

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def rope(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the context's positions: the precomputed ``ctx.rope`` if set."""
        return ctx.rope if ctx.rope is not None else self.rotary(ctx.positions)

    # ---- draft ----------------------------------------------------------------------------
    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, layer_idx: int = 0
    ) -> torch.Tensor:
        """``TargetLM.mtp_forward``, slot p at RoPE position p."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (num_nextn_predict_layers = 0)")
        return self.mtp.step(input_ids, self.embedding, hidden, self.rope(ctx), ctx, layer_idx)

    @torch.no_grad()
    def mtp_write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, layer_idx: int = 0) -> None:
        """``TargetLM.mtp_write_kv``: the MTP layer's attention input, then its K/V."""
        assert self.mtp is not None
        layer = self.mtp.layers[layer_idx]
        x = self.mtp.fuse(input_ids, self.embedding, hidden, layer_idx)
        layer.self_attn.write_kv(layer.input_layernorm(x), self.rope(ctx), ctx)

    # ---- cache views ----------------------------------------------------------------------
    def attention_layers(self) -> list[nn.Module]:
        return [l.self_attn for l in self.model.layers if l.layer_type == "full_attention"]

    def recurrent_layers(self) -> list[nn.Module]:
        return [l.linear_attn for l in self.model.layers if l.layer_type == "linear_attention"]

    def mtp_attention_layers(self) -> list[nn.Module]:
        return [] if self.mtp is None else [l.self_attn for l in self.mtp.layers]
