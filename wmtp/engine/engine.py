"""The engine: requests, scheduler and the speculative iteration (DESIGN §2).

Per request, between iterations: committed tokens x_0..x_{L-1}; the target has seen x_0..x_{L-2}
(KV at positions 0..L-2, recurrent state after x_{L-2}); draft slots are written up to L-2; the
first draft token d_1 and the MTP output at slot L-2 are in hand. One iteration: γ−1 draft steps,
one verify forward of d = γ+1 tokens, acceptance + bonus, GDN rollback, draft-extend over the
accepted slots with the target's true hidden states (which also yields the next d_1).
Greedy batches run the same iteration from static buffers replayed as CUDA graphs
(``wmtp.engine.graphs``), each launched before the previous one's results are read (overlap: one
iteration in flight while the batch is unchanged); sampling batches, and any device without
graphs, run it eagerly.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.depth import DepthController
from wmtp.engine.graphs import BatchRow, DecodeGraphs
from wmtp.engine.memory import Allocation, MemoryManager
from wmtp.engine.metrics import EngineMetrics, RequestMetrics
from wmtp.engine.prefix_cache import PrefixCache
from wmtp.engine.sampling import SamplingParams, accept_greedy, accept_speculative, filtered_probs, sample
from wmtp.errors import WmtpError
from wmtp.models.context import ForwardContext, PagedSlots, RingSlots, to_device
from wmtp.models.base import TargetLM
from wmtp.quant import is_fp8


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: requests are compared and looked up by object, never by value
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    alloc: Allocation | None = None
    page_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # device block-table rows (target, draft)
    prefilled: int = 0  # prompt positions the target has processed
    pending_hidden: torch.Tensor | None = None  # h of the last prefilled position (draft lags by one)
    draft_token: int | None = None  # d_1
    draft_q: torch.Tensor | None = None  # its draft distribution (sampling mode)
    draft_hidden: torch.Tensor | None = None  # MTP output at slot L-2
    finish_reason: str | None = None
    new_tokens: list[int] = field(default_factory=list)  # emitted since the last step() (streaming)
    reported: bool = False  # its finish went out in a StepOutput
    # while waiting: per prefilling request id, the point this prompt could resume from once that
    # request's prefill passes it (``PrefixCache.resume_point``; fixed per pair, so computed once)
    resume_after: dict[int, int] = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class Engine:
    """Continuous batching over one model; ``step()`` advances every running request once."""

    def __init__(self, model: TargetLM, spec: SpecConfig, eng: EngineConfig) -> None:
        if spec.speculative and model.mtp is None:
            raise WmtpError(f"mode {spec.mode!r} needs an MTP head; this model has none (use mode='dense')")
        self.model, self.spec, self.eng = model, spec, eng
        ids = spec.draft_vocab_ids(model.config.vocab_size)
        self.draft_head = None if ids is None else model.draft_head(ids)  # the pruned draft lm_head
        p = model.embed_weight
        self.device, self.dtype = p.device, p.dtype
        self.memory = MemoryManager(model.config, spec, eng, self.dtype)
        self.memory.bind(model, self.device)
        if is_fp8(self.memory.kv_dtype):
            self._warn_unscaled_kv()
        self.prefix = PrefixCache(self.memory, eng)  # admission and release go through it, cache on or off
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.stop_ids = set(model.config.eos_token_ids)
        self.metrics = EngineMetrics(spec.gamma)
        # Benchmark-only (DESIGN §6): accept exactly this many drafts per iteration (at most γ),
        # whatever the tokens. Never set by the generation API.
        self.forced_accept: int | None = None
        self.depth = DepthController(spec.gamma) if spec.adaptive else None  # num_draft_tokens="auto"
        if self.depth is not None and model.tp is not None:  # a shard: every rank must choose each γ alike
            from wmtp.engine.distributed import slowest_rank

            self.depth.agree = slowest_rank
        # decode graphs per (batch size, γ), built on first use
        self.graphs: dict[tuple[int, int], DecodeGraphs] = {}
        self._graph_mode = self._resolve_graph_mode()
        self._graph_pool = torch.cuda.graph_pool_handle() if self._graph_mode == "capture" else None
        self.phase_timer = None  # benchmark-only PhaseTimer (wmtp/engine/phases.py); None costs nothing
        self.overlap = eng.overlap  # static-path iterations overlap (off while a phase timer is set)
        self._inflight: _InFlight | None = None  # a launched static-path iteration not yet collected
        self._emitted: list[Request] = []  # requests a collect emitted for during this step()
        self._last_collect = 0.0

    def _warn_unscaled_kv(self) -> None:
        layers = self.model.attention_layers() + (self.model.mtp_attention_layers() if self.spec.speculative else [])
        unscaled = sum(not layer.kv_scale_loaded for layer in layers)
        if unscaled:
            logging.getLogger("wmtp").warning(
                "kv_cache_dtype=fp8_e4m3: %d of %d attention layers have no k_scale / v_scale in the checkpoint; "
                "they use 1.0", unscaled, len(layers))

    # ---- request lifecycle ---------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams) -> int:
        if not isinstance(params, SamplingParams):
            raise WmtpError(f"params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise WmtpError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise WmtpError(f"prompt token ids must be ints in [0, vocab_size={vocab}); got e.g. {bad[:3]}")
        self.memory.check_fits_ever(len(prompt), params.max_tokens)
        rid = next(self._ids)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        req = Request(rid, list(prompt), params, RequestMetrics(self.spec.gamma, time.perf_counter()), gen,
                      tokens=list(prompt))
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is not None and req.status != Status.FINISHED:
            self._finish(req, "abort")

    def stats(self) -> dict:
        """Engine-wide metrics (DESIGN §6) plus the pools' bytes and current use and the prefix cache's counters."""
        return {**self.metrics.to_dict(), "memory_bytes": self.memory.bytes_report(), "memory_use": self.memory.usage(),
                "prefix_cache": self.prefix.stats()}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, reason: str) -> None:
        if req.status == Status.WAITING:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
        if req.alloc is not None:
            self.prefix.release(req.id)
            req.alloc = req.page_rows = None
        req.status, req.finish_reason = Status.FINISHED, reason
        req.metrics.finish_time = time.perf_counter()
        self.metrics.record_finish(req.metrics)
        req.pending_hidden = req.draft_hidden = req.draft_q = None

    # ---- scheduling ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Admit what fits, run one prefill chunk per prefilling request, one iteration for all
        decoding requests; return what each request emitted."""
        if self.model.bound_pools is not self.memory:  # another engine over these weights bound its pools
            self.memory.attach(self.model)
        self._emitted = []
        self._admit_waiting()
        prefilling = [r for r in self.running if r.status == Status.PREFILL]
        if self._inflight is not None and (prefilling or self._inflight.reqs != self._decoding()):
            self._drain()  # the batch changes: collect the overlapped iteration first
        touched = self._prefill_batch(prefilling) if prefilling else []
        seen = {id(r) for r in touched}
        decoding = [r for r in self._decoding() if id(r) not in seen]
        if decoding:
            self._iteration(decoding)
        outs, done = [], set()
        for req in touched + self._emitted + decoding:
            if id(req) in done:
                continue
            done.add(id(req))
            if req.new_tokens or (req.status == Status.FINISHED and not req.reported):
                outs.append(StepOutput(req.id, req.new_tokens, req.status == Status.FINISHED, req.finish_reason))
                req.new_tokens = []
                req.reported = req.status == Status.FINISHED
        return outs

    def _decoding(self) -> list[Request]:
        return [r for r in self.running if r.status == Status.DECODE]

    def _admit_waiting(self) -> None:
        """Admit waiting requests in arrival order while the pools can hold their worst case. A
        prefix-cache hit resumes the prefill at its snapshot with h of the position before it."""
        while self.waiting:
            req = self.waiting[0]
            if self._awaits_prefix(req):
                break
            got = self.prefix.admit(req.id, req.prompt, len(req.prompt) + req.params.max_tokens)
            if got is None:
                break
            self.waiting.popleft()
            req.alloc, req.prefilled, req.pending_hidden = got
            req.metrics.cached_tokens = req.prefilled
            req.metrics.memory_bytes = self.memory.allocation_bytes(req.alloc)
            # Pages are reserved for the worst case up front, so each request's block-table row is
            # built once here: no per-iteration host work that grows with the context.
            # int32: the layout the attention kernels read, so no per-forward cast
            rows = [to_device(p, self.device, torch.int32) if p else None
                    for p in (req.alloc.pages, req.alloc.draft_pages)]
            req.page_rows = (rows[0], rows[1])
            req.status = Status.PREFILL
            self.running.append(req)

    def _awaits_prefix(self, req: Request) -> bool:
        """Whether ``req`` waits for a prefilling request to pass a prefix they share, so that it
        resumes from those pages and snapshot instead of computing them again: B users sending one
        document at once prefill it once (SGLang's in-batch prefix caching does the same). The wait
        ends within that request's prefill, which the waiting one does not delay. A prefix shorter
        than one prefill chunk is not waited for: computing it again costs less than a step."""
        if not self.prefix.enabled:
            return False
        for other in self.running:
            if other.status != Status.PREFILL:
                continue
            if other.id not in req.resume_after:
                point = self.prefix.resume_point(other.prompt, req.prompt)
                req.resume_after[other.id] = point if point >= self.eng.prefill_chunk else 0
            if other.prefilled < req.resume_after[other.id]:
                return True
        return False

    # ---- contexts ------------------------------------------------------------------------------
    def _target_ctx(self, reqs: list[Request], starts: list[int], lens: list[int], record: bool = False) -> ForwardContext:
        table = _block_table([r.page_rows[0] for r in reqs])
        slots = [r.alloc.state_slot for r in reqs]
        states = to_device(slots, self.device) if slots[0] is not None else None
        return ForwardContext(starts, lens, PagedSlots(table, self.eng.page_size), states,
                              device=self.device, record_states=record)

    def _draft_ctx(self, reqs: list[Request], starts: list[int], lens: list[int], windows) -> ForwardContext:
        if self.spec.uses_ring:
            base = to_device([self._ring_base(r) for r in reqs], self.device)
            slots = RingSlots(base, self.spec.draft_window, self.spec.num_draft_tokens)
        else:
            slots = PagedSlots(_block_table([r.page_rows[1] for r in reqs]), self.eng.page_size)
        return ForwardContext(starts, lens, slots, device=self.device, windows=windows)

    def _ring_base(self, req: Request) -> int:
        return req.alloc.ring * self.spec.ring_size

    # ---- prefill -------------------------------------------------------------------------------
    def _prefill_batch(self, reqs: list[Request]) -> list[Request]:
        """One target forward over the next prompt chunk of as many prefilling requests as fit in
        ``prefill_chunk`` tokens (activations stay bounded by it); returns the requests touched."""
        budget, chunks = self.eng.prefill_chunk, []
        for req in reqs:
            if budget == 0:
                break
            s = req.prefilled
            e = self.prefix.chunk_end(len(req.prompt), s, min(len(req.prompt), s + budget))
            chunks.append((req, s, e))
            budget -= e - s
        batch = [c[0] for c in chunks]
        ids = to_device([t for r, s, e in chunks for t in r.prompt[s:e]], self.device)
        hidden = self.model(ids, self._target_ctx(batch, [s for _, s, _ in chunks], [e - s for _, s, e in chunks]))
        parts = hidden.split([e - s for _, s, e in chunks])
        if self.spec.speculative:
            self._draft_prefill(chunks, parts)
        for (req, _, e), h in zip(chunks, parts):
            req.prefilled = e
            if not self.spec.speculative:
                req.pending_hidden = h[-1:]
            self.prefix.record_chunk(req.id, req.prompt, e, req.pending_hidden)
        self._first_tokens([r for r in batch if r.prefilled == len(r.prompt)])
        return batch

    def _first_tokens(self, reqs: list[Request]) -> None:
        """Sample x_n for requests whose prefill is complete; then draft slot n-1 = (embed(x_n),
        h_{n-1}) gives d_1, batched over them."""
        if not reqs:
            return
        logits = self.model.compute_logits(torch.cat([r.pending_hidden for r in reqs]))
        live = []
        for b, req in enumerate(reqs):
            first = self._sample_target(req, logits[b : b + 1])[0]
            req.metrics.first_token_time = time.perf_counter()
            if self._emit(req, [first]):
                req.status = Status.DECODE
                live.append(req)
        if live and self.spec.speculative:
            ctx = self._draft_ctx(live, [len(r.prompt) - 1 for r in live], [1] * len(live),
                                  [self.spec.window_for(len(r.tokens)) for r in live])
            ids = to_device([r.tokens[-1] for r in live], self.device)
            out = self.model.mtp_forward(ids, torch.cat([r.pending_hidden for r in live]), ctx)
            for b, req in enumerate(live):
                self._set_draft(req, out[b : b + 1])
        for req in reqs:
            req.pending_hidden = None

    def _draft_prefill(self, chunks: list[tuple[Request, int, int]], parts: tuple[torch.Tensor, ...]) -> None:
        """Draft slots whose next token is in the prompt: [s-1, e-1) per chunk (h_{s-1} is held from
        the previous chunk, so the draft lags the target by one position). A slot's K/V are its own
        (embedding, hidden) pair's projections and no prompt slot's output is ever read (the first
        draft forward, at the last slot, runs in ``_first_tokens``), so the prefill only writes K/V,
        in one batched call and with no attention (DESIGN §4): every slot for full-attention requests,
        for windowed ones only the slots some future query can read (a resumed request's too:
        ``PrefixCache.draft_runs``)."""
        segs = []
        for (req, s, e), h in zip(chunks, parts):
            lo, hi = max(s - 1, 0), e - 1
            hid = h[: e - 1 - s] if s == 0 else torch.cat([req.pending_hidden, h[: e - 1 - s]])
            req.pending_hidden = h[-1:]
            if hi <= lo:
                continue
            window = self.spec.window_for(len(req.prompt))
            runs = [(lo, hi)] if window is None else self.prefix.draft_runs(window, lo, hi, len(req.prompt))
            segs += [(req, a, b, hid[a - lo : b - lo]) for a, b in runs]
        if not segs:
            return
        reqs = [r for r, *_ in segs]
        ids = to_device([t for r, a, b, _ in segs for t in r.prompt[a + 1 : b + 1]], self.device)
        ctx = self._draft_ctx(reqs, [a for _, a, _, _ in segs], [b - a for _, a, b, _ in segs],
                              [self.spec.window_for(len(r.prompt)) for r in reqs])
        self.model.mtp_write_kv(ids, torch.cat([h for *_, h in segs]), ctx)

    # ---- one speculative iteration for a batch -------------------------------------------------
    def _choose_gamma(self, reqs: list[Request]) -> int:
        """This iteration's depth: the spec's, or the adaptive controller's choice (``engine.depth``)."""
        if self.depth is None:
            return self.spec.gamma
        return self.depth.choose([r.metrics.positions for r in reqs], self.metrics.positions)

    def _iteration(self, reqs: list[Request]) -> None:
        gamma = self._choose_gamma(reqs)
        graphs = self._decode_graphs(reqs, gamma)
        if self._inflight is not None and (graphs is None or self._inflight.graphs is not graphs):
            # another graph set (a probe, a new depth) or the eager path: collect the iteration in
            # flight first. The chosen γ stands, so a probe is run rather than chosen and dropped;
            # only a batch that the collected iteration shrank is chosen for again.
            self._drain()
            live = [r for r in reqs if r.status == Status.DECODE]
            if not live:
                return
            if len(live) != len(reqs):
                reqs = live
                gamma = self._choose_gamma(reqs)
                graphs = self._decode_graphs(reqs, gamma)
        if graphs is not None:
            return self._iteration_static(reqs, graphs)
        self._drain()
        self._forget_rows()
        t0 = time.perf_counter()
        if (pt := self.phase_timer) is not None:
            pt.start()
        d = gamma + 1
        lens = [len(r.tokens) for r in reqs]
        drafts = [[r.draft_token] for r in reqs] if gamma else [[] for _ in reqs]
        qs = [[r.draft_q] for r in reqs]
        if gamma > 1:
            windows = [self.spec.window_for(L) for L in lens]
            hid = torch.cat([r.draft_hidden for r in reqs])
            for i in range(1, gamma):  # draft step i writes slot L-2+i and proposes d_{i+1}
                ids = to_device([dr[-1] for dr in drafts], self.device)
                ctx = self._draft_ctx(reqs, [L - 2 + i for L in lens], [1] * len(reqs), windows)
                hid = self.model.mtp_forward(ids, hid, ctx)
                logits = self.model.draft_logits(hid, self.draft_head)
                for b, r in enumerate(reqs):
                    tok, q = self._sample_draft(r, logits[b : b + 1], lens[b] + i)
                    drafts[b].append(tok)
                    qs[b].append(q)
                if pt is not None:
                    pt.mark("draft_fwd")
        # verify: [x_{L-1}, d_1..d_γ] at positions L-1..L+γ-1, one forward for the batch
        ids = to_device([t for r, dr in zip(reqs, drafts) for t in [r.tokens[-1], *dr]], self.device)
        ctx = self._target_ctx(reqs, [L - 1 for L in lens], [d] * len(reqs), record=gamma > 0)
        hidden = self.model(ids, ctx)
        logits = self.model.compute_logits(hidden).view(len(reqs), d, -1)
        hidden = hidden.view(len(reqs), d, -1)
        if pt is not None:
            pt.mark("verify_base")
        results = [self._accept(r, drafts[b], qs[b], logits[b]) for b, r in enumerate(reqs)]
        if gamma:
            self._rollback(reqs, [a for a, _ in results], ctx)
        extend = []
        for b, (r, (a, bonus)) in enumerate(zip(reqs, results)):
            if self._emit(r, drafts[b][:a] + [bonus]) and self.spec.speculative:
                extend.append((r, lens[b], drafts[b][:a] + [bonus], hidden[b, : a + 1]))
        if pt is not None:
            pt.mark("verify_ovh")
        if extend:
            self._extend(extend)
        if pt is not None:
            pt.mark("draft_ctx")
        self._record_iteration(reqs, [a for a, _ in results], t0, gamma)

    def _record_iteration(self, reqs: list[Request], accepted: list[int], t0: float, gamma: int) -> None:
        """T_iter from the start of the draft phase to the end of the draft-extend (DESIGN §6; the
        extend's d_1 read syncs, so the GPU work is done), per request and engine-wide. Overlapped
        iterations pass the later of their launch and the previous collection: the steady-state
        interval between iterations."""
        seconds = time.perf_counter() - t0
        self.metrics.record_iteration(accepted, seconds, gamma)
        for r, a in zip(reqs, accepted):
            r.metrics.record_iteration(a, seconds, gamma)
        if self.depth is not None:
            self.depth.record(len(reqs), gamma, seconds)

    def _accept(self, req: Request, drafts: list[int], qs: list, logits: torch.Tensor) -> tuple[int, int]:
        if self.forced_accept is not None:
            k = min(self.forced_accept, len(drafts))
            return k, int(torch.argmax(logits[k]))
        if req.params.greedy:
            target = torch.argmax(logits, dim=-1)
            return accept_greedy(to_device(drafts, logits.device), target)
        p = filtered_probs(logits.float(), req.params)
        if not drafts:
            return 0, int(sample(p, req.generator)[0])
        q = torch.cat(qs)
        return accept_speculative(to_device(drafts, logits.device), q, p, req.generator)

    def _rollback(self, reqs: list[Request], accepted: list[int], ctx: ForwardContext) -> None:
        """Set each GDN layer's state to the one after the last accepted token (verify index a)."""
        if ctx.recorded:
            self.model.rollback_states(ctx.state_slots, to_device(accepted, self.device), ctx.recorded)

    def _extend(self, items: list[tuple[Request, int, list[int], torch.Tensor]]) -> None:
        """Draft-extend over slots L-1..L-1+a with the TRUE target hiddens; its last output is d_1."""
        reqs = [it[0] for it in items]
        ids = to_device([t for it in items for t in it[2]], self.device)
        hid = torch.cat([it[3] for it in items])
        ctx = self._draft_ctx(reqs, [L - 1 for _, L, _, _ in items], [len(t) for _, _, t, _ in items],
                              [self.spec.window_for(L) for _, L, _, _ in items])
        out = self.model.mtp_forward(ids, hid, ctx)
        ends = to_device(ctx.token_offsets[1:], self.device) - 1
        last = out[ends]
        for b, r in enumerate(reqs):
            self._set_draft(r, last[b : b + 1])

    # ---- the same iteration over static buffers (CUDA graphs) --------------------------------------
    def _resolve_graph_mode(self) -> str:
        """"capture" (CUDA graphs), "eager" (the static-buffer path run without capture: tests) or
        "off". The static path needs the device-side kernels of the triton backend."""
        mode = self.eng.decode_graphs
        if mode == "off" or self.model.backend.name != "triton" or self.dtype == torch.float64:
            return "off"
        if not self.model.static_decode:
            if mode in ("capture", "eager"):
                raise WmtpError(f"EngineConfig.decode_graphs={mode!r}: {self.model.config.model_type} has no static "
                                "decode path yet (some of its ops are not device kernels); use 'auto' or 'off'")
            return "off"
        if mode == "auto":
            return "capture" if self.device.type == "cuda" else "off"
        if mode == "capture" and self.device.type != "cuda":
            raise WmtpError("EngineConfig.decode_graphs='capture' needs a CUDA device")
        return mode

    @contextlib.contextmanager
    def eager_iterations(self) -> Iterator[None]:
        """Run iterations eagerly inside this block (e.g. untimed runs that hook Python-level ops,
        which a graph replay would skip)."""
        saved, self._graph_mode = self._graph_mode, "off"
        try:
            yield
        finally:
            self._graph_mode = saved

    def _decode_graphs(self, reqs: list[Request], gamma: int) -> DecodeGraphs | None:
        """The graph set for this batch and depth, or None where the eager iteration must run: sampling
        requests (their draws use per-request generators on the host), hooks a test replaced, or
        a MoE verify too large for a capturable expert path."""
        if self._graph_mode == "off" or any(not r.params.greedy for r in reqs):
            return None
        hooks = ("_sample_draft", "_accept")  # replaced on the instance or in a subclass (tests, tracing)
        if any(h in vars(self) or getattr(type(self), h) is not getattr(Engine, h) for h in hooks):
            return None
        B, cfg = len(reqs), self.model.config
        capturable = self.model.backend.capturable_moe(B * (gamma + 1), cfg, self.dtype,
                                                       quantized=self.model.quant is not None)
        if self._graph_mode == "capture" and not capturable:
            return None
        if (B, gamma) not in self.graphs:
            self.graphs[B, gamma] = DecodeGraphs(self.model, self.spec, self.eng, self.memory, B,
                                                 capture=self._graph_mode == "capture", pool=self._graph_pool,
                                                 draft_head=self.draft_head, gamma=gamma)
        return self.graphs[B, gamma]

    def _iteration_static(self, reqs: list[Request], graphs: DecodeGraphs) -> None:
        """``_iteration`` for greedy batches, from static buffers: the rows uploaded once per batch,
        the four forwards back to back (positions, acceptance and the extend's inputs derived on
        the device; one graph replay, or four when the phases are timed), results through one copy.
        With ``overlap`` the next iteration of the same batch is launched before this one's results
        are read and emitted."""
        pt = self.phase_timer
        overlap = self.overlap and pt is None
        prev = self._inflight
        if prev is not None and (not overlap or prev.graphs is not graphs or prev.reqs != reqs):
            self._drain()
            prev = None
        t0 = time.perf_counter()
        if pt is not None:
            pt.start()
        self._forget_rows(keep=graphs)
        if graphs.loaded != [r.id for r in reqs]:  # rows built only on a change
            graphs.load(self._batch_rows(reqs))
        graphs.set_forced(self.forced_accept)
        if pt is None:
            graphs.run("iteration" if graphs.drafting else "verify")
        else:  # the forwards replayed apart, each phase timed
            phases = (("chain", "draft_fwd"), ("verify", "verify_base"), ("accept", "verify_ovh"), ("extend", "draft_ctx"))
            for name, phase in phases if graphs.drafting else phases[1:2]:
                graphs.run(name)
                pt.mark(phase)
        launched = _InFlight(graphs, reqs, graphs.fetch(), t0)
        if overlap:
            self._inflight = launched
            if prev is not None:
                self._collect(prev)
            return
        self._collect(launched)
        if pt is not None:
            pt.mark("verify_ovh")  # emission and metrics (host, after the sync)

    def _batch_rows(self, reqs: list[Request]) -> list[BatchRow]:
        ring = self.spec.uses_ring
        return [BatchRow(r.id, r.page_rows[0], r.page_rows[1], self._ring_base(r) if ring else 0, len(r.tokens),
                         r.tokens[-1], r.alloc.state_slot, r.draft_token, r.draft_hidden) for r in reqs]

    @property
    def compiled_steps(self) -> bool | None:
        """Whether the bookkeeping of every decode-graph set built so far ran through torch.compile
        (None: no set was built; results record it)."""
        return all(g.compiled for g in self.graphs.values()) if self.graphs else None

    def _forget_rows(self, keep: DecodeGraphs | None = None) -> None:
        """The graph sets other than ``keep`` reload their rows on next use: the iteration about to
        run advances the requests without them."""
        for g in self.graphs.values():
            if g is not keep:
                g.loaded = None

    def _drain(self) -> None:
        """Collect the iteration in flight, if any."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._collect(inflight)

    def _collect(self, it: _InFlight) -> None:
        """Wait for a launched iteration's results and emit them; requests that finished after it
        was launched (it ran one iteration past their end) are skipped."""
        drafts, target, accepted, d1, lengths = it.graphs.results(it.ticket)
        live, acc = [], []
        for b, r in enumerate(it.reqs):
            if r.status != Status.DECODE:
                continue
            a = accepted[b]
            if self._emit(r, drafts[b][:a] + [target[b][a]]):
                if len(r.tokens) != lengths[b]:
                    raise RuntimeError(f"decode graphs: request {r.id} holds {len(r.tokens)} tokens on the host but "
                                       f"{lengths[b]} on the device")
                if self.spec.speculative:
                    r.draft_token, r.draft_q, r.draft_hidden = d1[b], None, it.graphs.next_hidden[b : b + 1]
            live.append(r)
            acc.append(a)
        self._emitted += live
        start, self._last_collect = max(it.t0, self._last_collect), time.perf_counter()
        if live:
            self._record_iteration(live, acc, start, it.graphs.gamma)

    # ---- draft helpers -------------------------------------------------------------------------
    def _set_draft(self, req: Request, mtp_out: torch.Tensor) -> None:
        req.draft_hidden = mtp_out
        req.draft_token, req.draft_q = self._sample_draft(req, self.model.draft_logits(mtp_out, self.draft_head),
                                                          len(req.tokens))

    def _sample_draft(self, req: Request, logits: torch.Tensor, pos: int) -> tuple[int, torch.Tensor | None]:
        """Propose the token at sequence position ``pos`` (tests override this to inject drafts:
        verification must be lossless whatever the draft proposes)."""
        if req.params.greedy:
            return int(torch.argmax(logits[0])), None
        q = filtered_probs(logits.float(), req.params)
        return int(sample(q, req.generator)[0]), q

    def _sample_target(self, req: Request, logits: torch.Tensor) -> list[int]:
        if req.params.greedy:
            return torch.argmax(logits, dim=-1).tolist()
        return sample(filtered_probs(logits.float(), req.params), req.generator).tolist()

    # ---- emission ------------------------------------------------------------------------------
    def _emit(self, req: Request, tokens: list[int]) -> bool:
        """Append tokens, cutting at a stop token or max_tokens; returns True if still running."""
        p = req.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.stop_ids)
        for t in tokens:
            req.tokens.append(t)
            req.new_tokens.append(t)
            req.metrics.num_generated += 1
            if t in stops:
                self._finish(req, "stop")
                return False
            if req.num_generated >= p.max_tokens:
                self._finish(req, "length")
                return False
        return True


@dataclass
class _InFlight:
    """A static-path iteration launched and not yet collected."""

    graphs: DecodeGraphs
    reqs: list[Request]
    ticket: int  # which of the graphs' pinned result buffers
    t0: float  # host time at launch


def _block_table(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, max_pages] from the requests' cached rows (zero-padded; padding is never addressed)."""
    if len(rows) == 1:
        return rows[0][None]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
