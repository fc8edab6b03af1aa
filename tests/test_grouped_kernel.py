"""The grouped GEMM over quantized experts (``wmtp.kernels.grouped``) against its twin, ``F.linear``
per expert over ``QuantWeight.dequantize``: NVFP4 and block FP8, fp32 and bf16, experts with no
rows, with one row, and with several row blocks; N and K not multiples of the tiles; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.helpers import close_to_twin as _close  # noqa: E402

from wmtp.kernels.grouped import grouped_quant_mm  # noqa: E402
from wmtp.quant import FP8Block, NVFP4, QuantWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, id="bf16")


def _experts(fmt, e: int, n: int, k: int, seed: int) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    parts = [fmt.to_model(fmt.quantize(torch.randn(n, k, generator=g) * k**-0.5), n) for _ in range(e)]
    return QuantWeight(fmt, {s: torch.stack([p[s] for p in parts]).to(DEVICE) for s in fmt.suffixes}, k)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("fmt", [NVFP4(), FP8Block()], ids=["nvfp4", "fp8"])
def test_grouped_quant_mm_matches_the_twin(fmt, dtype):
    k = 160 if isinstance(fmt, NVFP4) else 200  # several K steps, the last partial
    w = _experts(fmt, 5, 40, k, seed=1)  # N = 40: two column blocks of 32, the second partial
    counts = torch.tensor([3, 0, 37, 1, 20])  # an empty expert; 37 rows: three row blocks of 16
    offs = torch.cumsum(counts, 0).to(torch.int32).to(DEVICE)
    x = torch.randn(int(counts.sum()), k, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    got = grouped_quant_mm(x, w, offs, block_m=16, block_n=32, block_k=64 if isinstance(fmt, NVFP4) else 32)
    dense = w.dequantize(dtype)
    want = torch.cat([F.linear(rows, dense[e]) for e, rows in enumerate(torch.split(x, counts.tolist()))])
    assert _close(got, want)


def test_grouped_quant_mm_bad_input_names_the_problem():
    w = _experts(NVFP4(), 2, 8, 32, seed=0)
    offs = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"grouped_quant_mm: x \(2, 48\) must be \[M, 32\]"):
        grouped_quant_mm(torch.zeros(2, 48, device=DEVICE), w, offs)
    with pytest.raises(ValueError, match=r"grouped_quant_mm: offs \(3,\) must be \[2\]"):
        grouped_quant_mm(torch.zeros(2, 32, device=DEVICE), w, torch.tensor([1, 2, 2], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="block_k 24 must be a power of 2"):
        grouped_quant_mm(torch.zeros(2, 32, device=DEVICE), w, offs, block_k=24)
