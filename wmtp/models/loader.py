"""Build models: from HF checkpoints (memory-mapped safetensors, single or sharded), or with random
weights created directly on the target device; and write checkpoints in exact HF layout.

Checkpoint spellings handled here and nowhere else:
- Qwen3.5 ``Qwen3_5MoeForConditionalGeneration`` keeps the LM under ``model.language_model.``;
- routed experts stored per expert (``experts.{e}.gate_proj/up_proj/down_proj``, or up / down for
  ungated ones) or packed (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]);
  wmtp holds them packed (``layers.Experts.parts`` maps the two);
- projections of one input (q/k/v_proj, GDN in_proj_*) are stored apart; wmtp packs each group
  into one ``PackedLinear`` (one GEMM) and the writer splits it back;
- an MTP head may live in a separate ``mtp.safetensors`` next to a checkpoint that never had one;
- an attention layer's fp8 KV scales are ``<attn>.k_scale`` / ``<attn>.v_scale``, or ModelOpt's
  ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` (``quant.KV_SCALE_NAMES``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path

import torch
from wmtp.config import ModelConfig
from wmtp.errors import CheckpointError, ConfigError
from wmtp.models.base import TargetLM
from wmtp.models.layers import Attention, Experts, GatedDeltaNet, Linear, PackedLinear, RMSNorm
from wmtp.models.model import CausalLM
from wmtp.models.nemotron_h import Mamba2Mixer, NemotronHCausalLM
from wmtp.models.parallel import Split, TPGroup, param_splits, shard_, shard_config
from wmtp.quant import KV_SCALE_NAMES, QuantConfig, QuantFormat, kv_scale_value

log = logging.getLogger("wmtp")

MTP_FILE = "mtp.safetensors"
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype | None, default: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    key = dtype or default
    if key not in DTYPES:
        raise ConfigError(f"dtype {key!r} is not supported; supported: {sorted(DTYPES)}")
    return DTYPES[key]


def lm_prefix(cfg: ModelConfig) -> str:
    """Where the language model's ``model.*`` tensors live in the checkpoint."""
    return "model.language_model." if cfg.model_type == "qwen3_5_moe" else "model."


def _model_class(cfg: ModelConfig) -> type:
    """The model class of ``cfg``'s family (Nemotron-H's blocks are their own module)."""
    if cfg.family == "mamba_hybrid":
        return NemotronHCausalLM
    return CausalLM


