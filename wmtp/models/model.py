"""Target model (hybrid GDN-MoE or Llama-family dense) and its MTP draft heads.

State-dict names equal the HF checkpoint names (``model.*``, ``lm_head.*``, ``mtp.*``), except that
routed experts are always held packed; ``wmtp.models.loader`` maps the other spellings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from wmtp.config import ModelConfig
from wmtp.kernels.common import acc_dtype
from wmtp.models.backend import Backend, get_backend
from wmtp.models.context import ForwardContext, PagedSlots
from wmtp.models.layers import DecoderLayer, Linear, embed_norm_cat, finish, make_norm
from wmtp.models.rope import RotaryEmbedding
from wmtp.quant import QuantConfig


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

    def fuse(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, idx: int) -> torch.Tensor:
        """The decoder layer's input at each slot: fc(cat(norm(embed[ids]), norm(hidden)))."""
        return self.fc(embed_norm_cat(ids, embed, hidden, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden))

    def step(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, cos_sin, ctx: ForwardContext,
             idx: int) -> torch.Tensor:
        return finish(self.norm, self.layers[idx](self.fuse(ids, embed, hidden, idx), cos_sin, ctx))


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

    def fuse(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, idx: int) -> torch.Tensor:
        layer = self.layers[idx]
        return layer.eh_proj(embed_norm_cat(ids, embed, hidden, layer.enorm, layer.hnorm))

    def step(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, cos_sin, ctx: ForwardContext,
             idx: int) -> torch.Tensor:
        layer = self.layers[idx]
        return finish(layer.shared_head.norm,
                      DecoderLayer.forward(layer, self.fuse(ids, embed, hidden, idx), cos_sin, ctx))


def mtp_style(cfg: ModelConfig) -> str:
    """Hybrid Qwen models ship the Qwen MTP form; dense Llama-family targets take DeepSeek-style heads."""
    return "qwen" if cfg.is_hybrid else "deepseek"


