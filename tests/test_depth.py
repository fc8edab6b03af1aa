"""Adaptive draft depth (``SpecConfig(num_draft_tokens="auto")``, ``engine.depth``): the controller
against a brute-force search over the same α and T tables; its estimators; greedy output identical
to dense for every model family, mode and batch size with the depth changing between iterations
(eager and static iterations, γ = 0 included); per-iteration depths in the metrics; config errors.
The sampled case (exact acceptance at a depth chosen from the past) is in test_spec_exact."""

from __future__ import annotations

import itertools
import random

import pytest

from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.cli import build_parser
from wmtp.engine.depth import (DepthController, IterationTimes, best_depth, expected_tokens, pooled_alphas,
                               shrunk_alphas)
from wmtp.engine.metrics import PositionCounts, alphas_from_histogram
from wmtp.errors import ConfigError
from tests.helpers import tiny_model
from tests.test_engine import MODES, SINK, W, _oracle_drafts, _prompts, _run_staggered, dense_reference  # noqa: F401


def _brute_expected(alphas: list[float], gamma: int) -> float:
    """E[tokens | γ] by enumerating the accepted count a: P(a) = Π_{j≤a} α_j · (1 − α_{a+1}) for a < γ."""
    total = 0.0
    for a in range(gamma + 1):
        p = 1.0
        for j in range(a):
            p *= alphas[j]
        if a < gamma:
            p *= 1 - alphas[a]
        total += (a + 1) * p
    return total


def test_controller_picks_the_brute_force_depth():
    rng = random.Random(0)
    for _ in range(300):
        gmax, batch = rng.randint(1, 8), rng.randint(1, 5)
        alphas = [[rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(gmax)] for _ in range(batch)]
        c, slope = rng.uniform(5, 20), rng.uniform(0, 3)
        times = [c + slope * g + rng.uniform(-0.5, 0.5) for g in range(gmax + 1)]
        scores = {g: sum(_brute_expected(a, g) for a in alphas) / times[g] for g in range(gmax + 1)}
        want = max(scores.values())
        got = best_depth(alphas, times)
        assert scores[got] == pytest.approx(want, rel=1e-12), (alphas, times)
        for g in range(gmax + 1):
            assert expected_tokens(alphas[0], g) == pytest.approx(_brute_expected(alphas[0], g), rel=1e-12)


def test_depth_extremes():
    assert best_depth([[0.0] * 7], [10 + g for g in range(8)]) == 0  # nothing accepted: a plain decode step
    assert best_depth([[1.0] * 7], [10 + g for g in range(8)]) == 7  # everything accepted: as deep as allowed
    assert best_depth([[0.9] * 7], [10.0] * 8) == 7  # free drafts: as deep as allowed


def test_position_counts_agree_with_the_histogram_at_fixed_depth():
    rng = random.Random(1)
    gamma, counts, hist = 5, PositionCounts(5), [0] * 6
    for _ in range(500):
        a = min(rng.randrange(8), gamma)
        counts.record(gamma, a)
        hist[a] += 1
    assert counts.alphas() == pytest.approx(alphas_from_histogram(hist))
    mixed = PositionCounts(3)
    mixed.record(1, 1)  # γ = 1, accepted: position 2 never verified, no rejection recorded there
    mixed.record(3, 1)  # γ = 3, rejected at 2
    assert (mixed.trials, mixed.accepts) == ([2, 1, 0], [2, 0, 0])


def test_estimators_shrink_towards_their_priors():
    counts = PositionCounts(3)
    assert pooled_alphas(counts) == [0.5, 0.5, 0.5]  # nothing seen: the first position's prior everywhere
    for _ in range(100):
        counts.record(3, 0)  # always rejected at 1: positions 2, 3 never reached
    pooled = pooled_alphas(counts)
    assert pooled[0] < 0.02 and pooled[1] == pooled[2] == pooled[0]  # unseen positions: as good as the last seen
    fresh = PositionCounts(3)
    assert shrunk_alphas(fresh, pooled) == pooled  # a new request starts from the engine's estimate


