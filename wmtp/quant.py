"""Quantized weight formats (DESIGN §9): the public checkpoint formats, read, checked, written and
dequantized here and nowhere else (the loader, the writer, the kernels' wrappers and the bytes floor
all use this module).

**NVFP4** (NVIDIA ModelOpt, ``quant_algo: NVFP4``), per quantized linear ``<name>``:

- ``<name>.weight`` uint8 [N, K / 2]: two e2m1 codes per byte, input 2j in the low nibble, 2j + 1 in
  the high one (code: sign bit 3, then the magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6);
- ``<name>.weight_scale`` float8_e4m3fn [N, K / 16]: one scale per 16 inputs;
- ``<name>.weight_scale_2`` float32 scalar: the second, per-tensor level;
- ``<name>.input_scale`` float32 scalar: the activations' scale of W4A4 paths; a weight-only path
  never uses it, but it is loaded and checked like the rest.

``w[n, k] = e2m1(code[n, k]) * weight_scale[n, k // 16] * weight_scale_2``.

**Block FP8** (``quant_method: fp8`` with ``weight_block_size: [128, 128]``, as in Qwen's ``-FP8``
releases; ModelOpt's ``FP8_PB_WO`` spells the same tensors):

- ``<name>.weight`` float8_e4m3fn [N, K];
- ``<name>.weight_scale_inv`` float32 [ceil(N / 128), ceil(K / 128)].

``w[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]``.

The config is read from ``hf_quant_config.json`` (``{"quantization": {"quant_algo", "group_size",
"exclude_modules"}}``) or from config.json's ``quantization_config`` (``quant_method`` "modelopt"
with ``quant_algo`` and ``ignore`` / ``exclude_modules``, or "fp8" with ``weight_block_size`` and
``modules_to_not_convert``). Modules on the exclude list (fnmatch patterns over module names) stay
in the checkpoint's dtype. Anything else (another method or algorithm, a missing or misshapen scale)
is a ``CheckpointError`` naming the file, field or tensor: never a silent fallback to 16 bits.

**KV cache** (``EngineConfig.kv_cache_dtype``): ``auto`` keeps K / V in the model's dtype;
``fp8_e4m3`` stores ``clamp(x * (1 / scale), ±448)`` rounded to float8_e4m3fn and reads ``code * scale``,
one (k_scale, v_scale) pair per attention layer: the checkpoint's (ModelOpt writes
``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale``, newer exports ``<attn>.k_scale``), else 1.0.
The target pool, the draft pool, the draft ring and the prefix snapshots all take that dtype.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from wmtp.errors import CheckpointError

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: magnitudes of the e2m1 codes 0..7 (code 8..15: the same, negative)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

Tensors = dict[str, torch.Tensor]  # suffix ("weight", "weight_scale", ...) -> tensor


# ---- e2m1 codes ---------------------------------------------------------------------------------


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 code values [16] float32 (codes 8..15 are the negatives of 0..7; code 8 is -0), made on
    ``device`` from the bit fields (no host copy, so CUDA-graph capture may call it):
    e = code >> 1 & 3, m = code & 1 -> 0.5 m (e = 0) or 2^(e-1) (1 + m/2)."""
    c = torch.arange(8, device=device)
    e, m = (c >> 1).float(), (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))
    return torch.cat([mag, -mag])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest e2m1 codes [same shape] uint8 of ``x`` (already divided by its scales;
    saturating at ±6). Ties go to the even magnitude index, as IEEE rounding does."""
    mag = x.abs().clamp(max=E2M1_MAX)
    # midpoints between consecutive magnitudes; at a tie the lower (even) index wins where it is even
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device, dtype=mag.dtype)
    idx = torch.bucketize(mag, mids, right=False)  # mag <= mid -> lower index
    tie_up = torch.isin(mag, mids) & (idx % 2 == 1)  # a tie whose lower index is odd rounds up to even
    idx = idx + tie_up.to(idx.dtype)
    return (idx + 8 * (x < 0).to(idx.dtype)).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K / 2] bytes, input 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dim {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] bytes -> [..., K] codes (the inverse of ``pack_e2m1``)."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ---- formats ------------------------------------------------------------------------------------


class QuantFormat(ABC):
    """One weight format: the tensors a quantized linear has in a checkpoint (``suffixes``), their
    checks, round-to-nearest quantization (random-weight checkpoints), the reference dequantization
    (the twin every kernel is tested against) and the bytes a GEMV reads (the floor, DESIGN §6).
    Weights are [N, K] or, for packed experts, [E, N, K]: leading dims ride along."""

    name: str
    suffixes: tuple[str, ...]

    @abstractmethod
    def check(self, name: str, t: Tensors, n: int, k: int) -> None:
        """Raise ``CheckpointError`` naming ``name.<suffix>`` and what was expected unless ``t`` holds a
        well-formed [.., n, k] weight."""

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> Tensors:
        """Round-to-nearest quantization of ``w`` [..., N, K] (any float dtype)."""

    row_vectors: tuple[str, ...] = ()  # model-layout tensors with one value per row ([.., N])
    #: inputs per column of every other model-layout tensor ([.., N, cols]: the weight, the scales);
    #: a tensor-parallel shard of the inputs takes whole columns of each (``wmtp.models.parallel``)
    column_inputs: dict[str, int]
    k_multiple: int = 1  # in_features (a shard's too) must be a multiple of this
    uniform_columns: tuple[str, ...] = ()  # tensors whose columns all hold one value (per-tensor scales)

    def dequantize(self, t: Tensors, dtype: torch.dtype) -> torch.Tensor:
        """A checkpoint weight [..., N, K] in ``dtype`` (computed in fp32, one rounding to ``dtype``)."""
        return self.dequantize_rows(self.to_model(t, t["weight"].shape[-2]), dtype)

    @abstractmethod
    def dequantize_rows(self, t: Tensors, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize`` of the model's per-row layout: the reference every kernel is tested against."""

    @abstractmethod
    def weight_bytes(self, n: int, k: int) -> int:
        """Bytes of one [n, k] weight a kernel must read: the packed weight and every scale level."""

    @abstractmethod
    def model_shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The model's tensors of an [n, k] weight (``QuantWeight``): per row, so the rows of packed
        projections (q / k / v parts) and of experts concatenate: suffix -> (shape, dtype)."""

    @abstractmethod
    def to_model(self, t: Tensors, n: int) -> Tensors:
        """A checkpoint's tensors of one [.., n, k] weight in the model's per-row layout."""

    @abstractmethod
    def to_checkpoint(self, t: Tensors) -> Tensors:
        """The inverse of ``to_model`` for one checkpoint weight's rows (their shared scales are equal
        across the rows by construction)."""

    def _require(self, name: str, t: Tensors) -> None:
        missing = [s for s in self.suffixes if s not in t]
        if missing:
            raise CheckpointError(f"{name}: {self.name} weight lacks {', '.join(f'{name}.{s}' for s in missing)}")


def _expect(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise CheckpointError(f"{name}: {what} must be {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")


def _scalar(name: str, tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype != torch.float32 or tensor.numel() != 1 or tensor.dim() > 1:
        raise CheckpointError(f"{name}: {what} must be one float32 value, got {tensor.dtype} {list(tensor.shape)}")


class NVFP4(QuantFormat):
    name = "nvfp4"
    suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    row_vectors = ("weight_scale_2", "input_scale")
    column_inputs = {"weight": 2, "weight_scale": 16}
    k_multiple = 16

    def __init__(self, group_size: int = 16) -> None:
        if group_size != 16:
            raise CheckpointError(f"NVFP4: group_size {group_size}; the format has one scale per 16 inputs")
        self.group = group_size

    def check(self, name: str, t: Tensors, n: int, k: int) -> None:
        self._require(name, t)
        if k % self.group:
            raise CheckpointError(f"{name}: NVFP4 needs in_features ({k}) to be a multiple of {self.group}")
        lead = tuple(t["weight"].shape[:-2])
        _expect(f"{name}.weight", t["weight"], torch.uint8, (*lead, n, k // 2), "the packed e2m1 weight")
        _expect(f"{name}.weight_scale", t["weight_scale"], torch.float8_e4m3fn, (*lead, n, k // self.group),
                "the per-16-input scale")
        for s in ("weight_scale_2", "input_scale"):
            x = t[s]
            if lead and x.numel() == math.prod(lead):  # packed experts: one value per expert
                continue
            _scalar(f"{name}.{s}", x, "the per-tensor scale" if s == "weight_scale_2" else "the input scale")

    def quantize(self, w: torch.Tensor) -> Tensors:
        *lead, n, k = w.shape
        if k % self.group:
            raise CheckpointError(f"NVFP4: in_features {k} of a {list(w.shape)} weight must be a multiple of {self.group}")
        w32 = w.float()
        amax = w32.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12)  # per tensor (per expert)
        scale_2 = amax / (E2M1_MAX * E4M3_MAX)
        blocks = w32.view(*lead, n, k // self.group, self.group)
        block_scale = (blocks.abs().amax(-1) / E2M1_MAX / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        denom = block_scale.float()[..., None] * scale_2[..., None]
        codes = e2m1_codes(torch.where(denom > 0, blocks / denom, 0.0)).view(*lead, n, k)
        shape = tuple(lead) if lead else ()
        return {"weight": pack_e2m1(codes), "weight_scale": block_scale, "weight_scale_2": scale_2.reshape(shape),
                "input_scale": torch.ones(shape, device=w.device)}

    def weight_bytes(self, n: int, k: int) -> int:
        return n * k // 2 + n * (k // self.group) + 4

    def model_shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((n, k // 2), torch.uint8), "weight_scale": ((n, k // self.group), torch.float8_e4m3fn),
                "weight_scale_2": ((n,), torch.float32), "input_scale": ((n,), torch.float32)}

    def to_model(self, t: Tensors, n: int) -> Tensors:
        lead = tuple(t["weight"].shape[:-2])
        per_row = {s: t[s].float().reshape(*lead, 1).expand(*lead, n).contiguous() for s in ("weight_scale_2", "input_scale")}
        return {"weight": t["weight"], "weight_scale": t["weight_scale"], **per_row}

    def to_checkpoint(self, t: Tensors) -> Tensors:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"],
                **{s: t[s][..., 0].clone() for s in ("weight_scale_2", "input_scale")}}

    def dequantize_rows(self, t: Tensors, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_e2m1(t["weight"])
        vals = e2m1_table(codes.device)[codes.long()]
        scale = t["weight_scale"].float().repeat_interleave(self.group, dim=-1)
        return (vals * scale * t["weight_scale_2"].float()[..., None]).to(dtype)


class FP8Block(QuantFormat):
    name = "fp8"
    suffixes = ("weight", "weight_scale_inv")

    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        if len(block) != 2 or min(block) < 1:
            raise CheckpointError(f"FP8: weight_block_size {list(block)} must be two positive ints")
        self.block = tuple(int(b) for b in block)
        self.column_inputs = {"weight": 1, "weight_scale_inv": self.block[1]}

    def _grid(self, n: int, k: int) -> tuple[int, int]:
        return -(-n // self.block[0]), -(-k // self.block[1])

    def check(self, name: str, t: Tensors, n: int, k: int) -> None:
        self._require(name, t)
        lead = tuple(t["weight"].shape[:-2])
        _expect(f"{name}.weight", t["weight"], torch.float8_e4m3fn, (*lead, n, k), "the fp8 weight")
        _expect(f"{name}.weight_scale_inv", t["weight_scale_inv"], torch.float32, (*lead, *self._grid(n, k)),
                f"the scale per {self.block[0]} x {self.block[1]} block")

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N, K] -> [..., N, K] of the block index grid's values broadcast (padding cut off)."""
        bn, bk = self.block
        return x.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)

    def quantize(self, w: torch.Tensor) -> Tensors:
        *lead, n, k = w.shape
        gn, gk = self._grid(n, k)
        bn, bk = self.block
        pad = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
        amax = pad.view(*lead, gn, bn, gk, bk).abs().amax(dim=(-3, -1)).clamp(min=1e-12)
        scale_inv = amax / E4M3_MAX
        q = (w.float() / self._blocks(scale_inv)[..., :n, :k]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale_inv}

    def weight_bytes(self, n: int, k: int) -> int:
        gn, gk = self._grid(n, k)
        return n * k + 4 * gn * gk

    def model_shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        # the block scales repeated over each block's rows (4 bytes per 128 weights beside the
        # checkpoint's 4 per 128 x 128): parts of any size then pack along N
        return {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale_inv": ((n, self._grid(n, k)[1]), torch.float32)}

    def to_model(self, t: Tensors, n: int) -> Tensors:
        rows = t["weight_scale_inv"].float().repeat_interleave(self.block[0], dim=-2)[..., :n, :]
        return {"weight": t["weight"], "weight_scale_inv": rows.contiguous()}

    def to_checkpoint(self, t: Tensors) -> Tensors:
        return {"weight": t["weight"], "weight_scale_inv": t["weight_scale_inv"][..., :: self.block[0], :].contiguous()}

    def dequantize_rows(self, t: Tensors, dtype: torch.dtype) -> torch.Tensor:
        w = t["weight"]
        scale = t["weight_scale_inv"].float().repeat_interleave(self.block[1], dim=-1)[..., : w.shape[-1]]
        return (w.float() * scale).to(dtype)


class FP8Tensor(QuantFormat):
    """ModelOpt's per-tensor FP8 (``quant_algo: FP8``): an fp8-e4m3 weight [N, K], one float32
    ``weight_scale`` and the ``input_scale`` (W8A8's; unused by a weight-only path, loaded and
    checked). The model holds the scale per row and 128 inputs, the block-FP8 layout, so one kernel
    reads both formats."""

    name = "fp8_tensor"
    suffixes = ("weight", "weight_scale", "input_scale")
    row_vectors = ("input_scale",)
    k_block = 128  # the model layout's scale columns (FP8Block's)
    column_inputs = {"weight": 1, "weight_scale": k_block}
    uniform_columns = ("weight_scale",)

    def check(self, name: str, t: Tensors, n: int, k: int) -> None:
        self._require(name, t)
        lead = tuple(t["weight"].shape[:-2])
        _expect(f"{name}.weight", t["weight"], torch.float8_e4m3fn, (*lead, n, k), "the fp8 weight")
        for s in ("weight_scale", "input_scale"):
            if not (lead and t[s].numel() == math.prod(lead)):  # packed experts: one value per expert
                _scalar(f"{name}.{s}", t[s], "the per-tensor scale" if s == "weight_scale" else "the input scale")

    def quantize(self, w: torch.Tensor) -> Tensors:
        *lead, n, k = w.shape
        scale = w.float().abs().amax(dim=(-2, -1)).clamp(min=1e-12) / E4M3_MAX  # per tensor (per expert)
        q = (w.float() / scale[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.reshape(tuple(lead)), "input_scale": torch.ones(tuple(lead), device=w.device)}

    def weight_bytes(self, n: int, k: int) -> int:
        return n * k + 4

    def model_shapes(self, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": ((n, -(-k // self.k_block)), torch.float32),
                "input_scale": ((n,), torch.float32)}

    def to_model(self, t: Tensors, n: int) -> Tensors:
        lead, k = tuple(t["weight"].shape[:-2]), t["weight"].shape[-1]
        cols = -(-k // self.k_block)
        scale = t["weight_scale"].float().reshape(*lead, 1, 1).expand(*lead, n, cols).contiguous()
        return {"weight": t["weight"], "weight_scale": scale,
                "input_scale": t["input_scale"].float().reshape(*lead, 1).expand(*lead, n).contiguous()}

    def to_checkpoint(self, t: Tensors) -> Tensors:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"][..., 0, 0].clone(),
                "input_scale": t["input_scale"][..., 0].clone()}

    def dequantize_rows(self, t: Tensors, dtype: torch.dtype) -> torch.Tensor:
        w = t["weight"]
        scale = t["weight_scale"].float().repeat_interleave(self.k_block, dim=-1)[..., : w.shape[-1]]
        return (w.float() * scale).to(dtype)


# ---- a quantized weight in the model ------------------------------------------------------------


@dataclass(frozen=True)
class QuantWeight:
    """A quantized weight as the model holds it and hands it to the backend (where a plain weight
    tensor would go): the format and its per-row tensors (``QuantFormat.model_shapes``) of a
    [N, K] weight, or of [E, N, K] experts. Rows slice and experts index like a tensor's."""

    format: QuantFormat
    tensors: Tensors
    in_features: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.tensors["weight"].shape[:-1], self.in_features)

    @property
    def device(self) -> torch.device:
        return self.tensors["weight"].device

    def rows(self, rows: slice) -> "QuantWeight":
        vec = self.format.row_vectors
        return QuantWeight(self.format, {s: t[..., rows] if s in vec else t[..., rows, :] for s, t in self.tensors.items()},
                           self.in_features)

    def __getitem__(self, expert: int) -> "QuantWeight":
        return QuantWeight(self.format, {s: t[expert] for s, t in self.tensors.items()}, self.in_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The reference: the weight [.., N, K] in ``dtype``."""
        return self.format.dequantize_rows(self.tensors, dtype)


def dense(w: "torch.Tensor | QuantWeight", dtype: torch.dtype) -> torch.Tensor:
    """A weight as a plain tensor: itself, or a quantized one dequantized (the reference path)."""
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w


# ---- the checkpoint's quantization config --------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight formats: one ``format`` for every linear and expert but the modules it
    leaves unquantized (``exclude``: fnmatch patterns over module names as the checkpoint spells
    them, e.g. ``lm_head``, ``model.layers.*.mlp.gate``); or, ModelOpt's ``MIXED_PRECISION``
    (``format`` None), a format per module (``layers``: name or pattern -> format), every module
    not named unquantized."""

    format: QuantFormat | None
    exclude: tuple[str, ...] = ()
    source: str = ""  # the file and field it was read from, for error messages
    layers: tuple[tuple[str, QuantFormat], ...] = ()

    @property
    def name(self) -> str:
        """The format's name, or ``mixed`` with the formats it mixes (``mixed_fp8_tensor+nvfp4``)."""
        if self.format is not None:
            return self.format.name
        return "mixed_" + "+".join(sorted({f.name for _, f in self.layers}))

    def excluded(self, module: str) -> bool:
        """Whether ``module`` (``model.layers.3.mlp.gate``) stays in the checkpoint's dtype."""
        return self.format_of(module) is None

    def format_of(self, module: str) -> QuantFormat | None:
        """``module``'s format (None: it stays in the checkpoint's dtype)."""
        if self.format is not None:
            hit = any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in self.exclude)
            return None if hit else self.format
        exact, patterns = self._layer_index
        if module in exact:
            return exact[module]
        return next((f for p, f in patterns if fnmatch.fnmatchcase(module, p)), None)

    @functools.cached_property
    def _layer_index(self) -> tuple[dict[str, QuantFormat], list[tuple[str, QuantFormat]]]:
        # a release names every module (tens of thousands, experts one by one): exact names by lookup
        exact = {p: f for p, f in self.layers if not any(c in p for c in "*?[")}
        return exact, [(p, f) for p, f in self.layers if p not in exact]

    @classmethod
    def from_checkpoint(cls, ckpt: str | Path) -> "QuantConfig | None":
        """The checkpoint's config (None: not quantized). hf_quant_config.json wins over config.json."""
        ckpt = Path(ckpt)
        hf = ckpt / "hf_quant_config.json"
        if hf.exists():
            obj = _read_json(hf)
            q = obj.get("quantization")
            if not isinstance(q, dict):
                raise CheckpointError(f"{hf}: no \"quantization\" object")
            return cls._modelopt(q, f"{hf}: quantization", q.get("exclude_modules"))
        cfg = ckpt / "config.json"
        q = _read_json(cfg).get("quantization_config") if cfg.exists() else None
        return None if q is None else cls.from_config_dict(q, f"{cfg}: quantization_config")

    @classmethod
    def from_config_dict(cls, q: dict, where: str = "quantization_config") -> "QuantConfig":
        """config.json's ``quantization_config`` (also what a quantized preset carries)."""
        if not isinstance(q, dict):
            raise CheckpointError(f"{where} must be an object")
        method = q.get("quant_method")
        if method == "modelopt":
            return cls._modelopt(q, where, q.get("ignore", q.get("exclude_modules")))
        if method == "fp8":
            block = q.get("weight_block_size")
            if block is None:
                raise CheckpointError(f"{where}: quant_method fp8 without weight_block_size (per-tensor FP8 is read "
                                      "from ModelOpt's quant_algo FP8; this spelling is block-scaled only)")
            if q.get("fmt", "e4m3") != "e4m3":
                raise CheckpointError(f"{where}: fmt {q.get('fmt')!r}; only e4m3 is supported")
            return cls(FP8Block(tuple(block)), _patterns(q.get("modules_to_not_convert"), where), where)
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported (supported: modelopt NVFP4 / FP8 / "
                              "FP8_PB_WO / MIXED_PRECISION, fp8 with weight_block_size)")

    @classmethod
    def _modelopt(cls, q: dict, where: str, exclude) -> "QuantConfig":
        if q.get("quant_algo") == "MIXED_PRECISION":
            layers = q.get("quantized_layers")
            if not isinstance(layers, dict) or not layers:
                raise CheckpointError(f"{where}: quant_algo MIXED_PRECISION without a quantized_layers object")
            formats: dict[str, QuantFormat] = {}  # one format object per spelling
            out = []
            for name, entry in layers.items():
                if not isinstance(entry, dict):
                    raise CheckpointError(f"{where}: quantized_layers[{name!r}] must be an object, got {entry!r}")
                key = json.dumps(entry, sort_keys=True)
                if key not in formats:
                    formats[key] = _modelopt_format(entry, f"{where}: quantized_layers[{name!r}]")
                out.append((name, formats[key]))
            return cls(None, _patterns(exclude, where), where, tuple(out))
        return cls(_modelopt_format(q, where), _patterns(exclude, where), where)

    def config_entries(self) -> tuple[dict | None, dict]:
        """What a checkpoint of this format carries: (hf_quant_config.json or None, config.json's
        ``quantization_config``), spelled as the public releases spell them."""
        if self.format is None:
            layers = {p: _modelopt_entry(f) for p, f in self.layers}
            q = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
            return ({"producer": {"name": "modelopt"}, "quantization": q},
                    {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
        if not isinstance(self.format, FP8Block):
            q = {**_modelopt_entry(self.format), "kv_cache_quant_algo": None, "exclude_modules": list(self.exclude)}
            return ({"producer": {"name": "modelopt"}, "quantization": q},
                    {"quant_method": "modelopt", **_modelopt_entry(self.format), "ignore": list(self.exclude)})
        return None, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": list(self.format.block), "modules_to_not_convert": list(self.exclude)}


def _modelopt_format(q: dict, where: str) -> QuantFormat:
    """The format of one ModelOpt ``quant_algo`` entry."""
    algo = q.get("quant_algo")
    if algo == "NVFP4":
        return NVFP4(int(q.get("group_size", 16)))
    if algo == "FP8":
        return FP8Tensor()
    if isinstance(algo, str) and algo.upper() == "FP8_PB_WO":
        return FP8Block(tuple(q.get("block_size", q.get("weight_block_size", [128, 128]))))
    raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported (supported: NVFP4, FP8, FP8_PB_WO, "
                          "MIXED_PRECISION)")


def _modelopt_entry(fmt: QuantFormat) -> dict:
    """``_modelopt_format``'s inverse: how ModelOpt spells ``fmt``."""
    if isinstance(fmt, NVFP4):
        return {"quant_algo": "NVFP4", "group_size": fmt.group}
    if isinstance(fmt, FP8Tensor):
        return {"quant_algo": "FP8"}
    return {"quant_algo": "FP8_PB_WO", "block_size": list(fmt.block)}


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return obj


def _patterns(exclude, where: str) -> tuple[str, ...]:
    if exclude is None:
        return ()
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise CheckpointError(f"{where}: the exclude list must be a list of module-name patterns, got {exclude!r}")
    return tuple(exclude)


FORMATS = {"nvfp4": lambda: NVFP4(), "fp8": lambda: FP8Block()}
#: what random-weight checkpoints and presets leave unquantized: the lm_head, the embedding and the
#: routers / shared-expert gates (the public releases' lists name these; wmtp never quantizes norms,
#: the GDN conv, A or dt, which are no linears)
DEFAULT_EXCLUDE = ("lm_head", "*embed_tokens", "*.mlp.gate", "*.mlp.shared_expert_gate")


#: the Nemotron-3-Super NVFP4 release's formats by module kind (its ``quantized_layers`` names each
#: module of the backbone; these patterns give every module of a kind that kind's format): routed
#: experts NVFP4; the Mamba2 in / out projections, the shared experts, the latent projections and the
#: attention output FP8 per tensor; the rest (attention q / k / v, routers, conv, embeddings,
#: lm_head, the MTP layers) in the checkpoint's 16 bits
NEMOTRON_SUPER_LAYERS = (
    ("backbone.layers.*.mixer.experts.*", "nvfp4"),
    *((f"backbone.layers.*.mixer.{m}", "fp8_tensor") for m in (
        "in_proj", "out_proj", "o_proj", "fc1_latent_proj", "fc2_latent_proj", "shared_experts.*")),
)
LAYER_FORMATS = {"nvfp4": NVFP4, "fp8": FP8Block, "fp8_tensor": FP8Tensor}


def mixed_config(layers: tuple[tuple[str, str], ...], source: str) -> QuantConfig:
    """A MIXED_PRECISION config from (module pattern, format name) pairs."""
    return QuantConfig(None, (), source, tuple((p, LAYER_FORMATS[f]()) for p, f in layers))


def default_config(name: str, exclude: tuple[str, ...]) -> QuantConfig:
    """The format ``name`` (``nvfp4`` | ``fp8``) with the public releases' defaults."""
    if name not in FORMATS:
        raise CheckpointError(f"quantization {name!r}; supported: {sorted(FORMATS)}")
    return QuantConfig(FORMATS[name](), tuple(exclude), f"--quantize {name}")


# ---- the KV cache's format ------------------------------------------------------------------------

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of K / V pools for ``EngineConfig.kv_cache_dtype`` ``name``."""
    if name == "auto":
        return model_dtype
    if name == "fp8_e4m3":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype {name!r}; supported: {', '.join(KV_CACHE_DTYPES)}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: cast to ``dtype``, or for fp8 times ``1 / scale`` (one fp32
    multiply, as the kernels do it), saturated at ±448 (a plain cast turns overflow into NaN) and
    rounded to nearest even."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``x`` as values of ``dtype`` (``code * scale`` for fp8)."""
    return x.to(dtype) * scale if is_fp8(x.dtype) else x.to(dtype)


def bytewise(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8, for indexing and copies (CUDA's index kernels lack fp8; the
    bytes are the values); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


#: how checkpoints spell an attention layer's KV scales, after the attention module's name
KV_SCALE_NAMES = {"k": ("k_scale", "k_proj.k_scale", "attn.k_scale"), "v": ("v_scale", "v_proj.v_scale", "attn.v_scale")}


def kv_scale_value(name: str, t: torch.Tensor) -> float:
    """A checkpoint's per-layer KV scale as a float; anything but one finite positive value (a
    per-head or per-token scale, 0, NaN) is a CheckpointError naming the tensor."""
    if t.numel() != 1:
        raise CheckpointError(f"tensor {name!r}: KV scale of shape {list(t.shape)}; only per-layer scalars are supported")
    v = float(t.float().reshape(()))
    if not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"tensor {name!r}: KV scale {v} must be finite and > 0")
    return v
