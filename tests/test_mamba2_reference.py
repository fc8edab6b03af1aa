"""The Mamba2 (SSD) reference (``wmtp.kernels.torch_mamba2``): chunked = token by token (exactly, in
fp64), piecewise = whole, and both equal to transformers' NemotronH functions (fp32): the chunk scan
over several chunks with a partial last one and an initial state, one decode step, the gated
group norm."""

from __future__ import annotations

import pytest
import torch

from wmtp.kernels.torch_mamba2 import gated_group_rms_norm, ssd_chunked, ssd_gates, ssd_recurrent

T, H, P, G, N = 70, 6, 4, 2, 8  # chunks of 16: four whole and a partial one
LIMIT = (0.001, float("inf"))


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    x, dt_raw, B, C = r(T, H, P), r(T, H), r(T, G, N), r(T, G, N)
    dt_bias, A_log, D = r(H) * 0.5, torch.linspace(0.0, 1.5, H, dtype=dtype), r(H)
    return x, dt_raw, B, C, dt_bias, A_log, D, r(H, P, N)


def test_chunked_equals_recurrent_and_pieces_equal_the_whole():
    x, dt_raw, B, C, dt_bias, A_log, D, s0 = _inputs(torch.float64)
    dt, A = ssd_gates(dt_raw, dt_bias, A_log, LIMIT)
    want_y, want_s = ssd_recurrent(x, dt, A, B, C, D, s0)
    for chunk in (16, 64, 128):
        y, s = ssd_chunked(x, dt, A, B, C, D, chunk, s0)
        assert (y - want_y).abs().max() < 1e-10 and (s - want_s).abs().max() < 1e-10
    y1, s1 = ssd_chunked(x[:33], dt[:33], A, B[:33], C[:33], D, 16, s0)
    y2, s2 = ssd_recurrent(x[33:], dt[33:], A, B[33:], C[33:], D, s1)
    assert (torch.cat([y1, y2]) - want_y).abs().max() < 1e-10 and (s2 - want_s).abs().max() < 1e-10


def test_matches_transformers_nemotron_h():
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt_raw, B, C, dt_bias, A_log, D, s0 = _inputs(torch.float32, seed=1)
    dt, A = ssd_gates(dt_raw, dt_bias, A_log, LIMIT)
    y, s = ssd_chunked(x, dt, A, B, C, D, 16, s0)
    want_y, want_s = hf.mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk_size=16, D=D,
                                          dt_bias=dt_bias, initial_states=s0[None], dt_softplus=True,
                                          dt_limit=LIMIT, return_final_states=True)
    scale = want_y.abs().max()
    assert (y - want_y[0]).abs().max() <= 1e-5 * scale and (s - want_s[0]).abs().max() <= 1e-5 * want_s.abs().max()
    # one decode step (transformers' recurrent form applies no dt limit: dt here is above it)
    state = s0[None].clone()
    want = hf.mamba2_selective_state_update(
        state, x[:1], dt_raw[:1, :, None].expand(1, H, P), A[:, None, None].expand(H, P, N), B[:1], C[:1],
        D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)
    y1, s1 = ssd_recurrent(x[:1], dt[:1], A, B[:1], C[:1], D, s0)
    assert (dt[:1] > LIMIT[0]).all()
    assert (y1 - want).abs().max() <= 1e-5 * want.abs().max() and (s1 - state[0]).abs().max() <= 1e-5 * s1.abs().max()


def test_gated_group_norm_matches_transformers():
    zamba = pytest.importorskip("transformers.models.zamba2.modeling_zamba2")
    g = torch.Generator().manual_seed(2)
    y, z, w = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g), torch.randn(24, generator=g)
    ref = zamba.Zamba2RMSNormGated(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(w)
        want = ref(y, z)
    assert (gated_group_rms_norm(y, z, w, 8, 1e-5) - want).abs().max() <= 1e-6


def test_bad_shapes_name_the_tensor():
    x, dt_raw, B, C, dt_bias, A_log, D, s0 = _inputs(torch.float32)
    dt, A = ssd_gates(dt_raw, dt_bias, A_log, LIMIT)
    with pytest.raises(ValueError, match=r"state \(6, 4, 7\) must be \[6, 4, 8\]"):
        ssd_recurrent(x, dt, A, B, C, D, s0[..., :7])
    with pytest.raises(ValueError, match="G dividing H"):
        ssd_chunked(x, dt, A, B[:, :1].expand(T, 4, N), C[:, :1].expand(T, 4, N), D, 16)
