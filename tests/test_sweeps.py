"""The cost sweeps (``wmtp bench context|depth|phases|verify-by-k|window|batch|memory|suite``) on
a tiny preset on CPU, the phase timer, and the report rendered from their output.

CPU timings on a shared machine are noisy, so relations about time are tested where a known cost
is injected (sleeps in the draft forward / per draft key read) and dominates the noise; relations
that hold exactly (phase partition, pool bytes, admission counts, tok/s arithmetic) on real runs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

import wmtp
from wmtp.analysis.report import build_report, load_results
from wmtp.analysis.stats import mean_ci, ols_fit, ratio_ci
from wmtp.bench.synthetic import add_synthetic_request, force_acceptance, randomize_pools
from wmtp.cli import main
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine
from wmtp.engine.phases import PHASES, PhaseTimer
from wmtp.engine.window import DraftWindow
from wmtp.models.model import CausalLM

PRESET = "tiny-qwen3.5-moe"
TINY = ["--device", "cpu", "--preset", PRESET, "--page-size", "16", "--sink", "4", "--window", "32", "--warmup", "1"]
SUITE = TINY + ["--contexts", "64,128", "--context", "128", "--depths", "2,3", "-d", "3", "--windows", "16,32",
                "--runs", "2", "--iters", "6", "--k-iters", "2", "--batch-ladder", "1,2", "--kv-budget-gib", "0.0005"]
KINDS = ("context_sweep", "depth_sweep", "phases", "verify_by_k", "window_sweep", "batch_sweep", "memory")


def _rows(out, kind: str) -> list[dict]:
    return json.loads((out / f"{kind}.json").read_text())["rows"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every sweep in one ``wmtp bench suite`` run (one model, shared cells)."""
    out = tmp_path_factory.mktemp("suite")
    assert main(["bench", "suite", "--out", str(out)] + SUITE) == 0
    return out


# ---- the suite's files --------------------------------------------------------------------------


def test_suite_writes_every_sweep_schema_valid(suite):
    files, ignored = load_results(suite)
    assert sorted(f.kind for f in files) == sorted(KINDS) and not ignored
    for f in files:
        m = f.meta
        assert m["synthetic"] is True and m["model"] == PRESET and m["hardware"].startswith("CPU")
        assert m["command"].startswith("wmtp bench suite --out") and m["shape"]["full_attention_layers"] == 1
        assert m["runs"] == (1 if f.kind == "memory" else 2)
        for r in f.rows:  # every per-run list holds one value per run
            assert all(len(v) == m["runs"] for k, v in r.items() if k.endswith("_s") and isinstance(v, list))
    assert {(r["mode"], r["d"]) for r in _rows(suite, "depth_sweep")} == {(m, d) for m in ("native", "windowed") for d in (2, 3)}
    assert {(r["mode"], r["S"]) for r in _rows(suite, "context_sweep")} == {(m, s) for m in ("native", "windowed")
                                                                           for s in (64, 128)}
    assert sorted(str(r["W"]) for r in _rows(suite, "window_sweep")) == ["16", "32", "native"]


def test_suite_shares_cells_between_sweeps(suite):
    """native/windowed d=3 at S=128 is one cell: context, depth and window report the same runs."""
    ctx = {(r["mode"], r["S"]): r["t_iter_s"] for r in _rows(suite, "context_sweep")}
    depth = {(r["mode"], r["d"]): r["t_iter_s"] for r in _rows(suite, "depth_sweep")}
    window = {str(r["W"]): r["t_iter_s"] for r in _rows(suite, "window_sweep")}
    assert ctx["native", 128] == depth["native", 3] == window["native"]
    assert ctx["windowed", 128] == depth["windowed", 3] == window["32"]


