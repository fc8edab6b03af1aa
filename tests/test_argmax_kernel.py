"""The one-launch row arg-max (``wmtp.kernels.argmax``) against its twin ``torch.argmax``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.argmax import CHUNK, argmax_rows  # noqa: E402
from wmtp.kernels.common import arrival_counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [7, CHUNK, 2 * CHUNK + 5])  # one program; exactly one chunk; a ragged last chunk
def test_argmax_rows_matches_torch(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g).to(DEVICE, dtype)
    x[1, V - 1] = 100.0  # the maximum in the last chunk's last entry
    x[2, 0] = 100.0  # and in the first
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert int(arrival_counters(x.device, 5)[:5].abs().sum()) == 0  # the counters are left zeroed


def test_ties_take_the_lowest_index_across_chunks_and_nan_wins():
    V = 3 * CHUNK
    x = torch.zeros(4, V, device=DEVICE)
    x[0, [CHUNK + 3, 2 * CHUNK + 1]] = 5.0  # a tie in two chunks: the earlier
    x[1, [2 * CHUNK - 1, CHUNK + 7]] = 5.0  # a tie inside one chunk
    x[2] = float("-inf")  # all -inf: index 0, as torch
    x[3, 11] = float("nan")
    assert argmax_rows(x).tolist() == [CHUNK + 3, CHUNK + 7, 0, 11]


def test_writes_into_a_strided_destination():
    """[B, n] destination (a block of an output buffer) in row-major token order, others untouched."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    buf = torch.full((2, 8), -7, dtype=torch.int64, device=DEVICE)
    argmax_rows(x, out=buf[:, 2:5])
    assert torch.equal(buf[:, 2:5], x.argmax(-1).view(2, 3))
    assert bool((buf[:, :2] == -7).all()) and bool((buf[:, 5:] == -7).all())
    col = torch.zeros(6, 3, dtype=torch.int64, device=DEVICE)
    argmax_rows(x, out=col[:, 1])
    assert torch.equal(col[:, 1], x.argmax(-1))


def test_bad_shapes_name_the_tensor():
    with pytest.raises(ValueError, match=r"argmax_rows: x \(3,\)"):
        argmax_rows(torch.zeros(3))
    with pytest.raises(ValueError, match=r"argmax_rows: out \(4,\) torch.int64 must be int64 \[3\]"):
        argmax_rows(torch.zeros(3, 5), out=torch.zeros(4, dtype=torch.int64))
