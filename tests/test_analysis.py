"""Analysis: statistics (Wilson, t, OLS, α_j ↔ H ↔ AL), window probes on tiny models, output diffs and
the markdown report on fake (test-only) results."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import wmtp
from tests.analysis_fixtures import BUILDERS, write_fake_results
from tests.helpers import scramble_
from wmtp.analysis.diff import diff_tokens, greedy_outputs, output_diff_table, summarize_diffs
from wmtp.analysis.probes import attention_mass, capture_attention, top_margin, window_probe
from wmtp.analysis.report import build_report, load_results, write_results
from wmtp.analysis.stats import (
    acceptance_length_from_alphas, alpha_intervals, diff_ci, histogram_from_alphas, mean_ci, ols_fit, ratio_ci,
    t_quantile, wilson_interval,
)
from wmtp.engine.metrics import acceptance_length, alphas_from_histogram
from wmtp.engine.window import DraftWindow
from wmtp.errors import WmtpError

# ---- Wilson ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n,lo,hi", [
    (8, 10, 0.4902, 0.9433),   # textbook example, z = 1.96
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (50, 100, 0.4038, 0.5962),
    (1, 3, 0.0615, 0.7923),
])
def test_wilson_known_values(k, n, lo, hi):
    a, b = wilson_interval(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


def test_wilson_matches_scipy_binomtest():
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(3, 17), (40, 41), (120, 300), (0, 5)]:
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        a, b = wilson_interval(k, n, z=stats.norm.ppf(0.975))
        assert (a, b) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_wilson_edge_cases():
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


# ---- α_j ↔ H[n] ↔ AL ------------------------------------------------------------------------------

hists = st.lists(st.integers(0, 500), min_size=2, max_size=9).filter(lambda h: sum(h) > 0)


@settings(max_examples=200, deadline=None)
@given(hists)
def test_alpha_hist_al_round_trip(hist):
    alphas = alphas_from_histogram(hist)
    assert acceptance_length_from_alphas(alphas) == pytest.approx(acceptance_length(hist), rel=1e-12)
    rebuilt = histogram_from_alphas(alphas, sum(hist))
    assert rebuilt == pytest.approx(hist, abs=1e-9 * sum(hist))
    for est, a in zip(alpha_intervals(hist), alphas):
        assert est.n == sum(hist[est.j - 1 :]) and est.k == sum(hist[est.j :])
        if est.n:
            assert est.lo <= a <= est.hi and est.alpha == a
        else:
            assert math.isnan(a) and math.isnan(est.lo)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), st.integers(1, 10_000))
def test_alphas_to_hist_to_alphas(alphas, total):
    hist = histogram_from_alphas(alphas, total)
    assert sum(hist) == pytest.approx(total)
    back = alphas_from_histogram(hist)
    for a, b, s in zip(alphas, back, [1.0] + list(np.cumprod(alphas))):
        if s > 1e-9:  # α_j is only identified where draft j is reached
            assert b == pytest.approx(a, abs=1e-9)


def test_alpha_known_profile():
    hist = [10, 20, 30, 40]  # 100 iterations; AL = 1 + (20 + 60 + 120) / 100 = 3
    est = alpha_intervals(hist)
    assert [e.alpha for e in est] == pytest.approx([0.9, 70 / 90, 40 / 70])
    assert acceptance_length_from_alphas([e.alpha for e in est]) == pytest.approx(3.0)
    assert acceptance_length_from_alphas(alphas_from_histogram([5, 0, 0])) == 1.0  # nan α after a zero


# ---- Student t, mean CI ---------------------------------------------------------------------------


def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for level in (0.90, 0.95, 0.99):
        for df in list(range(1, 61)) + [100, 1000, 10**6]:
            assert t_quantile(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df), abs=1e-3), (level, df)
    assert t_quantile(0.8, 4) == pytest.approx(stats.t.ppf(0.9, 4))  # non-tabulated level via scipy


def test_mean_ci_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 12, 40):
        xs = rng.normal(10, 2, n).tolist()
        c = mean_ci(xs)
        lo, hi = stats.t.interval(0.95, n - 1, loc=np.mean(xs), scale=stats.sem(xs))
        assert (c.mean, c.lo, c.hi) == pytest.approx((np.mean(xs), lo, hi), rel=1e-4)
    one = mean_ci([3.0])
    assert one.mean == 3.0 and math.isnan(one.half)
    assert mean_ci([]).n == 0


def test_diff_and_ratio_ci():
    a, b = [10.0, 11.0, 12.0], [5.0, 5.5, 6.0]
    d, r = diff_ci(a, b), ratio_ci(a, b)
    assert d.mean == pytest.approx(5.5) and r.mean == pytest.approx(2.0)
    se_d = math.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 3)
    assert d.half == pytest.approx(t_quantile(0.95, 2) * se_d)
    assert r.sd == pytest.approx(2.0 * math.hypot(math.sqrt(1 / 3) / 11, math.sqrt(0.25 / 3) / 5.5))


# ---- OLS ------------------------------------------------------------------------------------------


def test_ols_known_dataset():
    fit = ols_fit([1, 2, 3, 4, 5], [2, 4, 5, 4, 5])  # SSR = 2.4, s² = 0.8, Sxx = 10
    assert (fit.slope, fit.intercept, fit.r2) == pytest.approx((0.6, 2.2, 0.6))
    assert fit.se_slope == pytest.approx(math.sqrt(0.08))
    assert fit.se_intercept == pytest.approx(math.sqrt(0.8 * (1 / 5 + 9 / 10)))


def test_ols_matches_numpy_and_matrix_formula():
    rng = np.random.default_rng(1)
    x = np.arange(1, 9, dtype=float)  # γ = 1..8 (d = 2..9)
    y = 1.19e-3 * x + 19.6e-3 + rng.normal(0, 2e-4, x.size)
    fit = ols_fit(x.tolist(), y.tolist())
    slope, intercept = np.polyfit(x, y, 1)
    assert (fit.slope, fit.intercept) == pytest.approx((slope, intercept), rel=1e-9)
    X = np.column_stack([x, np.ones_like(x)])
    resid = y - X @ np.array([slope, intercept])
    cov = resid @ resid / (x.size - 2) * np.linalg.inv(X.T @ X)
    assert (fit.se_slope, fit.se_intercept) == pytest.approx(tuple(np.sqrt(np.diag(cov))), rel=1e-9)
    assert fit.r2 == pytest.approx(np.corrcoef(x, y)[0, 1] ** 2, rel=1e-9)
    exact = ols_fit([1, 2, 3], [3, 5, 7])
    assert exact.se_slope == pytest.approx(0, abs=1e-12) and exact.r2 == 1.0
    assert math.isnan(ols_fit([1, 2], [1, 3]).se_slope)
    with pytest.raises(ValueError):
        ols_fit([2, 2, 2], [1, 2, 3])


def test_steepest_step_finds_the_cliff():
    """The largest rise between consecutive depths (in x order, whatever the input order) and where:
    a straight line's equals its slope; a jump at x = 7 shows there; ties of x are an error."""
    from wmtp.analysis.stats import steepest_step

    assert steepest_step([1, 2, 3, 4], [2, 4, 6, 8]) == (2, 2)
    assert steepest_step([6, 1, 7, 2, 3], [11, 1, 20, 3, 5]) == (9, 7)
    assert steepest_step([1, 3], [0, 3]) == (1.5, 3)  # per unit x across a gap
    with pytest.raises(ValueError, match="distinct x"):
        steepest_step([1, 1, 2], [1, 2, 3])


