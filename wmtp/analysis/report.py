"""``wmtp report RESULTS_DIR``: a markdown report with tables and PNG plots from benchmark JSON.

Input schema (full description in ``wmtp/analysis/SCHEMA.md``). Each ``*.json`` under RESULTS_DIR is
``{"kind": K, "schema": 1, "meta": {hardware, model, dtype, synthetic, runs, command, date, ...},
"rows": [...]}``; times are seconds (``*_s``), list-valued fields hold one value per independent run
and the report computes mean and 95% Student-t CIs itself. Kinds and their row fields:

- ``step``: mode, S, d, B, t_iter_s[], t_iter_p10_s[]?, t_iter_p90_s[]?, t_iter_sync_s[]?, floor_s?, floor_bytes?, al[]?
- ``context_sweep``: mode, S, d, t_iter_s[]                                   (paper Fig. 3)
- ``depth_sweep``: mode, d, S, t_iter_s[]; meta.fit_d = [lo, hi]?             (paper Table 6)
- ``phases``: mode, d, S, t_verify_base_s[], t_verify_ovh_s[], t_draft_ctx_s[],
  t_draft_fwd_s[] (sum over the iteration's draft steps), draft_steps, t_iter_s[]   (paper Table 7)
- ``verify_by_k``: mode, d, k, t_verify_ovh_s[], iterations[]?          (reviewers' AL-matched test)
- ``window_sweep``: W (int | "native"), sink, d, S, t_iter_s[], al[]?          (paper Table 10)
- ``batch_sweep``: mode, B, d, per_user_tok_s[], system_tok_s[], admitted          (paper Fig. 4)
- ``memory``: mode, S, d, max_total_tokens, target_kv_bytes, draft_pool_bytes, draft_ring_bytes,
  state_bytes, max_admitted
- ``acceptance``: task, mode, sink, W (null = native), d, hists[][] (H[n] per run), al[]?
- ``probe``: task, S, sink, W, steps, flipped, agreement, margin_all, margin_flipped, z_far,
  readout_change                                                          (paper Tables 11–12)
- ``output_diff``: mode_a, mode_b, prompt, n_diff, first_diff, len_a, len_b
- ``peer``: engine, mode, d, S, B, t_iter_s[], al[] (+ ttft_s[], tpot_s[] at B = 1; system_tok_s[] above)
- ``adaptive_depth``: config ("dN" | "auto"), trace, tpot_s, al, gamma_histogram
- ``multiturn``: mode, prefix_cache, users, turns, doc_tokens, ttft_s[user][turn], mean_ttft_s_per_turn[]
- ``kv_logits``: model, scales, tokens, max_abs, mean_abs, logit_span, argmax_changed

Only sections whose kinds are present are rendered; the report lists the missing ones. PNGs are
written next to the markdown file.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from wmtp.analysis.stats import (
    MeanCI, acceptance_length_from_alphas, alpha_intervals, diff_ci, mean_ci, ols_fit, ratio_ci, steepest_step,
)
from wmtp.bench.gpu_state import describe_gpu_state
from wmtp.engine.metrics import acceptance_length
from wmtp.errors import WmtpError

SCHEMA_VERSION = 1
META_FIELDS = ("hardware", "model", "dtype", "synthetic", "runs", "command", "date")
ROW_FIELDS: dict[str, tuple[str, ...]] = {
    "step": ("mode", "S", "d", "B", "t_iter_s"),
    "context_sweep": ("mode", "S", "d", "t_iter_s"),
    "depth_sweep": ("mode", "d", "S", "t_iter_s"),
    "phases": ("mode", "d", "S", "t_verify_base_s", "t_verify_ovh_s", "t_draft_ctx_s", "t_draft_fwd_s",
               "draft_steps", "t_iter_s"),
    "verify_by_k": ("mode", "d", "k", "t_verify_ovh_s"),
    "window_sweep": ("W", "sink", "d", "S", "t_iter_s"),
    "batch_sweep": ("mode", "B", "d", "per_user_tok_s", "system_tok_s", "admitted"),
    "memory": ("mode", "S", "d", "max_total_tokens", "target_kv_bytes", "draft_pool_bytes", "draft_ring_bytes",
               "state_bytes", "max_admitted"),
    "acceptance": ("task", "mode", "sink", "W", "d", "hists"),
    "probe": ("task", "S", "sink", "W", "steps", "flipped", "agreement", "margin_all", "margin_flipped", "z_far",
              "readout_change"),
    "output_diff": ("mode_a", "mode_b", "prompt", "n_diff", "first_diff", "len_a", "len_b"),
    "ttft": ("mode", "tokens", "ttft_s"),
    "peer": ("engine", "mode", "d", "S", "B", "t_iter_s", "al"),
    "adaptive_depth": ("config", "trace", "tpot_s", "al", "gamma_histogram"),
    "multiturn": ("mode", "prefix_cache", "users", "turns", "doc_tokens", "ttft_s", "mean_ttft_s_per_turn"),
    "kv_logits": ("model", "scales", "tokens", "max_abs", "mean_abs", "logit_span", "argmax_changed"),
}
KIND_PURPOSE = {
    "step": "per-step cost vs the bytes floor",
    "context_sweep": "context wedge (paper Fig. 3)",
    "depth_sweep": "latency-model fit T_iter = γ·t_draft_fwd + c (paper Table 6)",
    "phases": "phase decomposition (paper Table 7)",
    "verify_by_k": "AL-matched t_verify_ovh comparison (reviewers' test)",
    "window_sweep": "window-size dose-response (paper Table 10)",
    "batch_sweep": "throughput-latency Pareto (paper Fig. 4)",
    "memory": "KV memory and admission (DESIGN §4)",
    "acceptance": "α_j profiles with Wilson intervals (paper Fig. 2 / Table 9)",
    "probe": "decision-invariance and attention-mass probe (paper Tables 11-12)",
    "output_diff": "greedy output diff dense / native / windowed (reviewers)",
    "ttft": "time to first token of a real chunked prefill",
    "peer": "wmtp against vLLM on the same GPU and prompts",
    "adaptive_depth": "TPOT of the adaptive draft depth against every fixed depth",
    "multiturn": "TTFT per turn of conversations over one document through the server, prefix cache off / on",
    "kv_logits": "what an fp8 KV cache does to the logits, against the model-dtype cache",
}
COLOURS = {"dense": "#7f7f7f", "native": "#d62728", "windowed": "#1f77b4"}


@dataclass
class ResultFile:
    path: Path
    kind: str
    meta: dict
    rows: list[dict]
    name: str = ""  # path relative to the results directory (files of one kind may sit in subfolders)

    @property
    def label(self) -> str:
        return f"{self.model} · {self.meta['hardware']} · `{self.name or self.path.name}`"

    @property
    def model(self) -> str:
        """The model the numbers are of: ``meta.model``, and its first N layers where ``meta.layers`` says so."""
        layers = self.meta.get("layers")
        return f"{self.meta['model']} (first {layers} layers)" if layers else self.meta["model"]

    @property
    def slug(self) -> str:
        """Unique per file in a report: names its plots."""
        return (self.name or self.path.name).removesuffix(".json").replace("/", "_")


class Report:
    """Markdown lines plus the PNGs written so far."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.lines, self.pngs = out_dir, [], []
        self.warnings: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, headers: list[str], rows: Iterable[list]) -> None:
        self.add("| " + " | ".join(headers) + " |", "|" + "---|" * len(headers))
        self.add(*("| " + " | ".join(str(c) for c in r) + " |" for r in rows))
        self.add("")

    def figure(self, fig, name: str, caption: str) -> None:
        import matplotlib.pyplot as plt

        path = self.out_dir / name
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        self.pngs.append(path)
        self.add(f"![{caption}]({name})", "", f"*{caption}*", "")


