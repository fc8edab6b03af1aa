"""Prefill-once forks (wmtp.bench.acceptance): a fork of a snapshot decodes exactly as a fresh engine
does (tokens, acceptance histogram, per-iteration trace), for every mode, ring on and off, on a
plain and a hybrid (GDN) tiny target. CPU, fp32."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import scramble_
from wmtp.bench.acceptance import TracingEngine, run_fork, take_snapshot
from wmtp.config import ModelConfig
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.sampling import SamplingParams
from wmtp.models.loader import build_model
from wmtp.presets import PRESETS

V = 8  # a small vocabulary: a scrambled draft then agrees with the target often enough to accept 0..γ
N_PROMPT, N_GEN = 61, 40
SPECS = {
    "dense": SpecConfig(mode="dense", num_draft_tokens=1),
    "native-d3": SpecConfig(mode="native", num_draft_tokens=3),
    "native-d5": SpecConfig(mode="native", num_draft_tokens=5),
    "win-ring": SpecConfig(mode="windowed", num_draft_tokens=4, sink=4, window=8, ring=True),
    "win-pool": SpecConfig(mode="windowed", num_draft_tokens=4, sink=4, window=8, ring=False),
    "win-nosink": SpecConfig(mode="windowed", num_draft_tokens=5, sink=0, window=16, ring=False),
}
CHUNK, PAGE = 23, 8  # prompt crosses several chunks and pages


def _model(preset: str):
    raw = dict(PRESETS[preset], vocab_size=V)
    model = build_model(ModelConfig.from_dict(raw), "cpu", torch.float32)
    return scramble_(model, seed=0, gain=1.0).eval()


def _scratch(model, prompt: list[int], spec: SpecConfig, params: SamplingParams):
    eng = TracingEngine(model, spec, EngineConfig(max_model_len=len(prompt) + params.max_tokens, max_num_seqs=1,
                                                  page_size=PAGE, prefill_chunk=CHUNK))
    req = eng.requests[eng.add_request(prompt, params)]
    while eng.has_unfinished():
        eng.step()
    hist = list(req.metrics.hist) if spec.speculative else []
    return req.tokens[len(prompt):], hist, eng.trace.get(req.id, [])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-next"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fork_equals_fresh_engine(preset: str, temperature: float) -> None:
    torch.set_num_threads(1)
    model = _model(preset)
    rng = random.Random(7)
    prompt = [rng.randrange(1, V) for _ in range(N_PROMPT)]
    params = SamplingParams(temperature=temperature, max_tokens=N_GEN, ignore_eos=True, seed=11)
    snap = take_snapshot(model, prompt, prefill_chunk=CHUNK, page_size=PAGE)
    forked = {}
    for name, spec in SPECS.items():
        run = run_fork(model, snap, spec, params, page_size=PAGE, prefill_chunk=CHUNK)
        want = _scratch(model, prompt, spec, params)
        assert (run.tokens, run.hist, run.trace) == want, f"{preset} {name}: fork differs from a fresh engine"
        forked[name] = run
    # the comparison means something: drafts do get accepted, greedy outputs are the dense tokens, and
    # the window changes what the draft proposes (otherwise a fork that ignored the window would pass)
    if temperature == 0.0:
        assert all(r.tokens == forked["dense"].tokens for r in forked.values())
    assert sum(forked["native-d5"].hist[1:]) > 0
    assert forked["win-pool"].trace != _scratch(model, prompt, SpecConfig(mode="native", num_draft_tokens=4), params)[2]


def test_snapshot_is_reusable_and_unchanged() -> None:
    """Forking does not modify the snapshot: the same fork twice gives the same run."""
    torch.set_num_threads(1)
    model = _model("tiny-llama")
    prompt = list(range(1, V)) * 6
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    snap = take_snapshot(model, prompt, prefill_chunk=CHUNK, page_size=PAGE)
    before = [k.clone() for k, _ in snap.target_kv] + [snap.hidden.clone()]
    a = run_fork(model, snap, SPECS["win-ring"], params, page_size=PAGE)
    b = run_fork(model, snap, SPECS["win-ring"], params, page_size=PAGE)
    assert (a.tokens, a.hist, a.trace) == (b.tokens, b.hist, b.trace)
    after = [k for k, _ in snap.target_kv] + [snap.hidden]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_probes_from_snapshot_hiddens_equal_window_probe() -> None:
    """The snapshot's kept hiddens give the same probe as ``window_probe``'s own prefill."""
    from wmtp.analysis.probes import window_probe, window_probes_from_hidden
    from wmtp.engine.window import DraftWindow

    torch.set_num_threads(1)
    model = _model("tiny-llama")
    rng = random.Random(3)
    prompt = [rng.randrange(1, V) for _ in range(N_PROMPT)]
    snap = take_snapshot(model, prompt, prefill_chunk=CHUNK, page_size=PAGE)
    windows = [DraftWindow(sink=4, window=8), DraftWindow(sink=0, window=16)]
    got = window_probes_from_hidden(model, prompt, snap.hidden, windows, first=20)
    for w, g in zip(windows, got):
        want = window_probe(model, prompt, w, first=20)
        assert (g.positions, g.affected, g.agree) == (want.positions, want.affected, want.agree)
        for f in ("margin", "z_far", "readout_change"):
            assert torch.allclose(torch.tensor(getattr(g, f)), torch.tensor(getattr(want, f)), atol=1e-4), f
    assert any(not a for a in got[0].agree) or max(got[0].z_far) > 0.01  # the window does bite here
