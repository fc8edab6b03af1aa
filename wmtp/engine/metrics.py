"""Acceptance and latency metrics (DESIGN §5, §6)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def alphas_from_histogram(hist: list[int]) -> list[float]:
    """α_j = Σ_{n≥j} H[n] / Σ_{n≥j−1} H[n], j = 1..γ (nan where the denominator is 0)."""
    out = []
    for j in range(1, len(hist)):
        den = sum(hist[j - 1 :])
        out.append(sum(hist[j:]) / den if den else float("nan"))
    return out


def acceptance_length(hist: list[int]) -> float:
    """AL = mean emitted tokens per iteration = 1 + mean accepted drafts."""
    n = sum(hist)
    return 1.0 + sum(k * h for k, h in enumerate(hist)) / n if n else float("nan")


@dataclass
class PositionCounts:
    """Per draft position j = 1..γ_max: ``trials[j-1]`` iterations verified draft j with drafts
    1..j−1 accepted, ``accepts[j-1]`` of them accepted it. α_j = accepts / trials holds whatever
    depth each iteration drafted (a histogram of accepted counts is censored at each iteration's γ,
    so it gives α only for a fixed γ; there the two agree)."""

    max_gamma: int
    trials: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.trials = [0] * self.max_gamma
        self.accepts = [0] * self.max_gamma

    def record(self, gamma: int, accepted: int) -> None:
        """An iteration that drafted ``gamma`` tokens and accepted the first ``accepted``."""
        for j in range(min(accepted + 1, gamma)):
            self.trials[j] += 1
        for j in range(accepted):
            self.accepts[j] += 1

    def add(self, trials: list[int], accepts: list[int]) -> None:
        for j, (n, a) in enumerate(zip(trials, accepts)):
            self.trials[j] += n
            self.accepts[j] += a

    def alphas(self) -> list[float]:
        """α_j, j = 1..γ_max (nan where position j was never reached)."""
        return [a / n if n else float("nan") for a, n in zip(self.accepts, self.trials)]


@dataclass
class RequestMetrics:
    """Per request. ``hist[n]`` = iterations that accepted exactly n drafts (n = 0..γ_max);
    ``gammas``: the depth each iteration drafted (fixed γ unless the depth is adaptive)."""

    gamma: int
    arrival: float
    hist: list[int] = field(default_factory=list)
    t_iter: list[float] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)
    positions: PositionCounts = field(init=False)
    first_token_time: float | None = None
    finish_time: float | None = None
    proposed: int = 0
    accepted: int = 0
    num_generated: int = 0
    memory_bytes: dict[str, int] = field(default_factory=dict)  # per pool, reserved at admission
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (its prefill started there)

    def __post_init__(self) -> None:
        self.hist = [0] * (self.gamma + 1)
        self.positions = PositionCounts(self.gamma)

    def record_iteration(self, accepted: int, seconds: float, gamma: int) -> None:
        self.hist[accepted] += 1
        self.t_iter.append(seconds)
        self.gammas.append(gamma)
        self.positions.record(gamma, accepted)
        self.proposed += gamma
        self.accepted += accepted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_generated < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated - 1)

    def to_dict(self) -> dict:
        return {
            "iterations": sum(self.hist),
            "acceptance_histogram": list(self.hist),
            "acceptance_length": acceptance_length(self.hist),
            "alpha": self.positions.alphas(),
            "position_trials": list(self.positions.trials),
            "position_accepts": list(self.positions.accepts),
            "gammas": list(self.gammas),
            "t_iter": list(self.t_iter),
            "t_iter_median": statistics.median(self.t_iter) if self.t_iter else None,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "proposed_draft_tokens": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "generated_tokens": self.num_generated,
            "memory_bytes": dict(self.memory_bytes),
            "cached_prompt_tokens": self.cached_tokens,
        }


@dataclass
class EngineMetrics:
    """Engine-wide: every speculative iteration (one per batched ``_iteration`` call: its accepted
    counts for all requests and its wall time) and every finished request's TTFT / TPOT.
    Invariant: ``hist`` and ``positions`` equal the sums over every request seen."""

    gamma: int
    hist: list[int] = field(default_factory=list)
    t_iter: list[float] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)  # the depth each iteration drafted
    positions: PositionCounts = field(init=False)
    batch_sizes: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    generated: int = 0
    finished: int = 0

    def __post_init__(self) -> None:
        self.hist = [0] * (self.gamma + 1)
        self.positions = PositionCounts(self.gamma)

    def record_iteration(self, accepted: list[int], seconds: float, gamma: int) -> None:
        for a in accepted:
            self.hist[a] += 1
            self.positions.record(gamma, a)
        self.t_iter.append(seconds)
        self.gammas.append(gamma)
        self.batch_sizes.append(len(accepted))
        self.proposed += gamma * len(accepted)
        self.accepted += sum(accepted)

    def record_finish(self, request: RequestMetrics) -> None:
        self.finished += 1
        self.generated += request.num_generated
        for values, v in ((self.ttft, request.ttft), (self.tpot, request.tpot)):
            if v is not None:
                values.append(v)

    def to_dict(self) -> dict:
        def med(x: list[float]) -> float | None:
            return statistics.median(x) if x else None

        return {
            "iterations": len(self.t_iter),
            "acceptance_histogram": list(self.hist),
            "acceptance_length": acceptance_length(self.hist),
            "alpha": self.positions.alphas(),
            "gamma_histogram": [self.gammas.count(g) for g in range(self.gamma + 1)],
            "t_iter_median": med(self.t_iter),
            "mean_batch_size": sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else None,
            "ttft_median": med(self.ttft),
            "tpot_median": med(self.tpot),
            "proposed_draft_tokens": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "generated_tokens": self.generated,
            "finished_requests": self.finished,
        }