# ---- loading ------------------------------------------------------------------------------------


def load_results(results_dir: str | Path, include_archive: bool = False) -> tuple[list[ResultFile], list[str]]:
    """Every results file under ``results_dir`` (sorted), plus the names of ignored JSON files.
    Folders named ``archive`` (superseded results) are skipped unless ``include_archive``."""
    root = Path(results_dir)
    if not root.is_dir():
        raise WmtpError(f"report: {root} is not a directory")
    files, ignored = [], []
    for path in sorted(root.rglob("*.json")):
        if not include_archive and "archive" in path.relative_to(root).parts[:-1]:
            continue
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise WmtpError(f"report: {path}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or obj.get("kind") not in ROW_FIELDS:
            # other result files (load time, kernels, TTFT, GPU identity) live beside these
            ignored.append(str(path.relative_to(root)))
            continue
        f = validate(obj, path)
        f.name = str(path.relative_to(root))
        files.append(f)
    return files, ignored


def validate(obj: dict, path: Path) -> ResultFile:
    """Check one results object against the schema; errors name the file, row and field."""
    kind = obj["kind"]
    if kind not in ROW_FIELDS:
        raise WmtpError(f"report: {path}: unknown kind {kind!r}; known: {sorted(ROW_FIELDS)}")
    meta, rows = obj.get("meta"), obj.get("rows")
    if not isinstance(meta, dict) or not isinstance(rows, list):
        raise WmtpError(f"report: {path}: needs a 'meta' object and a 'rows' list")
    missing = [f for f in META_FIELDS if f not in meta]
    if missing:
        raise WmtpError(f"report: {path}: meta lacks {missing}")
    for i, row in enumerate(rows):
        lack = [f for f in ROW_FIELDS[kind] if f not in row]
        if lack:
            raise WmtpError(f"report: {path}: rows[{i}] ({kind}) lacks {lack}")
        if kind == "acceptance" and any(len(h) != row["d"] for h in row["hists"]):
            raise WmtpError(f"report: {path}: rows[{i}].hists: every histogram needs d = {row['d']} entries (H[0..γ])")
    return ResultFile(path, kind, meta, rows)


def write_results(path: str | Path, kind: str, rows: list[dict], meta: dict) -> Path:
    """Write one schema-valid results file (``meta.date`` defaults to now, UTC); raises WmtpError
    naming the missing field before anything is written. For benchmark scripts."""
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta}
    obj = {"kind": kind, "schema": SCHEMA_VERSION, "meta": meta, "rows": rows}
    path = Path(path)
    validate(json.loads(json.dumps(obj)), path)  # what the report will read back
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))
    return path


# ---- formatting helpers -------------------------------------------------------------------------


def _nan(x: float) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_ci(c: MeanCI, scale: float = 1.0, digits: int = 2) -> str:
    """'mean ± half' (half = 95% CI half-width); just 'mean' for one run; '–' for none."""
    if c.n == 0 or _nan(c.mean):
        return "–"
    if _nan(c.half):
        return f"{c.mean * scale:.{digits}f}"
    return f"{c.mean * scale:.{digits}f} ± {c.half * scale:.{digits}f}"


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if _nan(x) else f"{x:.{digits}f}"


def colour(mode: str) -> str:
    return next((c for m, c in COLOURS.items() if str(mode).startswith(m)), "#2ca02c")


def _runs_check(rep: Report, f: ResultFile, fields: Iterable[str]) -> None:
    """Warn when a per-run list does not hold meta.runs values."""
    runs = f.meta["runs"]
    for i, row in enumerate(f.rows):
        for k in fields:
            v = row.get(k)
            if isinstance(v, list) and len(v) != runs:
                rep.warnings.append(f"`{f.path.name}` rows[{i}].{k}: {len(v)} values, meta.runs = {runs}")


def _commit(f: ResultFile) -> str:
    """The commit the file's numbers come from (``meta.commit``; files written before it was recorded have none)."""
    return f"`{f.meta['commit']}`" if f.meta.get("commit") else "unrecorded"


def _provenance(f: ResultFile) -> str:
    m = f.meta
    real = "**synthetic context**" if m["synthetic"] else "real prefill"
    return f"{f.model} ({m['dtype']}) on {m['hardware']} · {real} · {m['runs']} runs · {m['date']} · commit {_commit(f)}"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _modes(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["mode"] for r in rows))


def _errorbar(ax, xs, cis: list[MeanCI], scale: float, **kw) -> None:
    ys = [c.mean * scale for c in cis]
    err = [0.0 if _nan(c.half) else c.half * scale for c in cis]
    ax.errorbar(xs, ys, yerr=err, capsize=3, marker="o", ms=4, **kw)


def _pair(rows: list[dict], key: tuple) -> dict[str, dict]:
    """mode -> row, for rows matching ``key`` (a tuple of (field, value))."""
    return {r["mode"]: r for r in rows if all(r.get(k) == v for k, v in key)}


def _native_windowed(by_mode: dict[str, dict]) -> tuple[dict | None, dict | None]:
    nat = by_mode.get("native")
    win = next((r for m, r in by_mode.items() if str(m).startswith("windowed")), None)
    return nat, win


# ---- sections ---------------------------------------------------------------------------------


