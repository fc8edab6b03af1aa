"""Checkpoint loading / writing (wmtp.models.loader, wmtp.config, ``wmtp make-checkpoint``).

Every failure mode is checked on its error *message*: it must name the file, field or tensor at
fault and what was expected. Checkpoints come from the real CLI (in-process) on the tiny presets,
are written once per module and copied before a test mutates them. CPU, fp32.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import wmtp
from wmtp.cli import main as cli_main
from wmtp.config import ModelConfig
from wmtp.errors import CheckpointError, ConfigError
from wmtp.models.loader import MTP_FILE, build_model, checkpoint_state, init_random_, load_checkpoint, save_checkpoint
from wmtp.presets import PRESETS

TINY = ["tiny-qwen3-next", "tiny-qwen3.5-moe", "tiny-llama", "tiny-qwen3"]
MOE = ["tiny-qwen3-next", "tiny-qwen3.5-moe"]
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
MAIN_FILE = "model.safetensors"
SHARDED = ("--max-shard-gb", "0.0002")  # ~210 kB shards: several per tiny checkpoint
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_checkpoint(out: Path, preset: str, *args: str) -> Path:
    """Run ``wmtp make-checkpoint`` in-process; it must succeed."""
    assert cli_main(["make-checkpoint", "--preset", preset, "--out", str(out), *args]) == 0
    return out


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Any:
    """Tiny models gain nothing from intra-op threads, and on a busy CPU the thread pool's
    spin-waits made this module ~10x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``pristine(preset, *cli_args)``: a make-checkpoint output, written once per module. Read-only."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(preset: str, *args: str) -> Path:
        key = (preset, *args)
        if key not in cache:
            out = tmp_path_factory.mktemp(re.sub(r"[^\w]+", "_", "_".join(key)))
            cache[key] = make_checkpoint(out / "ckpt", preset, *args)
        return cache[key]

    return get


@pytest.fixture
def ckpt(pristine: Callable[..., Path], tmp_path: Path) -> Callable[..., Path]:
    """``ckpt(preset, *cli_args)``: a private, mutable copy of a make-checkpoint output."""

    def get(preset: str, *args: str) -> Path:
        return Path(shutil.copytree(pristine(preset, *args), tmp_path / "ckpt"))

    return get


