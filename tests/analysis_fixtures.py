"""TEST DATA ONLY: fake-but-plausible results files of every kind for the report tests.

Shapes follow the paper's Qwen-35B 1M numbers loosely (native ~27 ms, windowed ~18 ms per iteration at
d = 7). Nothing here was measured; every file says so in meta.notes and meta.hardware.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from wmtp.analysis.diff import output_diff_table

MS = 1e-3
RUNS = 3


def _meta(rng: random.Random, **extra) -> dict:
    return {"hardware": "FAKE (test data)", "model": "qwen3.6-35b-a3b", "dtype": "bfloat16", "synthetic": True,
            "runs": RUNS, "command": "tests/analysis_fixtures.py (fake data)", "date": "2026-11-30T12:00:00Z",
            "notes": "fake test data, not a measurement",
            "shape": {"layers": 40, "full_attention": 10, "hidden": 2048, "experts": 256}, **extra}


def _runs(rng: random.Random, mean: float, rel: float = 0.01) -> list[float]:
    return [mean * (1 + rng.gauss(0, rel)) for _ in range(RUNS)]


def _t_iter(mode: str, s: int, d: int) -> float:
    """Fake latency model (seconds): verify grows with S, the native draft's scan too."""
    f = s / 2**20
    gamma = d - 1
    verify = (8 + 6 * f + 0.4 * d) * MS
    if mode == "dense":
        return (8 + 6 * f) * MS
    if mode == "native":
        return verify + (3.5 * f + 0.5) * MS + gamma * (0.45 + 0.75 * f) * MS
    window = min(f, 4096 / 2**20)  # the window reads at most sink + W keys: equal to native on short contexts
    return verify + (3.5 * window + 0.5) * MS + gamma * (0.45 + 0.75 * window) * MS + 0.1 * MS * gamma * f


def _rows_step(rng):
    s = 2**20
    out = []
    for mode, d, al in (("dense", 1, 1.0), ("native", 7, 4.49), ("windowed", 7, 4.74)):
        t = _t_iter(mode, s, d)
        out.append({"mode": mode, "S": s, "d": d, "B": 1, "t_iter_s": _runs(rng, t), "t_iter_p10_s": _runs(rng, 0.97 * t),
                    "t_iter_p90_s": _runs(rng, 1.04 * t), "floor_s": 0.55 * t, "floor_bytes": int(2.6e9),
                    "al": [1.0] * RUNS if mode == "dense" else _runs(rng, al, 0.02)})
    return out


def _rows_context(rng):
    return [{"mode": m, "S": s, "d": 7, "t_iter_s": _runs(rng, _t_iter(m, s, 7))}
            for m in ("native", "windowed") for s in (65536, 131072, 262144, 524288, 1048576)]


def _rows_depth(rng):
    return [{"mode": m, "d": d, "S": 2**20, "t_iter_s": _runs(rng, _t_iter(m, 2**20, d), 0.006)}
            for m in ("native", "windowed") for d in range(2, 10)]


def _rows_phases(rng):
    out = []
    for mode in ("native", "windowed"):
        base, ovh = 12.0 * MS, 1.1 * MS
        ctx = (4.6 if mode == "native" else 0.6) * MS
        fwd = 5 * (1.2 if mode == "native" else 0.71) * MS
        out.append({"mode": mode, "d": 7, "S": 2**20, "t_verify_base_s": _runs(rng, base), "t_verify_ovh_s": _runs(rng, ovh),
                    "t_draft_ctx_s": _runs(rng, ctx), "t_draft_fwd_s": _runs(rng, fwd), "draft_steps": 5,
                    "t_iter_s": _runs(rng, 1.01 * (base + ovh + ctx + fwd))})
    return out


def _rows_verify_by_k(rng):
    return [{"mode": m, "d": 7, "k": k, "t_verify_ovh_s": _runs(rng, (1.0 + 0.03 * k) * MS, 0.02),
             "iterations": [rng.randint(20, 90) for _ in range(RUNS)]} for m in ("native", "windowed") for k in range(7)]


