"""Triton recurrent gated delta rule for decode / verify (a few tokens per request).

One program owns (request, value head, block of value dims): it keeps that slice of the recurrent
state [Dk, BLOCK_V] in registers, runs the request's tokens through the delta rule (same math as
``torch_gdn.gated_delta_rule_recurrent``: q, k L2-normalised in-kernel, q scaled by Dk**-0.5), and
writes the state back to its pool slot. The gates g, beta are computed in-kernel from the raw ``a``,
``b`` projections (``torch_gdn.gdn_gates``' math), which saves the separate gates launch per layer.
With ``record`` it also writes the state after every token, which is what the engine rolls back to
after a partially accepted verify. All requests of a forward run in one launch; nothing syncs with
the host. The twin is ``TorchBackend.gated_delta_net``.
"""

from __future__ import annotations

import math

import torch

from wmtp.kernels.torch_gdn import L2NORM_EPS

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Longer pieces (prefill chunks) go to the chunked reference / fla path.
MAX_RECURRENT_TOKENS = 16

if triton is not None:

    @triton.jit
    def _gate_values(a, b, a_log, dt_bias):
        """``torch_gdn.gdn_gates`` elementwise: g = -exp(A_log) * softplus(a + dt_bias) in fp32 and
        beta = sigmoid(b) rounded to b's dtype (what the reference hands the delta rule)."""
        x = a.to(tl.float32) + dt_bias.to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
        g = -tl.exp(a_log.to(tl.float32)) * softplus
        beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
        return g, beta.to(b.dtype)

    @triton.jit
    def _token_inputs(Q, K, V, A, B, row, live, hk, h, R, ks, vs, v_ok, stride_qt, stride_qh, stride_vt, stride_vh,
                      stride_at, stride_ag, stride_bt, stride_bg):
        """One token's q, k [DK], v [BLOCK_V] and raw gates a, b for v-head h (zeros where not ``live``)."""
        q = tl.load(Q + row * stride_qt + hk * stride_qh + ks, mask=live & (ks >= 0), other=0.0)
        k = tl.load(K + row * stride_qt + hk * stride_qh + ks, mask=live & (ks >= 0), other=0.0)
        v = tl.load(V + row * stride_vt + h * stride_vh + vs, mask=live & v_ok, other=0.0)
        a = tl.load(A + row * stride_at + (h // R) * stride_ag + h % R, mask=live, other=0.0)
        b = tl.load(B + row * stride_bt + (h // R) * stride_bg + h % R, mask=live, other=0.0)
        return q, k, v, a, b

    @triton.jit
    def _gdn_recurrent_kernel(Q, K, V, A, B, A_LOG, DT_BIAS, STATE, SLOTS, TOK_OFF, Q_LEN, O, REC,
                              HV, R, stride_qt, stride_qh, stride_vt, stride_vh, stride_at, stride_ag, stride_bt,
                              stride_bg, stride_ss, stride_sh, scale, eps, GROUP: tl.constexpr, DK: tl.constexpr,
                              DV: tl.constexpr, BLOCK_V: tl.constexpr, RECORD: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        off = tl.load(TOK_OFF + b).to(tl.int32)  # int64 from the graphs' staging: keep index math 32-bit
        n = tl.load(Q_LEN + b).to(tl.int32)
        ks = tl.arange(0, DK)
        vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = vs < DV
        a_log = tl.load(A_LOG + h)
        dt_bias = tl.load(DT_BIAS + h)
        # Token t + 1's inputs are loaded while token t computes: the tokens form a dependent chain,
        # so an unprefetched load's latency would be paid once per token.
        q_n, k_n, v_n, a_n, b_n = _token_inputs(Q, K, V, A, B, off, n > 0, h // GROUP, h, R, ks, vs, v_ok, stride_qt,
                                                stride_qh, stride_vt, stride_vh, stride_at, stride_ag, stride_bt,
                                                stride_bg)
        s_ptr = STATE + slot * stride_ss + h * stride_sh + ks[:, None] * DV + vs[None, :]
        S = tl.load(s_ptr, mask=v_ok[None, :], other=0.0).to(tl.float32)
        for t in range(0, n):
            row = off + t
            q, k, v, a, bt = q_n, k_n, v_n, a_n, b_n
            q_n, k_n, v_n, a_n, b_n = _token_inputs(Q, K, V, A, B, row + 1, t + 1 < n, h // GROUP, h, R, ks, vs, v_ok,
                                                    stride_qt, stride_qh, stride_vt, stride_vh, stride_at, stride_ag,
                                                    stride_bt, stride_bg)
            g, beta = _gate_values(a, bt, a_log, dt_bias)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
            S = S * tl.exp(g)
            pred = tl.sum(k[:, None] * S, 0)  # what the state already predicts for k
            delta = (v.to(tl.float32) - pred) * beta.to(tl.float32)
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(q[:, None] * S, 0)
            tl.store(O + row * (HV * DV) + h * DV + vs, o.to(O.dtype.element_ty), mask=v_ok)
            if RECORD:
                r_ptr = REC + row.to(tl.int64) * (HV * DK * DV) + h * (DK * DV) + ks[:, None] * DV + vs[None, :]
                tl.store(r_ptr, S, mask=v_ok[None, :])
        tl.store(s_ptr, S.to(STATE.dtype.element_ty), mask=v_ok[None, :])

    @triton.jit
    def _gates_kernel(A, B, A_LOG, DT_BIAS, G_OUT, BETA_OUT, HV, R, stride_at, stride_ag, stride_bt, stride_bg,
                      BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hs = tl.arange(0, BLOCK_H)
        ok = hs < HV
        a = tl.load(A + t * stride_at + (hs // R) * stride_ag + hs % R, mask=ok, other=0.0)
        b = tl.load(B + t * stride_bt + (hs // R) * stride_bg + hs % R, mask=ok, other=0.0)
        g, beta = _gate_values(a, b, tl.load(A_LOG + hs, mask=ok, other=0.0), tl.load(DT_BIAS + hs, mask=ok, other=0.0))
        tl.store(G_OUT + t * HV + hs, g, mask=ok)
        tl.store(BETA_OUT + t * HV + hs, beta.to(BETA_OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _conv_update_kernel(X, W, STATE, SLOTS, TOK_OFF, Q_LEN, OUT, WIN, C, stride_xt, stride_ss, win_rows,
                            BLOCK_C: tl.constexpr, RECORD: tl.constexpr):
        """Kernel size 4: out[t] = silu(w0 x[t-3] + w1 x[t-2] + w2 x[t-1] + w3 x[t]) per channel,
        the left context read from / written back to the request's conv-state slot."""
        b = tl.program_id(0)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cs < C
        slot = tl.load(SLOTS + b).to(tl.int64)
        off = tl.load(TOK_OFF + b).to(tl.int32)
        n = tl.load(Q_LEN + b).to(tl.int32)
        w0 = tl.load(W + cs * 4 + 0, mask=ok, other=0.0).to(tl.float32)
        w1 = tl.load(W + cs * 4 + 1, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(W + cs * 4 + 2, mask=ok, other=0.0).to(tl.float32)
        w3 = tl.load(W + cs * 4 + 3, mask=ok, other=0.0).to(tl.float32)
        s_ptr = STATE + slot * stride_ss + cs * 3
        h3 = tl.load(s_ptr + 0, mask=ok, other=0.0)  # oldest first
        h2 = tl.load(s_ptr + 1, mask=ok, other=0.0)
        h1 = tl.load(s_ptr + 2, mask=ok, other=0.0)
        if RECORD:
            wb = WIN + b.to(tl.int64) * win_rows * C + cs
            tl.store(wb, h3.to(WIN.dtype.element_ty), mask=ok)
            tl.store(wb + C, h2.to(WIN.dtype.element_ty), mask=ok)
            tl.store(wb + 2 * C, h1.to(WIN.dtype.element_ty), mask=ok)
        for t in range(0, n):
            row = (off + t).to(tl.int64)
            x = tl.load(X + row * stride_xt + cs, mask=ok, other=0.0)
            y = w0 * h3.to(tl.float32) + w1 * h2.to(tl.float32) + w2 * h1.to(tl.float32) + w3 * x.to(tl.float32)
            y = y.to(W.dtype.element_ty).to(tl.float32)  # the reference convolves in the weight dtype
            y = y / (1.0 + tl.exp(-y))
            tl.store(OUT + row * C + cs, y.to(OUT.dtype.element_ty), mask=ok)
            if RECORD:
                tl.store(wb + (3 + t) * C, x.to(WIN.dtype.element_ty), mask=ok)
            h3, h2, h1 = h2, h1, x.to(h1.dtype)
        tl.store(s_ptr + 0, h3, mask=ok)
        tl.store(s_ptr + 1, h2, mask=ok)
        tl.store(s_ptr + 2, h1, mask=ok)


    @triton.jit
    def _rollback_kernel(CONV, SSM, REC, WIN, SLOTS, ACC, B, n, N, C, win_rows, stride_cl, stride_cs, stride_sl,
                         stride_ss, stride_rl, stride_wl, SSM_BLOCKS, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                         KM1: tl.constexpr):
        """Program (layer * B + b, j): block j of request b's recorded state after its accepted token
        -> its ssm slot; programs past the ssm blocks copy the conv window rows."""
        lb = tl.program_id(0)
        j = tl.program_id(1)
        l = (lb // B).to(tl.int64)
        b = lb % B
        slot = tl.load(SLOTS + b).to(tl.int64)
        a = tl.load(ACC + b).to(tl.int64)
        if j < SSM_BLOCKS:  # (branch-local names: Triton types each name once across both branches)
            offs = j * BLOCK + tl.arange(0, BLOCK)
            s_ok = offs < N
            s = tl.load(REC + l * stride_rl + (b * n + a) * N + offs, mask=s_ok)
            tl.store(SSM + l * stride_sl + slot * stride_ss + offs, s, mask=s_ok)
        else:
            cs = (j - SSM_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
            c_ok = cs < C
            src = WIN + l * stride_wl + (b * win_rows + a + 1) * C + cs
            dst = CONV + l * stride_cl + slot * stride_cs + cs * KM1
            for r in tl.static_range(KM1):
                w = tl.load(src + r * C, mask=c_ok)
                tl.store(dst + r, w.to(CONV.dtype.element_ty), mask=c_ok)

def _check_gate_views(op: str, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                      ) -> int:
    """Validates the gate inputs of ``op``: a, b [T, G, R] with unit last stride (v-head h at
    ``[:, h // R, h % R]``), A_log, dt_bias [G * R]. Returns R."""
    views_ok = a.dim() == 3 and b.shape == a.shape and a.stride(2) == 1 and b.stride(2) == 1
    if not views_ok or A_log.shape != (a.shape[1] * a.shape[2],) or dt_bias.shape != A_log.shape:
        raise ValueError(f"{op}: a {tuple(a.shape)}, b {tuple(b.shape)} must be [T, G, R] views with unit last "
                         f"stride and A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} [G * R]")
    return a.shape[2]


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_gdn.gdn_gates`` (its twin) in one launch, for the chunked (prefill) path; decode /
    verify compute the gates inside ``gdn_recurrent``. a, b: [T, G, R] with v-head h at
    ``[:, h // R, h % R]`` (strided views of the fused ``ba`` projection are fine: no copies).
    Returns g [T, HV] fp32 and beta [T, HV] in b's dtype."""
    R = _check_gate_views("gdn_gates", a, b, A_log, dt_bias)
    T, HV = a.shape[0], A_log.shape[0]
    g = torch.empty(T, HV, device=a.device, dtype=torch.float32)
    beta = torch.empty(T, HV, device=a.device, dtype=b.dtype)
    if T:
        _gates_kernel[(T,)](a, b, A_log, dt_bias, g, beta, HV, R, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            BLOCK_H=triton.next_power_of_2(HV))
    return g, beta


def conv_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                tok_off: torch.Tensor, q_len: torch.Tensor, record_len: int | None = None,
                window_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv (kernel 4) + SiLU over every request's rows of ``x`` [T, C] (rows may be
    strided) in one
    launch: request b owns rows ``tok_off[b] ..`` (``q_len[b]`` of them, device tensors) and its
    left context is ``conv_state[slots[b]]`` [C, 3], updated in place. With ``record_len`` n
    (every request has n rows: a verify) also returns the windows [B, 3 + n, C] (old context, then
    the inputs) that the rollback reads, written into ``window_into[:B]`` when given (the engine's
    preallocated verify record). Twin: ``torch_gdn.causal_conv1d`` per request."""
    T, C = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()  # rows may be strided (a view into the packed input projection), channels not
    if weight.shape != (C, 4) or conv_state.shape[1:] != (C, 3) or not conv_state.is_contiguous():
        raise ValueError(f"conv_update: weight {tuple(weight.shape)} must be [{C}, 4] and conv_state "
                         f"{tuple(conv_state.shape)} a contiguous [slots, {C}, 3] (kernel size 4 only)")
    B = slots.shape[0]
    out = torch.empty(T, C, device=x.device, dtype=x.dtype)
    win = None
    if record_len is not None and window_into is not None:
        if window_into.shape[0] < B or window_into.shape[1:] != (3 + record_len, C):
            raise ValueError(f"conv_update: window_into {tuple(window_into.shape)} cannot hold {B} windows of "
                             f"[{3 + record_len}, {C}]")
        win = window_into[:B]
    elif record_len is not None:
        win = torch.empty(B, 3 + record_len, C, device=x.device, dtype=conv_state.dtype)
    block_c = 256
    _conv_update_kernel[(B, triton.cdiv(C, block_c))](
        x, weight.contiguous(), conv_state, slots, tok_off, q_len, out, out if win is None else win,
        C, x.stride(0), conv_state.stride(0), 3 + (record_len or 0), BLOCK_C=block_c, RECORD=win is not None)
    return out, win


def gdn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, tok_off: torch.Tensor, q_len: torch.Tensor,
    record: bool, record_into: torch.Tensor | None = None, block_v: int = 16, num_warps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k [T, HK, Dk] (v-head h reads k-head h // (HV / HK); strided views of the conv output are
    fine, they share strides); v [T, HV, Dv]; a, b [T, G, R] and A_log, dt_bias [HV] the gate inputs
    as ``gdn_gates`` takes them (g, beta are computed per token and head in-kernel, same math and
    rounding); request b owns rows ``tok_off[b] .. tok_off[b] + q_len[b] - 1`` (int32 device tensors
    [B], so nothing is read on the host: graph-capturable) and updates ``ssm_state[slots[b]]`` in
    place. Returns o [T, HV, Dv] and, with ``record``, the fp32 state after every token
    [T, HV, Dk, Dv] (written to ``record_into[:T]`` when given: the engine's preallocated verify
    states). ``block_v`` (a power of 2) is the value dims per program: smaller means more programs
    (B * HV * Dv / block_v) over the same state bytes; ``num_warps`` per program. Defaults from
    ``benchmarks/tune_gdn.py`` on the H200 (35B shape; tuning/tune_gdn_s7.json): 16 x 1 warp, 7.6
    us for a d = 7 verify (10.8 us at 4 warps), 3.1 us for one token."""
    T, HK, DK = q.shape
    HV, DV = v.shape[1:]
    if DK & (DK - 1) or ssm_state.shape[1:] != (HV, DK, DV) or not ssm_state.is_contiguous() or HV % HK:
        raise ValueError(f"gdn_recurrent: Dk={DK} must be a power of 2, v heads {HV} a multiple of k heads {HK} and "
                         f"ssm_state {tuple(ssm_state.shape)} a contiguous [slots, {HV}, {DK}, {DV}]")
    if k.shape != q.shape or k.stride() != q.stride() or q.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"gdn_recurrent: q {tuple(q.shape)} and k {tuple(k.shape)} must share shape and strides, "
                         "with unit stride on the head dim (v too)")
    R = _check_gate_views("gdn_recurrent", a, b, A_log, dt_bias)
    if a.shape[0] != T or A_log.shape != (HV,) or block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"gdn_recurrent: gates a {tuple(a.shape)} / A_log {tuple(A_log.shape)} must cover {T} "
                         f"tokens x {HV} v heads; block_v={block_v} must be a power of 2")
    o = torch.empty(T, HV, DV, device=q.device, dtype=q.dtype)
    if not record:
        rec = o  # unused
    elif record_into is not None:
        if record_into.shape[0] < T or record_into.shape[1:] != (HV, DK, DV) or record_into.dtype != torch.float32:
            raise ValueError(f"gdn_recurrent: record_into {tuple(record_into.shape)} {record_into.dtype} cannot hold "
                             f"{T} fp32 states of [{HV}, {DK}, {DV}]")
        rec = record_into[:T]
    else:
        rec = torch.empty(T, HV, DK, DV, device=q.device, dtype=torch.float32)
    block_v = min(block_v, triton.next_power_of_2(DV))
    _gdn_recurrent_kernel[(slots.shape[0], HV, triton.cdiv(DV, block_v))](
        q, k, v, a, b, A_log, dt_bias, ssm_state, slots, tok_off, q_len, o, rec,
        HV, R, q.stride(0), q.stride(1), v.stride(0), v.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), DK**-0.5, L2NORM_EPS,
        GROUP=HV // HK, DK=DK, DV=DV, BLOCK_V=block_v, RECORD=record, num_warps=num_warps,
    )
    return o, rec if record else None


def fla_available(device: torch.device) -> bool:
    """flash-linear-attention's chunked kernels (optional ``gpu`` extra) run on CUDA devices."""
    if device.type != "cuda":
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gdn_chunked_fla(conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
                    ctx, dims: tuple[int, int, int, int, int]) -> torch.Tensor:
    """Prefill-sized pieces through fla's chunked gated delta rule (varlen over the requests of the
    forward; its GVA maps v-head h to k-head h // (HV / HK), as ``_gdn_heads`` repeats them).
    Starts from and updates ``ssm_state[ctx.state_slots]``. Returns o [T, HV, Dv]."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    hk, hv, dk, dv, _ = dims
    T = conv_out.shape[0]
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    cu_cpu = torch.tensor(ctx.token_offsets, dtype=torch.long)
    slots = ctx.state_slots
    o, final = chunk_gated_delta_rule(
        q.reshape(1, T, hk, dk), k.reshape(1, T, hk, dk), v.reshape(1, T, hv, dv), g[None].float(), beta[None],
        scale=dk**-0.5, initial_state=ssm_state[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_cpu.to(conv_out.device), cu_seqlens_cpu=cu_cpu,
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    return o[0]


def rollback_states(conv: torch.Tensor, ssm: torch.Tensor, rec_states: torch.Tensor, rec_windows: torch.Tensor,
                    slots: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
    """``torch_gdn.rollback_states`` (its twin) in one launch: each request's recorded state after
    its accepted token is copied straight into its slot, every layer at once (the reference's
    gather then scatter moves the bytes twice). Shapes as the twin's; all contiguous."""
    L, B = ssm.shape[0], slots.shape[0]
    N, C, km1 = math.prod(ssm.shape[2:]), conv.shape[2], conv.shape[3]
    shapes_ok = (rec_states.shape[0] == L and rec_states.shape[1] >= B * n and rec_states.shape[2:] == ssm.shape[2:]
                 and rec_windows.shape[0] == L and rec_windows.shape[1] >= B and rec_windows.shape[2:] == (km1 + n, C)
                 and conv.shape[0] == L and accepted.shape == slots.shape)
    if not shapes_ok or not all(t.is_contiguous() for t in (conv, ssm, rec_states, rec_windows)):
        raise ValueError(f"rollback_states: conv {tuple(conv.shape)}, ssm {tuple(ssm.shape)}, rec_states "
                         f"{tuple(rec_states.shape)}, rec_windows {tuple(rec_windows.shape)}, slots {tuple(slots.shape)}, "
                         f"accepted {tuple(accepted.shape)} disagree for {B} requests of {n} tokens (all contiguous)")
    if B == 0:
        return
    block, block_c = 4096, 1024
    ssm_blocks = triton.cdiv(N, block)
    _rollback_kernel[(L * B, ssm_blocks + triton.cdiv(C, block_c))](
        conv, ssm, rec_states, rec_windows, slots, accepted, B, n, N, C, km1 + n, conv.stride(0), conv.stride(1),
        ssm.stride(0), ssm.stride(1), rec_states.stride(0), rec_windows.stride(0), ssm_blocks,
        BLOCK=block, BLOCK_C=block_c, KM1=km1)