def section_step(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("t_iter_s", "t_iter_p10_s", "t_iter_p90_s", "al"))
    rows = []
    for r in f.rows:
        t = mean_ci(r["t_iter_s"])
        floor = r.get("floor_s")
        al = mean_ci(r["al"]) if r.get("al") else None
        tpot = ratio_ci(r["t_iter_s"], r["al"]) if al else None
        sync = mean_ci(r["t_iter_sync_s"]) if r.get("t_iter_sync_s") else None
        rows.append([r["mode"], r["S"], r["d"], r["B"], fmt_ci(t, 1e3),
                     fmt_ci(mean_ci(r.get("t_iter_p10_s") or []), 1e3), fmt_ci(mean_ci(r.get("t_iter_p90_s") or []), 1e3),
                     fmt(floor * 1e3 if floor else None), fmt(t.mean / floor if floor else None),
                     fmt_ci(sync, 1e3) if sync else "–", fmt(sync.mean / floor if sync and floor else None),
                     fmt_ci(al) if al else "–", fmt_ci(tpot, 1e3) if tpot else "–"])
    rep.table(["mode", "S", "d", "B", "T_iter ms", "p10 ms", "p90 ms", "floor ms", "T_iter/floor",
               "synchronised ms", "sync/floor", "AL", "TPOT ms"], rows)
    basis = _floor_basis(f.meta.get("bandwidth"))
    if basis:
        rep.add(basis)
        rep.add("")
    states = [(r["mode"], describe_gpu_state(r.get("gpu_state_after"))) for r in f.rows]
    for mode, state in states:
        if state:
            rep.add(f"- GPU after {mode}'s timed iterations: {state}")
    if any(state for _, state in states):
        rep.add("")
    if any(r.get("t_iter_sync_s") for r in f.rows):
        rep.add("T_iter: one iteration in flight (the engine's default), the interval between consecutive "
                "iterations' results; synchronised: every step GPU-synchronised before and after.")
        rep.add("")
    _ratio_lines(rep, f.rows, ("S", "d", "B"))


def section_ttft(rep: Report, f: ResultFile) -> None:
    """One prefill per mode (a single run: the ``ttft_s`` value is a number, not a list), and with
    ``--repeat-suffix`` the second prompt's, served from the prefix cache."""
    repeat = any("repeat_ttft_s" in r for r in f.rows)
    rep.table(["mode", "prompt tokens", "chunk", "TTFT s"] + (["other suffix", "its TTFT s", "tokens cached"] if repeat else []),
              [[r["mode"], r["tokens"], r.get("chunk", "–"), fmt(r["ttft_s"])]
               + ([r.get("repeat_suffix", "–"), fmt(r.get("repeat_ttft_s")), r.get("repeat_cached_tokens", "–")]
                  if repeat else []) for r in f.rows])
    kinds = ("attention", "recurrent", "moe", "mlp", "rest")
    split = [r for r in f.rows if "split_s" in r]
    if split:
        rep.add("", "Time of the first prefill inside each kind of layer (target and draft head, CUDA events around "
                "each layer; attention includes its projections), s:", "")
        rep.table(["mode", *kinds], [[r["mode"], *(fmt(r["split_s"].get(k)) for k in kinds)] for r in split])
    by = {r["mode"]: r["ttft_s"] for r in f.rows}
    if "native" in by and "windowed" in by:
        rep.add(f"- native / windowed TTFT = {by['native'] / by['windowed']:.3f} (the windowed draft prefill writes "
                "K/V only for the slots a later query can read, DESIGN §4)", "")


def section_multiturn(rep: Report, f: ResultFile) -> None:
    """Mean TTFT over the users per turn, with the prefix cache off and on (one run each)."""
    turns = max(r["turns"] for r in f.rows)
    rep.table(["mode", "prefix cache", "users", "document tokens", "cached tokens"]
              + [f"turn {t + 1} s" for t in range(turns)],
              [[r["mode"], "on" if r["prefix_cache"] else "off", r["users"], r["doc_tokens"], r.get("cached_tokens", "–")]
               + [fmt(x, 3) for x in r["mean_ttft_s_per_turn"]] for r in f.rows])
    by = {r["prefix_cache"]: r["mean_ttft_s_per_turn"][1:] for r in f.rows if r["turns"] > 1}
    if True in by and False in by:
        off, on = (sum(by[c]) / len(by[c]) for c in (False, True))
        rep.add(f"- turns after the first: mean TTFT {off:.3f} s without the cache, {on:.3f} s with it "
                f"({off / on:.1f}x)", "")
    div = next((r["divergence"] for r in f.rows if r.get("divergence") is not None), None)
    if div is not None:
        where = [f"user {u}: turn {d[0] + 1}, token {d[1] + 1}" for u, d in enumerate(div) if d is not None]
        rep.add("- answers with the cache: " + ("identical to those without it" if not where else
                "first differing token " + "; ".join(where) + f" ({f.meta['dtype']})"), "")


def section_kv_logits(rep: Report, f: ResultFile) -> None:
    """One sequence per (model, scales): |Δlogits| of fp8 against model-dtype K / V, and the argmax."""
    rep.table(["model", "KV scales", "tokens", "text", "max |Δlogit|", "mean |Δlogit|", "logit span", "argmax changed"],
              [[r["model"], r["scales"], r["tokens"], r.get("text", "–"), fmt(r["max_abs"], 4), fmt(r["mean_abs"], 4),
                fmt(r["logit_span"], 3), f"{r['argmax_changed']} / {r['tokens']}"] for r in f.rows])


def _floor_basis(bw: dict | None) -> str | None:
    """Which bandwidth the file's floors divide by: the HBM read bandwidth (DESIGN §6), or, in files
    written before it was measured, a device-to-device copy's read + written bytes per second."""
    if not bw:
        return None
    if "read_bytes_per_s" in bw:
        return (f"Floor: bytes over the HBM read bandwidth measured in the run, {bw['read_bytes_per_s'] / 1e12:.2f} TB/s "
                f"(a copy: {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s read + write).")
    return (f"Floor: bytes over a copy's read + write bandwidth, {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s (this file "
            "predates the read-bandwidth measurement DESIGN §6 asks for; the read bandwidth is higher, so its ratios are lower).")


def _ratio_lines(rep: Report, rows: list[dict], keys: tuple[str, ...]) -> None:
    """step_native / step_windowed (acceptance cancels) per group of rows sharing ``keys``."""
    groups = dict.fromkeys(tuple((k, r[k]) for k in keys) for r in rows)
    for g in groups:
        nat, win = _native_windowed(_pair(rows, g))
        if nat and win:
            rc = ratio_ci(nat["t_iter_s"], win["t_iter_s"])
            where = ", ".join(f"{k}={v}" for k, v in g)
            rep.add(f"- {where}: step_native / step_windowed = {fmt_ci(rc, 1, 3)} (95% CI, delta method)")
    rep.add("")


def section_context_sweep(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("t_iter_s",))
    modes, contexts = _modes(f.rows), sorted({r["S"] for r in f.rows})
    table = []
    for s in contexts:
        by = _pair(f.rows, (("S", s),))
        nat, win = _native_windowed(by)
        wedge = ratio_ci(nat["t_iter_s"], win["t_iter_s"]) if nat and win else None
        table.append([s] + [fmt_ci(mean_ci(by[m]["t_iter_s"]), 1e3) if m in by else "–" for m in modes]
                     + [fmt_ci(_shift(wedge, -1.0), 100, 1) if wedge else "–"])
    rep.table(["S"] + [f"T_iter {m} ms" for m in modes] + ["native/windowed − 1 (%)"], table)
    _plot_context(rep, f, modes)