def test_suite_phases_partition_t_iter(suite):
    """The four phases add up to the timer's span exactly in every run, and the span is T_iter within
    5% (pooled over runs: with 6 iterations a run, one preemption outside the span on this shared
    CPU would dominate a single run; the dedicated phase-timer test checks each iteration)."""
    for r in _rows(suite, "phases"):
        assert r["draft_steps"] == r["d"] - 2  # γ − 1 draft steps; the extend is draft_ctx
        for run in range(2):
            parts = [r[f"t_{p}_s"][run] for p in PHASES]
            assert all(p > 0 for p in parts)
            assert sum(parts) == pytest.approx(r["t_span_s"][run], rel=1e-9)
        assert abs(sum(r["t_span_s"]) / sum(r["t_iter_s"]) - 1) < 0.05


def test_suite_verify_by_k_rows(suite):
    rows = _rows(suite, "verify_by_k")
    for mode in ("native", "windowed"):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["k"])
        assert [r["k"] for r in mine] == [0, 1, 2] and all(r["iterations"] == [2, 2] for r in mine)
        assert all(0 < t < 0.05 for r in mine for t in r["t_verify_ovh_s"])


def test_suite_batch_admission_and_tok_s(suite):
    rows = _rows(suite, "batch_sweep")
    most = {}
    for mode in ("dense", "native", "windowed"):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["B"])
        bs = [r["B"] for r in mine]
        assert bs[:2] == [1, 2] and bs == sorted(set(bs)) and bs[-1] == mine[0]["max_admitted"]
        assert mine[0]["limited_by"] == "memory" and all(r["admitted"] == r["B"] for r in mine)
        al = mine[0]["forced_accept"] + 1
        for r in mine:
            for pu, sy, t in zip(r["per_user_tok_s"], r["system_tok_s"], r["t_iter_s"]):
                assert pu == pytest.approx(al / t) and sy == pytest.approx(r["B"] * pu)
        most[mode] = bs[-1]
    # same budget: the ring frees the draft pool, so windowed seats more than native; dense has no draft
    assert most["dense"] >= most["windowed"] > most["native"] >= 2
    mem = {(r["mode"], r["S"]): r["max_admitted"] for r in _rows(suite, "memory")}
    assert all(mem[m, 128] == most[m] for m in most)


def test_suite_memory_table(suite):
    cfg = wmtp.load_model(PRESET).config
    slot = cfg.draft_kv_bytes_per_token(4)
    for r in _rows(suite, "memory"):
        F = r["full_attention_layers"]
        assert F == len(cfg.full_attention_layers)
        if r["mode"] == "native":  # the full-length draft pool is 1/(F+1) of the KV, exactly
            assert r["draft_pool_bytes"] / (r["draft_pool_bytes"] + r["target_kv_bytes"]) == pytest.approx(1 / (F + 1))
            assert r["draft_ring_bytes"] == 0
        if r["mode"] == "windowed":  # a ring of sink + W + d slots per seat, no pool
            assert r["draft_pool_bytes"] == 0 and r["draft_ring_bytes"] % ((4 + 32 + 3) * slot) == 0
        if r["mode"] == "dense":
            assert r["draft_pool_bytes"] == r["draft_ring_bytes"] == 0
        assert sum(r["per_request_bytes"].values()) * r["max_admitted"] <= r["kv_budget_bytes"]
    mem = {(r["mode"], r["S"]): r["max_admitted"] for r in _rows(suite, "memory")}
    assert all(mem[m, 64] >= mem[m, 128] for m in ("dense", "native", "windowed"))


def test_budget_below_one_request_names_the_option(tmp_path, capsys):
    """600 tokens of native need target + draft pool (2 × 256 B/token); the budget holds 1.3 × 256 B/token."""
    assert main(["bench", "memory", "--out", str(tmp_path), "--contexts", "600", "--batch-modes", "native",
                 "-d", "3", "--kv-budget-gib", str(1.3 * 600 * 256 / 2**30)] + TINY) == 2
    assert "--kv-budget-gib / --reserve-gib: a KV budget of" in capsys.readouterr().err


