"""benchmarks/peer/vllm_vs_wmtp.py on the host: the vLLM config it writes, the batch window, the
plan, merging, and its wmtp half end to end on a tiny preset (the vLLM half needs the GPU machine)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("vllm_vs_wmtp", ROOT / "benchmarks" / "peer" / "vllm_vs_wmtp.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_vs_wmtp"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_vllm_config_is_the_preset_shape_with_yarn_in_config_and_overrides(peer):
    from wmtp.config import ModelConfig
    from wmtp.presets import PRESETS

    preset = PRESETS["qwen3.6-35b-a3b"]
    config, overrides = peer.vllm_hf_config(peer.shape("qwen3.6-35b-a3b"))
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and config["model_type"] == "qwen3_5_moe"
    text = config["text_config"]
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "linear_num_value_heads", "head_dim", "mtp_num_hidden_layers"):
        assert text[k] == preset[k], k
    rope = text["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 262144
    assert rope["mrope_section"] == [11, 11, 10] and rope["mrope_interleaved"] is True
    # the MTP drafter reads config.json, not the dict overrides: both carry the 1M positions
    assert text["max_position_embeddings"] == overrides["text_config"]["max_position_embeddings"] == 1048576
    assert overrides["text_config"]["rope_parameters"] == rope
    assert config["vision_config"]["out_hidden_size"] == preset["hidden_size"]
    # wmtp reads the same file as the same model
    assert ModelConfig.from_dict(config).num_layers == ModelConfig.from_dict(preset).num_layers


def test_smoke_shape_keeps_the_widths(peer):
    full, small = peer.shape("qwen3.6-35b-a3b"), peer.shape("qwen3.6-35b-a3b", layers=4)
    assert small["num_hidden_layers"] == 4 and small["hidden_size"] == full["hidden_size"]
    with pytest.raises(SystemExit):
        peer.shape("tiny-qwen3")  # not a Qwen3.5-MoE shape


def test_batch_window_counts_only_the_steps_where_all_decode(peer):
    # r0 starts at t=1, r1 at t=3 (its prefill ends later); r0 finishes at t=6
    ev = [(1.0, "r0", 1, False), (2.0, "r0", 1, False), (3.0, "r0", 1, False), (3.0, "r1", 1, False),
          (4.0, "r0", 1, False), (4.0, "r1", 1, False), (5.0, "r0", 1, False), (5.0, "r1", 1, False),
          (6.0, "r0", 1, True), (6.0, "r1", 1, False), (7.0, "r1", 1, True)]
    w = peer.batch_window(ev, 2)
    assert w["window_s"] == 3.0 and w["window_steps"] == 3 and w["window_tokens"] == 6
    assert w["system_tok_s"] == 2.0 and w["per_user_tok_s"] == 1.0 and w["t_iter_s"] == 1.0 and w["al"] == 1.0
    assert peer.batch_window(ev[:4], 3)["system_tok_s"] is None  # never all three decoding


def test_plan_puts_the_longest_contexts_after_the_batch_row(peer):
    a = peer.parse_args(["--contexts", "131072,1040000,262144"])
    assert [(r["B"], r["S"]) for r in peer.plan(a)] == [(1, 131072), (1, 262144), (8, 131072), (1, 1040000)]
    assert peer.model_len(a) == 1048576
    with pytest.raises(SystemExit):
        peer.model_len(peer.parse_args(["--contexts", "1048576"]))  # + generated tokens: too long


def test_child_env_puts_the_cutedsl_packages_on_the_path_or_off_it(peer, tmp_path):
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages").mkdir(parents=True)
    env = peer.child_env({"PYTHONPATH": str(tmp_path)})
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path), str(tmp_path / "nvidia_cutlass_dsl" / "dsl_packages")]
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    off = peer.child_env({"PYTHONPATH": f"{tmp_path}:{tmp_path}/nvidia_cutlass_dsl/dsl_packages"}, no_cutedsl=True)
    assert "dsl_packages" not in off["PYTHONPATH"]


def test_wmtp_half_on_the_host_and_merging(peer, tmp_path, monkeypatch):
    """The parent starts the wmtp child, which measures every planned row; a second call's rows of
    the same cells replace the first's; --merge combines results files; the report skips the kind."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children beside other test workers: one thread each
    state = tmp_path / "state"
    base = ["--device", "cpu", "--preset", "tiny-qwen3.5-moe", "--contexts", "64,128", "--max-tokens", "4",
            "--batch", "2", "--batch-context", "32", "--batch-max-tokens", "24", "--max-model-len", "512",
            "--state", str(state), "--quiet", "--deadline", "240"]
    assert peer.main(base + ["--wmtp-modes", "dense,windowed", "--out", str(tmp_path / "a.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["kind"] == "peer" and {k for k in ("hardware", "model", "dtype", "synthetic", "runs", "command",
                                                 "date")} <= set(a["meta"])
    assert a["meta"]["commit"] == a["meta"]["engines"]["wmtp"]["modes"]["dense"]["resolved"]["commit"]
    cells = {(r["mode"], r["S"], r["B"]) for r in a["rows"]}
    assert cells == {(m, S, B) for m in ("dense", "windowed") for S, B in ((64, 1), (128, 1), (32, 2))}
    for r in a["rows"]:
        assert r["engine"] == "wmtp" and len(r["t_iter_s"]) == 1 and r["t_iter_s"][0] > 0
        assert r["al"][0] == pytest.approx(1.0, abs=0.5)  # random weights: natural acceptance
        if r["B"] == 1:
            assert r["ttft_s"][0] > 0 and r["steps"] >= 1 and r["generated"] == 4
        else:
            assert r["system_tok_s"][0] > 0 and r["window_steps"] >= 1
    dense = next(r for r in a["rows"] if r["mode"] == "dense" and r["B"] == 1)
    assert dense["al"] == [1.0] and dense["steps"] == 3  # one token per step after the first
    # a second call re-measures one cell on a synthetic context: it replaces the first's row
    assert peer.main(base + ["--wmtp-modes", "dense", "--contexts", "128", "--batch", "1", "--wmtp-synthetic-from",
                             "128", "--out", str(tmp_path / "b.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    row = next(r for r in b["rows"] if r["mode"] == "dense" and r["S"] == 128)
    assert row["synthetic"] is True and row["ttft_s"] == [None] and len(b["rows"]) == len(a["rows"])
    assert peer.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m.json"),
                      "--state", str(tmp_path / "m")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert len(m["rows"]) == len(a["rows"]) and m["meta"]["synthetic"] is True
    from wmtp.analysis.report import build_report

    build_report(tmp_path, tmp_path / "report" / "REPORT.md")
    text = (tmp_path / "report" / "REPORT.md").read_text()
    assert "## wmtp against vLLM" in text and "`m.json`" in text
