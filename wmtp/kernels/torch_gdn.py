"""PyTorch reference ops for Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers).

Every op here works on ONE sequence (no batch dimension); the caller loops over requests.
These are the numerical ground truth that the Triton / flash-linear-attention paths are
tested against, so they favour clarity and fp32 accuracy over speed.

Notation
    T   tokens in the sequence (may be 0 for the conv / delta rule ops)
    C   conv channels (= 2 * key_dim + value_dim for Qwen3-Next)
    K   conv kernel width
    HV  value heads (q / k must already be expanded from key heads to value heads)
    Dk  key / query head dim,   Dv  value head dim

Gated delta rule, per head, for t = 1..T (S is the [Dk, Dv] state):
    S   <- exp(g_t) * S
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t  = S^T q_t
with q_t, k_t L2-normalised (eps 1e-6 inside the rsqrt) and q_t scaled by Dk**-0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from wmtp.kernels.common import acc_dtype

__all__ = [
    "RECURRENT_MAX_TOKENS",
    "causal_conv1d",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_rms_norm",
    "gdn_gates",
    "l2_normalize",
    "record_width",
    "rollback_conv",
    "replay_states",
    "rollback_states",
    "verify_record",
]

#: ``gated_delta_rule`` uses the token recurrence when T <= this (decode, short verify
#: windows) and the chunked WY form above it (prefill).
RECURRENT_MAX_TOKENS: int = 16

#: eps inside ``rsqrt(sum(x*x) + eps)`` for the q / k L2 norm (matches FLA and transformers).
L2NORM_EPS: float = 1e-6


# --------------------------------------------------------------------------------------
# Short causal depthwise convolution
# --------------------------------------------------------------------------------------
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time (+ ``bias`` [C], Mamba2's) followed by SiLU, with carried
    left context.

    Args:
        x: [T, C] inputs of this piece of the sequence, or [B, T, C] for B sequences at once.
        weight: [C, K] depthwise kernel (``conv1d.weight.squeeze(1)``).
        conv_state: [C, K-1] (or [B, C, K-1]) the last K-1 inputs seen before ``x`` (oldest
            first), or None for the start of a sequence (zeros).

    Returns:
        out: [T, C] (or [B, T, C]) in ``x.dtype``; the conv + SiLU are computed in
            ``weight.dtype`` (as the reference casts its input to the weight dtype).
        new_state: [C, K-1] (or [B, C, K-1]) in ``x.dtype``, the last K-1 columns of
            ``cat([conv_state, x.T])``; feeding it to the next call makes piecewise
            processing identical to processing the whole sequence.
    """
    batched = x.dim() == 3
    assert x.dim() in (2, 3) and weight.dim() == 2, (x.shape, weight.shape)
    if not batched:
        x = x[None]
        conv_state = None if conv_state is None else conv_state[None]
    B, T, C = x.shape
    Cw, K = weight.shape
    assert Cw == C, f"weight has {Cw} channels, x has {C}"
    if conv_state is None:
        conv_state = x.new_zeros(B, C, K - 1)
    assert conv_state.shape == (B, C, K - 1), f"conv_state {tuple(conv_state.shape)} != {(B, C, K - 1)}"

    # [B, C, K-1+T], oldest first: the left context followed by this piece.
    ctx = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=2)
    new_state = ctx[..., T:].contiguous()
    if T == 0:
        y = x.new_empty(B, 0, C)
    else:
        # Valid (unpadded) conv over the context gives exactly T outputs:
        # out[t, c] = sum_j weight[c, j] * ctx[c, t + j].
        y = F.silu(F.conv1d(ctx.to(weight.dtype), weight.unsqueeze(1), bias, groups=C)).transpose(1, 2).to(x.dtype)
    return (y, new_state) if batched else (y[0], new_state[0])


