"""Nemotron-H (DESIGN §10): a Mamba2 hybrid whose blocks each hold one mixer after a pre-norm,
``h = h + mixer(norm(h))``, the mixer one of

- ``mamba``: Mamba2 (``in_proj`` -> z | x B C | dt; depthwise causal conv + bias + SiLU over x B C;
  the SSD recurrence per head, ``torch_mamba2``; output norm of ``y * silu(z)`` per group; ``out_proj``);
- ``full_attention``: GQA attention without position encoding (NoPE) or q / k norms;
- ``mlp``: ``down(relu(up(x))^2)``;
- ``moe``: sigmoid routing (``torch_relu2_moe``) over routed ReLU² experts that run in a latent width
  (``fc1_latent_proj`` before, ``fc2_latent_proj`` after, when ``moe_latent_size`` is set), plus the
  shared ReLU² expert on the block input.

State-dict names are the checkpoints' (``backbone.embeddings``, ``backbone.layers.{i}.mixer.*``,
``backbone.norm_f``, ``lm_head``; experts per expert, ``mixer.experts.{e}.up_proj``), so loading is a
name lookup; the attention's q / k / v are packed as in ``layers.Attention``. The CPU reference path
(``backend="torch"``) so far: ``forward`` / ``score`` / ``mtp_forward`` over the model's own
contiguous caches (``bind_caches``); the engine's pools and the speculative verify come next.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from wmtp.config import ModelConfig
from wmtp.kernels.common import acc_dtype
from wmtp.kernels.torch_gdn import causal_conv1d
from wmtp.kernels.torch_mamba2 import gated_group_rms_norm, ssd_chunked, ssd_gates
from wmtp.kernels.torch_relu2_moe import relu2_experts, sigmoid_route
from wmtp.models.backend import Backend, get_backend
from wmtp.models.context import ForwardContext, PagedSlots
from wmtp.models.layers import Attention, Linear, embed_norm_cat, make_norm


def _vector(n: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(n))


class Mamba2Mixer(nn.Module):
    """One Mamba2 mixer; ``conv_state`` [slots, C, K-1] and ``ssm_state`` [slots, H, P, N] (fp32)
    are bound by the owner of the caches."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        m = self.shape = cfg.mamba
        self.in_proj = Linear(cfg.hidden_size, m.inner + m.conv_dim + m.heads, False, backend)
        self.conv1d = nn.Module()  # HF's Conv1d weight [C, 1, K] (and bias [C])
        self.conv1d.weight = nn.Parameter(torch.empty(m.conv_dim, 1, m.conv_kernel))
        self.conv1d.bias = _vector(m.conv_dim) if m.conv_bias else None
        self.dt_bias, self.A_log, self.D = _vector(m.heads), _vector(m.heads), _vector(m.heads)
        self.norm = nn.Module()
        self.norm.weight = _vector(m.inner)
        self.eps = cfg.rms_norm_eps
        self.out_proj = Linear(m.inner, cfg.hidden_size, False, backend)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.record_states:
            raise NotImplementedError("Mamba2Mixer: a speculative verify (record_states) is not supported yet")
        m = self.shape
        z, xbc, dt = self.in_proj(x).split([m.inner, m.conv_dim, m.heads], dim=-1)
        y = torch.empty(x.shape[0], m.inner, device=x.device, dtype=acc_dtype(x))
        weight = self.conv1d.weight.squeeze(1)
        for req, n in enumerate(ctx.q_lens):
            lo, slot = ctx.token_offsets[req], ctx.state_slots[req]
            conv, self.conv_state[slot] = causal_conv1d(xbc[lo:lo + n], weight, self.conv_state[slot], self.conv1d.bias)
            xs, B, C = conv.split([m.inner, m.groups * m.state, m.groups * m.state], dim=-1)
            dt_g, A = ssd_gates(dt[lo:lo + n], self.dt_bias, self.A_log, m.dt_limit)
            out, self.ssm_state[slot] = ssd_chunked(xs.reshape(n, m.heads, m.head_dim), dt_g, A,
                                                    B.reshape(n, m.groups, m.state), C.reshape(n, m.groups, m.state),
                                                    self.D, m.chunk, self.ssm_state[slot])
            y[lo:lo + n] = out.reshape(n, m.inner)
        return self.out_proj(gated_group_rms_norm(y, z, self.norm.weight, m.inner // m.groups, self.eps).to(x.dtype))


class ReLU2MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, backend: Backend) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, inter, False, backend)
        self.down_proj = Linear(inter, hidden, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class LatentMoE(nn.Module):
    """Sigmoid-routed ReLU² experts in the latent width, plus the shared expert (module docstring)."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        h, width = cfg.hidden_size, cfg.moe_latent_size or cfg.hidden_size
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(cfg.num_experts, h))
        self.gate.e_score_correction_bias = _vector(cfg.num_experts)
        self.experts = nn.ModuleList(ReLU2MLP(width, cfg.moe_intermediate_size, backend) for _ in range(cfg.num_experts))
        self.shared_experts = ReLU2MLP(h, cfg.shared_expert_intermediate_size, backend)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = Linear(h, width, False, backend)
            self.fc2_latent_proj = Linear(width, h, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        w, idx = sigmoid_route(x, self.gate.weight, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                               c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        latent = self.fc1_latent_proj(x) if c.moe_latent_size else x
        routed = relu2_experts(latent, [(e.up_proj.weight, e.down_proj.weight) for e in self.experts], w, idx)
        if c.moe_latent_size:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, block: str, backend: Backend) -> None:
        super().__init__()
        self.block = block
        self.norm = make_norm(cfg, cfg.hidden_size, backend)
        self.mixer = {"mamba": lambda: Mamba2Mixer(cfg, backend), "full_attention": lambda: Attention(cfg, backend),
                      "mlp": lambda: ReLU2MLP(cfg.hidden_size, cfg.intermediate_size, backend),
                      "moe": lambda: LatentMoE(cfg, backend)}[block]()

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.norm(h)
        if self.block == "full_attention":
            none = x.new_empty(x.shape[0], 0)  # NoPE: RoPE over zero channels
            return h + self.mixer(x, (none, none), ctx)
        return h + (self.mixer(x, ctx) if self.block == "mamba" else self.mixer(x))


class NemotronHMTPBlock(NemotronHBlock):
    """A block of an MTP step (``mtp_layer_types``, e.g. attention then MoE): the step's first block
    also holds the fusion (``enorm``, ``hnorm``, ``eh_proj``), its last the ``final_layernorm``."""

    def __init__(self, cfg: ModelConfig, block: str, backend: Backend, first: bool, last: bool) -> None:
        super().__init__(cfg, block, backend)
        h = cfg.hidden_size
        if first:
            self.enorm, self.hnorm = make_norm(cfg, h, backend), make_norm(cfg, h, backend)
            self.eh_proj = Linear(2 * h, h, False, backend)
        if last:
            self.final_layernorm = make_norm(cfg, h, backend)


class NemotronHMTPHead(nn.Module):
    """Nemotron-H's MTP (as the public serving code and checkpoints hold it, ``mtp.layers.{i}``):
    step j runs blocks ``j*L .. j*L + L-1`` of the L-block pattern on
    ``eh_proj(cat(enorm(embed[x_{p+1}]), hnorm(h_p)))`` at slot p (DESIGN §2), each block
    ``h + mixer(norm(h))``, and returns ``final_layernorm`` of the last block's output. Its attention
    has no position encoding, like the target's; embeddings and lm_head are the target's."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        pattern = cfg.mtp_layer_types
        self.span = len(pattern)
        self.layers = nn.ModuleList(
            NemotronHMTPBlock(cfg, pattern[i % self.span], backend, i % self.span == 0, i % self.span == self.span - 1)
            for i in range(cfg.num_nextn_predict_layers * self.span))

    def fuse(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, idx: int) -> torch.Tensor:
        first = self.layers[idx * self.span]
        return first.eh_proj(embed_norm_cat(ids, embed, hidden, first.enorm, first.hnorm))

    def step(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
             idx: int) -> torch.Tensor:
        h = self.fuse(ids, embed, hidden, idx)
        blocks = self.layers[idx * self.span:(idx + 1) * self.span]
        for block in blocks:
            h = block(h, ctx)
        return blocks[-1].final_layernorm(h)


class NemotronHCausalLM(nn.Module):
    """The Nemotron-H target: ``forward`` returns the final-norm hidden states, ``compute_logits``
    the lm_head's logits."""

    quant = None  # no quantized Nemotron-H checkpoints yet

    def __init__(self, cfg: ModelConfig, backend: Backend | str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.backbone.layers = nn.ModuleList(NemotronHBlock(cfg, b, self.backend) for b in cfg.layer_types)
        self.backbone.norm_f = make_norm(cfg, cfg.hidden_size, self.backend)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = NemotronHMTPHead(cfg, self.backend) if cfg.num_nextn_predict_layers else None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.backbone.embeddings(input_ids)
        for block in self.backbone.layers:
            h = block(h, ctx)
        return self.backbone.norm_f(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.backbone.embeddings.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w)

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                    layer_idx: int = 0) -> torch.Tensor:
        """One MTP step at draft slots ``ctx.positions`` (``NemotronHMTPHead``); feed the result to
        ``compute_logits``, or back in as ``hidden``."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (num_nextn_predict_layers = 0)")
        return self.mtp.step(input_ids, self.backbone.embeddings.weight, hidden, ctx, layer_idx)

    def attention_layers(self) -> list[nn.Module]:
        return [b.mixer for b in self.backbone.layers if b.block == "full_attention"]

    def mtp_attention_layers(self) -> list[nn.Module]:
        return [] if self.mtp is None else [b.mixer for b in self.mtp.layers if b.block == "full_attention"]

    def mamba_layers(self) -> list[Mamba2Mixer]:
        return [b.mixer for b in self.backbone.layers if b.block == "mamba"]

    def bind_caches(self, batch: int, max_len: int) -> ForwardContext:
        """Fresh contiguous caches for ``batch`` requests of up to ``max_len`` tokens (request b
        owns KV slots ``b * max_len ..`` and state slot b); returns a context template's slots."""
        p = self.backbone.embeddings.weight
        for attn in self.attention_layers() + self.mtp_attention_layers():
            shape = (batch * max_len, attn.num_kv_heads, attn.head_dim)
            attn.k_cache, attn.v_cache = (torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(2))
        for mix in self.mamba_layers():
            m = mix.shape
            mix.conv_state = torch.zeros(batch, m.conv_dim, m.conv_kernel - 1, device=p.device, dtype=p.dtype)
            mix.ssm_state = torch.zeros(batch, m.heads, m.head_dim, m.state, device=p.device, dtype=acc_dtype(p))
        return PagedSlots(torch.arange(batch, device=p.device)[:, None], max_len)

    @torch.no_grad()
    def score(self, token_ids: Sequence[int] | torch.Tensor, pieces: Sequence[int] | None = None) -> torch.Tensor:
        """Target logits [T, vocab] (fp32) of one sequence, fed as one forward or as the successive
        ``pieces`` (lengths summing to T: chunked prefill, then decode steps) over fresh caches."""
        p = self.backbone.embeddings.weight
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=p.device).reshape(-1)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"score: token ids must be a non-empty sequence in [0, vocab_size={self.config.vocab_size})")
        pieces = list(pieces) if pieces is not None else [ids.numel()]
        if sum(pieces) != ids.numel() or min(pieces) < 1:
            raise ValueError(f"score: pieces {pieces} must be positive and sum to the {ids.numel()} tokens")
        slots, out, start = self.bind_caches(1, ids.numel()), [], 0
        for n in pieces:
            ctx = ForwardContext(q_starts=[start], q_lens=[n], kv_slots=slots,
                                 state_slots=torch.zeros(1, dtype=torch.long, device=p.device), device=p.device)
            out.append(self.compute_logits(self(ids[start:start + n], ctx)).to(acc_dtype(p)))
            start += n
        return torch.cat(out)