def test_iteration_times_calibrate_then_fit():
    t = IterationTimes(max_gamma=5)
    order = []
    for _ in range(12):
        g = t.calibration(batch=2)
        if g is None:
            break
        order.append(g)
        t.record(2, g, 10.0 + 2.0 * g)
    assert order == [5] * 4 + [1] * 4  # γ_max, then 1; each first sample (capture, compilation) dropped
    # γ ≥ 1 on the line through the measured ones; γ = 0, unmeasured, as dear as γ = 1 (no draft step saved)
    assert t.estimate(2) == pytest.approx([12.0] + [10.0 + 2.0 * g for g in range(1, 6)])
    t.record(2, 0, 9.0)
    t.record(2, 0, 9.0)
    assert t.estimate(2)[0] == 9.0
    assert t.calibration(batch=3) == 5  # another batch size has its own table
    t.record(2, 3, 100.0)
    t.record(2, 3, 100.0)
    assert t.estimate(2)[3] == 100.0  # measured beats the fit


def test_controller_follows_acceptance():
    """Measured costs of a draft step 10% of the verify: low acceptance → a shallow depth, high → deep."""
    def run(alpha: float) -> int:
        ctl = DepthController(max_gamma=7)
        for g in (7,) * 4 + (1,) * 4 + (0,) * 2:
            ctl.record(1, g, 10.0 + 1.0 * g)
        counts = PositionCounts(7)
        rng = random.Random(2)
        for _ in range(200):
            a = 0
            while a < 7 and rng.random() < alpha:
                a += 1
            counts.record(7, a)
        return ctl.best([counts], counts)

    assert run(0.05) == 0 and run(0.2) <= 1 and run(0.95) == 7


def test_controller_probes_the_depths_it_does_not_choose():
    """Every PROBE_EVERY-th choice is a neighbour of the best (above, then below; inward at a bound),
    so a controller sitting at γ = 0 still learns that acceptance rose, and climbs."""
    ctl = DepthController(max_gamma=7, probe_every=4)
    for g in (7,) * 4 + (1,) * 4 + (0,) * 2:  # here a plain step is measurably cheaper than γ = 1
        ctl.record(1, g, 10.0 + 3.0 * g)
    counts = PositionCounts(7)
    for _ in range(5):
        counts.record(7, 0)  # nothing accepted so far: γ = 0 is best
    chosen = []
    for _ in range(40):
        g = ctl.choose([counts], counts)
        chosen.append(g)
        if g:
            counts.record(g, g)  # acceptance has risen: every draft of a probe is accepted
    assert chosen[:3] == [0, 0, 0] and chosen[3] == 1  # the first probe: one above γ = 0
    assert chosen[-4:] == [7, 7, 7, 6]  # the probes' evidence moved the best to γ_max; probes then go below


def test_controller_at_zero_probes_one_every_few_iterations():
    """At γ = 0 no acceptance is observed, so γ = 1 is probed every ZERO_PROBE_EVERY-th choice
    (not every PROBE_EVERY-th, as off any other best)."""
    from wmtp.engine.depth import PROBE_EVERY, ZERO_PROBE_EVERY

    def choices(accepted: int, n: int) -> list[int]:
        ctl = DepthController(max_gamma=7)
        for g in (7,) * 4 + (1,) * 4 + (0,) * 2:
            ctl.record(1, g, 10.0 + 3.0 * g)
        counts = PositionCounts(7)
        for _ in range(5):
            counts.record(7, accepted)
        return [ctl.choose([counts], counts) for _ in range(n)]

    assert ZERO_PROBE_EVERY < PROBE_EVERY
    assert choices(0, 3 * ZERO_PROBE_EVERY) == ([0] * (ZERO_PROBE_EVERY - 1) + [1]) * 3
    assert set(choices(7, PROBE_EVERY - 1)) == {7}


def _auto_llm(preset: str, mode: str, ring: bool, d_max: int, batch: int, **spec) -> LLM:
    s = SpecConfig(mode=mode, num_draft_tokens="auto", max_draft_tokens=d_max, window=W, sink=SINK, ring=ring, **spec)
    return LLM(preset, spec=s, max_model_len=256, max_num_seqs=batch, page_size=8, prefill_chunk=37)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-llama", "tiny-nemotron-h"])
