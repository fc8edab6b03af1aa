"""Nemotron-H's MoE on the Triton path (``TritonBackend.relu2_moe``: sigmoid routing in
``route_topk``, ungated ReLU² experts in the pair-wise GEMV, the shared down + combine) against its
twin ``torch_relu2_moe`` (``TorchBackend.relu2_moe``): float and quantized experts, top-k above 8
and not a power of two, a correction bias that makes choices differ from the raw scores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.common import SigmoidRouting  # noqa: E402
from wmtp.kernels.linear import skinny_linear  # noqa: E402
from wmtp.kernels.moe import down_combine, grouped_mm_supported, relu2_gemv, route_topk  # noqa: E402
from wmtp.kernels.torch_relu2_moe import sigmoid_route  # noqa: E402
from wmtp.models.backend import TorchBackend, TritonBackend  # noqa: E402
from wmtp.quant import FP8Block, NVFP4, QuantWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, id="bf16")
F = torch.nn.functional


def _routing(E: int, H: int, top_k: int, seed: int, n_group: int = 1, topk_group: int = 1) -> SigmoidRouting:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(E, H, generator=g) * H**-0.5).to(DEVICE, torch.bfloat16)
    bias = (torch.randn(E, generator=g) * 0.3).to(DEVICE)  # as large as the score spread: reorders choices
    return SigmoidRouting(weight, bias, top_k, n_group, topk_group, True, 2.5)


def _experts(E: int, n: int, k: int, seed: int, dtype: torch.dtype, fmt=None) -> torch.Tensor | QuantWeight:
    w = torch.randn(E, n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    if fmt is None:
        return w.to(DEVICE, dtype)
    return QuantWeight(fmt, {s: v.to(DEVICE) for s, v in fmt.to_model(fmt.quantize(w), n).items()}, k)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: 1e-5 of the largest value (sums in another order); bf16: a few output roundings of the
    chain (each expert's output, the weighted sum) and the interpreter's truncation."""
    rel = 1e-5 if want.dtype == torch.float32 else (2e-2 if DEVICE == "cuda" else 5e-2)
    return got.dtype == want.dtype and (got.float() - want.float()).abs().max().item() <= rel * want.float().abs().max().item()


# (6, 5, -3): every choice below -2 and two padded slots of the 8-wide block, which must never be picked
@pytest.mark.parametrize("E,top_k,shift", [(16, 5, 0.0), (64, 22, 0.0), (512, 22, 0.0), (6, 5, -3.0)])
def test_sigmoid_route_topk_matches_the_reference(E, top_k, shift):
    """The kernel's choice (by score + bias, negative choices included) and weights (unbiased
    scores, renormalised, scaled) equal ``sigmoid_route``'s."""
    H, T = 48, 6
    r = _routing(E, H, top_k, seed=1)
    r = r._replace(bias=r.bias + shift)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want_w, want_i = sigmoid_route(x, r)
    logits = F.linear(x.float(), r.weight.float())
    got = route_topk(logits, top_k, True, sigmoid_bias=r.bias, scale=r.scale)
    assert torch.equal(got.experts.long().sort(-1)[0], want_i.sort(-1)[0])
    order_got, order_want = got.experts.long().argsort(-1), want_i.argsort(-1)
    torch.testing.assert_close(got.weights.gather(1, order_got), want_w.gather(1, order_want), rtol=1e-6, atol=1e-7)


