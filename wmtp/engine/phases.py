"""Per-iteration phase timing (DESIGN §6, paper Table 7): benchmark-only, off by default.

``Engine._iteration`` calls ``start()`` once and ``mark(phase)`` at the end of each phase when
``engine.phase_timer`` is set (it is None by default, costing nothing). Every mark attributes the
time since the previous mark (or ``start``) to ``phase``, so the phases of one iteration partition
its span from ``start`` to the last mark exactly: their sum IS that span, whatever happens between
the marks (host work, launches, syncs).

On CUDA the marks are CUDA events recorded on the current stream, never synchronised while the
iteration runs (timing must not change what is timed); ``collect()`` synchronises once and reads
them back. The span is then the GPU timeline from ``start`` to the last mark. On CPU the marks are
``time.perf_counter()`` readings (CPU kernels are synchronous).

Phases (DESIGN §2 step numbers):
- ``draft_fwd``: one draft step (step 1; γ − 1 per iteration), summed over the iteration's steps;
- ``verify_base``: the verify target forward + its logits (step 2);
- ``verify_ovh``: acceptance, GDN rollback, metrics and emission (step 3);
- ``draft_ctx``: the draft-extend that yields the next d_1 (step 4).
"""

from __future__ import annotations

import time

import torch

PHASES = ("draft_fwd", "verify_base", "verify_ovh", "draft_ctx")


class PhaseTimer:
    """Collects marks for any number of iterations; ``collect()`` returns one dict per iteration
    (seconds per phase in ``PHASES``, 0.0 for a phase that did not occur, plus ``"steps"``: how
    many ``draft_fwd`` marks, and ``"total"``: the span from ``start`` to the last mark)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._iters: list[list[tuple[str | None, object]]] = []

    def _stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        """Begin a new iteration."""
        self._iters.append([(None, self._stamp())])

    def mark(self, phase: str) -> None:
        """End of a ``phase`` segment (time since the previous mark goes to it)."""
        if phase not in PHASES:
            raise ValueError(f"PhaseTimer.mark: unknown phase {phase!r}; known: {PHASES}")
        self._iters[-1].append((phase, self._stamp()))

    def _elapsed(self, a: object, b: object) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a  # type: ignore[union-attr, operator]

    def collect(self) -> list[dict[str, float]]:
        """Per-iteration phase seconds for every iteration since the last ``collect()`` (then
        forgets them). Synchronises the device once (CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for marks in self._iters:
            row = dict.fromkeys(PHASES, 0.0) | {"steps": 0.0}
            for (_, prev), (phase, stamp) in zip(marks, marks[1:]):
                row[phase] += self._elapsed(prev, stamp)
                row["steps"] += phase == "draft_fwd"
            row["total"] = self._elapsed(marks[0][1], marks[-1][1])
            out.append(row)
        self._iters = []
        return out