# --------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------
def l2_normalize(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """``x * rsqrt(sum(x*x, -1) + eps)`` over the last dim (eps is inside the rsqrt)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _check_gdr_shapes(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
) -> tuple[int, int, int, int]:
    assert q.dim() == 3 and q.shape == k.shape, (q.shape, k.shape)
    T, HV, Dk = q.shape
    assert v.dim() == 3 and v.shape[:2] == (T, HV), f"v {tuple(v.shape)} vs q {tuple(q.shape)}"
    Dv = v.shape[2]
    assert g.shape == (T, HV) and beta.shape == (T, HV), (g.shape, beta.shape)
    if initial_state is not None:
        assert initial_state.shape == (HV, Dk, Dv), (
            f"initial_state {tuple(initial_state.shape)} != {(HV, Dk, Dv)}"
        )
    return T, HV, Dk, Dv


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32, head-major ([HV, T, ...]) copies; q/k L2-normalised, q scaled by Dk**-0.5."""
    qf, kf, vf = (t.transpose(0, 1).to(acc_dtype(q)) for t in (q, k, v))
    gf, bf = (t.transpose(0, 1).to(acc_dtype(q)) for t in (g, beta))
    qf = l2_normalize(qf) * (qf.shape[-1] ** -0.5)
    kf = l2_normalize(kf)
    return qf, kf, vf, gf, bf


def _initial_state(initial_state: Tensor | None, HV: int, Dk: int, Dv: int, like: Tensor) -> Tensor:
    if initial_state is None:
        return like.new_zeros(HV, Dk, Dv, dtype=acc_dtype(like))
    # .to() may alias the caller's tensor; the algorithms below never write in place.
    return initial_state.to(device=like.device, dtype=acc_dtype(like))


def delta_rule_step(S: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor) -> Tensor:
    """One token of the gated delta rule on S [HV, Dk, Dv]: k [HV, Dk] (L2-normalised), v [HV, Dv],
    decay = exp(g) and beta [HV], all in S's dtype."""
    S = S * decay[:, None, None]
    pred = torch.einsum("hk,hkv->hv", k, S)  # what the state already predicts for k
    delta = (v - pred) * beta[:, None]
    return S + k[:, :, None] * delta[:, None, :]


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule (decode path). Same contract as ``gated_delta_rule``."""
    T, HV, Dk, Dv = _check_gdr_shapes(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    S = _initial_state(initial_state, HV, Dk, Dv, qf)  # [HV, Dk, Dv]
    decay = gf.exp()  # [HV, T]
    outs: list[Tensor] = []
    for t in range(T):
        S = delta_rule_step(S, kf[:, t], vf[:, t], decay[:, t], bf[:, t])
        outs.append(torch.einsum("hk,hkv->hv", qf[:, t], S))
    out = torch.stack(outs, dim=0) if outs else vf.new_empty(0, HV, Dv)  # [T, HV, Dv]
    return out.to(q.dtype), S


def gated_delta_rule_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) gated delta rule (prefill path). Same contract as
    ``gated_delta_rule``.

    Within a chunk of length L, with G = inclusive cumsum of g and S0 the state at the
    chunk start, the per-token corrections u_i = beta_i (v_i - S_{i-1}^T k_i) solve the
    unit lower-triangular system
        (I + A) u = beta*v - (beta*exp(G)*k) S0,   A_ij = beta_i (k_i.k_j) exp(G_i - G_j), j < i
    so u = U - W S0 with U = (I+A)^-1 beta*v and W = (I+A)^-1 beta*exp(G)*k. Then
        o_i  = exp(G_i) q_i^T S0 + sum_{j<=i} (q_i.k_j) exp(G_i - G_j) u_j
        S_L  = exp(G_L) S0 + sum_j exp(G_L - G_j) k_j u_j^T.
    A sequence shorter than ``chunk_size`` is handled as one chunk of its own length;
    otherwise the tail is zero-padded (g=0, beta=0, k=0 leave the state unchanged).
    """
    T, HV, Dk, Dv = _check_gdr_shapes(q, k, v, g, beta, initial_state)
    assert chunk_size > 0
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta)
    S = _initial_state(initial_state, HV, Dk, Dv, qf)
    if T == 0:
        return vf.new_empty(0, HV, Dv).to(q.dtype), S

    L = min(chunk_size, T)
    pad = (-T) % L
    if pad:
        qf, kf, vf = (F.pad(t, (0, 0, 0, pad)) for t in (qf, kf, vf))
        gf, bf = (F.pad(t, (0, pad)) for t in (gf, bf))
    N = (T + pad) // L

    # [HV, N, L, D] and [HV, N, L]
    qc, kc, vc = (t.reshape(HV, N, L, t.shape[-1]) for t in (qf, kf, vf))
    # Log-decays accumulate in fp64: with strong decay G reaches ~-1e3 inside a chunk, where fp32
    # rounding of G_i - G_j alone is ~1e-4, enough to make results depend on chunk boundaries.
    gc64 = gf.reshape(HV, N, L).double().cumsum(dim=-1)
    gc = gc64.to(qf.dtype)
    bc = bf.reshape(HV, N, L)

    # Pairwise decays exp(G_i - G_j) on and below the diagonal (masked before exp: the
    # upper triangle would be exp(positive) and could overflow).
    diff = gc64[..., :, None] - gc64[..., None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=qf.device).tril()
    decay_ij = diff.masked_fill(~causal, float("-inf")).exp().to(qf.dtype)  # [HV, N, L, L]

    kb = kc * bc[..., None]
    strict = torch.ones(L, L, dtype=torch.bool, device=qf.device).tril(-1)
    A = ((kb @ kc.transpose(-1, -2)) * decay_ij).masked_fill(~strict, 0.0)
    eye = torch.eye(L, dtype=A.dtype, device=A.device)
    rhs = torch.cat([vc * bc[..., None], kb * gc.exp()[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    U, W = sol[..., :Dv], sol[..., Dv:]  # [HV, N, L, Dv], [HV, N, L, Dk]

    attn = (qc @ kc.transpose(-1, -2)) * decay_ij  # intra-chunk, causal incl. diagonal
    q_dec = qc * gc.exp()[..., None]  # reads S0 decayed to position i
    k_dec = kc * (gc64[..., -1:] - gc64).exp().to(qf.dtype)[..., None]  # contribution decayed to chunk end
    chunk_decay = gc[..., -1].exp()  # [HV, N]

    out = vf.new_empty(HV, N, L, Dv)
    for n in range(N):
        u = U[:, n] - W[:, n] @ S  # [HV, L, Dv]
        out[:, n] = q_dec[:, n] @ S + attn[:, n] @ u
        S = S * chunk_decay[:, n, None, None] + k_dec[:, n].transpose(-1, -2) @ u

    out = out.reshape(HV, N * L, Dv)[:, :T].transpose(0, 1)
    return out.to(q.dtype), S


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    use_chunked: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over one sequence.

    Args:
        q, k: [T, HV, Dk] (already repeated from key heads to value heads); L2-normalised
            here (eps 1e-6), q additionally scaled by Dk**-0.5.
        v: [T, HV, Dv].
        g: [T, HV] log decay, must be <= 0 (not checked: no host sync).
        beta: [T, HV] write strength, usually in (0, 1).
        initial_state: [HV, Dk, Dv] state before the first token (fp32; other dtypes are
            upcast), or None for zeros. Never modified in place.
        chunk_size: chunk length for the chunked algorithm.
        use_chunked: force the algorithm; None picks the recurrence for
            T <= RECURRENT_MAX_TOKENS and the chunked form otherwise.

    Returns:
        out: [T, HV, Dv] in ``q.dtype`` (computed in fp32).
        final_state: [HV, Dk, Dv] fp32 state after the last token.
    """
    if use_chunked is None:
        use_chunked = q.shape[0] > RECURRENT_MAX_TOKENS
    if use_chunked:
        return gated_delta_rule_chunked(q, k, v, g, beta, initial_state, chunk_size=chunk_size)
    return gated_delta_rule_recurrent(q, k, v, g, beta, initial_state)


# --------------------------------------------------------------------------------------
# Output norm and gates
# --------------------------------------------------------------------------------------
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3-Next ``RMSNormGated``: ``weight * rmsnorm(x) * silu(gate)``, norm before gate.

    Args:
        x: [..., D] (typically the delta-rule output per value head).
        gate: [..., D] (the ``z`` projection).
        weight: [D] plain scale (initialised to ones; NOT the ``1 + w`` form).
        eps: added to the mean square inside the rsqrt.

    Returns:
        [..., D] in ``x.dtype``. The norm runs in fp32, is cast to ``x.dtype`` before the
        weight multiply (so with a bf16 x and bf16 weight the weight is applied in bf16;
        with an fp32 weight type promotion makes it fp32), and silu(gate) is applied in fp32.
    """
    assert x.shape == gate.shape and weight.shape == x.shape[-1:], (x.shape, gate.shape, weight.shape)
    in_dtype = x.dtype
    xf = x.to(acc_dtype(x))
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = weight * xf.to(in_dtype)
    y = y * F.silu(gate.to(acc_dtype(x)))
    return y.to(in_dtype)


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """Decay and write-strength gates from the ``a`` / ``b`` projections.

    Args:
        a, b: [T, HV] projection outputs.
        A_log: [HV], dt_bias: [HV] layer parameters.

    Returns:
        g: [T, HV] fp32, ``-exp(A_log) * softplus(a + dt_bias)`` (<= 0), all in fp32
            (an fp16 exp(A_log) could overflow to inf).
        beta: [T, HV] ``sigmoid(b)`` in ``b.dtype`` (the delta rule upcasts it to fp32).
    """
    assert a.shape == b.shape and a.shape[-1:] == A_log.shape == dt_bias.shape
    acc = acc_dtype(a)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
    beta = torch.sigmoid(b)
    return g, beta


def record_width(hk: int, dk: int, hv: int, dv: int) -> int:
    """Values one verify token records per GDN layer (the rollback's replay input): k after the
    conv, SiLU and L2 norm, per k-head [HK * Dk] | v after the conv and SiLU [HV * Dv] | g [HV] |
    beta [HV], all as the delta rule used them (fp32). 25 KB on the 35B shape, where the state the
    rollback rebuilds from them is 2 MiB."""
    return hk * dk + hv * dv + 2 * hv


def verify_record(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, hk: int, batch: int = 1) -> Tensor:
    """One request's verify record [T, ``record_width``] from the delta rule's inputs (q, k [T, HV,
    Dk] repeated from ``hk`` k-heads, v [T, HV, Dv], g, beta [T, HV]), in the accumulation dtype:
    the values ``gated_delta_rule_recurrent`` computes with. With ``batch`` B the heads are B
    requests' (request-major, B x HV) and the rows come request-major too: [B * T, record_width]."""
    _, kf, vf, gf, bf = _prepare(q, k, v, g, beta)  # [B * HV, T, ...]
    T, HV = g.shape[0], g.shape[1] // batch

    def rows(x: Tensor, stride: int = 1) -> Tensor:  # [B * HV, T, ...] -> [B, T, heads * ...]
        x = x.reshape(batch, HV, T, -1)[:, ::stride]
        return x.transpose(1, 2).reshape(batch, T, -1)

    # k: the repeat's first copy of each k-head
    parts = [rows(kf, HV // hk), rows(vf), rows(gf), rows(bf)]
    return torch.cat(parts, dim=2).reshape(batch * T, -1)


def rollback_states(conv: Tensor, ssm: Tensor, rec_tokens: Tensor, rec_windows: Tensor, slots: Tensor,
                    accepted: Tensor, n: int) -> None:
    """After a verify of n tokens per request, which left the states in the slots as they were
    before it and recorded each token's delta-rule inputs: set each request's states to those after
    its verify token ``accepted[b]``, every layer, by replaying tokens 0..accepted[b] from the slot's
    state (no host sync: later tokens are masked). conv [L, slots, C, K-1], ssm [L, slots, HV, Dk,
    Dv], rec_tokens [L, >= B*n, record_width] (request b's token t at row b*n + t), rec_windows
    [L, >= B, K-1+n, C] (the old context then the inputs); slots, accepted [B] device tensors."""
    B = slots.shape[0]
    HV, DK, DV = ssm.shape[2:]
    HK = (rec_tokens.shape[-1] - HV * DV - 2 * HV) // DK

    def step(S: Tensor, row: Tensor) -> Tensor:
        k, v, g, beta = row.split([HK * DK, HV * DV, HV, HV], dim=-1)
        k = k.reshape(B, HK, DK).repeat_interleave(HV // HK, dim=1).view(B * HV, DK)
        return delta_rule_step(S, k, v.reshape(B * HV, DV), g.exp().flatten(), beta.flatten())

    replay_states(ssm, rec_tokens, slots, accepted, n, step)
    rollback_conv(conv, rec_windows, slots, accepted)


def replay_states(ssm: Tensor, rec_tokens: Tensor, slots: Tensor, accepted: Tensor, n: int, step) -> None:
    """The state half of a rollback (every recurrent kind's): ssm [L, slots, H, ...] of ``slots``
    [B] advanced by ``step(S [B * H, ...], record rows [B, record_width])`` through each request's
    recorded tokens 0..accepted[b] (later ones masked: no host sync). The B requests' heads run
    side by side; each head's arithmetic is its own."""
    B, H = slots.shape[0], ssm.shape[2]
    for l in range(ssm.shape[0]):
        S = ssm[l, slots].to(rec_tokens.dtype).flatten(0, 1)
        rows = rec_tokens[l, : B * n].view(B, n, -1)
        for t in range(n):
            S = torch.where((t <= accepted).repeat_interleave(H).view(-1, *[1] * (S.dim() - 1)), step(S, rows[:, t]), S)
        ssm[l, slots] = S.view(B, *ssm.shape[2:]).to(ssm.dtype)


def rollback_conv(conv: Tensor, rec_windows: Tensor, slots: Tensor, accepted: Tensor) -> None:
    """The conv half of a rollback (every recurrent layer kind's): conv [L, slots, C, K-1] of
    ``slots`` [B] to the K-1 inputs ending at verify token ``accepted[b]``, read from the verify's
    windows [L, >= B, K-1+n, C] (the old context, then the n inputs)."""
    B, k1 = slots.shape[0], conv.shape[-1]
    # conv state after token a = the K-1 inputs ending at window row a + K-1
    idx = (accepted[:, None] + 1 + torch.arange(k1, device=accepted.device))[None, :, :, None]
    win = rec_windows[:, :B]
    conv[:, slots] = win.gather(2, idx.expand(win.shape[0], B, k1, win.shape[-1])).transpose(2, 3).to(conv.dtype)
