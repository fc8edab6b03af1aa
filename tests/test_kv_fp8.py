"""The fp8 e4m3 KV cache (``EngineConfig.kv_cache_dtype="fp8_e4m3"``, ``wmtp.quant``): greedy output
identical across modes at fp8 KV on both families and Nemotron-H, the pools' halved bytes, the
checkpoint's per-layer scales, and the logits it moves against the model-dtype cache. Prefix-cache
hits at fp8: tests/test_prefix_cache.py."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import tiny_model
from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.engine.config import EngineConfig
from wmtp.engine.engine import Engine
from wmtp.errors import CheckpointError, ConfigError

FP8 = "fp8_e4m3"
PROMPTS = [[5, 9, 3] * 7, [7] * 13, [11, 2] * 9, [4, 6, 8, 10] * 5]  # longer than sink + W


def _greedy(model, spec: SpecConfig, prompts, kv: str, max_tokens: int = 10) -> list[list[int]]:
    llm = LLM(model, spec=spec, max_model_len=64, max_num_seqs=len(prompts), page_size=8, prefill_chunk=16,
              kv_cache_dtype=kv)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


SPECS = [SpecConfig(mode="native", num_draft_tokens=3),
         SpecConfig(mode="windowed", num_draft_tokens=3, window=8, sink=2),
         SpecConfig(mode="windowed", num_draft_tokens=3, window=8, sink=2, ring=False),
         SpecConfig(mode="windowed", num_draft_tokens="auto", max_draft_tokens=4, window=8, sink=2)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3.5-moe", "tiny-nemotron-h"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identical_across_modes_at_fp8_kv(preset, batch):
    """The modes share one KV dtype, so speculation stays lossless at fp8: native, windowed with and
    without the ring, and adaptive depth emit dense's tokens."""
    model = tiny_model(preset)
    prompts = PROMPTS[:batch]
    dense = _greedy(model, SpecConfig(mode="dense"), prompts, FP8)
    for spec in SPECS:
        assert _greedy(model, spec, prompts, FP8) == dense, spec


def test_pools_hold_fp8_and_count_half_the_bytes():
    """Target pool, draft ring and prefix snapshots take the fp8 dtype; the memory report and
    admission count one byte per element, so a byte budget seats twice the pages."""
    model = tiny_model("tiny-qwen3.5-moe")
    spec = SpecConfig(mode="windowed", num_draft_tokens=3, window=8, sink=2)
    reports = {}
    for kv in ("auto", FP8):
        eng = Engine(model, spec, EngineConfig(max_model_len=64, max_num_seqs=2, page_size=8, prefix_cache=True,
                                               kv_memory_bytes=2**20, kv_cache_dtype=kv))
        attn = model.attention_layers()[0]
        want = torch.float8_e4m3fn if kv == FP8 else torch.float32
        assert attn.k_cache.dtype == want and model.mtp_attention_layers()[0].k_cache.dtype == want
        assert eng.memory.snapshots.draft.dtype == want
        reports[kv] = (eng.memory.target_page_bytes, eng.memory.draft_slot_bytes, eng.memory.sizes.num_pages)
        del eng
    (page32, slot32, pages32), (page8, slot8, pages8) = reports["auto"], reports[FP8]
    assert page8 * 4 == page32 and slot8 * 4 == slot32  # fp32 model: 4 bytes -> 1
    assert pages8 > 3 * pages32


def test_fp8_logits_close_to_the_model_dtype_cache(monkeypatch):
    """fp8 K / V move the logits by a bounded amount (e4m3 keeps 3 mantissa bits: ~6% of a value at
    worst), with scale 1.0 and with per-layer scales that put the layer's values in range as a
    checkpoint's would; a scale applied on one side only (the store, not the read) is far off."""
    from wmtp.bench.kv_dtype import fp8_logit_error

    model = tiny_model("tiny-llama")
    ids = [5, 9, 3, 12, 17, 2] * 4
    span = model.score(ids).abs().max().item()
    err = fp8_logit_error(model, ids)
    assert 0 < err["max_abs"] < 0.05 * span
    attn = model.attention_layers()[0]
    attn.k_scale, attn.v_scale = 0.01, 0.02
    assert 0 < fp8_logit_error(model, ids)["max_abs"] < 0.05 * span
    from wmtp.models import backend as be

    real = be.dequantize_kv
    monkeypatch.setattr(be, "dequantize_kv", lambda x, scale, dtype: real(x, 1.0, dtype))  # the read forgets it
    assert fp8_logit_error(model, ids)["max_abs"] > 0.05 * span