def test_report_renders_the_suite(suite, tmp_path):
    import matplotlib.image as mpimg

    rep = build_report(suite, tmp_path / "REPORT.md")
    text = (tmp_path / "REPORT.md").read_text()
    assert {p.name for p in rep.pngs} == {"context_wedge_context_sweep.png", "latency_fit_depth_sweep.png",
                                          "phases_phases.png", "verify_by_k_verify_by_k.png", "window_window_sweep.png",
                                          "pareto_batch_sweep.png"}
    for p in rep.pngs:
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 0.01
    phase_lines = [l for l in text.splitlines() if l.startswith("| native | 3 | 128 |") or l.startswith("| windowed | 3 | 128 |")]
    assert phase_lines and not any("⚠" in l for l in phase_lines)
    assert "Most requests seated at once" in text and "1/(F+1)" in text and "reference" in text
    assert not rep.warnings


# ---- injected costs: the sweeps must see them -----------------------------------------------


def _slow_draft(monkeypatch, seconds: float) -> None:
    """Every MTP forward costs ``seconds`` more (a known t_draft_fwd)."""
    orig = CausalLM.mtp_forward

    def slow(self, *args, **kw):
        time.sleep(seconds)
        return orig(self, *args, **kw)

    monkeypatch.setattr(CausalLM, "mtp_forward", slow)


def test_depth_fit_recovers_the_draft_forward_cost(monkeypatch, tmp_path):
    """With 40 ms added to every MTP forward the fitted slope (t_draft_fwd) is 40 ms plus the tiny
    model's own draft step (a few ms, more on a loaded machine), and the line fits; the report's fit
    is the OLS of the file's means."""
    _slow_draft(monkeypatch, 0.040)
    assert main(["bench", "depth", "--out", str(tmp_path), "--depths", "2-4", "--runs", "2", "--iters", "3",
                 "--context", "96"] + TINY) == 0
    rows = _rows(tmp_path, "depth_sweep")
    for mode in ("native", "windowed"):
        pts = sorted((r["d"] - 1, mean_ci(r["t_iter_s"]).mean) for r in rows if r["mode"] == mode)
        fit = ols_fit([p[0] for p in pts], [p[1] for p in pts])
        assert 0.039 < fit.slope < 0.065 and fit.r2 > 0.9, (mode, fit)
        assert fit.slope == pytest.approx(np.polyfit(*zip(*pts), 1)[0])
        rep = build_report(tmp_path)
        line = next(l for l in (tmp_path / "REPORT.md").read_text().splitlines() if l.startswith(f"| {mode} | "))
        assert line.split(" | ")[1].startswith(f"{fit.slope * 1e3:.3f} ± ")
    assert [p.name for p in rep.pngs] == ["latency_fit_depth_sweep.png"]


def test_context_wedge_follows_the_draft_keys_read(monkeypatch, tmp_path):
    """Each draft attention call sleeps 50 µs per key the reference backend gathers. Windowed draft
    reads stay within sink + W + d − 1 keys at any S while native reads all S, so the cost-side
    ratio native/windowed grows with S."""
    import wmtp.models.backend as backend

    keys: dict[str, list[int]] = {"native": [], "windowed": []}
    state = {"draft": None}
    orig_fwd, orig_causal, orig_window = CausalLM.mtp_forward, backend.causal_key_positions, DraftWindow.key_positions

    def mtp_forward(self, ids, hidden, ctx, *a, **kw):
        state["draft"] = "native" if ctx.windows is None or ctx.window(0) is None else "windowed"
        try:
            return orig_fwd(self, ids, hidden, ctx, *a, **kw)
        finally:
            state["draft"] = None

    def counted(positions: torch.Tensor) -> torch.Tensor:
        if state["draft"]:
            keys[state["draft"]].append(positions.numel())
            time.sleep(50e-6 * positions.numel())
        return positions

    monkeypatch.setattr(CausalLM, "mtp_forward", mtp_forward)
    monkeypatch.setattr(backend, "causal_key_positions", lambda q_last: counted(orig_causal(q_last)))
    monkeypatch.setattr(DraftWindow, "key_positions", lambda self, a, b: counted(orig_window(self, a, b)))
    assert main(["bench", "context", "--out", str(tmp_path), "--contexts", "64,640", "-d", "3", "--runs", "2",
                 "--iters", "3", "--no-floor"] + TINY) == 0
    assert max(keys["windowed"]) <= 4 + 32 + 3 - 1 and max(keys["native"]) >= 640
    by = {(r["mode"], r["S"]): r["t_iter_s"] for r in _rows(tmp_path, "context_sweep")}
    wedge = {s: ratio_ci(by["native", s], by["windowed", s]).mean for s in (64, 640)}
    assert wedge[640] > 2.0 and wedge[640] > wedge[64] + 1.0, wedge
    rep = build_report(tmp_path)
    assert [p.name for p in rep.pngs] == ["context_wedge_context_sweep.png"]


