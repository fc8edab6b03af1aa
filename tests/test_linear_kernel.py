"""The Triton skinny linear (``wmtp.kernels.linear``) against its twin, F.linear: both row-tile
paths (broadcast multiply-sum below 16 rows, tl.dot at 16), split-K on and off, bias, strided
operands, determinism, the default configuration's invariants and the argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from wmtp.kernels.linear import MAX_ROWS, default_launch, skinny_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# Forced configurations: SPLIT_K 1 (one launch), and 3 splits of 16-wide K steps (the workspace and
# reduce path whenever K > 16).
NO_SPLIT = {"SPLIT_K": 1}
SPLIT = {"SPLIT_K": 3, "BLOCK_K": 16}


def _operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: summation order only (1e-5 of the largest output). bf16: an ulp or two of the single
    rounding, as the other kernel tests allow (the CPU interpreter also truncates instead of
    rounding to nearest)."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    scale = max(want.float().abs().max().item(), 1e-6)
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("launch", [NO_SPLIT, SPLIT], ids=["one_pass", "split_k"])
@pytest.mark.parametrize("K", [8, 48, 256])
@pytest.mark.parametrize("N", [1, 5, 64, 130])
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_matches_f_linear_fp32(M, N, K, launch):
    x, w, b = _operands(M, N, K, torch.float32, seed=M * 1000 + N * 10 + K)
    _assert_close(skinny_linear(x, w, b, **launch), F.linear(x, w, b))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("launch", [{}, NO_SPLIT, SPLIT], ids=["default", "one_pass", "split_k"])
@pytest.mark.parametrize("M", [1, 3, 8, pytest.param(16, marks=GPU_ONLY)])  # interpreter: tl.dot on bf16 is wrong
def test_matches_f_linear_bf16(M, launch, bias):
    x, w, b = _operands(M, 130, 256, torch.bfloat16, seed=M, bias=bias)
    _assert_close(skinny_linear(x, w, b, **launch), F.linear(x, w, b))


@pytest.mark.parametrize("M", [3, 16])
def test_without_bias_and_forced_dot_path(M):
    """No bias, and BLOCK_M 16 (the tl.dot path) for a 3-row x: padding rows are masked off."""
    x, w, _ = _operands(M, 64, 48, torch.float32, seed=7, bias=False)
    _assert_close(skinny_linear(x, w), F.linear(x, w))
    _assert_close(skinny_linear(x, w, BLOCK_M=16), F.linear(x, w))


@pytest.mark.parametrize("launch", [NO_SPLIT, SPLIT], ids=["one_pass", "split_k"])
def test_strided_operands(launch):
    """x a row slice of a larger buffer (every other row, an offset column range), x transposed
    (non-unit K stride), and weight a row/column slice of a packed projection (row stride > K)."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(12, 80, generator=g).to(DEVICE)
    packed = (torch.randn(100, 70, generator=g) * 0.2).to(DEVICE)
    w = packed[30:94, 5:53]  # [64, 48], strides (70, 1)
    b = torch.randn(64, generator=g).to(DEVICE)
    x_rows = buf[1::2, 16:64]  # [6, 48], strides (160, 1)
    x_t = torch.randn(48, 8, generator=g).to(DEVICE)[:, :5].t()  # [5, 48], strides (1, 8)
    for x in (x_rows, x_t):
        _assert_close(skinny_linear(x, w, b, **launch), F.linear(x, w, b))


def test_split_k_is_deterministic():
    x, w, b = _operands(8, 130, 256, torch.float32, seed=11)
    first = skinny_linear(x, w, b, **SPLIT)
    assert torch.equal(first, skinny_linear(x, w, b, **SPLIT))
    _assert_close(first, F.linear(x, w, b))


def test_empty_inputs():
    x, w, b = _operands(1, 6, 8, torch.float32, seed=0)
    assert skinny_linear(x[:0], w, b).shape == (0, 6)
    _assert_close(skinny_linear(x[:, :0], w[:, :0], b), F.linear(x[:, :0], w[:, :0], b))  # K = 0: the bias


@pytest.mark.parametrize("M", [1, 7, 8, 16])
def test_default_launch_on_the_h200_shapes(M):
    """Defaults for the 35B decode shapes (132 SMs): valid for the path taken, and every weight of
    4 MB or more spread over >= 1.9 programs per SM (the floor needs many reads in flight)."""
    import triton

    bm = triton.next_power_of_2(M)
    for N, K in [(12288, 2048), (64, 2048), (2048, 4096), (8192, 2048), (512, 2048), (256, 2048), (1024, 2048),
                 (2048, 512), (248320, 2048)]:
        cfg = default_launch(bm, N, K, 2, 132)
        assert cfg["BLOCK_M"] == bm and cfg["SPLIT_K"] >= 1
        if bm >= 16:
            assert min(cfg["BLOCK_N"], cfg["BLOCK_K"]) >= 16
        if N * K * 2 >= 4 << 20:
            assert triton.cdiv(N, cfg["BLOCK_N"]) * cfg["SPLIT_K"] >= 250, (N, K, cfg)


def test_errors_name_the_arguments():
    x, w, b = _operands(4, 6, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=f"x .*M <= {MAX_ROWS}"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="x"):
        skinny_linear(x[0], w)
    with pytest.raises(ValueError, match="x torch.float64"):
        skinny_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="weight"):
        skinny_linear(x, w[:, :7])
    with pytest.raises(ValueError, match="weight .*unit stride"):
        skinny_linear(x, torch.zeros(8, 6, device=DEVICE).t())
    with pytest.raises(ValueError, match="weight .*float64"):
        skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:5])
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b.double())
    with pytest.raises(ValueError, match="unknown launch keys"):
        skinny_linear(x, w, BLOCK_Q=4)
    with pytest.raises(ValueError, match="BLOCK_M"):
        skinny_linear(x, w, BLOCK_M=2)  # fewer than x's 4 rows
    with pytest.raises(ValueError, match="powers of two"):
        skinny_linear(x, w, BLOCK_N=3)
    with pytest.raises(ValueError, match="tl.dot"):
        skinny_linear(x, w, BLOCK_M=16, BLOCK_N=8)
    with pytest.raises(ValueError, match="SPLIT_K"):
        skinny_linear(x, w, SPLIT_K=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 7, 16])
@pytest.mark.parametrize("N,K", [(2048, 4096), (256, 2048), (12288, 2048)])
def test_bf16_decode_shapes_in_a_cuda_graph_gpu(N, K, M):
    """The 35B shapes at decode sizes, bf16, captured in a CUDA graph and replayed on new inputs
    (the out_proj shape takes the split-K path at 16 rows)."""
    x, w, b = _operands(M, N, K, torch.bfloat16, seed=N + M)
    skinny_linear(x, w, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _assert_close(y, F.linear(x, w, b))
    before = y.clone()
    graph.replay()
    assert torch.equal(y, before)
