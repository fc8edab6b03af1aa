"""Prefill once, decode under many speculative configs: a snapshot of one request's prefilled state
and forks of it into fresh engines (benchmark-only; the acceptance sweeps on CPU).

A long prefill costs far more than decoding on a CPU, and it is the same for every SpecConfig: the
target's KV / recurrent state do not depend on the mode (DESIGN §1), and a draft slot's K/V are
per-position projections of (embed(x_{p+1}), h_p), independent of which keys the draft attends to
(DESIGN §4). So ``take_snapshot`` runs the target prefill plus a full-length (native) draft prefill
once, stops the request right before its first token, and keeps everything BY POSITION:

- target K/V at positions 0..n−1 (every full-attention layer) and the GDN conv/SSM states;
- draft K/V at slots 0..n−2 (slot n−1 is written by the first-token draft step);
- h_0..h_{n−1}, the target's final hiddens (h_{n−1} yields x_n and, with embed(x_n), the first
  draft step; all of them feed teacher-forced draft probes without a second prefill).

``fork`` builds a fresh engine for any SpecConfig (dense, native, windowed, ring or not), writes the
snapshot into that engine's own pools, and hands the request to the engine's own ``_first_tokens``,
which samples x_n and runs the first draft step under the config's window. From there on the engine
decodes as usual. Invariant (tested against from-scratch runs): a fork emits the same tokens and
acceptance histogram as a fresh engine given the same prompt, SpecConfig and SamplingParams.

Engines bind their pools to the model's layers on construction, so only the most recently built
engine (snapshot or fork) may be stepped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.engine import Engine, Request
from wmtp.engine.sampling import SamplingParams
from wmtp.models.base import TargetLM


@dataclass
class PrefillSnapshot:
    """One prompt's prefilled state, by position (independent of any engine's slot layout)."""

    prompt: list[int]
    hidden: torch.Tensor  # h_0..h_{n-1} [n, hidden]
    target_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: K, V at positions 0..n-1
    draft_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per MTP attention layer: K, V at slots 0..n-2
    states: list[tuple[torch.Tensor, torch.Tensor]]  # per GDN layer: conv state, SSM state after x_{n-1}


@dataclass(frozen=True)
class IterationTrace:
    """One speculative iteration of a forked request: ``context`` = L committed tokens when it
    started (so draft i guessed sequence position L + i − 1), the drafts, and how many were accepted."""

    context: int
    drafts: tuple[int, ...]
    accepted: int


class _PrefillOnly(Engine):
    """Engine that stops a request once its prefill is complete: ``_first_tokens`` does nothing, so
    the request sits at prefilled == n; every prefill chunk's target hiddens are kept in ``hidden``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hidden: list[torch.Tensor] = []

    def _draft_prefill(self, chunks, parts) -> None:
        self.hidden.extend(parts)
        super()._draft_prefill(chunks, parts)

    def _first_tokens(self, reqs: list[Request]) -> None:
        return None


