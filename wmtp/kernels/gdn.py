"""Triton GDN mixer for decode / verify (a few tokens per request): conv + gated delta rule in one launch.

One program owns (request, value head, block of value dims). It convolves (kernel 4, SiLU) the
q, k and v channels it reads straight from the packed projection rows, keeping their left context
in registers, and keeps its slice of the recurrent state [Dk, BLOCK_V] in registers while the
request's tokens run through the delta rule (same math as ``torch_gdn.gated_delta_rule_recurrent``:
q, k L2-normalised in-kernel, q scaled by Dk**-0.5); then it writes the state and the conv context
back to the pool slot. The gates g, beta are computed in-kernel from the raw ``a``, ``b``
projections (``torch_gdn.gdn_gates``' math). So a GDN layer's decode costs one launch, not three.
With ``record`` (a verify) it leaves the slots' states as they were and records each token's
delta-rule inputs and the conv window instead; after acceptance ``rollback_states`` replays the
accepted tokens from the slot's state, all layers in one launch. Recording the state after every
token instead wrote 2 MiB per token and layer (14.7 MB per verify layer at d = 7 on the 35B shape,
0.44 GB of verify record per request) where the inputs are 25 KB. All requests of a forward run in one
launch; nothing syncs with the host. The twin is ``TorchBackend.gated_delta_net``.
"""

from __future__ import annotations

import importlib

import torch

from wmtp.kernels.common import arrival_counters, pdl
from wmtp.kernels.torch_gdn import L2NORM_EPS, record_width

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Longer pieces (prefill chunks) go to the chunked reference / fla path.
MAX_RECURRENT_TOKENS = 16
# gdn_decode's tile (value dims per program) and warps, fastest on the H200 (benchmarks/tune_gdn.py);
# the rollback's replay takes the same so its reductions, and so its states, are the verify's.
DECODE_BLOCK_V, DECODE_WARPS = 16, 1

