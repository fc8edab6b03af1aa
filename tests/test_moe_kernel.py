"""The Triton decode-sized MoE kernels (routing, SwiGLU GEMV, down + combine) and the whole fused
path against their twins: the reference router / per-expert loop (``TorchBackend.moe``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.common import SharedExpert  # noqa: E402
from wmtp.kernels.moe import down_combine, moe_gemv, route, route_topk, routed_experts_grouped, swiglu_gemv  # noqa: E402
from wmtp.models.backend import TorchBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(E: int, H: int, inter: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) * 0.5
    gate_up = torch.randn(E, 2 * inter, H, generator=g) * H**-0.5
    down = torch.randn(E, H, inter, generator=g) * inter**-0.5
    return [t.to(DEVICE, dtype) for t in (router, gate_up, down)]


def _shared(H: int, inter: int, seed: int, dtype=torch.float32) -> SharedExpert:
    g = torch.Generator().manual_seed(seed)
    ws = (torch.randn(inter, H, generator=g) * H**-0.5, torch.randn(inter, H, generator=g) * H**-0.5,
          torch.randn(H, inter, generator=g) * inter**-0.5, torch.randn(1, H, generator=g) * H**-0.5)
    return SharedExpert(*(w.to(DEVICE, dtype) for w in ws))


@pytest.mark.parametrize("E,top_k,norm", [(8, 2, True), (60, 8, False), (256, 8, True)])
def test_route_topk_matches_reference(E, top_k, norm):
    g = torch.Generator().manual_seed(E)
    logits = (torch.randn(5, E, generator=g) * 3).to(DEVICE)
    probs_w, probs_i, no_shared = route_topk(logits, top_k, norm)
    want_w, want_i = route(logits, torch.eye(E, device=DEVICE), top_k, norm)  # identity router: logits as given
    assert torch.equal(probs_i.long(), want_i)
    assert torch.allclose(probs_w, want_w, atol=1e-6)
    assert no_shared is None


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 rounding)")])])
def test_route_topk_computes_the_shared_gate_logit(dtype):
    """The shared expert's gate logit x . w comes out of the routing launch, rounded as F.linear's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1500, generator=g).to(DEVICE, dtype)  # hidden over more than one block
    gate = (torch.randn(1, 1500, generator=g) * 0.05).to(DEVICE, dtype)
    r = route_topk(torch.randn(4, 8, generator=g).to(DEVICE), 2, True, x, gate)
    want = torch.nn.functional.linear(x, gate).float().view(-1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    assert r.shared_logit.shape == (4,) and (r.shared_logit - want).abs().max().item() <= tol


def test_swiglu_gemv_matches_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 80, 300, generator=g).to(DEVICE)  # N = 40 per half, K not multiples of the blocks
    x = torch.randn(3, 300, generator=g).to(DEVICE)
    idx = torch.tensor([4, 0, 0, 2, 4, 1], device=DEVICE)  # 3 tokens x top-2
    xs = x.repeat_interleave(2, dim=0)
    want = torch.nn.functional.silu(torch.einsum("pnk,pk->pn", w[idx, :40], xs)) * torch.einsum("pnk,pk->pn", w[idx, 40:], xs)
    assert torch.allclose(swiglu_gemv(x, w[:, :40], w[:, 40:], idx, 2), want, atol=1e-4)
    # one fixed expert (the shared expert path)
    single = swiglu_gemv(x, w[2:3, :40], w[2:3, 40:], None)
    assert torch.allclose(single, torch.nn.functional.silu(x @ w[2, :40].T) * (x @ w[2, 40:].T), atol=1e-4)


@pytest.mark.parametrize("with_shared", [False, True])
def test_down_combine_matches_reference(with_shared):
    g = torch.Generator().manual_seed(1)
    down = torch.randn(6, 50, 140, generator=g).to(DEVICE)
    h = torch.randn(4 * 3, 140, generator=g).to(DEVICE)
    idx = torch.randint(0, 6, (4, 3), generator=g).to(DEVICE)
    top_w = torch.rand(4, 3, generator=g).to(DEVICE)
    y = torch.einsum("pnk,pk->pn", down[idx.view(-1)], h).view(4, 3, 50)
    want = (y * top_w[..., None]).sum(1)
    shared = None
    if with_shared:  # the shared expert's down projection (Ks = 300: more than one K block) and gate
        hs, ws = torch.randn(4, 300, generator=g).to(DEVICE), (torch.randn(50, 300, generator=g) * 0.1).to(DEVICE)
        logit = torch.randn(4, generator=g).to(DEVICE)
        shared = (hs, ws, logit)
        want = want + torch.sigmoid(logit)[:, None] * (hs @ ws.T)
    assert torch.allclose(down_combine(h, down, idx, top_w, 3, shared), want, atol=1e-4)


@pytest.mark.parametrize("tokens,top_k,norm,shared", [(1, 2, True, False), (7, 4, False, True), (13, 3, True, True)])
def test_routed_experts_match_reference(tokens, top_k, norm, shared):
    router, gate_up, down = _weights(E=8, H=64, inter=48, seed=tokens)
    sh = _shared(64, 40, seed=tokens) if shared else None
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, norm, sh)
    got = moe_gemv(x, router, gate_up, down, top_k, norm, sh)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("tokens,top_k", [(40, 8), (300, 4)])
def test_grouped_experts_match_reference(tokens, top_k):
    """Prefill-sized MoE: pairs sorted by expert through torch's grouped GEMM (bf16, as it runs on
    the GPU; torch has a CPU fallback), some experts receiving no rows; with a shared expert."""
    router, gate_up, down = _weights(E=16, H=64, inter=32, seed=tokens, dtype=torch.bfloat16)
    sh = _shared(64, 24, seed=tokens, dtype=torch.bfloat16)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, True, sh).float()
    got = routed_experts_grouped(x, router, gate_up, down, top_k, True, sh).float()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_shape_errors_name_the_tensors():
    with pytest.raises(ValueError, match="swiglu_gemv: weight"):
        swiglu_gemv(torch.zeros(2, 8), torch.zeros(3, 4, 9), torch.zeros(3, 4, 9), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="swiglu_gemv: idx"):
        swiglu_gemv(torch.zeros(2, 8), torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="down_combine: shared"):
        down_combine(torch.zeros(4, 8), torch.zeros(3, 5, 8), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), 2,
                     shared=(torch.zeros(2, 6), torch.zeros(4, 6), torch.zeros(2)))
    with pytest.raises(ValueError, match="route_topk: shared_gate"):
        route_topk(torch.zeros(2, 4), 2, True, torch.zeros(2, 8), torch.zeros(1, 6))
    with pytest.raises(ValueError, match="route_topk: top_k"):
        route_topk(torch.zeros(2, 4), 5, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_35b_expert_shape_gpu():
    """The 35B expert shape (hidden 2048, intermediate 512, shared expert 512), 7 tokens x top-8, bf16."""
    router, gate_up, down = _weights(E=64, H=2048, inter=512, seed=3, dtype=torch.bfloat16)
    sh = _shared(2048, 512, seed=4, dtype=torch.bfloat16)
    x = torch.randn(7, 2048, device=DEVICE, dtype=torch.bfloat16)
    want = TorchBackend().moe(x, router, gate_up, down, 8, True, sh).float()
    got = moe_gemv(x, router, gate_up, down, 8, True, sh).float()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()