def _shift(c: MeanCI, by: float) -> MeanCI:
    return MeanCI(c.mean + by, c.lo + by, c.hi + by, c.half, c.sd, c.n)


def _plot_context(rep: Report, f: ResultFile, modes: list[str]) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in modes:
        rs = sorted((r for r in f.rows if r["mode"] == m), key=lambda r: r["S"])
        _errorbar(a1, [r["S"] for r in rs], [mean_ci(r["t_iter_s"]) for r in rs], 1e3, label=m, color=colour(m))
    xs, wedge = [], []
    for s in sorted({r["S"] for r in f.rows}):
        nat, win = _native_windowed(_pair(f.rows, (("S", s),)))
        if nat and win:
            xs.append(s)
            wedge.append(_shift(ratio_ci(nat["t_iter_s"], win["t_iter_s"]), -1.0))
    if xs:
        _errorbar(a2, xs, wedge, 100, color=colour("windowed"), label="step_native / step_windowed − 1")
    _log2_panels(((a1, "T_iter (ms)"), (a2, "cost-side saving (%)")), [r["S"] for r in f.rows], "context S (tokens)")
    a1.set_title("per-iteration time vs context")
    a2.set_title("the windowing wedge (paper Fig. 3)")
    a2.axhline(0, color="k", lw=0.6)
    fig.suptitle(f"{f.model} · d={f.rows[0]['d']} · {_short_meta(f)}", fontsize=9)
    rep.figure(fig, f"context_wedge_{f.slug}.png", "Context wedge: T_iter and step_native/step_windowed − 1 vs S (mean ± 95% CI)")


