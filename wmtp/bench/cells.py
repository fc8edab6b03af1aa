"""Engines and measurements for the sweeps (DESIGN §6).

A ``Cell`` is one engine configuration (mode, d, S, window, pools). A ``Measure`` is one timed block
run on a live engine of that cell. Measures never change the pools, so every measure a suite needs
on one cell runs on the SAME engine: the cell's engine is built once per independent run (fresh pools,
re-randomized, and a fresh synthetic request, each seeded by the run index) and released after.

Invariants:
- every engine holds synthetic context (random KV / draft KV / states) and forced acceptance: the
  numbers are costs only, AL = k + 1 by construction;
- a run's value of a measure is a steady-state statistic over ``iters`` timed iterations that follow
  ``warmup`` untimed ones (median, or mean where parts must add up: phases);
- a measure's ``steps()`` bounds the iterations it runs, so the request(s) of a cell are admitted with
  enough ``max_tokens`` for all of the cell's measures.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from wmtp.bench.floor import ExpertCounter, step_bytes
from wmtp.bench.step import _spec, _sync_time, deciles, kv_dtype, parse_mode, release_pools
from wmtp.bench.synthetic import add_synthetic_request, force_acceptance, randomize_pools
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.memory import CapacityError, MemoryManager
from wmtp.engine.phases import PhaseTimer
from wmtp.errors import WmtpError
from wmtp.models.model import CausalLM


@dataclass(frozen=True)
class Cell:
    """One engine configuration. ``budget``: pools sized from the KV byte budget and requests
    admitted by the measures (batch / memory); else pools for one request of S tokens, admitted
    when the engine opens. Build with ``Cell.make`` so equal configurations compare equal."""

    mode: str
    d: int
    S: int
    window: int | None = None
    sink: int | None = None
    budget: bool = False

    @classmethod
    def make(cls, mode: str, d: int, S: int, window: int, sink: int, budget: bool = False) -> "Cell":
        """Normalised: dense has d = 1, and only windowed cells carry (window, sink), so native and
        dense cells are shared by every sweep whatever their window options."""
        base = parse_mode(mode)[0]
        win = base == "windowed"
        return cls(mode, 1 if base == "dense" else d, S, window if win else None, sink if win else None, budget)

    @property
    def spec(self) -> SpecConfig:
        defaults = SpecConfig()
        return _spec(self.mode, self.d, self.window or defaults.window,
                     defaults.sink if self.sink is None else self.sink)

    def label(self) -> str:
        w = f" W={self.window} sink={self.sink}" if self.window is not None else ""
        return f"{self.mode} d={self.d} S={self.S}{w}{' (KV budget)' if self.budget else ''}"


@dataclass
class Bench:
    """What every measurement shares: the model (built once per process), the device, the options
    and the HBM read bandwidth (CUDA only) that bytes floors are divided by."""

    model: CausalLM
    device: torch.device
    a: argparse.Namespace
    bandwidth: float | None = None
    _budget: int | None = field(default=None, repr=False)

    def budget(self) -> int:
        """KV budget of budget cells: ``--kv-budget-gib``, else free device memory minus
        ``--reserve-gib``, read once (with no engine alive) so every mode gets the same bytes."""
        if self._budget is None:
            if self.a.kv_budget_gib is not None:
                self._budget = int(self.a.kv_budget_gib * 2**30)
            else:  # the sweeps' option check makes sure this is CUDA
                free, _ = torch.cuda.mem_get_info(self.device)
                self._budget = free - int(self.a.reserve_gib * 2**30)
        return self._budget

    @property
    def elt(self) -> int:
        return self.model.embed_weight.element_size()


@dataclass
class CellRun:
    """One live engine of a cell, for one independent run."""

    bench: Bench
    cell: Cell
    run: int
    eng: Engine
    max_tokens: int

    def time_steps(self, n: int) -> list[float]:
        return [_sync_time(self.eng.step, self.bench.device) for _ in range(n)]

    def force(self, k: int) -> int:
        """Force k accepted drafts (clipped to γ); returns the k in force."""
        k = min(k, self.eng.spec.gamma)
        force_acceptance(self.eng, k)
        return k


def request_bytes(model: CausalLM, spec: SpecConfig, total_tokens: int, page_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> int:
    """Bytes one request of ``total_tokens`` reserves in all pools (the engine's own accounting)."""
    mm = MemoryManager(model.config, spec, EngineConfig(max_model_len=total_tokens, max_num_seqs=1, page_size=page_size,
                                                        num_kv_pages=1, kv_cache_dtype=kv_cache_dtype), dtype)
    return sum(mm.allocation_bytes(mm.need(total_tokens)).values())


def seq_cap(bench: Bench, cell: Cell, max_tokens: int) -> int:
    """max_num_seqs of a budget cell: one more request than the budget can hold (so the pools, not
    the sequence slots, stop admission), at most ``--max-batch``."""
    dtype = bench.model.embed_weight.dtype
    per = request_bytes(bench.model, cell.spec, cell.S + max_tokens, bench.a.page_size, dtype, kv_dtype(cell.mode))
    return max(1, min(bench.a.max_batch, bench.budget() // per + 1))


@contextmanager
def open_cell(bench: Bench, cell: Cell, run: int, max_tokens: int, randomize: bool) -> Iterator[CellRun]:
    """A fresh engine of ``cell`` (pools randomized with seed ``run`` when ``randomize``); a
    non-budget cell also gets its synthetic S-token request (seed ``run``). Pools are released on
    exit, so the next cell can allocate its own."""
    a = bench.a
    if cell.budget:
        cfg = EngineConfig(max_model_len=cell.S + max_tokens, max_num_seqs=seq_cap(bench, cell, max_tokens),
                           page_size=a.page_size, kv_memory_bytes=bench.budget(), kv_cache_dtype=kv_dtype(cell.mode))
    else:
        cfg = EngineConfig(max_model_len=cell.S + max_tokens, max_num_seqs=1, page_size=a.page_size,
                           kv_cache_dtype=kv_dtype(cell.mode))
    try:
        eng = Engine(bench.model, cell.spec, cfg)
    except CapacityError as e:  # only a budget cell can be refused: the budget is below one request
        raise WmtpError(f"--kv-budget-gib / --reserve-gib: a KV budget of {bench.budget()} bytes cannot seat one "
                        f"request of {cell.label()}: {e}") from None
    try:
        if randomize:
            randomize_pools(eng, seed=run)
        if not cell.budget:
            add_synthetic_request(eng, cell.S, max_tokens, seed=run)
        yield CellRun(bench, cell, run, eng, max_tokens)
    finally:
        del eng
        release_pools(bench.model)


# ---- measures -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measure:
    """One timed block on a live engine. Equal measures (same class and fields) on one cell are run
    once and shared by the sweeps that need them. ``order``: measures of a cell run by ascending
    order (a batch ladder must admit its requests before the memory fill does)."""

    runs: int
    order = 0
    randomize = True  # needs content-free random pools (timing); False: only sizes matter

    def steps(self, gamma: int) -> int:
        """Upper bound on iterations ``__call__`` runs (sizes the requests' max_tokens)."""
        raise NotImplementedError

    def __call__(self, cr: CellRun) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class TIter(Measure):
    """T_iter at forced k: median, p10, p90 over ``iters`` iterations; with ``floor``, the bytes floor
    with the experts the warm-up iterations routed to (counting syncs, so only warm-up ones count;
    None when no MoE call was seen, e.g. replayed from a CUDA graph)."""

    k: int = 3
    iters: int = 50
    warmup: int = 5
    floor: bool = True

    def steps(self, gamma: int) -> int:
        return self.warmup + 2 + self.iters  # + the two graph warm-up steps

    def __call__(self, cr: CellRun) -> dict:
        k = cr.force(self.k)
        floor = self._warm_up(cr)
        times = cr.time_steps(self.iters)
        q = deciles(times)
        bw = cr.bench.bandwidth
        return {"t_iter_s": statistics.median(times), "t_iter_p10_s": q[0], "t_iter_p90_s": q[-1],
                "forced_accept": k, "floor_bytes": floor, "floor_s": floor / bw if floor and bw else None}

    def _warm_up(self, cr: CellRun) -> int | None:
        """Runs the warm-up iterations (under an ExpertCounter with ``floor``); the floor bytes.
        The counter wraps a Python-level op and syncs, so its iterations run eagerly; two more
        then capture and replay the decode graphs, so no timed step pays for a capture."""
        if not self.floor:
            cr.time_steps(self.warmup)
            return None
        with cr.eng.eager_iterations(), ExpertCounter(cr.bench.model) as counter:
            cr.time_steps(self.warmup)
        cr.time_steps(2)
        seen = counter.mean_distinct()
        if not seen and counter.by_router:
            return None
        return step_bytes(cr.bench.model, cr.eng.spec, cr.cell.S, seen, cr.bench.elt, cr.eng.memory.kv_elt).total


def _phase_block(cr: CellRun, iters: int) -> tuple[list[float], list[dict[str, float]]]:
    """Wall times of ``iters`` iterations with a PhaseTimer attached, and its per-iteration phases."""
    timer = PhaseTimer(cr.bench.device)
    cr.eng.phase_timer = timer
    try:
        walls = cr.time_steps(iters)
    finally:
        cr.eng.phase_timer = None
    parts = timer.collect()
    if len(parts) != len(walls):  # B = 1 decode: one _iteration per step
        raise RuntimeError(f"phase timer saw {len(parts)} iterations in {len(walls)} steps")
    return walls, parts


@dataclass(frozen=True)
class Phases(Measure):
    """Per-iteration phases at forced k (means over ``iters``: means add up, medians do not) and the
    wall T_iter of the same iterations (its mean), for the within-5% sum check. ``draft_steps`` is
    γ − 1 by definition (DESIGN §2); ``marked_steps`` how many draft_fwd marks the engine made (the
    same unless the draft loop is replayed as one CUDA graph with one mark)."""

    k: int = 3
    iters: int = 50
    warmup: int = 5
    order = 1

    def steps(self, gamma: int) -> int:
        return self.warmup + self.iters

    def __call__(self, cr: CellRun) -> dict:
        k = cr.force(self.k)
        cr.time_steps(self.warmup)
        walls, parts = _phase_block(cr, self.iters)
        mean = {p: statistics.fmean(it[p] for it in parts) for p in parts[0]}
        return {"t_verify_base_s": mean["verify_base"], "t_verify_ovh_s": mean["verify_ovh"],
                "t_draft_ctx_s": mean["draft_ctx"], "t_draft_fwd_s": mean["draft_fwd"],
                "draft_steps": cr.eng.spec.gamma - 1, "marked_steps": int(parts[0]["steps"]),
                "t_iter_s": statistics.fmean(walls),
                "t_span_s": mean["total"], "forced_accept": k}


@dataclass(frozen=True)
class VerifyByK(Measure):
    """t_verify_ovh per forced accepted count k = 0..γ on one engine (k changes no pool): median
    over ``iters`` iterations per k, after ``warmup`` untimed ones at that k."""

    iters: int = 50
    warmup: int = 2
    order = 2

    def steps(self, gamma: int) -> int:
        return (gamma + 1) * (self.warmup + self.iters)

    def __call__(self, cr: CellRun) -> dict:
        by_k = []  # index = k
        for k in range(cr.eng.spec.gamma + 1):
            cr.force(k)
            cr.time_steps(self.warmup)
            _, parts = _phase_block(cr, self.iters)
            by_k.append({"k": k, "t_verify_ovh_s": statistics.median(p["verify_ovh"] for p in parts),
                         "iterations": len(parts)})
        return {"by_k": by_k}


def _admit(cr: CellRun, upto: int) -> bool:
    """Admit synthetic S-token requests until ``upto`` are running; False when the pools (or the
    engine's max_num_seqs) refuse one first."""
    eng = cr.eng
    while len(eng.memory.held) < upto:
        try:
            add_synthetic_request(eng, cr.cell.S, cr.max_tokens, seed=1000 * cr.run + len(eng.memory.held))
        except MemoryError:
            return False
    return True


def _limit(cr: CellRun) -> str:
    """What stopped admission: the pools or the sequence-slot cap (``--max-batch``)."""
    return "max_num_seqs" if len(cr.eng.memory.held) >= cr.eng.eng.max_num_seqs else "memory"


@dataclass(frozen=True)
class BatchLadder(Measure):
    """Admit requests up the B ladder, timing ``iters`` iterations at each B, then admit until the
    pools refuse and time that B too (the max admissible). Per B: per-user tok/s = AL/T_iter and
    system tok/s = B·AL/T_iter with AL = k + 1 (forced)."""

    ladder: tuple[int, ...] = (1, 2, 4)
    k: int = 3
    iters: int = 50
    warmup: int = 5
    order = 3

    def steps(self, gamma: int) -> int:
        return (len(self.ladder) + 1) * (self.warmup + self.iters)

    def __call__(self, cr: CellRun) -> dict:
        al = cr.force(self.k) + 1
        points: list[dict] = []  # ascending B
        for b in (*self.ladder, None):  # None: as many as fit
            fits = _admit(cr, b if b is not None else cr.eng.eng.max_num_seqs)
            n = len(cr.eng.memory.held)
            if n == 0 or (points and points[-1]["B"] == n):
                break
            cr.time_steps(self.warmup)
            t = statistics.median(cr.time_steps(self.iters))
            points.append({"B": n, "t_iter_s": t, "per_user_tok_s": al / t, "system_tok_s": n * al / t})
            if not fits:
                break
        return {"points": points, "max_admitted": len(cr.eng.memory.held), "limited_by": _limit(cr),
                "forced_accept": al - 1}


@dataclass(frozen=True)
class MemoryFill(Measure):
    """Admit S-token requests until the pools refuse; the pools' bytes, one request's bytes and the
    count (deterministic: one run is enough)."""

    order = 4
    randomize = False

    def steps(self, gamma: int) -> int:
        return 0

    def __call__(self, cr: CellRun) -> dict:
        _admit(cr, cr.eng.eng.max_num_seqs)
        mem = cr.eng.memory
        first = next(iter(cr.eng.requests.values()), None)
        return {"pools": mem.bytes_report(), "per_request_bytes": first.metrics.memory_bytes if first else {},
                "max_total_tokens": mem.sizes.num_pages * cr.eng.eng.page_size, "max_admitted": len(mem.held),
                "limited_by": _limit(cr), "kv_budget_bytes": cr.bench.budget(),
                "full_attention_layers": len(cr.bench.model.config.full_attention_layers)}
