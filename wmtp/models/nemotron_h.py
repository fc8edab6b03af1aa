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
``backbone.norm_f``, ``lm_head``), so loading is a name lookup, but that the routed experts
(``mixer.experts.{e}.up_proj`` / ``down_proj`` in a checkpoint) are packed (``layers.Experts``)
and the attention's q / k / v as in ``layers.Attention``. The Mamba2 mixers run through the
backend's ``mamba2`` op, the routed experts through its ``relu2_moe``.
"""

from __future__ import annotations

import torch
from torch import nn

from wmtp.config import ModelConfig
from wmtp.kernels.common import SigmoidRouting
from wmtp.models.backend import Backend, get_backend
from wmtp.models.base import TargetLM
from wmtp.models.context import ForwardContext
from wmtp.models.layers import Attention, Experts, Linear, embed_norm_cat, finish, make_norm


def _vector(n: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(n))


class Mamba2Mixer(nn.Module):
    """One Mamba2 mixer; ``conv_state`` [slots, C, K-1], ``ssm_state`` [slots, H, P, N] (fp32) and
    the verify record are bound by the owner of the caches."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    # (tokens [rows, torch_mamba2.record_width] fp32, windows [seqs, K-1+d, C]) a verify records into
    verify_record: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        m = self.shape = cfg.mamba
        self.layer_idx, self.backend = layer_idx, backend
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
        m = self.shape
        z, xbc, dt = self.in_proj(x).split([m.inner, m.conv_dim, m.heads], dim=-1)
        y = self.backend.mamba2(xbc, dt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, self.A_log,
                                self.D, self.conv_state, self.ssm_state, ctx, self.layer_idx, m,
                                ctx.record_buffers(self.verify_record, m.conv_kernel))
        normed = self.backend.gated_group_rms_norm(y, z, self.norm.weight, m.inner // m.groups, self.eps)
        return self.out_proj(normed.to(x.dtype))


class ReLU2MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, backend: Backend) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, inter, False, backend)
        self.down_proj = Linear(inter, hidden, False, backend)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``down(relu(up x)^2)`` (+ ``add``), the ReLU² and the sum in the projections' epilogues."""
        return self.down_proj(self.up_proj(x, relu2=True), add=add)


class LatentMoE(nn.Module):
    """Sigmoid-routed ReLU² experts in the latent width, plus the shared expert (module docstring)."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        h, width = cfg.hidden_size, cfg.moe_latent_size or cfg.hidden_size
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(cfg.num_experts, h))
        self.gate.e_score_correction_bias = _vector(cfg.num_experts)
        self.experts = Experts(cfg.num_experts, width, cfg.moe_intermediate_size, gated=False)
        self.backend = backend
        self.shared_experts = ReLU2MLP(h, cfg.shared_expert_intermediate_size, backend)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = Linear(h, width, False, backend)
            self.fc2_latent_proj = Linear(width, h, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        routing = SigmoidRouting(self.gate.weight, self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                                 c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        routed = self.backend.relu2_moe(x, routing, *self.experts.weights(),
                                        self.fc1_latent_proj if c.moe_latent_size else None)
        if c.moe_latent_size:
            routed = self.fc2_latent_proj(routed)
        return self.shared_experts(x, add=routed)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, block: str, backend: Backend, layer_idx: int = -1) -> None:
        super().__init__()
        self.block = block
        self.norm = make_norm(cfg, cfg.hidden_size, backend)
        self.mixer = {"mamba": lambda: Mamba2Mixer(cfg, layer_idx, backend), "full_attention": lambda: Attention(cfg, backend),
                      "mlp": lambda: ReLU2MLP(cfg.hidden_size, cfg.intermediate_size, backend),
                      "moe": lambda: LatentMoE(cfg, backend)}[block]()

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixer output, residual): the block's output is their sum, the add left to the next norm
        (``add_forward``, one launch with it), as is the input's when ``residual`` is given (the
        block's input is then ``x + residual``); ``layers.finish`` sums and norms the last."""
        x, residual = (self.norm(x), x) if residual is None else self.norm.add_forward(x, residual)
        if self.block == "full_attention":
            return self.mixer(x, None, ctx), residual  # NoPE
        return (self.mixer(x, ctx) if self.block == "mamba" else self.mixer(x)), residual


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

    def fuse(self, ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, idx: int) -> torch.Tensor:
        first = self.layers[idx * self.span]
        return first.eh_proj(embed_norm_cat(ids, embedding, hidden, first.enorm, first.hnorm))

    def step(self, ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, ctx: ForwardContext,
             idx: int) -> torch.Tensor:
        out = self.fuse(ids, embedding, hidden, idx), None
        blocks = self.layers[idx * self.span:(idx + 1) * self.span]
        for block in blocks:
            out = block(out[0], ctx, out[1])
        return finish(blocks[-1].final_layernorm, out)


class NemotronHCausalLM(TargetLM):
    """The Nemotron-H target (``TargetLM``); its recurrent layers are the Mamba2 mixers."""

    static_decode = True

    def __init__(self, cfg: ModelConfig, backend: Backend | str = "torch") -> None:
        super().__init__()
        self.config = cfg
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.rotary = None  # NoPE
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.backbone.layers = nn.ModuleList(NemotronHBlock(cfg, b, self.backend, i) for i, b in enumerate(cfg.layer_types))
        self.backbone.norm_f = make_norm(cfg, cfg.hidden_size, self.backend)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = NemotronHMTPHead(cfg, self.backend) if cfg.num_nextn_predict_layers else None

    @property
    def embedding(self) -> nn.Embedding:
        return self.backbone.embeddings

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = self.backbone.embeddings(input_ids), None
        for block in self.backbone.layers:
            out = block(out[0], ctx, out[1])
        return finish(self.backbone.norm_f, out)

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                    layer_idx: int = 0) -> torch.Tensor:
        """``TargetLM.mtp_forward`` through ``NemotronHMTPHead``."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (num_nextn_predict_layers = 0)")
        return self.mtp.step(input_ids, self.embedding, hidden, ctx, layer_idx)

    @torch.no_grad()
    def mtp_write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                     layer_idx: int = 0) -> None:
        """``TargetLM.mtp_write_kv``: the step's blocks before its attention block are position-local
        (MLP / MoE; the config admits one attention block per step and no Mamba2), so they run on
        the slot's own input, then the attention block writes its K/V."""
        assert self.mtp is not None
        out = self.mtp.fuse(input_ids, self.embedding, hidden, layer_idx), None
        for block in self.mtp.layers[layer_idx * self.mtp.span:(layer_idx + 1) * self.mtp.span]:
            if block.block == "full_attention":
                x = block.norm(out[0]) if out[1] is None else block.norm.add_forward(*out)[0]
                return block.mixer.write_kv(x, None, ctx)
            out = block(out[0], ctx, out[1])

    def attention_layers(self) -> list[nn.Module]:
        return [b.mixer for b in self.backbone.layers if b.block == "full_attention"]

    def mtp_attention_layers(self) -> list[nn.Module]:
        return [] if self.mtp is None else [b.mixer for b in self.mtp.layers if b.block == "full_attention"]

    def recurrent_layers(self) -> list[Mamba2Mixer]:
        return [b.mixer for b in self.backbone.layers if b.block == "mamba"]
