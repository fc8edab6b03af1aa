"""The Triton Mamba2 decode / verify kernel and its rollback against their twins
(``TorchBackend.mamba2``, ``torch_mamba2.rollback_states``), and fla's chunked SSD against
``torch_mamba2.ssd_chunked`` on a GPU. Several heads per group, a head dim that is not a multiple of
the kernel's block (masked lanes), decode pieces of different lengths, a verify with its record."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.config import Mamba2Shape  # noqa: E402
from wmtp.kernels import mamba2 as k  # noqa: E402
from wmtp.kernels import torch_mamba2  # noqa: E402
from wmtp.models.backend import TorchBackend  # noqa: E402
from wmtp.models.context import ForwardContext  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = Mamba2Shape(heads=4, head_dim=24, state=16, groups=2, conv_kernel=4, chunk=8, dt_limit=(0.001, float("inf")),
                    conv_bias=True)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _layer(dtype, bias: bool = True, slots: int = 5, seed: int = 0):
    m, g = SHAPE, torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(DEVICE)  # noqa: E731
    p = dict(conv_weight=rnd(m.conv_dim, 4, scale=0.5).to(dtype), conv_bias=rnd(m.conv_dim, scale=0.1).to(dtype) if bias else None,
             dt_bias=rnd(m.heads, scale=0.5), A_log=rnd(m.heads, scale=0.5), D=rnd(m.heads))
    conv = rnd(slots, m.conv_dim, 3).to(dtype)
    ssm = rnd(slots, m.heads, m.head_dim, m.state, scale=0.1)
    return p, conv, ssm, g


def _inputs(g, T, dtype):
    m = SHAPE
    xbc = (torch.randn(T, m.conv_dim + 8, generator=g)[:, 4:-4]).to(DEVICE, dtype)  # a strided view, as in_proj's
    dt = torch.randn(T, m.heads, generator=g).to(DEVICE, dtype)
    return xbc, dt


def _ctx(lens, slots, record=False):
    starts = [7] * len(lens)
    return ForwardContext(starts, lens, state_slots=torch.tensor(slots, device=DEVICE), device=DEVICE,
                          record_states=record)


def _kernel(xbc, dt, p, conv, ssm, ctx, record=None):
    _, q_len, tok_off = ctx.device_lens
    return k.mamba2_decode(xbc, dt, p["conv_weight"], p["conv_bias"], p["dt_bias"], p["A_log"], p["D"], conv, ssm,
                           ctx.state_slots, tok_off, q_len, SHAPE, record)


def _twin(xbc, dt, p, conv, ssm, ctx):
    return TorchBackend().mamba2(xbc, dt, p["conv_weight"], p["conv_bias"], p["dt_bias"], p["A_log"], p["D"], conv, ssm,
                                 ctx, 0, SHAPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_decode_matches_the_twin(dtype, bias):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bf16 arithmetic of Triton's CPU interpreter is not the GPU's")
    p, conv, ssm, g = _layer(dtype, bias)
    lens, slots = [1, 3, 2], [4, 0, 2]
    xbc, dt = _inputs(g, sum(lens), dtype)
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    y, _, _ = _kernel(xbc, dt, p, c1, s1, _ctx(lens, slots))
    want = _twin(xbc, dt, p, c2, s2, _ctx(lens, slots))
    tol = TOL[dtype]
    assert y.dtype == want.dtype and (y.float() - want.float()).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    assert torch.equal(c1, c2), "conv contexts differ"
    assert (s1 - s2).abs().max().item() <= tol * max(1.0, s2.abs().max().item())
    untouched = [1, 3]
    assert torch.equal(s1[untouched], ssm[untouched]) and torch.equal(c1[untouched], conv[untouched])


@pytest.mark.parametrize("accepted", [[0, 2, 1], [3, 0, 3]])
def test_verify_record_and_rollback_match_the_twins(accepted):
    dtype, n = torch.float32, 4
    p, conv, ssm, g = _layer(dtype)
    slots = [3, 1, 4]
    xbc, dt = _inputs(g, n * len(slots), dtype)
    c1, s1, c2, s2 = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    kctx, tctx = _ctx([n] * 3, slots, record=True), _ctx([n] * 3, slots, record=True)
    y, win, tokens = _kernel(xbc, dt, p, c1, s1, kctx, record=n)
    want = _twin(xbc, dt, p, c2, s2, tctx)
    twin_win, twin_tokens = tctx.recorded[0]
    assert (y - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
    assert torch.equal(s1, ssm) and torch.equal(c1, conv), "a verify must leave the states as they were"
    assert torch.equal(win, twin_win)
    assert (tokens - twin_tokens).abs().max().item() <= 2e-5 * max(1.0, twin_tokens.abs().max().item())
    acc = torch.tensor(accepted, device=DEVICE)
    sl = torch.tensor(slots, device=DEVICE)
    k.rollback_states(c1[None], s1[None], tokens[None].contiguous(), win[None].contiguous(), sl, acc, n)
    torch_mamba2.rollback_states(c2[None], s2[None], twin_tokens[None], twin_win[None], sl, acc, n)
    assert torch.equal(c1, c2)
    assert (s1 - s2).abs().max().item() <= 2e-5 * max(1.0, s2.abs().max().item())
    # and the rolled-back state is the one a decode of just the accepted tokens leaves
    for b, (slot, a) in enumerate(zip(slots, accepted)):
        c3, s3 = conv.clone(), ssm.clone()
        _twin(xbc[b * n : b * n + a + 1], dt[b * n : b * n + a + 1], p, c3, s3, _ctx([a + 1], [slot]))
        assert (s1[slot] - s3[slot]).abs().max().item() <= 2e-5 * max(1.0, s3[slot].abs().max().item())
        assert torch.equal(c1[slot], c3[slot])


def test_bad_shapes_are_named():
    p, conv, ssm, g = _layer(torch.float32)
    xbc, dt = _inputs(g, 2, torch.float32)
    with pytest.raises(ValueError, match="conv_weight .* must be"):
        k.mamba2_decode(xbc, dt, p["conv_weight"][:, :3], p["conv_bias"], p["dt_bias"], p["A_log"], p["D"], conv, ssm,
                        torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), SHAPE)
    with pytest.raises(ValueError, match="ssm_state"):
        k.mamba2_decode(xbc, dt, p["conv_weight"], p["conv_bias"], p["dt_bias"], p["A_log"], p["D"], conv, ssm[:, :2],
                        torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), SHAPE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need CUDA")
def test_fla_chunked_ssd_matches_the_twin():
    pytest.importorskip("fla")
    g = torch.Generator().manual_seed(3)
    T, H, P, G, N = 300, 8, 64, 2, 128
    x = torch.randn(T, H, P, generator=g).cuda().bfloat16()
    dt, A = torch_mamba2.ssd_gates(torch.randn(T, H, generator=g).cuda(), torch.zeros(H, device="cuda"),
                                   torch.rand(H, generator=g).cuda(), (0.001, float("inf")))
    B, C = (torch.randn(T, G, N, generator=g).cuda().bfloat16() * 0.3 for _ in range(2))
    D, state = torch.randn(H, generator=g).cuda(), torch.randn(H, P, N, generator=g).cuda() * 0.1
    y, s = k.ssd_chunked_fla(x, dt, A, B, C, D, state)
    want_y, want_s = torch_mamba2.ssd_chunked(x, dt, A, B, C, D, 64, state)
    assert (y.float() - want_y.float()).abs().max().item() <= 3e-2 * max(1.0, want_y.float().abs().max().item())
    assert (s - want_s).abs().max().item() <= 1e-2 * max(1.0, want_s.abs().max().item())
