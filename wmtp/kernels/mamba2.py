"""Triton Mamba2 mixer for decode / verify (a few tokens per request) and its rollback; fla's chunked
simple-GLA for prefill (DESIGN §10).

One program owns (request, head, block of head channels). It convolves (kernel 4, bias, SiLU) its x
channels and its group's B and C channels, read straight from the in_proj rows with their left
context in registers, and keeps its slice of the SSM state [BLOCK_P, N] in registers while the
request's tokens run through ``torch_mamba2.ssd_step`` (dt = softplus(dt_raw + dt_bias) clamped to
the time-step limit, decay = exp(dt * A)), each token's output y = S @ C + D x; then it writes the
state and the conv context back to the pool slot. With ``record`` (a verify) it leaves the states as
they were and records each token's SSD inputs and the conv window; ``rollback_states`` replays the
accepted tokens from the slot, every layer in one launch. The twins are ``TorchBackend.mamba2`` and
``torch_mamba2.rollback_states``.

Prefill maps the SSD onto fla's ``chunk_simple_gla`` (a scalar decay per head and step): q = C,
k = B (each head its group's), v = dt * x, g = dt * A, scale 1, and y = o + D x; fla's state is
[N, P] per head where the pools hold [P, N].
"""

from __future__ import annotations

import torch

from wmtp.config import Mamba2Shape
from wmtp.kernels.common import arrival_counters, launch_tile, pdl
from wmtp.kernels.gdn import MAX_RECURRENT_TOKENS, check_rollback  # noqa: F401  (GDN's decode / prefill split)
from wmtp.kernels.torch_mamba2 import record_width

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# decode / verify tile (head channels per program) and warps, from benchmarks/tune_mamba2.py on the H200
# (Nemotron-3-Super shape): 5.3 us a decode layer, 12.3 us a d = 7 verify layer
DECODE_BLOCK_P, DECODE_WARPS = 32, 4

