"""``wmtp bench depth-replay``: TPOT of adaptive depth (``num_draft_tokens="auto"``) against fixed
depths, on a long synthetic context, replaying recorded acceptance.

A trace is a list of acceptance run lengths r_i: iteration i of a real decode accepted r_i drafts
in a row (recorded at a fixed depth γ_rec, so censored at γ_rec; ``scripts/depth_sweep.py`` writes
them from SmolLM2's real decodes). Replayed through forced acceptance (DESIGN §6), iteration i of
a run at depth γ accepts min(r_i, γ): the same acceptance process at every depth, with the real
model's costs of the preset at S tokens. Per config: an untimed pass over every trace, each on one
request (every graph set the config will use captured, the controller's time tables filled: a
server's warm state), then each trace's timed pass on a fresh request; TPOT = wall time / tokens emitted, T_iter = wall time / iterations.
The adaptive controller sees only the accepted counts, never the trace.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from wmtp.bench.step import add_engine_args
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.errors import WmtpError


def load_traces(path: str) -> tuple[dict[str, list[int]], int]:
    """``{"gamma": γ_rec, "traces": {name: [r_i, ...]}}`` → (traces, γ_rec), checked."""
    try:
        doc = json.loads(Path(path).read_text())
        traces, gamma = doc["traces"], int(doc["gamma"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WmtpError(f"--traces {path}: not a trace file ({{'gamma': int, 'traces': {{name: [ints]}}}}): {e}") from e
    for name, t in traces.items():
        if not t or any(not isinstance(r, int) or not 0 <= r <= gamma for r in t):
            raise WmtpError(f"--traces {path}: trace {name!r} must be a non-empty list of ints in [0, gamma={gamma}]")
    return traces, gamma


def _pass(eng: Engine, context: int, trace: list[int], seed: int) -> dict:
    """One request decoding len(trace) iterations, iteration i forced to accept trace[i]."""
    from wmtp.bench.step import _sync
    from wmtp.bench.synthetic import add_synthetic_request

    req = add_synthetic_request(eng, context, 8 * len(trace) + 8 * (eng.spec.gamma + 1), seed=seed)
    start = req.num_generated
    _sync(eng.device)
    t0 = time.perf_counter()
    for r in trace:  # each step launches one iteration (and collects the one before it)
        eng.forced_accept = r
        eng.step()
    eng._drain()
    _sync(eng.device)
    seconds = time.perf_counter() - t0
    tokens, gammas = req.num_generated - start, list(req.metrics.gammas)
    eng.abort(req.id)
    return {"seconds": seconds, "tokens": tokens, "iterations": len(gammas), "gammas": gammas}


def replay(model, spec: SpecConfig, traces: dict[str, list[int]], a: argparse.Namespace) -> list[dict]:
    """Every trace under one engine of ``spec``: all warm passes, then the timed ones (so no timed
    pass captures a graph set a later warm pass would have), one row per trace."""
    from wmtp.bench.step import release_pools
    from wmtp.bench.synthetic import randomize_pools

    longest = max(len(t) for t in traces.values())
    eng = Engine(model, spec, EngineConfig(max_model_len=a.context + 8 * longest + 8 * spec.verify_tokens,
                                           max_num_seqs=1, page_size=a.page_size, decode_graphs=a.decode_graphs))
    randomize_pools(eng)
    rows = []
    for i, trace in enumerate(traces.values()):
        _pass(eng, a.context, trace, seed=2 * i)
    for i, (name, trace) in enumerate(traces.items()):
        r = _pass(eng, a.context, trace, seed=2 * i + 1)
        label = "auto" if spec.adaptive else f"d{spec.num_draft_tokens}"
        row = {"config": label, "mode": spec.mode, "trace": name, "S": a.context, "d_max": spec.num_draft_tokens,
               "tpot_s": r["seconds"] / r["tokens"], "t_iter_s": r["seconds"] / r["iterations"],
               "al": r["tokens"] / r["iterations"], "iterations": r["iterations"], "tokens": r["tokens"],
               "gamma_histogram": [r["gammas"].count(g) for g in range(spec.gamma + 1)]}
        rows.append(row)
        print(f"[{spec.mode} {label:5s}] {name:24s} TPOT {row['tpot_s'] * 1e3:7.2f} ms  T_iter "
              f"{row['t_iter_s'] * 1e3:7.2f} ms  AL {row['al']:.3f}  γ {row['gamma_histogram']}", flush=True)
    del eng
    release_pools(model)
    return rows


def summarise(rows: list[dict], reference: str) -> list[dict]:
    """Per trace: auto's TPOT over the best fixed depth's, and over ``reference``'s (e.g. d7)."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        mine = {r["config"]: r for r in rows if r["trace"] == trace}
        fixed = {c: r for c, r in mine.items() if c != "auto"}
        if "auto" not in mine or not fixed:
            continue
        best = min(fixed, key=lambda c: fixed[c]["tpot_s"])
        row = {"trace": trace, "best_fixed": best, "auto_over_best": mine["auto"]["tpot_s"] / fixed[best]["tpot_s"]}
        if reference in fixed:
            row[f"auto_over_{reference}"] = mine["auto"]["tpot_s"] / fixed[reference]["tpot_s"]
        out.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return out


