"""Decoder building blocks for both families. Module and parameter names mirror the HF checkpoints
(``mlp.experts.gate_up_proj``, ``linear_attn.A_log`` ...), so loading is a name lookup, except that
projections of one input are packed into one ``PackedLinear`` (``self_attn.qkv_proj`` holds the
checkpoint's q_proj / k_proj / v_proj rows; ``linear_attn.in_proj`` the in_proj_* ones), whose
parts the loader and writer map by name. Caches are attributes bound by the engine
(``k_cache``/``v_cache`` on attention, ``conv_state``/``ssm_state`` on Gated DeltaNet), one
preallocated tensor per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from wmtp.config import ModelConfig
from wmtp.kernels.common import SharedExpert
from wmtp.models.backend import Backend
from wmtp.models.context import ForwardContext
from wmtp.models.parallel import VocabParallelEmbedding
from wmtp.quant import QuantFormat, QuantWeight


def register_quant(module: nn.Module, fmt: QuantFormat, shape: tuple[int, ...]) -> None:
    """Give ``module`` the parameters of a quantized weight of ``shape`` ([N, K], or [E, N, K]
    experts) in ``fmt``'s per-row layout, named by their checkpoint suffixes (``weight``,
    ``weight_scale``, ...), uninitialised, where (and on whatever device) the model is being built."""
    *lead, n, k = shape
    for suffix, (shp, dtype) in fmt.model_shapes(n, k).items():
        if hasattr(module, suffix):
            delattr(module, suffix)
        module.register_parameter(suffix, nn.Parameter(torch.empty(*lead, *shp, dtype=dtype), requires_grad=False))


def quant_weight(module: nn.Module, fmt: QuantFormat, in_features: int) -> QuantWeight:
    return QuantWeight(fmt, {s: getattr(module, s) for s in fmt.suffixes}, in_features)


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


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is the backend's ``linear`` (decode-sized inputs may take a
    kernel instead of cuBLAS). ``quantize_`` replaces the weight by a quantized format's tensors."""

    quant: QuantFormat | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: Backend) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend

    def quantize_(self, fmt: QuantFormat) -> None:
        register_quant(self, fmt, (self.out_features, self.in_features))
        self.quant = fmt

    def qweight(self) -> torch.Tensor | QuantWeight:
        """What the backend multiplies by: the weight tensor, or the quantized weight."""
        return self.weight if self.quant is None else quant_weight(self, self.quant, self.in_features)

    def forward(self, x: torch.Tensor, relu2: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """``relu2`` / ``add``: ``Backend.linear``'s epilogue (in the kernel's launch where it runs)."""
        return self.backend.linear(x, self.qweight(), self.bias, relu2, add)


class PackedLinear(Linear):
    """Several projections of the same input stored as one weight, their rows in ``parts`` order
    (name -> out features), so a forward runs one GEMM: at decode sizes each launch costs more than
    the bytes it reads. Checkpoints keep the parts apart: the loader maps ``<parent>.<part>.weight``
    (and ``.bias``) to ``rows(part)`` of this module's tensors, and the writer splits them back."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, backend: Backend) -> None:
        super().__init__(in_features, sum(parts.values()), bias, backend)
        self.parts = dict(parts)

    def rows(self, part: str) -> slice:
        start = 0
        for name, size in self.parts.items():
            if name == part:
                return slice(start, start + size)
            start += size
        raise KeyError(f"PackedLinear has no part {part!r}; parts: {list(self.parts)}")

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The parts of a forward's output [T, out_features], as column views (no copies)."""
        return list(y.split(list(self.parts.values()), dim=-1))

    def forward_parts(self, x: torch.Tensor, first: str, last: str) -> list[torch.Tensor]:
        """Only the adjacent parts ``first`` .. ``last``, from one GEMM over their rows."""
        rows = slice(self.rows(first).start, self.rows(last).stop)
        names = list(self.parts)
        w = self.qweight()
        w = w[rows] if self.quant is None else w.rows(rows)
        y = self.backend.linear(x, w, None if self.bias is None else self.bias[rows])
        return list(y.split([self.parts[n] for n in names[names.index(first) : names.index(last) + 1]], dim=-1))


def embed_norm_cat(ids: torch.Tensor, embedding: nn.Embedding, hidden: torch.Tensor, norm_e: RMSNorm,
                   norm_h: RMSNorm) -> torch.Tensor:
    """``cat(norm_e(embedding(ids)), norm_h(hidden))`` (the MTP fc's input) as one backend op; a
    vocabulary-sharded embedding (tensor parallelism) gathers its rows first, then the norms run."""
    if (norm_e.eps, norm_e.offset) != (norm_h.eps, norm_h.offset):
        raise ValueError("embed_norm_cat: the two norms must share eps and the offset form")
    if isinstance(embedding, VocabParallelEmbedding):
        return torch.cat([norm_e(embedding(ids)), norm_h(hidden)], dim=-1)
    return norm_e.backend.embed_norm_cat(ids, embedding.weight, hidden, norm_e.weight, norm_h.weight, norm_e.eps,
                                         norm_e.offset)


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
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}, bias,
                                     backend)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias, backend)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, cfg.head_dim, backend)
            self.k_norm = make_norm(cfg, cfg.head_dim, backend)
        self.qk_norm, self.eps, self.norm_offset = cfg.qk_norm, cfg.rms_norm_eps, cfg.norm_offset
        assert not (cfg.qk_norm and cfg.rope.get("rope_type") == "none"), "NoPE attention has no q / k norm here"
        self.scale = cfg.head_dim**-0.5
        # fp8 KV: stored = x / scale, read = code * scale (the checkpoint's, set by the loader)
        self.k_scale = self.v_scale = 1.0
        self.kv_scale_loaded = False

    @property
    def kv_scale(self) -> tuple[float, float]:
        return self.k_scale, self.v_scale

    def _norm_weight(self, norm: str) -> torch.Tensor | None:
        return getattr(self, norm).weight if self.qk_norm else None

    def _kv_heads(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[0]
        return k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim)

    def write_kv(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, ctx: ForwardContext
                 ) -> None:
        """Fill cache slots without attending (draft-prefill sparsification, DESIGN §4): the K / V
        rows only (K normed and rotated), no query. ``cos_sin`` None: no position encoding (NoPE,
        whose models have no q / k norm either)."""
        k, v = self._kv_heads(*self.qkv_proj.forward_parts(x, "k_proj", "v_proj"))
        if cos_sin is not None:
            k = self.backend.norm_rope(k, *cos_sin, self._norm_weight("k_norm"), self.eps, self.norm_offset)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, ctx.write_slots, self.kv_scale)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, ctx: ForwardContext
                ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        gate = None
        if self.gated:  # per head [query | gate]; the gate stays a view, applied by the attention op
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(t, self.num_heads, self.head_dim)
        k, v = self._kv_heads(k, v)
        if cos_sin is not None:  # per-head q/k norm (if any) and RoPE
            q, k = self.backend.qk_norm_rope(q, k, *cos_sin, self._norm_weight("q_norm"), self._norm_weight("k_norm"),
                                             self.eps, self.norm_offset)
        o = self.backend.attention(q, k, v, self.k_cache, self.v_cache, ctx, self.scale, gate, self.kv_scale)
        return self.o_proj(o.reshape(t, -1))


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / Qwen3.5 linear attention. The checkpoint's input projections, fused (qkvz, ba) or
    split (qkv, z, b, a), are packed into one ``in_proj``."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor
    # (tokens [rows, torch_gdn.record_width] fp32, windows [seqs, K-1+d, C]) a verify records into, bound by the engine
    verify_record: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        self.backend, self.layer_idx = backend, layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.fused = cfg.gdn_fused_projections
        h, key_dim, value_dim = cfg.hidden_size, self.hk * self.dk, self.hv * self.dv
        parts = ({"in_proj_qkvz": 2 * key_dim + 2 * value_dim, "in_proj_ba": 2 * self.hv} if self.fused else
                 {"in_proj_qkv": 2 * key_dim + value_dim, "in_proj_z": value_dim, "in_proj_b": self.hv,
                  "in_proj_a": self.hv})
        self.in_proj = PackedLinear(h, parts, False, backend)
        # HF stores the depthwise conv as Conv1d weight [C, 1, K]; keep that shape for loading.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(cfg.gdn_conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(self.dv))
        self.norm_eps = cfg.rms_norm_eps
        self.out_proj = Linear(value_dim, h, False, backend)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Returns mixed_qkv [T, conv_dim] in [q | k | v] order, and z [T, G, R, Dv], b, a [T, G, R]
        as views (v-head h at ``[:, h // R, h % R]``; G = HK for the fused layout, 1 for the split one)."""
        t = x.shape[0]
        parts = self.in_proj.split(self.in_proj(x))
        if not self.fused:
            mixed, z, b, a = parts
            return mixed, z.view(t, 1, self.hv, self.dv), b.view(t, 1, self.hv), a.view(t, 1, self.hv)
        # Fused layout is grouped per key head: [q(Dk) k(Dk) v(r*Dv) z(r*Dv)] and [b(r) a(r)].
        r = self.hv // self.hk
        qkvz = parts[0].view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = parts[1].view(t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.view(t, self.hk, r, self.dv), b, a

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        core = self.backend.gated_delta_net(
            mixed, a, b, self.A_log, self.dt_bias, self.conv1d.weight.squeeze(1), self.conv_state, self.ssm_state,
            ctx, self.layer_idx, (self.hk, self.hv, self.dk, self.dv, self.kernel),
            ctx.record_buffers(self.verify_record, self.kernel),
        )
        core = self.backend.gated_rms_norm(core, z, self.norm.weight, self.norm_eps)
        return self.out_proj(core.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, backend: Backend) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, False, backend)
        self.up_proj = Linear(hidden, inter, False, backend)
        self.down_proj = Linear(inter, hidden, False, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertPart(NamedTuple):
    """One checkpoint projection of every routed expert (``experts.{e}.<kind>.weight``, [n, k]) and
    where it sits in the packed parameter: ``param``'s rows ``rows`` of each expert."""

    kind: str
    param: str
    rows: slice
    n: int
    k: int


class Experts(nn.Module):
    """Routed experts, packed: gated (SwiGLU) gate_up_proj [E, 2I, H] (gate rows first), or
    ungated (ReLU²) up_proj [E, I, H]; and down_proj [E, H, I]. Each a parameter, or
    (``quantize_``) a module of a quantized format's tensors over [E, N, K]. ``parts`` is how the
    checkpoint's per-expert projections map onto them (the loader, writer and bytes floor use it)."""

    quant: QuantFormat | None = None

    def __init__(self, num: int, hidden: int, inter: int, gated: bool = True) -> None:
        super().__init__()
        self.num, self.hidden, self.inter, self.gated = num, hidden, inter, gated
        self.first = "gate_up_proj" if gated else "up_proj"
        for name, shape in self._shapes():
            setattr(self, name, nn.Parameter(torch.empty(shape)))

    def _shapes(self) -> list[tuple[str, tuple[int, int, int]]]:
        return [(self.first, (self.num, (2 if self.gated else 1) * self.inter, self.hidden)),
                ("down_proj", (self.num, self.hidden, self.inter))]

    @property
    def parts(self) -> list[ExpertPart]:
        i, h = self.inter, self.hidden
        first = ([ExpertPart("gate_proj", self.first, slice(0, i), i, h),
                  ExpertPart("up_proj", self.first, slice(i, 2 * i), i, h)]
                 if self.gated else [ExpertPart("up_proj", self.first, slice(None), i, h)])
        return first + [ExpertPart("down_proj", "down_proj", slice(None), h, i)]

    def quantize_(self, fmt: QuantFormat) -> None:
        for name, shape in self._shapes():
            delattr(self, name)
            setattr(self, name, nn.Module())
            register_quant(getattr(self, name), fmt, shape)
        self.quant = fmt

    def weights(self) -> tuple[torch.Tensor | QuantWeight, torch.Tensor | QuantWeight]:
        """(gate_up or up, down) as the backend's MoE takes them."""
        first = getattr(self, self.first)
        if self.quant is None:
            return first, self.down_proj
        return quant_weight(first, self.quant, self.hidden), quant_weight(self.down_proj, self.quant, self.inter)


class SparseMoE(nn.Module):
    """Softmax router + top-k routed experts + optional sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.backend, self.top_k, self.norm_topk_prob = backend, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, backend)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.has_shared:
            m = self.shared_expert
            shared = SharedExpert(m.gate_proj.qweight(), m.up_proj.qweight(), m.down_proj.qweight(),
                                  self.shared_expert_gate.weight)
        return self.backend.moe(x, self.gate.weight, *self.experts.weights(), self.top_k, self.norm_topk_prob, shared)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or GDN), then FFN (dense MLP or MoE)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, layer_type: str, moe: bool, backend: Backend) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.self_attn = Attention(cfg, backend)
        else:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, backend)
        self.mlp = SparseMoE(cfg, backend) if moe else MLP(cfg.hidden_size, cfg.intermediate_size, backend)
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
