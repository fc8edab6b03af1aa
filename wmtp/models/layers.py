"""Decoder building blocks for both families. Module and parameter names mirror the HF checkpoints
(``self_attn.q_proj``, ``linear_attn.in_proj_qkvz``, ``mlp.experts.gate_up_proj`` ...), so loading is
a name lookup. Caches are attributes bound by the engine (``k_cache``/``v_cache`` on attention,
``conv_state``/``ssm_state`` on Gated DeltaNet), one preallocated tensor per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wmtp.config import ModelConfig
from wmtp.kernels.common import SharedExpert
from wmtp.models.backend import Backend
from wmtp.models.context import ForwardContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool, backend: Backend) -> None:
        super().__init__()
        self.eps, self.offset, self.backend = eps, offset, backend
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps, self.offset)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one op."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps, self.offset)


def make_norm(cfg: ModelConfig, dim: int, backend: Backend) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset, backend)


class Attention(nn.Module):
    """GQA attention; optional q/k RMSNorm and (Qwen3-Next) sigmoid output gate; partial RoPE."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.gated_attention
        bias = cfg.attention_bias
        q_out = cfg.num_heads * cfg.head_dim * (2 if self.gated else 1)
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, cfg.head_dim, backend)
            self.k_norm = make_norm(cfg, cfg.head_dim, backend)
        self.qk_norm, self.eps, self.norm_offset = cfg.qk_norm, cfg.rms_norm_eps, cfg.norm_offset
        self.scale = cfg.head_dim**-0.5

    def _norm_rope(self, x: torch.Tensor, norm: str, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per-head q/k norm (when the model has one) and RoPE, one backend op."""
        n = getattr(self, norm) if self.qk_norm else None
        return self.backend.norm_rope(x, *cos_sin, None if n is None else n.weight, self.eps, self.norm_offset)

    def project_kv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position K (normed, rotated) and V: all a cache slot holds."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return self._norm_rope(k, "k_norm", cos_sin), v

    def write_kv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> None:
        """Fill cache slots without attending (draft-prefill sparsification, DESIGN §4)."""
        k, v = self.project_kv(x, cos_sin)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, ctx.write_slots)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x)
        if self.gated:
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, -1)
        else:
            q = q.view(t, self.num_heads, self.head_dim)
        q = self._norm_rope(q, "q_norm", cos_sin)
        k, v = self.project_kv(x, cos_sin)
        o = self.backend.attention(q, k, v, self.k_cache, self.v_cache, ctx, self.scale).reshape(t, -1)
        if self.gated:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / Qwen3.5 linear attention. Projections are fused (qkvz, ba) or split (qkv, z, b, a)."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    # (states [rows, HV, Dk, Dv] fp32, windows [seqs, K-1+d, C]) a verify records into, bound by the engine
    verify_record: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        self.backend, self.layer_idx = backend, layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.fused = cfg.gdn_fused_projections
        h, key_dim, value_dim = cfg.hidden_size, self.hk * self.dk, self.hv * self.dv
        if self.fused:
            self.in_proj_qkvz = nn.Linear(h, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, 2 * key_dim + value_dim, bias=False)
            self.in_proj_z = nn.Linear(h, value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.hv, bias=False)
            self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        # HF stores the depthwise conv as Conv1d weight [C, 1, K]; keep that shape for loading.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(cfg.gdn_conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.dv))
        self.norm_eps = cfg.rms_norm_eps
        self.out_proj = nn.Linear(value_dim, h, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Returns mixed_qkv [T, conv_dim] in [q | k | v] order, and z [T, G, R, Dv], b, a [T, G, R]
        as views (v-head h at ``[:, h // R, h % R]``; G = HK for the fused layout, 1 for the split one)."""
        t = x.shape[0]
        if not self.fused:
            z = self.in_proj_z(x).view(t, 1, self.hv, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x).view(t, 1, self.hv), self.in_proj_a(x).view(t, 1, self.hv)
        # Fused layout is grouped per key head: [q(Dk) k(Dk) v(r*Dv) z(r*Dv)] and [b(r) a(r)].
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.view(t, self.hk, r, self.dv), b, a

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        core = self.backend.gated_delta_net(
            mixed, a, b, self.A_log, self.dt_bias, self.conv1d.weight.squeeze(1), self.conv_state, self.ssm_state,
            ctx, self.layer_idx, (self.hk, self.hv, self.dk, self.dv, self.kernel), self.verify_record,
        )
        core = self.backend.gated_rms_norm(core, z, self.norm.weight, self.norm_eps)
        return self.out_proj(core.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts, packed: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))


class SparseMoE(nn.Module):
    """Softmax router + top-k routed experts + optional sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.backend, self.top_k, self.norm_topk_prob = backend, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.has_shared:
            m = self.shared_expert
            shared = SharedExpert(m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, self.shared_expert_gate.weight)
        return self.backend.moe(
            x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k, self.norm_topk_prob, shared
        )


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or GDN), then FFN (dense MLP or MoE)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, layer_type: str, moe: bool, backend: Backend) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.self_attn = Attention(cfg, backend)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, backend)
        self.mlp = SparseMoE(cfg, backend) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, backend)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, backend)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output is ``h + residual`` of the returned pair: the add is left to the next
        norm (``add_forward``, one launch with it), as is the input's when ``residual`` is given
        (then the block's input is ``x + residual``). Use ``finish`` for the summed output."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if self.layer_type == "full_attention":
            h = self.self_attn(h, cos_sin, ctx)
        else:
            h = self.linear_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


def finish(norm: RMSNorm, out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``norm(h + residual)`` of a block's (h, residual) output."""
    return norm.add_forward(*out)[0]