def edit_tensors(
    file: Path, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Rewrite a safetensors file without ``drop`` and with ``put`` added/replaced; returns the original."""
    original = load_file(file)
    state = {k: v for k, v in original.items() if k not in drop}
    assert len(state) == len(original) - len(drop), f"not all of {drop} are in {file.name}"
    state.update(put or {})
    save_file(state, file, metadata={"format": "pt"})
    return original


def edit_config(ckpt_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = ckpt_dir / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def set_fields(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw.update(fields)


def random_ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


SEQS = [random_ids(n, seed) for seed, n in enumerate((80, 97, 130))]


def wmtp_logits(model: Any, seqs: list[torch.Tensor] = SEQS) -> list[torch.Tensor]:
    return [model.score(ids) for ids in seqs]


def assert_same_logits(a: Path | Any, b: Path | Any) -> None:
    """Bit-identical target logits of two checkpoints / models on the standard sequences."""
    la = wmtp_logits(wmtp.load_model(str(a)) if isinstance(a, Path) else a)
    lb = wmtp_logits(wmtp.load_model(str(b)) if isinstance(b, Path) else b)
    for x, y in zip(la, lb):
        assert torch.equal(x, y)


def assert_same_state(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------------------------
# 1 + 4: config errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, named",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, r"model_type='gpt2', architectures=\['GPT2LMHeadModel'\]"),
        ({"model_type": None, "architectures": ["GPT2LMHeadModel"]}, r"model_type=None, architectures=\['GPT2LMHeadModel'\]"),
    ],
    ids=["model_type", "architectures_only"],
)
def test_unknown_architecture(ckpt: Callable[..., Path], fields: dict[str, Any], named: str) -> None:
    d = ckpt("tiny-llama")
    edit_config(d, set_fields(**fields))
    supported = r"supported model_type: \[.*'llama'.*'qwen3'.*'qwen3_5_moe'.*'qwen3_next'.*\]"
    with pytest.raises(ConfigError, match=rf"unknown architecture \({named}\); {supported}"):
        wmtp.load_model(str(d))


def _set_rope_dynamic(raw: dict[str, Any]) -> None:
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}


def _layer_types(*types: str) -> Callable[[dict[str, Any]], None]:
    return set_fields(layer_types=list(types))


SLIDING = _layer_types("linear_attention", "full_attention", "sliding_attention", "full_attention")
UNSUPPORTED_CONFIGS = [
    pytest.param("tiny-llama", set_fields(hidden_act="gelu"), r"'hidden_act'='gelu' is not supported; supported: \['silu'\]",
                 id="hidden_act"),
    pytest.param("tiny-llama", _set_rope_dynamic,
                 r"'rope_scaling\.rope_type'='dynamic' is not supported; supported: \['default', 'linear', 'llama3', 'yarn'\]",
                 id="rope_dynamic"),
    pytest.param("tiny-qwen3-next", SLIDING,
                 r"'layer_types' has unsupported value\(s\) \['sliding_attention'\]; "
                 r"supported: \['full_attention', 'linear_attention'\]",
                 id="layer_types_hybrid"),
    pytest.param("tiny-qwen3", SLIDING,
                 r"'layer_types' has unsupported value\(s\) \['linear_attention', 'sliding_attention'\]; "
                 r"supported: \['full_attention'\]",
                 id="layer_types_dense"),
    pytest.param("tiny-qwen3.5-moe", set_fields(num_experts_per_tok=16),
                 r"'num_experts_per_tok'=16 must be in \[1, num_experts=8\]", id="top_k_gt_experts"),
]


@pytest.mark.parametrize("preset, change, message", UNSUPPORTED_CONFIGS)
def test_unsupported_config_value(ckpt: Callable[..., Path], preset: str, change, message: str) -> None:
    d = ckpt(preset)
    edit_config(d, change)
    with pytest.raises(ConfigError, match=message):
        wmtp.load_model(str(d))


# ---------------------------------------------------------------------------------------------
# 2 + 3: missing tensors, wrong shapes
# ---------------------------------------------------------------------------------------------
EXPERT_UP = "model.layers.2.mlp.experts.5.up_proj.weight"
MISSING = [
    pytest.param("tiny-llama", (), "model.layers.1.self_attn.k_proj.weight", id="llama_k_proj"),
    pytest.param("tiny-qwen3-next", (), "model.layers.1.self_attn.k_proj.weight", id="qwen3next_k_proj"),
    pytest.param("tiny-qwen3.5-moe", ("--expert-layout", "packed"), "model.layers.2.mlp.experts.gate_up_proj",
                 id="packed_experts"),
    pytest.param("tiny-qwen3.5-moe", (), EXPERT_UP, id="per_expert_up_proj"),
]


@pytest.mark.parametrize("preset, args, name", MISSING)
def test_missing_tensor(ckpt: Callable[..., Path], preset: str, args: tuple[str, ...], name: str) -> None:
    d = ckpt(preset, *args)
    edit_tensors(d / MAIN_FILE, drop=(name,))
    with pytest.raises(CheckpointError, match=rf"1 tensor\(s\) missing from the checkpoint, e\.g\. .*{re.escape(name)}"):
        wmtp.load_model(str(d))


@pytest.mark.parametrize(
    "preset, name",
    [("tiny-llama", "model.layers.1.self_attn.k_proj.weight"),
     ("tiny-qwen3.5-moe", "model.layers.3.mlp.experts.3.down_proj.weight"),
     ("tiny-qwen3-next", "model.layers.0.linear_attn.in_proj_qkvz.weight")],
)
def test_wrong_shape(ckpt: Callable[..., Path], preset: str, name: str) -> None:
    d = ckpt(preset)
    expected = list(load_file(d / MAIN_FILE)[name].shape)
    found = [expected[0], expected[1] // 2]
    edit_tensors(d / MAIN_FILE, put={name: torch.zeros(found)})
    with pytest.raises(CheckpointError, match=rf"{MAIN_FILE}: tensor '{re.escape(name)}' has shape "
                                              rf"{re.escape(str(found))}, expected {re.escape(str(expected))}"):
        wmtp.load_model(str(d))


# ---------------------------------------------------------------------------------------------
# 5: unused tensors
# ---------------------------------------------------------------------------------------------
def test_unused_tensors_warn_once(ckpt: Callable[..., Path], pristine, caplog: pytest.LogCaptureFixture) -> None:
    d = ckpt("tiny-qwen3-next")
    extra = {f"extra.block_{i}.weight": torch.ones(3, i + 1) for i in range(3)}
    edit_tensors(d / MAIN_FILE, put=extra)
    with caplog.at_level(logging.WARNING, logger="wmtp"):
        model = wmtp.load_model(str(d))
    warnings = [r for r in caplog.records if r.name == "wmtp" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert "3 unused tensor(s)" in msg
    assert all(name in msg for name in extra), msg
    assert_same_logits(model, pristine("tiny-qwen3-next"))


def test_clean_checkpoint_does_not_warn(pristine, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="wmtp"):
        wmtp.load_model(str(pristine("tiny-llama")))
    assert not [r for r in caplog.records if r.name == "wmtp" and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------------------------
# 6: missing files, bad paths, unknown presets
# ---------------------------------------------------------------------------------------------
def test_missing_config_json(ckpt: Callable[..., Path]) -> None:
    d = ckpt("tiny-llama")
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match=rf"{re.escape(str(d / 'config.json'))}: not found"):
        wmtp.load_model(str(d))


def test_missing_safetensors(ckpt: Callable[..., Path]) -> None:
    d = ckpt("tiny-qwen3-next")
    (d / MAIN_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d))}: no model\.safetensors or model\.safetensors\.index\.json"):
        wmtp.load_model(str(d))


def test_index_names_missing_shard(ckpt: Callable[..., Path]) -> None:
    d = ckpt("tiny-qwen3-next", *SHARDED)
    shards = sorted(p.name for p in d.iterdir() if SHARD_RE.match(p.name))
    (d / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE} names shard {re.escape(shards[1])}, which does not exist"):
        wmtp.load_model(str(d))


@pytest.mark.parametrize("missing", ["{tmp}/no_such_dir", "{tmp}/ckpt.d", "./not/here"])
def test_nonexistent_path(tmp_path: Path, missing: str) -> None:
    path = missing.format(tmp=tmp_path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(path)}: no such checkpoint directory \(and not a preset name\)"):
        wmtp.load_model(path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(Path(path)))}: not a checkpoint directory"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "name",
    ["tiny-gpt2", "qwen3-next-80b",
     "qwen3.7-35b-a3b"],
)
def test_unknown_preset(name: str) -> None:
    available = re.escape(str(sorted(PRESETS)))
    with pytest.raises(ConfigError, match=rf"unknown preset '{re.escape(name)}'; available: {available}"):
        wmtp.load_model(name)


# ---------------------------------------------------------------------------------------------
# 7 + 8: sharded checkpoints, expert layouts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-llama"])
def test_sharded_checkpoint(pristine, preset: str) -> None:
    whole = pristine(preset)
    sharded = pristine(preset, *SHARDED)
    shards = sorted(p.name for p in sharded.iterdir() if SHARD_RE.match(p.name))
    n = len(shards)
    assert n > 1 and not (sharded / MAIN_FILE).exists()
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    ref = load_file(whole / MAIN_FILE)
    assert index["weight_map"].keys() == ref.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    for shard in shards:
        for name, t in load_file(sharded / shard).items():
            assert index["weight_map"][name] == shard and torch.equal(t, ref[name])
    assert (sharded / MTP_FILE).exists() == (whole / MTP_FILE).exists()
    assert_same_logits(whole, sharded)


def test_save_checkpoint_max_shard_bytes(pristine, tmp_path: Path) -> None:
    model = wmtp.load_model(str(pristine("tiny-qwen3.5-moe")))
    save_checkpoint(model, tmp_path, max_shard_bytes=300_000)
    assert len([p for p in tmp_path.iterdir() if SHARD_RE.match(p.name)]) > 1
    assert_same_state(model, wmtp.load_model(str(tmp_path)))
    # rewriting unsharded into the same directory removes the stale shards and index
    save_checkpoint(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == [MAIN_FILE]
    assert_same_state(model, wmtp.load_model(str(tmp_path)))


@pytest.mark.parametrize("preset", MOE)
def test_expert_layouts_load_identically(pristine, preset: str) -> None:
    per_expert, packed = pristine(preset), pristine(preset, "--expert-layout", "packed")
    per_names, packed_names = load_file(per_expert / MAIN_FILE).keys(), load_file(packed / MAIN_FILE).keys()
    assert any(re.search(r"\.experts\.\d+\.up_proj\.weight$", k) for k in per_names)
    assert not any(k.endswith("experts.gate_up_proj") for k in per_names)
    assert any(k.endswith("experts.gate_up_proj") for k in packed_names)
    assert not any(re.search(r"\.experts\.\d+\.", k) for k in packed_names)
    a, b = wmtp.load_model(str(per_expert)), wmtp.load_model(str(packed))
    assert_same_state(a, b)
    assert_same_state(a, wmtp.load_model(preset, seed=0))
    assert_same_logits(a, b)


def test_checkpoint_state_rejects_unknown_layout() -> None:
    with pytest.raises(ValueError, match=r"expert_layout='stacked'; supported: \['packed', 'per_expert'\]"):
        checkpoint_state(wmtp.load_model("tiny-qwen3-next"), "stacked")


# ---------------------------------------------------------------------------------------------
# 9: make-checkpoint output in transformers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", TINY)
def test_make_checkpoint_loads_in_transformers(pristine, preset: str) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    d = pristine(preset)
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == PRESETS[preset]["architectures"]
    assert config["model_type"] == PRESETS[preset]["model_type"]

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    text = "The draft proposes 4 tokens; the target checks them in one pass."
    enc = tok.encode(text)
    assert 0 < len(enc.ids) < len(text) and max(enc.ids) < config["vocab_size"]
    assert tok.decode(enc.ids) == text
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tok_config["eos_token"]) is not None

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == config["architectures"][0]
    assert {k: v for k, v in info.items() if v} == {}, info
    ours = wmtp.load_model(str(d))
    for ids, logits in zip(SEQS, wmtp_logits(ours)):
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        assert logits.shape == ref.shape == (len(ids), config["vocab_size"])
        assert (logits - ref).abs().max().item() <= 1e-4


def test_llama_mtp_head_is_written_beside_the_checkpoint(pristine) -> None:
    d = pristine("tiny-llama")
    config = json.loads((d / "config.json").read_text())
    assert "num_nextn_predict_layers" not in config and "mtp_num_hidden_layers" not in config
    assert not [k for k in load_file(d / MAIN_FILE) if k.startswith("mtp.")]
    assert load_file(d / MTP_FILE) and all(k.startswith("mtp.layers.0.") for k in load_file(d / MTP_FILE))
    model = wmtp.load_model(str(d))
    assert model.mtp is not None and model.config.num_nextn_predict_layers == 1


# ---------------------------------------------------------------------------------------------
# 10: attaching an MTP head
# ---------------------------------------------------------------------------------------------
def test_attach_mtp_head(ckpt: Callable[..., Path], tmp_path: Path) -> None:
    d = ckpt("tiny-llama")
    head = shutil.move(d / MTP_FILE, tmp_path / MTP_FILE)
    bare = wmtp.load_model(str(d))
    assert bare.mtp is None and bare.config.num_nextn_predict_layers == 0
    assert not [k for k in bare.state_dict() if k.startswith("mtp.")]

    shutil.copy(head, d / MTP_FILE)
    with_head = wmtp.load_model(str(d))
    assert with_head.mtp is not None and with_head.config.num_nextn_predict_layers == 1
    written, state = load_file(head), checkpoint_state(with_head)  # under checkpoint names (q/k/v apart)
    assert {k for k in state if k.startswith("mtp.")} == written.keys()
    for name, t in written.items():
        assert torch.equal(state[name], t), name
    assert_same_logits(bare, with_head)  # the head does not touch the target


# ---------------------------------------------------------------------------------------------
# 11: dtypes
# ---------------------------------------------------------------------------------------------
def test_load_bfloat16(pristine) -> None:
    d = pristine("tiny-qwen3-next")
    model = wmtp.load_model(str(d), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = wmtp_logits(wmtp.load_model(str(d)))
    for logits, r in zip(wmtp_logits(model), ref):
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
        assert (logits - r).abs().max().item() < 0.05 * r.abs().max().item()


@pytest.mark.parametrize("source", ["checkpoint", "preset"])
def test_unsupported_dtype(pristine, source: str) -> None:
    target = str(pristine("tiny-llama")) if source == "checkpoint" else "tiny-llama"
    with pytest.raises(ConfigError, match=r"dtype 'int8' is not supported; supported: \[.*'bfloat16'.*'float32'.*\]"):
        wmtp.load_model(target, dtype="int8")


# ---------------------------------------------------------------------------------------------
# 12: random init
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", TINY)
def test_random_init_is_seeded(preset: str) -> None:
    a, b, c = (wmtp.load_model(preset, seed=s) for s in (7, 7, 8))
    assert_same_state(a, b)
    sa, sc = a.state_dict(), c.state_dict()
    random_params = [k for k, v in sa.items() if v.ndim >= 2]
    assert random_params and all(not torch.equal(sa[k], sc[k]) for k in random_params)


@pytest.mark.parametrize("preset", TINY)
def test_random_init_activations_finite(preset: str) -> None:
    model = wmtp.load_model(preset, seed=3)
    assert model.config.num_layers == 4
    outputs: list[torch.Tensor] = []
    # a block returns (h, residual), its output being their sum (the add is deferred into the next norm)
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out[0] + out[1])) for layer in model.model.layers]
    try:
        logits = model.score(random_ids(200, seed=5))
    finally:
        for h in hooks:
            h.remove()
    assert len(outputs) == 4
    for out in outputs:
        assert torch.isfinite(out).all() and out.std() > 0
    assert logits.shape == (200, model.config.vocab_size) and torch.isfinite(logits).all() and logits.std() > 0


def test_init_random_on_built_model_matches_preset() -> None:
    cfg = ModelConfig.from_dict(json.loads(json.dumps(PRESETS["tiny-qwen3.5-moe"])))
    model = init_random_(build_model(cfg, "cpu", torch.float32), seed=4)
    assert_same_state(model, wmtp.load_model("tiny-qwen3.5-moe", seed=4))


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe-nvfp4", "tiny-nemotron-h-nvfp4"])
def test_random_quantized_experts_in_runs_equal_one_pass(preset, monkeypatch) -> None:
    """A preset's random quantized experts quantized one expert a pass (runs of QUANT_INIT_ELEMENTS)
    hold the tensors one pass over all experts gives: the scales are per expert."""
    import wmtp.models.loader as loader

    whole = wmtp.load_model(preset, seed=3)
    monkeypatch.setattr(loader, "QUANT_INIT_ELEMENTS", 1)
    assert any(g.experts and g.experts > 1 for g in loader.quant_groups(whole))
    assert_same_state(wmtp.load_model(preset, seed=3), whole)
