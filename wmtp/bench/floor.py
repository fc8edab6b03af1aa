"""The bytes floor of one speculative iteration (DESIGN §6) and the bandwidth it is divided by.

Floor = bytes every kernel must read at least / HBM read bandwidth measured on the same GPU in the
same run (a streaming read; ``measure_bandwidth``; on a CPU run, the host memory's). Counted per
iteration (γ = d − 1), for any ``TargetLM``:
- verify (one target forward of d tokens): every dense target weight, the experts the d tokens
  actually route to (distinct, per layer, measured), the lm_head once, the target KV of S tokens,
  the recurrent states;
- draft (γ MTP forwards: γ − 1 steps + the extend): each reads the MTP layer's dense weights, its
  routed experts (measured), the lm_head (the rows of a pruned draft vocabulary only), and the
  draft KV it attends to: S slots (native) or
  sink + W (windowed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from wmtp.config import ModelConfig
from wmtp.engine.config import SpecConfig
from wmtp.kernels.common import SigmoidRouting
from wmtp.kernels.torch_relu2_moe import sigmoid_route
from wmtp.models.base import TargetLM, recurrent_state
from wmtp.models.layers import Experts
from wmtp.models.loader import quant_groups


@dataclass
class StepBytes:
    target_dense: int
    target_experts: int
    target_kv: int
    states: int
    lm_head: int
    draft_dense: int
    draft_experts: int
    draft_kv: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _nbytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def moe_blocks(module: nn.Module, skip: Sequence[nn.Module | None] = ()) -> list[nn.Module]:
    """The MoE blocks under ``module`` but outside the ``skip`` modules: every module whose
    ``.experts`` are packed routed experts (``layers.Experts``: Qwen's SparseMoE, Nemotron-H's LatentMoE)."""
    skipped = {id(m) for s in skip if s is not None for m in s.modules()}
    return [m for m in module.modules() if id(m) not in skipped and isinstance(getattr(m, "experts", None), Experts)]


class _Weights:
    """Bytes of a model's weights as a kernel must read them: float tensors whole; a quantized
    weight as its format counts it (``QuantFormat.weight_bytes``: packed values and every scale
    level of each checkpoint weight, not the model's per-row copies of per-tensor scales)."""

    def __init__(self, model: TargetLM) -> None:
        params = dict(model.named_parameters())
        self.quantized: set[int] = set()
        self.bytes_of: dict[int, int] = {}  # id(weight parameter) -> its quantized bytes (per expert for experts)
        for g in quant_groups(model):
            self.quantized |= {id(params[f"{g.param}.{s}"]) for s in g.fmt.suffixes}
            w = id(params[f"{g.param}.weight"])
            self.bytes_of[w] = self.bytes_of.get(w, 0) + g.fmt.weight_bytes(g.n, g.k)

    def dense(self, params: Iterable[torch.Tensor]) -> int:
        """Bytes of ``params`` (a module's), the quantized ones as their format counts them."""
        params = list(params)
        return (_nbytes(p for p in params if id(p) not in self.quantized)
                + sum(self.bytes_of.get(id(p), 0) for p in params))

    def expert(self, moe: nn.Module) -> int:
        """Bytes of one routed expert of ``moe``: its slice of every packed parameter of
        ``moe.experts`` (gate_up or up, and down)."""
        e: Experts = moe.experts
        packed = [getattr(e, name) for name in dict.fromkeys(part.param for part in e.parts)]
        if e.quant is not None:
            return sum(self.bytes_of[id(w.weight)] for w in packed)
        return sum(w[0].numel() * w.element_size() for w in packed)

    def split(self, module: nn.Module, skip: Sequence[nn.Module | None] = ()) -> tuple[int, list[nn.Module]]:
        """(bytes of ``module``'s weights other than its routed experts and those under ``skip``,
        its MoE blocks outside ``skip``). A MoE block's router, latent projections and shared
        expert are read by every forward, so they count as dense bytes."""
        moes = moe_blocks(module, skip)
        skipped = {id(p) for s in skip if s is not None for p in s.parameters()}
        skipped |= {id(p) for m in moes for p in m.experts.parameters()}
        return self.dense(p for p in module.parameters() if id(p) not in skipped), moes


def state_bytes(cfg: ModelConfig, elt: int) -> int:
    """One request's recurrent states (conv windows in the model dtype, fp32 SSM states) over every
    recurrent layer, as the engine's pools hold them; 0 for attention-only models."""
    st = recurrent_state(cfg)
    return 0 if st is None else st.layers * (st.conv_bytes(elt) + st.ssm_bytes)


def step_bytes(model: TargetLM, spec: SpecConfig, context: int, distinct: dict[int, float], elt: int,
               kv_elt: int | None = None) -> StepBytes:
    """The floor's bytes of one iteration at ``context`` tokens (module docstring) for any
    ``TargetLM``. ``distinct``: mean distinct experts per forward, keyed by ``id`` of each MoE
    block (``ExpertCounter.mean_distinct``); ``elt``: bytes of a conv-state element, and of a KV
    element unless ``kv_elt`` (the engine's ``MemoryManager.kv_elt``: 1 for an fp8 KV cache) says."""
    cfg = model.config
    kv_elt = elt if kv_elt is None else kv_elt
    emb = model.embed_weight
    weights = _Weights(model)
    # the target: every weight outside the MTP head and the lm_head (counted apart)
    target_dense, target_moes = weights.split(model, skip=(model.mtp, model.lm_head))
    target_dense -= emb.numel() * emb.element_size()  # only the looked-up rows are read
    lm = model.lm_head.weight if model.lm_head is not None else emb
    lm_bytes = lm.numel() * lm.element_size()
    draft_ids = spec.draft_vocab_ids(cfg.vocab_size)  # a pruned draft head reads its rows only
    draft_lm_bytes = lm_bytes if draft_ids is None else len(draft_ids) * lm.shape[1] * lm.element_size()
    gamma = spec.gamma
    target_experts = int(sum(distinct.get(id(m), 0) * weights.expert(m) for m in target_moes))
    draft_dense = draft_experts = draft_kv = 0
    if gamma and model.mtp is not None:
        mtp_dense, mtp_moes = weights.split(model.mtp)
        draft_dense = gamma * mtp_dense
        draft_experts = int(gamma * sum(distinct.get(id(m), 0) * weights.expert(m) for m in mtp_moes))
        win = spec.window_for(context)
        keys = context if win is None else min(context, win.sink + win.window)
        draft_kv = gamma * keys * cfg.draft_kv_bytes_per_token(kv_elt) * max(cfg.num_mtp_attention_layers, 1)
    return StepBytes(
        target_dense=target_dense, target_experts=target_experts,
        target_kv=context * cfg.target_kv_bytes_per_token(kv_elt), states=state_bytes(cfg, elt),
        lm_head=lm_bytes + gamma * draft_lm_bytes, draft_dense=draft_dense, draft_experts=draft_experts, draft_kv=draft_kv,
    )


# (block, warps, programs per SM, unroll) of the streaming read: the three fastest of a 112-launch sweep
# on the H200 (4.45, 4.44, 4.40 TB/s over 4 GiB; 1826005)
READ_CONFIGS = ((2048, 8, 8, 4), (2048, 8, 4, 4), (2048, 8, 16, 1))
# One round's median of 20 reads moved 4.27-4.43 TB/s between runs on one machine; a floor over a
# low reading is too high and flatters T_iter / floor, so each
# timing takes the best of rounds interleaved over the configurations.
BANDWIDTH_ROUNDS = 3


# the host reads ~20x slower than HBM: a smaller buffer (still far past the caches) and fewer reps
# keep its measurement to seconds
HOST_GIB, HOST_REPS = 0.5, 5


def _median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median time of ``fn()`` over ``reps`` runs after 3 warm-ups: CUDA events on a GPU, the wall
    clock on the host (whose ops return when done)."""
    times = []
    for _ in range(reps + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times = sorted(times[3:])
    return times[len(times) // 2]


def best_rates(timers: dict[str, Callable[[], float]], nbytes: dict[str, float], rounds: int) -> dict[str, float]:
    """Bytes per second of each timer (seconds per call of ``nbytes[name]`` bytes) at its best of
    ``rounds`` calls, the rounds interleaved over the timers, so that one slow moment of the GPU
    lowers one round of each rather than every reading of one timer."""
    best = dict.fromkeys(timers, 0.0)
    for _ in range(rounds):
        for name, seconds in timers.items():
            best[name] = max(best[name], nbytes[name] / seconds())
    return best


def _streaming_reads(words: torch.Tensor, reps: int) -> dict[str, Callable[[], float]]:
    """Timers (seconds per call) of the streaming reads of ``words`` (int32): on a GPU
    ``stream_xor`` in each of ``READ_CONFIGS``; on the host a torch sum over int64 words, one add
    per 8 bytes read, memory-bound."""
    device = words.device
    if device.type != "cuda":
        as_int64 = words.view(torch.int64)
        return {"torch sum of int64 words": lambda: _median_seconds(as_int64.sum, reps, device)}
    from wmtp.kernels.stream import stream_xor

    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def read(block: int, warps: int, per_sm: int, unroll: int) -> Callable[[], float]:
        return lambda: _median_seconds(lambda: stream_xor(words, per_sm * sms, block, warps, unroll), reps, device)

    return {f"block {b}, {w} warps, {p}/SM, unroll {u}": read(b, w, p, u) for b, w, p, u in READ_CONFIGS}


def measure_bandwidth(device: torch.device, gib: float | None = None, reps: int | None = None,
                      rounds: int = BANDWIDTH_ROUNDS) -> dict:
    """Memory bandwidth of ``gib`` GiB on ``device`` (default 4 GiB and 20 reps on a GPU,
    ``HOST_GIB`` and ``HOST_REPS`` on the host): ``read_bytes_per_s``, the floor's denominator
    (DESIGN §6: read bandwidth), is the fastest streaming read (``_streaming_reads``);
    ``copy_bytes_per_s`` (a copy, bytes read + written) is kept beside it (the floors of results
    written before f55cfea divided by it). Each is the best of ``rounds`` medians of ``reps``."""
    on_gpu = device.type == "cuda"
    gib = gib if gib is not None else 4.0 if on_gpu else HOST_GIB
    reps = reps if reps is not None else 20 if on_gpu else HOST_REPS
    n = int(gib * 2**30) // 8 * 8
    src = torch.zeros(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timers = {"copy": lambda: _median_seconds(lambda: dst.copy_(src), reps, device),
              **_streaming_reads(src.view(torch.int32), reps)}
    rates = best_rates(timers, {k: 2 * n if k == "copy" else n for k in timers}, rounds)
    del src, dst, timers  # the timers hold views of the buffers
    if on_gpu:
        torch.cuda.empty_cache()
    copy = rates.pop("copy")
    return {"read_bytes_per_s": max(rates.values()), "read_by_config": rates, "copy_bytes_per_s": copy, "gib": gib,
            "rounds": rounds, "reps": reps}


class ExpertCounter:
    """Wraps the backend's routed-expert ops, ``moe`` (softmax routing) and ``relu2_moe``
    (Nemotron-H's sigmoid routing), to count the distinct experts each call routes to, per MoE
    block: a call names its block only by the router weight it passes, so blocks are looked up by
    that weight's storage. Adds a host sync per call: use it on untimed iterations only."""

    def __init__(self, model: TargetLM) -> None:
        self.model = model
        self.by_router = {m.gate.weight.data_ptr(): m for m in moe_blocks(model)}
        self.counts: dict[int, list[int]] = {}

    def _count(self, router_weight: torch.Tensor, chosen: torch.Tensor) -> None:
        block = self.by_router[router_weight.data_ptr()]
        self.counts.setdefault(id(block), []).append(int(torch.unique(chosen).numel()))

    def __enter__(self) -> "ExpertCounter":
        backend = self.model.backend
        moe, relu2_moe = backend.moe, backend.relu2_moe  # the class's methods, bound

        def counted_moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up, down, top_k: int,
                        norm_topk_prob: bool, shared=None) -> torch.Tensor:
            # softmax keeps the logits' order: their top-k are the routed experts
            self._count(router_weight, torch.topk(F.linear(x, router_weight).float(), top_k, dim=-1).indices)
            return moe(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)

        def counted_relu2_moe(x: torch.Tensor, routing: SigmoidRouting, up, down, latent_proj=None) -> torch.Tensor:
            self._count(routing.weight, sigmoid_route(x, routing)[1])
            return relu2_moe(x, routing, up, down, latent_proj)

        backend.moe, backend.relu2_moe = counted_moe, counted_relu2_moe
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.backend.moe, self.model.backend.relu2_moe  # back to the class's methods

    def mean_distinct(self) -> dict[int, float]:
        return {k: sum(v) / len(v) for k, v in self.counts.items()}
