"""A pruned draft vocabulary (``SpecConfig.draft_vocab``, ``engine.draft_vocab``): drafts come from
V′ only, greedy output stays the dense output (tokens outside V′ included) for both families in
every mode, batch 1 and 4, eager and static iterations; the rank file and its command; the floor
reads the pruned head. The sampled case (exact acceptance with q on V′) is in test_spec_exact."""

from __future__ import annotations

import json

import pytest
import torch

import wmtp
from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.cli import main
from wmtp.engine.draft_vocab import count_tokens, load_ids, rank
from wmtp.engine.engine import Engine
from wmtp.errors import WmtpError
from tests.helpers import tiny_model

V_PRIME = list(range(0, 512, 8))  # 64 of the 512 tokens


def _run(model, spec: SpecConfig, prompts, batch: int, max_tokens: int = 12, **kw) -> list[list[int]]:
    llm = LLM(model, spec=spec, max_model_len=96, max_num_seqs=batch, page_size=8, prefill_chunk=32, **kw)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_pruned_drafts_keep_greedy_output(preset, monkeypatch):
    """Every draft is a token of V′ (the head's argmax over V′), the output equals dense though
    most of the dense output's tokens lie outside V′, in native / windowed (ring on, off, and the
    window only past a context), batch 1 and 4."""
    model = tiny_model(preset)
    prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((4, 19, 33, 9))]
    dense = _run(model, SpecConfig(mode="dense", num_draft_tokens=1), prompts, 4)
    outside = sum(t not in V_PRIME for out in dense for t in out)
    assert outside > len(dense) * 6, "the check needs dense tokens outside V′"
    drafted = []
    sample_draft = Engine._sample_draft

    def spy(self, req, logits, pos):
        tok, q = sample_draft(self, req, logits, pos)
        drafted.append(tok)
        return tok, q

    monkeypatch.setattr(Engine, "_sample_draft", spy)
    configs = [("native", True, {}), ("windowed", True, {}), ("windowed", False, {}),
               ("windowed", False, {"window_min_context": 20})]  # the window only past 20 tokens
    for mode, ring, extra in configs:
        for batch in (1, 4):
            spec = SpecConfig(mode=mode, num_draft_tokens=4, window=8, sink=2, ring=ring, draft_vocab=tuple(V_PRIME),
                              **extra)
            assert _run(model, spec, prompts, batch) == dense, f"{preset} {mode} ring={ring} {extra} batch {batch}"
    assert drafted and set(drafted) <= set(V_PRIME)


@pytest.mark.whole_tiles
def test_pruned_drafts_on_the_static_iteration():
    """The static-buffer iteration (what CUDA graphs replay) with a pruned head: dense's output."""
    pytest.importorskip("triton")
    model = tiny_model("tiny-llama", backend="triton")
    prompts = [[3, 9, 27, 81, 243], [7] * 11]
    dense = _run(model, SpecConfig(mode="dense", num_draft_tokens=1), prompts, 2, max_tokens=6)
    spec = SpecConfig(mode="windowed", num_draft_tokens=3, window=8, sink=2, draft_vocab=tuple(V_PRIME))
    llm = LLM(model, spec=spec, max_model_len=96, max_num_seqs=2, page_size=8, prefill_chunk=32,
              decode_graphs="eager")
    out = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert llm.engine.graphs and out == dense


def test_draft_logits_are_the_head_rows_elsewhere_minus_infinity():
    model = tiny_model("tiny-llama")
    head = model.draft_head(V_PRIME)
    assert head.weight.shape == (64, model.config.hidden_size) and head.weight.is_contiguous()
    h = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full, pruned = model.draft_logits(h), model.draft_logits(h, head)
    assert torch.equal(pruned[:, V_PRIME], full[:, V_PRIME])
    others = [t for t in range(model.config.vocab_size) if t not in V_PRIME]
    assert torch.isneginf(pruned[:, others]).all()


def test_rank_file_round_trip_and_errors(tmp_path):
    counts = count_tokens([[5, 5, 7, 2, 7, 5], [9]])
    assert rank(counts) == ([5, 7, 2, 9], [3, 2, 1, 1])  # ties: the lower id first
    assert rank(counts, 2) == ([5, 7], [3, 2])
    out = tmp_path / "v.json"
    assert main(["draft-vocab", "--preset", "tiny-llama", "--generate", "3", "--max-tokens", "16", "--size", "20",
                 "--out", str(out)]) == 0
    obj = json.loads(out.read_text())
    assert len(obj["ids"]) <= 20 and obj["tokens_counted"] == 48 and obj["source"]["generated"]["prompts"] == 3
    assert obj["counts"] == sorted(obj["counts"], reverse=True)
    assert load_ids(str(out), 2, 512) == obj["ids"][:2] and load_ids(str(out), None, 512) == obj["ids"]
    spec = SpecConfig(mode="windowed", draft_vocab=str(out), draft_vocab_size=2)
    assert spec.draft_vocab_ids(512) == obj["ids"][:2]
    with pytest.raises(WmtpError, match="draft_vocab_size=99 exceeds the"):
        load_ids(str(out), 99, 512)  # (a random tiny model repeats a few tokens: fewer than 99 ranked)
    with pytest.raises(WmtpError, match=r"ints in \[0, 512\)"):
        load_ids((3, 600), None, 512)
    with pytest.raises(WmtpError, match="ids repeat"):
        load_ids((3, 3), None, 512)
    assert hash(SpecConfig(mode="windowed", draft_vocab=[4, 5])) == hash(SpecConfig(mode="windowed", draft_vocab=(4, 5)))
    with pytest.raises(WmtpError, match="mode 'dense' has no draft"):
        SpecConfig(mode="dense", num_draft_tokens=1, draft_vocab=(1, 2))
    with pytest.raises(WmtpError, match="beside a draft_vocab"):
        SpecConfig(mode="windowed", draft_vocab_size=4)
    with pytest.raises(WmtpError, match="cannot read the rank file"):
        LLM(wmtp.load_model("tiny-llama"), spec=SpecConfig(mode="windowed", draft_vocab=str(tmp_path / "none.json")))


def test_corpus_ranking(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat " * 20)
    out = tmp_path / "v.json"
    assert main(["draft-vocab", "--preset", "tiny-llama", "--corpus", str(corpus), "--size", "8", "--out", str(out)]) == 0
    obj = json.loads(out.read_text())
    assert obj["source"]["corpus"] == [str(corpus)] and len(obj["ids"]) <= 8 and obj["tokens_counted"] > 0


def test_floor_reads_the_pruned_head():
    from wmtp.bench.floor import step_bytes

    model = tiny_model("tiny-llama")
    full = SpecConfig(mode="windowed", num_draft_tokens=4, window=8, sink=2)
    pruned = SpecConfig(mode="windowed", num_draft_tokens=4, window=8, sink=2, draft_vocab=tuple(V_PRIME))
    LLM(model, spec=full, max_model_len=64, max_num_seqs=1)  # binds the pools the floor reads
    a, b = step_bytes(model, full, 64, {}, 4), step_bytes(model, pruned, 64, {}, 4)
    row = model.config.hidden_size * 4  # fp32 weights
    assert a.lm_head - b.lm_head == full.gamma * (model.config.vocab_size - len(V_PRIME)) * row
