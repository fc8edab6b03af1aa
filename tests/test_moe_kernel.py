"""The Triton routed-expert GEMV (decode-sized MoE) against its twin, the reference grouped MoE."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.moe import expert_gemv, routed_experts_gemv, routed_experts_grouped  # noqa: E402
from wmtp.models.backend import TorchBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(E: int, H: int, inter: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) * 0.5
    gate_up = torch.randn(E, 2 * inter, H, generator=g) * H**-0.5
    down = torch.randn(E, H, inter, generator=g) * inter**-0.5
    return [t.to(DEVICE, dtype) for t in (router, gate_up, down)]


def test_expert_gemv_matches_gather_matmul():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 40, 300, generator=g).to(DEVICE)  # N, K not multiples of the blocks
    x = torch.randn(7, 300, generator=g).to(DEVICE)
    idx = torch.tensor([4, 0, 0, 2, 4, 1, 3], device=DEVICE)
    want = torch.einsum("pnk,pk->pn", w[idx], x)
    assert torch.allclose(expert_gemv(x, w, idx), want, atol=1e-4)


@pytest.mark.parametrize("tokens,top_k,norm", [(1, 2, True), (7, 4, False), (13, 3, True)])
def test_routed_experts_match_reference(tokens, top_k, norm):
    router, gate_up, down = _weights(E=8, H=64, inter=48, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, norm)
    got = routed_experts_gemv(x, router, gate_up, down, top_k, norm)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("tokens,top_k", [(40, 8), (300, 4)])
def test_grouped_experts_match_reference(tokens, top_k):
    """Prefill-sized MoE: pairs sorted by expert through torch's grouped GEMM (bf16, as it runs on
    the GPU; torch has a CPU fallback), some experts receiving no rows."""
    router, gate_up, down = _weights(E=16, H=64, inter=32, seed=tokens, dtype=torch.bfloat16)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    want = TorchBackend().moe(x, router, gate_up, down, top_k, True).float()
    got = routed_experts_grouped(x, router, gate_up, down, top_k, True).float()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_shape_errors_name_the_tensors():
    with pytest.raises(ValueError, match="expert_gemv"):
        expert_gemv(torch.zeros(2, 8), torch.zeros(3, 4, 9), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_35b_expert_shape_gpu():
    """The 35B expert shape (hidden 2048, intermediate 512), 7 tokens x top-8, bf16."""
    router, gate_up, down = _weights(E=64, H=2048, inter=512, seed=3, dtype=torch.bfloat16)
    x = torch.randn(7, 2048, device=DEVICE, dtype=torch.bfloat16)
    want = TorchBackend().moe(x, router, gate_up, down, 8, True).float()
    got = routed_experts_gemv(x, router, gate_up, down, 8, True).float()
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()
