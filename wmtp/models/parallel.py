"""Tensor parallelism inside the model (DESIGN §11): which slice of each weight a rank holds, and the
collectives its layers run. Processes, the process group and the broadcast of each step's work are
the engine's (``wmtp.engine.distributed``); nothing here starts a process.

A model over N ranks is built from ``shard_config`` (head counts and intermediate widths divided by
N, the vocabulary whole), so every layer allocates its shard with its usual code; ``shard_`` then
- swaps the embedding and the lm_head for their vocabulary shards (``VocabParallelEmbedding``); the
  logits are gathered over the ranks (``TargetLM.compute_logits`` / ``draft_logits``), so argmax
  and sampling see the whole vocabulary, the same on every rank;
- sums the row-parallel output of every residual branch over the ranks (one all-reduce each): a
  decoder layer's attention (after o_proj) or Gated DeltaNet (after out_proj) and its FFN (after
  down_proj: the dense MLP, or the whole MoE block with its shared expert), and each Nemotron-H
  mixer (Mamba2 after out_proj, attention, ReLU² MLP, latent MoE after fc2_latent_proj). These are
  forward hooks, so a single-process model runs the same forward with nothing added.

Sharding rules (``param_splits``, over the model's parameter names, which follow the checkpoints; the
loader reads only a rank's rows from the memory-mapped safetensors):
- attention: q (with its gate rows) / k / v by heads, o_proj by input columns; KV heads replicated
  when there are fewer than N (rank r holds KV head ⌊r·KV/N⌋, the one its query heads read);
- Gated DeltaNet: key and value heads (the q, k, v, z, b, a rows, the conv channels, A_log,
  dt_bias), out_proj by columns; Mamba2: heads with their groups (z, x, B, C, dt rows, the conv
  channels, A_log, D, dt_bias, the gated norm), out_proj by columns;
- dense MLPs and shared experts: gate / up by intermediate rows, down by columns;
- routed experts: tensor parallelism inside every expert (its intermediate dim, the dense MLP's
  rule), not expert parallelism: every rank routes every token alike with the replicated router,
  needs no all-to-all and stays balanced whatever the routing, and the one all-reduce of the MoE
  block sums routed and shared experts;
- embeddings and lm_head by vocabulary rows (the MTP head shares them); replicated: norms, routers,
  the shared-expert gate, the MTP fusion (fc / eh_proj) and Nemotron-H's latent projections.
Recurrent states, their rollback and the draft ring are per rank (its own heads): no communication.

Quantized weights (``wmtp.quant``) are cut as their logical [.., N, K] weight is: a cut of the rows
takes the same rows of the packed weight, its scales and its per-row vectors; a cut of the inputs
takes whole columns of the packed weight and of each scale (``QuantFormat.column_inputs``), so a
rank's shard of K must hold whole scale blocks (or lie inside one block, whose scale its ranks
share; a per-tensor scale laid out per block fits any shard), and the per-row vectors are
replicated. Per-tensor scales stay per tensor of the whole model, so a shard dequantizes to exactly
the whole weight's slice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wmtp.config import ModelConfig
from wmtp.errors import ConfigError
from wmtp.quant import QuantFormat


# torch 2.13 renamed all_gather_into_tensor (deprecated there); the GPU machine's 2.11 may not have the new name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place among ``size`` tensor-parallel ranks; ``group`` is the torch.distributed
    process group the tensors move in (None: the default one)."""

    rank: int
    size: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dim, rank order (vocabulary shards -> logits)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x, group=self.group)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise ``ConfigError`` naming the config.json field N = ``size`` does not divide, before any
    work (quantized weights' scale blocks: ``param_splits``)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"tensor_parallel_size={size!r} must be an int >= 1")
    if size == 1:
        return
    shared = "moe_shared_expert_intermediate_size" if cfg.mamba is not None else "shared_expert_intermediate_size"
    fields = [("num_attention_heads", cfg.num_heads), ("vocab_size", cfg.vocab_size),
              ("intermediate_size", cfg.intermediate_size), ("moe_intermediate_size", cfg.moe_intermediate_size),
              (shared, cfg.shared_expert_intermediate_size),
              ("linear_num_key_heads", cfg.linear_num_key_heads), ("linear_num_value_heads", cfg.linear_num_value_heads)]
    if cfg.mamba is not None:  # a Mamba2 group's norm spans its heads: whole groups per rank
        fields += [("mamba_num_heads", cfg.mamba.heads), ("n_groups", cfg.mamba.groups)]
    for name, value in fields:
        if value % size:
            raise ConfigError(f"tensor_parallel_size={size} does not divide config.json field {name!r}={value}")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(f"tensor_parallel_size={size} must divide config.json field 'num_key_value_heads'={kv} or "
                          "be a multiple of it (KV heads are then replicated)")


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's config of ``cfg`` over ``size`` ranks: head counts and intermediate widths divided
    (one KV head per rank when there are fewer than ``size``), the vocabulary whole (the embedding
    and the lm_head take their rows in ``shard_``)."""
    check_shardable(cfg, size)
    m = cfg.mamba
    return cfg.replace(
        num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads // size, 1),
        intermediate_size=cfg.intermediate_size // size, moe_intermediate_size=cfg.moe_intermediate_size // size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size,
        linear_num_key_heads=cfg.linear_num_key_heads // size, linear_num_value_heads=cfg.linear_num_value_heads // size,
        mamba=None if m is None else dataclasses.replace(m, heads=m.heads // size, groups=m.groups // size))


@dataclass(frozen=True)
class Split:
    """How a tensor is cut over N ranks along ``dim``: runs of ``pieces`` = ((local size, parts), ...)
    in order; the whole tensor holds each run's ``parts`` chunks one after another, and rank r holds
    chunk ⌊r·parts/N⌋ of each (parts = N: a chunk of its own; fewer: shared by N/parts ranks, as
    replicated KV heads). ``once``: the bias of a row-parallel output, whole on rank 0 and zero on the
    others (the all-reduce adds it once)."""

    dim: int
    pieces: tuple[tuple[int, int], ...] = ()
    once: bool = False

    def ranges(self, rank: int, size: int) -> list[tuple[int, int]]:
        """[start, stop) of each run's chunk of ``rank`` in the whole tensor, along ``dim``."""
        out, offset = [], 0
        for n, parts in self.pieces:
            c = rank * parts // size
            out.append((offset + c * n, offset + (c + 1) * n))
            offset += n * parts
        return out

    def whole_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        if self.once:
            return tuple(local)
        shape = list(local)
        shape[self.dim] = sum(n * parts for n, parts in self.pieces)
        return tuple(shape)

    def take(self, whole: Any, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s part of ``whole``: a tensor, or anything indexed like one by a tuple of
        slices (a safetensors slice: only those rows are read from the file)."""
        if self.once:
            t = whole[:]
            return t if rank == 0 else torch.zeros_like(t)
        lead = (slice(None),) * self.dim
        return torch.cat([whole[(*lead, slice(a, b))] for a, b in self.ranges(rank, size)], dim=self.dim)

    def within(self, index: tuple) -> "Split":
        """The split of the piece ``index`` (leading ints and slices, as the loader addresses one
        checkpoint tensor inside a packed parameter: a projection's rows, an expert's slice)."""
        if self.once or not index:
            return self
        dim = self.dim - sum(isinstance(i, int) for i in index[: self.dim])
        rows = index[self.dim] if len(index) > self.dim else slice(None)
        if rows == slice(None):
            return Split(dim, self.pieces)
        kept, start = [], 0
        for n, parts in self.pieces:
            if rows.start <= start and start + n <= rows.stop:
                kept.append((n, parts))
            start += n
        if sum(n for n, _ in kept) != rows.stop - rows.start:
            raise ValueError(f"Split.within: rows {rows} do not fall on the runs {self.pieces}")
        return Split(dim, tuple(kept))


def _runs(*pieces: tuple[int, int], dim: int = 0) -> Split:
    return Split(dim, tuple(pieces))


def param_splits(model: nn.Module) -> dict[str, Split]:
    """The ``Split`` of every sharded parameter of a model built by ``shard_`` (module docstring);
    parameters not named are replicated. ``ConfigError`` names a quantized weight whose shard of
    the inputs would cut its scale blocks."""
    from wmtp.models.layers import Experts, Linear

    out = _logical_splits(model)
    for name, m in model.named_modules():
        fmt = getattr(m, "quant", None)
        if fmt is None or not isinstance(m, (Linear, Experts)):
            continue
        # a Linear's logical weight is its (quantized) ``weight``; an expert set's, each packed projection
        weights = {f"{name}.weight": name} if isinstance(m, Linear) else {
            f"{name}.{w}": f"{name}.{w}" for w in (m.first, "down_proj")}
        for key, holder in weights.items():
            logical = out.pop(key, None)
            if logical is None:
                continue
            ndim = 2 if isinstance(m, Linear) else 3
            for suffix in fmt.suffixes:
                split = quant_split(fmt, suffix, logical, ndim, holder, model.tp.size)
                if split is not None:
                    out[f"{holder}.{suffix}"] = split
    return out


def quant_split(fmt: QuantFormat, suffix: str, logical: Split, ndim: int, where: str, size: int) -> Split | None:
    """The split of model tensor ``suffix`` of a quantized weight whose logical [.., N, K] weight
    (``ndim`` dims) ``logical`` cuts (None: replicated); module docstring."""
    if logical.dim == ndim - 2:  # output rows: the same rows of every tensor, per-row vectors too
        return logical
    if suffix in fmt.row_vectors:
        return None
    (kl, parts), = logical.pieces  # inputs are cut in one run of N chunks
    unit, k = fmt.column_inputs[suffix], kl * parts
    if suffix in fmt.uniform_columns:  # one value throughout: every rank takes the columns its shard needs
        return Split(logical.dim, ((-(-kl // unit), 1),))
    if kl % fmt.k_multiple == 0:
        if kl % unit == 0:
            return Split(logical.dim, ((kl // unit, parts),))
        cols = -(-k // unit)
        if cols == 1 or (unit % kl == 0 and k % unit == 0):  # each rank's inputs inside one block
            return Split(logical.dim, ((1, cols),))
    raise ConfigError(f"tensor_parallel_size={size}: {where} is a {fmt.name} weight of {k} inputs, {kl} per rank, "
                      f"which would cut its blocks of {max(unit, fmt.k_multiple)} inputs; use a size whose "
                      "shards hold whole blocks")


def _logical_splits(model: nn.Module) -> dict[str, Split]:
    """``param_splits`` over every weight as if unquantized (a quantized one's logical [.., N, K])."""
    from wmtp.models.layers import MLP, Attention, Experts, GatedDeltaNet
    from wmtp.models.nemotron_h import Mamba2Mixer, ReLU2MLP

    n, whole = model.tp.size, model.whole_config
    kv_parts = min(whole.num_kv_heads, n)
    out: dict[str, Split] = {}
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, Attention):
            q, kv = m.qkv_proj.parts["q_proj"], m.qkv_proj.parts["k_proj"]
            heads = _runs((q, n), (kv, kv_parts), (kv, kv_parts))
            out.update({f"{p}qkv_proj.weight": heads, f"{p}qkv_proj.bias": heads,
                        f"{p}o_proj.weight": _runs((m.o_proj.in_features, n), dim=1), f"{p}o_proj.bias": Split(0, once=True)})
        elif isinstance(m, GatedDeltaNet):
            qk, v = m.hk * m.dk, m.hv * m.dv
            conv = ((qk, n), (qk, n), (v, n))  # [q | k | v]
            if m.fused:  # grouped per key head ([q k v z], [b a]): each part's rows are whole key heads
                in_proj = tuple((size, n) for size in m.in_proj.parts.values())
            else:  # [q | k | v], z, b, a
                in_proj = (*conv, (v, n), (m.hv, n), (m.hv, n))
            out.update({f"{p}in_proj.weight": _runs(*in_proj), f"{p}conv1d.weight": _runs(*conv),
                        f"{p}dt_bias": _runs((m.hv, n)), f"{p}A_log": _runs((m.hv, n)),
                        f"{p}out_proj.weight": _runs((v, n), dim=1)})
        elif isinstance(m, Mamba2Mixer):
            s = m.shape
            inner, bc, heads = (s.inner, n), (s.groups * s.state, n), (s.heads, n)
            conv = _runs(inner, bc, bc)
            out.update({f"{p}in_proj.weight": _runs(inner, inner, bc, bc, heads), f"{p}conv1d.weight": conv,
                        f"{p}conv1d.bias": conv, f"{p}dt_bias": _runs(heads), f"{p}A_log": _runs(heads),
                        f"{p}D": _runs(heads), f"{p}norm.weight": _runs(inner), f"{p}out_proj.weight": _runs(inner, dim=1)})
        elif isinstance(m, (MLP, ReLU2MLP)):
            inter = m.down_proj.in_features
            for proj in ("gate_proj", "up_proj"):
                if hasattr(m, proj):
                    out[f"{p}{proj}.weight"] = _runs((inter, n))
            out[f"{p}down_proj.weight"] = _runs((inter, n), dim=1)
        elif isinstance(m, Experts):
            first = ((m.inter, n),) * (2 if m.gated else 1)
            out.update({f"{p}{m.first}": _runs(*first, dim=1), f"{p}down_proj": _runs((m.inter, n), dim=2)})
    vocab = _runs((model.embedding.num_embeddings, n))
    out[_param_name(model, model.embedding.weight)] = vocab
    if model.lm_head is not None:
        out["lm_head.weight"] = vocab
    return out


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    return next(name for name, p in model.named_parameters() if p is param)


def vocab_lookup(tp: TPGroup, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a vocabulary sharded by rows over the ranks (``weight``: this rank's
    [V/N, H]): each rank gives the rows it holds, zeros elsewhere, summed over the ranks (exact)."""
    local = ids - tp.rank * weight.shape[0]
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight).masked_fill_(outside[..., None], 0)
    return tp.all_reduce(rows)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the input embedding (``vocab_lookup``); ``weight`` is [V/N, H]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_lookup(self.tp, self.weight, ids)


def shard_(model: nn.Module, tp: TPGroup, whole: ModelConfig) -> None:
    """Make ``model`` (built from ``shard_config(whole, tp.size)``, on the meta device) rank
    ``tp.rank``'s shard: vocabulary-sharded embedding and lm_head, the all-reduce after each
    row-parallel branch (module docstring), ``model.tp`` and ``model.whole_config`` set."""
    from wmtp.models.layers import DecoderLayer
    from wmtp.models.nemotron_h import NemotronHBlock

    model.tp, model.whole_config = tp, whole
    rows = whole.vocab_size // tp.size
    emb = model.embedding
    parent, _, attr = next(name for name, m in model.named_modules() if m is emb).rpartition(".")
    setattr(model.get_submodule(parent), attr, VocabParallelEmbedding(rows, emb.embedding_dim, tp))
    if model.lm_head is not None:
        model.lm_head = nn.Linear(whole.hidden_size, rows, bias=False)

    def reduce(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(out)

    for m in model.modules():
        if isinstance(m, DecoderLayer):
            branches = [m.self_attn if m.layer_type == "full_attention" else m.linear_attn, m.mlp]
        elif isinstance(m, NemotronHBlock):
            branches = [m.mixer]
        else:
            continue
        for branch in branches:
            branch.register_forward_hook(reduce)
