"""On CPU: adaptive draft depth against every fixed depth with REAL acceptance — SmolLM2-135M + its
trained MTP head on the chat-wrapped RULER workloads at 8K, windowed W = 512, sink 16, greedy.

    PYTHONPATH=. python scripts/depth_sweep.py --gen 96

Per prompt: one prefill (``wmtp.bench.acceptance.take_snapshot``), then each config decodes
``--gen`` tokens (ignore_eos) from the fork, timed from the fork's first token to the last: TPOT,
AL, the depths ``auto`` chose. The configs run in ``--rounds`` rounds, each in a rotated order (a
loaded host drifts; every config sees the same drift on average); TPOT is the median over rounds.
``--interleave`` forks the configs together and steps them in turn, each iteration timed alone, so
a noisy host's drift falls on all of them alike. Every output must equal dense's (lossless). Writes
``benchmarks/results/acceptance/depth.json`` and the run-length traces of the d = 8 runs (``depth_traces.json``, γ = 7) that
``wmtp bench depth-replay`` replays on the GPU. The summary gives auto's TPOT over the best fixed
depth's both as a ratio of medians and as the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from scripts.acceptance_sweep import HEAD, MODEL, TASKS, load
from wmtp.bench.acceptance import fork, take_snapshot
from wmtp.engine.config import SpecConfig
from wmtp.engine.metrics import acceptance_length
from wmtp.engine.sampling import SamplingParams

BASE = dict(mode="windowed", window=512, sink=16)
FIXED = range(2, 9)
TRACE_D = 8


def configs() -> dict[str, SpecConfig]:
    specs = {f"d{d}": SpecConfig(**BASE, num_draft_tokens=d) for d in FIXED}
    specs["auto"] = SpecConfig(**BASE, num_draft_tokens="auto", max_draft_tokens=max(FIXED))
    return specs


def open_fork(model, snap, spec: SpecConfig, gen: int, warm: dict | None = None):
    """An engine forked from ``snap`` to decode ``gen`` tokens. ``warm`` (auto only) carries the depth
    controller and the pooled acceptance counts from run to run, as one serving engine keeps them
    across requests."""
    eng, req = fork(model, snap, spec, SamplingParams(max_tokens=gen, ignore_eos=True))
    if warm is not None:
        eng.depth = warm.setdefault("depth", eng.depth)
        eng.metrics.positions = warm.setdefault("positions", eng.metrics.positions)
    return eng, req


def result(eng, req, snap, seconds: float) -> dict:
    m = req.metrics
    return {"tokens": req.tokens[len(snap.prompt):], "seconds": seconds, "tpot_s": seconds / (m.num_generated - 1),
            "hist": list(m.hist), "gammas": list(m.gammas), "runs": [it.accepted for it in eng.trace.get(req.id, [])]}


@torch.no_grad()
def decode(model, snap, spec: SpecConfig, gen: int, warm: dict | None = None) -> dict:
    """One fork decoding ``gen`` tokens, timed from the fork's first token to the last."""
    eng, req = open_fork(model, snap, spec, gen, warm)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return result(eng, req, snap, time.perf_counter() - t0)