def test_phase_timer_attributes_each_phase(monkeypatch):
    """Known costs land in their phases: 80 ms per MTP forward (γ − 1 = 2 draft steps, one extend),
    120 ms per target forward (the verify); the phases sum to the iteration's wall time within 5%.
    The slack above each injected cost (the tiny model's own work, CPU noise: tens of ms on a loaded
    machine) stays under one misplaced forward, so a mark in the wrong place fails."""
    draft, target, slack = 0.080, 0.120, 0.060
    _slow_draft(monkeypatch, draft)
    orig = CausalLM.forward

    def slow_target(self, *args, **kw):
        time.sleep(target)
        return orig(self, *args, **kw)

    monkeypatch.setattr(CausalLM, "forward", slow_target)
    model = wmtp.load_model(PRESET)
    eng = Engine(model, SpecConfig(mode="windowed", num_draft_tokens=4, window=32, sink=4),
                 EngineConfig(max_model_len=256, max_num_seqs=1, page_size=16))
    assert eng.phase_timer is None
    randomize_pools(eng)
    add_synthetic_request(eng, 96, 64)
    force_acceptance(eng, 2)
    eng.step()
    eng.phase_timer = timer = PhaseTimer("cpu")
    walls = []
    for _ in range(4):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    parts = timer.collect()
    assert len(parts) == 4 and timer.collect() == []
    for p, wall in zip(parts, walls):
        assert p["steps"] == 2
        assert 2 * draft <= p["draft_fwd"] < 2 * draft + slack
        assert target <= p["verify_base"] < target + slack
        assert draft <= p["draft_ctx"] < draft + slack
        assert p["verify_ovh"] < slack
        assert sum(p[k] for k in PHASES) == pytest.approx(p["total"])
        assert abs(p["total"] / wall - 1) < 0.05
    with pytest.raises(ValueError, match="unknown phase"):
        timer.start()
        timer.mark("verify")