def _tokens(n: int) -> str:
    """131072 -> '128K', 1040000 -> '1.04M', 96 -> '96' (tick labels)."""
    if n >= 10**6:
        return f"{n / 1e6:.3g}M"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _log2_panels(panels: Iterable[tuple[object, str]], xs: list[int], xlabel: str) -> None:
    """Style (axes, y label) panels sharing a log2 x axis ticked at the data (a few points rarely
    straddle two powers of two), with grid and legend."""
    ticks = sorted(set(xs))
    for ax, yl in panels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [_tokens(x) for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _short_meta(f: ResultFile) -> str:
    return f"{f.meta['hardware']} · {'synthetic' if f.meta['synthetic'] else 'real'} · {f.meta['runs']} runs"


def _fit_points(f: ResultFile, mode: str) -> tuple[list[int], list[MeanCI], list[dict]]:
    rs = sorted((r for r in f.rows if r["mode"] == mode), key=lambda r: r["d"])
    lo, hi = f.meta.get("fit_d") or (min(r["d"] for r in rs), max(r["d"] for r in rs))
    used = [r for r in rs if lo <= r["d"] <= hi]
    return [r["d"] - 1 for r in used], [mean_ci(r["t_iter_s"]) for r in used], rs


def section_depth_sweep(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("t_iter_s",))
    fits, rows = {}, []
    for m in _modes(f.rows):
        gam, cis, _ = _fit_points(f, m)
        if len(gam) < 2:
            rep.warnings.append(f"`{f.path.name}` {m}: fewer than 2 depths in the fit range")
            continue
        fit = fits[m] = ols_fit(gam, [c.mean for c in cis])
        step, at = steepest_step(gam, [c.mean for c in cis])
        rows.append([m, f"{fmt(fit.slope * 1e3, 3)} ± {fmt(fit.se_slope * 1e3, 3)}",
                     f"{fmt(fit.intercept * 1e3)} ± {fmt(fit.se_intercept * 1e3)}", fmt(fit.r2, 4),
                     f"{fmt(step / fit.slope, 3)} (d = {at + 1:g})" if fit.slope > 0 else "–", fit.n,
                     f"{min(gam) + 1}..{max(gam) + 1}"])
    nat = fits.get("native")
    win = next((v for k, v in fits.items() if str(k).startswith("windowed")), None)
    if nat and win:
        rows.append(["Δ native − windowed", f"{fmt((nat.slope - win.slope) * 1e3, 3)} ± "
                     f"{fmt(math.hypot(nat.se_slope, win.se_slope) * 1e3, 3)}",
                     f"{fmt((nat.intercept - win.intercept) * 1e3)} ± {fmt(math.hypot(nat.se_intercept, win.se_intercept) * 1e3)}",
                     "", "", "", ""])
    rep.add("OLS over the per-d mean T_iter (x = γ = d − 1); ± = standard error. Slope = t_draft_fwd, "
            "intercept c = t_verify + t_draft_ctx. Steepest step: the largest rise from one depth to the next "
            "over the slope (1 on a straight line; a cliff shows above it).", "")
    rep.table(["mode", "slope ms/forward", "intercept c ms", "R²", "steepest step / slope", "points", "d range"], rows)
    _depth_table(rep, f)
    _plot_depth(rep, f, fits)


def _pm(value: float, se: float) -> str:
    """'v ± se' in ms (3 significant digits; no ± when the SE is undefined)."""
    return f"{value * 1e3:.3g}" + ("" if _nan(se) else f" ± {se * 1e3:.2g}")


def _depth_table(rep: Report, f: ResultFile) -> None:
    modes, depths = _modes(f.rows), sorted({r["d"] for r in f.rows})
    table = []
    for d in depths:
        by = _pair(f.rows, (("d", d),))
        table.append([d] + [fmt_ci(mean_ci(by[m]["t_iter_s"]), 1e3) if m in by else "–" for m in modes])
    rep.table(["d"] + [f"T_iter {m} ms" for m in modes], table)


def _plot_depth(rep: Report, f: ResultFile, fits: dict) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in _modes(f.rows):
        used, _, rs = _fit_points(f, m)
        for r in rs:
            ax.scatter([r["d"] - 1] * len(r["t_iter_s"]), [t * 1e3 for t in r["t_iter_s"]], s=8, alpha=0.3,
                       color=colour(m))
        inside = [r for r in rs if r["d"] - 1 in used]
        outside = [r for r in rs if r["d"] - 1 not in used]
        _errorbar(ax, [r["d"] - 1 for r in inside], [mean_ci(r["t_iter_s"]) for r in inside], 1e3, color=colour(m), ls="none")
        if outside:
            _errorbar(ax, [r["d"] - 1 for r in outside], [mean_ci(r["t_iter_s"]) for r in outside], 1e3,
                      color=colour(m), ls="none", mfc="white", label=f"{m}: outside the fit range")
        if m in fits:
            fit = fits[m]
            xs = [min(used), max(used)]
            ax.plot(xs, [fit(x) * 1e3 for x in xs], color=colour(m),
                    label=f"{m}: ({_pm(fit.slope, fit.se_slope)}) ms·γ + ({_pm(fit.intercept, fit.se_intercept)}) ms, "
                          f"R²={fit.r2:.3f}")
    ax.set_xlabel("γ = d − 1 (draft forwards per iteration)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("T_iter (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Latency model T_iter = γ·t_draft_fwd + c · {f.model} · S={f.rows[0]['S']}", fontsize=9)
    rep.figure(fig, f"latency_fit_{f.slug}.png", "Latency-model fit per mode: per-run points, mean ± 95% CI, OLS line")


PHASES = ("t_verify_base_s", "t_verify_ovh_s", "t_draft_ctx_s", "t_draft_fwd_s")
PHASE_LABELS = ("verify (target)", "verify overhead", "draft ctx + extend", "draft steps")


def section_phases(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, PHASES + ("t_iter_s",))
    rows = []
    for r in f.rows:
        means = [mean_ci(r[p]).mean for p in PHASES]
        t = mean_ci(r["t_iter_s"])
        total = sum(means)
        dev = total / t.mean - 1
        over = (means[1] + means[2] + means[3]) / means[0]
        per_step = means[3] / r["draft_steps"] if r["draft_steps"] else float("nan")
        rows.append([r["mode"], r["d"], r["S"]] + [fmt_ci(mean_ci(r[p]), 1e3) for p in PHASES]
                    + [fmt(per_step * 1e3, 3), fmt(total * 1e3), fmt_ci(t, 1e3),
                       f"{dev * 100:+.1f}%" + (" ⚠" if abs(dev) > 0.05 else ""), f"+{over * 100:.0f}%"])
    rep.add("All times per iteration (ms, mean ± 95% CI over runs). Sum check: phases vs T_iter (DESIGN §6 asks "
            "within 5%; ⚠ marks a miss). Speculation overhead = (t_verify_ovh + t_draft) / t_verify_base.", "")
    rep.table(["mode", "d", "S", "t_verify_base", "t_verify_ovh", "t_draft_ctx", "t_draft_fwd (all steps)",
               "per step", "sum", "T_iter", "sum − T_iter", "spec. overhead"], rows)
    _plot_phases(rep, f)


def _plot_phases(rep: Report, f: ResultFile) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 * len(f.rows) + 2.5), 4.2))
    names = [f"{r['mode']}\nd={r['d']}" for r in f.rows]
    bottom = [0.0] * len(f.rows)
    shades = ("#4c4c4c", "#9e9e9e", "#f2a541", "#5aa9e6")
    for p, lab, c in zip(PHASES, PHASE_LABELS, shades):
        vals = [mean_ci(r[p]).mean * 1e3 for r in f.rows]
        ax.bar(names, vals, bottom=bottom, label=lab, color=c, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    t = [mean_ci(r["t_iter_s"]).mean * 1e3 for r in f.rows]
    xs = range(len(f.rows))
    ax.hlines(t, [x - 0.36 for x in xs], [x + 0.36 for x in xs], color="k", lw=2, zorder=3, label="measured T_iter")
    for x, v in zip(xs, t):
        ax.annotate(f"{v:.1f} ms", (x, v), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_ylabel("ms per iteration")
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"Phase decomposition · {f.model} · S={f.rows[0]['S']}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    rep.figure(fig, f"phases_{f.slug}.png", "Per-iteration phases (stacked means) with the measured T_iter (black bar)")


def section_verify_by_k(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("t_verify_ovh_s", "iterations"))
    modes, ks = _modes(f.rows), sorted({r["k"] for r in f.rows})
    table = []
    for k in ks:
        by = _pair(f.rows, (("k", k),))
        nat, win = _native_windowed(by)
        d = diff_ci(nat["t_verify_ovh_s"], win["t_verify_ovh_s"]) if nat and win else None
        its = [sum(by[m].get("iterations") or []) or "–" for m in modes]
        table.append([k] + [fmt_ci(mean_ci(by[m]["t_verify_ovh_s"]), 1e3, 3) if m in by else "–" for m in modes]
                     + its + [fmt_ci(d, 1e3, 3) if d else "–"])
    rep.add("t_verify_ovh binned by accepted drafts k (ms, mean ± 95% CI over runs). A flat difference at "
            "matched k means the bookkeeping does not depend on the window (reviewers' test).", "")
    rep.table(["k"] + [f"{m} ms" for m in modes] + [f"{m} iterations" for m in modes]
              + ["native − windowed ms"], table)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for i, m in enumerate(modes):
        rs = sorted((r for r in f.rows if r["mode"] == m), key=lambda r: r["k"])
        _errorbar(ax, [r["k"] + 0.06 * (i - 0.5) for r in rs], [mean_ci(r["t_verify_ovh_s"]) for r in rs], 1e3,
                  label=m, color=colour(m))
    ax.set_xlabel("accepted drafts k in the iteration")
    ax.set_xticks(ks)
    ax.set_ylabel("t_verify_ovh (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"AL-matched verify overhead · {f.model} · d={f.rows[0]['d']}", fontsize=9)
    rep.figure(fig, f"verify_by_k_{f.slug}.png", "t_verify_ovh per accepted count k (mean ± 95% CI)")


def section_window_sweep(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("t_iter_s", "al"))
    native = next((r for r in f.rows if r["W"] == "native"), None)
    rows = []
    for r in sorted(f.rows, key=lambda r: (r["W"] != "native", r["W"] if r["W"] != "native" else 0)):
        t = mean_ci(r["t_iter_s"])
        tpot = ratio_ci(r["t_iter_s"], r["al"]) if r.get("al") else None
        speed = (ratio_ci(native["t_iter_s"], native["al"]).mean / tpot.mean
                 if tpot and native and native.get("al") else None)
        cost = ratio_ci(native["t_iter_s"], r["t_iter_s"]) if native and r is not native else None
        rows.append([r["W"], r["sink"], r["d"], r["S"], fmt_ci(t, 1e3),
                     fmt_ci(cost, 1, 3) if cost else ("reference" if r is native else "–"),
                     fmt_ci(mean_ci(r["al"])) if r.get("al") else "–", fmt_ci(tpot, 1e3) if tpot else "–",
                     f"{speed:.3f}×" if speed else "–"])
    rep.add("Cost side: T_native / T_W with a 95% CI (delta method; acceptance cancels). TPOT = T_iter / AL per run; "
            "speedup = TPOT_native / TPOT_W (ratio of means; needs measured AL).", "")
    rep.table(["W", "sink", "d", "S", "T_iter ms", "T_native / T_W", "AL", "TPOT ms", "speedup vs native"], rows)
    _plot_window(rep, f, native)


def _plot_window(rep: Report, f: ResultFile, native: dict | None) -> None:
    plt = _plt()
    rs = sorted((r for r in f.rows if r["W"] != "native"), key=lambda r: r["W"])
    if not rs:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["W"] + r["sink"] for r in rs]
    _errorbar(a1, xs, [mean_ci(r["t_iter_s"]) for r in rs], 1e3, color=colour("windowed"), label="windowed")
    if native:
        c = mean_ci(native["t_iter_s"])
        a1.axhline(c.mean * 1e3, color=colour("native"), label="native (every key)")
        if not _nan(c.half):
            a1.axhspan(c.lo * 1e3, c.hi * 1e3, color=colour("native"), alpha=0.15)
        _errorbar(a2, xs, [ratio_ci(native["t_iter_s"], r["t_iter_s"]) for r in rs], 1, color=colour("windowed"),
                  label="T_native / T_W (cost side)")
        a2.axhline(1, color="k", lw=0.6)
    _log2_panels(((a1, "T_iter (ms)"), (a2, "T_native / T_W")), xs, "draft keys read: W + sink")
    a1.set_title("per-iteration time vs draft window")
    a2.set_title("cost-side speedup over native (> 1: windowing is cheaper)")
    fig.suptitle(f"{f.model} · d={rs[0]['d']} · S={rs[0]['S']} · {_short_meta(f)}", fontsize=9)
    rep.figure(fig, f"window_{f.slug}.png", "Window dose-response (cost side): T_iter vs W + sink, native as a band; "
               "T_native / T_W (mean ± 95% CI)")


def section_batch_sweep(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("per_user_tok_s", "system_tok_s"))
    rows = [[r["mode"], r["d"], r["B"], r["admitted"], fmt_ci(mean_ci(r["per_user_tok_s"]), 1, 1),
             fmt_ci(mean_ci(r["system_tok_s"]), 1, 1)] for r in sorted(f.rows, key=lambda r: (r["mode"], r["d"], r["B"]))]
    rep.table(["mode", "d", "B", "admitted", "per-user tok/s", "system tok/s"], rows)
    most = _max_admitted(f.rows)
    contexts = sorted({r["S"] for r in f.rows if "S" in r})
    at = f" at S = {', '.join(map(str, contexts))} tokens per request" if contexts else ""
    rep.add(f"Most requests seated at once{at} (the memory ceiling of each curve): "
            + ", ".join(f"{m} d={d}: {n}" for (m, d), n in most.items()), "")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    markers = "osD^vP*X"
    curves = list(dict.fromkeys((r["mode"], r["d"]) for r in f.rows))
    depths = sorted({d for _, d in curves})
    for m, d in curves:
        rs = sorted((r for r in f.rows if r["mode"] == m and r["d"] == d), key=lambda r: r["B"])
        xs = [mean_ci(r["per_user_tok_s"]).mean for r in rs]
        ys = [mean_ci(r["system_tok_s"]).mean for r in rs]
        name = m if m == "dense" else f"{m} d={d}"
        ax.plot(xs, ys, marker=markers[depths.index(d) % len(markers)], color=colour(m), ms=5,
                label=f"{name} (max admitted {most[m, d]})", alpha=0.9)
        for r, x, y in zip(rs, xs, ys):
            ax.annotate(f"B={r['B']}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7, color=colour(m))
        top = max(zip(rs, xs, ys), key=lambda p: p[0]["admitted"])
        if top[0]["admitted"] == most[m, d]:  # ring the point at the memory ceiling
            ax.scatter([top[1]], [top[2]], s=140, facecolors="none", edgecolors=colour(m), linewidths=1.5, zorder=3)
    ax.set_xlabel("per-user decode speed (tok/s/user)")
    ax.set_ylabel("system throughput (tok/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Throughput-latency Pareto (up and right is better) · {f.model}"
                 + (f" · S={', '.join(map(str, contexts))}" if contexts else ""), fontsize=9)
    rep.figure(fig, f"pareto_{f.slug}.png", "Pareto: per-user vs system throughput per mode and depth, labelled by batch size B (means over runs); "
               "ringed: the largest batch the pools seat")


def _max_admitted(rows: list[dict]) -> dict[tuple[str, int], int]:
    """(mode, d) -> most requests seated at once: the rows' ``max_admitted`` (batch sweeps record
    it) or else the largest ``admitted``."""
    out: dict[tuple[str, int], int] = {}
    for r in rows:
        key = (r["mode"], r["d"])
        out[key] = max(out.get(key, 0), r.get("max_admitted", r["admitted"]))
    return out


def section_memory(rep: Report, f: ResultFile) -> None:
    mib = 2.0**20
    rows = []
    for r in f.rows:
        draft = r["draft_ring_bytes"] if str(r["mode"]).startswith("windowed") and r["draft_ring_bytes"] else r["draft_pool_bytes"]
        kv = r["target_kv_bytes"] + draft
        full = r.get("full_attention_layers")
        per_req = sum(r["per_request_bytes"].values()) / mib if r.get("per_request_bytes") else None
        rows.append([r["mode"], r["S"], r["d"], r["max_total_tokens"], fmt(r["target_kv_bytes"] / mib, 1),
                     fmt(r["draft_pool_bytes"] / mib, 1), fmt(r["draft_ring_bytes"] / mib, 2), fmt(r["state_bytes"] / mib, 1),
                     f"{100 * draft / kv:.2f}%" if kv else "–", f"{100 / (full + 1):.2f}%" if full else "–",
                     fmt(per_req, 2), r["max_admitted"]])
    rep.add("MiB. Draft share = draft KV in use (ring for windowed, else the pool) / (target KV + draft KV); a "
            "full-length draft pool holds 1/(F+1) of the KV (F = target full-attention layers, DESIGN §4). Per request "
            "= what one request reserves in all pools.", "")
    rep.table(["mode", "S", "d", "max_total_tokens", "target KV", "draft pool", "draft ring", "states",
               "draft share", "1/(F+1)", "per request", "max admitted"], rows)


def section_acceptance(rep: Report, f: ResultFile) -> None:
    _runs_check(rep, f, ("hists", "al"))
    gamma = max(len(r["hists"][0]) - 1 for r in f.rows)
    rows = []
    for r in f.rows:
        pooled = [sum(col) for col in zip(*r["hists"])]
        alphas = alpha_intervals(pooled)
        al_rebuilt = acceptance_length_from_alphas([a.alpha for a in alphas])
        per_run = r.get("al") or [acceptance_length(h) for h in r["hists"]]
        cells = [f"{a.alpha:.3f} [{a.lo:.2f}, {a.hi:.2f}]" if a.n else "–" for a in alphas]
        rows.append([r["task"], r["mode"], r["sink"] if r["W"] is not None else "–",
                     r["W"] if r["W"] is not None else "full", r["d"], sum(pooled),
                     fmt(acceptance_length(pooled), 3), fmt(al_rebuilt, 3), fmt_ci(mean_ci(per_run), 1, 3)]
                    + cells + ["–"] * (gamma - len(cells)))
    rep.add("α_j pooled over runs with Wilson 95% intervals; AL (pooled) is measured from H[n], AL(α) is "
            "rebuilt as 1 + Σ_j Π_{i≤j} α_i (the two must agree); AL runs = mean ± 95% CI over runs.", "")
    rep.table(["task", "mode", "sink", "W", "d", "iterations", "AL (pooled)", "AL(α)", "AL runs"]
              + [f"α_{j}" for j in range(1, gamma + 1)], rows)
    _plot_alphas(rep, f)


def _plot_alphas(rep: Report, f: ResultFile) -> None:
    plt = _plt()
    tasks = list(dict.fromkeys(r["task"] for r in f.rows))
    cols = min(3, len(tasks))  # wrap panels so a large grid stays legible
    nrows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.8 * cols, 3.8 * nrows), squeeze=False)
    fig.subplots_adjust(hspace=0.4)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        rs = [r for r in f.rows if r["task"] == task]
        for i, r in enumerate(rs):
            alphas = [a for a in alpha_intervals([sum(c) for c in zip(*r["hists"])]) if a.n]
            off = 0.08 * (i - (len(rs) - 1) / 2)
            xs = [a.j + off for a in alphas]
            ys = [a.alpha for a in alphas]
            err = [[a.alpha - a.lo for a in alphas], [a.hi - a.alpha for a in alphas]]
            w = "full" if r["W"] is None else f"W={r['W']}, sink={r['sink']}"
            ax.errorbar(xs, ys, yerr=err, capsize=3, marker="o", ms=4, color=colour(r["mode"]),
                        label=f"{r['mode']} ({w}, d={r['d']})", alpha=0.9 if i < 3 else 0.6)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position j")
        ax.set_ylabel("α_j (conditional acceptance)")
        ax.set_title(task, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"α_j profiles with Wilson 95% intervals · {f.model} · {_short_meta(f)}", fontsize=9)
    rep.figure(fig, f"alpha_{f.slug}.png", "Conditional acceptance α_j per draft position, Wilson 95% intervals (pooled over runs)")


def section_probe(rep: Report, f: ResultFile) -> None:
    rows = [[r["task"], r["S"], r["sink"], r["W"], r["steps"], fmt(r["agreement"], 3), r["flipped"],
             fmt(r["margin_all"]), fmt(r["margin_flipped"]), fmt(1 - r["z_far"], 3), fmt(r["z_far"], 3),
             fmt(r["readout_change"], 3)] for r in f.rows]
    rep.add("Steps = draft positions whose window hides at least one key. agree = windowed top-1 == full top-1; "
            "margins = full draft's top1 − top2 logit on all vs flipped steps; Z_far/Z = softmax mass outside "
            "the window; read-out change = ‖o_full − o_win‖/‖o_full‖.", "")
    rep.table(["task", "S", "sink", "W", "steps", "agree", "flipped", "margin all", "margin flipped",
               "in-window mass", "Z_far/Z", "read-out change"], rows)


def section_output_diff(rep: Report, f: ResultFile) -> None:
    from wmtp.analysis.diff import DiffCell, summarize_diffs

    cells = [DiffCell(**{k: r[k] for k in ROW_FIELDS["output_diff"]}) for r in f.rows]
    rep.table(["pair", "cells", "cells differing", "tokens differing", "tokens compared"],
              [[f"{s['mode_a']} vs {s['mode_b']}", s["cells"], s["cells_differing"], s["tokens_differing"], s["tokens"]]
               for s in summarize_diffs(cells)])
    prompts = list(dict.fromkeys(c.prompt for c in cells))
    pairs = list(dict.fromkeys((c.mode_a, c.mode_b) for c in cells))
    look = {(c.mode_a, c.mode_b, c.prompt): c for c in cells}

    def cell(p: str, a: str, b: str) -> str:
        c = look.get((a, b, p))
        return "–" if c is None else (str(c.n_diff) if c.first_diff is None else f"{c.n_diff} (from {c.first_diff})")

    rep.add("Differing tokens per cell (first differing position in brackets):", "")
    rep.table(["prompt"] + [f"{a} vs {b}" for a, b in pairs], [[p] + [cell(p, a, b) for a, b in pairs] for p in prompts])


# peer pairs: (vLLM mode, wmtp mode) compared at the same S and B
PEER_PAIRS = (("dense", "dense"), ("mtp", "native"), ("mtp", "windowed"))


def _first(values: list | None) -> float | None:
    return values[0] if values else None


def section_peer(rep: Report, f: ResultFile) -> None:
    """Per S: B = 1 TTFT / T_iter / TPOT and B > 1 system tok/s per engine and mode, then each
    vLLM mode against the wmtp modes it corresponds to (AL beside every row: compare at equal AL)."""
    _runs_check(rep, f, ("t_iter_s", "al"))
    one = [r for r in f.rows if r["B"] == 1]
    rep.table(["engine", "mode", "d", "S", "TTFT s", "T_iter ms", "TPOT ms", "AL"],
              [[r["engine"], r["mode"], r["d"], r["S"], fmt(_first(r.get("ttft_s"))), fmt_ci(mean_ci(r["t_iter_s"]), 1e3),
                fmt_ci(mean_ci(r["tpot_s"]), 1e3) if r.get("tpot_s") else "–", fmt_ci(mean_ci(r["al"]), digits=3)]
               for r in one])
    many = [r for r in f.rows if r["B"] > 1]
    if many:
        rep.table(["engine", "mode", "d", "S", "B", "system tok/s", "per-user tok/s", "T_iter ms", "AL"],
                  [[r["engine"], r["mode"], r["d"], r["S"], r["B"], fmt_ci(mean_ci(r["system_tok_s"]), digits=1),
                    fmt_ci(mean_ci(r["per_user_tok_s"]), digits=1), fmt_ci(mean_ci(r["t_iter_s"]), 1e3),
                    fmt_ci(mean_ci(r["al"]), digits=3)] for r in many])
    cells = {(r["engine"], r["mode"], r["S"], r["B"]): r for r in f.rows}
    lines = []
    for (S, B) in sorted({(r["S"], r["B"]) for r in f.rows}):
        for vm, wm in PEER_PAIRS:
            v, w = cells.get(("vllm", vm, S, B)), cells.get(("wmtp", wm, S, B))
            if v is None or w is None:
                continue
            if B == 1 and v.get("tpot_s") and w.get("tpot_s"):
                lines.append(f"- S = {S}, B = 1: vLLM {vm} / wmtp {wm} TPOT = "
                             f"{mean_ci(v['tpot_s']).mean / mean_ci(w['tpot_s']).mean:.2f}")
            elif B > 1:
                lines.append(f"- S = {S}, B = {B}: wmtp {wm} / vLLM {vm} system tok/s = "
                             f"{mean_ci(w['system_tok_s']).mean / mean_ci(v['system_tok_s']).mean:.2f}")
    rep.add(*lines, "")


def section_adaptive_depth(rep: Report, f: ResultFile) -> None:
    """Per trace (workload): TPOT, AL and the depths run for every fixed d and for ``auto``; auto
    over the best fixed depth and over d = 7; a plot of TPOT against d with auto's level."""
    traces = list(dict.fromkeys(r["trace"] for r in f.rows))
    by = {(r["trace"], r["config"]): r for r in f.rows}
    configs = list(dict.fromkeys(r["config"] for r in f.rows))
    rep.table(["trace", *configs, "best fixed", "auto / best", "per round", "auto / d7"],
              [[t, *(fmt(by[t, c]["tpot_s"] * 1e3, 1) if (t, c) in by else "–" for c in configs),
                *_auto_ratios(by, t, configs)] for t in traces])
    rep.add("TPOT in ms. AL and the depths `auto` ran:", "")
    rep.table(["trace", "AL fixed d (d = 2..)", "AL auto", "auto's γ histogram"],
              [[t, " / ".join(fmt(by[t, c]["al"], 3) for c in configs if c != "auto" and (t, c) in by),
                fmt(by[t, "auto"]["al"], 3) if (t, "auto") in by else "–",
                by[t, "auto"]["gamma_histogram"] if (t, "auto") in by else "–"] for t in traces])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, t in enumerate(traces):
        ds = [int(c[1:]) for c in configs if c != "auto" and (t, c) in by]
        line, = ax.plot(ds, [by[t, f"d{d}"]["tpot_s"] * 1e3 for d in ds], "o-", label=t)
        if (t, "auto") in by:
            ax.axhline(by[t, "auto"]["tpot_s"] * 1e3, color=line.get_color(), ls="--", lw=1)
    ax.set_xlabel("fixed draft depth d (dashed: auto)")
    ax.set_ylabel("TPOT ms")
    ax.legend(fontsize=7)
    rep.figure(fig, f"adaptive_depth_{f.slug}.png", f"TPOT per fixed depth and auto's (dashed) — {_short_meta(f)}")


def _auto_ratios(by: dict, trace: str, configs: list[str]) -> list[str]:
    fixed = [c for c in configs if c != "auto" and (trace, c) in by]
    if (trace, "auto") not in by or not fixed:
        return ["–", "–", "–", "–"]
    best = min(fixed, key=lambda c: by[trace, c]["tpot_s"])
    auto = by[trace, "auto"]["tpot_s"]
    d7 = fmt(auto / by[trace, "d7"]["tpot_s"], 3) if (trace, "d7") in by else "–"
    rounds = [by[trace, c].get("tpot_rounds_s") for c in ("auto", best)]
    # the median of the per-round ratios: two configs of one round ran minutes apart, a host's drift cancels
    paired = fmt(statistics.median(x / y for x, y in zip(*rounds)), 3) if all(rounds) else "–"
    return [best, fmt(auto / by[trace, best]["tpot_s"], 3), paired, d7]


SECTIONS: dict[str, tuple[str, Callable[[Report, ResultFile], None]]] = {
    "step": ("Per-step cost", section_step),
    "ttft": ("Time to first token", section_ttft),
    "context_sweep": ("Context sweep: the windowing wedge", section_context_sweep),
    "depth_sweep": ("Latency-model fit over draft depth", section_depth_sweep),
    "phases": ("Phase decomposition", section_phases),
    "verify_by_k": ("Verify overhead at matched acceptance", section_verify_by_k),
    "window_sweep": ("Window-size sweep", section_window_sweep),
    "batch_sweep": ("Batch sweep: throughput-latency Pareto", section_batch_sweep),
    "memory": ("Memory", section_memory),
    "acceptance": ("Acceptance profiles", section_acceptance),
    "probe": ("Decision-invariance and attention-mass probe", section_probe),
    "output_diff": ("Greedy output diff", section_output_diff),
    "peer": ("wmtp against vLLM", section_peer),
    "adaptive_depth": ("Adaptive draft depth", section_adaptive_depth),
    "multiturn": ("Multi-turn serving with the prefix cache", section_multiturn),
    "kv_logits": ("fp8 KV cache: logits", section_kv_logits),
}


# ---- driver -------------------------------------------------------------------------------------


def _header(rep: Report, files: list[ResultFile], ignored: list[str], results_dir: Path) -> None:
    rep.add("# wmtp measurement report", "",
            f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} from `{results_dir}` "
            "by `wmtp report`. Means over independent runs with 95% Student-t intervals (± = half-width) unless a "
            "table says otherwise; times in ms.", "")
    if any(f.meta["synthetic"] for f in files):
        rep.add("> **Synthetic context** in the files marked so below: target KV, draft KV and recurrent states "
                "were filled with random values instead of a prefill. Costs are content-free; acceptance from "
                "such runs means nothing.", "")
    rep.add("## Inputs", "")
    rep.table(["file", "kind", "model", "hardware", "dtype", "context", "runs", "date", "commit", "command"],
              [[f"`{f.path.relative_to(results_dir)}`", f.kind, f.model, f.meta["hardware"], f.meta["dtype"],
                "synthetic" if f.meta["synthetic"] else "real", f.meta["runs"], f.meta["date"][:10], _commit(f),
                f"`{f.meta['command']}`"] for f in files])
    shapes = {f.meta["model"]: f.meta["shape"] for f in files if f.meta.get("shape")}
    for model, shape in shapes.items():
        rep.add(f"- shape of {model}: {json.dumps(shape) if not isinstance(shape, str) else shape}")
    if ignored:
        rep.add(f"- not part of this report (no kind it renders): {', '.join(f'`{p}`' for p in ignored)}")
    rep.add("")


def build_report(results_dir: str | Path, out: str | Path | None = None, include_archive: bool = False) -> Report:
    """Read ``results_dir`` (its ``archive`` folders too with ``include_archive``), write the markdown
    (default ``results_dir/REPORT.md``) and its PNGs."""
    results_dir = Path(results_dir)
    files, ignored = load_results(results_dir, include_archive)
    out = Path(out) if out else results_dir / "REPORT.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    rep = Report(out.parent)
    _header(rep, files, ignored, results_dir)
    present = {f.kind for f in files}
    for kind, (title, fn) in SECTIONS.items():
        if kind not in present:
            continue
        rep.add(f"## {title}", "")
        for f in (f for f in files if f.kind == kind):
            rep.add(f"### {f.label}", "", _provenance(f), "")
            fn(rep, f)
    missing = [k for k in SECTIONS if k not in present]
    rep.add("## Missing", "")
    rep.add(*(f"- `{k}`: {KIND_PURPOSE[k]}: no results file" for k in missing) if missing else ["- nothing: every kind is present"])
    rep.add("")
    if rep.warnings:
        rep.add("## Warnings", "", *(f"- {w}" for w in rep.warnings), "")
    out.write_text("\n".join(rep.lines))
    return rep
