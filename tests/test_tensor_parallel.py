"""Tensor parallelism on the CPU (gloo, 2 processes): every architecture sharded over 2 ranks gives
the single-process logits (target and MTP head, loaded from a checkpoint and from a preset) and the
same greedy tokens in dense / native / windowed; a killed rank ends a run with an error within
seconds; sizes that do not divide the model, and devices that are missing, are refused before
anything is spawned. The ranks are spawned once per test process (``Ranks.shared``) and reused."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from tests import tensor_parallel_ranks as on_ranks
from tests.helpers import scramble_, tiny_model
from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.bench import floor
from wmtp.cli import main
from wmtp.engine.distributed import Ranks, RankFailure
from wmtp.engine.memory import CapacityError
from wmtp.errors import ConfigError, WmtpError
from wmtp.models.loader import save_checkpoint

# (preset, config overrides, expert layout): every family and checkpoint layout; the second llama has
# one KV head (replicated over the ranks) and attention biases (o_proj's is added once)
MODELS = {
    "llama": ("tiny-llama", {}, "per_expert"),
    "llama-kv1-bias": ("tiny-llama", {"num_key_value_heads": 1, "attention_bias": True}, "per_expert"),
    "qwen3": ("tiny-qwen3", {}, "per_expert"),
    "qwen3-next": ("tiny-qwen3-next", {}, "per_expert"),
    "qwen3.5-moe": ("tiny-qwen3.5-moe", {}, "packed"),
    "nemotron-h": ("tiny-nemotron-h", {}, "per_expert"),
}
PROMPTS = [[5, 9, 17, 3, 22, 41, 7, 11], [100, 200, 300, 400, 12]]
SPECS = {"dense": SpecConfig(mode="dense", num_draft_tokens=1), "native": SpecConfig(mode="native", num_draft_tokens=3),
         "windowed": SpecConfig(mode="windowed", num_draft_tokens=3, window=4, sink=2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A scrambled (strongly peaked logits: no near ties for a sum order to flip) tiny checkpoint per model."""
    made: dict[str, str] = {}

    def get(key: str) -> str:
        if key not in made:
            preset, overrides, layout = MODELS[key]
            model = scramble_(tiny_model(preset, **overrides), seed=1)
            made[key] = str(save_checkpoint(model, tmp_path_factory.mktemp(key), expert_layout=layout))
        return made[key]

    return get


@pytest.fixture
def ranks() -> Ranks:
    return Ranks.shared(2, "cpu")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("key", list(MODELS))
def test_two_ranks_give_the_single_process_logits(key, checkpoint, ranks):
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    source = checkpoint(key)
    for got, want in zip(ranks.call(on_ranks.logits, source, ids), on_ranks.logits(source, ids, sharded=False)):
        _close(got, want)
    if not MODELS[key][1]:  # a preset's random weights are the same model on any number of ranks
        preset = MODELS[key][0]
        for got, want in zip(ranks.call(on_ranks.logits, preset, ids), on_ranks.logits(preset, ids, sharded=False)):
            _close(got, want)


@pytest.mark.parametrize("key", ["llama-kv1-bias", "qwen3-next", "qwen3.5-moe", "nemotron-h"])
def test_two_ranks_give_the_single_process_tokens(key, checkpoint, ranks):
    source = checkpoint(key)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for name, spec in SPECS.items():
        runs = []
        for size in (1, 2):
            llm = LLM(source, spec=spec, max_model_len=64, max_num_seqs=2, tensor_parallel_size=size)
            runs.append(([o.token_ids for o in llm.generate(PROMPTS, params)], llm.stats()["acceptance_length"]))
            llm.close()
        assert runs[0] == runs[1], name
    # sampling: every rank draws from the same seeded generator over the same gathered logits
    sampled = []
    for size in (1, 2):
        llm = LLM(source, spec=SPECS["windowed"], max_model_len=64, tensor_parallel_size=size)
        sampled.append([o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0,
                                                                                  seed=7, ignore_eos=True))])
        llm.close()
    assert sampled[0] == sampled[1]
    # partial acceptances: the rollback of the recurrent states and the draft ring's extend per rank
    spec = SPECS["windowed"]
    assert ranks.call(on_ranks.forced_run, source, spec, PROMPTS, 1) == on_ranks.forced_run(source, spec, PROMPTS, 1,
                                                                                           sharded=False)


