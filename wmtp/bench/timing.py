"""Kernel timing for the tuning scripts under ``benchmarks/``."""

from __future__ import annotations

from typing import Any, Callable, Sequence


def cold_ms_per_call(fn: Callable[[Any], object], weights: Sequence[Any]) -> float:
    """Milliseconds per call of ``fn(w)``, timed from a CUDA graph that calls it once for every ``w``
    of ``weights`` in turn: with more bytes across them than L2 holds, each call reads its weights
    from HBM, as a decode iteration's layers do."""
    import triton.testing

    def run() -> None:
        for w in weights:
            fn(w)

    run()  # compile / autotune outside the graph
    return triton.testing.do_bench_cudagraph(run) / len(weights)
