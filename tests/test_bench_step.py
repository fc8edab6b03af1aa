"""``wmtp bench step``'s host-side parts: its options' checks (and ``ttft``'s), the ``--kernels``
shape, and admission's record of what a released engine left alive."""

from __future__ import annotations

import argparse

import pytest
import torch

import wmtp
from wmtp.bench.step import kernel_shape, largest_tensors
from wmtp.cli import main
from wmtp.errors import WmtpError
from wmtp.presets import preset_config


def _args(heads=None, kv_heads=None, head_dim=None) -> argparse.Namespace:
    return argparse.Namespace(heads=heads, kv_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("bench,given,named", [
    ("step", ["--iters", "0"], "--iters=0"), ("step", ["--context", "0"], "--context=0"),
    ("step", ["--warmup", "-1"], "--warmup=-1"), ("step", ["--max-admit", "0"], "--max-admit=0"),
    ("step", ["--page-size", "0"], "--page-size=0"), ("step", ["-d", "0"], "num_draft_tokens (d)=0"),
    ("step", ["--modes", "dense,weird"], "mode='weird'"), ("step", ["--modes", "windowed:kv-fp9"], "kv-fp9"),
    ("step", ["--modes", ","], "--modes=','"), ("ttft", ["--chunk", "0"], "--chunk=0"),
    ("ttft", ["--repeat-suffix", "64"], "--repeat-suffix=64 must be in [1, 63]"),
    ("step", ["--layers", "0"], "layers=0: the model has 4 layers"), ("ttft", ["--layers", "5"], "layers=5")])
def test_bad_options_are_named_before_the_model_loads(bench, given, named, tmp_path, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(wmtp, "load_model", no_load)
    out = tmp_path / "x.json"
    size = ["--context", "64"] if bench == "step" else ["--tokens", "64"]
    assert main(["bench", bench, "--preset", "tiny-qwen3-next", "--device", "cpu", *size, *given, "--out", str(out)]) == 2
    assert named in capsys.readouterr().err and not out.exists()


def test_kernel_shape_is_the_models_unless_given():
    cfg = preset_config("nemotron-3-super-120b-a12b")
    assert kernel_shape(_args(), cfg) == (32, 2, 128)
    assert kernel_shape(_args(heads=16, head_dim=256), cfg) == (16, 2, 256)


@pytest.mark.parametrize("given, match", [(dict(heads=0), "--heads=0 must be at least 1"),
                                          (dict(kv_heads=-2, head_dim=0), "--kv-heads=-2, --head-dim=0"),
                                          (dict(heads=12, kv_heads=8), "12 query heads are not a multiple of 8")])
def test_bad_kernel_shapes_are_named(given, match):
    with pytest.raises(WmtpError, match=match):
        kernel_shape(_args(**given), preset_config("qwen3.6-35b-a3b"))


def test_largest_tensors_names_what_is_still_reachable():
    """``bench step --admission``'s record of what an engine left alive: each storage once, at its
    base's shape (a view keeps the base reachable); gone once nothing holds it."""
    size = 3 * 2 * 4096 * 8 * 4
    pool = torch.zeros(3, 2, 4096, 8)
    views = [pool[0, 1], pool.view(-1)[:10]]
    del pool
    found = [e for e in largest_tensors(torch.device("cpu"), most=10_000) if e["bytes"] == size]
    assert found == [{"bytes": size, "shape": [3, 2, 4096, 8], "dtype": "torch.float32"}]
    del views
    assert not [e for e in largest_tensors(torch.device("cpu"), most=10_000) if e["bytes"] == size]


def test_layers_applies_to_presets_only(tmp_path, capsys, monkeypatch):
    """``--layers`` on a checkpoint directory: named before anything loads; ``load_model`` refuses it too."""
    monkeypatch.setattr(wmtp, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    argv = ["bench", "step", "--preset", str(ckpt), "--device", "cpu", "--layers", "2", "--out", str(tmp_path / "x.json")]
    assert main(argv) == 2
    assert "--layers=2 applies to presets" in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(WmtpError, match="layers=2 applies to presets"):
        wmtp.load_model(str(ckpt), layers=2)


def test_first_layers_keeps_the_pattern_and_each_layers_shape():
    """A shortened preset: its first N layer kinds (the raw config's pattern with them), the rest of
    its shape as the whole model's; out-of-range counts are named."""
    whole = preset_config("tiny-nemotron-h")
    short = whole.first_layers(3)
    assert short.layer_types == whole.layer_types[:3] == ["mamba", "moe", "full_attention"]
    assert short.num_layers == 3 and short.raw["num_hidden_layers"] == 3
    assert short.raw["layers_block_type"] == whole.raw["layers_block_type"][:3]
    super_ = preset_config("nemotron-3-super-120b-a12b").first_layers(44)  # the legacy pattern string
    assert super_.raw["hybrid_override_pattern"] == "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEME"
    assert super_.layer_types.count("full_attention") == 4
    assert (short.mamba, short.num_experts, short.mtp_layer_types) == (whole.mamba, whole.num_experts, whole.mtp_layer_types)
    model = wmtp.load_model("tiny-nemotron-h", layers=3)
    assert len(model.backbone.layers) == 3 and model.config.layer_types == short.layer_types
    for n in (0, 6):
        with pytest.raises(WmtpError, match=f"layers={n}: the model has 5 layers"):
            whole.first_layers(n)