def _rows_window(rng):
    als = {1024: 4.1, 2048: 4.5, 4032: 4.74, 8192: 4.7, "native": 4.49}
    return [{"W": w, "sink": 64, "d": 7, "S": 2**20,
             "t_iter_s": _runs(rng, _t_iter("native" if w == "native" else "windowed", 2**20, 7) + (0 if w == "native" else w * 1e-7)),
             "al": _runs(rng, al, 0.02)} for w, al in als.items()]


def _rows_batch(rng):
    out = []
    for mode, d, al in (("dense", 1, 1.0), ("native", 3, 2.3), ("native", 7, 4.49), ("windowed", 3, 2.35), ("windowed", 7, 4.74)):
        cap = {"dense": 8, "native": 6, "windowed": 8}[mode]
        for b in (1, 2, 4, 8):
            adm = min(b, cap)
            t = _t_iter(mode, 2**20, d) * (1 + 0.35 * (adm - 1))
            per_user = al / t
            out.append({"mode": mode, "B": b, "d": d, "per_user_tok_s": _runs(rng, per_user),
                        "system_tok_s": _runs(rng, per_user * adm), "admitted": adm})
    return out


def _rows_memory(rng):
    tok, per = 4 * 2**20, 2048
    return [{"mode": m, "S": 2**20, "d": 7, "max_total_tokens": tok, "target_kv_bytes": 10 * per * tok,
             "draft_pool_bytes": per * tok if m == "native" else 0,
             "draft_ring_bytes": per * (64 + 4032 + 7) * 4 if m == "windowed" else 0,
             "state_bytes": 30 * 16 * 32 * 128 * 128 * 4 * 4, "max_admitted": 3 if m == "native" else 4}
            for m in ("native", "windowed")]


def sample_hist(rng: random.Random, alphas: list[float], iterations: int) -> list[int]:
    """Iterations accept drafts one by one with probability α_j until the first rejection."""
    hist = [0] * (len(alphas) + 1)
    for _ in range(iterations):
        n = 0
        while n < len(alphas) and rng.random() < alphas[n]:
            n += 1
        hist[n] += 1
    return hist


def _rows_acceptance(rng):
    prof = {("niah_mq", "native"): [0.9, 0.85, 0.8, 0.78, 0.75, 0.7], ("niah_mq", "windowed"): [0.9, 0.86, 0.82, 0.8, 0.76, 0.72],
            ("fwe", "native"): [0.7, 0.6, 0.55, 0.5, 0.45, 0.4], ("fwe", "windowed"): [0.7, 0.58, 0.5, 0.47, 0.4, 0.3]}
    return [{"task": t, "mode": m, "sink": 64, "W": None if m == "native" else 4032, "d": 7,
             "hists": [sample_hist(rng, a, 300) for _ in range(RUNS)]} for (t, m), a in prof.items()]


def _rows_probe(rng):
    return [{"task": t, "S": 2**20, "sink": 64, "W": 4032, "steps": 512, "flipped": f, "agreement": 1 - f / 512,
             "margin_all": 3.9, "margin_flipped": 0.5, "z_far": 0.22, "readout_change": 0.15}
            for t, f in (("niah_mq", 38), ("fwe", 61))]


def _rows_diff(rng):
    base = [rng.randrange(512) for _ in range(64)]
    outputs = {"dense": {"p0": base, "p1": base[::-1]},
               "native": {"p0": base, "p1": base[::-1]},
               "windowed": {"p0": base[:40] + [7] * 24, "p1": base[::-1]}}
    return [c.to_dict() for c in output_diff_table(outputs)]


def _rows_ttft(rng):
    return [{"mode": m, "tokens": 131072, "chunk": 8192, "ttft_s": rng.uniform(5, 8), "repeat_suffix": 200,
             "repeat_ttft_s": 0.6, "repeat_cached_tokens": 122880,
             "split_s": {"attention": 2.0, "recurrent": 1.0, "moe": 1.5, "mlp": 0.0, "rest": 0.5}}
            for m in ("native", "windowed")]


