"""The bytes floor (DESIGN §6) of Nemotron-H, against bytes counted independently on tiny-nemotron-h:
the distinct experts the counter sees are those the routed-expert op runs, and each part of
``step_bytes`` equals its count from the parameters' names and the layers' bound caches. The
quantized Qwen case is in test_quantized_model.py."""

from __future__ import annotations

import json

import pytest
import torch

import wmtp
import wmtp.kernels.torch_relu2_moe as relu2
from wmtp.bench import floor
from wmtp.bench.floor import ExpertCounter, step_bytes
from wmtp.cli import main
from wmtp.engine.config import SpecConfig
from wmtp.models.nemotron_h import LatentMoE


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run_counted(model, tokens: int, monkeypatch) -> tuple[dict[int, float], list[int]]:
    """One target forward and one MTP forward of ``tokens`` tokens under an ExpertCounter: its mean
    distinct experts per block, and the distinct experts each call of the ReLU² experts ran."""
    ran: list[int] = []
    experts = relu2.relu2_experts

    def recording(x, up, down, weights, idx):
        ran.append(int(torch.unique(idx).numel()))
        return experts(x, up, down, weights, idx)

    monkeypatch.setattr(relu2, "relu2_experts", recording)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.private_cache(1, tokens) as cache, ExpertCounter(model) as counter:
        ctx = cache.context([0], [tokens])
        model.mtp_forward(ids, model(ids, ctx), ctx)
    return counter.mean_distinct(), ran


def test_nemotron_h_floor_parts_equal_independent_counts(monkeypatch):
    """Dense bytes: the parameters outside the routed experts (the target's less the embedding
    table; the MTP head's per draft forward); experts: distinct x one expert's up + down; states
    and KV: the bound caches' and attention layers' shapes."""
    model = wmtp.load_model("tiny-nemotron-h")
    cfg, elt = model.config, model.embed_weight.element_size()
    distinct, ran = _run_counted(model, 6, monkeypatch)
    target_moe, mtp_moe = (next(m for m in part.modules() if isinstance(m, LatentMoE))
                           for part in (model.backbone, model.mtp))
    # the counter hooked relu2_moe and saw, per block in call order, what the experts ran
    assert list(distinct.values()) == ran and list(distinct) == [id(target_moe), id(mtp_moe)]
    expert = 2 * cfg.moe_intermediate_size * cfg.moe_latent_size * elt  # up [I, W] and down [W, I]
    non_expert = {n: _nbytes(p) for n, p in model.named_parameters() if ".experts." not in n}  # shared_experts stay
    # the embedding table is not read whole (only the looked-up rows)
    emb = _nbytes(model.embed_weight)
    target = sum(b for n, b in non_expert.items() if not n.startswith(("mtp.", "lm_head."))) - emb
    draft = sum(b for n, b in non_expert.items() if n.startswith("mtp."))
    with model.private_cache(1, 1):  # the states a forward reads, as bound per request
        states = sum(_nbytes(l.conv_state) + _nbytes(l.ssm_state) for l in model.recurrent_layers())
    kv = [2 * a.num_kv_heads * a.head_dim * elt for a in model.attention_layers()]
    draft_kv = [2 * a.num_kv_heads * a.head_dim * elt for a in model.mtp_attention_layers()]
    context = 100
    for mode, keys in (("native", context), ("windowed", 8 + 16)):
        spec = SpecConfig(mode=mode, num_draft_tokens=3, window=16, sink=8)
        got = step_bytes(model, spec, context, distinct, elt)
        assert got.target_dense == target and got.draft_dense == 2 * draft
        assert got.target_experts == int(ran[0] * expert) and got.draft_experts == int(2 * ran[1] * expert)
        assert got.states == states and got.target_kv == context * sum(kv)
        assert got.lm_head == 3 * _nbytes(model.lm_head.weight) and got.draft_kv == 2 * keys * sum(draft_kv)


def test_bench_step_runs_nemotron_h_on_the_host(tmp_path, monkeypatch):
    """``wmtp bench step`` without a GPU: the torch backend, the preset's dtype, the host's read
    bandwidth under the floor (a small buffer here: only that it runs is checked)."""
    monkeypatch.setattr(floor, "HOST_GIB", 1 / 256)
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--device", "cpu", "--preset", "tiny-nemotron-h", "--context", "40", "-d", "2",
            "--iters", "2", "--warmup", "1", "--modes", "windowed,windowed:kv-fp8", "--window", "16", "--sink", "4",
            "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    row, fp8 = result["rows"]
    # the fp8 KV twin: the same step with a quarter of the fp32 KV bytes, its speed-up in the summary
    assert fp8["mode"] == "windowed:kv-fp8" and fp8["bytes"]["draft_kv"] * 4 == row["bytes"]["draft_kv"]
    assert fp8["bytes"]["target_kv"] * 4 == row["bytes"]["target_kv"] > 0
    assert fp8["pool_bytes"]["target_kv"] * 4 == row["pool_bytes"]["target_kv"]
    assert result["summary"]["kv_fp8_speedup"]["windowed"] > 0
    assert result["meta"]["backend"] == "torch" and result["meta"]["dtype"] == "float32"
    assert row["floor_bytes"] == sum(v for k, v in row["bytes"].items() if k != "total") > 0
    assert row["bytes"]["draft_kv"] == (4 + 16) * 2 * 2 * 16 * 4  # γ = 1 forward over sink + W ring slots
    assert row["floor_s"] == pytest.approx(row["floor_bytes"] / result["meta"]["bandwidth"]["read_bytes_per_s"])


def test_bench_step_first_layers(tmp_path, monkeypatch):
    """``--layers N``: the preset's first N layers (tiny-nemotron-h's mamba, moe, attention of five),
    recorded in the results; the floor counts those layers' bytes: the one Mamba2 state of two, the
    attention's KV whole (the only attention layer is among them). One timed iteration (its deciles
    the time itself)."""
    monkeypatch.setattr(floor, "HOST_GIB", 1 / 256)
    rows = {}
    for layers in ([], ["--layers", "3"]):
        out = tmp_path / f"step{len(layers)}.json"
        argv = ["bench", "step", "--device", "cpu", "--preset", "tiny-nemotron-h", "--context", "40", "-d", "2",
                "--iters", "1", "--warmup", "1", "--modes", "dense", *layers, "--out", str(out)]
        assert main(argv) == 0
        result = json.loads(out.read_text())
        rows[result["meta"]["layers"]] = result["rows"][0]["bytes"]
    assert set(rows) == {None, 3}
    assert rows[3]["states"] * 2 == rows[None]["states"] > 0 and rows[3]["target_kv"] == rows[None]["target_kv"] > 0
    assert 0 < rows[3]["target_dense"] < rows[None]["target_dense"]
