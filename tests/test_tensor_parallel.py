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
from wmtp.models.loader import init_random_, save_checkpoint
from wmtp.models.parallel import Split, quant_split
from wmtp.quant import NVFP4, FP8Block, FP8Tensor

# (preset, tiny_model's arguments, expert layout): every family, checkpoint layout and weight format;
# the second llama has one KV head (replicated over the ranks) and attention biases (o_proj's is
# added once); the quantized ones cut whole NVFP4 blocks, FP8 blocks shared by both ranks and
# Nemotron's per-tensor FP8 beside NVFP4 experts
MODELS = {
    "llama": ("tiny-llama", {}, "per_expert"),
    "llama-kv1-bias": ("tiny-llama", {"num_key_value_heads": 1, "attention_bias": True}, "per_expert"),
    "qwen3": ("tiny-qwen3", {}, "per_expert"),
    "qwen3-next": ("tiny-qwen3-next", {}, "per_expert"),
    "qwen3.5-moe": ("tiny-qwen3.5-moe", {}, "packed"),
    "nemotron-h": ("tiny-nemotron-h", {}, "per_expert"),
    "qwen3.5-moe-nvfp4": ("tiny-qwen3.5-moe-nvfp4", {}, "per_expert"),
    "qwen3-next-fp8": ("tiny-qwen3-next", {"quantize": "fp8"}, "per_expert"),
    "nemotron-h-nvfp4": ("tiny-nemotron-h-nvfp4", {}, "per_expert"),
}
PROMPTS = [[5, 9, 17, 3, 22, 41, 7, 11], [100, 200, 300, 400, 12]]
SPECS = {"dense": SpecConfig(mode="dense", num_draft_tokens=1), "native": SpecConfig(mode="native", num_draft_tokens=3),
         "windowed": SpecConfig(mode="windowed", num_draft_tokens=3, window=4, sink=2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint per model with strongly peaked logits (no near ties for a sum order to flip):
    scrambled, or, quantized, drawn with a large deviation and quantized to nearest."""
    made: dict[str, str] = {}

    def get(key: str) -> str:
        if key not in made:
            preset, overrides, layout = MODELS[key]
            model = tiny_model(preset, **overrides)
            if model.quant is None:
                scramble_(model, seed=1)
            else:
                init_random_(model, seed=1, std=0.25)
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


@pytest.mark.parametrize("key", ["llama-kv1-bias", "qwen3-next", "qwen3.5-moe", "nemotron-h", "qwen3.5-moe-nvfp4",
                                 "qwen3-next-fp8", "nemotron-h-nvfp4"])
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


@pytest.mark.parametrize("key", ["qwen3-next", "nemotron-h-nvfp4"])
def test_the_prefix_cache_resumes_alike_on_every_rank(key, checkpoint, ranks):
    """Each rank's engine keeps its own cache of its heads' pages and recurrent-state snapshots; the
    ranks see the same requests, so they resume from the same snapshot: TP = 2 with the cache emits
    TP = 1's tokens (with the cache and without) and skips as many prompt tokens."""
    doc = [(7 * i + 3) % 500 + 1 for i in range(90)]
    prompts = [doc + [11, 12], doc + [13], doc[:50] + [14, 15]]  # past the document's end, and mid-way
    for name, spec in SPECS.items():
        runs = []
        for size, cache in ((1, False), (1, True), (2, True)):
            llm = LLM(checkpoint(key), spec=spec, max_model_len=160, max_num_seqs=2, tensor_parallel_size=size,
                      prefix_cache=cache, page_size=16)
            tokens = [llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids for p in prompts]
            runs.append((tokens, llm.stats()["prefix_cache"]["hit_tokens"]))
            llm.close()
        assert runs[0][0] == runs[1][0] == runs[2][0], name
        assert runs[1][1] == runs[2][1] > 0, name


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


def test_sizes_and_devices_that_cannot_hold_the_model_are_refused_before_spawning(tmp_path):
    before = Ranks._live
    for preset, size, field in (("tiny-llama", 3, "num_attention_heads"), ("tiny-qwen3.5-moe", 4, "linear_num_key_heads"),
                                ("tiny-nemotron-h", 4, "n_groups"), ("tiny-llama", 0, "tensor_parallel_size")):
        with pytest.raises(ConfigError, match=field):
            LLM(preset, tensor_parallel_size=size)
    # shards of the inputs that would cut a scale block: 24 inputs per rank of NVFP4's 16-blocks, 192 of FP8's 128
    for name, preset, fmt, field, weight in (("nvfp4", "tiny-qwen3.5-moe", "nvfp4", "moe_intermediate_size", "experts.down_proj"),
                                             ("fp8", "tiny-llama", "fp8", "intermediate_size", "mlp.down_proj")):
        ckpt = save_checkpoint(tiny_model(preset, quantize=fmt, **{field: 48 if fmt == "nvfp4" else 384}), tmp_path / name)
        with pytest.raises(ConfigError, match=rf"{weight} is a {fmt} weight of \d+ inputs, (24|192) per rank"):
            LLM(str(ckpt), tensor_parallel_size=2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(WmtpError, match="visible CUDA devices"):
            LLM("tiny-llama", device="cuda", tensor_parallel_size=2)
    with pytest.raises(WmtpError, match="not a built model"):
        LLM(tiny_model("tiny-llama"), tensor_parallel_size=2)
    assert Ranks._live is before


@pytest.mark.parametrize("fmt,k,size", [(NVFP4(), 64, 2), (NVFP4(), 128, 4), (FP8Block((32, 32)), 128, 2),
                                        (FP8Block((64, 64)), 128, 4), (FP8Block(), 96, 2), (FP8Tensor(), 320, 4)])
def test_a_quantized_shard_dequantizes_to_the_whole_weights_slice(fmt, k, size):
    """Every rank's cut of a quantized weight's model tensors (``quant_split``: whole blocks, a block
    shared by ranks, one scale per tensor) dequantizes to its rows / columns of the whole weight."""
    n = 12
    whole = fmt.to_model(fmt.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(k))), n)
    ref = fmt.dequantize_rows(whole, torch.float32)
    for logical, dim in ((Split(1, ((k // size, size),)), 1), (Split(0, ((n // size, size),)), 0)):
        for r in range(size):
            cut = {}
            for s, t in whole.items():
                split = quant_split(fmt, s, logical, 2, "w", size)
                cut[s] = t if split is None else split.take(t, r, size)
            want = ref.narrow(dim, r * ref.shape[dim] // size, ref.shape[dim] // size)
            assert torch.equal(fmt.dequantize_rows(cut, torch.float32), want), (fmt.name, dim, r)
    scale = next(s for s in fmt.column_inputs if s != "weight")
    odd = Split(1, ((fmt.column_inputs[scale] * 3 // 2, 2),))  # one and a half blocks per rank
    if scale in fmt.uniform_columns:
        assert quant_split(fmt, scale, odd, 2, "w", 2) is not None
    else:
        with pytest.raises(ConfigError, match="would cut its blocks"):
            quant_split(fmt, scale, odd, 2, "w", 2)
