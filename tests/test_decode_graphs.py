"""The static-buffer decode iteration (what CUDA graphs replay) against the eager iteration.

On the CPU it runs uncaptured (``decode_graphs="eager"``, Triton kernels in the interpreter); on a
GPU the same checks run with real capture. Checked: greedy tokens identical to dense (lossless) with
batches whose membership changes; with forced acceptance of every k (so rollback and extend cover
every accepted count) tokens identical to the eager iteration with the same forcing; pools empty
at the end; host-side bookkeeping (acceptance histograms) identical; overlapped iterations (the
default: the next launched before the previous is read) identical to synchronous ones; the
device-side slot lookups against the host's.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from wmtp import LLM, SamplingParams, SpecConfig  # noqa: E402
from wmtp.engine import graphs as graphs_module  # noqa: E402
from wmtp.bench.synthetic import force_acceptance  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402

pytestmark = pytest.mark.whole_tiles  # the engine's invariants; the kernels' tilings are the kernel tests'
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
GRAPHS = "capture" if ON_GPU else "eager"


def _llm(preset: str, mode: str, graphs: str, d: int = 4, backend: str = "triton", overlap: bool = True) -> LLM:
    """An engine over the preset at its fewest layers (``tiny_model``: same seed, same weights for
    every call), so the interpreter's cost per layer is paid once or twice, not four times."""
    spec = SpecConfig(mode=mode, num_draft_tokens=d if mode != "dense" else 1, window=8, sink=2)
    return LLM(tiny_model(preset, DEVICE, backend), spec=spec, max_model_len=128, max_num_seqs=3, page_size=8,
               prefill_chunk=32, decode_graphs=graphs, overlap=overlap)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 400) for _ in range(rng.choice([3, 17, 40]))] for _ in range(n)]


def _staggered(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Requests join every other step and finish at different lengths, so batches change."""
    eng, outs, queue, live, step = llm.engine, {}, list(enumerate(prompts)), {}, 0
    while queue or live:
        if queue and step % 2 == 0:
            i, p = queue.pop(0)
            live[eng.add_request(p, SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))] = i
        for o in eng.step():
            if o.finished:
                outs[live.pop(o.request_id)] = eng.requests[o.request_id].tokens
        step += 1
    assert all(v == 0 for v in eng.memory.usage().values())
    return [outs[i] for i in range(len(prompts))]


# Triton's interpreter costs ~1 s per tiny forward on the CPU: sizes are kept small for CI.
# (the two Qwen hybrid presets take the same static path: one of them, in both its modes; Nemotron-H's
# Mamba2 / NoPE path in the mode that exercises the most of it)
@pytest.mark.parametrize("preset,modes", [("tiny-qwen3-next", ("dense", "windowed")), ("tiny-llama", ("native",)),
                                          ("tiny-nemotron-h", ("windowed",))])
def test_static_iteration_is_lossless(preset, modes):
    prompts, lens = _prompts(3, seed=1), [7, 4, 9]
    ref = _staggered(_llm(preset, "dense", "off", backend="torch"), prompts, lens)
    for mode in modes:
        llm = _llm(preset, mode, GRAPHS)
        assert _staggered(llm, prompts, lens) == ref, f"{preset} {mode}: static iteration output differs from dense"
        assert llm.engine.graphs, "the static path did not run"


@pytest.mark.parametrize("preset,mode,ks", [("tiny-qwen3-next", "windowed", (1, 3)), ("tiny-llama", "native", (2,)),
                                            ("tiny-nemotron-h", "windowed", (2,))])
def test_static_matches_eager_under_forced_acceptance(preset, mode, ks, monkeypatch):
    """Forcing k accepted drafts makes outputs depend on the rollback and the extend being right for
    that k: the static path must give exactly the eager path's tokens and histograms. Its
    bookkeeping steps go through dynamo here (the GPU's compiled path; on the CPU with dynamo's
    eager backend, which traces and guards as the GPU's does without a C++ build)."""
    monkeypatch.setenv("WMTP_COMPILE", "1")
    if not ON_GPU:
        monkeypatch.setattr(graphs_module, "COMPILE_BACKEND", "eager")
    prompts, lens = _prompts(2, seed=2), [9, 6]
    # on the CPU the eager reference runs the torch twins (same tokens; the interpreter's cost paid once)
    backends = {"off": "triton" if ON_GPU else "torch", GRAPHS: "triton"}
    for k in ks:
        runs = {}
        for graphs in ("off", GRAPHS):
            llm = _llm(preset, mode, graphs, backend=backends[graphs])
            force_acceptance(llm.engine, k)
            runs[graphs] = (_staggered(llm, prompts, lens), llm.engine.metrics.hist)
            if graphs == GRAPHS:
                assert llm.engine.compiled_steps is True, "a graph set ran its bookkeeping uncompiled"
        assert runs["off"] == runs[GRAPHS], f"{preset} {mode} k={k}: static and eager iterations disagree"


def test_every_graph_set_compiles_past_the_recompile_limit(monkeypatch):
    """Each graph set is a new specialisation of the same bookkeeping code; dynamo runs a function
    eagerly once it has been recompiled ``recompile_limit`` times. More sets than that (as a bench
    suite builds) must each report their steps compiled."""
    monkeypatch.setattr(graphs_module, "COMPILE_BACKEND", "eager")

    class Steps:  # what a graph set compiles: a method reading per-set attributes
        def __init__(self, n: int) -> None:
            self.n, self.out = n, torch.zeros(n)

        def stage(self) -> None:
            self.out.copy_(torch.arange(self.n) * self.n)

    for n in range(1, torch._dynamo.config.recompile_limit + 3):
        steps = Steps(n)
        compiler = graphs_module._StepCompiler()
        compiler("stage", steps.stage)()
        assert compiler.compiled, f"set {n} ran its step eagerly (dynamo's recompile limit)"
        assert steps.out.tolist() == [i * n for i in range(n)]


def test_sampling_requests_use_the_eager_iteration():
    llm = _llm("tiny-llama", "windowed", GRAPHS)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True))
    assert len(out[0].token_ids) == 6 and not llm.engine.graphs