def test_bad_kv_cache_dtype_is_named():
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int8")


def test_unscaled_fp8_warns_once_per_engine(caplog):
    model = tiny_model("tiny-llama")
    with caplog.at_level(logging.WARNING, logger="wmtp"):
        Engine(model, SpecConfig(mode="native", num_draft_tokens=2),
               EngineConfig(max_model_len=32, max_num_seqs=1, kv_cache_dtype=FP8))
    lines = [r.getMessage() for r in caplog.records if "k_scale" in r.getMessage()]
    assert len(lines) == 1 and "2 of 2 attention layers" in lines[0] and "1.0" in lines[0]


def _checkpoint_with_scales(tmp_path, scales: dict[str, torch.Tensor]):
    from safetensors.torch import load_file, save_file

    from wmtp.models.loader import save_checkpoint

    model = tiny_model("tiny-llama")
    save_checkpoint(model, tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors.update(scales)
    save_file(tensors, shard)
    index = tmp_path / "model.safetensors.index.json"
    if index.exists():
        import json

        obj = json.loads(index.read_text())
        obj["weight_map"].update({n: shard.name for n in scales})
        index.write_text(json.dumps(obj))
    return tmp_path


def test_checkpoint_kv_scales_load_in_both_spellings(tmp_path, caplog):
    """ModelOpt's ``k_proj.k_scale`` / ``v_proj.v_scale`` on the backbone layer and ``k_scale`` /
    ``v_scale`` on the MTP layer: each lands on its layer; the engine then warns about none."""
    import wmtp

    ckpt = _checkpoint_with_scales(tmp_path, {
        "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.5]),
        "mtp.layers.0.self_attn.k_scale": torch.tensor(2.0),
        "mtp.layers.0.self_attn.v_scale": torch.tensor(4.0),
    })
    model = wmtp.load_model(str(ckpt))
    assert model.attention_layers()[0].kv_scale == (0.25, 0.5)
    assert model.mtp_attention_layers()[0].kv_scale == (2.0, 4.0)
    with caplog.at_level(logging.WARNING, logger="wmtp"):
        Engine(model, SpecConfig(mode="native", num_draft_tokens=2),
               EngineConfig(max_model_len=32, max_num_seqs=1, kv_cache_dtype=FP8))
    assert not [r for r in caplog.records if "k_scale" in r.getMessage() or "unused" in r.getMessage()]


@pytest.mark.parametrize("scales,match", [
    ({"model.layers.0.self_attn.k_scale": torch.ones(2), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     "k_scale.*shape \\[2\\].*per-layer"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     "k_scale.*> 0"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, "has a k_scale but no v_scale"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.0),
      "model.layers.0.self_attn.v_scale": torch.tensor(1.0)}, "two k_scale tensors"),
])
def test_bad_checkpoint_kv_scales_are_named(tmp_path, scales, match):
    import wmtp

    ckpt = _checkpoint_with_scales(tmp_path, scales)
    with pytest.raises(CheckpointError, match=match):
        wmtp.load_model(str(ckpt))


def test_bench_kv_logits_writes_its_rows(tmp_path):
    """``wmtp bench kv-logits``: rows per model with scales 1.0 and calibrated, rendered by the report."""
    import json

    from wmtp.analysis.report import build_report
    from wmtp.cli import main

    out = tmp_path / "res" / "kv.json"
    assert main(["bench", "kv-logits", "--models", "tiny-llama", "--tokens", "24", "--decode-steps", "4",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["scales"] for r in rows] == ["1.0", "calibrated"]
    assert all(r["tokens"] == 24 and r["decode_steps"] == 4 and 0 < r["max_abs"] < r["logit_span"] for r in rows)
    build_report(tmp_path / "res", tmp_path / "REPORT.md")
    assert "fp8 KV cache: logits" in (tmp_path / "REPORT.md").read_text()


def test_unknown_mode_option_is_named():
    from wmtp.bench.step import parse_mode
    from wmtp.errors import WmtpError

    assert parse_mode("windowed:V4096:kv-fp8") == ("windowed", 4096, FP8)
    with pytest.raises(WmtpError, match="unknown option 'kv8'"):
        parse_mode("native:kv8")