# ---- probes ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3.5-moe"])
def tiny(request):
    model = scramble_(wmtp.load_model(request.param, dtype="float32"), seed=1)
    ids = torch.randint(0, model.config.vocab_size, (97,), generator=torch.Generator().manual_seed(0))
    return model, ids


def test_probe_covering_window_is_identity(tiny):
    model, ids = tiny
    r = window_probe(model, ids, DraftWindow(sink=4, window=ids.numel()))
    assert not any(r.affected)
    s = r.summary(only_affected=False)
    assert s["agreement"] == 1.0 and s["flipped"] == 0
    assert max(r.z_far) == 0.0 and max(r.readout_change) == 0.0
    assert r.summary()["steps"] == 0


def test_probe_small_window(tiny):
    model, ids = tiny
    w = DraftWindow(sink=2, window=8)
    r = window_probe(model, ids, w)
    assert r.affected == [p >= 10 for p in r.positions]
    for p, a in enumerate(r.affected):
        assert (r.z_far[p] > 0) == a and (r.readout_change[p] > 0) == a
    s = r.summary()
    assert s["steps"] == ids.numel() - 1 - 10 and 0 < s["z_far"] < 1
    assert 0 <= s["agreement"] <= 1 and s["flipped"] == sum(not r.agree[p] for p in range(len(r.agree)) if r.affected[p])


