"""The Triton decode-sized MoE kernels (routing, SwiGLU GEMV, down + combine) and the whole fused
path against their twins: the reference router / per-expert loop (``TorchBackend.moe``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.common import SharedExpert  # noqa: E402
from wmtp.kernels.moe import (  # noqa: E402
    down_combine, moe_gemv, route, route_topk, routed_experts_grouped, shared_expert_reference, swiglu_gemv,
    swiglu_gemv_with_shared)
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


def _swiglu_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` rounded per projection as the reference MoE rounds it."""
    F = torch.nn.functional
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


# Triton's CPU interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest), up to an ulp (2^-7)
# low on each of the four roundings of a SwiGLU + down chain: 2-3% of the largest value measured.
BF16_TOL = 2e-2 if DEVICE == "cuda" else 5e-2


# fp32: sums of a few hundred products accumulated in another order (tiles, BLAS) differ by a few
# ulps of the terms, ~1e-6 of the largest value at these sizes; 1e-5 of it leaves room and still
# catches a dropped or doubled term.
FP32_TOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The file's tolerances, relative to the largest value: ``FP32_TOL`` in fp32, ``BF16_TOL`` in bf16."""
    rel = FP32_TOL if want.dtype == torch.float32 else BF16_TOL
    tol = rel * want.float().abs().max().item()
    return got.dtype == want.dtype and (got.float() - want.float()).abs().max().item() <= tol


BF16 = pytest.param(torch.bfloat16, id="bf16")


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
    # N = 40 per half, K not multiples of the blocks; weights scaled as initialised (1/sqrt(K))
    w = (torch.randn(5, 80, 300, generator=g) * 300**-0.5).to(DEVICE)
    x = torch.randn(3, 300, generator=g).to(DEVICE)
    idx = torch.tensor([4, 0, 0, 2, 4, 1], device=DEVICE)  # 3 tokens x top-2
    xs = x.repeat_interleave(2, dim=0)
    want = torch.nn.functional.silu(torch.einsum("pnk,pk->pn", w[idx, :40], xs)) * torch.einsum("pnk,pk->pn", w[idx, 40:], xs)
    assert _close(swiglu_gemv(x, w[:, :40], w[:, 40:], idx, 2), want)
    # one expert for every token
    single = swiglu_gemv(x, w[2:3, :40], w[2:3, 40:], torch.zeros(3, dtype=torch.long, device=DEVICE))
    assert _close(single, torch.nn.functional.silu(x @ w[2, :40].T) * (x @ w[2, 40:].T))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("inter_s", [40, 24, 56])  # the shared expert's N equal to, below, above the routed N
