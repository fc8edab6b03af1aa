"""Adaptive draft depth (``SpecConfig(num_draft_tokens="auto")``).

Before each iteration the engine picks γ ∈ [0, γ_max] (γ = 0: verify x_{L−1} alone, a plain
decode step whose draft-extend keeps the draft caught up) maximising expected tokens per second
of the batch, Σ_b E_b[tokens | γ] / T(γ):

- E_b[tokens | γ] = 1 + Σ_{k=1..γ} Π_{j≤k} α_j (the bonus token, plus each draft accepted together
  with every draft before it), with α_j the request's per-position acceptance (``PositionCounts``)
  shrunk towards the engine-wide estimate, which is itself shrunk towards the position before it
  (acceptance falls with depth: an unseen position is assumed as good as the last seen one, so
  the controller still tries it and learns). Choosing γ from the past only is what keeps the
  output exact: speculative sampling is lossless for any depth fixed before the drafts are seen.
- T(γ): the engine's own measured iteration times for this batch size (rounded up to a power of
  two), the median of the most recent warm samples per γ; depths not measured yet come from the
  affine latency model T = c + γ·t_draft (DESIGN §6) fitted through the measured γ ≥ 1 (γ = 0,
  unmeasured, costs T(1): it saves a verify token, not a draft forward). Until two depths are measured
  the controller calibrates (γ_max, then 1, a few iterations each).
- Exploration: an estimate the controller stops choosing would never change (at γ = 0 nothing is
  learnt about acceptance; a depth whose one sample was slow would never be timed again), so every
  ``PROBE_EVERY``-th iteration of a batch size runs one depth off the best, above and below in
  turn: a bounded cost that keeps both tables current as the context and the acceptance drift.
  While γ = 0 is best, every ``ZERO_PROBE_EVERY``-th runs γ = 1: a request whose first drafts were
  rejected would otherwise sit at γ = 0 for ``PROBE_EVERY`` iterations per new trial, while the
  probes cost T(1) − T(0) (one more verify token) on a quarter of the iterations.

The batch takes one γ: the verify reads every weight once for the whole batch, so its cost is set
by the widest request, and graphs are captured per (batch size, γ); a per-request mask would save
none of the bandwidth-bound step and would still pay the widest verify.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Sequence

from wmtp.engine.metrics import PositionCounts

PRIOR_STRENGTH = 2.0  # pseudo-trials of the prior per position: two real trials weigh as much
FIRST_PRIOR = 0.5  # α_1 before any trial anywhere
KEEP_SAMPLES = 16  # recent iteration times per (batch size, γ): the median follows a growing context
CALIBRATION_SAMPLES = 3  # warm samples per calibration depth: a median that one slow iteration cannot move
PROBE_EVERY = 32  # one iteration in this many runs a neighbouring depth (exploration)
ZERO_PROBE_EVERY = 4  # ... and one in this many while γ = 0 is best, where nothing else is learnt


def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """E[tokens | γ] = 1 + Σ_{k=1..γ} Π_{j≤k} α_j."""
    total, run = 1.0, 1.0
    for a in alphas[:gamma]:
        run *= a
        total += run
    return total


def shrunk_alphas(counts: PositionCounts, prior: Sequence[float], strength: float = PRIOR_STRENGTH) -> list[float]:
    """Posterior means (accepts + strength·prior) / (trials + strength), position by position."""
    return [(a + strength * m) / (n + strength) for a, n, m in zip(counts.accepts, counts.trials, prior)]


def pooled_alphas(counts: PositionCounts, strength: float = PRIOR_STRENGTH) -> list[float]:
    """Engine-wide α_j, each position shrunk towards the estimate of the one before it."""
    out, prior = [], FIRST_PRIOR
    for a, n in zip(counts.accepts, counts.trials):
        prior = (a + strength * prior) / (n + strength)
        out.append(prior)
    return out


def best_depth(alphas: Sequence[Sequence[float]], times: Sequence[float]) -> int:
    """argmax over γ of Σ_b E_b[tokens | γ] / T(γ) (``times[γ]``, γ = 0..len − 1); ties → the smaller γ."""
    scores = [sum(expected_tokens(a, g) for a in alphas) / t for g, t in enumerate(times)]
    return max(range(len(scores)), key=lambda g: (scores[g], -g))


class IterationTimes:
    """Measured T(γ) per batch size. The first sample of each (B, γ) is dropped: it carries the
    graph capture or the kernels' compilation."""

    def __init__(self, max_gamma: int, keep: int = KEEP_SAMPLES) -> None:
        self.max_gamma = max_gamma
        self._samples: dict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=keep))
        self._seen: set[tuple[int, int]] = set()

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes share a table up to the next power of two: a decode step's cost barely moves
        within one, and a server whose batch changes every few iterations still calibrates once."""
        return 1 << (batch - 1).bit_length()

    def record(self, batch: int, gamma: int, seconds: float) -> None:
        key = (self.bucket(batch), gamma)
        if key in self._seen:
            self._samples[key].append(seconds)
        self._seen.add(key)

    def measured(self, batch: int) -> dict[int, float]:
        batch = self.bucket(batch)
        return {g: statistics.median(s) for (b, g), s in self._samples.items() if b == batch and s}

    def calibration(self, batch: int) -> int | None:
        """The next depth to measure while fewer than two have ``CALIBRATION_SAMPLES`` warm samples
        (None once the model can be fitted)."""
        batch = self.bucket(batch)
        done = {g for (b, g), s in self._samples.items() if b == batch and len(s) >= CALIBRATION_SAMPLES}
        if len(done) >= 2:
            return None
        for g in (self.max_gamma, 1 if self.max_gamma > 1 else 0):
            if g not in done:
                return g
        return None

    def estimate(self, batch: int) -> list[float]:
        """T(γ) for γ = 0..γ_max: measured medians where there are, elsewhere the line through the
        measured γ ≥ 1 (each adds one draft forward; floored at a tenth of the fastest measured, so
        a noisy slope cannot predict a free iteration). An unmeasured γ = 0 is taken as T(1), not
        the line's value: it verifies one token fewer, but the draft still extends over the emitted
        token, so it saves no draft forward (γ = 1's d_1 came from the previous extend too)."""
        m = self.measured(batch)
        pts = {g: t for g, t in m.items() if g >= 1} or m
        g_mean = sum(pts) / len(pts)
        t_mean = sum(pts.values()) / len(pts)
        spread = sum((g - g_mean) ** 2 for g in pts)
        slope = sum((g - g_mean) * (t - t_mean) for g, t in pts.items()) / spread if spread else 0.0
        floor = min(m.values()) / 10
        est = [m.get(g, max(t_mean + slope * (g - g_mean), floor)) for g in range(self.max_gamma + 1)]
        if 0 not in m and self.max_gamma >= 1:
            est[0] = est[1]
        return est


class DepthController:
    """Chooses each iteration's γ from the requests' acceptance and the measured times."""

    def __init__(self, max_gamma: int, probe_every: int = PROBE_EVERY) -> None:
        self.max_gamma = max_gamma
        self.times = IterationTimes(max_gamma)
        self.probe_every = probe_every
        self._chosen: dict[int, int] = defaultdict(int)  # choices per batch-size bucket since calibration

    def best(self, requests: Sequence[PositionCounts], pooled: PositionCounts) -> int:
        """argmax_γ of the expected tokens per second, from the estimates as they stand."""
        prior = pooled_alphas(pooled)
        return best_depth([shrunk_alphas(c, prior) for c in requests], self.times.estimate(len(requests)))

    def choose(self, requests: Sequence[PositionCounts], pooled: PositionCounts) -> int:
        """This iteration's γ: calibration first, then the best depth, a neighbour of it on every
        ``probe_every``-th choice (above on odd probes, below on even; the other side at a bound),
        on every ``ZERO_PROBE_EVERY``-th while the best is γ = 0."""
        batch = len(requests)
        cal = self.times.calibration(batch)
        if cal is not None:
            return cal
        best = self.best(requests, pooled)
        key = IterationTimes.bucket(batch)
        self._chosen[key] += 1
        n = self._chosen[key]
        every = self.probe_every if best else min(self.probe_every, ZERO_PROBE_EVERY)
        if self.max_gamma == 0 or n % every:
            return best
        step = 1 if (n // every) % 2 else -1
        probe = best + step
        return probe if 0 <= probe <= self.max_gamma else best - step

    def record(self, batch: int, gamma: int, seconds: float) -> None:
        self.times.record(batch, gamma, self.agree(seconds))

    @staticmethod
    def agree(seconds: float) -> float:
        """The time every engine of a tensor-parallel group records (they must choose alike); one
        process: its own measurement. ``wmtp.engine.distributed`` replaces it per rank."""
        return seconds
