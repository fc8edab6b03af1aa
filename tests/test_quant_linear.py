"""The skinny linear kernel over quantized weights (``wmtp.kernels.linear``, ``quant_tiles``) against
its twin ``F.linear(x, w.dequantize(x.dtype))``, for NVFP4 and block FP8: rows 1..64, N and K not
multiples of the tiles, split K, packed projections whose parts keep their own scales, bias, the
dequantizing path above the kernel's rows, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.helpers import close_to_twin as _close  # noqa: E402

from wmtp.kernels.common import linear_epilogue  # noqa: E402
from wmtp.kernels.linear import MAX_ROWS, QUANT_MAX_ROWS, LinearTiles, decode_linear, skinny_linear  # noqa: E402
from wmtp.quant import FP8Block, FP8Tensor, NVFP4, QuantWeight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = pytest.param(torch.bfloat16, id="bf16")


def _weight(fmt, parts: list[int], k: int, seed: int) -> QuantWeight:
    """A packed projection: each part quantized on its own (its own scales), rows concatenated."""
    g = torch.Generator().manual_seed(seed)
    per_part = [fmt.to_model(fmt.quantize(torch.randn(n, k, generator=g) * k**-0.5), n) for n in parts]
    t = {s: torch.cat([p[s] for p in per_part]).to(DEVICE) for s in fmt.suffixes}
    return QuantWeight(fmt, t, k)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 7, MAX_ROWS, QUANT_MAX_ROWS])
@pytest.mark.parametrize("fmt", [NVFP4(), FP8Block(), FP8Tensor()], ids=["nvfp4", "fp8", "fp8_tensor"])
def test_quant_linear_matches_the_twin(fmt, rows, dtype):
    k = 160 if isinstance(fmt, NVFP4) else 200  # several K steps, the last partial (NVFP4: K a multiple of 16)
    w = _weight(fmt, [40, 23, 7], k, seed=rows)  # N = 70, not a multiple of the tile; three parts' own scales
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    b = torch.randn(70, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    want = F.linear(x, w.dequantize(dtype))
    assert _close(skinny_linear(x, w, tiles=LinearTiles(16, 32, 1, 4)), want)
    assert _close(skinny_linear(x, w, b, tiles=LinearTiles(32, 64, 1, 4)), F.linear(x, w.dequantize(dtype), b))
    assert _close(skinny_linear(x, w, b, tiles=LinearTiles(16, 32, 3, 4)), F.linear(x, w.dequantize(dtype), b))  # split K
    assert _close(decode_linear(x, w.rows(slice(40, 63))), F.linear(x, w.rows(slice(40, 63)).dequantize(dtype)))
    if rows == 1:  # the FMA candidate (one row): unsplit, split K with bias
        assert _close(skinny_linear(x, w, tiles=LinearTiles(16, 32, 1, 4, gemv=True)), want)
        assert _close(skinny_linear(x, w, b, tiles=LinearTiles(32, 64, 3, 4, gemv=True)),
                      F.linear(x, w.dequantize(dtype), b))


@pytest.mark.parametrize("fmt", [NVFP4(), FP8Block()], ids=["nvfp4", "fp8"])
def test_quant_linear_rows_beyond_fp16s_range(fmt):
    """The kernel's fp16 dot scales each row of a 16-bit x by a power of 2: rows of 1e6 (past fp16's
    65504) and 1e-6 (below its normals) come out as exact as a row of 1, each to its own magnitude."""
    w = _weight(fmt, [40], 128, seed=3)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    x = (x * torch.tensor([[1e6], [1.0], [1e-6]])).to(DEVICE, torch.bfloat16)
    got, want = skinny_linear(x, w, tiles=LinearTiles(16, 64, 1, 4)), F.linear(x, w.dequantize(torch.bfloat16))
    assert torch.isfinite(got).all()
    for r in range(3):
        assert _close(got[r], want[r]), r


@pytest.mark.parametrize("fmt", [None, NVFP4(), FP8Block()], ids=["bf16", "nvfp4", "fp8"])
@pytest.mark.parametrize("rows,tiles", [(1, LinearTiles(16, 32, 3, 4, gemv=True)), (7, LinearTiles(16, 32, 1, 4)),
                                        (7, LinearTiles(32, 64, 3, 4))], ids=["gemv_split", "dots", "dots_split"])
def test_epilogue_in_the_launch_matches_the_ops_after_f_linear(fmt, rows, tiles):
    """ReLU² and a residual sum in the kernel's epilogue (a ReLU² MLP's up projection, the shared
    expert's down projection summed with the routed experts'): as ``linear_epilogue`` after the
    kernel's own linear (each op rounded to bf16; against ``F.linear``'s the square would double its
    summation-order difference), on every path the output takes (one launch, or the last split to
    arrive)."""
    w = _weight(fmt or NVFP4(), [40, 30], 160, seed=rows)
    w = w.dequantize(torch.bfloat16) if fmt is None else w
    if fmt is None and tiles.gemv:
        tiles = tiles._replace(gemv=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 160, generator=g).to(DEVICE, torch.bfloat16)
    add = torch.randn(rows, 70, generator=g).to(DEVICE, torch.bfloat16)
    y = skinny_linear(x, w, tiles=tiles)
    assert _close(y, F.linear(x, w if fmt is None else w.dequantize(torch.bfloat16)))
    assert _close(skinny_linear(x, w, tiles=tiles, relu2=True), linear_epilogue(y, relu2=True))
    assert _close(skinny_linear(x, w, tiles=tiles, add=add), linear_epilogue(y, add=add))
    assert _close(skinny_linear(x, w, tiles=tiles, relu2=True, add=add), linear_epilogue(y, True, add))
    y = decode_linear(x, w)  # the engine's entry: the kernel at its own tiles, or cuBLAS and the ops after it
    assert _close(decode_linear(x, w, relu2=True, add=add), linear_epilogue(y, True, add))
    wide = torch.randn(rows, 2 * 70, generator=g).to(DEVICE, torch.bfloat16)  # no unit stride on N: after the linear
    assert _close(decode_linear(x, w, add=wide[:, ::2]), linear_epilogue(y, add=wide[:, ::2]))
    with pytest.raises(ValueError, match=r"skinny_linear: add \(7, 69\) torch.bfloat16 must be \(7, 70\)"):
        skinny_linear(torch.zeros(7, 160, device=DEVICE, dtype=torch.bfloat16), w, add=add[:1].expand(7, 70)[:, :69])


def test_quant_linear_above_the_kernels_rows_dequantizes():
    w = _weight(NVFP4(), [24], 32, seed=0)
    x = torch.randn(QUANT_MAX_ROWS + 3, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert _close(decode_linear(x, w), F.linear(x, w.dequantize(x.dtype)))


def test_quant_linear_bad_input_names_the_problem():
    w = _weight(NVFP4(), [8], 32, seed=0)
    with pytest.raises(ValueError, match=r"skinny_linear: weight \(8, 32\) nvfp4 must be \[N, 48\]"):
        skinny_linear(torch.zeros(2, 48, device=DEVICE), w)
    with pytest.raises(ValueError, match=f"x has {QUANT_MAX_ROWS + 1} rows"):
        skinny_linear(torch.zeros(QUANT_MAX_ROWS + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="gemv tiles take one row"):
        skinny_linear(torch.zeros(2, 32, device=DEVICE), w, tiles=LinearTiles(16, 32, 1, 4, gemv=True))
    with pytest.raises(ValueError, match="block_k 24 must be a power of 2"):
        skinny_linear(torch.zeros(2, 32, device=DEVICE), w, tiles=LinearTiles(16, 24, 1, 4))
    with pytest.raises(ValueError, match="FP8 block_k 48 must divide"):
        skinny_linear(torch.zeros(2, 32, device=DEVICE), _weight(FP8Block(), [8], 32, seed=0),
                      tiles=LinearTiles(16, 48, 1, 4))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("fmt", [NVFP4(), FP8Block(), FP8Tensor()], ids=["nvfp4", "fp8", "fp8_tensor"])
def test_dequantize_kernel_equals_the_twin_to_the_bit(fmt, dtype):
    """The prefill path's one-pass dequantization against ``QuantWeight.dequantize``: experts
    [E, N, K] (K over several tiles, the last partial), a packed projection's rows, odd row counts.
    (The CPU interpreter's casts to bf16 truncate: there, within one bf16 step.)"""
    import os

    from wmtp.kernels.quant_tiles import dequantize

    exact = dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") != "1"

    k = 576 if isinstance(fmt, NVFP4) else 600
    g = torch.Generator().manual_seed(0)
    experts = QuantWeight(fmt, {s: v.to(DEVICE) for s, v in fmt.to_model(
        fmt.quantize(torch.randn(3, 12, k, generator=g)), 12).items()}, k)
    for w in (experts, experts[1], _weight(fmt, [5, 8], k, seed=3).rows(slice(5, 13)), _weight(fmt, [7], k, seed=4)):
        got, want = dequantize(w, dtype), w.dequantize(dtype)
        assert torch.equal(got, want) if exact else torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