def test_fp32_rows_over_a_bf16_weight():
    """The router GEMM: an fp32 x against the 16-bit weight read as stored, exact products summed
    in fp32, equals F.linear over the weight widened first."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(40, 96, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    x = torch.randn(3, 96, generator=g).to(DEVICE)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("fmt", [None, pytest.param(NVFP4(), id="nvfp4"), pytest.param(FP8Block(), id="fp8")])
def test_relu2_gemv_and_combine_match_the_reference(fmt, dtype):
    E, W, inter, top_k, T = 6, 160, 48, 3, 5
    up, down = _experts(E, inter, W, 4, dtype, fmt), _experts(E, W, inter, 5, dtype, fmt)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, W, generator=g).to(DEVICE, dtype)
    idx = torch.randint(0, E, (T, top_k), generator=g).to(DEVICE)
    dense = (lambda w, e: w[e].dequantize(dtype) if fmt is not None else w[e])  # noqa: E731
    want_h = torch.stack([F.relu(F.linear(x[p // top_k], dense(up, int(e)))).square() for p, e in enumerate(idx.view(-1))])
    assert _close(relu2_gemv(x, up, idx.view(-1), top_k, BLOCK_N=16, BLOCK_K=64), want_h)
    assert _close(relu2_gemv(x, up, idx.view(-1), top_k, BLOCK_N=16, BLOCK_K=64, FMA=True), want_h)
    top_w = torch.rand(T, top_k, generator=g).to(DEVICE)
    y = torch.stack([F.linear(want_h[p], dense(down, int(e))) for p, e in enumerate(idx.view(-1))])  # rounded
    want = (y.view(T, top_k, -1).float() * top_w[..., None]).sum(1).to(dtype)
    assert _close(down_combine(want_h, down, idx, top_w, top_k), want)


@pytest.mark.parametrize("tokens,fmt", [(1, None), (7, None), pytest.param(1, NVFP4(), id="1-nvfp4"),
                                        pytest.param(7, NVFP4(), id="7-nvfp4"),
                                        pytest.param(13, NVFP4(), id="13-nvfp4")])  # 286 pairs: still the GEMV
def test_relu2_moe_matches_the_twin(fmt, tokens, monkeypatch):
    """The whole op at decode sizes (22 experts a token of 64) against ``TorchBackend.relu2_moe``;
    quantized experts beyond ``MAX_GEMV_PAIRS`` pairs stay on the GEMV (``QUANT_GEMV_TOKENS``)."""
    E, H, W, inter, top_k = 64, 96, 32, 48, 22
    dtype = torch.float32
    r = _routing(E, H, top_k, seed=7)
    up, down = _experts(E, inter, W, 8, dtype, fmt), _experts(E, W, inter, 9, dtype, fmt)
    g = torch.Generator().manual_seed(10)
    x, latent = torch.randn(tokens, H, generator=g).to(DEVICE), torch.randn(tokens, W, generator=g).to(DEVICE)
    want = TorchBackend().relu2_moe(x, r, up, down, lambda _: latent)
    import wmtp.kernels.moe as moe

    calls = []
    gemv = moe.relu2_moe_gemv
    monkeypatch.setattr(moe, "relu2_moe_gemv", lambda *a: calls.append(1) or gemv(*a))
    assert _close(TritonBackend().relu2_moe(x, r, up, down, lambda _: latent), want) and calls == [1]


def test_the_router_reads_x_before_the_latent_projection(monkeypatch):
    """At decode sizes the router's launch comes first and the latent projection after it (the
    router's launch then follows the norm's, not the projection's); the result is the twin's."""
    E, H, W, inter, top_k = 64, 96, 32, 48, 22
    r = _routing(E, H, top_k, seed=19)
    up, down = _experts(E, inter, W, 20, torch.float32), _experts(E, W, inter, 21, torch.float32)
    g = torch.Generator().manual_seed(22)
    x, proj = torch.randn(1, H, generator=g).to(DEVICE), torch.randn(W, H, generator=g).to(DEVICE) * H**-0.5
    import wmtp.kernels.moe as moe

    order = []
    router = moe.fp32_linear
    monkeypatch.setattr(moe, "fp32_linear", lambda *a: order.append("router") or router(*a))
    got = TritonBackend().relu2_moe(x, r, up, down, lambda t: order.append("latent") or F.linear(t, proj))
    assert order == ["router", "latent"]
    assert _close(got, TorchBackend().relu2_moe(x, r, up, down, lambda t: F.linear(t, proj)))


def test_relu2_moe_with_router_groups_takes_the_reference_route():
    """Group-limited choice (n_group > 1) has no kernel: the op routes through the twin's routing."""
    E, H, W, inter, top_k = 16, 48, 32, 24, 4
    r = _routing(E, H, top_k, seed=11, n_group=4, topk_group=2)
    up, down = _experts(E, inter, W, 12, torch.float32), _experts(E, W, inter, 13, torch.float32)
    g = torch.Generator().manual_seed(14)
    x, latent = torch.randn(3, H, generator=g).to(DEVICE), torch.randn(3, W, generator=g).to(DEVICE)
    assert _close(TritonBackend().relu2_moe(x, r, up, down, lambda _: latent),
                  TorchBackend().relu2_moe(x, r, up, down, lambda _: latent))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_relu2_experts_gpu():
    """Prefill-sized: ungated experts through the grouped GEMMs, bf16, the Nemotron-3-Super expert
    shape at a few experts."""
    E, H, W, inter, top_k, T = 32, 4096, 1024, 2688, 22, 96
    r = _routing(E, H, top_k, seed=15)
    up, down = _experts(E, inter, W, 16, torch.bfloat16), _experts(E, W, inter, 17, torch.bfloat16)
    g = torch.Generator().manual_seed(18)
    x = torch.randn(T, H, generator=g).to(DEVICE, torch.bfloat16)
    latent = torch.randn(T, W, generator=g).to(DEVICE, torch.bfloat16)
    assert grouped_mm_supported(latent)
    assert _close(TritonBackend().relu2_moe(x, r, up, down, lambda _: latent),
                  TorchBackend().relu2_moe(x, r, up, down, lambda _: latent))
