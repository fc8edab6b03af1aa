"""Kernel timing for the tuning scripts under ``benchmarks/``; time per kind of module for ``bench ttft --split``."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch


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


class ModuleTimes:
    """Time spent inside the submodules of ``model`` of each kind, over a block (``with``): kinds name
    module classes (``{"attention": (Attention,), ...}``); forward hooks time every call of a module of
    those classes, by CUDA events on a CUDA device (summed after the block, one synchronisation, so
    the timed work keeps its pace) and by the host clock elsewhere (where the work is synchronous). A
    module inside another counted one counts only in the outer (a MoE's shared-expert MLP is MoE)."""

    def __init__(self, model: torch.nn.Module, kinds: dict[str, tuple[type, ...]], device: torch.device) -> None:
        self.model, self.kinds, self.cuda = model, kinds, device.type == "cuda"
        self.calls: dict[str, list] = {k: [] for k in kinds}
        self._hooks: list = []

    def _kind(self, module: object) -> str | None:
        return next((k for k, classes in self.kinds.items() if isinstance(module, classes)), None)

    def __enter__(self) -> ModuleTimes:
        outer: list[str] = []
        for name, module in self.model.named_modules():
            kind = self._kind(module)
            if kind is None or any(name.startswith(o + ".") for o in outer):
                continue
            outer.append(name)
            calls, started = self.calls[kind], []

            def pre(_m, _args, started=started) -> None:
                if self.cuda:
                    started.append(torch.cuda.Event(enable_timing=True))
                    started[-1].record()
                else:
                    started.append(time.perf_counter())

            def post(_m, _args, _out, started=started, calls=calls) -> None:
                if self.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    calls.append((started.pop(), end))
                else:
                    calls.append(time.perf_counter() - started.pop())

            self._hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def seconds(self) -> dict[str, float]:
        """Seconds inside each kind's modules (after the block)."""
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(a.elapsed_time(b) for a, b in c) / 1e3 for k, c in self.calls.items()}
        return {k: float(sum(c)) for k, c in self.calls.items()}