if triton is not None:
    from wmtp.kernels.common import last_to_arrive, wait_prior
    from wmtp.kernels.gdn import (_conv_taps, _copy_conv_window, _rollback_program, _store_context,
                                   _store_window_rows)

    @triton.jit
    def _conv_bias_silu(x, h3, h2, h1, w0, w1, w2, w3, bias, WDT: tl.constexpr):
        """Kernel-4 causal conv of one token plus the bias, then SiLU, rounded as the reference's
        (the conv in the weight dtype, the output in x's dtype); fp32."""
        y = w0 * h3.to(tl.float32) + w1 * h2.to(tl.float32) + w2 * h1.to(tl.float32) + w3 * x.to(tl.float32) + bias
        y = y.to(WDT).to(tl.float32)
        return (y / (1.0 + tl.exp(-y))).to(x.dtype).to(tl.float32)

    @triton.jit
    def _ssd_step(S, x, dt, decay, b):
        """``torch_mamba2.ssd_step`` on this program's [BLOCK_P, N] slice (fp32); the verify and the
        rollback's replay both run it, so the replayed state is the verify's."""
        return S * decay + (dt * x)[:, None] * b[None, :]

    @triton.jit
    def _mamba2_decode_kernel(XBC, DT, CW, CB, CONV, DT_BIAS, A_LOG, D, STATE, SLOTS, TOK_OFF, Q_LEN, Y, REC, WIN,
                              COUNT, H, C, stride_xt, stride_dt, stride_cs, stride_ss, win_rows, rec_w, dt_min, dt_max,
                              HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                              BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr, RECORD: tl.constexpr,
                              PDL: tl.constexpr):
        wait_prior(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        pb = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        off = tl.load(TOK_OFF + b).to(tl.int32)
        n = tl.load(Q_LEN + b).to(tl.int32)
        g = h // HEADS_PER_GROUP
        ps = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = ps < P
        ns = tl.arange(0, N)
        cx = h * P + ps  # this program's x channels, then its group's B and C channels
        cb = H * P + g * N + ns
        cc = H * P + G * N + g * N + ns
        wx0, wx1, wx2, wx3 = _conv_taps(CW, cx, p_ok)
        wb0, wb1, wb2, wb3 = _conv_taps(CW, cb, cb >= 0)
        wc0, wc1, wc2, wc3 = _conv_taps(CW, cc, cc >= 0)
        bx = tl.zeros((BLOCK_P,), dtype=tl.float32)
        bb = tl.zeros((N,), dtype=tl.float32)
        bc = tl.zeros((N,), dtype=tl.float32)
        if HAS_BIAS:
            bx = tl.load(CB + cx, mask=p_ok, other=0.0).to(tl.float32)
            bb = tl.load(CB + cb).to(tl.float32)
            bc = tl.load(CB + cc).to(tl.float32)
        conv = CONV + slot * stride_cs
        x3 = tl.load(conv + cx * 3 + 0, mask=p_ok, other=0.0)
        x2 = tl.load(conv + cx * 3 + 1, mask=p_ok, other=0.0)
        x1 = tl.load(conv + cx * 3 + 2, mask=p_ok, other=0.0)
        b3, b2, b1 = tl.load(conv + cb * 3 + 0), tl.load(conv + cb * 3 + 1), tl.load(conv + cb * 3 + 2)
        c3, c2, c1 = tl.load(conv + cc * 3 + 0), tl.load(conv + cc * 3 + 1), tl.load(conv + cc * 3 + 2)
        # the group's B / C rows of the rollback window by its first program, x rows by their only one
        first = (h % HEADS_PER_GROUP == 0) & (pb == 0)
        win = WIN + b.to(tl.int64) * win_rows * C
        if RECORD:
            _store_window_rows(win, C, cx, p_ok, x3, x2, x1)
            _store_window_rows(win, C, cb, first & (cb >= 0), b3, b2, b1)
            _store_window_rows(win, C, cc, first & (cc >= 0), c3, c2, c1)
        dt_bias = tl.load(DT_BIAS + h).to(tl.float32)
        a = -tl.exp(tl.load(A_LOG + h).to(tl.float32))
        d_skip = tl.load(D + h).to(tl.float32)
        s_ptr = STATE + slot * stride_ss + h * (P * N) + ps[:, None] * N + ns[None, :]
        S = tl.load(s_ptr, mask=p_ok[:, None], other=0.0).to(tl.float32)
        for t in range(0, n):
            row = (off + t).to(tl.int64)
            xin = XBC + row * stride_xt
            xx = tl.load(xin + cx, mask=p_ok, other=0.0)
            xb = tl.load(xin + cb)
            xc = tl.load(xin + cc)
            x = _conv_bias_silu(xx, x3, x2, x1, wx0, wx1, wx2, wx3, bx, CW.dtype.element_ty)
            bv = _conv_bias_silu(xb, b3, b2, b1, wb0, wb1, wb2, wb3, bb, CW.dtype.element_ty)
            cv = _conv_bias_silu(xc, c3, c2, c1, wc0, wc1, wc2, wc3, bc, CW.dtype.element_ty)
            if RECORD:
                tl.store(win + (3 + t) * C + cx, xx.to(WIN.dtype.element_ty), mask=p_ok)
                tl.store(win + (3 + t) * C + cb, xb.to(WIN.dtype.element_ty), mask=first)
                tl.store(win + (3 + t) * C + cc, xc.to(WIN.dtype.element_ty), mask=first)
            x3, x2, x1 = x2, x1, xx.to(x1.dtype)
            b3, b2, b1 = b2, b1, xb.to(b1.dtype)
            c3, c2, c1 = c2, c1, xc.to(c1.dtype)
            raw = tl.load(DT + row * stride_dt + h).to(tl.float32) + dt_bias
            dt = tl.minimum(tl.maximum(tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw))), dt_min), dt_max)
            decay = tl.exp(dt * a)
            if RECORD:  # the replay's inputs (torch_mamba2.record_width)
                rec = REC + row * rec_w
                tl.store(rec + cx, x, mask=p_ok)
                tl.store(rec + H * P + g * N + ns, bv, mask=first)
                tl.store(rec + H * P + G * N + h, dt, mask=pb == 0)
                tl.store(rec + H * P + G * N + H + h, decay, mask=pb == 0)
            S = _ssd_step(S, x, dt, decay, bv)
            y = tl.sum(S * cv[None, :], 1) + d_skip * x
            tl.store(Y + row * (H * P) + cx, y.to(Y.dtype.element_ty), mask=p_ok)
        if not RECORD:
            tl.store(s_ptr, S.to(STATE.dtype.element_ty), mask=p_ok[:, None])
            # x channels by their only program; the group's B / C channels, which all its programs
            # read at their start, by the last of them to get here
            _store_context(conv, cx, p_ok, x3, x2, x1)
            if last_to_arrive(COUNT, b * G + g, HEADS_PER_GROUP * tl.num_programs(2)):
                _store_context(conv, cb, cb >= 0, b3, b2, b1)
                _store_context(conv, cc, cc >= 0, c3, c2, c1)

    @triton.jit
    def _mamba2_rollback_kernel(CONV, SSM, REC, WIN, SLOTS, ACC, B, n, C, H, win_rows, rec_w, stride_cl, stride_cs,
                                stride_sl, stride_ss, stride_rl, stride_wl, P_BLOCKS, HEADS_PER_GROUP: tl.constexpr,
                                P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_P: tl.constexpr,
                                BLOCK_C: tl.constexpr, KM1: tl.constexpr, PDL: tl.constexpr):
        """Program (layer * B + b, j): for j < H * P_BLOCKS, head j // P_BLOCKS's block of channels of
        request b's state, replayed from its slot through the recorded tokens 0..accepted[b];
        programs past those copy the conv window rows that end at the accepted token."""
        wait_prior(PDL)
        j, l, b, slot, a = _rollback_program(SLOTS, ACC, B)
        if j < H * P_BLOCKS:  # (branch-local names: Triton types each name once across both branches)
            h = j // P_BLOCKS
            ps = (j % P_BLOCKS) * BLOCK_P + tl.arange(0, BLOCK_P)
            p_ok = ps < P
            ns = tl.arange(0, N)
            s_ptr = SSM + l * stride_sl + slot * stride_ss + h * (P * N) + ps[:, None] * N + ns[None, :]
            S = tl.load(s_ptr, mask=p_ok[:, None], other=0.0).to(tl.float32)
            rec = REC + l * stride_rl + (b * n).to(tl.int64) * rec_w
            for t in range(0, a + 1):
                x = tl.load(rec + h * P + ps, mask=p_ok, other=0.0)
                bv = tl.load(rec + H * P + (h // HEADS_PER_GROUP) * N + ns)
                dt = tl.load(rec + H * P + G * N + h)
                decay = tl.load(rec + H * P + G * N + H + h)
                S = _ssd_step(S, x, dt, decay, bv)
                rec += rec_w
            tl.store(s_ptr, S.to(SSM.dtype.element_ty), mask=p_ok[:, None])
        else:
            _copy_conv_window(CONV, WIN, l, b, slot, a, j - H * P_BLOCKS, C, win_rows, stride_cl, stride_cs, stride_wl,
                              BLOCK_C, KM1)


def mamba2_decode(xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                  dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, conv_state: torch.Tensor,
                  ssm_state: torch.Tensor, slots: torch.Tensor, tok_off: torch.Tensor, q_len: torch.Tensor,
                  shape: Mamba2Shape, record_len: int | None = None,
                  record_into: tuple[torch.Tensor, torch.Tensor] | None = None, block_p: int = DECODE_BLOCK_P,
                  num_warps: int = DECODE_WARPS) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The Mamba2 mixer's conv + SSD of a decode / verify forward in one launch (module docstring).

    xbc [T, C] pre-conv x | B | C rows (may be strided), dt [T, H] raw (may be strided); request b
    owns rows ``tok_off[b] .. + q_len[b] - 1`` (device tensors [B]: graph-capturable) and updates
    ``conv_state[slots[b]]`` [C, 3] and ``ssm_state[slots[b]]`` [H, P, N] (fp32) in place. With
    ``record_len`` n (every request n rows: a verify) the states stay and it records the conv windows
    [B, 3 + n, C] and each token's SSD inputs [T, ``torch_mamba2.record_width``] (fp32), into
    ``record_into`` = (tokens, windows) when given. Returns (y [T, H * P] in xbc's dtype, windows or
    None, tokens or None). Twin: ``TorchBackend.mamba2``."""
    m = shape
    T, C = xbc.shape
    if xbc.stride(1) != 1:
        xbc = xbc.contiguous()
    if dt.stride(1) != 1:
        dt = dt.contiguous()
    if (C != m.conv_dim or dt.shape != (T, m.heads) or ssm_state.shape[1:] != (m.heads, m.head_dim, m.state)
            or not ssm_state.is_contiguous() or m.state & (m.state - 1)):
        raise ValueError(f"mamba2_decode: xbc {tuple(xbc.shape)}, dt {tuple(dt.shape)}, ssm_state "
                         f"{tuple(ssm_state.shape)} disagree with {m} (contiguous state, power-of-2 state size)")
    if conv_weight.shape != (C, 4) or conv_state.shape[1:] != (C, 3) or not conv_state.is_contiguous():
        raise ValueError(f"mamba2_decode: conv_weight {tuple(conv_weight.shape)} must be [{C}, 4] and conv_state "
                         f"{tuple(conv_state.shape)} a contiguous [slots, {C}, 3] (kernel size 4 only)")
    B = slots.shape[0]
    y = torch.empty(T, m.inner, device=xbc.device, dtype=xbc.dtype)
    win = tokens = None
    rec_w = record_width(m.heads, m.head_dim, m.groups, m.state)
    if record_len is not None:
        tokens, win = record_into if record_into is not None else (
            torch.empty(T, rec_w, device=xbc.device, dtype=torch.float32),
            torch.empty(B, 3 + record_len, C, device=xbc.device, dtype=conv_state.dtype))
        if tokens.dim() != 2 or tokens.shape[0] < T or tokens.shape[1] != rec_w or tokens.dtype != torch.float32 \
                or not tokens.is_contiguous() or win.shape[0] < B or win.shape[1:] != (3 + record_len, C):
            raise ValueError(f"mamba2_decode: record tokens {tuple(tokens.shape)} {tokens.dtype} / windows "
                             f"{tuple(win.shape)} cannot hold {T} fp32 rows of {rec_w} and {B} windows of "
                             f"[{3 + record_len}, {C}]")
        tokens, win = tokens[:T], win[:B]
    block_p = min(launch_tile(block_p, m.head_dim), triton.next_power_of_2(m.head_dim))
    if B:
        _mamba2_decode_kernel[(B, m.heads, triton.cdiv(m.head_dim, block_p))](
            xbc, dt, conv_weight.contiguous(), conv_weight if conv_bias is None else conv_bias, conv_state, dt_bias,
            A_log, D, ssm_state, slots, tok_off, q_len, y, y if tokens is None else tokens, y if win is None else win,
            arrival_counters(xbc.device, B * m.groups), m.heads, C, xbc.stride(0), dt.stride(0), conv_state.stride(0),
            ssm_state.stride(0), 3 + (record_len or 0), rec_w, m.dt_limit[0], min(m.dt_limit[1], 3.0e38),
            HEADS_PER_GROUP=m.heads // m.groups, P=m.head_dim, N=m.state, G=m.groups, BLOCK_P=block_p,
            HAS_BIAS=conv_bias is not None, RECORD=record_len is not None, num_warps=num_warps, **pdl(xbc.device))
    return y, win, tokens


def rollback_states(conv: torch.Tensor, ssm: torch.Tensor, rec_tokens: torch.Tensor, rec_windows: torch.Tensor,
                    slots: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
    """``torch_mamba2.rollback_states`` (its twin) in one launch, every layer at once (shapes as the
    twin's; pools and records contiguous)."""
    L, B = ssm.shape[0], slots.shape[0]
    H, P, N = ssm.shape[2:]
    C, km1 = conv.shape[2], conv.shape[3]
    rec_w = rec_tokens.shape[-1]
    G = (rec_w - H * P - 2 * H) // N if N else 0
    check_rollback("mamba2 rollback_states", conv, ssm, rec_tokens, rec_windows, slots, accepted, n,
                   G >= 1 and H % G == 0 and record_width(H, P, G, N) == rec_w and not N & (N - 1))
    if B == 0:
        return
    block_p, block_c = min(DECODE_BLOCK_P, triton.next_power_of_2(P)), 1024
    p_blocks = triton.cdiv(P, block_p)
    _mamba2_rollback_kernel[(L * B, H * p_blocks + triton.cdiv(C, block_c))](
        conv, ssm, rec_tokens, rec_windows, slots.contiguous(), accepted.contiguous(), B, n, C, H, km1 + n, rec_w,
        conv.stride(0), conv.stride(1), ssm.stride(0), ssm.stride(1), rec_tokens.stride(0), rec_windows.stride(0),
        p_blocks, HEADS_PER_GROUP=H // G, P=P, N=N, G=G, BLOCK_P=block_p, BLOCK_C=block_c, KM1=km1,
        num_warps=DECODE_WARPS, **pdl(conv.device))


def ssd_chunked_fla(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_mamba2.ssd_chunked`` (its twin) of one sequence piece through fla's
    ``chunk_simple_gla``: x [T, H, P], dt [T, H] (gated), A, D [H], B, C [T, G, N], state [H, P, N]
    (fp32). Returns (y [T, H, P] in x's dtype, the new state [H, P, N] fp32)."""
    from fla.ops.simple_gla import chunk_simple_gla

    T, H, P = x.shape
    rep = H // B.shape[1]
    q = C.repeat_interleave(rep, dim=1).to(x.dtype)[None]
    k = B.repeat_interleave(rep, dim=1).to(x.dtype)[None]
    v = (x.float() * dt[:, :, None]).to(x.dtype)[None]
    g = (dt * A.float())[None]
    o, final = chunk_simple_gla(q, k, v, g, scale=1.0, initial_state=state.transpose(1, 2)[None].contiguous(),
                                output_final_state=True)
    y = o[0].float() + D.float()[None, :, None] * x.float()
    return y.to(x.dtype), final[0].transpose(1, 2).float()