def build_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype, backend: str = "torch",
                quant: QuantConfig | None = None, tp: TPGroup | None = None) -> TargetLM:
    """Allocate an uninitialised model directly on ``device`` in ``dtype`` (no CPU staging); with
    ``quant`` its linears and experts hold that format's tensors (those ``quant`` excludes stay in
    ``dtype``); with ``tp`` only rank ``tp.rank``'s shard (``wmtp.models.parallel``; a shard that
    would cut a quantized weight's scale blocks is a ``ConfigError`` before any memory is taken)."""
    whole = cfg
    if tp is not None:
        cfg = shard_config(cfg, tp.size)
    with torch.device("meta"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = _model_class(cfg)(cfg, backend)
            if quant is not None:
                _quantize_modules(model, quant)
            if tp is not None:
                shard_(model, tp, whole)
                param_splits(model)
        finally:
            torch.set_default_dtype(prev)
    model.to_empty(device=device)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# quantized weights (wmtp.quant): which modules, and where each checkpoint tensor of theirs goes
# ---------------------------------------------------------------------------------------------
class QuantGroup:
    """One quantized checkpoint weight (``<module>.weight`` with its scales; for experts, the same
    projection of every expert, ``<experts>.{e}.<kind>``) and where its per-row tensors live in the
    model: parameter ``<param>.<suffix>`` at ``index`` (rows of a packed projection, an expert's rows)."""

    def __init__(self, module: str, fmt: QuantFormat, n: int, k: int, param: str, rows: slice,
                 experts: int | None = None) -> None:
        self.module, self.fmt, self.n, self.k, self.param, self.rows, self.experts = module, fmt, n, k, param, rows, experts

    def each(self) -> list[int | None]:
        """What ``names`` and ``index`` take: every expert, or None for a plain weight."""
        return list(range(self.experts)) if self.experts is not None else [None]

    def names(self, e: int | None = None) -> list[str]:
        """Checkpoint tensor names (of expert ``e``)."""
        base = self.module if e is None else self.module.replace(".experts.*.", f".experts.{e}.")
        return [f"{base}.{s}" for s in self.fmt.suffixes]

    def index(self, e: int | None = None) -> tuple:
        """Where expert ``e``'s (all experts' when None) rows sit in the model's tensors."""
        lead = () if self.experts is None else (slice(None) if e is None else e,)
        return (*lead, self.rows)


def _quantize_modules(model: TargetLM, quant: QuantConfig) -> None:
    """Swap the weights of every ``Linear`` and ``Experts`` the config quantizes for its format's
    tensors. A packed projection (q/k/v, the GDN in-projections) and an expert set (gate / up /
    down) hold one format: a config that gives their parts different ones is an error naming them."""
    cfg = model.config
    for name, m in model.named_modules():
        ckpt = _to_checkpoint_name(cfg, name)
        if isinstance(m, PackedLinear):
            parent = ckpt.rsplit(".", 1)[0]
            fmt = _one_format(quant, {part: f"{parent}.{part}" for part in m.parts}, f"the projections under {parent}, "
                              "which wmtp runs as one packed GEMM,")
        elif isinstance(m, Linear):
            fmt = quant.format_of(ckpt)
        elif isinstance(m, Experts):
            fmt = _one_format(quant, {p.kind: f"{ckpt}.0.{p.kind}" for p in m.parts}, f"{ckpt}'s projections")
        else:
            continue
        if fmt is not None:
            m.quantize_(fmt)
    model.quant = quant


def _one_format(quant: QuantConfig, parts: dict[str, str], what: str) -> QuantFormat | None:
    """The one format of ``parts`` (part -> module name), or an error naming each part's."""
    fmts = {part: quant.format_of(module) for part, module in parts.items()}
    if len({None if f is None else f.name for f in fmts.values()}) > 1:
        named = {part: None if f is None else f.name for part, f in fmts.items()}
        raise ConfigError(f"{quant.source}: gives {what} different formats ({named}); quantize all alike or none")
    return next(iter(fmts.values()))


def quant_groups(model: TargetLM) -> list[QuantGroup]:
    """Every quantized checkpoint weight of ``model`` in its module's format (empty for a model in
    one float dtype)."""
    if model.quant is None:
        return []
    cfg, out = model.config, []
    for name, m in model.named_modules():
        ckpt = _to_checkpoint_name(cfg, name)
        fmt = getattr(m, "quant", None)
        if fmt is None or not isinstance(m, (Linear, Experts)):
            continue
        if isinstance(m, PackedLinear):
            parent = ckpt.rsplit(".", 1)[0]
            out += [QuantGroup(f"{parent}.{part}", fmt, m.parts[part], m.in_features, name, m.rows(part)) for part in m.parts]
        elif isinstance(m, Linear):
            out.append(QuantGroup(ckpt, fmt, m.out_features, m.in_features, name, slice(None)))
        else:
            out += [QuantGroup(f"{ckpt}.*.{p.kind}", fmt, p.n, p.k, f"{name}.{p.param}", p.rows, experts=m.num)
                    for p in m.parts]
    return out


def _quant_params(model: TargetLM) -> set[str]:
    """Names of the parameters that hold quantized weights (loaded and written by group)."""
    return {f"{g.param}.{s}" for g in quant_groups(model) for s in g.fmt.suffixes}


@torch.no_grad()
def _load_quant(model: TargetLM, groups: list[QuantGroup], names: dict[str, Path]) -> tuple[set[str], list[str]]:
    """Read, check and place every quantized weight; returns the checkpoint names used and those
    missing. A tensor-parallel rank reads only its rows / columns of the packed weight (nearly all
    the bytes); the scales are read whole and cut after ``to_model``."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    cuts = _QuantCuts(model)
    used, missing, handles = set(), [], {}

    def open_(n: str):
        f = names[n]
        if f not in handles:
            handles[f] = safe_open(f, "pt")
        return handles[f]

    for g in groups:
        for e in g.each():
            want = g.names(e)
            gone = [n for n in want if n not in names]
            if gone:
                missing += gone
                continue
            base = want[0].rsplit(".", 1)[0]
            t = {s: open_(n).get_tensor(n) for s, n in zip(g.fmt.suffixes, want) if s != "weight"}
            w_name = want[g.fmt.suffixes.index("weight")]
            w = open_(w_name).get_slice(w_name)
            # checked (and laid out) as the whole weight; its bytes are read as this rank's cut below
            t["weight"] = torch.empty(w.get_shape(), dtype=w[:1].dtype, device="meta")
            cut = cuts.of(g, e)
            n, k = cuts.whole(g, e, cut)
            g.fmt.check(base, t, n, k)
            t = g.fmt.to_model(t, n)
            t["weight"] = w[:] if cut["weight"] is None else cut["weight"].take(w, cuts.rank, cuts.size)
            for s, v in t.items():
                if s != "weight":
                    v = cuts.take(cut[s], v)
                dest = params[f"{g.param}.{s}"]
                dest[g.index(e)].copy_(v.to(dest.device))
            used.update(want)
    return used, missing


class _QuantCuts:
    """Where a tensor-parallel shard cuts each quantized group's model tensors (``param_splits``):
    ``of`` (suffix -> Split or None) per group and expert, ``whole`` the whole weight's (n, k)."""

    def __init__(self, model: TargetLM) -> None:
        self.params = dict(model.named_parameters())
        self.splits = {} if model.tp is None else param_splits(model)
        self.rank, self.size = (0, 1) if model.tp is None else (model.tp.rank, model.tp.size)

    def of(self, g: QuantGroup, e: int | None) -> dict[str, Split | None]:
        index = g.index(e)
        return {s: (sp.within(index) if (sp := self.splits.get(f"{g.param}.{s}")) is not None else None)
                for s in g.fmt.suffixes}

    def whole(self, g: QuantGroup, e: int | None, cut: dict[str, Split | None]) -> tuple[int, int]:
        if cut["weight"] is None:
            return g.n, g.k
        local = tuple(self.params[f"{g.param}.weight"][g.index(e)].shape)
        *_, n, cols = cut["weight"].whole_shape(local)
        return n, cols * g.fmt.column_inputs["weight"]

    def take(self, split: Split | None, whole: torch.Tensor) -> torch.Tensor:
        return whole if split is None else split.take(whole, self.rank, self.size)


def _quant_state(model: TargetLM) -> dict[str, torch.Tensor]:
    """Every quantized weight under its checkpoint names, in the checkpoint's layout (per expert)."""
    params = dict(model.named_parameters())
    out = {}
    for g in quant_groups(model):
        for e in g.each():
            rows = {s: params[f"{g.param}.{s}"][g.index(e)] for s in g.fmt.suffixes}
            out.update(dict(zip(g.names(e), g.fmt.to_checkpoint(rows).values())))
    return out


QUANT_INIT_ELEMENTS = 1 << 27  # weight elements one quantize pass of _init_quant_ takes (whole experts)


@torch.no_grad()
def _init_quant_(model: TargetLM, gen: torch.Generator, std: float, out_std: float) -> None:
    """Random quantized weights: each checkpoint weight drawn as ``init_random_`` draws a float one
    (all experts of a projection at once), then quantized to nearest (its own scales, as a real
    checkpoint's parts and experts have), experts in runs of about ``QUANT_INIT_ELEMENTS``: the
    quantizer's fp32 and int64 temporaries of 512 experts at once (Nemotron-3-Super's) are several
    times the packed weight, more than an H100 had left. Scales are per expert, so the runs give the
    tensors one pass would. A tensor-parallel shard draws and quantizes the whole weight and keeps its
    cut, so it holds the single-process model's tensors."""
    params = dict(model.named_parameters())
    cuts = _QuantCuts(model)
    for g in quant_groups(model):
        device = params[f"{g.param}.weight"].device
        cut = cuts.of(g, None)
        n, k = cuts.whole(g, None, cut)
        shape = (n, k) if g.experts is None else (g.experts, n, k)
        scale = out_std if g.module.endswith(("o_proj", "down_proj", "out_proj")) else std
        w = torch.empty(shape, device=device).normal_(0.0, scale, generator=gen)
        index = g.index()
        run = max(1, QUANT_INIT_ELEMENTS // (n * k))
        for lo in [None] if g.experts is None else range(0, g.experts, run):
            part, at = (w, index) if lo is None else (w[lo:lo + run], (slice(lo, lo + run), *index[1:]))
            for s, v in g.fmt.to_model(g.fmt.quantize(part), n).items():
                params[f"{g.param}.{s}"][at].copy_(cuts.take(cut[s], v))


@torch.no_grad()
def init_random_(model: TargetLM, seed: int = 0, std: float = 0.02) -> TargetLM:
    """Small-variance random init on the model's device: activations stay finite at depth.

    Output projections are scaled by 1/sqrt(2 * layers) (GPT-2 style) so the residual stream does
    not grow with depth; norms start at identity; GDN decay parameters follow the reference init.
    """
    cfg = model.config
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out_std = std / math.sqrt(2 * max(cfg.num_layers, 1))
    quantized = _quant_params(model)
    _init_quant_(model, gen, std, out_std)
    draw = _Draws(model)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("A_log", "dt_bias") or name in quantized:
            continue  # set with their module (below, or quantized above)
        if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight", "experts.down_proj")):
            draw(name, lambda t: t.normal_(0.0, out_std, generator=gen))
        elif p.ndim >= 2:
            draw(name, lambda t: t.normal_(0.0, std, generator=gen))
        else:
            p.zero_()  # biases
    for mname, m in model.named_modules():
        if isinstance(m, RMSNorm):
            m.weight.fill_(0.0 if m.offset else 1.0)
        elif isinstance(m, GatedDeltaNet):
            m.norm.weight.fill_(1.0)
            m.dt_bias.fill_(1.0)
            draw(f"{mname}.A_log", lambda t: t.uniform_(1.0, 16.0, generator=gen).log(), torch.float32)
            k = m.conv1d.weight.shape[-1]
            draw(f"{mname}.conv1d.weight", lambda t: t.normal_(0.0, 1.0 / math.sqrt(k), generator=gen))
        elif isinstance(m, Mamba2Mixer):  # as the reference: dt in [1e-3, 0.1] log-uniform, A in [1, 16], D = 1
            m.norm.weight.fill_(1.0)
            m.D.fill_(1.0)

            def dt_bias(t: torch.Tensor) -> torch.Tensor:
                dt = t.uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
                return dt + torch.log(-torch.expm1(-dt))  # softplus^-1

            draw(f"{mname}.dt_bias", dt_bias, torch.float32)
            draw(f"{mname}.A_log", lambda t: t.uniform_(1.0, 16.0, generator=gen).log(), torch.float32)
            k = m.conv1d.weight.shape[-1]
            draw(f"{mname}.conv1d.weight", lambda t: t.normal_(0.0, 1.0 / math.sqrt(k), generator=gen))
    return model


class _Draws:
    """``init_random_``'s random draws: ``draw(name, fill, dtype)`` sets parameter ``name`` to
    ``fill(an empty tensor of the parameter's shape)``. A tensor-parallel shard draws the whole
    model's tensor and keeps its own slice, so its weights equal the single-process model's (same
    generator, same order); one whole tensor at a time is alive."""

    def __init__(self, model: TargetLM) -> None:
        self.params = dict(model.named_parameters())
        self.tp = model.tp
        self.splits: dict[str, Split] = {} if model.tp is None else param_splits(model)

    def __call__(self, name: str, fill, dtype: torch.dtype | None = None) -> None:
        p = self.params[name]
        split = self.splits.get(name)
        if split is None and dtype is None:
            fill(p)  # in place
            return
        shape = p.shape if split is None else split.whole_shape(tuple(p.shape))
        t = fill(torch.empty(shape, device=p.device, dtype=dtype or p.dtype))
        p.copy_(t if split is None else split.take(t, self.tp.rank, self.tp.size))


# ---------------------------------------------------------------------------------------------
# reading checkpoints
# ---------------------------------------------------------------------------------------------
def checkpoint_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> file, over model.safetensors(.index.json) and an optional mtp.safetensors."""
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    names: dict[str, Path] = {}
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e!r})") from None
        for name, fname in weight_map.items():
            names[name] = ckpt / fname
        for f in set(names.values()):
            if not f.exists():
                raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
    elif (ckpt / "model.safetensors").exists():
        f = ckpt / "model.safetensors"
        with safe_open(f, "pt") as h:
            names = {k: f for k in h.keys()}
    else:
        raise CheckpointError(f"{ckpt}: no model.safetensors or model.safetensors.index.json")
    extra = ckpt / MTP_FILE
    if extra.exists():
        with safe_open(extra, "pt") as h:
            names.update({k: extra for k in h.keys()})
    return names


def _count_mtp_layers(names: list[str]) -> int:
    idx = {int(m.group(1)) for n in names if (m := _MTP_LAYER_RE.match(n))}
    return max(idx) + 1 if idx else 0


class _Target:
    """Where one checkpoint tensor goes: a parameter, or a piece (rows, or one expert's slice) of a
    packed one; ``packed`` / ``piece`` name that parameter and the piece."""

    def __init__(self, param: torch.Tensor, key: str, index: tuple = (), piece: object = None) -> None:
        self.param, self.key, self.index, self.piece = param, key, index, piece

    @property
    def view(self) -> torch.Tensor:
        return self.param[self.index] if self.index else self.param


def packed_linear_parts(model: torch.nn.Module) -> dict[str, tuple[str, str, slice]]:
    """Our name of every part of every ``PackedLinear`` tensor (``...self_attn.q_proj.weight``) ->
    (the packed parameter's name, the part, its rows)."""
    out = {}
    for mname, m in model.named_modules():
        if isinstance(m, PackedLinear):
            parent = mname.rsplit(".", 1)[0]
            for kind in ("weight", "bias"):
                if getattr(m, kind) is not None:
                    out.update({f"{parent}.{part}.{kind}": (f"{mname}.{kind}", part, m.rows(part)) for part in m.parts})
    return out


def _targets(model: TargetLM, ckpt_names: list[str]) -> dict[str, _Target]:
    """Map checkpoint names to destinations: a parameter, a packed projection's rows, or one
    expert's slice of a packed expert tensor."""
    cfg = model.config
    params = dict(model.named_parameters())
    parts = packed_linear_parts(model)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
    prefix = lm_prefix(cfg)
    out: dict[str, _Target] = {}
    for name in ckpt_names:
        ours = "model." + name[len(prefix):] if name.startswith(prefix) else name
        if ours in params:
            out[name] = _Target(params[ours], ours)
            continue
        if ours in parts:
            packed, part, rows = parts[ours]
            out[name] = _Target(params[packed], packed, (rows,), part)
            continue
        m = _EXPERT_RE.match(ours)
        mod = experts.get(m.group(1)) if m else None
        part = next((p for p in mod.parts if p.kind == m.group(3)), None) if mod is not None else None
        if part is not None:
            e, key = int(m.group(2)), f"{m.group(1)}.{part.param}"
            if e >= mod.num:
                continue  # reported as unused: expert index beyond num_experts
            out[name] = _Target(params[key], key, (e, part.rows), (e, part.kind))
    return out


def packed_expert_parts(model: torch.nn.Module) -> dict[str, list]:
    """Our name of every packed expert parameter (``...experts.gate_up_proj``) -> the checkpoint
    projections it holds (``Experts.parts``)."""
    out: dict[str, list] = defaultdict(list)
    for name, m in model.named_modules():
        if isinstance(m, Experts):
            for part in m.parts:
                out[f"{name}.{part.param}"].append(part)
    return dict(out)


def _missing_tensors(model: TargetLM, whole: set[str], pieces: dict[str, set]) -> list[str]:
    """Checkpoint names of everything not loaded; per-expert and per-projection gaps are named one
    by one."""
    cfg = model.config
    by_packed: dict[str, list[tuple[str, str]]] = defaultdict(list)  # packed key -> [(part, our part name)]
    for ours, (packed, part, _rows) in packed_linear_parts(model).items():
        by_packed[packed].append((part, ours))
    expert_kinds = {key: [p.kind for p in parts] for key, parts in packed_expert_parts(model).items()}
    missing = []
    for key, p in model.named_parameters():
        if key in whole or (key == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        name = _to_checkpoint_name(cfg, key)
        if key in by_packed:
            missing += [_to_checkpoint_name(cfg, ours) for part, ours in by_packed[key] if part not in pieces[key]]
        elif key in expert_kinds and key in pieces:
            base = name.rsplit(".", 1)[0]
            missing += [f"{base}.{e}.{k}.weight" for e in range(p.shape[0]) for k in expert_kinds[key]
                        if (e, k) not in pieces[key]]
        else:
            missing.append(name)
    return missing


def _to_checkpoint_name(cfg: ModelConfig, ours: str) -> str:
    return lm_prefix(cfg) + ours[len("model."):] if ours.startswith("model.") else ours


@torch.no_grad()
def load_weights(model: TargetLM, ckpt: Path, names: dict[str, Path]) -> None:
    """Copy every checkpoint tensor into its parameter; fail on a missing tensor or wrong shape."""
    from safetensors import safe_open

    groups = quant_groups(model)
    quant_used, quant_missing = _load_quant(model, groups, names)
    quant_used |= _load_kv_scales(model, names)
    quant_names = {n for g in groups for e in g.each() for n in g.names(e)}
    targets = _targets(model, [n for n in names if n not in quant_names and n not in quant_used])
    whole: set[str] = _quant_params(model)  # parameters loaded as one tensor (quantized ones: by group)
    pieces: dict[str, set] = defaultdict(set)  # packed key -> pieces loaded ((expert, kind) or part)
    splits = {} if model.tp is None else param_splits(model)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for n in targets:
        by_file[names[n]].append(n)
    for f, ns in by_file.items():
        with safe_open(f, "pt") as h:
            for n in ns:
                t = targets[n]
                piece = h.get_slice(n)
                split = splits[t.key].within(t.index) if t.key in splits else None
                want = tuple(t.view.shape) if split is None else split.whole_shape(tuple(t.view.shape))
                shape = tuple(piece.get_shape())
                if shape != want:
                    raise CheckpointError(f"{f.name}: tensor {n!r} has shape {list(shape)}, expected {list(want)}")
                # a tensor-parallel rank reads only its rows of the memory-mapped file
                src = h.get_tensor(n) if split is None else split.take(piece, model.tp.rank, model.tp.size)
                t.view.copy_(src.to(device=t.param.device, dtype=t.param.dtype))
                if t.index:
                    pieces[t.key].add(t.piece)
                else:
                    whole.add(t.key)
    missing = quant_missing + _missing_tensors(model, whole, pieces)
    if missing:
        raise CheckpointError(f"{ckpt}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}")
    unused = sorted(set(names) - set(targets) - quant_used)
    if unused:
        log.warning("%s: %d unused tensor(s) in the checkpoint, e.g. %s", ckpt, len(unused), unused[:4])


def _load_kv_scales(model: TargetLM, names: dict[str, Path]) -> set[str]:
    """Set each attention layer's (k_scale, v_scale) from the checkpoint where it carries them
    (``Attention.kv_scale_loaded`` says which did); returns the tensor names read."""
    from safetensors import safe_open

    used: set[str] = set()
    for mod_name, m in model.named_modules():
        if not isinstance(m, Attention):
            continue
        ck = _to_checkpoint_name(model.config, mod_name)
        found = {}
        for kind, spellings in KV_SCALE_NAMES.items():
            hits = [f"{ck}.{sp}" for sp in spellings if f"{ck}.{sp}" in names]
            if len(hits) > 1:
                raise CheckpointError(f"attention layer {ck!r} has two {kind}_scale tensors: {hits}")
            if hits:
                with safe_open(names[hits[0]], "pt") as h:
                    found[kind] = kv_scale_value(hits[0], h.get_tensor(hits[0]))
                used.add(hits[0])
        if len(found) == 1:
            have = next(iter(found))
            raise CheckpointError(f"attention layer {ck!r} has a {have}_scale but no {'v' if have == 'k' else 'k'}_scale")
        if found:
            m.k_scale, m.v_scale = found["k"], found["v"]
        m.kv_scale_loaded = bool(found)
    return used


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None, backend: str = "torch",
    tp: TPGroup | None = None,
) -> TargetLM:
    """A checkpoint directory's model (with ``tp``: rank ``tp.rank``'s shard, reading only its rows)."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a checkpoint directory")
    cfg = ModelConfig.from_file(ckpt / "config.json")
    names = checkpoint_files(ckpt)
    n_mtp = _count_mtp_layers(list(names))
    if cfg.family == "mamba_hybrid":  # a Nemotron-H MTP step spans its pattern's blocks
        n_mtp //= len(cfg.mtp_layer_types)
    if cfg.num_nextn_predict_layers == 0 and n_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=n_mtp)  # a head attached next to the checkpoint
    quant = QuantConfig.from_checkpoint(ckpt)
    model = build_model(cfg, device, resolve_dtype(dtype, cfg.torch_dtype), backend, quant, tp)
    load_weights(model, ckpt, names)
    return model


# ---------------------------------------------------------------------------------------------
# writing checkpoints
# ---------------------------------------------------------------------------------------------
def unpacked_state_dict(module: torch.nn.Module, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` (but the tensors named in ``skip``) with every ``PackedLinear``
    tensor split back into its parts (row views) under the parts' own names, as checkpoints and
    transformers modules hold them."""
    parts: dict[str, list[tuple[str, slice]]] = defaultdict(list)
    for part_name, (key, _part, rows) in packed_linear_parts(module).items():
        parts[key].append((part_name, rows))
    out: dict[str, torch.Tensor] = {}
    for key, t in module.state_dict().items():
        if key not in skip:
            out.update({name: t[rows] for name, rows in parts[key]} if key in parts else {key: t})
    return out


def checkpoint_state(model: TargetLM, expert_layout: str = "per_expert") -> dict[str, torch.Tensor]:
    """The model's tensors under HF checkpoint names, experts per expert or packed."""
    if expert_layout not in ("per_expert", "packed"):
        raise ValueError(f"expert_layout={expert_layout!r}; supported: ['packed', 'per_expert']")
    cfg = model.config
    if model.quant is not None and expert_layout != "per_expert":
        raise ValueError("quantized experts are written per expert (as ModelOpt exports them)")
    out: dict[str, torch.Tensor] = dict(_quant_state(model))
    expert_parts = packed_expert_parts(model)
    for ours, p in unpacked_state_dict(model, skip=_quant_params(model)).items():
        name = _to_checkpoint_name(cfg, ours)
        if expert_layout == "per_expert" and ours in expert_parts:
            base = name.rsplit(".", 1)[0]
            out.update({f"{base}.{e}.{part.kind}.weight": p[e, part.rows] for e in range(p.shape[0])
                        for part in expert_parts[ours]})
        else:
            out[name] = p
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_checkpoint(
    model: TargetLM,
    out: str | Path,
    expert_layout: str = "per_expert",
    max_shard_bytes: int = 4 << 30,
    separate_mtp: bool | None = None,
) -> Path:
    """Write config.json + safetensors (sharded with an index above ``max_shard_bytes``).

    ``separate_mtp`` (default: for dense Llama-family targets) writes the head to mtp.safetensors,
    leaving a checkpoint that transformers loads as a plain model.
    """
    from safetensors.torch import save_file

    cfg = model.config
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = checkpoint_state(model, expert_layout)
    if separate_mtp is None:
        separate_mtp = not cfg.is_hybrid
    raw = json.loads(json.dumps(cfg.raw))
    text = raw["text_config"] if "text_config" in raw else raw
    text["dtype"] = next(model.parameters()).dtype.__repr__().split(".")[-1]
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        text.pop(key, None)
    if cfg.num_nextn_predict_layers and not separate_mtp:
        key = "mtp_num_hidden_layers" if cfg.model_type.startswith("qwen3_5") else "num_nextn_predict_layers"
        text[key] = cfg.num_nextn_predict_layers
    raw.pop("quantization_config", None)
    hf_quant = out / "hf_quant_config.json"
    hf_quant.unlink(missing_ok=True)
    if model.quant is not None:  # spelled as the public releases spell it (wmtp.quant)
        hf, raw["quantization_config"] = model.quant.config_entries()
        if hf is not None:
            hf_quant.write_text(json.dumps(hf, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if separate_mtp:
        mtp = {k: state.pop(k) for k in [k for k in state if k.startswith("mtp.")]}
        if mtp:
            save_file(mtp, out / MTP_FILE, metadata={"format": "pt", "wmtp_mtp_style": "deepseek"})
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