def test_adaptive_greedy_identical_to_dense(preset, dense_reference):
    """Every mode (ring on and off, and the window only past a context), batch 1 and 4, drafts right
    with probability 0.2 or 0.9: the controller moves the depth, the output stays dense's."""
    max_tokens = 20
    prompts = _prompts(6, seed=11)
    ref = dense_reference(preset, prompts, max_tokens)
    configs = [(m, r, {}) for m, r in MODES] + [("windowed", False, {"window_min_context": 30})]
    runs = zip(configs, ((4, 0.9), (1, 0.2), (4, 0.2), (1, 0.9)))  # both batch sizes, both hit rates
    depths = set()
    for k, ((mode, ring, extra), (batch, hit)) in enumerate(runs):
        chunk = prompts[k : k + 3]
        llm = _auto_llm(preset, mode, ring, 6, batch, **extra)
        _oracle_drafts(llm.engine, ref, hit, seed=k)
        got = _run_staggered(llm, chunk, SamplingParams(max_tokens=max_tokens, ignore_eos=True), batch)
        for p, g in zip(chunk, got):
            assert g == ref[tuple(p)], f"{preset} {mode} ring={ring} {extra} batch {batch}: output differs from dense"
        depths |= set(llm.engine.metrics.gammas)
        assert all(v == 0 for v in llm.engine.memory.usage().values())
    assert len(depths) >= 3, f"the depth barely moved: {depths}"


def _cycle_depths(engine, depths: list[int]) -> None:
    """Replace the controller's choice by a walk through every depth (γ = 0 included) indexed by the
    iterations recorded so far: the same choices on any path that records each iteration before
    the next is chosen (an overlapped one lags by one: still a varying depth)."""
    engine.depth.choose = lambda requests, pooled: depths[len(engine.metrics.gammas) % len(depths)]


def test_every_depth_in_turn_is_lossless(dense_reference):
    prompts = _prompts(6, seed=12)
    ref = dense_reference("tiny-qwen3.5-moe", prompts, 20)
    for mode, ring in MODES:
        llm = _auto_llm("tiny-qwen3.5-moe", mode, ring, 5, 3)
        _oracle_drafts(llm.engine, ref, 0.8, seed=1)
        _cycle_depths(llm.engine, [0, 4, 2, 1, 3])
        got = _run_staggered(llm, prompts, SamplingParams(max_tokens=20, ignore_eos=True), 3)
        assert got == [ref[tuple(p)] for p in prompts], f"{mode} ring={ring}"
        m = llm.engine.metrics
        assert set(m.gammas) == {0, 1, 2, 3, 4} and m.to_dict()["gamma_histogram"][0] > 0
        assert m.proposed == sum(g * b for g, b in zip(m.gammas, m.batch_sizes))
        req = next(iter(llm.engine.requests.values())).metrics.to_dict()
        assert len(req["gammas"]) == req["iterations"] and req["proposed_draft_tokens"] == sum(req["gammas"])


@pytest.mark.whole_tiles
def test_every_depth_on_the_static_iteration():
    """The static-buffer iteration (CUDA graphs' path), one graph set per depth, γ = 0's included:
    with forced acceptance clipped to each depth, the eager iteration's tokens and histograms; and
    overlapped (the next iteration launched before the last is read, a depth change collecting it
    first), dense's tokens."""
    pytest.importorskip("triton")
    from wmtp.bench.synthetic import force_acceptance

    # the eager references run the torch twins (same tokens; the interpreter's cost paid once)
    models = {graphs: tiny_model("tiny-qwen3-next", backend="torch" if graphs == "off" else "triton")
              for graphs in ("off", "eager")}
    prompts = [[3, 9, 27, 81, 243], [7] * 11]
    spec = SpecConfig(mode="windowed", num_draft_tokens="auto", max_draft_tokens=4, window=8, sink=2)

    def run(graphs: str, overlap: bool, forced: int | None) -> tuple[list, list, LLM]:
        llm = LLM(models[graphs], spec=spec if forced is not None or graphs != "off" else SpecConfig(mode="dense",
                  num_draft_tokens=1), max_model_len=96, max_num_seqs=2, page_size=8, prefill_chunk=32,
                  decode_graphs=graphs, overlap=overlap)
        if llm.engine.depth is not None:
            _cycle_depths(llm.engine, [0, 3, 1, 2])
        if forced is not None:
            force_acceptance(llm.engine, forced)
        out = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
        return out, llm.engine.metrics.hist, llm

    eager, static = run("off", False, 2), run("eager", False, 2)
    assert {g for _, g in static[2].engine.graphs} == {0, 1, 2, 3}
    assert eager[:2] == static[:2]
    assert eager[1][1] > 0 and eager[1][2] > 0  # k = 2 forced, clipped to 1 at γ = 1
    overlapped = run("eager", True, None)
    assert overlapped[0] == run("off", False, None)[0] and len(set(overlapped[2].engine.metrics.gammas)) > 1


