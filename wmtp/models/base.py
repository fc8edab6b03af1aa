"""What the engine needs of a target model, whatever its family (DESIGN §2, §4, §10).

``TargetLM`` is the contract: ``forward`` (final-norm hidden states), ``compute_logits`` /
``draft_logits``, the MTP head's ``mtp_forward`` / ``mtp_write_kv``, and the layers whose caches the
engine binds: full-attention layers (``k_cache`` / ``v_cache``), the MTP head's, and the recurrent
layers (GDN or Mamba2: ``conv_state``, ``ssm_state``, ``verify_record``) whose per-request state
``recurrent_state`` describes. A family is a subclass; the engine never looks inside one.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from wmtp.config import ModelConfig
from wmtp.kernels.common import acc_dtype
from wmtp.models.backend import Backend
from wmtp.models.context import ForwardContext, PagedSlots, packed_windows
from wmtp.models.parallel import TPGroup, vocab_lookup
from wmtp.quant import QuantConfig


@dataclass(frozen=True)
class RecurrentState:
    """One request's state in each of ``layers`` recurrent layers of ``kind`` ("gdn" | "mamba2"):
    a conv window [conv_dim, conv_kernel - 1] in the model dtype and an fp32 SSM state of
    ``ssm_shape``; a verify records ``record_width`` fp32 values per token and layer, from which
    the backend's ``<kind>_rollback`` rebuilds the state after the accepted token."""

    kind: str
    layers: int
    conv_dim: int
    conv_kernel: int
    ssm_shape: tuple[int, ...]
    record_width: int

    def conv_bytes(self, elt: int) -> int:
        return self.conv_dim * (self.conv_kernel - 1) * elt

    @property
    def ssm_bytes(self) -> int:
        return 4 * math.prod(self.ssm_shape)