def test_two_ranks_give_the_single_process_tokens_at_fp8_kv(checkpoint, ranks):
    """fp8 K / V per rank (each its KV heads, the same per-layer scales): TP = 2 emits TP = 1's tokens."""
    source = checkpoint("qwen3.5-moe")
    runs = []
    for size in (1, 2):
        llm = LLM(source, spec=SPECS["windowed"], max_model_len=64, max_num_seqs=2, tensor_parallel_size=size,
                  kv_cache_dtype="fp8_e4m3")
        runs.append([o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))])
        llm.close()
    assert runs[0] == runs[1]


def test_adaptive_depth_chooses_alike_on_every_rank(checkpoint, ranks):
    """Each rank's clock differs; the depth controllers agree on the slowest rank's time, so every
    rank runs the same γ each iteration (else their collectives would not match) and the tokens are
    the single process's."""
    source = checkpoint("qwen3-next")
    spec = SpecConfig(mode="windowed", num_draft_tokens="auto", max_draft_tokens=4, window=8, sink=2)
    tokens, gammas = ranks.call(on_ranks.adaptive_run, source, spec, PROMPTS)
    assert tokens == on_ranks.adaptive_run(source, spec, PROMPTS, sharded=False)[0] and gammas[0] == gammas[1]
    _, gammas = ranks.call(on_ranks.adaptive_run, source, spec, PROMPTS, 3)  # alone, rank 1 would stay shallow
    assert gammas[0] == gammas[1] and max(gammas[0]) == 3


def test_cli_generate_and_bench_step_on_two_ranks(checkpoint, ranks, tmp_path, monkeypatch, capsys):
    source = checkpoint("nemotron-h")
    argv = ["generate", "--model", source, "--prompt", "5 9 17 3", "--max-tokens", "6", "--mode", "windowed",
            "--window", "4", "--sink", "2", "-d", "3"]
    outs = []
    for size in ("1", "2"):
        assert main(argv + ["--tensor-parallel-size", size]) == 0
        outs.append(capsys.readouterr().out.splitlines()[0])
    assert outs[0] == outs[1]
    monkeypatch.setattr(floor, "HOST_GIB", 1 / 256)  # rank 0 measures the bandwidth for every rank
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--device", "cpu", "--preset", "tiny-nemotron-h", "--context", "40", "-d", "2",
                 "--iters", "2", "--warmup", "1", "--modes", "windowed", "--window", "16", "--sink", "4",
                 "--tensor-parallel-size", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["tensor_parallel_size"] == 2 and len(result["rows"]) == 1


def test_an_engine_refused_alike_on_every_rank_leaves_the_ranks_up(checkpoint, ranks):
    with pytest.raises(CapacityError, match="kv_memory_bytes"):
        LLM(checkpoint("llama"), kv_memory_bytes=64, tensor_parallel_size=2)
    assert Ranks.shared(2, "cpu") is ranks and ranks.failure is None
    ids = [1, 2, 3]
    _close(ranks.call(on_ranks.logits, "tiny-llama", ids)[0], on_ranks.logits("tiny-llama", ids, sharded=False)[0])


def test_a_killed_rank_ends_the_run_with_an_error_within_seconds(checkpoint, ranks):
    llm = LLM(checkpoint("llama"), spec=SPECS["dense"], max_model_len=512, tensor_parallel_size=2)
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
    next(stream)
    worker = ranks.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 .*exited with code -9"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 10
    with pytest.raises(RankFailure):  # the group is gone: later calls refuse at once
        llm.generate(PROMPTS)
    assert Ranks.shared(2, "cpu") is not ranks  # the next user gets fresh ranks


def test_sizes_and_devices_that_cannot_hold_the_model_are_refused_before_spawning():
    before = Ranks._live
    for preset, size, field in (("tiny-llama", 3, "num_attention_heads"), ("tiny-qwen3.5-moe", 4, "linear_num_key_heads"),
                                ("tiny-nemotron-h", 4, "n_groups"), ("tiny-llama", 0, "tensor_parallel_size")):
        with pytest.raises(ConfigError, match=field):
            LLM(preset, tensor_parallel_size=size)
    with pytest.raises(ConfigError, match="quantized"):
        LLM("tiny-qwen3.5-moe-nvfp4", tensor_parallel_size=2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(WmtpError, match="visible CUDA devices"):
            LLM("tiny-llama", device="cuda", tensor_parallel_size=2)
    with pytest.raises(WmtpError, match="not a built model"):
        LLM(tiny_model("tiny-llama"), tensor_parallel_size=2)
    assert Ranks._live is before