def test_swiglu_gemv_with_shared_matches_reference(inter_s, tokens, dtype):
    """One launch: the routed pairs' rows and one shared-expert row per token, each as the reference."""
    g = torch.Generator().manual_seed(inter_s + tokens)
    w = (torch.randn(5, 80, 300, generator=g) * 300**-0.5).to(DEVICE, dtype)  # routed N = 40, K over two blocks
    sg, su = ((torch.randn(inter_s, 300, generator=g) * 300**-0.5).to(DEVICE, dtype) for _ in range(2))
    x = torch.randn(tokens, 300, generator=g).to(DEVICE, dtype)
    idx = torch.randint(0, 5, (tokens * 3,), generator=g).to(DEVICE)  # top-3
    routed, shared = swiglu_gemv_with_shared(x, w[:, :40], w[:, 40:], idx, 3, sg, su)
    want = torch.cat([_swiglu_reference(x[p // 3, None], w[e, :40], w[e, 40:]) for p, e in enumerate(idx.tolist())])
    assert routed.shape == (tokens * 3, 40) and _close(routed, want)
    assert shared.shape == (tokens, inter_s) and _close(shared, _swiglu_reference(x, sg, su))
    fma = swiglu_gemv_with_shared(x, w[:, :40], w[:, 40:], idx, 3, sg, su, FMA=True)  # the FMA form (NVFP4's default)
    assert _close(fma[0], want) and _close(fma[1], _swiglu_reference(x, sg, su))


# 3, 6: neither a power of two, the padded expert slots must not count; 12: past MAX_FUSED_TOP_K (pair-wise
# rows, then the combine) without the shared expert
@pytest.mark.parametrize("top_k", [3, 6, 12])
@pytest.mark.parametrize("with_shared", [False, True])
def test_down_combine_matches_reference(with_shared, top_k):
    g = torch.Generator().manual_seed(top_k)
    down = (torch.randn(8, 50, 140, generator=g) * 140**-0.5).to(DEVICE)
    h = torch.randn(4 * top_k, 140, generator=g).to(DEVICE)
    idx = torch.randint(0, 8, (4, top_k), generator=g).to(DEVICE)
    top_w = torch.rand(4, top_k, generator=g).to(DEVICE)
    y = torch.einsum("pnk,pk->pn", down[idx.view(-1)], h).view(4, top_k, 50)
    want = (y * top_w[..., None]).sum(1)
    shared = None
    if with_shared:  # the shared expert's down projection (Ks = 300: more than one K block) and gate
        hs, ws = torch.randn(4, 300, generator=g).to(DEVICE), (torch.randn(50, 300, generator=g) * 300**-0.5).to(DEVICE)
        logit = torch.randn(4, generator=g).to(DEVICE)
        shared = (hs, ws, logit)
        want = want + torch.sigmoid(logit)[:, None] * (hs @ ws.T)
    assert _close(down_combine(h, down, idx, top_w, top_k, shared), want)


@pytest.mark.parametrize("tokens,top_k,norm,shared", [(1, 2, True, False), (7, 4, False, True), (13, 3, True, True)])
def test_routed_experts_match_reference(tokens, top_k, norm, shared):
    router, gate_up, down = _weights(E=8, H=64, inter=48, seed=tokens)
    sh = _shared(64, 40, seed=tokens) if shared else None
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, norm, sh)
    got = moe_gemv(x, router, gate_up, down, top_k, norm, sh)
    assert _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (7, 6)])
@pytest.mark.parametrize("inter_s", [48, 40])  # the shared expert's intermediate size equal to the routed one, or not
def test_moe_gemv_with_shared_matches_reference(inter_s, tokens, top_k, dtype):
    """The whole decode path (routing, the folded routed + shared SwiGLU, down + combine) against
    ``TorchBackend.moe`` (whose shared part is ``shared_expert_reference``)."""
    router, gate_up, down = _weights(E=8, H=64, inter=48, seed=tokens, dtype=dtype)
    sh = _shared(64, inter_s, seed=tokens + 1, dtype=dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, True, sh)
    assert _close(moe_gemv(x, router, gate_up, down, top_k, True, sh), want)
    # the shared expert alone is a large part of the output: a wrong shared row would not pass unseen
    assert shared_expert_reference(x, sh).float().abs().max() > 0.1 * want.float().abs().max()


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


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_combine_sorted_matches_scatter_then_sum(dtype):
    """The expert-sorted rows combined through their positions equal scattering them back to pair
    order, widening to fp32, weighting and summing over k (the reference it replaced); N past a
    column block."""
    from wmtp.kernels.moe import combine_sorted

    g = torch.Generator().manual_seed(1)
    T, k, N = 5, 3, 300
    y_sorted = torch.randn(T * k, N, generator=g).to(DEVICE, dtype)
    order = torch.randperm(T * k, generator=g).to(DEVICE)
    top_w = torch.rand(T, k, generator=g).to(DEVICE)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    want = (y.view(T, k, N).float() * top_w[..., None]).sum(1).to(dtype)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(T * k, device=DEVICE)
    got = combine_sorted(y_sorted, pos, top_w, block_n=128)
    assert got.dtype == dtype and _close(got, want)
    with pytest.raises(ValueError, match="combine_sorted: y_sorted"):
        combine_sorted(y_sorted[:-1], pos[:-1], top_w)
    with pytest.raises(ValueError, match=r"combine_sorted: .* shared_logit \(\d+,\) must hold .* shared rows"):
        combine_sorted(y_sorted, pos, top_w, shared_logit=torch.zeros(T, device=DEVICE))  # no shared rows in y
    with pytest.raises(ValueError, match=r"shared_logit \(1,\)"):
        combine_sorted(torch.cat([y_sorted, y_sorted[:T]]), pos, top_w, shared_logit=torch.zeros(1, device=DEVICE))


def test_shape_errors_name_the_tensors():
    with pytest.raises(ValueError, match="swiglu_gemv: weight"):
        swiglu_gemv(torch.zeros(2, 8), torch.zeros(3, 4, 9), torch.zeros(3, 4, 9), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="swiglu_gemv: idx"):
        swiglu_gemv(torch.zeros(2, 8), torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), torch.zeros(3, dtype=torch.long), 2)
    x, w = torch.zeros(2, 8), torch.zeros(3, 4, 8)
    idx = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"swiglu_gemv_with_shared: shared_gate \(5, 6\).*must be \[Ns, 8\]"):
        swiglu_gemv_with_shared(x, w, w, idx, 2, torch.zeros(5, 6), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="swiglu_gemv_with_shared: shared_gate .* torch.float64 must be"):
        swiglu_gemv_with_shared(x, w, w, idx, 2, torch.zeros(5, 8, dtype=torch.float64), torch.zeros(5, 8))
    with pytest.raises(ValueError, match="swiglu_gemv_with_shared: shared_up"):
        swiglu_gemv_with_shared(x, w, w, idx, 2, torch.zeros(5, 8), torch.zeros(6, 8))
    with pytest.raises(ValueError, match=r"down_combine: h \(5, 8\) must be \[T \* top_k, K\]"):
        down_combine(torch.zeros(5, 8), w, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match=r"down_combine: idx \(2, 3\) and top_w \(2, 2\) must be \[2, 2\]"):
        down_combine(torch.zeros(4, 8), w, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2), 2)
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