@pytest.mark.whole_tiles
def test_probes_run_on_the_overlapped_static_iteration():
    """Overlapped static iterations: a probe needs another graph set, so the iteration in flight is
    collected first, and then the probe itself runs (it is not chosen, dropped and replaced by the
    best on a second choice). Every choice runs, in order; at most the last, launched past the end,
    is not recorded."""
    pytest.importorskip("triton")
    from wmtp.bench.synthetic import force_acceptance

    spec = SpecConfig(mode="windowed", num_draft_tokens="auto", max_draft_tokens=4, window=8, sink=2)
    llm = LLM(tiny_model("tiny-llama", backend="triton"), spec=spec, max_model_len=128, max_num_seqs=1,
              page_size=8, prefill_chunk=32, decode_graphs="eager", overlap=True)
    ctl, chosen = llm.engine.depth, []
    ctl.probe_every = 3
    choose = ctl.choose
    ctl.choose = lambda requests, pooled: chosen.append(choose(requests, pooled)) or chosen[-1]
    force_acceptance(llm.engine, 0)  # nothing accepted: γ = 0 is best, its probe γ = 1
    llm.generate([[3, 9, 27, 81, 243]], SamplingParams(max_tokens=48, ignore_eos=True))
    run = llm.engine.metrics.gammas
    assert run == chosen[: len(run)] and len(chosen) - len(run) <= 1
    after = run[len(run) // 2 :]  # past calibration
    assert 0 in after and 1 in after


def test_auto_config_and_cli():
    s = SpecConfig(mode="windowed", num_draft_tokens="auto")
    assert s.adaptive and s.num_draft_tokens == 8 and s.gamma == 7 and s.ring_size == 64 + 4032 + 8
    s = SpecConfig(mode="native", num_draft_tokens="auto", max_draft_tokens=3)
    assert s.num_draft_tokens == 3
    for bad, field in ((dict(mode="dense", num_draft_tokens="auto"), "dense"),
                       (dict(num_draft_tokens="deep"), "num_draft_tokens"),
                       (dict(num_draft_tokens=4, max_draft_tokens=6), "max_draft_tokens"),
                       (dict(num_draft_tokens="auto", max_draft_tokens=1), "max_draft_tokens")):
        with pytest.raises(ConfigError, match=field):
            SpecConfig(**bad)
    args = build_parser().parse_args(["generate", "--preset", "tiny-llama", "--prompt", "1 2", "-d", "auto",
                                      "--max-draft-tokens", "5"])
    assert (args.num_draft_tokens, args.max_draft_tokens) == ("auto", 5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--preset", "tiny-llama", "--prompt", "1", "-d", "deep"])


def test_bench_depth_replay_on_the_host(tmp_path, capsys):
    """``wmtp bench depth-replay``: fixed depths accept exactly min(r_i, γ) per iteration (their AL is
    the trace's), auto's depths are recorded, and every trace gets a summary row."""
    import json

    from wmtp.cli import main

    traces = {"low": [0, 0, 1, 0, 0, 0], "high": [3, 3, 2, 3, 3, 3]}
    (tmp_path / "t.json").write_text(json.dumps({"gamma": 3, "traces": traces}))
    out = tmp_path / "replay.json"
    argv = ["bench", "depth-replay", "--traces", str(tmp_path / "t.json"), "--preset", "tiny-qwen3.5-moe",
            "--device", "cpu", "--context", "48", "--window", "16", "--sink", "4", "--depths", "2,4,auto",
            "--max-draft-tokens", "4", "--reference", "d4", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    rows = {(r["config"], r["trace"]): r for r in doc["rows"]}
    assert set(rows) == {(c, t) for c in ("d2", "d4", "auto") for t in traces}
    for (config, trace), r in rows.items():
        assert r["iterations"] == len(traces[trace]) and sum(r["gamma_histogram"]) == r["iterations"]
        if config != "auto":
            gamma = int(config[1:]) - 1
            assert r["al"] == pytest.approx(1 + sum(min(x, gamma) for x in traces[trace]) / len(traces[trace]))
    assert {s["trace"] for s in doc["summary"]} == set(traces) and all("auto_over_d4" in s for s in doc["summary"])
    assert main(argv + ["--depths", "9"]) != 0  # d = 9 needs run lengths beyond the traces' γ = 3
    assert "censored at gamma=3" in capsys.readouterr().err
    assert main(argv + ["--depths", "2,deep"]) != 0
    assert "comma-separated ints" in capsys.readouterr().err
