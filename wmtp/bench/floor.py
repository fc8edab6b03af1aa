"""The bytes floor of one speculative iteration (DESIGN §6) and the bandwidth it is divided by.

Floor = bytes every kernel must read at least / HBM read bandwidth measured on the same GPU in the
same run (a streaming read; ``measure_bandwidth``). Counted per iteration (γ = d − 1):
- verify (one target forward of d tokens): every dense target weight, the experts the d tokens
  actually route to (distinct, per layer, measured), the lm_head once, the target KV of S tokens,
  the recurrent states;
- draft (γ MTP forwards: γ − 1 steps + the extend): each reads the MTP layer's dense weights, its
  routed experts (measured), the lm_head, and the draft KV it attends to: S slots (native) or
  sink + W (windowed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from wmtp.engine.config import SpecConfig
from wmtp.errors import WmtpError
from wmtp.models.layers import SparseMoE
from wmtp.models.loader import quant_groups
from wmtp.models.model import CausalLM


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


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


class _Weights:
    """Bytes of a model's weights as a kernel must read them: float tensors whole; a quantized
    weight as its format counts it (``QuantFormat.weight_bytes``: packed values and every scale
    level of each checkpoint weight, not the model's per-row copies of per-tensor scales)."""

    def __init__(self, model: CausalLM) -> None:
        params = dict(model.named_parameters())
        self.quantized: set[int] = set()
        self.bytes_of: dict[int, int] = {}  # id(weight parameter) -> its quantized bytes (per expert for experts)
        for g in quant_groups(model):
            self.quantized |= {id(params[f"{g.param}.{s}"]) for s in g.fmt.suffixes}
            w = id(params[f"{g.param}.weight"])
            self.bytes_of[w] = self.bytes_of.get(w, 0) + g.fmt.weight_bytes(g.n, g.k)

    def dense(self, params) -> int:
        """Bytes of ``params`` (a module's), the quantized ones as their format counts them."""
        params = list(params)
        return (_nbytes(p for p in params if id(p) not in self.quantized)
                + sum(self.bytes_of.get(id(p), 0) for p in params))

    def expert(self, moe: torch.nn.Module) -> int:
        """Bytes of one routed expert (gate, up and down)."""
        e = moe.experts
        if e.quant is not None:
            return self.bytes_of[id(e.gate_up_proj.weight)] + self.bytes_of[id(e.down_proj.weight)]
        return (e.gate_up_proj[0].numel() + e.down_proj[0].numel()) * e.gate_up_proj.element_size()

    def split(self, module: torch.nn.Module) -> tuple[int, list[torch.nn.Module]]:
        """(bytes of non-routed-expert weights, the module's MoE blocks)."""
        moes = [m for m in module.modules() if isinstance(m, SparseMoE)]
        expert_params = {id(p) for m in moes for p in m.experts.parameters()}
        return self.dense(p for p in module.parameters() if id(p) not in expert_params), moes


def step_bytes(model: CausalLM, spec: SpecConfig, context: int, distinct: dict[int, float], elt: int) -> StepBytes:
    """``distinct``: mean distinct experts per forward, keyed by ``id`` of each MoE block."""
    cfg = model.config
    if not isinstance(model, CausalLM):
        raise WmtpError(f"bytes floor: not counted for {cfg.model_type} yet (its MoE blocks hold experts per expert)")
    body = model.model
    emb = body.embed_tokens.weight
    weights = _Weights(model)
    target_dense, target_moes = weights.split(body)
    target_dense -= emb.numel() * emb.element_size()  # only the looked-up rows are read
    lm = model.lm_head.weight if model.lm_head is not None else emb
    lm_bytes = lm.numel() * lm.element_size()
    gamma = spec.gamma
    target_experts = int(sum(distinct.get(id(m), 0) * weights.expert(m) for m in target_moes))
    states = sum(l.conv_state[0].numel() * l.conv_state.element_size() + l.ssm_state[0].numel() * l.ssm_state.element_size()
                 for l in model.recurrent_layers())
    draft_dense = draft_experts = draft_kv = 0
    if gamma and model.mtp is not None:
        mtp_dense, mtp_moes = weights.split(model.mtp)
        draft_dense = gamma * mtp_dense
        draft_experts = int(gamma * sum(distinct.get(id(m), 0) * weights.expert(m) for m in mtp_moes))
        win = spec.window_for(context)
        keys = context if win is None else min(context, win.sink + win.window)
        draft_kv = gamma * keys * cfg.draft_kv_bytes_per_token(elt) * max(cfg.num_mtp_attention_layers, 1)
    return StepBytes(
        target_dense=target_dense, target_experts=target_experts,
        target_kv=context * cfg.target_kv_bytes_per_token(elt), states=states,
        lm_head=(1 + gamma) * lm_bytes, draft_dense=draft_dense, draft_experts=draft_experts, draft_kv=draft_kv,
    )


# (block, warps, programs per SM, unroll) of the streaming read: the three fastest of a 112-launch sweep
# on the H200 (4.45, 4.44, 4.40 TB/s over 4 GiB; 1826005)
READ_CONFIGS = ((2048, 8, 8, 4), (2048, 8, 4, 4), (2048, 8, 16, 1))
# One round's median of 20 reads moved 4.27-4.43 TB/s between runs on one machine; a floor over a
# low reading is too high and flatters T_iter / floor, so each
# timing takes the best of rounds interleaved over the configurations.
BANDWIDTH_ROUNDS = 3


def _median_seconds(fn, reps: int) -> float:
    """Median GPU time of ``fn()`` over ``reps`` runs after 3 warm-ups (CUDA events)."""
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
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


def measure_bandwidth(device: torch.device, gib: float = 4.0, reps: int = 20, rounds: int = BANDWIDTH_ROUNDS) -> dict:
    """HBM bandwidth of ``gib`` GiB on ``device``: ``read_bytes_per_s``, the floor's denominator
    (DESIGN §6: read bandwidth), is the fastest streaming read (``stream_xor``) of ``READ_CONFIGS``;
    ``copy_bytes_per_s`` (a device-to-device copy, bytes read + written) is kept beside it (the
    floors of results written before f55cfea divided by it). Each is the best of ``rounds`` medians of ``reps``."""
    from wmtp.kernels.stream import stream_xor

    n = int(gib * 2**30) // 4 * 4
    src = torch.zeros(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    words, sms = src.view(torch.int32), torch.cuda.get_device_properties(device).multi_processor_count

    def read(block: int, warps: int, per_sm: int, unroll: int) -> Callable[[], float]:
        return lambda: _median_seconds(lambda: stream_xor(words, per_sm * sms, block, warps, unroll), reps)

    timers = {"copy": lambda: _median_seconds(lambda: dst.copy_(src), reps),
              **{f"block {b}, {w} warps, {p}/SM, unroll {u}": read(b, w, p, u) for b, w, p, u in READ_CONFIGS}}
    rates = best_rates(timers, {k: 2 * n if k == "copy" else n for k in timers}, rounds)
    del src, dst, words
    torch.cuda.empty_cache()
    copy = rates.pop("copy")
    return {"read_bytes_per_s": max(rates.values()), "read_by_config": rates, "copy_bytes_per_s": copy, "gib": gib,
            "rounds": rounds, "reps": reps}


class ExpertCounter:
    """Wraps ``model.backend.moe`` to count distinct routed experts per call, per MoE block.
    Adds a host sync per call: use it on untimed iterations only."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.by_router = {m.gate.weight.data_ptr(): m for m in model.modules()
                          if hasattr(m, "experts") and hasattr(m, "gate")}
        self.counts: dict[int, list[int]] = {}
        self._orig = model.backend.moe

    def __enter__(self) -> "ExpertCounter":
        def moe(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared=None):
            top = torch.topk(torch.nn.functional.linear(x, router_weight).float(), top_k, dim=-1).indices
            block = self.by_router[router_weight.data_ptr()]
            self.counts.setdefault(id(block), []).append(int(torch.unique(top).numel()))
            return self._orig(x, router_weight, gate_up, down, top_k, norm_topk_prob, shared)

        self.model.backend.moe = moe
        return self

    def __exit__(self, *exc) -> None:
        del self.model.backend.moe  # back to the class method

    def mean_distinct(self) -> dict[int, float]:
        return {k: sum(v) / len(v) for k, v in self.counts.items()}