def run_depth_replay(a: argparse.Namespace) -> int:
    import wmtp
    from wmtp.bench.step import _meta, weights

    traces, gamma_rec = load_traces(a.traces)
    tokens = a.depths.split(",")
    if any(t != "auto" and not t.isdigit() for t in tokens):
        raise WmtpError(f"--depths {a.depths}: comma-separated ints and/or 'auto'")
    depths = [int(t) for t in tokens if t != "auto"]
    if any(d < 2 for d in depths) or max(depths, default=2) - 1 > gamma_rec or a.max_draft_tokens - 1 > gamma_rec:
        raise WmtpError(f"--depths {a.depths} / --max-draft-tokens {a.max_draft_tokens}: each d in [2, gamma+1="
                        f"{gamma_rec + 1}] (the traces are censored at gamma={gamma_rec})")
    model = wmtp.load_model(a.preset, device=a.device, dtype=a.dtype, backend=a.backend)
    specs = [SpecConfig(mode=a.mode, num_draft_tokens="auto", max_draft_tokens=a.max_draft_tokens, window=a.window,
                        sink=a.sink) if d == "auto" else
             SpecConfig(mode=a.mode, num_draft_tokens=int(d), window=a.window, sink=a.sink)
             for d in tokens]  # in the order given
    meta = {**_meta(a, True), "weights": weights(model), "backend": a.backend, "traces": a.traces,
            "trace_gamma": gamma_rec, "decode_graphs": a.decode_graphs,
            "what": "forced acceptance min(r_i, γ) replaying recorded run lengths r_i; an untimed pass over every "
                    "trace, then each trace's timed pass on a fresh request"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for spec in specs:  # written after every config: a run cut short keeps what it measured
        rows += replay(model, spec, traces, a)
        result = {"kind": "adaptive_depth", "schema": 1, "meta": meta, "rows": rows,
                  "summary": summarise(rows, a.reference) if spec is specs[-1] else []}
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


def add_args(sub: argparse._SubParsersAction) -> None:
    help = "TPOT of adaptive depth vs fixed depths, replaying acceptance traces (synthetic context)"
    s = sub.add_parser("depth-replay", help=help, description=help)
    s.add_argument("--traces", required=True, help="trace file (scripts/depth_sweep.py)")
    s.add_argument("--preset", default="qwen3.6-35b-a3b")
    s.add_argument("--mode", default="windowed", choices=["native", "windowed"])
    s.add_argument("--depths", default="2,3,4,5,6,7,8,auto", help="fixed d values and/or auto")
    s.add_argument("--max-draft-tokens", type=int, default=8, help="d_max of auto")
    s.add_argument("--reference", default="d7", help="the fixed config auto is also compared with")
    s.add_argument("--context", type=int, default=1_040_000, help="S, synthetic")
    add_engine_args(s)