@torch.no_grad()
def test_probe_matches_brute_force(tiny):
    """Agreement and margins from single-position draft steps; o_full / o_win from the backend itself."""
    model, ids = tiny
    w = DraftWindow(sink=3, window=5)
    r = window_probe(model, ids, w)
    n = ids.numel() - 1
    attn = model.mtp.layers[0].self_attn
    with model.private_cache(1, ids.numel()) as cache:
        hidden = model(ids, cache.context([0], [ids.numel()]))
        outs = {}
        for win in (None, w):
            with capture_attention(attn) as rec:
                model.mtp_forward(ids[1:], hidden[:-1], cache.context([0], [n], windows=[win]))
            outs[win] = rec.calls[0]
        q, k, v, scale, o_full = outs[None]
        z_far, change, ref_full, ref_win = attention_mass(q, k, v, scale, w)
        assert torch.allclose(ref_full.float(), o_full, atol=1e-5)
        assert torch.allclose(ref_win.float(), outs[w][4], atol=1e-5)
        for p in range(0, n, 7):  # one draft step at slot p, keys already in the cache
            logits = {}
            for win in (None, w):
                h = model.mtp_forward(ids[p + 1 : p + 2], hidden[p : p + 1], cache.context([p], [1], windows=[win]))
                logits[win] = model.compute_logits(h).float()[0]
            assert r.agree[p] == bool(logits[None].argmax() == logits[w].argmax())
            assert r.margin[p] == pytest.approx(top_margin(logits[None]).item(), abs=1e-4)
            keys = torch.arange(p + 1)
            assert bool((~w.visible(torch.tensor(p), keys)).any()) == r.affected[p]


def test_probe_tail_equals_full_probe(tiny):
    model, ids = tiny
    w = DraftWindow(sink=2, window=6)
    full, tail = window_probe(model, ids, w), window_probe(model, ids, w, first=50, prefill_chunk=32)
    assert tail.positions == full.positions[50:] and tail.affected == full.affected[50:]
    assert tail.agree == full.agree[50:]
    for f in ("margin", "z_far", "readout_change"):
        assert getattr(tail, f) == pytest.approx(getattr(full, f)[50:], abs=1e-4), f
    with pytest.raises(ValueError):
        window_probe(model, ids, w, first=ids.numel() - 1)


# ---- output diff ----------------------------------------------------------------------------------