def recurrent_state(cfg: ModelConfig) -> RecurrentState | None:
    """The recurrent state of ``cfg``'s family (None: attention only)."""
    if cfg.is_hybrid:
        from wmtp.kernels.torch_gdn import record_width

        return RecurrentState("gdn", len(cfg.linear_attention_layers), cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim,
                              (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                              record_width(cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                                           cfg.linear_num_value_heads, cfg.linear_value_head_dim))
    if cfg.mamba is not None:
        from wmtp.kernels.torch_mamba2 import record_width

        m = cfg.mamba
        return RecurrentState("mamba2", cfg.layer_types.count("mamba"), m.conv_dim, m.conv_kernel,
                              (m.heads, m.head_dim, m.state), record_width(m.heads, m.head_dim, m.groups, m.state))
    return None


class DraftHead(NamedTuple):
    """A pruned draft lm_head (``TargetLM.draft_head``): token ids [K] and their rows [K, H]."""

    ids: torch.Tensor
    weight: torch.Tensor


class TargetLM(nn.Module, ABC):
    """A target with an optional MTP head (module docstring). ``forward`` returns final-norm hidden
    states (what the MTP head consumes, as vLLM / SGLang feed it)."""

    config: ModelConfig
    backend: Backend
    mtp: nn.Module | None
    lm_head: nn.Linear | None
    # the checkpoint's weight format (DESIGN §9) when its linears and experts are quantized
    quant: QuantConfig | None = None
    # RoPE over positions (``rope.RotaryEmbedding``), None without position encoding (NoPE); set by
    # the subclass (an annotation only: a class value would shadow the registered submodule)
    rotary: nn.Module | None
    # whether the engine may run this family's decode from static buffers (CUDA graphs): it needs
    # every op of an iteration on the device (``wmtp.engine.graphs``)
    static_decode: bool = False
    # this rank's group when the model is one shard of a tensor-parallel model (``parallel.shard_``):
    # ``config`` is then the shard's (head counts and intermediate widths divided; the vocabulary
    # whole) and ``whole_config`` the model's (an annotation only: set by ``shard_``)
    tp: TPGroup | None = None
    whole_config: ModelConfig

    @property
    @abstractmethod
    def embedding(self) -> nn.Embedding:
        """The input embedding module (under tensor parallelism: its vocabulary rows)."""

    @property
    def embed_weight(self) -> torch.Tensor:
        """The input embedding [vocab, hidden] (tied lm_heads share it)."""
        return self.embedding.weight

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    @abstractmethod
    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                    layer_idx: int = 0) -> torch.Tensor:
        """One MTP forward at draft slots ``ctx.positions`` (DESIGN §2): slot p takes
        (embed(x_{p+1}) = ``input_ids``, h_p = ``hidden``); returns the head's normed output (feed it
        to ``draft_logits``, or back in as ``hidden`` for the next step)."""

    @abstractmethod
    def mtp_write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                     layer_idx: int = 0) -> None:
        """Write the MTP head's K/V at draft slots ``ctx.positions`` without running its attention:
        a slot's K/V depend only on its own (embedding, hidden) pair (DESIGN §4)."""

    @abstractmethod
    def attention_layers(self) -> list[nn.Module]: ...

    @abstractmethod
    def mtp_attention_layers(self) -> list[nn.Module]: ...

    @abstractmethod
    def recurrent_layers(self) -> list[nn.Module]:
        """The layers ``recurrent_state(config)`` describes, in order."""

    # ---- logits ---------------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of the whole vocabulary (gathered over tensor-parallel ranks)."""
        logits = torch.nn.functional.linear(hidden, self._lm_head_weight())
        return logits if self.tp is None else self.tp.gather(logits)

    def draft_logits(self, hidden: torch.Tensor, head: DraftHead | None = None) -> torch.Tensor:
        """``compute_logits`` of MTP outputs, through the backend's linear (a 1-row draft step's
        lm_head may take a decode kernel instead of cuBLAS). Only drafts come from these logits and
        the target verifies each, so their summation order can never change the output. With a
        pruned ``head`` (``draft_head``) only its rows are read; the other tokens' logits are -inf
        (a greedy draft is the argmax over the sub-vocabulary, a sampled draft's q zero outside it)."""
        if head is None:
            logits = self.backend.linear(hidden, self._lm_head_weight())
            return logits if self.tp is None else self.tp.gather(logits)
        small = self.backend.linear(hidden, head.weight)
        out = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(out.dim() - 1, head.ids, small)

    def draft_head(self, ids: list[int]) -> DraftHead:
        """The lm_head rows of the token ``ids`` gathered into one contiguous weight (made once;
        whole on every tensor-parallel rank, so its logits need no gather)."""
        w = self._lm_head_weight()
        idx = torch.tensor(ids, dtype=torch.long, device=w.device)
        if self.tp is not None:
            return DraftHead(idx, vocab_lookup(self.tp, w, idx))
        return DraftHead(idx, w.index_select(0, idx).contiguous())

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.lm_head is None else self.lm_head.weight

    # ---- speculative verify ---------------------------------------------------------------
    def rollback_states(self, slots: torch.Tensor, accepted: torch.Tensor, recorded: dict) -> None:
        """After a verify with ``record_states`` (which left the states as they were): set each
        recurrent layer's states in ``slots`` [B] to those after verify token ``accepted[b]`` (device
        tensors, no host sync: graph-capturable). The verify recorded into the engine's stacked
        record (``MemoryManager.bind``), so every layer moves in one backend op."""
        layers = self.recurrent_layers()
        pools = getattr(self, "state_pools", None)
        if pools is None or pools.verify_tokens is None or any(
                recorded[l.layer_idx][1].data_ptr() != pools.verify_tokens[i].data_ptr() for i, l in enumerate(layers)):
            raise RuntimeError("rollback_states: the verify did not record into the engine's stacked verify record "
                               "(the recurrent layers' verify_record, bound by MemoryManager.bind)")
        n = recorded[layers[0].layer_idx][0].shape[1] - pools.conv.shape[-1]  # window rows: K-1 old, n inputs
        rollback = getattr(self.backend, f"{recurrent_state(self.config).kind}_rollback")
        windows = packed_windows(pools.verify_windows, pools.conv.shape[-1] + n)  # as the verify recorded them
        rollback(pools.conv, pools.ssm, pools.verify_tokens, windows, slots, accepted, n)

    # ---- private contiguous caches (score, tests, simple decoding; the engine binds paged pools) --
    @contextlib.contextmanager
    def private_cache(self, batch: int, max_len: int, kv_dtype: torch.dtype | None = None) -> Iterator["PrivateCache"]:
        """Bind ``batch`` x ``max_len`` fresh caches (K / V in ``kv_dtype``, default the model's) to
        every layer; restore the old ones on exit."""
        layers = self.attention_layers() + self.mtp_attention_layers() + self.recurrent_layers()
        names = ("k_cache", "v_cache", "conv_state", "ssm_state")
        saved = [{n: getattr(m, n) for n in names if hasattr(m, n)} for m in layers]
        try:
            yield PrivateCache(self, batch, max_len, kv_dtype)
        finally:
            for m, old in zip(layers, saved):
                for n in names:
                    if hasattr(m, n):
                        delattr(m, n)
                for n, t in old.items():
                    setattr(m, n, t)

    @torch.no_grad()
    def score(self, token_ids: Sequence[int] | torch.Tensor, pieces: Sequence[int] | None = None,
              kv_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Target logits [T, vocab] (fp32) of one sequence over fresh caches (K / V in ``kv_dtype``),
        fed as one forward or as the successive ``pieces`` (lengths summing to T: chunked prefill,
        then decode steps)."""
        p = self.embed_weight
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=p.device).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("score: token_ids is empty")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"score: token ids must be in [0, vocab_size={self.config.vocab_size})")
        pieces = [ids.numel()] if pieces is None else list(pieces)
        if sum(pieces) != ids.numel() or min(pieces) < 1:
            raise ValueError(f"score: pieces {pieces} must be positive and sum to the {ids.numel()} tokens")
        out, start = [], 0
        with self.private_cache(1, ids.numel(), kv_dtype) as cache:
            for n in pieces:
                hidden = self(ids[start:start + n], cache.context([start], [n]))
                out.append(self.compute_logits(hidden).to(acc_dtype(p)))
                start += n
        return torch.cat(out)


class PrivateCache:
    """Contiguous caches for ``batch`` requests of up to ``max_len`` tokens (request b owns slots
    ``b*max_len ..`` and state slot b), bound to the model's layers. Also holds a same-sized MTP
    draft cache."""

    def __init__(self, model: TargetLM, batch: int, max_len: int, kv_dtype: torch.dtype | None = None) -> None:
        p = model.embed_weight
        self.batch, self.max_len, self.device = batch, max_len, p.device
        for attn in model.attention_layers() + model.mtp_attention_layers():
            shape = (batch * max_len, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.zeros(shape, device=p.device, dtype=kv_dtype or p.dtype)
            attn.v_cache = torch.zeros(shape, device=p.device, dtype=kv_dtype or p.dtype)
        state = recurrent_state(model.config)
        for layer in model.recurrent_layers():
            layer.conv_state = torch.zeros(batch, state.conv_dim, state.conv_kernel - 1, device=p.device, dtype=p.dtype)
            layer.ssm_state = torch.zeros(batch, *state.ssm_shape, device=p.device, dtype=acc_dtype(p))
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
