"""The kernel seam: every op a model file needs that a Triton / fla kernel may replace.

Model files call ``self.backend.<op>`` only. ``TorchBackend`` is the reference twin: plain PyTorch,
correct on any device, and what every faster backend is tested against. Backends register by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F

from wmtp.config import Mamba2Shape
from wmtp.engine.window import causal_key_positions
from wmtp.kernels.common import SharedExpert, SigmoidRouting, acc_dtype, linear_epilogue
from wmtp.models.context import ForwardContext
from wmtp.models.rope import apply_rotary
from wmtp.quant import QuantWeight, bytewise, dense, dequantize_kv, quantize_kv


class Backend(ABC):
    """Ops behind the seam. Shapes are flat over the batch: T tokens, B requests."""

    name: str = "abstract"

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        """RMSNorm over the last dim; ``offset`` selects the Qwen3-Next ``x * (1 + w)`` form."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm residual step: ``s = x + residual``; returns (``rms_norm(s)``, s)."""
        s = x + residual
        return self.rms_norm(s, weight, eps, offset), s

    def norm_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None,
                  eps: float, offset: bool) -> torch.Tensor:
        """Attention heads' prologue: per-head ``rms_norm`` (when ``weight`` is given, q/k norm) then
        rotate_half RoPE of the first ``cos.shape[-1]`` channels. x [T, heads, D]; cos, sin [T, rot]."""
        if weight is not None:
            x = self.rms_norm(x, weight, eps, offset)
        return apply_rotary(x, cos, sin)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm_rope`` of the queries [T, heads, D] and of the keys [T, kv_heads, D], each with its
        own norm weight (both or neither given)."""
        return self.norm_rope(q, cos, sin, q_weight, eps, offset), self.norm_rope(k, cos, sin, k_weight, eps, offset)

    def embed_norm_cat(self, ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                       w_h: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        """The MTP layer's fc input: ``cat(rms_norm(embed[ids], w_e), rms_norm(hidden, w_h))`` [T, 2H]."""
        return torch.cat([self.rms_norm(F.embedding(ids, embed), w_e, eps, offset),
                          self.rms_norm(hidden, w_h, eps, offset)], dim=-1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None,
               relu2: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``: the model's projections and the draft's lm_head (``draft_logits``); a
        quantized weight through its reference dequantization. ``relu2`` / ``add``: the
        ``linear_epilogue`` after it (ReLU² MLPs' up projection; a residual branch summed into it)."""
        return linear_epilogue(F.linear(x, dense(weight, x.dtype), bias), relu2, add)

    def argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy choice ``logits.argmax(-1)`` of logits [T, V] as int64, written into ``out`` ([T],
        or [B, n] with B·n = T) when given; returns it."""
        ids = logits.argmax(-1)
        return ids if out is None else out.copy_(ids.view(out.shape))

    @abstractmethod
    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """GDN's output norm: ``weight * rmsnorm(x) * silu(gate)`` over the last dim. x [T, HV, D];
        gate [T, HV, D] or a [T, G, R, D] view with G·R = HV (z in place in the fused projection)."""

    def gated_group_rms_norm(self, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                             eps: float) -> torch.Tensor:
        """Mamba2's output norm: ``weight * rmsnorm_g(y * silu(z))`` over groups of ``group_size``
        channels (``torch_mamba2.gated_group_rms_norm``). y, z [T, C]; returns y's dtype."""
        from wmtp.kernels.torch_mamba2 import gated_group_rms_norm

        return gated_group_rms_norm(y, z, weight, group_size, eps)

    @abstractmethod
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: ForwardContext,
        scale: float,
        gate: torch.Tensor | None = None,
        kv_scale: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Write k, v [T, kv_heads, D] into the caches at ``ctx.write_slots``, then attend.

        q: [T, heads, D]. Request b's queries see keys ``0..q`` (or its draft window) read from
        the caches through ``ctx.kv_slots``. Returns [T, heads, D], times ``sigmoid(gate)``
        ([T, heads, D], Qwen3-Next's output gate) when given. ``kv_scale``: (k, v) scales of fp8
        caches (``wmtp.quant.quantize_kv``; unused by 16- and 32-bit caches).
        """

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, kv_scale: tuple[float, float] = (1.0, 1.0)) -> None:
        """Write k, v [T, kv_heads, D] into the caches [slots, kv_heads, D] at ``slots`` [T]
        (quantized with ``kv_scale`` where the caches are fp8)."""
        bytewise(k_cache)[slots] = bytewise(quantize_kv(k, kv_scale[0], k_cache.dtype))
        bytewise(v_cache)[slots] = bytewise(quantize_kv(v, kv_scale[1], v_cache.dtype))

    @abstractmethod
    def gated_delta_net(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        ctx: ForwardContext,
        layer_idx: int,
        dims: tuple[int, int, int, int, int],
        record_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Causal conv + SiLU, then the gated delta rule, carrying per-request state slots.

        mixed_qkv: [T, conv_dim] pre-conv [q | k | v]; a, b: [T, G, R] raw gate projections (v-head
        h at ``[:, h // R, h % R]``, views of the fused projection) and A_log, dt_bias: [HV], from
        which the op derives g = -exp(A_log) * softplus(a + dt_bias) (fp32) and beta = sigmoid(b)
        (b's dtype) as ``torch_gdn.gdn_gates``; conv_state: [slots, conv_dim, K-1]; ssm_state:
        [slots, HV, Dk, Dv] fp32; dims = (HK, HV, Dk, Dv, K).
        Updates the states of ``ctx.state_slots`` in place. Returns [T, HV, Dv]. With
        ``ctx.record_states`` (a verify: every request has n tokens) the states are left as they
        were and ``ctx.recorded[layer_idx]`` gets the conv windows [B, K-1+n, C] and each token's
        delta-rule inputs [B*n, ``torch_gdn.record_width``] (fp32), from which ``gdn_rollback``
        rebuilds the state after the accepted token; written into ``record_into`` = (tokens
        [>= B*n, ...], windows [>= B, ...]) when given (the engine's preallocated verify record),
        else into new tensors.
        """

    def gdn_rollback(self, conv: torch.Tensor, ssm: torch.Tensor, rec_tokens: torch.Tensor, rec_windows: torch.Tensor,
                     slots: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
        """Every GDN layer's states of ``slots`` (as before the verify) to those after verify token
        ``accepted[b]`` (``torch_gdn.rollback_states`` states the layouts). Device tensors only:
        capturable."""
        from wmtp.kernels.torch_gdn import rollback_states

        rollback_states(conv, ssm, rec_tokens, rec_windows, slots, accepted, n)

    @abstractmethod
    def mamba2(self, xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
               dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, conv_state: torch.Tensor,
               ssm_state: torch.Tensor, ctx: ForwardContext, layer_idx: int, shape: Mamba2Shape,
               record_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """A Mamba2 mixer's conv + SiLU and SSD, carrying per-request state slots (``torch_mamba2``).

        xbc: [T, conv_dim] pre-conv [x | B | C]; dt: [T, H] raw; conv_weight [C, K], conv_bias [C]
        or None; dt_bias, A_log, D [H]; conv_state [slots, C, K-1]; ssm_state [slots, H, P, N] fp32.
        Returns y [T, H * P] (before the gated norm) in xbc's dtype and updates the states
        of ``ctx.state_slots``; with ``ctx.record_states`` (a verify) the states stay and
        ``ctx.recorded[layer_idx]`` gets (conv windows [B, K-1+n, C], per-token SSD inputs [B*n,
        ``torch_mamba2.record_width``]) as for ``gated_delta_net``, in ``record_into`` when given.
        """

    def mamba2_rollback(self, conv: torch.Tensor, ssm: torch.Tensor, rec_tokens: torch.Tensor,
                        rec_windows: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
        """``gdn_rollback`` for Mamba2 layers (``torch_mamba2.rollback_states``)."""
        from wmtp.kernels.torch_mamba2 import rollback_states

        rollback_states(conv, ssm, rec_tokens, rec_windows, slots, accepted, n)

    @abstractmethod
    def moe(
        self,
        x: torch.Tensor,
        router_weight: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        norm_topk_prob: bool,
        shared: SharedExpert | None = None,
    ) -> torch.Tensor:
        """Softmax router, top-k routed experts, plus the sigmoid-gated ``shared`` expert when given.
        x: [N, H]; gate_up: [E, 2I, H]; down: [E, H, I]."""


    @abstractmethod
    def relu2_moe(self, x: torch.Tensor, routing: SigmoidRouting, up: torch.Tensor | QuantWeight,
                  down: torch.Tensor | QuantWeight,
                  latent_proj: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Nemotron-H's routed experts (``torch_relu2_moe``): ``routing`` chooses and weighs them from
        the block input x [T, H]; the experts (up [E, I, W], down [E, W, I], ungated ReLU²) run on
        ``latent_proj(x)`` [T, W] (x itself without one), projected after the router has read x: at
        decode sizes the router's launch then follows the norm's, not the projection's (a 44-layer
        Nemotron-3-Super step on an H100: dense 4.88 -> 4.77 ms). Returns the weighted sum [T, W] in
        the latent's dtype."""


_REGISTRY: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str) -> Callable[[type[Backend]], type[Backend]]:
    def deco(cls: type[Backend]) -> type[Backend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_backend(name: str = "torch") -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def default_backend(device: str | torch.device) -> str:
    """``triton`` on CUDA devices when triton is importable, else the ``torch`` reference."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


@register_backend("torch")
class TorchBackend(Backend):
    """Reference implementations (the twins every kernel is tested against)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        h = x.to(acc_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if offset:
            return (h * (1.0 + weight.to(h.dtype))).to(x.dtype)
        return weight * h.to(x.dtype)

    def gated_rms_norm(self, x, gate, weight, eps):
        from wmtp.kernels.torch_gdn import gated_rms_norm

        return gated_rms_norm(x, gate.reshape(x.shape), weight, eps)

    def attention(self, q, k, v, k_cache, v_cache, ctx, scale, gate=None, kv_scale=(1.0, 1.0)):
        self.store_kv(k, v, k_cache, v_cache, ctx.write_slots, kv_scale)
        out = torch.empty_like(q)
        n_kv, acc = k_cache.shape[1], acc_dtype(q)
        # requests with the same queries and window read the same key positions: one batched
        # product per such group (each request's arithmetic is its own, as one at a time)
        groups: dict[tuple, list[int]] = {}
        for b, (start, n) in enumerate(zip(ctx.q_starts, ctx.q_lens)):
            if n:
                groups.setdefault((start, n, ctx.window(b)), []).append(b)
        for (start, n, window), reqs in groups.items():
            q_last = start + n - 1
            # Gather only keys the rule lets some query read: O(sink + W) under a window.
            keys = causal_key_positions(q_last) if window is None else window.key_positions(start, q_last)
            keys = keys.to(q.device)
            slots = ctx.kv_slots.group_slots(torch.tensor(reqs, device=q.device), keys)  # [G, S]
            kb = dequantize_kv(bytewise(k_cache)[slots].view(k_cache.dtype), kv_scale[0], acc)  # [G, S, n_kv, D]
            vb = dequantize_kv(bytewise(v_cache)[slots].view(v_cache.dtype), kv_scale[1], acc)
            rows = torch.tensor([ctx.token_offsets[b] for b in reqs], device=q.device)[:, None] + torch.arange(n, device=q.device)
            qb = q[rows].to(acc)  # [G, n, H, D]
            qpos = torch.arange(start, q_last + 1, device=q.device)
            mask = keys[None, :] <= qpos[:, None] if window is None else window.visible(qpos[:, None], keys[None, :])
            qg = qb.view(len(reqs), n, n_kv, qb.shape[2] // n_kv, -1)
            scores = torch.einsum("bnkgd,bskd->bkgns", qg, kb) * scale
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            ob = torch.einsum("bkgns,bskd->bnkgd", probs, vb)
            out[rows] = ob.reshape(len(reqs), n, -1, ob.shape[-1]).to(q.dtype)
        return out if gate is None else out * torch.sigmoid(gate)

    def gated_delta_net(self, mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, ssm_state, ctx, layer_idx,
                        dims, record_into=None):
        from wmtp.kernels.torch_gdn import (causal_conv1d, gated_delta_rule, gated_delta_rule_recurrent, gdn_gates,
                                            verify_record)

        _, hv, _, dv, _ = dims
        g, beta = gdn_gates(a.flatten(1), b.flatten(1), A_log, dt_bias)
        if _uniform_short(ctx):
            return self._gated_delta_net_batched(mixed_qkv, g, beta, conv_weight, conv_state, ssm_state, ctx,
                                                 layer_idx, dims, record_into)
        out = mixed_qkv.new_empty(mixed_qkv.shape[0], hv, dv)
        windows, tokens = [], []
        for req, n in enumerate(ctx.q_lens):
            if n == 0:
                continue
            lo = ctx.token_offsets[req]
            slot = int(ctx.state_slots[req])
            x = mixed_qkv[lo : lo + n]
            conv_out, new_conv = causal_conv1d(x, conv_weight, conv_state[slot])
            q, k, v = _gdn_heads(conv_out, dims)
            gates = (g[lo : lo + n], beta[lo : lo + n])
            if ctx.record_states:  # verify: the states stay; the rollback replays the accepted tokens
                o, _ = gated_delta_rule_recurrent(q, k, v, *gates, ssm_state[slot])
                windows.append(torch.cat([conv_state[slot].transpose(0, 1), x.to(conv_state.dtype)]))
                tokens.append(verify_record(q, k, v, *gates, dims[0]))
            else:
                o, new_state = gated_delta_rule(q, k, v, *gates, ssm_state[slot])
                conv_state[slot] = new_conv.to(conv_state.dtype)
                ssm_state[slot] = new_state.to(ssm_state.dtype)
            out[lo : lo + n] = o
        if ctx.record_states:
            _keep_record(ctx, layer_idx, torch.stack(windows), torch.cat(tokens), record_into)
        return out

    def _gated_delta_net_batched(self, mixed_qkv, g, beta, conv_weight, conv_state, ssm_state, ctx, layer_idx, dims,
                                 record_into):
        """``gated_delta_net`` for B requests of n tokens each (decode, verify, short prefill chunks),
        all at once: the recurrence over B x HV heads (each head's arithmetic is its own, as in the
        per-request loop), the conv over a batch."""
        from wmtp.kernels.torch_gdn import causal_conv1d, gated_delta_rule_recurrent, verify_record

        hk, hv, dk, dv, _ = dims
        B, n = len(ctx.q_lens), ctx.q_lens[0]
        slots = ctx.state_slots.to(torch.long)
        x = mixed_qkv.view(B, n, -1)
        conv_out, new_conv = causal_conv1d(x, conv_weight, conv_state[slots])
        q, k, v = _gdn_heads(conv_out.reshape(B * n, -1), dims)  # [B * n, HV, D]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B * n, HV, ...] -> [n, B * HV, ...], request-major heads
            return t.reshape(B, n, hv, -1).transpose(0, 1).reshape(n, B * hv, *t.shape[2:])

        q, k, v, g, beta = (heads(t) for t in (q, k, v, g, beta))
        o, state = gated_delta_rule_recurrent(q, k, v, g, beta, ssm_state[slots].reshape(B * hv, dk, dv))
        if ctx.record_states:  # verify: the states stay; the rollback replays the accepted tokens
            win = torch.cat([conv_state[slots].transpose(1, 2), x.to(conv_state.dtype)], dim=1)
            _keep_record(ctx, layer_idx, win, verify_record(q, k, v, g, beta, hk, batch=B), record_into)
        else:
            conv_state[slots] = new_conv.to(conv_state.dtype)
            ssm_state[slots] = state.view(B, hv, dk, dv).to(ssm_state.dtype)
        return o.view(n, B, hv, dv).transpose(0, 1).reshape(B * n, hv, dv)

    def mamba2(self, xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, conv_state, ssm_state, ctx, layer_idx,
               shape, record_into=None):
        from wmtp.kernels.torch_gdn import causal_conv1d
        from wmtp.kernels.torch_mamba2 import ssd_gates, ssd_recurrent, verify_record

        m = shape
        out = xbc.new_empty(xbc.shape[0], m.inner)
        windows, tokens = [], []
        for req, n in enumerate(ctx.q_lens):
            if n == 0:
                continue
            lo, slot = ctx.token_offsets[req], int(ctx.state_slots[req])
            x = xbc[lo : lo + n]
            conv, new_conv = causal_conv1d(x, conv_weight, conv_state[slot], conv_bias)
            xs, B, C = conv.split([m.inner, m.groups * m.state, m.groups * m.state], dim=-1)
            xs, B, C = xs.reshape(n, m.heads, m.head_dim), B.reshape(n, m.groups, m.state), C.reshape(n, m.groups, m.state)
            dt_g, A = ssd_gates(dt[lo : lo + n], dt_bias, A_log, m.dt_limit)
            if ctx.record_states:  # verify: the states stay; the rollback replays the accepted tokens
                y, _ = ssd_recurrent(xs, dt_g, A, B, C, D, ssm_state[slot])
                windows.append(torch.cat([conv_state[slot].transpose(0, 1), x.to(conv_state.dtype)]))
                tokens.append(verify_record(xs, dt_g, A, B))
            else:
                y, new_state = self._ssd(xs, dt_g, A, B, C, D, m.chunk, ssm_state[slot])
                conv_state[slot] = new_conv.to(conv_state.dtype)
                ssm_state[slot] = new_state.to(ssm_state.dtype)
            out[lo : lo + n] = y.reshape(n, m.inner)
        if ctx.record_states:
            _keep_record(ctx, layer_idx, torch.stack(windows), torch.cat(tokens), record_into)
        return out

    def _ssd(self, x, dt, A, B, C, D, chunk, state):
        """One request's SSD piece that updates its state (``torch_mamba2.ssd``)."""
        from wmtp.kernels.torch_mamba2 import ssd

        return ssd(x, dt, A, B, C, D, chunk, state)

    def moe(self, x, router_weight, gate_up, down, top_k, norm_topk_prob, shared=None):
        from wmtp.kernels.moe import route, shared_expert_reference

        top_w, top_i = route(x, router_weight, top_k, norm_topk_prob)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        inter = down.shape[-1]
        for e in torch.unique(top_i).tolist():
            rows, which = torch.where(top_i == e)
            h = F.linear(x[rows], dense(gate_up[e], x.dtype))
            h = F.silu(h[:, :inter]) * h[:, inter:]
            h = F.linear(h, dense(down[e], x.dtype)) * top_w[rows, which, None]
            out.index_add_(0, rows, h.to(out.dtype))
        return out if shared is None else out + shared_expert_reference(x, shared)


    def relu2_moe(self, x, routing, up, down, latent_proj=None):
        from wmtp.kernels.torch_relu2_moe import relu2_experts, sigmoid_route

        w, idx = sigmoid_route(x, routing)
        return relu2_experts(x if latent_proj is None else latent_proj(x), up, down, w, idx)


def _uniform_short(ctx) -> bool:
    """Every request of the forward has the same number of tokens, at most the recurrence's (the
    per-request loop otherwise: prefill chunks of any length, the chunked form), laid out in order."""
    from wmtp.kernels.torch_gdn import RECURRENT_MAX_TOKENS

    n = ctx.q_lens[0]
    return (0 < n <= RECURRENT_MAX_TOKENS and len(ctx.q_lens) > 1 and all(m == n for m in ctx.q_lens)
            and ctx.token_offsets[:-1] == list(range(0, n * len(ctx.q_lens), n)))


def _keep_record(ctx, layer_idx: int, windows: torch.Tensor, tokens: torch.Tensor, record_into) -> None:
    """A verify's recurrent-layer record for the rollback, in the engine's preallocated buffers when given."""
    if record_into is not None:
        tokens = record_into[0][: tokens.shape[0]].copy_(tokens)
        windows = record_into[1][: windows.shape[0]].copy_(windows)
    ctx.recorded[layer_idx] = (windows, tokens)


def _gdn_heads(conv_out: torch.Tensor, dims: tuple[int, int, int, int, int]) -> tuple[torch.Tensor, ...]:
    """Split the conv output [n, conv_dim] into q, k [n, HV, Dk] (k-heads repeated to the v-heads)
    and v [n, HV, Dv]."""
    hk, hv, dk, dv, _ = dims
    n = conv_out.shape[0]
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = q.reshape(n, hk, dk).repeat_interleave(hv // hk, dim=1)
    k = k.reshape(n, hk, dk).repeat_interleave(hv // hk, dim=1)
    return q, k, v.reshape(n, hv, dv)


@register_backend("triton")
class TritonBackend(TorchBackend):
    """Attention through the Triton paged / ring / windowed kernel (``wmtp.kernels.paged_attention``;
    prefill chunks without the draft window through FlashAttention-4 where it is installed,
    ``wmtp.kernels.flash_prefill``), routed experts through the pair-wise GEMV at decode sizes or
    grouped GEMMs beyond (``wmtp.kernels.moe``), the recurrent / fla-chunked gated delta rule (``wmtp.kernels.gdn``) and
    fused RMSNorms (``wmtp.kernels.norm``). fp64 (exactness tests) stays on the reference."""

    def attention(self, q, k, v, k_cache, v_cache, ctx, scale, gate=None, kv_scale=(1.0, 1.0)):
        if q.dtype == torch.float64:
            return super().attention(q, k, v, k_cache, v_cache, ctx, scale, gate, kv_scale)
        from wmtp.kernels import flash_prefill
        from wmtp.kernels.act_mul import SIGMOID, act_mul
        from wmtp.kernels.paged_attention import AttentionMeta, paged_attention

        self.store_kv(k, v, k_cache, v_cache, ctx.write_slots, kv_scale)
        if flash_prefill.applies(q, k_cache, ctx):  # a prefill chunk without the draft window: FlashAttention-4
            fmeta = ctx.backend_cache.get("flash_meta")
            if fmeta is None:
                fmeta = ctx.backend_cache["flash_meta"] = flash_prefill.FlashMeta.from_context(ctx, q.device)
            out = flash_prefill.flash_prefill(q, k_cache, v_cache, fmeta, scale)
            return out if gate is None else act_mul(gate, out, SIGMOID)
        meta = ctx.backend_cache.get("attention_meta")
        if meta is None:  # built once per forward, shared by every attention layer
            meta = ctx.backend_cache["attention_meta"] = AttentionMeta.from_context(ctx, q.device)
        return paged_attention(q, k_cache, v_cache, meta, scale, gate=gate, kv_scale=kv_scale)

    def store_kv(self, k, v, k_cache, v_cache, slots, kv_scale=(1.0, 1.0)):
        if k.dtype == torch.float64:
            return super().store_kv(k, v, k_cache, v_cache, slots, kv_scale)
        from wmtp.kernels.paged_attention import store_kv

        store_kv(k, v, k_cache, v_cache, slots, kv_scale)

    def rms_norm(self, x, weight, eps, offset):
        if x.dtype == torch.float64:
            return super().rms_norm(x, weight, eps, offset)
        from wmtp.kernels.norm import rms_norm

        return rms_norm(x, weight, eps, offset)

    def add_rms_norm(self, x, residual, weight, eps, offset):
        if x.dtype == torch.float64:
            return super().add_rms_norm(x, residual, weight, eps, offset)
        from wmtp.kernels.norm import add_rms_norm

        return add_rms_norm(x, residual, weight, eps, offset)

    def embed_norm_cat(self, ids, embed, hidden, w_e, w_h, eps, offset):
        if hidden.dtype == torch.float64:
            return super().embed_norm_cat(ids, embed, hidden, w_e, w_h, eps, offset)
        from wmtp.kernels.norm import embed_norm_cat

        return embed_norm_cat(ids, embed, hidden, w_e, w_h, eps, offset)

    def linear(self, x, weight, bias=None, relu2=False, add=None):
        from wmtp.kernels.linear import decode_linear

        # quantized: in-register dequantization, or dequantized for a GEMM; the epilogue in the kernel's launch
        return decode_linear(x, weight, bias, relu2, add)

    def argmax(self, logits, out=None):
        if logits.dtype == torch.float64:
            return super().argmax(logits, out)
        from wmtp.kernels.argmax import argmax_rows

        return argmax_rows(logits, out)

    def norm_rope(self, x, cos, sin, weight, eps, offset):
        if x.dtype == torch.float64:
            return super().norm_rope(x, cos, sin, weight, eps, offset)
        from wmtp.kernels.norm import norm_rope

        return norm_rope(x, cos, sin, weight, eps, offset)

    def qk_norm_rope(self, q, k, cos, sin, q_weight, k_weight, eps, offset):
        if q.dtype == torch.float64:
            return super().qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, offset)
        from wmtp.kernels.norm import qk_norm_rope

        return qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, offset)

    def gated_rms_norm(self, x, gate, weight, eps):
        if x.dtype == torch.float64:
            return super().gated_rms_norm(x, gate, weight, eps)
        from wmtp.kernels.norm import rms_norm

        return rms_norm(x, weight, eps, gate=gate)

    def gated_group_rms_norm(self, y, z, weight, group_size, eps):
        if y.dtype == torch.float64 or z.stride(-1) != 1:
            return super().gated_group_rms_norm(y, z, weight, group_size, eps)
        from wmtp.kernels.norm import gated_group_rms_norm

        return gated_group_rms_norm(y, z, weight, group_size, eps)

    def gdn_rollback(self, conv, ssm, rec_tokens, rec_windows, slots, accepted, n):
        if conv.dtype == torch.float64:
            return super().gdn_rollback(conv, ssm, rec_tokens, rec_windows, slots, accepted, n)
        from wmtp.kernels.gdn import rollback_states

        rollback_states(conv, ssm, rec_tokens, rec_windows, slots, accepted, n)

    def mamba2_rollback(self, conv, ssm, rec_tokens, rec_windows, slots, accepted, n):
        if conv.dtype == torch.float64 or ssm.shape[-1] & (ssm.shape[-1] - 1):
            return super().mamba2_rollback(conv, ssm, rec_tokens, rec_windows, slots, accepted, n)
        from wmtp.kernels.mamba2 import rollback_states

        rollback_states(conv, ssm, rec_tokens, rec_windows, slots, accepted, n)

    def mamba2(self, xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, conv_state, ssm_state, ctx, layer_idx,
               shape, record_into=None):
        from wmtp.kernels.mamba2 import MAX_RECURRENT_TOKENS, mamba2_decode

        args = (xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, conv_state, ssm_state, ctx, layer_idx, shape)
        if (xbc.dtype == torch.float64 or max(ctx.q_lens) > MAX_RECURRENT_TOKENS or shape.conv_kernel != 4
                or shape.state & (shape.state - 1) or not conv_state.is_contiguous()):
            return super().mamba2(*args, record_into)  # prefill-sized pieces: the chunked form (``_ssd``)
        n = ctx.q_lens[0]
        if ctx.record_states and any(m != n for m in ctx.q_lens):
            raise ValueError("record_states needs every request to have the same q_len (verify)")
        _, q_len, tok_off = ctx.device_lens
        y, window, tokens = mamba2_decode(xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, conv_state, ssm_state,
                                          ctx.state_slots, tok_off, q_len, shape, n if ctx.record_states else None,
                                          record_into)
        if ctx.record_states:
            ctx.recorded[layer_idx] = (window, tokens)
        return y

    def _ssd(self, x, dt, A, B, C, D, chunk, state):
        from wmtp.kernels.gdn import fla_available
        from wmtp.kernels.mamba2 import MAX_RECURRENT_TOKENS, ssd_chunked_fla

        if x.shape[0] > MAX_RECURRENT_TOKENS and x.dtype != torch.float64 and fla_available(x.device, "simple_gla"):
            return ssd_chunked_fla(x, dt, A, B, C, D, state)
        return super()._ssd(x, dt, A, B, C, D, chunk, state)

    def capturable_moe(self, num_tokens: int, cfg, dtype: torch.dtype, quantized: bool = False) -> bool:
        """Whether ``moe`` over ``num_tokens`` avoids host syncs (CUDA-graph capture): the pair-wise
        GEMVs (float or quantized) and the grouped GEMM do; the reference's ``torch.unique`` (what
        quantized experts take above the GEMV sizes) does not."""
        from wmtp.kernels.moe import MAX_GEMV_PAIRS, QUANT_GEMV_TOKENS

        if quantized and cfg.family == "mamba_hybrid":  # relu2_moe's quantized GEMV sizes
            return num_tokens <= QUANT_GEMV_TOKENS
        if quantized and cfg.num_experts > 0:
            return num_tokens * cfg.num_experts_per_tok <= MAX_GEMV_PAIRS
        return cfg.num_experts <= 0 or num_tokens * cfg.num_experts_per_tok <= MAX_GEMV_PAIRS or dtype == torch.bfloat16

    def moe(self, x, router_weight, gate_up, down, top_k, norm_topk_prob, shared=None):
        from wmtp.kernels.moe import MAX_GEMV_PAIRS, grouped_mm_supported, moe_gemv, routed_experts_grouped

        if x.dtype == torch.float64:
            return super().moe(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)
        if isinstance(gate_up, QuantWeight) and x.shape[0] * top_k > MAX_GEMV_PAIRS:
            if grouped_mm_supported(x):  # prefill: the grouped GEMMs over the quantized experts
                return routed_experts_grouped(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)
            return super().moe(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)
        if x.shape[0] * top_k <= MAX_GEMV_PAIRS:
            return moe_gemv(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)
        if grouped_mm_supported(x):
            return routed_experts_grouped(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)
        return super().moe(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)

    def relu2_moe(self, x, routing, up, down, latent_proj=None):
        from wmtp.kernels.moe import (MAX_GEMV_PAIRS, QUANT_GEMV_TOKENS, grouped_experts, grouped_mm_supported,
                                      relu2_moe_gemv)
        from wmtp.kernels.torch_relu2_moe import sigmoid_route

        gemv = (x.shape[0] <= QUANT_GEMV_TOKENS if isinstance(up, QuantWeight)
                else x.shape[0] * routing.top_k <= MAX_GEMV_PAIRS)
        if x.dtype == torch.float64:
            return super().relu2_moe(x, routing, up, down, latent_proj)
        if gemv and routing.n_group == 1:
            return relu2_moe_gemv(x, routing, up, down, latent_proj)
        if grouped_mm_supported(x):  # prefill, large batches: the grouped GEMMs, float or quantized experts
            w, idx = sigmoid_route(x, routing)
            return grouped_experts(x if latent_proj is None else latent_proj(x), up, down, w, idx, gated=False)
        return super().relu2_moe(x, routing, up, down, latent_proj)

    def gated_delta_net(self, mixed_qkv, a, b, A_log, dt_bias, conv_weight, conv_state, ssm_state, ctx, layer_idx,
                        dims, record_into=None):
        from wmtp.kernels.gdn import (MAX_RECURRENT_TOKENS, causal_conv1d_prefill, fla_available, gdn_chunked_fla,
                                      gdn_decode, gdn_gates)
        from wmtp.kernels.torch_gdn import causal_conv1d

        gates = (a, b, A_log, dt_bias)
        if mixed_qkv.dtype == torch.float64:
            return super().gated_delta_net(mixed_qkv, *gates, conv_weight, conv_state, ssm_state, ctx, layer_idx, dims,
                                           record_into)
        if max(ctx.q_lens) > MAX_RECURRENT_TOKENS:  # prefill-sized pieces: chunked form
            if not fla_available(mixed_qkv.device):
                return super().gated_delta_net(mixed_qkv, *gates, conv_weight, conv_state, ssm_state, ctx, layer_idx,
                                               dims)
            conv_out = torch.empty_like(mixed_qkv)
            conv = causal_conv1d_prefill if dims[-1] == 4 else causal_conv1d  # the kernel is written for size 4
            for req, n in enumerate(ctx.q_lens):
                lo, slot = ctx.token_offsets[req], ctx.state_slots[req : req + 1]
                conv_out[lo : lo + n], new = conv(mixed_qkv[lo : lo + n], conv_weight, conv_state[slot][0])
                conv_state[slot] = new[None].to(conv_state.dtype)
            return gdn_chunked_fla(conv_out, *gdn_gates(*gates), ssm_state, ctx, dims)
        if dims[-1] != 4 or not conv_state.is_contiguous():  # the fused conv is written for Qwen's kernel size 4
            return super().gated_delta_net(mixed_qkv, *gates, conv_weight, conv_state, ssm_state, ctx, layer_idx, dims,
                                           record_into)
        n = ctx.q_lens[0]
        if ctx.record_states and any(m != n for m in ctx.q_lens):
            raise ValueError("record_states needs every request to have the same q_len (verify)")
        _, q_len, tok_off = ctx.device_lens
        # one launch: the conv (state slots updated in place) and the delta rule (gates in-kernel)
        o, window, tokens = gdn_decode(mixed_qkv, conv_weight, conv_state, *gates, ssm_state, ctx.state_slots,
                                       tok_off, q_len, n if ctx.record_states else None, record_into)
        if ctx.record_states:
            ctx.recorded[layer_idx] = (window, tokens)
        return o