# ---- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, option", [
    (["depth", "--depths", "2,x"], "--depths"),
    (["context", "--contexts", ""], "--contexts"),
    (["phases", "--modes", "native,bogus"], "--modes"),
    (["suite", "--sweeps", "depth,nope"], "--sweeps"),
])
def test_bad_values_name_the_option_argparse(argv, option, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", argv[0], "--out", str(tmp_path)] + argv[1:])
    assert e.value.code == 2 and option in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["depth", "--depths", "1-3"], "--depths"),
    (["phases", "--modes", "dense"], "--modes"),
    (["batch"], "--kv-budget-gib"),
    (["context", "--runs", "0"], "--runs"),
    (["depth", "--fit-d", "5,3"], "--fit-d"),
    (["window", "--windows", "0,32"], "--windows"),
    (["context", "--accept", "-1"], "--accept"),
    (["depth", "--layers", "9"], "--layers=9"),
])
def test_bad_values_name_the_option(argv, option, tmp_path, capsys):
    assert main(["bench", argv[0], "--out", str(tmp_path)] + argv[1:] + TINY) == 2
    assert option in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_layers_builds_the_first_layers_and_records_them(tmp_path):
    """``--layers N`` (as ``bench step``'s): the sweep's model is the preset's first N layers, recorded
    in meta, its floor counting only those (the first two of tiny-qwen3-next: one GDN, one attention)."""
    argv = ["bench", "depth", "--depths", "2", "--runs", "1", "--iters", "2", "--context", "64"] + TINY
    argv[argv.index(PRESET)] = "tiny-qwen3-next"
    floors = {}
    for layers in (None, 2):
        out = tmp_path / str(layers)
        assert main(argv + ["--out", str(out)] + ([] if layers is None else ["--layers", str(layers)])) == 0
        f = json.loads((out / "depth_sweep.json").read_text())
        assert f["meta"]["layers"] == layers
        shape = f["meta"]["shape"]
        assert shape["layers"] == (layers or 4) and shape["full_attention_layers"] == (layers or 4) // 2
        floors[layers] = {r["mode"]: r["floor_bytes"] for r in f["rows"]}
    assert all(0 < floors[2][m] < floors[None][m] for m in floors[None])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda(tmp_path, capsys):
    assert main(["bench", "context", "--out", str(tmp_path)]) == 2
    assert "--device=cuda" in capsys.readouterr().err


def test_plan_runs_nothing(tmp_path, capsys):
    """The default 35B suite's plan: the shared d=7 cells hold several measures."""
    assert main(["bench", "suite", "--out", str(tmp_path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "native d=7 S=1040000 " in out and "TIter, Phases, VerifyByK" in out and "plan: " in out
    assert not list(tmp_path.iterdir())


def test_deadline_stops_before_the_next_engine(tmp_path, capsys):
    assert main(["bench", "suite", "--out", str(tmp_path), "--sweeps", "context,depth", "--deadline", "0.001",
                 "--contexts", "64", "--depths", "2", "--runs", "1", "--iters", "1"] + TINY) == 3
    assert "unfinished: context, depth" in capsys.readouterr().out and not list(tmp_path.glob("*.json"))


def test_resume_runs_only_what_is_missing(tmp_path, capsys):
    """A second call with --resume keeps the logged runs and adds only the missing one."""
    argv = ["bench", "context", "--out", str(tmp_path), "--contexts", "64", "--modes", "windowed", "--iters", "2",
            "--no-floor"] + TINY
    assert main(argv + ["--runs", "2"]) == 0
    first = _rows(tmp_path, "context_sweep")[0]["t_iter_s"]
    capsys.readouterr()
    assert main(argv + ["--runs", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resuming: 2 measure runs" in out and out.count(" run 3: ") == 1 and " run 1: " not in out
    again = _rows(tmp_path, "context_sweep")[0]["t_iter_s"]
    assert len(again) == 3 and again[:2] == first
    assert main(argv + ["--runs", "2"]) == 0 and " run 1: " in capsys.readouterr().out  # no --resume: afresh


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-nemotron-h"])
def test_bench_ttft_split_adds_up_to_the_prefill(preset, tmp_path):
    """``bench ttft --split``: the prefill's time inside attention, recurrent (GDN / Mamba2), MoE and
    MLP layers and the rest add up to its TTFT; a MoE's shared-expert MLP counts once, as MoE (the
    Qwen preset has no dense MLP layer)."""
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--preset", preset, "--device", "cpu", "--tokens", "100", "--chunk", "32",
                 "--modes", "windowed", "--window", "32", "--sink", "4", "-d", "3", "--split", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    split = row["split_s"]
    assert set(split) == {"attention", "recurrent", "moe", "mlp", "rest"}
    assert min(split["attention"], split["recurrent"], split["moe"], split["rest"]) > 0
    assert sum(split.values()) == pytest.approx(row["ttft_s"])
    if preset == "tiny-qwen3.5-moe":
        assert split["mlp"] == 0
