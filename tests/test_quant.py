"""The quantized weight formats (``wmtp.quant``): e2m1 codes and their packing, NVFP4 and block-FP8
round-to-nearest quantization against their reference dequantization, the checkpoint config as
the public releases spell it, and a clear error for every malformed input."""

from __future__ import annotations

import json

import pytest
import torch

from wmtp.errors import CheckpointError
from wmtp.quant import (
    E2M1_VALUES, FP8Block, FP8Tensor, NVFP4, QuantConfig, default_config, e2m1_codes, e2m1_table, pack_e2m1, unpack_e2m1,
)


def test_e2m1_codes_round_to_nearest_even_and_saturate():
    table = e2m1_table()
    assert table[:8].tolist() == list(E2M1_VALUES) and table[9:].tolist() == [-v for v in E2M1_VALUES[1:]]
    assert torch.equal(e2m1_codes(table), torch.tensor([*range(8), 0, *range(9, 16)], dtype=torch.uint8))  # -0 -> 0
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert table[e2m1_codes(ties).long()].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert table[e2m1_codes(torch.tensor([0.3, -2.9, 9.0, -100.0])).long()].tolist() == [0.5, -3.0, 6.0, -6.0]


def test_packing_puts_the_even_input_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_e2m1(packed), codes)
    every = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_e2m1(pack_e2m1(every)), every)


def test_nvfp4_dequantizes_as_the_format_says():
    """One row by hand: w = e2m1(code) * weight_scale[block] * weight_scale_2."""
    fmt = NVFP4()
    codes = torch.tensor([[7, 9] + [0] * 14 + [2, 12] + [0] * 14], dtype=torch.uint8)  # 6, -0.5 | 1, -2
    t = {"weight": pack_e2m1(codes), "weight_scale": torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn),
         "weight_scale_2": torch.tensor(0.25), "input_scale": torch.tensor(1.0)}
    fmt.check("x", t, 1, 32)
    w = fmt.dequantize(t, torch.float32)
    assert w[0, :2].tolist() == [6 * 2 * 0.25, -0.5 * 2 * 0.25] and w[0, 16:18].tolist() == [1 * 0.5 * 0.25, -2 * 0.5 * 0.25]
    assert w.abs().sum().item() == pytest.approx(3.0 + 0.25 + 0.125 + 0.25)


