"""The skinny decode-size linear kernel (``wmtp.kernels.linear``) against its twin ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from wmtp.kernels.common import MAX_COUNTERS, arrival_counters  # noqa: E402
from wmtp.kernels.linear import (MAX_ROWS, LinearTiles, decode_linear, fp32_linear, linear_tiles,  # noqa: E402
                                 skinny_linear)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, id="bf16")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: 1e-5 of the largest value; bf16: an output rounding (2^-8) plus the CPU interpreter's
    truncating casts."""
    rel = 1e-5 if want.dtype == torch.float32 else 1e-2
    return got.dtype == want.dtype and got.shape == want.shape and \
        (got.float() - want.float()).abs().max().item() <= rel * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 7, MAX_ROWS])
@pytest.mark.parametrize("splits", [1, 3])  # one program per column block, or split K summed by the last to arrive
def test_skinny_linear_matches_f_linear(rows, splits, dtype):
    g = torch.Generator().manual_seed(rows + splits)
    x = torch.randn(rows, 200, generator=g).to(DEVICE, dtype)  # K over several blocks, not a multiple of them
    w = (torch.randn(70, 200, generator=g) * 200**-0.5).to(DEVICE, dtype)  # N not a multiple of the block
    b = torch.randn(70, generator=g).to(DEVICE, dtype)
    tiles = LinearTiles(16, 32, splits, 4)
    assert _close(skinny_linear(x, w, tiles=tiles), F.linear(x, w))
    assert _close(skinny_linear(x, w, b, tiles=tiles), F.linear(x, w, b))
    assert int(arrival_counters(x.device, 8)[:8].abs().sum()) == 0  # left zeroed for the next launch


def test_a_one_row_vocab_projection_takes_the_kernel():
    """A draft step's lm_head (1 row, > 16384 outputs) takes the kernel's 64 x 256 tiles, and
    ``decode_linear`` computes it as F.linear does; 8 rows (the verify) stay on cuBLAS."""
    assert linear_tiles(1, 20_000, 64) == LinearTiles(64, 256, 1, 4)
    assert linear_tiles(8, 20_000, 64) is None
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 64, generator=g).to(DEVICE)
    w = (torch.randn(20_000, 64, generator=g) * 0.125).to(DEVICE)
    assert _close(decode_linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 7, MAX_ROWS + 3])  # the kernel, and F.linear past its rows
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])  # x's dtype (its 16-bit dot), or widened
def test_fp32_linear_of_a_16_bit_x_is_the_fp32_product(rows, w_dtype):
    """A router's fp32 logits from a bf16 x and a 16-bit weight: each product exact, summed in fp32 (the
    fp64 product within fp32 sums' error, far below a bf16 rounding's), as F.linear over fp32 copies."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(70, 200, generator=g) * 200**-0.5).to(DEVICE, w_dtype)
    got = fp32_linear(x, w)
    assert got.dtype == torch.float32
    assert _close(got, F.linear(x.double(), w.double()).float())
    assert _close(got, F.linear(x.float(), w.float()))
    with pytest.raises(ValueError, match="skinny_linear: out_dtype torch.float16 for torch.bfloat16 x"):
        skinny_linear(x[:1], w, out_dtype=torch.float16)


def test_skinny_linear_keeps_leading_dims_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    w = torch.randn(40, 64, generator=g).to(DEVICE)
    assert _close(skinny_linear(x, w), F.linear(x, w))
    wide = torch.randn(5, 128, generator=g).to(DEVICE)
    assert _close(skinny_linear(wide[:, :64], w), F.linear(wide[:, :64], w))  # rows with a stride


def test_bad_input_names_the_tensor():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"skinny_linear: weight \(4, 9\)"):
        skinny_linear(x, torch.zeros(4, 9))
    with pytest.raises(ValueError, match=r"skinny_linear: x has 17 rows"):
        skinny_linear(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"skinny_linear: bias \(3,\) must be \[4\]"):
        skinny_linear(x, torch.zeros(4, 8), torch.zeros(3))
    with pytest.raises(ValueError, match="arrival_counters: .* at most"):
        arrival_counters(x.device, MAX_COUNTERS + 1)


def test_arrival_counters_are_one_fixed_buffer():
    """Captured graphs keep the counters' address: a later, larger request must not reallocate."""
    dev = torch.device(DEVICE)
    first = arrival_counters(dev, 4)
    assert arrival_counters(dev, MAX_COUNTERS).data_ptr() == first.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams that run at once need a GPU")
def test_split_k_launches_on_concurrent_streams_count_apart():
    """Split-K launches on two streams at once each take their stream's counters: with one buffer
    for both, a column block's "last" program is decided by the other launch's arrivals too, and
    its sum misses splits or comes out twice."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 4096, generator=g).to(DEVICE, torch.bfloat16)
    ws = [(torch.randn(4096, 4096, generator=g) * 4096**-0.5).to(DEVICE, torch.bfloat16) for _ in range(2)]
    want = [skinny_linear(x, w, tiles=LinearTiles(32, 128, 8, 4)) for w in ws]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        theirs = arrival_counters(x.device, 1).data_ptr()
    assert theirs != arrival_counters(x.device, 1).data_ptr()
    for _ in range(50):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = [skinny_linear(x, ws[1], tiles=LinearTiles(32, 128, 8, 4)) for _ in range(4)]
        a = [skinny_linear(x, ws[0], tiles=LinearTiles(32, 128, 8, 4)) for _ in range(4)]
        torch.cuda.current_stream().wait_stream(side)
        assert all(torch.equal(t, want[0]) for t in a) and all(torch.equal(t, want[1]) for t in b)