def test_diff_tokens_and_table():
    assert diff_tokens([1, 2, 3], [1, 2, 3]) == (0, None)
    assert diff_tokens([1, 2, 3, 4], [1, 9, 3]) == (2, 1)
    cells = output_diff_table({"dense": {"a": [1, 2], "b": [3]}, "native": {"a": [1, 2], "b": [4]},
                               "windowed": {"a": [1, 5]}})
    got = {(c.mode_a, c.mode_b, c.prompt): c.n_diff for c in cells}
    assert got == {("dense", "native", "a"): 0, ("dense", "native", "b"): 1, ("dense", "windowed", "a"): 1,
                   ("native", "windowed", "a"): 1}
    summary = {(s["mode_a"], s["mode_b"]): s for s in summarize_diffs(cells)}
    assert summary[("dense", "native")]["cells_differing"] == 1 and summary[("dense", "native")]["tokens"] == 3


def test_greedy_outputs_lossless_on_tiny_model():
    from wmtp.engine.config import SpecConfig

    model = scramble_(wmtp.load_model("tiny-llama", dtype="float32"), seed=2)
    g = torch.Generator().manual_seed(1)
    prompts = {f"p{i}": torch.randint(1, 512, (30 + 20 * i,), generator=g).tolist() for i in range(2)}
    specs = {"dense": SpecConfig(mode="dense", num_draft_tokens=1), "native": SpecConfig(mode="native", num_draft_tokens=4),
             "windowed": SpecConfig(mode="windowed", num_draft_tokens=4, sink=2, window=8)}
    cells = output_diff_table(greedy_outputs(model, prompts, specs, max_tokens=16))
    assert len(cells) == 6 and all(c.n_diff == 0 and c.len_a == 16 for c in cells)


# ---- report ---------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_report_every_section(tmp_path):
    import matplotlib.image as mpimg

    write_fake_results(tmp_path / "res")
    (tmp_path / "res" / "other.json").write_text(json.dumps({"preset": "x"}))
    rep = build_report(tmp_path / "res", tmp_path / "out" / "REPORT.md")
    text = (tmp_path / "out" / "REPORT.md").read_text()
    for title in ("Per-step cost", "Time to first token", "windowing wedge", "Latency-model fit", "Phase decomposition", "matched acceptance",
                  "Window-size sweep", "Pareto", "Memory", "Acceptance profiles", "Decision-invariance", "Greedy output diff",
                  "wmtp against vLLM", "vLLM mtp / wmtp windowed TPOT", "Adaptive draft depth",
                  "Multi-turn serving with the prefix cache", "6.000 s without the cache, 0.600 s with it (10.0x)",
                  "first differing token user 1: turn 2, token 5", "| 200 | 0.60 | 122880 |",
                  "fp8 KV cache: logits", "1 / 512"):
        assert title in text, title
    assert re.search(r"\| hard \|.*\| d2 \| (\d\.\d{3}) \| \1 \|", text)  # adaptive depth: per-round ratio
    assert re.search(r"\| easy \|.*\| d\d \| \d\.\d{3} \| – \|", text)  # no rounds recorded
    assert "nothing: every kind is present" in text and "not part of this report (no kind it renders): `other.json`" in text
    assert "FAKE (test data)" in text and "Synthetic context" in text
    names = {p.name for p in rep.pngs}
    assert names == {"context_wedge_fake_context_sweep.png", "latency_fit_fake_depth_sweep.png", "phases_fake_phases.png",
                     "verify_by_k_fake_verify_by_k.png", "pareto_fake_batch_sweep.png", "alpha_fake_acceptance.png",
                     "window_fake_window_sweep.png", "adaptive_depth_fake_adaptive_depth.png"}
    for p in rep.pngs:
        assert p.parent == tmp_path / "out" and p.read_bytes()[:8] == PNG_MAGIC and f"]({p.name})" in text
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 0.01
    assert not rep.warnings


