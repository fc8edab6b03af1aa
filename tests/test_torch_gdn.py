"""Tests for the PyTorch Gated DeltaNet reference ops (wmtp.kernels.torch_gdn).

transformers' Qwen3-Next torch fallbacks are used as the external reference (batch dim 1
on their side). Everything runs on CPU in fp32 except the bf16 smoke tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from wmtp.kernels.torch_gdn import (
    RECURRENT_MAX_TOKENS,
    causal_conv1d,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_rms_norm,
    gdn_gates,
)

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

ATOL = 1e-5
HV = 4
SEQ_LENS = [1, 3, 63, 64, 65, 150]
DIMS = [(8, 16), (16, 8), (8, 8)]  # (Dk, Dv)


def _maxdiff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _inputs(
    T: int, Dk: int, Dv: int, with_state: bool, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HV, Dk, generator=gen)
    k = torch.randn(T, HV, Dk, generator=gen)
    v = torch.randn(T, HV, Dv, generator=gen)
    # Realistic gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
    a = torch.randn(T, HV, generator=gen)
    b = torch.randn(T, HV, generator=gen)
    A_log = torch.empty(HV).uniform_(0.01, 2.0, generator=gen).log()
    dt_bias = torch.randn(HV, generator=gen) * 0.5
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    s0 = torch.randn(HV, Dk, Dv, generator=gen) * 0.5 if with_state else None
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), s0


def _hf_rule(fn, q, k, v, g, beta, s0, **kw) -> tuple[Tensor, Tensor]:
    out, state = fn(
        q[None], k[None], v[None], g=g[None], beta=beta[None],
        initial_state=None if s0 is None else s0[None].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kw,
    )
    return out[0], state[0]


# --------------------------------------------------------------------------------------
# gated delta rule
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("Dk,Dv", DIMS)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", SEQ_LENS)
def test_rule_matches_transformers_and_each_other(T: int, with_state: bool, Dk: int, Dv: int) -> None:
    q, k, v, g, beta, s0 = _inputs(T, Dk, Dv, with_state, seed=T)
    s0_copy = None if s0 is None else s0.clone()

    o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    ref_o_c, ref_s_c = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0, chunk_size=64)
    ref_o_r, ref_s_r = _hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)

    for o, s in ((o_c, s_c), (o_r, s_r)):
        assert o.shape == (T, HV, Dv) and o.dtype == q.dtype
        assert s.shape == (HV, Dk, Dv) and s.dtype == torch.float32
    assert _maxdiff(o_c, ref_o_c) <= ATOL and _maxdiff(s_c, ref_s_c) <= ATOL
    assert _maxdiff(o_r, ref_o_r) <= ATOL and _maxdiff(s_r, ref_s_r) <= ATOL
    assert _maxdiff(o_c, o_r) <= ATOL and _maxdiff(s_c, s_r) <= ATOL
    if s0 is not None:  # never modified in place
        assert torch.equal(s0, s0_copy)

    # dispatcher: same answer whichever algorithm it picks, and forced choices work
    o_d, s_d = gated_delta_rule(q, k, v, g, beta, s0)
    expected = (o_c, s_c) if T > RECURRENT_MAX_TOKENS else (o_r, s_r)
    assert torch.equal(o_d, expected[0]) and torch.equal(s_d, expected[1])
    assert torch.equal(gated_delta_rule(q, k, v, g, beta, s0, use_chunked=True)[0], o_c)
    assert torch.equal(gated_delta_rule(q, k, v, g, beta, s0, use_chunked=False)[0], o_r)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 32])
def test_chunked_other_chunk_sizes(chunk_size: int) -> None:
    q, k, v, g, beta, s0 = _inputs(100, 8, 16, with_state=True, seed=1)
    o_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=chunk_size)
    ref_o, ref_s = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0, chunk_size=chunk_size)
    assert _maxdiff(o_c, o_r) <= ATOL and _maxdiff(s_c, s_r) <= ATOL
    assert _maxdiff(o_c, ref_o) <= ATOL and _maxdiff(s_c, ref_s) <= ATOL


def test_rule_empty_sequence() -> None:
    q, k, v, g, beta, s0 = _inputs(0, 8, 16, with_state=True)
    for fn in (gated_delta_rule_chunked, gated_delta_rule_recurrent):
        o, s = fn(q, k, v, g, beta, s0)
        assert o.shape == (0, HV, 16) and torch.equal(s, s0)


def test_rule_normalises_qk() -> None:
    """q and k are L2-normalised inside, so scaling them changes nothing (up to the eps)."""
    q, k, v, g, beta, s0 = _inputs(70, 8, 16, with_state=True, seed=3)
    o1, s1 = gated_delta_rule(q, k, v, g, beta, s0)
    o2, s2 = gated_delta_rule(q * 3.0, k * 0.5, v, g, beta, s0)
    assert _maxdiff(o1, o2) <= 1e-4 and _maxdiff(s1, s2) <= 1e-4


# --------------------------------------------------------------------------------------
# causal conv
# --------------------------------------------------------------------------------------
def _conv_ref_whole(x: Tensor, w: Tensor) -> Tensor:
    C, K = w.shape
    y = F.conv1d(x.T[None], w[:, None, :], padding=K - 1, groups=C)[0, :, : x.shape[0]]
    return F.silu(y).T


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 40])
def test_conv_whole_and_state(T: int, K: int) -> None:
    gen = torch.Generator().manual_seed(T * 10 + K)
    C = 12
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    y, st = causal_conv1d(x, w, None)
    assert y.shape == (T, C) and st.shape == (C, K - 1)
    assert _maxdiff(y, _conv_ref_whole(x, w)) <= ATOL
    hf_y = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    assert _maxdiff(y, hf_y) <= ATOL
    # new state = last K-1 inputs of [zeros(K-1), x]
    padded = torch.cat([torch.zeros(K - 1, C), x], dim=0)
    assert torch.equal(st, padded[-(K - 1):].T)


@pytest.mark.parametrize("pieces", [[1] * 20, [2, 1, 1, 5, 11], [1, 19], [17, 3]])
def test_conv_piecewise(pieces: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(pieces))
    C, K = 10, 4
    T = sum(pieces)
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    whole = _conv_ref_whole(x, w)

    st: Tensor | None = None
    hf_state = torch.zeros(1, C, K - 1)
    outs, hf_outs, t0 = [], [], 0
    for n in pieces:
        xp = x[t0 : t0 + n]
        y, st = causal_conv1d(xp, w, st)
        outs.append(y)
        hf_outs.append(hf.causal_conv1d_update(xp.T[None], hf_state, w, None, "silu")[0].T)  # mutates hf_state
        t0 += n
    assert _maxdiff(torch.cat(outs), whole) <= ATOL
    assert _maxdiff(torch.cat(hf_outs), whole) <= ATOL
    assert torch.equal(st, hf_state[0])


def test_conv_empty_keeps_state() -> None:
    C, K = 6, 4
    st = torch.randn(C, K - 1)
    y, st2 = causal_conv1d(torch.zeros(0, C), torch.randn(C, K), st)
    assert y.shape == (0, C) and torch.equal(st, st2)


# --------------------------------------------------------------------------------------
# full pipeline: piecewise with carried conv + recurrent state == whole sequence
# --------------------------------------------------------------------------------------
def _pipeline(x: Tensor, w: Tensor, g: Tensor, beta: Tensor, Dk: int, Dv: int, conv_state, rec_state, **kw):
    T = x.shape[0]
    y, conv_state = causal_conv1d(x, w, conv_state)
    q, k, v = torch.split(y, [HV * Dk, HV * Dk, HV * Dv], dim=-1)
    o, rec_state = gated_delta_rule(
        q.reshape(T, HV, Dk), k.reshape(T, HV, Dk), v.reshape(T, HV, Dv), g, beta, rec_state, **kw
    )
    return o, conv_state, rec_state


@pytest.mark.parametrize("pieces", [[37, 1, 32], [64, 6], [1, 69], [1] * 5 + [65], [20, 20, 30]])
@pytest.mark.parametrize("use_chunked", [None, True, False])
def test_pipeline_piecewise_matches_whole(pieces: list[int], use_chunked: bool | None) -> None:
    Dk, Dv, K = 8, 16, 4
    T = sum(pieces)
    gen = torch.Generator().manual_seed(sum(pieces) + len(pieces))
    C = HV * (2 * Dk + Dv)
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen) * 0.5
    g, beta = gdn_gates(torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen),
                        torch.zeros(HV), torch.zeros(HV))

    o_whole, cs_whole, rs_whole = _pipeline(x, w, g, beta, Dk, Dv, None, None, use_chunked=True)
    cs, rs, outs, t0 = None, None, [], 0
    for n in pieces:
        sl = slice(t0, t0 + n)
        o, cs, rs = _pipeline(x[sl], w, g[sl], beta[sl], Dk, Dv, cs, rs, use_chunked=use_chunked)
        outs.append(o)
        t0 += n
    assert _maxdiff(torch.cat(outs), o_whole) <= ATOL
    assert torch.equal(cs, cs_whole)
    assert _maxdiff(rs, rs_whole) <= ATOL


# --------------------------------------------------------------------------------------
# norm and gates
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    D = 16
    x = (torch.randn(7, HV, D, generator=gen) * 3).to(dtype)
    z = torch.randn(7, HV, D, generator=gen).to(dtype)
    mod = hf.Qwen3NextRMSNormGated(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(D, generator=gen))
        ref = mod(x.reshape(-1, D), z.reshape(-1, D)).reshape(x.shape)
    out = gated_rms_norm(x, z, mod.weight.detach(), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_gates(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    a = (torch.randn(9, HV, generator=gen) * 4).to(dtype)
    b = (torch.randn(9, HV, generator=gen) * 4).to(dtype)
    A_log = torch.empty(HV).uniform_(0.01, 16, generator=gen).log().to(dtype)
    dt_bias = torch.randn(HV, generator=gen).to(dtype)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert (g <= 0).all()
    x = a.double() + dt_bias.double()
    expected_g = -A_log.double().exp() * torch.log1p(x.exp())
    assert torch.allclose(g.double(), expected_g, rtol=1e-5, atol=1e-5)
    assert torch.equal(beta, b.sigmoid())


# --------------------------------------------------------------------------------------
# bf16 smoke
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 5, 100])
def test_bf16_smoke(T: int) -> None:
    Dk, Dv, K = 8, 16, 4
    q, k, v, g, beta, s0 = _inputs(T, Dk, Dv, with_state=True, seed=7, dtype=torch.bfloat16)
    q32, k32, v32, _, _, _ = _inputs(T, Dk, Dv, with_state=True, seed=7)
    for use_chunked in (True, False):
        o, s = gated_delta_rule(q, k, v, g, beta, s0, use_chunked=use_chunked)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        o32, _ = gated_delta_rule(q32, k32, v32, g, beta.float(), s0, use_chunked=use_chunked)
        assert _maxdiff(o, o32) < 0.1

    C = 12
    x = torch.randn(T, C).bfloat16()
    w = torch.randn(C, K).bfloat16()
    y, st = causal_conv1d(x, w, None)
    assert y.dtype == torch.bfloat16 and st.dtype == torch.bfloat16 and torch.isfinite(y).all()
    hf_y = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    assert torch.equal(y, hf_y)

    out = gated_rms_norm(o, o, torch.ones(Dv, dtype=torch.bfloat16), 1e-6)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