def test_decode_graphs_option_is_checked():
    from wmtp.engine.config import EngineConfig
    from wmtp.errors import ConfigError

    with pytest.raises(ConfigError, match="decode_graphs"):
        EngineConfig(decode_graphs="sometimes")


def test_overlapped_iterations_match_synchronous_ones():
    """Overlap on (one iteration in flight while the batch is unchanged; requests finish and join
    mid-run, so in-flight iterations run past a request's end and are drained on batch changes)
    vs off: same tokens, same histograms, and the overlap really had iterations in flight."""
    prompts, lens = _prompts(3, seed=4), [8, 3, 6]
    runs, overlapped = {}, 0
    for overlap in (False, True):
        llm = _llm("tiny-qwen3-next", "windowed", GRAPHS, overlap=overlap)
        force_acceptance(llm.engine, 2)
        collect = llm.engine._collect

        def spy(it, collect=collect, eng=llm.engine):
            nonlocal overlapped
            overlapped += eng._inflight is not None and eng._inflight is not it
            return collect(it)

        llm.engine._collect = spy
        runs[overlap] = (_staggered(llm, prompts, lens), llm.engine.metrics.hist)
    assert runs[True] == runs[False], "overlapped and synchronous iterations disagree"
    assert overlapped > 0, "no iteration was collected while the next one was in flight"


def test_phase_timed_replay_matches_the_one_graph_iteration():
    """With the phase timer the four forwards replay apart, each phase marked; without it, as one
    ``iteration`` graph: the same tokens either way, and the timer saw the static iteration's phases."""
    from wmtp.engine.phases import PhaseTimer

    prompts, lens = _prompts(2, seed=6), [5, 3]
    runs, timer = {}, PhaseTimer(DEVICE)
    for timed in (False, True):
        llm = _llm("tiny-llama", "native", GRAPHS)
        llm.engine.phase_timer = timer if timed else None
        runs[timed] = _staggered(llm, prompts, lens)
    phases = ("draft_fwd", "verify_base", "verify_ovh", "draft_ctx")
    assert any(all(row[p] > 0 for p in phases) for row in timer.collect()), "no iteration replayed the forwards apart"
    assert runs[True] == runs[False], "the phase-timed replay and the one-graph iteration disagree"


def test_a_batch_returning_to_an_earlier_graph_set_reloads():
    """[A] runs on the B = 1 set, [A, B] on the B = 2 set, B finishes, [A] is back on the B = 1 set:
    that set must reload A's rows (its device L and draft state are an iteration set behind)."""
    prompts, lens = _prompts(2, seed=5), [14, 3]
    runs = {}
    for graphs in ("off", GRAPHS):
        llm = _llm("tiny-llama", "native", graphs)
        force_acceptance(llm.engine, 2)
        runs[graphs] = _staggered(llm, prompts, lens)
        if graphs == GRAPHS:
            assert {b for b, _ in llm.engine.graphs} == {1, 2}, "the batches did not use both graph sets"
    assert runs["off"] == runs[GRAPHS]


def test_device_slot_lookup_matches_the_host():
    """``batch_slots`` (what the graphs derive on the device) against ``slots`` row by row, with
    positions past the reserved pages, negative ones and inactive ring rows sent to the trash."""
    from wmtp.engine.window import DraftWindow
    from wmtp.models.context import PagedSlots, RingSlots

    page, trash = 4, torch.tensor(999)
    table = torch.tensor([[5, 2, 7, 0], [3, 1, 0, 0]], dtype=torch.int32)
    paged = PagedSlots(table, page)
    pos = torch.tensor([[0, 5, 11, 12], [-1, 3, 7, 8]])
    got = paged.batch_slots(pos, torch.tensor([3, 2]), trash)
    want = [[int(paged.slots(0, torch.tensor([p]))[0]) if p < 12 else 999 for p in (0, 5, 11, 12)],
            [999] + [int(paged.slots(1, torch.tensor([p]))[0]) if p < 8 else 999 for p in (3, 7, 8)]]
    assert got.tolist() == want
    ring = RingSlots(torch.tensor([0, 100]), DraftWindow(2, 4), 3)
    pos = torch.tensor([[0, 1, 2, 9], [7, 8, 9, 10]])
    got = ring.batch_slots(pos, torch.tensor([True, False]), trash)
    assert got[0].tolist() == ring.slots(0, pos[0]).tolist() and got[1].tolist() == [999] * 4