class CausalLM(nn.Module):
    """A target with an optional MTP head. ``forward`` returns final-norm hidden states (what the MTP
    head consumes, as vLLM/SGLang feed it); ``compute_logits`` applies the shared lm_head."""

    # the checkpoint's weight format (DESIGN §9) when its linears and experts are quantized
    quant: QuantConfig | None = None

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

    def rope(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the context's positions: the precomputed ``ctx.rope`` if set."""
        return ctx.rope if ctx.rope is not None else self.rotary(ctx.positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self._lm_head_weight())

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` of MTP outputs, through the backend's linear (a 1-row draft step's
        lm_head may take a decode kernel instead of cuBLAS). Only drafts come from these logits and
        the target verifies each, so their summation order can never change the output."""
        return self.backend.linear(hidden, self._lm_head_weight())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ---- draft ----------------------------------------------------------------------------
    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, layer_idx: int = 0
    ) -> torch.Tensor:
        """One MTP forward at draft slots ``ctx.positions`` (DESIGN §2): slot p takes
        (embed(x_{p+1}) = ``input_ids``, h_p = ``hidden``) at RoPE position p; returns the head's
        normed output (feed it to ``compute_logits``, or back in as ``hidden`` for the next step)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (num_nextn_predict_layers = 0)")
        return self.mtp.step(input_ids, self.model.embed_tokens.weight, hidden, self.rope(ctx), ctx, layer_idx)

    @torch.no_grad()
    def mtp_write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, layer_idx: int = 0) -> None:
        """Write the MTP layer's K/V at draft slots ``ctx.positions`` without running attention or
        the FFN: a slot's K/V depend only on its own (embedding, hidden) pair (DESIGN §4)."""
        assert self.mtp is not None
        layer = self.mtp.layers[layer_idx]
        x = self.mtp.fuse(input_ids, self.model.embed_tokens.weight, hidden, layer_idx)
        layer.self_attn.write_kv(layer.input_layernorm(x), self.rope(ctx), ctx)

    def rollback_states(self, slots: torch.Tensor, accepted: torch.Tensor, recorded: dict) -> None:
        """After a verify with ``record_states`` (which left the states as they were): set each GDN
        layer's states in ``slots`` [B] to those after verify token ``accepted[b]`` (device tensors,
        no host sync: graph-capturable). The verify recorded into the engine's stacked record
        (``MemoryManager.bind``), so every layer moves in one backend op."""
        layers = self.gdn_layers()
        pools = getattr(self, "gdn_pools", None)
        if pools is None or pools.verify_tokens is None or any(
                recorded[l.layer_idx][1].data_ptr() != pools.verify_tokens[i].data_ptr() for i, l in enumerate(layers)):
            raise RuntimeError("rollback_states: the verify did not record into the engine's stacked verify record "
                               "(GatedDeltaNet.verify_record, bound by MemoryManager.bind)")
        n = recorded[layers[0].layer_idx][0].shape[1] - pools.conv.shape[-1]  # window rows: K-1 old, n inputs
        self.backend.gdn_rollback(pools.conv, pools.ssm, pools.verify_tokens, pools.verify_windows, slots, accepted, n)

    # ---- cache views ----------------------------------------------------------------------
    def attention_layers(self) -> list[nn.Module]:
        return [l.self_attn for l in self.model.layers if l.layer_type == "full_attention"]

    def gdn_layers(self) -> list[nn.Module]:
        return [l.linear_attn for l in self.model.layers if l.layer_type == "linear_attention"]

    def mtp_attention_layers(self) -> list[nn.Module]:
        return [] if self.mtp is None else [l.self_attn for l in self.mtp.layers]

    # ---- private contiguous caches (score, tests, simple decoding; the engine binds paged pools) --
    @contextlib.contextmanager
    def private_cache(self, batch: int, max_len: int) -> Iterator["PrivateCache"]:
        """Bind ``batch`` x ``max_len`` fresh caches to every layer; restore the old ones on exit."""
        layers = self.attention_layers() + self.mtp_attention_layers() + self.gdn_layers()
        names = ("k_cache", "v_cache", "conv_state", "ssm_state")
        saved = [{n: getattr(m, n) for n in names if hasattr(m, n)} for m in layers]
        try:
            yield PrivateCache(self, batch, max_len)
        finally:
            for m, old in zip(layers, saved):
                for n in names:
                    if hasattr(m, n):
                        delattr(m, n)
                for n, t in old.items():
                    setattr(m, n, t)

    @torch.no_grad()
    def score(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Full-sequence target logits [T, vocab] (fp32) for one sequence, no cache kept."""
        p = self.model.embed_tokens.weight
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=p.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("score: token_ids is empty")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"score: token ids must be in [0, vocab_size={self.config.vocab_size})")
        with self.private_cache(1, ids.numel()) as cache:
            return self.compute_logits(self(ids, cache.context([0], [ids.numel()]))).to(acc_dtype(p))


class PrivateCache:
    """Contiguous caches for ``batch`` requests of up to ``max_len`` tokens (request b owns slots
    ``b*max_len ..``), bound to the model's layers. Also holds a same-sized MTP draft cache."""

    def __init__(self, model: CausalLM, batch: int, max_len: int) -> None:
        p = model.model.embed_tokens.weight
        self.batch, self.max_len, self.device = batch, max_len, p.device
        for attn in model.attention_layers() + model.mtp_attention_layers():
            shape = (batch * max_len, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
            attn.v_cache = torch.zeros(shape, device=p.device, dtype=p.dtype)
        for gdn in model.gdn_layers():
            conv_dim = gdn.conv1d.weight.shape[0]
            gdn.conv_state = torch.zeros(batch, conv_dim, gdn.kernel - 1, device=p.device, dtype=p.dtype)
            gdn.ssm_state = torch.zeros(batch, gdn.hv, gdn.dk, gdn.dv, device=p.device, dtype=acc_dtype(p))
        table = torch.arange(batch, device=p.device)[:, None]
        self.kv_slots = PagedSlots(table, max_len)
        self.state_slots = torch.arange(batch, device=p.device)

    def context(self, q_starts: list[int], q_lens: list[int], windows=None, requests: list[int] | None = None) -> ForwardContext:
        """Context for a forward over ``requests`` (default: the first len(q_lens) of them)."""
        reqs = list(range(len(q_lens))) if requests is None else requests
        for s, n in zip(q_starts, q_lens):
            if s + n > self.max_len:
                raise ValueError(f"position {s + n - 1} exceeds the private cache length {self.max_len}")
        table = self.kv_slots.block_table[reqs]
        return ForwardContext(
            q_starts=list(q_starts), q_lens=list(q_lens), kv_slots=PagedSlots(table, self.max_len),
            state_slots=self.state_slots[reqs], windows=windows, device=self.device,
        )
