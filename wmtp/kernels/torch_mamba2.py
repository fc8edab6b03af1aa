"""Mamba2 (SSD) in plain PyTorch: the reference the Nemotron-H mixers run on the CPU and the twin of
the GPU kernels (DESIGN §10).

Per head h (H heads of P channels, sharing the B / C of group h // (H / G) of G groups of N):
    dt_t  = clamp(softplus(dt_raw_t + dt_bias), dt_min, dt_max)        (the config's time-step limit)
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * x_t ⊗ B_t                 S [H, P, N], A = -exp(A_log) < 0
    y_t   = S_t @ C_t + D * x_t
``ssd_recurrent`` runs that token by token (decode, verify, and the replay of a rollback,
``ssd_step``); ``ssd_chunked`` runs it in chunks of L tokens (prefill): within a chunk, with the inclusive cumulative
log-decay c_t = sum_{s<=t} dt_s A,
    y_t = exp(c_t) * S_prev @ C_t + sum_{s<=t} exp(c_t - c_s) (C_t . B_s) dt_s x_s + D x_t
    S   = exp(c_L) * S_prev + sum_s exp(c_L - c_s) dt_s x_s ⊗ B_s,
the same sums in another order. Both accumulate in fp32 (fp64 for fp64 inputs) and return fp32
states. The mixer's conv is ``torch_gdn.causal_conv1d`` (with its bias); its output norm is
``gated_group_rms_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from wmtp.kernels.common import acc_dtype
from wmtp.kernels.torch_gdn import RECURRENT_MAX_TOKENS, replay_states, rollback_conv


def ssd_gates(dt_raw: Tensor, dt_bias: Tensor, A_log: Tensor, dt_limit: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """(dt [T, H], A [H]) in fp32 / fp64 from the projection's dt [T, H] and the layer's parameters."""
    f = acc_dtype(dt_raw)
    dt = F.softplus(dt_raw.to(f) + dt_bias.to(f)).clamp(dt_limit[0], dt_limit[1])
    return dt, -torch.exp(A_log.to(f))


def _heads(t: Tensor, heads: int) -> Tensor:
    """[T, G, N] group vectors -> [T, H, N], head h taking group h // (H / G)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _check(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, state: Tensor | None) -> tuple[int, int, int, int]:
    T, H, P = x.shape
    G, N = B.shape[1:]
    if dt.shape != (T, H) or B.shape != (T, G, N) or C.shape != B.shape or H % G:
        raise ValueError(f"ssd: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)} "
                         f"must be [T, H, P], [T, H], [T, G, N], [T, G, N] with G dividing H")
    if state is not None and state.shape != (H, P, N):
        raise ValueError(f"ssd: state {tuple(state.shape)} must be [{H}, {P}, {N}]")
    return T, H, P, N


def _start(state: Tensor | None, H: int, P: int, N: int, like: Tensor) -> Tensor:
    f = acc_dtype(like)
    return like.new_zeros(H, P, N, dtype=f) if state is None else state.to(device=like.device, dtype=f)


def ssd_step(S: Tensor, x: Tensor, dt: Tensor, decay: Tensor, B: Tensor) -> Tensor:
    """One token on S [H, P, N]: x [H, P], dt and decay = exp(dt * A) [H], B [H, N] (each head's
    group vector), all in S's dtype."""
    return S * decay[:, None, None] + (dt[:, None] * x)[:, :, None] * B[:, None, :]