def test_report_states_the_floor_bandwidth(tmp_path):
    """A step file's section names the bandwidth its floors divide by: read (DESIGN §6) or, in older
    files, a copy's; and the GPU's state after each mode where the file has it."""
    for name, bw in (("read", {"read_bytes_per_s": 4.41e12, "copy_bytes_per_s": 4.23e12}),
                     ("copy", {"copy_bytes_per_s": 4.29e12, "copy_gib": 4.0})):
        (p,) = write_fake_results(tmp_path / "res" / name, kinds=["step"])
        obj = json.loads(p.read_text())
        obj["meta"]["bandwidth"] = bw
        if name == "read":  # and the GPU state bench step records after each mode
            obj["rows"][0]["gpu_state_after"] = {"clocks.sm": "1905", "clocks.mem": "3201", "power.draw": "685.06",
                                                 "power.limit": "700.00", "temperature.gpu": "55",
                                                 "clocks_event_reasons.active": "0x0000000000000004"}
        p.write_text(json.dumps(obj))
    build_report(tmp_path / "res", tmp_path / "out" / "REPORT.md")
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert "HBM read bandwidth measured in the run, 4.41 TB/s (a copy: 4.23 TB/s" in text
    assert "a copy's read + write bandwidth, 4.29 TB/s (this file predates" in text
    assert ("- GPU after dense's timed iterations: SM 1905 MHz, memory 3201 MHz, 685.06 W of 700.00 W, 55 C, "
            "clock events: sw power cap") in text
    assert text.count("timed iterations: SM") == 1


def test_report_names_a_shortened_model(tmp_path):
    """A run of a preset's first N layers (``bench step --layers``) is named so wherever the report
    names the model (the file table, its section's heading and provenance); a whole model's is not."""
    (p,) = write_fake_results(tmp_path / "res", kinds=["step"])
    obj = json.loads(p.read_text())
    obj["meta"]["layers"] = 44
    p.write_text(json.dumps(obj))
    build_report(tmp_path / "res", tmp_path / "out" / "REPORT.md")
    text = (tmp_path / "out" / "REPORT.md").read_text()
    model = obj["meta"]["model"]
    assert text.count(f"{model} (first 44 layers)") >= 3 and f"{model} · " not in text
    obj["meta"]["layers"] = None
    p.write_text(json.dumps(obj))
    build_report(tmp_path / "res", tmp_path / "out2" / "REPORT.md")
    assert "first 44 layers" not in (tmp_path / "out2" / "REPORT.md").read_text()


def test_report_same_kind_in_subfolders_gets_separate_plots(tmp_path):
    """Two batch sweeps (e.g. at 1M and at 131K) in different folders: two sections, two plots."""
    for sub in ("a", "b"):
        write_fake_results(tmp_path / "res" / sub, kinds=["batch_sweep"])
    rep = build_report(tmp_path / "res", tmp_path / "out" / "REPORT.md")
    text = (tmp_path / "out" / "REPORT.md").read_text()
    names = sorted(p.name for p in rep.pngs)
    assert names == ["pareto_a_fake_batch_sweep.png", "pareto_b_fake_batch_sweep.png"]
    assert all(f"]({n})" in text for n in names) and "`a/fake_batch_sweep.json`" in text


def test_report_leaves_the_archive_out_unless_asked(tmp_path):
    """Superseded results live in ``archive/`` folders: rendered only with ``--all``, and every file
    names the commit its numbers come from (or says it was not recorded)."""
    from wmtp.cli import main

    write_fake_results(tmp_path / "res", kinds=["step"])
    (old,) = write_fake_results(tmp_path / "res" / "archive" / "h200", kinds=["step"], seed=1)
    obj = json.loads(old.read_text())
    obj["meta"]["commit"] = "abc1234"
    old.write_text(json.dumps(obj))
    build_report(tmp_path / "res")
    text = (tmp_path / "res" / "REPORT.md").read_text()
    assert "`fake_step.json`" in text and "archive/" not in text and "| unrecorded |" in text
    assert main(["report", str(tmp_path / "res"), "--all"]) == 0
    text = (tmp_path / "res" / "REPORT.md").read_text()
    assert "`archive/h200/fake_step.json`" in text and "`abc1234`" in text