class TracingEngine(Engine):
    """Engine that also logs every iteration's (context, drafts, accepted) per request id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trace: dict[int, list[IterationTrace]] = {}

    def _accept(self, req: Request, drafts: list[int], qs: list, logits: torch.Tensor) -> tuple[int, int]:
        a, bonus = super()._accept(req, drafts, qs, logits)
        self.trace.setdefault(req.id, []).append(IterationTrace(len(req.tokens), tuple(drafts), a))
        return a, bonus


def _target_slots(eng: Engine, req: Request, n: int) -> torch.Tensor:
    return eng._target_ctx([req], [0], [n]).write_slots


def _draft_slots(eng: Engine, req: Request, positions: torch.Tensor) -> torch.Tensor:
    return eng._draft_ctx([req], [0], [1], [None]).kv_slots.slots(0, positions)


@torch.no_grad()
def take_snapshot(model: TargetLM, prompt: list[int], prefill_chunk: int = 512, page_size: int = 16) -> PrefillSnapshot:
    """Prefill ``prompt`` (target + full-length draft prefill, chunked like the engine) and keep its state."""
    n = len(prompt)
    if model.mtp is None:
        raise ValueError("take_snapshot: the model has no MTP head")
    spec = SpecConfig(mode="native", num_draft_tokens=2)  # full-length draft pool: every slot's K/V
    eng = _PrefillOnly(model, spec, EngineConfig(max_model_len=n + 1, max_num_seqs=1, page_size=page_size,
                                                 prefill_chunk=prefill_chunk))
    req = eng.requests[eng.add_request(list(prompt), SamplingParams(max_tokens=1))]
    while req.prefilled < n:
        eng.step()
    slots = _target_slots(eng, req, n)
    target_kv = [(a.k_cache[slots].clone(), a.v_cache[slots].clone()) for a in model.attention_layers()]
    dslots = _draft_slots(eng, req, torch.arange(n - 1, device=eng.device))
    draft_kv = [(a.k_cache[dslots].clone(), a.v_cache[dslots].clone()) for a in model.mtp_attention_layers()]
    s = req.alloc.state_slot
    states = [(g.conv_state[s].clone(), g.ssm_state[s].clone()) for g in model.recurrent_layers()] if s is not None else []
    hidden = torch.cat(eng.hidden)
    assert hidden.shape[0] == n and torch.equal(hidden[-1:], req.pending_hidden)
    return PrefillSnapshot(list(prompt), hidden, target_kv, draft_kv, states)


def _kept_draft_positions(spec: SpecConfig, n: int) -> list[int]:
    """Draft slots 0..n−2 the fork writes: all of them, except that a ring keeps only the slots some
    future query can read (as the engine's sparsified prefill does), so no two share a ring slot."""
    window = spec.window_for(n)
    if not spec.uses_ring or window is None:
        return list(range(n - 1))
    return [p for a, b in window.ever_read_runs(0, n - 1, n) for p in range(a, b)]


@torch.no_grad()
def fork(model: TargetLM, snap: PrefillSnapshot, spec: SpecConfig, params: SamplingParams, page_size: int = 16,
         prefill_chunk: int = 512) -> tuple[TracingEngine, Request]:
    """A fresh engine for ``spec`` holding ``snap``'s request right after its first token (x_n emitted,
    d_1 drafted under ``spec``'s window). Step the engine until ``has_unfinished()`` is False."""
    n = len(snap.prompt)
    eng = TracingEngine(model, spec, EngineConfig(max_model_len=n + params.max_tokens, max_num_seqs=1,
                                                  page_size=page_size, prefill_chunk=prefill_chunk))
    req = eng.requests[eng.add_request(list(snap.prompt), params)]
    eng._admit_waiting()
    slots = _target_slots(eng, req, n)
    for attn, (k, v) in zip(model.attention_layers(), snap.target_kv):
        attn.k_cache[slots], attn.v_cache[slots] = k, v
    if spec.speculative:
        keep = torch.tensor(_kept_draft_positions(spec, n), dtype=torch.long, device=eng.device)
        dslots = _draft_slots(eng, req, keep)
        for attn, (k, v) in zip(model.mtp_attention_layers(), snap.draft_kv):
            attn.k_cache[dslots], attn.v_cache[dslots] = k[keep], v[keep]
    for g, (conv, ssm) in zip(model.recurrent_layers(), snap.states):
        g.conv_state[req.alloc.state_slot], g.ssm_state[req.alloc.state_slot] = conv, ssm
    req.prefilled, req.pending_hidden = n, snap.hidden[-1:].clone()
    eng._first_tokens([req])
    return eng, req


@dataclass
class ForkRun:
    """What one forked decode produced."""

    tokens: list[int]  # generated tokens (x_n onwards)
    hist: list[int]  # H[n], n = 0..γ (empty for dense)
    trace: list[IterationTrace] = field(default_factory=list)
    seconds: float = 0.0


def run_fork(model: TargetLM, snap: PrefillSnapshot, spec: SpecConfig, params: SamplingParams, **kw) -> ForkRun:
    """``fork`` then decode to completion."""
    import time

    t0 = time.perf_counter()
    eng, req = fork(model, snap, spec, params, **kw)
    while eng.has_unfinished():
        eng.step()
    hist = list(req.metrics.hist) if spec.speculative else []
    return ForkRun(req.tokens[len(snap.prompt):], hist, eng.trace.get(req.id, []), time.perf_counter() - t0)