@torch.no_grad()
def decode_interleaved(model, snap, specs: dict[str, SpecConfig], gen: int, warm: dict) -> dict[str, dict]:
    """Every config forked at once and stepped in turn, one iteration each, each step timed alone:
    the host's drift (seconds to minutes on a shared machine) falls on every config alike, so the
    ratios of their TPOTs are paired within the same stretch of time."""
    forks = {n: open_fork(model, snap, s, gen, warm if n == "auto" else None) for n, s in specs.items()}
    seconds = dict.fromkeys(forks, 0.0)
    while any(eng.has_unfinished() for eng, _ in forks.values()):
        for n, (eng, _) in forks.items():
            if eng.has_unfinished():
                t0 = time.perf_counter()
                eng.step()
                seconds[n] += time.perf_counter() - t0
    return {n: result(eng, req, snap, seconds[n]) for n, (eng, req) in forks.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--head", default=HEAD)
    ap.add_argument("--tasks", nargs="*", default=TASKS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/acceptance/depth.json")
    ap.add_argument("--traces-out", default="benchmarks/results/acceptance/depth_traces.json")
    ap.add_argument("--interleave", action="store_true",
                    help="fork every config at once and step them in turn (decode_interleaved) instead of one after another")
    ap.add_argument("--configs", default=",".join(configs()),
                    help=f"which of {','.join(configs())} to run (traces need d{TRACE_D})")
    a = ap.parse_args()
    wanted = a.configs.split(",")
    if set(wanted) - set(configs()) or "auto" not in wanted:
        raise SystemExit(f"depth_sweep: --configs must include auto and name only {list(configs())} (got {a.configs})")
    from wmtp.workloads import make_workload

    model = load(a.model, a.head)
    specs = {n: s for n, s in configs().items() if n in wanted}
    names = list(specs)
    rows, traces, warm = [], {}, {}
    for i, task in enumerate(a.tasks):
        w = make_workload(task, a.tokens, a.model, seed=a.seed, chat=True)
        snap = take_snapshot(model, w["token_ids"], prefill_chunk=a.prefill_chunk)
        dense = decode(model, snap, SpecConfig(mode="dense", num_draft_tokens=1), a.gen)
        if i == 0:  # auto's controller calibrates once, untimed, then serves every prompt warm
            decode(model, snap, specs["auto"], a.gen, warm)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            if a.interleave:
                for n, x in decode_interleaved(model, snap, {n: specs[n] for n in order}, a.gen, warm).items():
                    runs[n].append(x)
                continue
            for n in order:
                runs[n].append(decode(model, snap, specs[n], a.gen, warm if n == "auto" else None))
        for n in names:
            first = runs[n][0]
            rows.append({"trace": task, "config": n, "tpot_s": statistics.median(x["tpot_s"] for x in runs[n]),
                         "tpot_rounds_s": [x["tpot_s"] for x in runs[n]], "al": acceptance_length(first["hist"]),
                         "gamma_histogram": [first["gammas"].count(g) for g in range(specs[n].gamma + 1)],
                         "equal_dense": all(x["tokens"] == dense["tokens"] for x in runs[n])})
            print(f"{task:16s} {n:5s} TPOT {rows[-1]['tpot_s'] * 1e3:7.1f} ms AL {rows[-1]['al']:.3f} "
                  f"γ {rows[-1]['gamma_histogram']} equal_dense={rows[-1]['equal_dense']}", flush=True)
        if f"d{TRACE_D}" in runs:
            traces[task] = runs[f"d{TRACE_D}"][0]["runs"]
        write(rows, traces, a)  # after every prompt: a run cut short keeps what it measured


def write(rows: list[dict], traces: dict[str, list[int]], a: argparse.Namespace) -> None:
    """The results file (``kind: adaptive_depth``, wmtp/analysis/SCHEMA.md) and the trace file."""
    import datetime

    from wmtp.bench.step import hardware_name, revision

    summary, names = [], list(dict.fromkeys(r["config"] for r in rows))
    for task in dict.fromkeys(r["trace"] for r in rows):
        mine = {r["config"]: r for r in rows if r["trace"] == task}
        best = min((n for n in names if n != "auto"), key=lambda n: mine[n]["tpot_s"])
        # paired within each round (the two ran minutes apart, or step by step with --interleave, not a round
        # apart): the host's drift cancels
        paired = statistics.median(x / y for x, y in zip(mine["auto"]["tpot_rounds_s"], mine[best]["tpot_rounds_s"]))
        summary.append({"trace": task, "best_fixed": best, "auto_over_best": mine["auto"]["tpot_s"] / mine[best]["tpot_s"],
                        "auto_over_best_paired": paired})
        if "d7" in mine:
            summary[-1]["auto_over_d7"] = mine["auto"]["tpot_s"] / mine["d7"]["tpot_s"]
        print(summary[-1], flush=True)
    what = (f"SmolLM2-135M + its MTP head, windowed W=512 sink=16, greedy, real acceptance: TPOT of auto (d_max "
            f"{max(FIXED)}; its controller and pooled acceptance carried from prompt to prompt after one untimed "
            f"calibration run, as in a serving engine) and of {', '.join(n for n in names if n != 'auto')}, median "
            f"over {a.rounds} rounds in rotated order"
            + (", the configs forked together and stepped in turn, each step timed alone" if a.interleave else ""))
    meta = {"hardware": hardware_name("cpu"), "model": "smollm2-135m + MTP head", "dtype": "float32",
            "synthetic": False, "runs": 1, "command": "PYTHONPATH=. python scripts/depth_sweep.py " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(), "commit": revision(), "what": what,
            "prompts": f"{len(a.tasks)} chat-wrapped RULER prompts of {a.tokens} tokens (seed {a.seed}), {a.gen} "
                       "tokens each with ignore_eos"}
    Path(a.out).write_text(json.dumps({"kind": "adaptive_depth", "schema": 1, "meta": meta, "rows": rows,
                                       "summary": summary}, indent=1) + "\n")
    if traces:
        Path(a.traces_out).write_text(json.dumps({
            "what": f"acceptance run lengths per iteration of the d={TRACE_D} runs of {a.out} (censored at gamma)",
            "gamma": TRACE_D - 1, "traces": traces}) + "\n")
    print(f"wrote {a.out}" + (f" and {a.traces_out}" if traces else ""))


if __name__ == "__main__":
    main()