def test_report_partial_states_missing(tmp_path):
    write_fake_results(tmp_path, kinds=["step", "acceptance"])
    rep = build_report(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert "## Per-step cost" in text and "## Acceptance profiles" in text and "## Memory" not in text
    missing = text.split("## Missing")[1]
    for kind in set(BUILDERS) - {"step", "acceptance"}:
        assert f"`{kind}`" in missing
    assert "`step`" not in missing and [p.name for p in rep.pngs] == ["alpha_fake_acceptance.png"]


def test_report_acceptance_al_consistency(tmp_path):
    write_fake_results(tmp_path, kinds=["acceptance"])
    build_report(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    rows = [l.split(" | ") for l in text.splitlines() if l.startswith("| niah_mq") or l.startswith("| fwe")]
    assert rows and all(r[6] == r[7] for r in rows)  # AL measured == AL rebuilt from α_j (after the sink column)


def test_report_schema_errors_and_run_warnings(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "step", "meta": {"model": "m"}, "rows": []}))
    with pytest.raises(WmtpError, match="meta lacks"):
        load_results(tmp_path)
    write_fake_results(tmp_path, kinds=["depth_sweep"])
    obj = json.loads((tmp_path / "fake_depth_sweep.json").read_text())
    obj["rows"][0].pop("t_iter_s")
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(WmtpError, match=r"rows\[0\] \(depth_sweep\) lacks \['t_iter_s'\]"):
        load_results(tmp_path)
    bad_hist = {"kind": "acceptance", "meta": obj["meta"], "rows": [
        {"task": "t", "mode": "native", "sink": 4, "W": None, "d": 4, "hists": [[1, 2, 3]]}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad_hist))
    with pytest.raises(WmtpError, match="d = 4 entries"):
        load_results(tmp_path)
    obj = json.loads((tmp_path / "fake_depth_sweep.json").read_text())
    obj["rows"][0]["t_iter_s"] = obj["rows"][0]["t_iter_s"][:2]
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    rep = build_report(tmp_path)
    assert any("2 values, meta.runs = 3" in w for w in rep.warnings)
    with pytest.raises(WmtpError, match="not a directory"):
        build_report(tmp_path / "nope")


def test_report_cli(tmp_path, capsys):
    from wmtp.cli import main

    write_fake_results(tmp_path, kinds=["phases"])
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r" / "R.md")]) == 0
    assert (tmp_path / "r" / "R.md").exists() and (tmp_path / "r" / "phases_fake_phases.png").exists()
    assert "1 plots" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_report_single_run_has_no_intervals(tmp_path, monkeypatch):
    import tests.analysis_fixtures as fx

    monkeypatch.setattr(fx, "RUNS", 1)
    fx.write_fake_results(tmp_path)
    rep = build_report(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert not rep.warnings and len(rep.pngs) == 8
    step_rows = [l for l in text.splitlines() if l.startswith("| native | 1048576 | 7 | 1 |")]
    assert step_rows and "±" not in step_rows[0]


def test_write_results_round_trip(tiny, tmp_path):
    model, ids = tiny
    row = window_probe(model, ids, DraftWindow(sink=2, window=8)).row("random-ids", ids.numel())
    meta = {"hardware": "CPU (test)", "model": "tiny", "dtype": "float32", "synthetic": False, "runs": 1,
            "command": "pytest"}
    write_results(tmp_path / "probe.json", "probe", [row], meta)
    (f,), _ = load_results(tmp_path)
    assert f.kind == "probe" and f.rows[0]["steps"] == ids.numel() - 1 - 10 and "date" in f.meta
    with pytest.raises(WmtpError, match="meta lacks"):
        write_results(tmp_path / "x.json", "probe", [row], {"model": "tiny"})
    assert not (tmp_path / "x.json").exists()
    build_report(tmp_path)
    assert "random-ids" in (tmp_path / "REPORT.md").read_text()
