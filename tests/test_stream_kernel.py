"""The streaming-read kernel behind the measured read bandwidth, against its twin."""

import pytest
import torch

pytest.importorskip("triton")

from wmtp.kernels.stream import stream_xor, stream_xor_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("unroll", [1, 4])
@pytest.mark.parametrize("n,programs,block", [(10_000, 3, 1024), (4096, 8, 512), (5, 2, 64)])
def test_stream_xor_reads_every_element_once(n, programs, block, unroll):
    """Partials over a strided split (a tail block, programs with no block) XOR to the buffer's
    XOR: every word read exactly once (a word read twice or skipped would change it)."""
    x = torch.randint(-(2**30), 2**30, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
    parts = stream_xor(x.to(DEVICE), programs, block, num_warps=4, unroll=unroll)
    assert parts.shape == (programs,)
    assert stream_xor_reference(parts.cpu()) == stream_xor_reference(x)


def test_stream_xor_rejects_other_buffers():
    with pytest.raises(ValueError, match="stream_xor: x must be a contiguous 1-D int32"):
        stream_xor(torch.zeros(8, dtype=torch.float32), 2)
    with pytest.raises(ValueError, match="must stay below 2\\*\\*31"):
        stream_xor(torch.zeros(8, dtype=torch.int32), programs=2**20, block=1024, unroll=4)


def test_best_rates_interleaves_rounds_and_keeps_each_best():
    """The bandwidth is each timer's best round, and rounds alternate between timers (a slow
    stretch of the GPU lowers one round of each, not every reading of one)."""
    from wmtp.bench.floor import best_rates

    calls = []
    times = {"a": iter([2.0, 1.0, 4.0]), "b": iter([1.0, 8.0, 2.0])}

    def timer(name):
        def seconds():
            calls.append(name)
            return next(times[name])
        return seconds

    rates = best_rates({k: timer(k) for k in times}, {"a": 8.0, "b": 4.0}, rounds=3)
    assert rates == {"a": 8.0, "b": 4.0}
    assert calls == ["a", "b"] * 3
