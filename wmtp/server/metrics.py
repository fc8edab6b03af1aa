"""Prometheus metrics for the server, in a registry of its own (several apps can live in one process).

Updated from two sides: the engine thread records tokens, finished requests and a snapshot of the
pools and the prefix cache's counters after every loop pass; HTTP answers are counted on the event
loop. Scrapes read only the snapshots and the accumulated acceptance histogram, never the engine
itself (it is not thread-safe).

Acceptance (DESIGN §5) is accumulated over finished requests, aborted ones included: H[n] =
iterations that accepted exactly n drafts; α_j and AL are computed from the sum at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wmtp.engine.engine import Engine
from wmtp.engine.metrics import PositionCounts, acceptance_length

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)

# pool label -> (key of MemoryManager.usage(), its FreeList attribute, key of bytes_report() or None)
POOLS = {
    "target_kv": ("pages", "pages", "target_kv"),
    "draft_pool": ("draft_pages", "draft_pages", "draft_pool"),
    "draft_ring": ("rings", "rings", "draft_ring"),
    "state": ("state_slots", "state_slots", "state_pool"),
    "seqs": ("seqs", "seq_slots", None),
}


class ServerMetrics:
    """All ``wmtp_*`` metrics of one app; ``render()`` gives the Prometheus text exposition."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http = Counter("wmtp_http_requests", "HTTP answers by route and status code", ["route", "code"],
                            registry=r)
        self.finished = Counter("wmtp_requests_finished", "engine requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("wmtp_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("wmtp_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("wmtp_time_to_first_token_seconds",
                              "time from submission to the engine (queueing for memory included) to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("wmtp_time_per_output_token_seconds", "mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        spec, mem = engine.spec, engine.memory
        self.gamma = spec.gamma
        self.spec_labels = {"mode": spec.mode, "num_draft_tokens": "auto" if spec.adaptive else str(spec.num_draft_tokens),
                            "window": str(spec.window), "sink": str(spec.sink), "ring": str(spec.uses_ring).lower()}
        self.capacity = {name: getattr(mem, attr).capacity for name, (_, attr, _) in POOLS.items()}
        report = mem.bytes_report()
        self.pool_bytes = {name: report[key] for name, (_, _, key) in POOLS.items() if key is not None}
        self._lock = threading.Lock()
        self._hist = [0] * (self.gamma + 1)
        self._depths = [0] * (self.gamma + 1)  # iterations by the depth γ they drafted
        self._positions = PositionCounts(self.gamma)
        self._proposed = self._accepted = 0
        self._snapshot: tuple[dict[str, int], int, int] = ({k: 0 for k, _, _ in POOLS.values()}, 0, 0)
        self._prefix = engine.prefix.stats()
        r.register(_EngineCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- engine thread -------------------------------------------------------------------------
    def snapshot(self, engine: Engine) -> None:
        """Copy pool usage and queue lengths, and the prefix cache's counters (each one atomic
        assignment: scrapes see a consistent set)."""
        self._snapshot = (dict(engine.memory.usage()), len(engine.running), len(engine.waiting))
        self._prefix = engine.prefix.stats()

    def observe_finished(self, m: dict[str, Any], reason: str) -> None:
        """Record a finished request from its ``RequestMetrics.to_dict()``."""
        self.finished.labels(reason).inc()
        if m["ttft"] is not None:
            self.ttft.observe(m["ttft"])
        if m["tpot"] is not None:
            self.tpot.observe(m["tpot"])
        with self._lock:
            for n, h in enumerate(m["acceptance_histogram"]):
                self._hist[n] += h
            for g in m["gammas"]:
                self._depths[g] += 1
            self._positions.add(m["position_trials"], m["position_accepts"])
            self._proposed += m["proposed_draft_tokens"]
            self._accepted += m["accepted_draft_tokens"]

    # ---- scrape side ---------------------------------------------------------------------------
    def acceptance(self) -> tuple[list[int], list[int], list[float], int, int]:
        """(H[n], iterations per depth γ, α_j, proposed, accepted) over the finished requests."""
        with self._lock:
            return list(self._hist), list(self._depths), self._positions.alphas(), self._proposed, self._accepted

    def prefix_cache(self) -> dict[str, int]:
        """The prefix cache's counters (``PrefixCache.stats()``) at the last snapshot."""
        return self._prefix

    def usage(self) -> tuple[dict[str, int], int, int]:
        """(units in use per ``MemoryManager.usage()`` key, running requests, waiting requests)."""
        return self._snapshot


class _EngineCollector(Collector):
    """Gauges and counters computed at scrape time from the snapshot and the acceptance sums."""

    def __init__(self, m: ServerMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        yield from self._queues_and_pools()
        yield from self._acceptance()
        yield from self._prefix_cache()

    def _prefix_cache(self) -> Iterator[Metric]:
        p = self.m.prefix_cache()
        yield CounterMetricFamily("wmtp_prefix_cache_hit_requests", "requests whose prefill resumed from the prefix "
                                  "cache", value=p["hit_requests"])
        yield CounterMetricFamily("wmtp_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache (not "
                                  "prefilled)", value=p["hit_tokens"])
        yield GaugeMetricFamily("wmtp_prefix_cache_pages", "full target KV pages in the prefix cache (held by running "
                                "requests or evictable)", value=p["cached_pages"])
        yield CounterMetricFamily("wmtp_prefix_cache_evicted_pages", "prefix-cache pages evicted (LRU) for new "
                                  "requests", value=p["evicted_pages"])
        yield GaugeMetricFamily("wmtp_prefix_cache_snapshots", "recurrent-state / draft snapshots held for resuming",
                                value=p["snapshots"])

    def _queues_and_pools(self) -> Iterator[Metric]:
        m = self.m
        used, running, waiting = m.usage()
        yield GaugeMetricFamily("wmtp_requests_running", "requests holding memory in the engine", value=running)
        yield GaugeMetricFamily("wmtp_requests_waiting", "requests queued for memory", value=waiting)
        units = GaugeMetricFamily("wmtp_memory_used", "units in use: pages (target_kv, draft_pool), rings "
                                  "(draft_ring), recurrent-state slots (state), sequence slots (seqs)", labels=["pool"])
        cap = GaugeMetricFamily("wmtp_memory_capacity", "units each pool holds (see wmtp_memory_used)", labels=["pool"])
        ratio = GaugeMetricFamily("wmtp_memory_usage_ratio", "used / capacity (0 for an empty pool)", labels=["pool"])
        for name, (key, _, _) in POOLS.items():
            units.add_metric([name], used[key])
            cap.add_metric([name], m.capacity[name])
            ratio.add_metric([name], used[key] / m.capacity[name] if m.capacity[name] else 0.0)
        size = GaugeMetricFamily("wmtp_memory_pool_bytes", "bytes allocated up front per pool", labels=["pool"])
        for name, b in m.pool_bytes.items():
            size.add_metric([name], b)
        info = GaugeMetricFamily("wmtp_spec_info", "speculation settings (value 1)", labels=list(m.spec_labels))
        info.add_metric(list(m.spec_labels.values()), 1)
        yield from (units, cap, ratio, size, info)

    def _acceptance(self) -> Iterator[Metric]:
        hist, depths, alphas, proposed, accepted = self.m.acceptance()
        it = CounterMetricFamily("wmtp_spec_iterations", "speculative iterations by drafts accepted (H[n])",
                                 labels=["accepted"])
        for n, h in enumerate(hist):
            it.add_metric([str(n)], h)
        yield it
        depth = CounterMetricFamily("wmtp_spec_depth", "speculative iterations by draft depth γ (fixed unless "
                                    "num_draft_tokens is auto)", labels=["gamma"])
        for g, n in enumerate(depths):
            depth.add_metric([str(g)], n)
        yield depth
        yield CounterMetricFamily("wmtp_draft_tokens_proposed", "draft tokens proposed", value=proposed)
        yield CounterMetricFamily("wmtp_draft_tokens_accepted", "draft tokens accepted", value=accepted)
        yield GaugeMetricFamily("wmtp_acceptance_length", "AL: mean tokens emitted per iteration (NaN before any)",
                                value=acceptance_length(hist))
        alpha = GaugeMetricFamily("wmtp_acceptance_alpha", "α_j: P(draft j accepted | drafts 1..j-1 accepted)",
                                  labels=["j"])
        for j, a in enumerate(alphas, start=1):
            alpha.add_metric([str(j)], a)
        yield alpha