def ssd_recurrent(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                  state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token by token. x [T, H, P]; dt [T, H] (gated, ``ssd_gates``); A, D [H]; B, C [T, G, N];
    state [H, P, N] or None (zeros). Returns (y [T, H, P] in x's dtype, the state after the last
    token, fp32)."""
    T, H, P, N = _check(x, dt, B, C, state)
    f = acc_dtype(x)
    S = _start(state, H, P, N, x)
    xf, dtf, Bh, Ch = x.to(f), dt.to(f), _heads(B.to(f), H), _heads(C.to(f), H)
    ys = []
    for t in range(T):
        S = ssd_step(S, xf[t], dtf[t], torch.exp(dtf[t] * A.to(f)), Bh[t])
        ys.append(torch.einsum("hpn,hn->hp", S, Ch[t]) + D.to(f)[:, None] * xf[t])
    y = torch.stack(ys) if ys else xf.new_empty(0, H, P)
    return y.to(x.dtype), S


def ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, chunk: int,
                state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``ssd_recurrent``'s contract, ``chunk`` tokens at a time (module docstring)."""
    T, H, P, N = _check(x, dt, B, C, state)
    f = acc_dtype(x)
    S = _start(state, H, P, N, x)
    xf, dtf, Bh, Ch, Af = x.to(f), dt.to(f), _heads(B.to(f), H), _heads(C.to(f), H), A.to(f)
    ys = []
    for lo in range(0, T, chunk):
        xs, ds, bs, cs = xf[lo:lo + chunk], dtf[lo:lo + chunk], Bh[lo:lo + chunk], Ch[lo:lo + chunk]
        L = xs.shape[0]
        cum = torch.cumsum(ds * Af, dim=0)  # [L, H], inclusive
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        gap = torch.where(causal[:, :, None], cum[:, None, :] - cum[None, :, :], float("-inf"))  # [t, s, H]
        weights = torch.exp(gap) * torch.einsum("thn,shn->tsh", cs, bs) * ds[None, :, :]
        y = torch.einsum("tsh,shp->thp", weights, xs)
        y = y + torch.exp(cum)[:, :, None] * torch.einsum("hpn,thn->thp", S, cs)
        ys.append(y + D.to(f)[None, :, None] * xs)
        tail = torch.exp(cum[-1][None, :] - cum) * ds  # [L, H]: each token's weight in the chunk's end state
        S = torch.exp(cum[-1])[:, None, None] * S + torch.einsum("sh,shp,shn->hpn", tail, xs, bs)
    y = torch.cat(ys) if ys else xf.new_empty(0, H, P)
    return y.to(x.dtype), S


def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, chunk: int,
        state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``ssd_recurrent`` for T <= ``RECURRENT_MAX_TOKENS`` (decode), ``ssd_chunked`` above (prefill)."""
    if x.shape[0] <= RECURRENT_MAX_TOKENS:
        return ssd_recurrent(x, dt, A, B, C, D, state)
    return ssd_chunked(x, dt, A, B, C, D, chunk, state)


def record_width(heads: int, head_dim: int, groups: int, state: int) -> int:
    """fp32 values one verify token records per Mamba2 layer (the rollback's replay input): x after
    the conv and SiLU [H * P] | B [G * N] | dt [H] | exp(dt * A) [H], as ``ssd_step`` used them."""
    return heads * head_dim + groups * state + 2 * heads


def verify_record(x: Tensor, dt: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """One request's verify record [T, ``record_width``] (fp32 / fp64) from the SSD inputs x [T, H, P],
    dt [T, H] (gated), A [H], B [T, G, N]."""
    f = acc_dtype(x)
    dtf = dt.to(f)
    return torch.cat([x.to(f).flatten(1), B.to(f).flatten(1), dtf, torch.exp(dtf * A.to(f))], dim=1)


def rollback_states(conv: Tensor, ssm: Tensor, rec_tokens: Tensor, rec_windows: Tensor, slots: Tensor,
                    accepted: Tensor, n: int) -> None:
    """``torch_gdn.rollback_states`` for Mamba2 layers: each request's states (as before a verify of
    n tokens) to those after its verify token ``accepted[b]``, replaying tokens 0..accepted[b] with
    ``ssd_step`` (later tokens masked: no host sync). conv [L, slots, C, K-1], ssm [L, slots, H, P,
    N], rec_tokens [L, >= B*n, record_width] (request b's token t at row b*n + t), rec_windows [L,
    >= B, K-1+n, C]; slots, accepted [B] device tensors."""
    B = slots.shape[0]
    H, P, N = ssm.shape[2:]
    G = (rec_tokens.shape[-1] - H * P - 2 * H) // N

    def step(S: Tensor, row: Tensor) -> Tensor:
        x, Bg, dt, decay = row.split([H * P, G * N, H, H], dim=-1)
        return ssd_step(S, x.reshape(B * H, P), dt.flatten(), decay.flatten(), _heads(Bg.reshape(B, G, N), H).view(B * H, N))

    replay_states(ssm, rec_tokens, slots, accepted, n, step)
    rollback_conv(conv, rec_windows, slots, accepted)


def gated_group_rms_norm(y: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float) -> Tensor:
    """``weight * rmsnorm_g(y * silu(z))`` with the RMS taken over each group of ``group_size``
    channels (Mamba2's output norm, gate before norm); computed in fp32, returned in y's dtype."""
    f = acc_dtype(y)
    h = y.to(f) * F.silu(z.to(f))
    g = h.view(*h.shape[:-1], -1, group_size)
    h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)
    return weight * h.to(y.dtype)