@pytest.mark.parametrize("shape", [(24, 64), (3, 8, 48)])  # a linear, packed experts (per-expert scale_2)
def test_nvfp4_round_to_nearest_error_bound(shape):
    """Each value within half a code step at its block's scale: the widest step (4 -> 6) is a third
    of the block's largest magnitude, and the fp8 block scale's own rounding (at most 1/16) can
    saturate the largest value by as much again: 1/6 * 17/16 + 1/16 < 0.25."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    fmt = NVFP4()
    t = fmt.quantize(w)
    fmt.check("w", t, shape[-2], shape[-1])
    got = fmt.dequantize(t, torch.float32)
    block_max = w.view(*shape[:-1], -1, 16).abs().amax(-1, keepdim=True).expand(*shape[:-1], -1, 16).reshape(shape)
    assert ((got - w).abs() <= 0.25 * block_max + 1e-7).all()
    assert (got - w).abs().mean() < 0.1 * w.abs().mean()  # ~0.085 for Gaussian weights at 4 bits
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (*shape[:-1], shape[-1] // 2)


@pytest.mark.parametrize("shape", [(300, 200), (2, 130, 260)])  # N, K not multiples of the 128 block
def test_fp8_block_round_trip(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    fmt = FP8Block()
    t = fmt.quantize(w)
    fmt.check("w", t, shape[-2], shape[-1])
    assert t["weight_scale_inv"].shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    got = fmt.dequantize(t, torch.float32)
    amax = w.abs().max()
    assert ((got - w).abs() <= w.abs() / 16 + amax / 448 * 2**-9).all()  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("shape", [(30, 200), (3, 13, 260)])  # a linear; packed experts: a scale per expert
def test_fp8_tensor_round_trip_and_layout(shape):
    """Per-tensor FP8: one scale (amax / 448) per weight, held by the model per row and 128 inputs."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    fmt = FP8Tensor()
    t = fmt.quantize(w)
    fmt.check("w", t, shape[-2], shape[-1])
    assert t["weight_scale"].shape == shape[:-2] and t["input_scale"].shape == shape[:-2]
    amax = w.abs().amax(dim=(-2, -1), keepdim=True)
    got = fmt.dequantize(t, torch.float32)
    assert ((got - w).abs() <= w.abs() / 16 + amax / 448 * 2**-9).all()  # e4m3: 3 mantissa bits
    model = fmt.to_model(t, shape[-2])
    assert model["weight_scale"].shape == (*shape[:-1], -(-shape[-1] // 128))
    assert torch.equal(fmt.dequantize_rows(model, torch.float32), got)
    back = fmt.to_checkpoint(model)
    assert torch.equal(back["weight_scale"], t["weight_scale"]) and torch.equal(back["input_scale"], t["input_scale"])
    with pytest.raises(CheckpointError, match=r"w\.weight_scale: the per-tensor scale must be one float32 value"):
        FP8Tensor().check("w", {**fmt.quantize(torch.randn(4, 8)), "weight_scale": torch.ones(4)}, 4, 8)


def test_weight_bytes_count_every_level():
    assert NVFP4().weight_bytes(2048, 512) == 2048 * 256 + 2048 * 32 + 4
    assert FP8Block().weight_bytes(300, 200) == 300 * 200 + 4 * 3 * 2
    assert FP8Tensor().weight_bytes(300, 200) == 300 * 200 + 4


def test_checks_name_the_tensor_and_what_was_expected():
    fmt = NVFP4()
    t = fmt.quantize(torch.randn(8, 32))
    for suffix in fmt.suffixes:
        with pytest.raises(CheckpointError, match=rf"lacks m\.{suffix}"):
            fmt.check("m", {k: v for k, v in t.items() if k != suffix}, 8, 32)
    with pytest.raises(CheckpointError, match=r"m\.weight_scale: the per-16-input scale must be torch.float8_e4m3fn \[8, 2\]"):
        fmt.check("m", {**t, "weight_scale": t["weight_scale"][:, :1]}, 8, 32)
    with pytest.raises(CheckpointError, match=r"m\.weight: the packed e2m1 weight must be torch.uint8"):
        fmt.check("m", {**t, "weight": t["weight"].to(torch.int8)}, 8, 32)
    with pytest.raises(CheckpointError, match=r"m\.weight_scale_2: the per-tensor scale must be one float32 value"):
        fmt.check("m", {**t, "weight_scale_2": torch.ones(2)}, 8, 32)
    with pytest.raises(CheckpointError, match="multiple of 16"):
        fmt.check("m", t, 8, 40)
    with pytest.raises(CheckpointError, match=r"NVFP4: in_features 40 of a \[8, 40\] weight must be a multiple of 16"):
        fmt.quantize(torch.randn(8, 40))
    f8 = FP8Block()
    t8 = f8.quantize(torch.randn(8, 32))
    with pytest.raises(CheckpointError, match=r"m\.weight_scale_inv: the scale per 128 x 128 block must be"):
        f8.check("m", {**t8, "weight_scale_inv": torch.ones(2, 1)}, 8, 32)
    with pytest.raises(CheckpointError, match=r"lacks m\.weight_scale_inv"):
        f8.check("m", {"weight": t8["weight"]}, 8, 32)


def _write(d, name, obj):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return d


def test_configs_as_the_releases_spell_them(tmp_path):
    hf = _write(tmp_path / "a", "hf_quant_config.json", {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}})
    q = QuantConfig.from_checkpoint(hf)
    assert isinstance(q.format, NVFP4) and q.excluded("lm_head") and q.excluded("model.layers.7.mlp.gate")
    assert not q.excluded("model.layers.7.mlp.gate_proj") and not q.excluded("model.layers.7.mlp.experts.3.up_proj")
    mo = _write(tmp_path / "b", "config.json", {"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["mtp*"]}})
    assert QuantConfig.from_checkpoint(mo).excluded("mtp.layers.0.mlp.experts.0.down_proj")
    fp8 = _write(tmp_path / "c", "config.json", {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.0.linear_attn.in_proj_ba"]}})
    q8 = QuantConfig.from_checkpoint(fp8)
    assert isinstance(q8.format, FP8Block) and q8.format.block == (128, 128)
    assert q8.excluded("model.layers.0.linear_attn.in_proj_ba") and not q8.excluded("model.layers.1.linear_attn.in_proj_ba")
    assert QuantConfig.from_checkpoint(_write(tmp_path / "d", "config.json", {"hidden_size": 8})) is None
    for name in ("nvfp4", "fp8"):  # what make-checkpoint writes reads back as the same format
        hf_obj, qc = default_config(name, ("lm_head",)).config_entries()
        d = _write(tmp_path / f"w{name}", "config.json", {"quantization_config": qc})
        if hf_obj is not None:
            _write(d, "hf_quant_config.json", hf_obj)
        back = QuantConfig.from_checkpoint(d)
        assert back.format.name == name and back.exclude == ("lm_head",)


@pytest.mark.parametrize("files,message", [
    ({"config.json": {"quantization_config": {"quant_method": "gptq", "bits": 4}}}, "quant_method 'gptq' is not supported"),
    ({"config.json": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}}},
     "quant_algo 'W4A8_AWQ' is not supported"),
    ({"config.json": {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}}, "without weight_block_size"),
    ({"config.json": {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}}},
     "fmt 'e5m2'"),
    ({"hf_quant_config.json": {"quantization": {"quant_algo": "NVFP4", "group_size": 32}}}, "one scale per 16 inputs"),
    ({"hf_quant_config.json": {"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}},
     "exclude list must be a list"),
    ({"hf_quant_config.json": {"producer": {}}}, r"no \"quantization\" object"),
    ({"hf_quant_config.json": "{not json"}, "not valid JSON"),
])
def test_malformed_configs_are_clear_errors(tmp_path, files, message):
    for name, obj in files.items():
        _write(tmp_path, name, obj)
    with pytest.raises(CheckpointError, match=message):
        QuantConfig.from_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="quantization 'int4'"):
        default_config("int4", ())