if triton is not None:
    from wmtp.kernels.common import last_to_arrive, wait_prior

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
    def _delta_rule_step(S, k, v, g, beta):
        """One token of the gated delta rule on this program's [Dk, BLOCK_V] state slice (fp32):
        ``torch_gdn.delta_rule_step``. The verify and the rollback's replay both run it, at the same
        tile and warps, so the replayed state is the verify's: bit for bit on the CPU; on the GPU
        within an ulp or so (the two kernels' reductions may take different layouts)."""
        S = S * tl.exp(g)
        pred = tl.sum(k[:, None] * S, 0)  # what the state already predicts for k
        delta = (v - pred) * beta
        return S + k[:, None] * delta[None, :]

    @triton.jit
    def _token_inputs(X, A, B, row, live, cq, ck, cv, v_ok, h, R, stride_xt, stride_at, stride_ag, stride_bt, stride_bg):
        """One token's conv inputs (raw projection rows) for the q, k [DK] and v [BLOCK_V] channels,
        and its raw gates a, b for v-head h (zeros where not ``live``)."""
        x = X + row.to(tl.int64) * stride_xt
        xq = tl.load(x + cq, mask=live & (cq >= 0), other=0.0)
        xk = tl.load(x + ck, mask=live & (ck >= 0), other=0.0)
        xv = tl.load(x + cv, mask=live & v_ok, other=0.0)
        a = tl.load(A + row * stride_at + (h // R) * stride_ag + h % R, mask=live, other=0.0)
        b = tl.load(B + row * stride_bt + (h // R) * stride_bg + h % R, mask=live, other=0.0)
        return xq, xk, xv, a, b

    @triton.jit
    def _conv_taps(CW, c, ok):
        w = CW + c * 4
        return (tl.load(w + 0, mask=ok, other=0.0).to(tl.float32), tl.load(w + 1, mask=ok, other=0.0).to(tl.float32),
                tl.load(w + 2, mask=ok, other=0.0).to(tl.float32), tl.load(w + 3, mask=ok, other=0.0).to(tl.float32))

    @triton.jit
    def _conv_silu(x, h3, h2, h1, w0, w1, w2, w3, WDT: tl.constexpr):
        """Kernel-4 causal conv of one token (left context h3, h2, h1, oldest first) then SiLU,
        rounded as the reference's: the conv in the weight dtype, the output in x's dtype; fp32."""
        y = w0 * h3.to(tl.float32) + w1 * h2.to(tl.float32) + w2 * h1.to(tl.float32) + w3 * x.to(tl.float32)
        y = y.to(WDT).to(tl.float32)
        return (y / (1.0 + tl.exp(-y))).to(x.dtype).to(tl.float32)

    @triton.jit
    def _store_context(CONV, c, ok, h3, h2, h1):
        tl.store(CONV + c * 3 + 0, h3, mask=ok)
        tl.store(CONV + c * 3 + 1, h2, mask=ok)
        tl.store(CONV + c * 3 + 2, h1, mask=ok)

    @triton.jit
    def _store_window_rows(WIN, C, c, ok, h3, h2, h1):
        """The old context of channels c as the window's first three rows [3, C] (oldest first)."""
        dt = WIN.dtype.element_ty
        tl.store(WIN + c, h3.to(dt), mask=ok)
        tl.store(WIN + C + c, h2.to(dt), mask=ok)
        tl.store(WIN + 2 * C + c, h1.to(dt), mask=ok)

    @triton.jit
    def _gdn_decode_kernel(X, CW, CONV, A, B, A_LOG, DT_BIAS, STATE, SLOTS, TOK_OFF, Q_LEN, O, REC, WIN, COUNT,
                           HK, HV, R, C, stride_xt, stride_cs, stride_at, stride_ag, stride_bt, stride_bg, stride_ss,
                           stride_sh, win_rows, rec_w, scale, eps, GROUP: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BLOCK_V: tl.constexpr, RECORD: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        off = tl.load(TOK_OFF + b).to(tl.int32)  # int64 from the graphs' staging: keep index math 32-bit
        n = tl.load(Q_LEN + b).to(tl.int32)
        hk = h // GROUP
        ks = tl.arange(0, DK)
        vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = vs < DV
        # this program's conv channels: its k-head's q and k, its v-head's block of v
        cq = hk * DK + ks
        ck = HK * DK + hk * DK + ks
        cv = 2 * HK * DK + h * DV + vs
        wq0, wq1, wq2, wq3 = _conv_taps(CW, cq, cq >= 0)
        wk0, wk1, wk2, wk3 = _conv_taps(CW, ck, ck >= 0)
        wv0, wv1, wv2, wv3 = _conv_taps(CW, cv, v_ok)
        conv = CONV + slot * stride_cs
        q3, q2, q1 = tl.load(conv + cq * 3 + 0), tl.load(conv + cq * 3 + 1), tl.load(conv + cq * 3 + 2)
        k3, k2, k1 = tl.load(conv + ck * 3 + 0), tl.load(conv + ck * 3 + 1), tl.load(conv + ck * 3 + 2)
        v3 = tl.load(conv + cv * 3 + 0, mask=v_ok, other=0.0)
        v2 = tl.load(conv + cv * 3 + 1, mask=v_ok, other=0.0)
        v1 = tl.load(conv + cv * 3 + 2, mask=v_ok, other=0.0)
        # the rollback window (old context, then the inputs): q / k rows by the k-head's first
        # program, v rows by their only program
        first = (h % GROUP == 0) & (vb == 0)
        win = WIN + b.to(tl.int64) * win_rows * C
        if RECORD:
            _store_window_rows(win, C, cq, first & (cq >= 0), q3, q2, q1)
            _store_window_rows(win, C, ck, first & (ck >= 0), k3, k2, k1)
            _store_window_rows(win, C, cv, v_ok, v3, v2, v1)
        a_log = tl.load(A_LOG + h)
        dt_bias = tl.load(DT_BIAS + h)
        # Token t + 1's inputs are loaded while token t computes: the tokens form a dependent chain,
        # so an unprefetched load's latency would be paid once per token.
        xq_n, xk_n, xv_n, a_n, b_n = _token_inputs(X, A, B, off, n > 0, cq, ck, cv, v_ok, h, R, stride_xt, stride_at,
                                                   stride_ag, stride_bt, stride_bg)
        s_ptr = STATE + slot * stride_ss + h * stride_sh + ks[:, None] * DV + vs[None, :]
        S = tl.load(s_ptr, mask=v_ok[None, :], other=0.0).to(tl.float32)
        for t in range(0, n):
            row = off + t
            xq, xk, xv, a, bt = xq_n, xk_n, xv_n, a_n, b_n
            xq_n, xk_n, xv_n, a_n, b_n = _token_inputs(X, A, B, row + 1, t + 1 < n, cq, ck, cv, v_ok, h, R, stride_xt,
                                                       stride_at, stride_ag, stride_bt, stride_bg)
            q = _conv_silu(xq, q3, q2, q1, wq0, wq1, wq2, wq3, CW.dtype.element_ty)
            k = _conv_silu(xk, k3, k2, k1, wk0, wk1, wk2, wk3, CW.dtype.element_ty)
            v = _conv_silu(xv, v3, v2, v1, wv0, wv1, wv2, wv3, CW.dtype.element_ty)
            if RECORD:
                tl.store(win + (3 + t) * C + cq, xq.to(WIN.dtype.element_ty), mask=first & (cq >= 0))
                tl.store(win + (3 + t) * C + ck, xk.to(WIN.dtype.element_ty), mask=first & (ck >= 0))
                tl.store(win + (3 + t) * C + cv, xv.to(WIN.dtype.element_ty), mask=v_ok)
            q3, q2, q1 = q2, q1, xq.to(q1.dtype)
            k3, k2, k1 = k2, k1, xk.to(k1.dtype)
            v3, v2, v1 = v2, v1, xv.to(v1.dtype)
            g, beta = _gate_values(a, bt, a_log, dt_bias)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
            beta = beta.to(tl.float32)
            if RECORD:  # the replay's inputs (torch_gdn.record_width): k by the k-head's first program
                rec = REC + row.to(tl.int64) * rec_w
                tl.store(rec + hk * DK + ks, k, mask=first)
                tl.store(rec + HK * DK + h * DV + vs, v, mask=v_ok)
                tl.store(rec + HK * DK + HV * DV + h, g, mask=vb == 0)
                tl.store(rec + HK * DK + HV * DV + HV + h, beta, mask=vb == 0)
            S = _delta_rule_step(S, k, v, g, beta)
            o = tl.sum(q[:, None] * S, 0)
            tl.store(O + row * (HV * DV) + h * DV + vs, o.to(O.dtype.element_ty), mask=v_ok)
        if not RECORD:
            tl.store(s_ptr, S.to(STATE.dtype.element_ty), mask=v_ok[None, :])
            # the new conv context: v channels by their only program; q / k channels, which the k-head's
            # GROUP x (DV / BLOCK_V) programs all read at their start, by the last of them to get here
            _store_context(conv, cv, v_ok, v3, v2, v1)
            if last_to_arrive(COUNT, b * HK + hk, GROUP * tl.num_programs(2)):
                _store_context(conv, cq, cq >= 0, q3, q2, q1)
                _store_context(conv, ck, ck >= 0, k3, k2, k1)

    @triton.jit
    def _conv_input(X, CONV, src, cs, ok, stride_xt):
        """Inputs at times ``src`` [BLOCK_T] of channels ``cs``: rows of X from time 0 on, the carried
        context ``CONV`` [C, 3] (oldest first) before it, in X's dtype."""
        x = tl.load(X + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_xt + cs[None, :],
                    mask=ok & (src >= 0)[:, None], other=0.0)
        h = tl.load(CONV + cs[None, :] * 3 + (3 + tl.minimum(src, -1))[:, None], mask=ok & (src < 0)[:, None],
                    other=0.0)
        return tl.where((src >= 0)[:, None], x, h.to(x.dtype))

    @triton.jit
    def _conv_prefill_kernel(X, CW, CONV, Y, T, C, stride_xt, stride_yt, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cs < C
        ok = (ts < T)[:, None] & c_ok[None, :]
        w0, w1, w2, w3 = _conv_taps(CW, cs, c_ok)
        x = _conv_input(X, CONV, ts, cs, ok, stride_xt)
        y = _conv_silu(x, _conv_input(X, CONV, ts - 3, cs, ok, stride_xt), _conv_input(X, CONV, ts - 2, cs, ok, stride_xt),
                       _conv_input(X, CONV, ts - 1, cs, ok, stride_xt), w0[None, :], w1[None, :], w2[None, :],
                       w3[None, :], CW.dtype.element_ty)
        tl.store(Y + ts.to(tl.int64)[:, None] * stride_yt + cs[None, :], y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _gates_kernel(A, B, A_LOG, DT_BIAS, G_OUT, BETA_OUT, HV, R, stride_at, stride_ag, stride_bt, stride_bg,
                      BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        wait_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        hs = tl.arange(0, BLOCK_H)
        ok = hs < HV
        a = tl.load(A + t * stride_at + (hs // R) * stride_ag + hs % R, mask=ok, other=0.0)
        b = tl.load(B + t * stride_bt + (hs // R) * stride_bg + hs % R, mask=ok, other=0.0)
        g, beta = _gate_values(a, b, tl.load(A_LOG + hs, mask=ok, other=0.0), tl.load(DT_BIAS + hs, mask=ok, other=0.0))
        tl.store(G_OUT + t * HV + hs, g, mask=ok)
        tl.store(BETA_OUT + t * HV + hs, beta.to(BETA_OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rollback_program(SLOTS, ACC, B):
        """A rollback program's (j, layer, request b, b's state slot, b's accepted count) from its
        ids (layer * B + b, j)."""
        lb = tl.program_id(0)
        b = lb % B
        return (tl.program_id(1), (lb // B).to(tl.int64), b, tl.load(SLOTS + b).to(tl.int64),
                tl.load(ACC + b).to(tl.int32))

    @triton.jit
    def _rollback_kernel(CONV, SSM, REC, WIN, SLOTS, ACC, B, n, C, HK, HV, win_rows, rec_w, stride_cl, stride_cs,
                         stride_sl, stride_ss, stride_rl, stride_wl, V_BLOCKS, GROUP: tl.constexpr, DK: tl.constexpr,
                         DV: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, KM1: tl.constexpr,
                         PDL: tl.constexpr):
        """Program (layer * B + b, j): for j < HV * V_BLOCKS, v-head j // V_BLOCKS's block of value
        dims of request b's state, replayed from its slot through the recorded tokens 0..accepted[b]
        (the verify's own steps, so its states to rounding); programs past those copy the conv
        window rows that end at the accepted token."""
        wait_prior(PDL)
        j, l, b, slot, a = _rollback_program(SLOTS, ACC, B)
        if j < HV * V_BLOCKS:  # (branch-local names: Triton types each name once across both branches)
            h = j // V_BLOCKS
            ks = tl.arange(0, DK)
            vs = (j % V_BLOCKS) * BLOCK_V + tl.arange(0, BLOCK_V)
            v_ok = vs < DV
            s_ptr = SSM + l * stride_sl + slot * stride_ss + h * (DK * DV) + ks[:, None] * DV + vs[None, :]
            S = tl.load(s_ptr, mask=v_ok[None, :], other=0.0).to(tl.float32)
            rec = REC + l * stride_rl + (b * n).to(tl.int64) * rec_w
            for t in range(0, a + 1):
                k = tl.load(rec + (h // GROUP) * DK + ks)
                v = tl.load(rec + HK * DK + h * DV + vs, mask=v_ok, other=0.0)
                g = tl.load(rec + HK * DK + HV * DV + h)
                beta = tl.load(rec + HK * DK + HV * DV + HV + h)
                S = _delta_rule_step(S, k, v, g, beta)
                rec += rec_w
            tl.store(s_ptr, S.to(SSM.dtype.element_ty), mask=v_ok[None, :])
        else:
            _copy_conv_window(CONV, WIN, l, b, slot, a, j - HV * V_BLOCKS, C, win_rows, stride_cl, stride_cs, stride_wl,
                              BLOCK_C, KM1)

    @triton.jit
    def _copy_conv_window(CONV, WIN, l, b, slot, a, cb, C, win_rows, stride_cl, stride_cs, stride_wl,
                          BLOCK_C: tl.constexpr, KM1: tl.constexpr):
        """A rollback's conv half (every recurrent kind's): channel block ``cb`` of layer l's conv
        context of ``slot`` set to the window rows of request b that end at its accepted token a."""
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
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
    verify compute the gates inside ``gdn_decode``. a, b: [T, G, R] with v-head h at
    ``[:, h // R, h % R]`` (strided views of the fused ``ba`` projection are fine: no copies).
    Returns g [T, HV] fp32 and beta [T, HV] in b's dtype."""
    R = _check_gate_views("gdn_gates", a, b, A_log, dt_bias)
    T, HV = a.shape[0], A_log.shape[0]
    g = torch.empty(T, HV, device=a.device, dtype=torch.float32)
    beta = torch.empty(T, HV, device=a.device, dtype=b.dtype)
    if T:
        _gates_kernel[(T,)](a, b, A_log, dt_bias, g, beta, HV, R, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            BLOCK_H=triton.next_power_of_2(HV), **pdl(a.device))
    return g, beta


def gdn_decode(
    x: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, tok_off: torch.Tensor,
    q_len: torch.Tensor, record_len: int | None = None,
    record_into: tuple[torch.Tensor, torch.Tensor] | None = None, block_v: int = DECODE_BLOCK_V,
    num_warps: int = DECODE_WARPS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The GDN mixer of a decode / verify forward in one launch: the causal conv (kernel 4) + SiLU
    of the packed q | k | v projection rows ``x`` [T, C] (rows may be strided), then the gated delta
    rule (q, k L2-normalised, q scaled by Dk**-0.5; g, beta from the raw gates in-kernel).

    Request b owns rows ``tok_off[b] .. tok_off[b] + q_len[b] - 1`` (device tensors [B]: nothing is
    read on the host, so it is graph-capturable) and updates ``conv_state[slots[b]]`` [C, 3] and
    ``ssm_state[slots[b]]`` [HV, Dk, Dv] (fp32) in place. a, b [T, G, R] and A_log, dt_bias [HV]
    as ``gdn_gates`` takes them. v-head h reads k-head h // (HV / HK), HK = (C - HV Dv) / (2 Dk).

    With ``record_len`` n (every request has n rows: a verify) the slots' states stay as they were
    and it records what ``rollback_states`` replays: each request's conv window [3 + n, C] (old
    context, then the inputs) and every token's delta-rule inputs [T, ``torch_gdn.record_width``]
    (fp32), into ``record_into`` = (tokens, windows) when given (the engine's preallocated verify
    record). Returns (o [T, HV, Dv], windows [B, 3 + n, C] or None, tokens or None).

    A program owns (request, v-head, ``block_v`` value dims) and convolves the channels it reads
    itself, so the conv costs no launch of its own. Twins: ``torch_gdn.causal_conv1d`` then
    ``torch_gdn.gated_delta_rule_recurrent`` (``TorchBackend.gated_delta_net``). Defaults from
    ``benchmarks/tune_gdn.py`` on the H200 (35B shape): 16 value dims x 1 warp."""
    T, C = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()  # rows may be strided (a view into the packed input projection), channels not
    HV, DK, DV = ssm_state.shape[1:]
    HK = (C - HV * DV) // (2 * DK) if DK else 0
    if DK & (DK - 1) or not ssm_state.is_contiguous() or HK < 1 or 2 * HK * DK + HV * DV != C or HV % HK:
        raise ValueError(f"gdn_decode: x {tuple(x.shape)} must hold q | k | v for "
                         f"ssm_state {tuple(ssm_state.shape)}, a contiguous [slots, HV, Dk, Dv] with Dk a power of 2 "
                         f"and HV a multiple of the k heads")
    if conv_weight.shape != (C, 4) or conv_state.shape[1:] != (C, 3) or not conv_state.is_contiguous():
        raise ValueError(f"gdn_decode: conv_weight {tuple(conv_weight.shape)} must be [{C}, 4] and conv_state "
                         f"{tuple(conv_state.shape)} a contiguous [slots, {C}, 3] (kernel size 4 only)")
    R = _check_gate_views("gdn_decode", a, b, A_log, dt_bias)
    if a.shape[0] != T or A_log.shape != (HV,) or block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"gdn_decode: gates a {tuple(a.shape)} / A_log {tuple(A_log.shape)} must cover {T} "
                         f"tokens x {HV} v heads; block_v={block_v} must be a power of 2")
    B = slots.shape[0]
    o = torch.empty(T, HV, DV, device=x.device, dtype=x.dtype)
    win = tokens = None
    rec_w = record_width(HK, DK, HV, DV)
    if record_len is not None:
        tokens, win = record_into if record_into is not None else (
            torch.empty(T, rec_w, device=x.device, dtype=torch.float32),
            torch.empty(B, 3 + record_len, C, device=x.device, dtype=conv_state.dtype))
        if tokens.dim() != 2 or tokens.shape[0] < T or tokens.shape[1] != rec_w or tokens.dtype != torch.float32 \
                or not tokens.is_contiguous():
            raise ValueError(f"gdn_decode: record tokens {tuple(tokens.shape)} {tokens.dtype} cannot hold {T} "
                             f"contiguous fp32 rows of {rec_w} (torch_gdn.record_width)")
        if win.shape[0] < B or win.shape[1:] != (3 + record_len, C):
            raise ValueError(f"gdn_decode: record windows {tuple(win.shape)} cannot hold {B} windows of "
                             f"[{3 + record_len}, {C}]")
        tokens, win = tokens[:T], win[:B]
    block_v = min(block_v, triton.next_power_of_2(DV))
    if B:
        _gdn_decode_kernel[(B, HV, triton.cdiv(DV, block_v))](
            x, conv_weight.contiguous(), conv_state, a, b, A_log, dt_bias, ssm_state, slots, tok_off, q_len, o,
            o if tokens is None else tokens, o if win is None else win, arrival_counters(x.device, B * HK),
            HK, HV, R, C, x.stride(0), conv_state.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            ssm_state.stride(0), ssm_state.stride(1), 3 + (record_len or 0), rec_w, DK**-0.5, L2NORM_EPS,
            GROUP=HV // HK, DK=DK, DV=DV, BLOCK_V=block_v, RECORD=record_len is not None, num_warps=num_warps,
            **pdl(x.device),
        )
    return o, win, tokens


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                          block_t: int = 16, block_c: int = 64, num_warps: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_gdn.causal_conv1d`` (its twin) of one sequence piece x [T, C] (rows may be strided)
    for kernel size 4 in one launch: the depthwise causal conv with the carried context
    ``conv_state`` [C, 3] (oldest first), then SiLU. Returns (y [T, C] in x's dtype, the new
    context [C, 3] in x's dtype). A prefill chunk's conv in torch is a transpose, a cat, a generic
    depthwise conv and a SiLU over [T, C] each. The default tile is the fastest of a 36-launch H200
    sweep: 196 against 1,363 us for the torch path over an 8192 x 8192 bf16 chunk
    (``benchmarks/tune_conv_prefill.py``)."""
    T, C = x.shape
    if weight.shape != (C, 4) or conv_state.shape != (C, 3):
        raise ValueError(f"causal_conv1d_prefill: weight {tuple(weight.shape)} must be [{C}, 4] and conv_state "
                         f"{tuple(conv_state.shape)} [{C}, 3] for x {tuple(x.shape)} (kernel size 4 only)")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(T, C, device=x.device, dtype=x.dtype)
    if T:
        _conv_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
            x, weight.contiguous(), conv_state.contiguous(), y, T, C, x.stride(0), y.stride(0), BLOCK_T=block_t,
            BLOCK_C=block_c, num_warps=num_warps, **pdl(x.device))
    new_state = torch.cat([conv_state.to(x.dtype), x[-3:].transpose(0, 1)], dim=1)[:, -3:]
    return y, new_state


def fla_available(device: torch.device, ops: str = "gated_delta_rule") -> bool:
    """flash-linear-attention's ``fla.ops.<ops>`` kernels (optional ``gpu`` extra) run on CUDA devices."""
    if device.type != "cuda":
        return False
    try:
        importlib.import_module(f"fla.ops.{ops}")
    except ImportError:
        return False
    return True


FLA_CHUNK = 64  # fla's chunk of the gated delta rule (its default), which its chunk table indexes


def gdn_chunked_fla(conv_out: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_state: torch.Tensor,
                    ctx, dims: tuple[int, int, int, int, int]) -> torch.Tensor:
    """Prefill-sized pieces through fla's chunked gated delta rule (varlen over the requests of the
    forward; its GVA maps v-head h to k-head h // (HV / HK), as ``_gdn_heads`` repeats them).
    Starts from and updates ``ssm_state[ctx.state_slots]``. Returns o [T, HV, Dv]."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices

    hk, hv, dk, dv, _ = dims
    T = conv_out.shape[0]
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    varlen = ctx.backend_cache.get("fla_varlen")
    if varlen is None:
        # once a forward, shared by every layer, each queued without a sync: a blocking copy (of the
        # offsets, or of fla's chunk table, which it copies with one when not handed it) makes the GPU
        # idle while the host queues the next layer's kernels
        cu_cpu = torch.tensor(ctx.token_offsets, dtype=torch.long)
        chunks = prepare_chunk_indices(cu_cpu, FLA_CHUNK, cu_seqlens_cpu=cu_cpu)
        varlen = dict(cu_seqlens=cu_cpu.to(conv_out.device, non_blocking=True), cu_seqlens_cpu=cu_cpu,
                      chunk_indices=chunks.to(conv_out.device, non_blocking=True))
        ctx.backend_cache["fla_varlen"] = varlen
    slots = ctx.state_slots
    o, final = chunk_gated_delta_rule(
        q.reshape(1, T, hk, dk), k.reshape(1, T, hk, dk), v.reshape(1, T, hv, dv), g[None].float(), beta[None],
        scale=dk**-0.5, initial_state=ssm_state[slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
        chunk_size=FLA_CHUNK, **varlen,
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    return o[0]


def check_rollback(op: str, conv: torch.Tensor, ssm: torch.Tensor, rec_tokens: torch.Tensor, rec_windows: torch.Tensor,
                   slots: torch.Tensor, accepted: torch.Tensor, n: int, width_ok: bool) -> None:
    """A rollback launch's inputs (every recurrent kind's): the layouts ``torch_gdn.rollback_states``
    states, contiguous, with ``width_ok`` (the record width the kind's shapes give)."""
    L, B, C, km1 = ssm.shape[0], slots.shape[0], conv.shape[2], conv.shape[3]
    shapes_ok = (width_ok and rec_tokens.dim() == 3 and rec_tokens.shape[0] == L and rec_tokens.shape[1] >= B * n
                 and rec_tokens.dtype == torch.float32 and rec_windows.shape[0] == L and rec_windows.shape[1] >= B
                 and rec_windows.shape[2:] == (km1 + n, C) and conv.shape[0] == L and accepted.shape == slots.shape)
    # the windows may be packed for fewer verify tokens than their buffer holds (each layer's slice contiguous)
    if not shapes_ok or not all(t.is_contiguous() for t in (conv, ssm, rec_tokens, rec_windows[0])):
        raise ValueError(f"{op}: conv {tuple(conv.shape)}, ssm {tuple(ssm.shape)}, rec_tokens "
                         f"{tuple(rec_tokens.shape)} {rec_tokens.dtype}, rec_windows {tuple(rec_windows.shape)}, slots "
                         f"{tuple(slots.shape)}, accepted {tuple(accepted.shape)} disagree for {B} requests of {n} "
                         f"tokens (all contiguous, the windows per layer; fp32 token rows of record_width)")


def rollback_states(conv: torch.Tensor, ssm: torch.Tensor, rec_tokens: torch.Tensor, rec_windows: torch.Tensor,
                    slots: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
    """``torch_gdn.rollback_states`` (its twin) in one launch, every layer at once: each request's
    state replayed from its slot through its accepted tokens' recorded inputs (at ``gdn_decode``'s
    tile and warps, so the verify's state to rounding), its conv context copied from the window.
    Shapes as the twin's; the pools and records contiguous (``slots`` / ``accepted`` may be views)."""
    L, B = ssm.shape[0], slots.shape[0]
    HV, DK, DV = ssm.shape[2:]
    C, km1 = conv.shape[2], conv.shape[3]
    rec_w = rec_tokens.shape[-1]
    HK = (rec_w - HV * DV - 2 * HV) // DK if DK else 0
    check_rollback("rollback_states", conv, ssm, rec_tokens, rec_windows, slots, accepted, n,
                   HK >= 1 and HV % HK == 0 and record_width(HK, DK, HV, DV) == rec_w)
    if B == 0:
        return
    block_v, block_c = min(DECODE_BLOCK_V, triton.next_power_of_2(DV)), 1024
    v_blocks = triton.cdiv(DV, block_v)
    _rollback_kernel[(L * B, HV * v_blocks + triton.cdiv(C, block_c))](
        conv, ssm, rec_tokens, rec_windows, slots.contiguous(), accepted.contiguous(), B, n, C, HK, HV, km1 + n, rec_w,
        conv.stride(0), conv.stride(1), ssm.stride(0), ssm.stride(1), rec_tokens.stride(0), rec_windows.stride(0), v_blocks,
        GROUP=HV // HK, DK=DK, DV=DV, BLOCK_V=block_v, BLOCK_C=block_c, KM1=km1, num_warps=DECODE_WARPS,
        **pdl(conv.device))
