"""Quantized checkpoints end to end (DESIGN §9): ``make-checkpoint --quantize`` writes the tensors
and config files the public NVFP4 / FP8 releases have and reloads to identical tensors; a quantized
model's logits equal those of the same model with its checkpoint dequantized by an independent
implementation (numpy, below); greedy output is identical across modes; every malformed checkpoint
is an error naming the tensor or field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import wmtp
from wmtp import LLM, SamplingParams, SpecConfig
from wmtp.cli import main
from wmtp.errors import CheckpointError, ConfigError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRESETS = ["tiny-qwen3.5-moe", "tiny-llama"]  # hybrid GDN-MoE (MoE, GDN, gated attention), dense Llama + DeepSeek head


def _make(tmp_path, preset: str, fmt: str | None):
    """A random checkpoint of ``preset`` quantized to ``fmt`` (None: the preset's own config)."""
    out = tmp_path / f"{preset}-{fmt}"
    assert main(["make-checkpoint", "--preset", preset, *(["--quantize", fmt] if fmt else []), "--out", str(out)]) == 0
    return out


def _tensors(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("preset", PRESETS)
def test_quantized_checkpoint_as_the_releases_write_it_and_back(tmp_path, preset, fmt):
    ckpt = _make(tmp_path, preset, fmt)
    t = _tensors(ckpt)
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    if fmt == "nvfp4":
        assert config["quant_method"] == "modelopt" and config["quant_algo"] == "NVFP4"
        assert json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
        q = "model.layers.0.mlp.down_proj" if preset == "tiny-llama" else "model.layers.0.mlp.experts.1.down_proj"
        assert t[f"{q}.weight"].dtype == torch.uint8 and t[f"{q}.weight_scale"].dtype == torch.float8_e4m3fn
        assert t[f"{q}.weight_scale_2"].shape == () and t[f"{q}.input_scale"].shape == ()
    else:
        assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
        q = "model.layers.0.self_attn.o_proj" if preset == "tiny-llama" else "model.layers.3.self_attn.o_proj"
        assert t[f"{q}.weight"].dtype == torch.float8_e4m3fn and t[f"{q}.weight_scale_inv"].dtype == torch.float32
    assert t["lm_head.weight" if "lm_head.weight" in t else "model.embed_tokens.weight"].dtype == torch.float32
    again = tmp_path / "again"
    model = wmtp.load_model(str(ckpt))
    from wmtp.models.loader import save_checkpoint

    save_checkpoint(model, again)
    t2 = _tensors(again)
    assert t.keys() == t2.keys() and all(_same(t[k], t2[k]) for k in t)


def _e2m1(codes: np.ndarray) -> np.ndarray:
    mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
    return np.where(codes >= 8, -1.0, 1.0) * mag[codes & 7]


def _dequantized(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's quantized weights (each in the format its tensors spell) as fp32 tensors
    under the plain names, in numpy."""
    out = {k: v for k, v in t.items() if not k.endswith(("weight_scale", "weight_scale_2", "input_scale",
                                                         "weight_scale_inv"))}
    for k in list(out):
        base = k[: -len(".weight")]
        if f"{base}.weight_scale_2" in t:  # NVFP4
            b = t[k].numpy()
            codes = np.empty((b.shape[0], 2 * b.shape[1]), dtype=np.int64)
            codes[:, 0::2], codes[:, 1::2] = b & 0x0F, b >> 4  # input 2j in the low nibble
            scale = np.repeat(t[f"{base}.weight_scale"].float().numpy().astype(np.float64), 16, axis=1)
            w = _e2m1(codes) * scale * float(t[f"{base}.weight_scale_2"])
            out[k] = torch.from_numpy(w).float()
        elif f"{base}.weight_scale_inv" in t:  # block FP8
            w = t[k].float().numpy().astype(np.float64)
            s = t[f"{base}.weight_scale_inv"].numpy().astype(np.float64)
            full = np.kron(s, np.ones((128, 128)))[: w.shape[0], : w.shape[1]]
            out[k] = torch.from_numpy(w * full).float()
        elif f"{base}.weight_scale" in t:  # per-tensor FP8
            out[k] = torch.from_numpy(t[k].float().numpy().astype(np.float64) * float(t[f"{base}.weight_scale"])).float()
    return out


@pytest.mark.parametrize("preset,fmt", [(p, f) for p in PRESETS for f in ("nvfp4", "fp8")]
                         + [("tiny-nemotron-h-nvfp4", None)])  # the release's mixed NVFP4 / FP8 / 16 bits
def test_logits_equal_the_independently_dequantized_model(tmp_path, preset, fmt):
    ckpt = _make(tmp_path, preset, fmt)
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in ckpt.iterdir():
        if f.suffix == ".json" and f.name != "hf_quant_config.json":
            obj = json.loads(f.read_text())
            obj.pop("quantization_config", None)
            (dense / f.name).write_text(json.dumps(obj))
    t = _tensors(ckpt)
    mtp = {k: v for k, v in t.items() if k.startswith("mtp.")} if (ckpt / "mtp.safetensors").exists() else {}
    deq = _dequantized(t)
    save_file({k: v.contiguous() for k, v in deq.items() if k not in mtp}, dense / "model.safetensors")
    if mtp:
        save_file({k: v.contiguous() for k, v in deq.items() if k in mtp}, dense / "mtp.safetensors")
    q, ref = wmtp.load_model(str(ckpt)), wmtp.load_model(str(dense))
    assert ref.quant is None and q.quant is not None
    ids = [5, 17, 3, 99, 250, 7, 7, 31, 64, 2]
    assert (q.score(ids) - ref.score(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("preset,fmt", [("tiny-qwen3.5-moe", "nvfp4"), ("tiny-qwen3.5-moe", "fp8"),
                                        ("tiny-nemotron-h-nvfp4", None)])
def test_greedy_identical_across_modes_quantized(preset, fmt):
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 23, 40))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = {}
    for mode, ring in (("dense", True), ("native", True), ("windowed", True), ("windowed", False)):
        spec = SpecConfig(mode=mode, num_draft_tokens=1 if mode == "dense" else 4, window=8, sink=2, ring=ring)
        llm = LLM(wmtp.load_model(preset, quantize=fmt), spec=spec, max_model_len=64, max_num_seqs=3,
                  page_size=8, prefill_chunk=16)
        outs[(mode, ring)] = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(v == outs[("dense", True)] for v in outs.values())


def test_malformed_quantized_checkpoints_name_the_problem(tmp_path):
    ckpt = _make(tmp_path, "tiny-llama", "nvfp4")
    t = _tensors(ckpt)
    name = "model.layers.0.self_attn.o_proj"

    def broken(edit) -> str:
        d = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        for f in ckpt.iterdir():
            if f.suffix == ".json":
                (d / f.name).write_text(f.read_text())
        with safe_open(ckpt / "mtp.safetensors", "pt") as h:
            save_file({k: h.get_tensor(k) for k in h.keys()}, d / "mtp.safetensors")
        tt = dict(t)
        edit(tt)
        save_file({k: v for k, v in tt.items() if not k.startswith("mtp.")}, d / "model.safetensors")
        return str(d)

    with pytest.raises(CheckpointError, match=rf"missing from the checkpoint, e.g. \['{name}.weight_scale'\]"):
        wmtp.load_model(broken(lambda tt: tt.pop(f"{name}.weight_scale")))
    with pytest.raises(CheckpointError, match=rf"{name}.weight_scale: the per-16-input scale must be"):
        wmtp.load_model(broken(lambda tt: tt.update({f"{name}.weight_scale": tt[f"{name}.weight_scale"][:, :1].contiguous()})))
    with pytest.raises(CheckpointError, match=rf"{name}.weight_scale_2: the per-tensor scale must be one float32"):
        wmtp.load_model(broken(lambda tt: tt.update({f"{name}.weight_scale_2": torch.ones(3)})))
    cfg = json.loads((ckpt / "config.json").read_text())
    d = broken(lambda tt: None)
    (tmp_path / d / "hf_quant_config.json").unlink()
    (tmp_path / d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported"):
        wmtp.load_model(d)
    (tmp_path / d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["*self_attn.k_proj"]}}))
    with pytest.raises(ConfigError, match=r"gives the projections under model\.layers\.\d+\.self_attn, which wmtp runs "
                       r"as one packed GEMM, different formats \(\{'q_proj': 'nvfp4', 'k_proj': None, 'v_proj': 'nvfp4'\}\)"):
        wmtp.load_model(d)
    with pytest.raises(CheckpointError, match="a checkpoint carries its own format"):
        wmtp.load_model(str(ckpt), quantize="fp8")


def test_bytes_floor_counts_the_format_not_the_models_copies():
    """The floor's weights (DESIGN §6): a quantized weight as its format stores it (packed values,
    block scales, the per-tensor scale), per expert for routed experts; float weights whole."""
    from wmtp.bench.floor import _Weights, step_bytes
    from wmtp.quant import NVFP4

    fmt, model = NVFP4(), wmtp.load_model("tiny-qwen3.5-moe", quantize="nvfp4")
    cfg, w = model.config, _Weights(model)
    moe = model.model.layers[0].mlp
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    assert w.expert(moe) == 2 * fmt.weight_bytes(i, h) + fmt.weight_bytes(h, i)
    qkv = model.model.layers[3].self_attn.qkv_proj
    assert w.dense(qkv.parameters()) == sum(fmt.weight_bytes(n, h) for n in qkv.parts.values())
    norm = model.model.layers[3].input_layernorm.weight
    assert w.dense([norm]) == norm.numel() * norm.element_size()
    dense = wmtp.load_model("tiny-qwen3.5-moe")
    spec = SpecConfig(mode="native", num_draft_tokens=4)
    for m in (model, dense):  # the engine binds the pools whose states the floor counts
        LLM(m, spec=spec, max_model_len=128, max_num_seqs=1)
    experts = {id(m): 2.0 for mm in (model, dense) for m in mm.modules() if hasattr(m, "experts")}
    q_bytes, f_bytes = step_bytes(model, spec, 64, experts, 4), step_bytes(dense, spec, 64, experts, 4)
    assert q_bytes.target_kv == f_bytes.target_kv and q_bytes.lm_head == f_bytes.lm_head  # unquantized parts
    assert q_bytes.target_dense < f_bytes.target_dense / 4 and q_bytes.draft_dense < f_bytes.draft_dense / 4


def test_mixed_checkpoint_as_the_release_writes_it_and_back(tmp_path):
    """The Nemotron-3-Super NVFP4 release's layout (``MIXED_PRECISION``): routed experts NVFP4 per
    expert, the Mamba2 and shared-expert projections per-tensor FP8 (weight, weight_scale,
    input_scale), attention q / k / v in 16 bits; written back bit for bit."""
    ckpt = _make(tmp_path, "tiny-nemotron-h-nvfp4", None)
    hf = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "MIXED_PRECISION"
    assert hf["quantized_layers"]["backbone.layers.*.mixer.in_proj"] == {"quant_algo": "FP8"}
    t = _tensors(ckpt)
    e = "backbone.layers.1.mixer.experts.3.up_proj"
    assert t[f"{e}.weight"].dtype == torch.uint8 and t[f"{e}.weight_scale"].dtype == torch.float8_e4m3fn
    assert t[f"{e}.weight_scale_2"].shape == ()
    for m in ("backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.shared_experts.down_proj"):
        assert t[f"{m}.weight"].dtype == torch.float8_e4m3fn
        assert t[f"{m}.weight_scale"].shape == () and t[f"{m}.input_scale"].shape == ()
    assert t["backbone.layers.2.mixer.q_proj.weight"].dtype == torch.float32
    assert t["mtp.layers.1.mixer.experts.0.up_proj.weight"].dtype == torch.float32  # the MTP layers stay
    model = wmtp.load_model(str(ckpt))
    assert model.quant.name == "mixed_fp8_tensor+nvfp4"
    from wmtp.models.loader import save_checkpoint

    save_checkpoint(model, tmp_path / "again")
    t2 = _tensors(tmp_path / "again")
    assert t.keys() == t2.keys() and all(_same(t[k], t2[k]) for k in t)


def test_mixed_configs_name_the_layer():
    from wmtp.quant import QuantConfig

    with pytest.raises(CheckpointError, match="quant_algo MIXED_PRECISION without a quantized_layers object"):
        QuantConfig.from_config_dict({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"})
    with pytest.raises(CheckpointError, match=r"quantized_layers\['model.layers.0.mlp.up_proj'\]: quant_algo 'INT4'"):
        QuantConfig.from_config_dict({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                      "quantized_layers": {"model.layers.0.mlp.up_proj": {"quant_algo": "INT4"}}})
    q = QuantConfig.from_config_dict({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.mlp.up_proj": {"quant_algo": "FP8"}, "model.layers.*.mlp.down_proj": {"quant_algo": "NVFP4"}}})
    assert q.format_of("model.layers.0.mlp.up_proj").name == "fp8_tensor" and q.excluded("model.layers.1.mlp.up_proj")
    assert q.format_of("model.layers.5.mlp.down_proj").name == "nvfp4"


def test_quantized_presets_carry_the_release_config(tmp_path):
    """``*-nvfp4`` / ``*-fp8`` presets: the base shape with the releases' quantization config, quantized
    random weights made directly (make-checkpoint writes them without --quantize)."""
    from wmtp.presets import PRESETS as ALL

    for name in ("qwen3.6-35b-a3b-nvfp4", "qwen3.5-122b-a10b-nvfp4", "qwen3.6-35b-a3b-fp8"):
        base = name.rsplit("-", 1)[0]
        assert {k: v for k, v in ALL[name].items() if k != "quantization_config"} == ALL[base]
    assert ALL["qwen3.6-35b-a3b-fp8"]["quantization_config"]["weight_block_size"] == [128, 128]
    out = tmp_path / "p"
    assert main(["make-checkpoint", "--preset", "tiny-qwen3.5-moe-nvfp4", "--out", str(out)]) == 0
    assert wmtp.load_model(str(out)).quant.format.name == "nvfp4"


@pytest.mark.whole_tiles
@pytest.mark.parametrize("preset,fmt", [("tiny-qwen3.5-moe", "nvfp4"), ("tiny-qwen3.5-moe", "fp8"),
                                        ("tiny-nemotron-h-nvfp4", None)])
def test_triton_backend_emits_the_twins_tokens(preset, fmt, monkeypatch):
    """The Triton backend's quantized linears and experts (``skinny_linear``, ``moe_gemv`` /
    ``relu2_moe_gemv``; the mixed NVFP4 / FP8 Nemotron-H as well) in
    the whole engine, the static decode iteration the CUDA graphs replay included (prefill, draft,
    verify, extend): the torch backend's greedy tokens."""
    import wmtp.kernels.linear as ql
    import wmtp.kernels.moe as qm
    from tests.helpers import tiny_model

    from wmtp.quant import QuantWeight

    calls = {"linear": 0, "moe": 0}

    def spy(name, fn, arg):  # counts the calls whose weight (positional ``arg``) is quantized
        return lambda *a, **k: calls.__setitem__(name, calls[name] + isinstance(a[arg], QuantWeight)) or fn(*a, **k)

    monkeypatch.setattr(ql, "skinny_linear", spy("linear", ql.skinny_linear, 1))
    monkeypatch.setattr(qm, "moe_gemv", spy("moe", qm.moe_gemv, 2))
    monkeypatch.setattr(qm, "relu2_moe_gemv", spy("moe", qm.relu2_moe_gemv, 3))
    spec = SpecConfig(mode="windowed", num_draft_tokens=3, window=8, sink=2)
    prompts = [[5, 9, 3] * 5, [7] * 12]
    outs = []
    for backend, graphs in (("torch", "off"), ("triton", "eager")):
        llm = LLM(tiny_model(preset, DEVICE, backend=backend, quantize=fmt), spec=spec, max_model_len=48,
                  max_num_seqs=2, prefill_chunk=16, decode_graphs=graphs)
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))])
        if backend == "triton":
            assert llm.engine.graphs, "the static decode iteration did not run"
    assert outs[0] == outs[1] and calls["linear"] and calls["moe"], calls