def _rows_peer(rng):
    rows = []
    for engine, modes in (("vllm", ("dense", "mtp")), ("wmtp", ("dense", "native", "windowed"))):
        for m in modes:
            d = 1 if m == "dense" else 7
            t = _runs(rng, rng.uniform(3e-3, 1.2e-2))
            rows.append({"engine": engine, "mode": m, "d": d, "S": 131072, "B": 1, "t_iter_s": t, "tpot_s": t,
                         "ttft_s": _runs(rng, rng.uniform(3, 7)), "al": [1.0] * RUNS})
            rows.append({"engine": engine, "mode": m, "d": d, "S": 131072, "B": 8, "t_iter_s": [4 * x for x in t],
                         "system_tok_s": [2 / x for x in t], "per_user_tok_s": [0.25 / x for x in t], "al": [1.0] * RUNS})
    return rows


def _rows_adaptive_depth(rng):
    rows = []
    for trace, alpha in (("hard", 0.15), ("easy", 0.8)):
        for d in range(2, 9):
            al = sum(alpha**k for k in range(d))
            rows.append({"config": f"d{d}", "trace": trace, "tpot_s": (10 + d) * 1e-3 / al, "al": al,
                         "gamma_histogram": [0] * (d - 1) + [40]})
        rows.append({"config": "auto", "trace": trace, "tpot_s": rng.uniform(0.9, 1.1) * 11e-3, "al": 1.2,
                     "gamma_histogram": [3, 30, 2, 1, 0, 0, 0, 4]})
    for r in rows[:8]:  # "hard" with two equal rounds: the per-round ratio equals the ratio of medians
        r["tpot_rounds_s"] = [r["tpot_s"]] * 2
    return rows


def _rows_multiturn(rng):
    return [{"mode": "windowed", "prefix_cache": cache, "users": 4, "turns": 3, "doc_tokens": 131072,
             "ttft_s": [[rng.uniform(0.9, 1.1) * (6.0 if t == 0 or not cache else 0.6) for t in range(3)] for _ in range(4)],
             "mean_ttft_s_per_turn": [6.0] + [0.6 if cache else 6.0] * 2, "cached_tokens": 786432 if cache else 0,
             **({"divergence": [None, [1, 4], None, None]} if cache else {})}
            for cache in (False, True)]


def _rows_kv_logits(rng):
    return [{"model": "tiny-llama", "scales": scales, "tokens": 512, "text": "random ids", "max_abs": rng.uniform(0.01, 0.02),
             "mean_abs": 3e-4, "logit_span": 2.3, "argmax_changed": 1} for scales in ("1.0", "calibrated")]


BUILDERS = {"step": _rows_step, "ttft": _rows_ttft, "context_sweep": _rows_context, "depth_sweep": _rows_depth, "phases": _rows_phases,
            "verify_by_k": _rows_verify_by_k, "window_sweep": _rows_window, "batch_sweep": _rows_batch,
            "memory": _rows_memory, "acceptance": _rows_acceptance, "probe": _rows_probe, "output_diff": _rows_diff,
            "peer": _rows_peer, "adaptive_depth": _rows_adaptive_depth,
            "multiturn": _rows_multiturn, "kv_logits": _rows_kv_logits}


def write_fake_results(out: Path, kinds: list[str] | None = None, seed: int = 0) -> list[Path]:
    """Write one fake results file per kind into ``out``; returns the paths."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in kinds or list(BUILDERS):
        extra = {"fit_d": [3, 9]} if kind == "depth_sweep" else {}
        obj = {"kind": kind, "schema": 1, "meta": _meta(rng, **extra), "rows": BUILDERS[kind](rng)}
        path = out / f"fake_{kind}.json"
        path.write_text(json.dumps(obj, indent=1))
        paths.append(path)
    return paths
