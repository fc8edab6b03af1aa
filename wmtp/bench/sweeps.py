"""``wmtp bench context|depth|phases|verify-by-k|window|batch|memory|suite``: the cost sweeps.

Every sweep runs on SYNTHETIC context with FORCED acceptance (costs only; DESIGN §6) and writes one
schema-valid results file (``wmtp/analysis/SCHEMA.md``) into ``--out``:

| command | kind | cells | per run |
|---|---|---|---|
| context | context_sweep | mode × S ∈ --contexts, d | T_iter (median), bytes floor |
| depth | depth_sweep | speculative mode × d ∈ --depths, S = --context | T_iter |
| phases | phases | speculative mode, d, S | mean t_verify_base / t_verify_ovh / t_draft_ctx / t_draft_fwd, T_iter |
| verify-by-k | verify_by_k | speculative mode, d, S | median t_verify_ovh at each forced k = 0..γ |
| window | window_sweep | windowed × W ∈ --windows, and native | T_iter |
| batch | batch_sweep | --batch-modes, pools from the KV budget | per-user and system tok/s at each B, max admitted |
| memory | memory | --batch-modes × S ∈ --contexts, KV budget | pool bytes, per-request bytes, max admitted |

``suite`` runs several in ONE process on one model. Cells that are equal (same mode, d, S, window,
pools) are built once per run and every measure the selected sweeps need runs on that engine (e.g.
native d=7 at S=--context serves the context, depth, phases, verify-by-k and window sweeps), and equal
measures are shared, not repeated. A sweep's file is written as soon as its last cell is done, so a
device-call timeout loses only unfinished sweeps; ``--deadline`` stops cleanly before that. Every
run's result is also appended to OUT/cells.jsonl at once, and ``--resume`` (same options, same OUT)
continues from it: a later call repeats no finished run, only the one in flight when time ran out.

An independent run is a fresh engine: fresh pools randomized with the run's seed and a fresh
synthetic request. Per-run values go in the lists; the report takes mean and 95% t-CI over runs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from wmtp.bench.cells import (
    BatchLadder, Bench, Cell, Measure, MemoryFill, Phases, TIter, VerifyByK, open_cell,
)
from wmtp.bench.step import add_layers_arg, check_layers
from wmtp.engine.config import MODES
from wmtp.errors import WmtpError

Plan = list[tuple[Cell, Measure]]
ROW_OF_T_ITER = ("t_iter_s", "t_iter_p10_s", "t_iter_p90_s")


# ---- measures from the options ------------------------------------------------------------------


def _t_iter(a: argparse.Namespace) -> TIter:
    return TIter(runs=a.runs, k=a.accept, iters=a.iters, warmup=a.warmup, floor=a.floor)


def _speculative(a: argparse.Namespace) -> list[str]:
    return [m for m in a.modes if m != "dense"]


def _cell(a: argparse.Namespace, mode: str, d: int | None = None, S: int | None = None, window: int | None = None,
          budget: bool = False) -> Cell:
    return Cell.make(mode, d or a.d, S or a.context, window or a.window, a.sink, budget)


# ---- plans: (cell, measure) pairs, deterministic in the options -------------------------------


def plan_context(a: argparse.Namespace) -> Plan:
    return [(_cell(a, m, S=s), _t_iter(a)) for m in a.modes for s in a.contexts]


def plan_depth(a: argparse.Namespace) -> Plan:
    return [(_cell(a, m, d=d), _t_iter(a)) for m in _speculative(a) for d in a.depths]


def plan_phases(a: argparse.Namespace) -> Plan:
    return [(_cell(a, m), Phases(runs=a.runs, k=a.accept, iters=a.iters, warmup=a.warmup)) for m in _speculative(a)]


def plan_verify_by_k(a: argparse.Namespace) -> Plan:
    by_k = VerifyByK(runs=a.runs, iters=a.k_iters or a.iters, warmup=min(a.warmup, 2))
    return [(_cell(a, m), by_k) for m in _speculative(a)]


def plan_window(a: argparse.Namespace) -> Plan:
    return [(_cell(a, "windowed", window=w), _t_iter(a)) for w in a.windows] + [(_cell(a, "native"), _t_iter(a))]


def plan_batch(a: argparse.Namespace) -> Plan:
    ladder = BatchLadder(runs=a.runs, ladder=a.batch_ladder, k=a.accept, iters=a.iters, warmup=a.warmup)
    return [(_cell(a, m, budget=True), ladder) for m in a.batch_modes]


def plan_memory(a: argparse.Namespace) -> Plan:
    return [(_cell(a, m, S=s, budget=True), MemoryFill(runs=1)) for m in a.batch_modes for s in a.contexts]


# ---- rows: one cell's per-run results -> schema rows --------------------------------------------


def _per_run(runs: list[dict], *fields: str) -> dict:
    return {f: [r[f] for r in runs] for f in fields}


def _t_iter_fields(runs: list[dict]) -> dict:
    """T_iter lists plus the run-invariant floor (same bytes every run; the floor of run 0)."""
    r0 = runs[0]
    return {**_per_run(runs, *ROW_OF_T_ITER), "forced_accept": r0["forced_accept"], "floor_bytes": r0["floor_bytes"],
            "floor_s": r0["floor_s"]}


def rows_context(a: argparse.Namespace, c: Cell, runs: list[dict]) -> list[dict]:
    return [{"mode": c.mode, "S": c.S, "d": c.d, "B": 1, **_t_iter_fields(runs)}]


def rows_window(a: argparse.Namespace, c: Cell, runs: list[dict]) -> list[dict]:
    return [{"W": c.window if c.window is not None else "native", "sink": a.sink, "d": c.d, "S": c.S,
             **_t_iter_fields(runs)}]


def rows_phases(a: argparse.Namespace, c: Cell, runs: list[dict]) -> list[dict]:
    fields = ("t_verify_base_s", "t_verify_ovh_s", "t_draft_ctx_s", "t_draft_fwd_s", "t_iter_s", "t_span_s")
    return [{"mode": c.mode, "d": c.d, "S": c.S, "draft_steps": runs[0]["draft_steps"],
             "forced_accept": runs[0]["forced_accept"], **_per_run(runs, *fields)}]


def rows_verify_by_k(a: argparse.Namespace, c: Cell, runs: list[dict]) -> list[dict]:
    return [{"mode": c.mode, "d": c.d, "S": c.S, "k": k,
             **_per_run([r["by_k"][k] for r in runs], "t_verify_ovh_s", "iterations")} for k in range(len(runs[0]["by_k"]))]


def rows_batch(a: argparse.Namespace, c: Cell, runs: list[dict]) -> list[dict]:
    """One row per B every run reached (a B some run could not seat would have fewer values)."""
    at = [{p["B"]: p for p in r["points"]} for r in runs]
    common = sorted(set.intersection(*(set(a) for a in at)))
    return [{"mode": c.mode, "B": b, "d": c.d, "S": c.S, "admitted": b, "forced_accept": runs[0]["forced_accept"],
             "max_admitted": min(r["max_admitted"] for r in runs), "limited_by": runs[0]["limited_by"],
             **_per_run([a[b] for a in at], "per_user_tok_s", "system_tok_s", "t_iter_s")}
            for b in common]


def rows_memory(a: argparse.Namespace, c: Cell, runs: list[dict]) -> list[dict]:
    r = runs[0]
    pools = r["pools"]
    return [{"mode": c.mode, "S": c.S, "d": c.d, "max_total_tokens": r["max_total_tokens"],
             "target_kv_bytes": pools["target_kv"], "draft_pool_bytes": pools["draft_pool"],
             "draft_ring_bytes": pools["draft_ring"], "state_bytes": pools["state_pool"],
             "max_admitted": r["max_admitted"], "limited_by": r["limited_by"], "kv_budget_bytes": r["kv_budget_bytes"],
             "per_request_bytes": r["per_request_bytes"], "full_attention_layers": r["full_attention_layers"]}]


# ---- the sweeps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    name: str  # the `wmtp bench` command
    kind: str  # results kind (SCHEMA.md); the file is OUT/<kind>.json
    help: str
    plan: Callable[[argparse.Namespace], Plan]
    rows: Callable[[argparse.Namespace, Cell, list[dict]], list[dict]]
    single_run: bool = False  # deterministic (memory): meta.runs = 1


SWEEPS: dict[str, Sweep] = {s.name: s for s in (
    Sweep("context", "context_sweep", "T_iter per mode over S (the windowing wedge, paper Fig. 3)", plan_context,
          rows_context),
    Sweep("depth", "depth_sweep", "T_iter per speculative mode over d (latency-model fit, paper Table 6)", plan_depth,
          rows_context),
    Sweep("phases", "phases", "per-iteration phase decomposition per speculative mode (paper Table 7)", plan_phases,
          rows_phases),
    Sweep("verify-by-k", "verify_by_k", "t_verify_ovh per forced accepted count k (AL-matched, reviewers)",
          plan_verify_by_k, rows_verify_by_k),
    Sweep("window", "window_sweep", "T_iter over the draft window W, and native (dose-response, cost side)",
          plan_window, rows_window),
    Sweep("batch", "batch_sweep", "per-user vs system tok/s up to the max admissible batch (Pareto, paper Fig. 4)",
          plan_batch, rows_batch),
    Sweep("memory", "memory", "pool bytes and max admitted requests per mode and S (KV budget)", plan_memory,
          rows_memory, single_run=True),
)}
SUITE_DEFAULT = "context,depth,phases,verify-by-k,window,batch,memory"


def _key(cell: Cell, m: Measure) -> str:
    """A (cell, measure) pair across processes: every field but the run count."""
    fields = {k: v for k, v in asdict(m).items() if k != "runs"}
    return json.dumps({"cell": asdict(cell), "measure": type(m).__name__, **fields}, sort_keys=True)


class Results:
    """Per-run results of (cell, measure) pairs. Each is appended to ``log`` (OUT/cells.jsonl) as it
    arrives; with ``resume`` the log's results for planned pairs are taken as done, so a call that
    ran out of time is continued without repeating the runs it finished."""

    def __init__(self, log: Path, planned: Plan, resume: bool) -> None:
        self._by: dict[tuple[Cell, Measure], dict[int, dict]] = {}
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        if resume and log.exists():
            keys = {_key(c, m): (c, m) for c, m in planned}
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                if rec["key"] in keys:
                    self._by.setdefault(keys[rec["key"]], {})[rec["run"]] = rec["out"]
        else:
            log.write_text("")

    def add(self, cell: Cell, m: Measure, run: int, out: dict) -> None:
        self._by.setdefault((cell, m), {})[run] = out
        with self.log.open("a") as f:
            f.write(json.dumps({"key": _key(cell, m), "run": run, "out": out}) + "\n")

    def has(self, cell: Cell, m: Measure, run: int) -> bool:
        return run in self._by.get((cell, m), {})

    def get(self, cell: Cell, m: Measure) -> list[dict]:
        """Results of runs 0..m.runs-1 done so far, in run order."""
        done = self._by.get((cell, m), {})
        return [done[r] for r in range(m.runs) if r in done]

    def complete(self, plan: Plan) -> bool:
        return all(len(self.get(c, m)) == m.runs for c, m in plan)

    def resumed(self) -> int:
        return sum(len(v) for v in self._by.values())


def schedule(plans: dict[str, Plan]) -> dict[Cell, list[Measure]]:
    """Cells in the order the sweeps first need them; per cell its distinct measures by ``order``."""
    cells: dict[Cell, list[Measure]] = {}
    for plan in plans.values():
        for c, m in plan:
            ms = cells.setdefault(c, [])
            if m not in ms:
                ms.append(m)
    return {c: sorted(ms, key=lambda m: m.order) for c, ms in cells.items()}


def _max_tokens(cell: Cell, measures: list[Measure]) -> int:
    """Tokens every request of the cell may emit: each iteration emits at most d."""
    return sum(m.steps(cell.spec.gamma) for m in measures) * cell.d + 8


def describe(m: Measure, out: dict) -> str:
    """One progress line per measure result."""
    if isinstance(m, TIter):
        floor = f", floor {out['floor_s'] * 1e3:.2f} ms" if out["floor_s"] else ""
        return f"T_iter {out['t_iter_s'] * 1e3:.2f} ms (p10 {out['t_iter_p10_s'] * 1e3:.2f}, p90 {out['t_iter_p90_s'] * 1e3:.2f}{floor})"
    if isinstance(m, Phases):
        parts = " + ".join(f"{k[2:-2]} {out[k] * 1e3:.2f}" for k in ("t_draft_fwd_s", "t_verify_base_s", "t_verify_ovh_s",
                                                                         "t_draft_ctx_s"))
        return f"phases {parts} ms (span {out['t_span_s'] * 1e3:.2f}) vs T_iter {out['t_iter_s'] * 1e3:.2f} ms"
    if isinstance(m, VerifyByK):
        return "t_verify_ovh by k: " + ", ".join(f"{v['k']}: {v['t_verify_ovh_s'] * 1e3:.3f}" for v in out["by_k"]) + " ms"
    if isinstance(m, BatchLadder):
        pts = ", ".join(f"B={p['B']}: {p['per_user_tok_s']:.1f}/{p['system_tok_s']:.1f}" for p in out["points"])
        return f"tok/s per-user/system {pts}; max admitted {out['max_admitted']} ({out['limited_by']})"
    return f"max admitted {out['max_admitted']} ({out['limited_by']}), pools {{{', '.join(f'{k}: {v / 2**30:.2f} GiB' for k, v in out['pools'].items())}}}"


# ---- meta, model, writing ---------------------------------------------------------------------


def _shape(cfg) -> dict:
    return {"layers": cfg.num_layers, "full_attention_layers": len(cfg.full_attention_layers), "hidden": cfg.hidden_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok, "vocab": cfg.vocab_size, "mtp_layers": cfg.num_nextn_predict_layers}


def _meta(a: argparse.Namespace, bench: Bench, sweep: Sweep) -> dict:
    from wmtp.bench.step import _meta as base

    dtype = str(bench.model.embed_weight.dtype).removeprefix("torch.")
    meta = {**base(a, True, 1 if sweep.single_run else a.runs), "dtype": dtype, "shape": _shape(bench.model.config),
            "backend": a.backend, "forced_accept": a.accept, "iters": a.iters, "warmup": a.warmup,
            "notes": f"synthetic context, forced acceptance k={a.accept} (clipped to γ): costs only, AL = k+1 by "
                     "construction; per-run values are medians over the timed iterations (phases: means)"}
    meta.pop("date")  # write_results stamps it (ISO 8601, UTC)
    if bench.bandwidth:
        meta["bandwidth_gbs"] = bench.bandwidth / 1e9
        meta["bandwidth_note"] = "HBM read bandwidth (streaming read), bytes per second"
    if sweep.name == "depth" and a.fit_d:
        meta["fit_d"] = list(a.fit_d)
    return meta


def write_sweep(a: argparse.Namespace, bench: Bench, sweep: Sweep, plan: Plan, res: Results) -> Path:
    from wmtp.analysis.report import write_results

    rows = []
    for c, m in plan:
        runs = res.get(c, m)[: m.runs]
        # per run: whether the decode graphs' bookkeeping ran compiled (None: no graph set, e.g. memory)
        rows += [{**row, "compiled_steps": [r.get("compiled_steps") for r in runs]} for row in sweep.rows(a, c, runs)]
    return write_results(Path(a.out) / f"{sweep.kind}.json", sweep.kind, rows, _meta(a, bench, sweep))


def make_bench(a: argparse.Namespace) -> Bench:
    import wmtp
    from wmtp.bench.floor import measure_bandwidth

    device = torch.device(a.device)
    bw = measure_bandwidth(device)["read_bytes_per_s"] if device.type == "cuda" and a.floor else None
    t0 = time.perf_counter()
    model = wmtp.load_model(a.preset, device=a.device, dtype=a.dtype, backend=a.backend, layers=a.layers)
    part = "" if a.layers is None else f" (first {a.layers} layers)"
    print(f"model {a.preset}{part} on {device} ({a.backend}) built in {time.perf_counter() - t0:.1f} s"
          + (f"; read bandwidth {bw / 1e12:.2f} TB/s" if bw else ""), flush=True)
    return Bench(model, device, a, bw)


# ---- the scheduler ------------------------------------------------------------------------------


def print_plan(cells: dict[Cell, list[Measure]]) -> None:
    engines = steps = 0
    for c, ms in cells.items():
        runs = max(m.runs for m in ms)
        n = sum(m.steps(c.spec.gamma) * m.runs for m in ms)
        engines, steps = engines + runs, steps + n
        print(f"  {c.label():46s} runs {runs} | {', '.join(type(m).__name__ for m in ms):30s} | {n} iterations")
    print(f"plan: {len(cells)} cells, {engines} engines, {steps} iterations (warm-up included; a batch "
          "ladder's count assumes every ladder B fits)", flush=True)


def run_sweeps(a: argparse.Namespace, names: list[str]) -> int:
    """Run the sweeps ``names`` in one process; 0 when every file was written, 3 when
    ``--deadline`` stopped it first (the files of finished sweeps are written)."""
    start = time.perf_counter()
    sweeps = [SWEEPS[n] for n in names]
    plans = {s.name: s.plan(a) for s in sweeps}
    cells = schedule(plans)
    print_plan(cells)
    if a.plan:
        return 0
    res = Results(Path(a.out) / "cells.jsonl", [p for plan in plans.values() for p in plan], a.resume)
    if res.resumed():
        print(f"resuming: {res.resumed()} measure runs already in {res.log}", flush=True)
    bench = make_bench(a)
    pending, took = _write_finished(a, bench, list(sweeps), plans, res, start), {}
    for i, (cell, measures) in enumerate(cells.items(), 1):
        max_tokens = _max_tokens(cell, measures)
        for run in range(max(m.runs for m in measures)):
            todo = [m for m in measures if run < m.runs and not res.has(cell, m, run)]
            if not todo:
                continue
            guess = took.get(cell, max(took.values(), default=0.0))
            if a.deadline and time.perf_counter() - start + guess > a.deadline:
                print(f"deadline {a.deadline:.0f} s: stopped before {cell.label()} run {run + 1}; unfinished: "
                      f"{', '.join(s.name for s in pending)} (continue with --resume)", flush=True)
                return 3
            t0 = time.perf_counter()
            with open_cell(bench, cell, run, max_tokens, any(m.randomize for m in todo)) as cr:
                for m in todo:
                    out = {**m(cr), "compiled_steps": cr.eng.compiled_steps}
                    res.add(cell, m, run, out)
                    print(f"[{i}/{len(cells)}] {cell.label()} run {run + 1}: {describe(m, out)}", flush=True)
            took[cell] = time.perf_counter() - t0
        pending = _write_finished(a, bench, pending, plans, res, start)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


def _write_finished(a: argparse.Namespace, bench: Bench, pending: list[Sweep], plans: dict[str, Plan],
                    res: Results, start: float) -> list[Sweep]:
    left = []
    for s in pending:
        if res.complete(plans[s.name]):
            path = write_sweep(a, bench, s, plans[s.name], res)
            print(f"wrote {path} ({s.name}, {time.perf_counter() - start:.0f} s in)", flush=True)
        else:
            left.append(s)
    return left


# ---- command line -------------------------------------------------------------------------------


def int_list(option: str, ranges: bool = False) -> Callable[[str], tuple[int, ...]]:
    """argparse type: comma-separated ints (``2-9`` ranges where allowed); errors name ``option``."""

    def parse(text: str) -> tuple[int, ...]:
        out: list[int] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, sep, hi = part.partition("-") if ranges else (part, "", "")
            try:
                out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
            except ValueError:
                raise argparse.ArgumentTypeError(f"{option}: {part!r} is not an integer"
                                                 + (" or a range like 2-9" if ranges else "")) from None
        if not out:
            raise argparse.ArgumentTypeError(f"{option}: give at least one value")
        return tuple(out)

    return parse


def name_list(option: str, allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{option}: {bad or 'nothing'} not in {list(allowed)}")
        return names

    return parse


def add_sweep_args(sub: argparse._SubParsersAction) -> None:
    """One sub-command per sweep plus ``suite``; all take the same options (each uses its own)."""
    for name, help in [(s.name, s.help) for s in SWEEPS.values()] + [("suite", "several sweeps in one process")]:
        p = sub.add_parser(name, help=help, description=f"{help}. Synthetic context, forced acceptance.")
        _options(p, suite=name == "suite")


def _options(p: argparse.ArgumentParser, suite: bool) -> None:
    if suite:
        p.add_argument("--sweeps", type=name_list("--sweeps", tuple(SWEEPS)), default=SUITE_DEFAULT.split(","),
                       help=f"which, in this order (default {SUITE_DEFAULT})")
    p.add_argument("--out", required=True, help="directory for the results JSON (one <kind>.json per sweep)")
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    add_layers_arg(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, the preset's own on CPU")
    p.add_argument("--backend", default="auto", help="torch | triton | auto (triton on CUDA)")
    p.add_argument("--modes", type=name_list("--modes", MODES), default=("native", "windowed"),
                   help="modes of the context/depth/phases/verify-by-k sweeps (dense is skipped where there is no draft)")
    p.add_argument("--batch-modes", type=name_list("--batch-modes", MODES), default=("dense", "native", "windowed"),
                   help="modes of the batch and memory sweeps")
    p.add_argument("-d", type=int, default=7, help="d = γ + 1 verify tokens (all sweeps but depth)")
    p.add_argument("--context", type=int, default=1_040_000, help="S of the depth/phases/verify-by-k/window/batch sweeps")
    p.add_argument("--contexts", type=int_list("--contexts"), default=(131_072, 262_144, 524_288, 1_040_000),
                   help="S values of the context and memory sweeps")
    p.add_argument("--depths", type=int_list("--depths", ranges=True), default=tuple(range(2, 10)), help="d values, e.g. 2-9")
    p.add_argument("--fit-d", type=int_list("--fit-d"), default=None, help="lo,hi: depth-sweep fit range (meta.fit_d)")
    p.add_argument("--window", type=int, default=4032, help="W of the windowed mode")
    p.add_argument("--windows", type=int_list("--windows"), default=(960, 1984, 4032, 8128, 16320),
                   help="W values of the window sweep (default: W + sink = 1K..16K)")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="independent runs (fresh engine each) per cell")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before each timed block")
    p.add_argument("--k-iters", type=int, default=None, help="verify-by-k: timed iterations per k (default --iters)")
    p.add_argument("--accept", type=int, default=3, help="forced accepted drafts per iteration (clipped to γ)")
    p.add_argument("--no-floor", dest="floor", action="store_false", help="skip the bytes floor (expert counting)")
    p.add_argument("--batch-ladder", type=int_list("--batch-ladder"), default=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
                   help="B values timed on the way up (then the max admissible B)")
    p.add_argument("--max-batch", type=int, default=64, help="cap on requests seated at once (batch, memory)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV budget of batch/memory (default on CUDA: free memory − --reserve-gib; required on CPU)")
    p.add_argument("--reserve-gib", type=float, default=16.0,
                   help="left free for activations and decode graphs (6 GiB ran out in the 1M batch sweep)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: start no engine that would likely end past it (finished sweeps are written)")
    p.add_argument("--resume", action="store_true",
                   help="keep the per-run results already in OUT/cells.jsonl (same options) and run only the rest")
    p.add_argument("--plan", action="store_true", help="print the cells and iteration counts, run nothing")


def check_options(a: argparse.Namespace, names: list[str]) -> None:
    """Bad values raise WmtpError naming the option."""
    from wmtp.bench.step import check_bounds

    positive = {"--runs": a.runs, "--iters": a.iters, "--warmup": a.warmup, "-d": a.d, "--context": a.context,
                "--window": a.window, "--page-size": a.page_size, "--max-batch": a.max_batch,
                "--k-iters": a.k_iters or 1, "--contexts": min(a.contexts), "--windows": min(a.windows),
                "--batch-ladder": min(a.batch_ladder)}
    check_bounds(positive, {"--accept": a.accept, "--sink": a.sink, "--reserve-gib": a.reserve_gib})
    check_layers(a)
    if a.d < 2 and any(m != "dense" for m in a.modes + a.batch_modes):
        raise WmtpError(f"-d={a.d}: speculative modes need d >= 2")
    if "depth" in names and min(a.depths) < 2:
        raise WmtpError(f"--depths: d={min(a.depths)} < 2 (d = γ + 1 needs at least one draft)")
    if a.fit_d is not None and (len(a.fit_d) != 2 or a.fit_d[0] > a.fit_d[1]):
        raise WmtpError(f"--fit-d={','.join(map(str, a.fit_d))}: give lo,hi with lo <= hi")
    drafted = {"depth", "phases", "verify-by-k"} & set(names)
    if drafted and not any(m != "dense" for m in a.modes):
        raise WmtpError(f"--modes={','.join(a.modes)}: the {', '.join(sorted(drafted))} sweep needs a speculative mode")
    if a.plan:
        return  # nothing runs: the device is not needed
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        raise WmtpError(f"--device={a.device}: no CUDA device here (use --device cpu with a tiny preset)")
    if {"batch", "memory"} & set(names) and a.kv_budget_gib is None and torch.device(a.device).type != "cuda":
        raise WmtpError("--kv-budget-gib is required for the batch/memory sweeps off CUDA (no free-memory query)")
    if a.kv_budget_gib is not None and a.kv_budget_gib <= 0:
        raise WmtpError(f"--kv-budget-gib={a.kv_budget_gib} must be > 0")


def run(a: argparse.Namespace) -> int:
    from wmtp.models.backend import default_backend

    names = list(a.sweeps) if a.bench == "suite" else [a.bench]
    check_options(a, names)
    a.backend = default_backend(a.device) if a.backend == "auto" else a.backend
    if a.dtype is None and torch.device(a.device).type == "cuda":
        a.dtype = "bfloat16"
    return run_sweeps(a, names)