@pytest.mark.parametrize("preset,fmt", [("tiny-qwen3.5-moe", "nvfp4"), ("tiny-qwen3.5-moe", "fp8"),
                                        ("tiny-nemotron-h-nvfp4", None)])
def test_grouped_moe_over_quantized_experts_matches_the_twin(preset, fmt, monkeypatch):
    """A prefill chunk of more (token, expert) pairs than the GEMVs take runs the Triton backend's
    grouped GEMMs over the quantized experts (SwiGLU MoE, Nemotron-H's latent ReLU² MoE), dequantized
    in one pass for torch's grouped GEMM. The MoE block's output equals the torch backend's (the
    grouped GEMM takes bf16 on the GPU; on the CPU it is taken in fp32, the Triton kernels
    interpreted)."""
    import wmtp.kernels.moe as qm
    from tests.helpers import close_to_twin, tiny_model
    from wmtp.models.layers import SparseMoE
    from wmtp.models.nemotron_h import LatentMoE
    from wmtp.quant import QuantWeight

    calls = []
    grouped_mm = qm._grouped_mm
    monkeypatch.setattr(qm, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    if DEVICE == "cpu":
        monkeypatch.setattr(qm, "grouped_mm_supported", lambda x: True)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    outs = []
    for backend in ("torch", "triton"):
        model = tiny_model(preset, DEVICE, backend=backend, quantize=fmt, dtype=dtype)
        moe = next(m for m in model.modules() if isinstance(m, (SparseMoE, LatentMoE)))
        x = torch.randn(135, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
        if backend == "triton":  # the reference's dequantization (PyTorch ops) is the twin's alone
            monkeypatch.setattr(QuantWeight, "dequantize", lambda *a: pytest.fail("reference dequantize called"))
        with torch.no_grad():  # 135 tokens: 270 pairs at top-2, more than MAX_GEMV_PAIRS
            outs.append(moe(x))
    assert close_to_twin(outs[1], outs[0]) and calls
