"""CUDA graphs for the decode iteration (DESIGN §2), one set per batch size and draft depth γ.

Each set holds four forwards over fixed shapes, replayed in order every iteration with no host
round trip between them (and, captured once more as one ``iteration`` graph, replayed as one
unless the phases are being timed):

- ``chain``: first the iteration's positions and slots, derived on the device from each row's
  committed length L (``_stage``); then the γ−1 greedy draft steps. Step i takes the previous token
  (d_1 first, read from ``next_d1`` where the previous iteration's extend left it) and the previous
  MTP output, writes draft slot L−2+i and proposes d_{i+1}; writes ``drafts`` [B, γ].
- ``verify``: the target forward over [x_{L−1}, d_1..d_γ] per request (the drafts are copied into
  its ids on the device) and the target's argmax [B, d]; the GDN layers record their per-token
  inputs and leave the states as they were.
- ``accept``: greedy acceptance on the device (or the forced count), then the GDN states of each
  request replayed through its accepted prefix (hybrid targets).
- ``extend``: the draft-extend over slots L−1..L−1+a with the target's true hidden states and the
  tokens [d_1..d_a, bonus], padded to d rows per request (padding rows write the pool's trash slot
  and are never read), which gives the next d_1 and MTP output; then L += a + 1 and x_{L−1} =
  bonus on the device (``_advance``).

Dense mode has only ``verify``, with d = 1, staging and advancing itself. A speculative set of
γ = 0 (adaptive depth's plain decode step) verifies x_{L−1} alone and keeps the chain (staging
only), accept (a = 0) and extend (one slot), so the draft stays caught up.

Invariants: the host uploads a batch's rows (block tables, L, x_{L−1}, state slots, draft state)
once, when the batch changes (``load``); from then on every per-iteration input is derived on the
device, so iteration i + 1 can be launched before iteration i's results are read (the engine's
overlap), and host work per iteration is O(B·d) whatever the context length. A row with L = 0 is
inactive: all its writes go to trash slots (warm-up and capture run the forwards once on such
rows). Slots of positions past a request's reserved pages also go to the trash slot: an overlapped
iteration runs once past a request's end, and its results for a finished request are dropped.
The results (drafts, target argmax, accepted counts, next d_1, L) come back through one of two
pinned host buffers (``fetch`` then ``results``): one host sync per iteration. Captured code reads
no host value that changes between replays. With ``capture=False`` the same functions run eagerly
(CPU tests), warm-up included: a replay is then a call.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.engine.memory import MemoryManager
from wmtp.engine.sampling import accept_greedy_batch
from wmtp.models.context import ForwardContext, PagedSlots, RingSlots
from wmtp.models.base import DraftHead, TargetLM


@dataclass
class BatchRow:
    """What the graphs need of one request when its batch is uploaded (the engine builds these)."""

    request_id: int
    target_pages: torch.Tensor  # int32 device row: the request's reserved target pages
    draft_pages: torch.Tensor | None  # the same for the native draft pool (None: ring, or dense)
    ring_base: int  # first slot of its draft ring (ring mode)
    length: int  # committed tokens L
    last_token: int  # x_{L-1}
    state_slot: int | None  # recurrent-state slot (hybrid targets)
    draft_token: int | None  # d_1
    draft_hidden: torch.Tensor | None  # the MTP output at slot L-2 [1, hidden]


class _Staging:
    """Named int64 fields packed in one device buffer: the host writes values, ``upload`` is one
    copy (from a fresh pinned buffer, which the caching host allocator keeps until the copy ran,
    so an upload never races an earlier one), and each field has a device view."""

    def __init__(self, fields: dict[str, tuple[int, ...]], device: torch.device) -> None:
        self.shapes = fields
        self.offsets: dict[str, int] = {}
        n = 0
        for name, shape in fields.items():
            self.offsets[name] = n
            n += math.prod(shape)
        self.pin = device.type == "cuda"
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.values: list[int] = [0] * n

    def view(self, name: str) -> torch.Tensor:
        o = self.offsets[name]
        return self.dev[o : o + math.prod(self.shapes[name])].view(self.shapes[name])

    def span(self, first: str, last: str) -> torch.Tensor:
        """The flat device run of the fields from ``first`` through ``last`` (in layout order)."""
        if self.offsets[last] < self.offsets[first]:
            raise ValueError(f"_Staging.span: field {last!r} is laid out before {first!r}")
        return self.dev[self.offsets[first] : self.offsets[last] + math.prod(self.shapes[last])]

    def set(self, name: str, flat: list[int]) -> None:
        o = self.offsets[name]
        self.values[o : o + len(flat)] = flat

    def upload(self) -> None:
        self._copy(self.dev, self.values)

    def upload_field(self, name: str) -> None:
        o = self.offsets[name]
        self._copy(self.view(name).view(-1), self.values[o : o + math.prod(self.shapes[name])])

    def _copy(self, dst: torch.Tensor, values: list[int]) -> None:
        host = torch.tensor(values, dtype=torch.int64)
        dst.copy_(host.pin_memory() if self.pin else host, non_blocking=True)


class _StepCompiler:
    """``torch.compile`` for one graph set's bookkeeping steps (pure torch, writing static buffers),
    whose small ops fuse into a few kernels on CUDA; and which of them compiled.

    A set needs its compiled steps only until it is captured (from then on the graph replays their
    kernels), and each set is a new specialisation of the same code (its buffers, batch size, mode).
    Dynamo's caches are therefore cleared before a set compiles, so no set ever meets the recompile
    limit (8 per function), past which dynamo would run the steps eagerly without a word (a
    ``bench suite`` of many engines did). ``compiled`` says whether every step went through the
    compiler; results record it."""

    def __init__(self) -> None:
        torch.compiler.reset()
        self.names: set[str] = set()
        self.done: set[str] = set()

    def __call__(self, name: str, fn: Callable[..., None]) -> Callable[..., None]:
        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            self.done.add(name)
            return torch._dynamo.lookup_backend(COMPILE_BACKEND)(gm, example_inputs)

        self.names.add(name)
        return torch.compile(fn, backend=backend, dynamic=False)

    @property
    def compiled(self) -> bool:
        return self.names <= self.done


COMPILE_BACKEND = "inductor"  # tests trace with dynamo's "eager" backend (the guards, no C++ build)


def compile_steps(device: torch.device, capture: bool) -> bool:
    """Whether a graph set compiles its bookkeeping steps: captured sets on CUDA; ``WMTP_COMPILE=0``
    never, ``WMTP_COMPILE=1`` every set on any device (tests)."""
    flag = os.environ.get("WMTP_COMPILE")
    return flag == "1" or (flag != "0" and capture and device.type == "cuda")


_WARM_UP_STREAMS: dict[int, torch.cuda.Stream] = {}


def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """The side stream every capture warms up on, one per device (kernels' per-stream buffers,
    ``arrival_counters``, then stay one per device, not one per capture)."""
    if device not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[device] = torch.cuda.Stream(device)
    return _WARM_UP_STREAMS[device]


class DecodeGraphs:
    """The static buffers, contexts and (optionally captured) graphs for batches of ``B`` greedy
    requests of one engine. One iteration: ``load`` (a no-op while the batch is unchanged), ``run``
    chain / verify / accept / extend, ``fetch``, then ``results`` (possibly after launching the next)."""

    def __init__(self, model: TargetLM, spec: SpecConfig, cfg: EngineConfig, memory: MemoryManager, batch: int,
                 capture: bool, pool=None, draft_head: DraftHead | None = None, gamma: int | None = None) -> None:
        start = time.perf_counter()
        self.model, self.spec, self.cfg, self.memory, self.B = model, spec, cfg, memory, batch
        self.draft_head = draft_head
        # γ: this set's depth (``spec.gamma`` unless adaptive); the pools and the ring are sized for spec's
        self.drafting = spec.speculative
        self.gamma = spec.gamma if gamma is None else gamma
        self.d = self.gamma + 1
        weight = model.embed_weight
        self.device, dtype = weight.device, weight.dtype
        dev, B, d, g = self.device, batch, self.d, max(self.gamma - 1, 0)
        mem = memory
        # loaded by the host when the batch changes: length (L), ver_x (x_{L-1}), state, forced,
        # pages (reserved target / draft pages); the rest is derived on the device by _stage
        self.stage = _Staging({
            "length": (B,), "ver_x": (B,), "state": (B,), "forced": (B,), "pages": (B,), "draft_pages": (B,),
            "ver_pos": (B, d), "chain_pos": (g, B), "chain_slot": (g, B), "windowed": (B,), "ver_slot": (B, d),
            "ver_start": (B,), "ext_slot": (B, d),
        }, dev)
        # RoPE (cos, sin) of every forward's positions (stage.span("ver_pos", "chain_pos")), computed once
        # per iteration by _stage: rows [0, B·d) the verify's and the extend's (same positions), then the
        # chain steps' B each; None for a model without position encoding (NoPE)
        rotary = model.rotary
        self.rope_cos_sin = (None if rotary is None else
                             tuple(torch.zeros(B * d + g * B, rotary.rot_dim, device=dev) for _ in range(2)))
        max_pages = mem.pages_for(cfg.max_model_len + spec.num_draft_tokens)
        self.target_table = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
        self.ring = spec.uses_ring
        self.draft_table = (torch.zeros(B, 1, dtype=torch.int64, device=dev) if self.ring
                            else torch.zeros(B, max_pages, dtype=torch.int32, device=dev))
        # results, packed for one copy to the host: drafts [B, γ] | target [B, d] | accepted | next d_1 | L
        g1 = max(self.gamma, 1)
        self.out = torch.zeros(B, g1 + d + 3, dtype=torch.int64, device=dev)
        self.drafts, self.target, self.accepted, self.next_d1, self.length_out = self._results()
        hidden = model.config.hidden_size
        self.ver_hidden = torch.zeros(B * d, hidden, device=dev, dtype=dtype)
        self.next_hidden = torch.zeros(B, hidden, device=dev, dtype=dtype)
        self.ext_ids = torch.zeros(B, d, dtype=torch.int64, device=dev)
        self.ext_slot = torch.zeros(B, d, dtype=torch.int64, device=dev)
        self.ext_len = torch.zeros(B, dtype=torch.int64, device=dev)
        self.cols = torch.arange(d, device=dev)
        self.chain_steps = torch.arange(1, max(self.gamma, 1), device=dev)[:, None]  # [γ-1, 1]
        self.trash_draft = torch.tensor(mem.trash_draft_slot, device=dev)
        self.trash_kv = torch.tensor(mem.trash_kv_slot, device=dev)
        cuda = dev.type == "cuda"
        self.out_host = [torch.zeros(self.out.shape, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.out_ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._next_buf = 0
        self.loaded: list[int] | None = None  # the request ids, in row order, of the rows on the device
        self._build_contexts()
        # the bookkeeping between the forwards (staging, acceptance, the extend's inputs, the advance) is
        # pure torch: eagerly about 80 tiny kernels an iteration (~1.5 us each in a graph, 0.13 ms at B = 1)
        steps = {"stage": self._stage, "advance": self._advance}  # dense; speculative: advance in extend_outputs
        if self.drafting:
            steps = {"stage": self._stage, "accept_counts": self._accept_counts, "extend_inputs": self._extend_inputs,
                     "extend_outputs": self._extend_outputs}
        compiler = _StepCompiler() if compile_steps(dev, capture) else None
        for name, fn in steps.items():
            setattr(self, f"run_{name}", compiler(name, fn) if compiler else fn)
        self.graphs: dict[str, Callable[[], None]] = {}
        fns = {"verify": self._verify}
        if self.drafting:  # and all four as one replay: each graph launch adds a ~5 us gap on the GPU
            fns.update(chain=self._chain, accept=self._accept, extend=self._extend, iteration=self._iteration)
        for name, fn in fns.items():
            self.graphs[name] = self._capture(fn, pool) if capture else fn
        if not capture:  # the iteration calls every part: one warm-up run of it covers them all
            self._warm(fns["iteration" if self.drafting else "verify"])
        self._fill_safe()
        # every step went through torch.compile (False: eager, by choice or by dynamo's fallback)
        self.compiled = compiler is not None and compiler.compiled
        self.build_seconds = time.perf_counter() - start  # compiling and capturing included

    def _results(self) -> tuple[torch.Tensor, ...]:
        """Views of ``out``: drafts [B, max(γ, 1)], target [B, d], accepted, next d_1, L [B]. The
        compiled steps take their views here, from ``out`` itself: views held as separate attributes
        would be aliased inputs to a compiled function that writes some of them."""
        g1, d = max(self.gamma, 1), self.d
        o = self.out
        return o[:, :g1], o[:, g1 : g1 + d], o[:, g1 + d], o[:, g1 + d + 1], o[:, g1 + d + 2]

    # ---- contexts over the static buffers ------------------------------------------------------
    def _lens(self, q_start: torch.Tensor, q_len: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, dev = self.B, self.device
        lens = q_len if isinstance(q_len, torch.Tensor) else torch.full((B,), q_len, dtype=torch.int64, device=dev)
        n = q_len if isinstance(q_len, int) else self.d
        return q_start, lens, torch.arange(B, dtype=torch.int64, device=dev) * n

    def _ctx(self, q_len: int, positions, slots, lens, target: bool, record: bool = False) -> ForwardContext:
        """A context whose device fields are the static buffers; host lists only give shapes."""
        from wmtp.kernels.paged_attention import AttentionMeta

        spec, cfg, B = self.spec, self.cfg, self.B
        if target:
            kv = PagedSlots(self.target_table, cfg.page_size)
            windows, keys = None, cfg.max_model_len + spec.num_draft_tokens
        else:
            window = spec.draft_window  # None in native mode
            kv = (RingSlots(self.draft_table.view(-1), window, spec.num_draft_tokens) if self.ring
                  else PagedSlots(self.draft_table, cfg.page_size))
            windows = None if window is None else [window] * B
            keys = window.ring_size(spec.num_draft_tokens) if self.ring else cfg.max_model_len + spec.num_draft_tokens
        ctx = ForwardContext([0] * B, [q_len] * B, kv, self.stage.view("state") if target else None,
                             windows=windows, device=self.device, record_states=record)
        ctx.bind_static(positions.reshape(-1), slots.reshape(-1), lens)
        sink, win = (windows[0].sink, windows[0].window) if windows else (0, 1)
        table = kv.base.view(-1, 1) if self.ring and not target else kv.block_table
        ctx.backend_cache["attention_meta"] = AttentionMeta(
            lens[0], lens[1], lens[2], self.stage.view("windowed") if windows else torch.zeros_like(lens[1]),
            table, 1 if (self.ring and not target) else cfg.page_size, self.ring and not target, sink, win,
            (win + spec.num_draft_tokens) if self.ring and not target else 1, q_len, keys, may_window=windows is not None)
        return ctx

    def _build_contexts(self) -> None:
        a = self.stage
        self.ver_ctx = self._ctx(self.d, a.view("ver_pos"), a.view("ver_slot"), self._lens(a.view("ver_start"), self.d),
                                 target=True, record=self.gamma > 0)
        self.ver_ctx.rope = self._rope_rows(0, self.B * self.d)
        self.ver_ids = torch.zeros(self.B, self.d, dtype=torch.int64, device=self.device)
        if not self.drafting:
            return
        self.chain_ctx = [self._ctx(1, a.view("chain_pos")[i], a.view("chain_slot")[i],
                                    self._lens(a.view("chain_pos")[i], 1), target=False)
                          for i in range(self.gamma - 1)]
        for i, ctx in enumerate(self.chain_ctx):
            ctx.rope = self._rope_rows(self.B * (self.d + i), self.B)
        self.ext_ctx = self._ctx(self.d, a.view("ver_pos"), self.ext_slot,
                                 self._lens(a.view("ver_start"), self.ext_len), target=False)
        self.ext_ctx.rope = self.ver_ctx.rope

    def _rope_rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.rope_cos_sin is None:
            return None
        return self.rope_cos_sin[0][start : start + n], self.rope_cos_sin[1][start : start + n]

    def _fill_safe(self) -> None:
        """Every row inactive (L = 0): all writes go to the trash slots (warm-up, capture, and any
        run before ``load``); the derived fields follow at once."""
        mem, B = self.memory, self.B
        for name, value in (("length", 0), ("ver_x", 0), ("state", mem.trash_state_slot), ("forced", -1),
                            ("pages", 0), ("draft_pages", 0)):
            self.stage.set(name, [value] * B)
        self.stage.upload()
        self.run_stage()
        self.loaded = None

    def _warm(self, fn: Callable[[], None]) -> None:
        """The uncaptured twin of ``_capture``'s warm-up: a run on inactive rows."""
        self._fill_safe()
        fn()

    # ---- device-side staging (start of the iteration) and advance (end of it) -----------------
    def _draft_slots(self, positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Draft-pool slots of ``positions`` [B, n] (the ring, or the draft pages in native mode)."""
        if self.ring:
            return self.ext_ctx.kv_slots.batch_slots(positions, active, self.trash_draft)
        return self.ext_ctx.kv_slots.batch_slots(positions, self.stage.view("draft_pages"), self.trash_draft)

    @torch.no_grad()
    def _stage(self) -> None:
        """Positions, slots and the window flag of this iteration from each row's L, written into
        the static views every context reads. Inactive rows (L = 0) get trash slots."""
        a = self.stage
        L = a.view("length")
        active = L > 0
        Lc = L.clamp(min=2)  # a real row has L >= 2 (prompt + first token); keeps positions >= 0
        ver_pos = (Lc - 1)[:, None] + self.cols
        a.view("ver_pos").copy_(ver_pos)
        a.view("ver_start").copy_(Lc - 1)
        a.view("ver_slot").copy_(self.ver_ctx.kv_slots.batch_slots(ver_pos, a.view("pages"), self.trash_kv))
        a.view("windowed").copy_(self.spec.windowed(L))
        if self.drafting:
            a.view("ext_slot").copy_(self._draft_slots(ver_pos, active))
            if self.gamma > 1:
                chain_pos = (Lc - 2)[None, :] + self.chain_steps  # [γ-1, B]: step i writes L-2+i
                a.view("chain_pos").copy_(chain_pos)
                a.view("chain_slot").copy_(self._draft_slots(chain_pos.T, active).T)
        if self.rope_cos_sin is not None:
            self.model.rotary(a.span("ver_pos", "chain_pos"), out=self.rope_cos_sin)

    @torch.no_grad()
    def _advance(self) -> None:
        """Commit the iteration on the device: L += a + 1, x_{L-1} = the bonus token (a = 0 in dense
        mode); L is also reported in the results."""
        _, target, a, _, length_out = self._results()
        L = self.stage.view("length")
        self.stage.view("ver_x").copy_(target.gather(1, a[:, None])[:, 0])
        L.add_(torch.where(L > 0, a + 1, 0))
        length_out.copy_(L)

    # ---- the forwards (captured once; they only read and write static buffers) ----------------
    @torch.no_grad()
    def _chain(self) -> None:
        self.run_stage()
        model = self.model
        ids, hid = self.next_d1, self.next_hidden  # the extend rewrites next_hidden only after the chain
        self.drafts[:, 0] = ids
        for i, ctx in enumerate(self.chain_ctx, start=1):
            hid = model.mtp_forward(ids, hid, ctx)
            ids = model.backend.argmax(model.draft_logits(hid, self.draft_head), out=self.drafts[:, i])

    @torch.no_grad()
    def _verify(self) -> None:
        """(Dense mode: the whole iteration, its staging and advance included.)"""
        model = self.model
        if not self.drafting:
            self.run_stage()
        self.ver_ids[:, 0] = self.stage.view("ver_x")
        if self.gamma:
            self.ver_ids[:, 1:] = self.drafts
        hidden = model(self.ver_ids.view(-1), self.ver_ctx)
        self.ver_hidden.copy_(hidden)
        model.backend.argmax(model.compute_logits(hidden), out=self.target)
        if not self.drafting:
            self.run_advance()

    @torch.no_grad()
    def _accept(self) -> None:
        """Accepted counts (greedy, or the staged forced count where >= 0), then the GDN rollback."""
        a = self.run_accept_counts()
        if self.ver_ctx.recorded:
            self.model.rollback_states(self.stage.view("state"), a, self.ver_ctx.recorded)

    def _accept_counts(self) -> torch.Tensor:
        """Writes the accepted counts into ``out`` and returns them as a contiguous [B] tensor."""
        drafts, target, accepted, _, _ = self._results()
        forced = self.stage.view("forced")
        a = torch.where(forced >= 0, forced.clamp(max=self.gamma), accept_greedy_batch(drafts[:, : self.gamma], target))
        accepted.copy_(a)
        return a

    @torch.no_grad()
    def _extend(self) -> None:
        """The draft-extend forward, then the next d_1 and MTP output, and the advance."""
        model = self.model
        self.run_extend_inputs()
        out = model.mtp_forward(self.ext_ids.view(-1), self.ver_hidden, self.ext_ctx)
        self.run_extend_outputs(out)
        model.backend.argmax(model.draft_logits(self.next_hidden, self.draft_head), out=self.next_d1)

    def _extend_inputs(self) -> None:
        """Extend inputs from the accepted counts on the device: ids [d_1..d_a, bonus, 0...], the
        first a + 1 slots of each request (the rest to the trash slot)."""
        drafts, target, a, _, _ = self._results()
        bonus = target.gather(1, a[:, None])
        drafts = torch.nn.functional.pad(drafts[:, : self.gamma], (0, self.d - self.gamma))
        self.ext_ids.copy_(torch.where(self.cols < a[:, None], drafts, torch.where(self.cols == a[:, None], bonus, 0)))
        self.ext_slot.copy_(torch.where(self.cols <= a[:, None], self.stage.view("ext_slot"), self.trash_draft))
        self.ext_len.copy_(a + 1)

    def _extend_outputs(self, out: torch.Tensor) -> None:
        """Each request's MTP output at its bonus row (the next iteration's hidden input), then the advance."""
        a = self._results()[2]
        self.next_hidden.copy_(out[torch.arange(self.B, device=a.device) * self.d + a])
        self._advance()

    def _iteration(self) -> None:
        """chain, verify, accept and extend back to back (the engine replays them apart only to time
        the phases)."""
        self._chain()
        self._verify()
        self._accept()
        self._extend()

    def _capture(self, fn: Callable[[], None], pool) -> Callable[[], None]:
        self._fill_safe()
        stream = _warm_up_stream(torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: compiles kernels, settles the allocator (inactive rows: writes go to trash slots)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    # ---- host side of one iteration ------------------------------------------------------------
    def load(self, rows: list[BatchRow]) -> None:
        """Upload the batch's rows when they changed: block tables, L, x_{L-1}, state slots,
        reserved pages, and the draft state (d_1 and the MTP output) unless the previous iteration's
        extend left it in ``next_d1`` / ``next_hidden``. Call only with no iteration of this set in
        flight."""
        key = [r.request_id for r in rows]
        if key == self.loaded:
            return
        a = self.stage
        self.target_table.zero_()
        for b, r in enumerate(rows):
            self.target_table[b, : r.target_pages.numel()] = r.target_pages
            if self.ring:
                self.draft_table[b, 0] = r.ring_base
            elif self.drafting:
                self.draft_table[b, : r.draft_pages.numel()] = r.draft_pages
        a.set("length", [r.length for r in rows])
        a.set("ver_x", [r.last_token for r in rows])
        a.set("state", [self.memory.trash_state_slot if r.state_slot is None else r.state_slot for r in rows])
        a.set("pages", [r.target_pages.numel() for r in rows])
        a.set("draft_pages", [0 if r.draft_pages is None else r.draft_pages.numel() for r in rows])
        a.upload()
        if self.drafting and any(r.draft_hidden.data_ptr() != self.next_hidden[b].data_ptr() for b, r in enumerate(rows)):
            self.next_hidden.copy_(torch.cat([r.draft_hidden for r in rows]))
            self.next_d1.copy_(torch.tensor([r.draft_token for r in rows]), non_blocking=False)
        self.loaded = key

    def set_forced(self, forced: int | None) -> None:
        """Benchmark-only: accept exactly ``forced`` drafts (clipped to γ) from the next launch on
        (None: greedy acceptance). One small copy in stream order, so it may change between
        overlapped iterations without a drain."""
        value = -1 if forced is None else forced
        if self.stage.values[self.stage.offsets["forced"]] != value:
            self.stage.set("forced", [value] * self.B)
            self.stage.upload_field("forced")

    def run(self, name: str) -> None:
        """Replay (or, uncaptured, call) one of the forwards."""
        self.graphs[name]()

    def fetch(self) -> int:
        """Queue the copy of this iteration's results to a pinned host buffer (after the forwards,
        in stream order); returns the ticket ``results`` waits on."""
        k, self._next_buf = self._next_buf, 1 - self._next_buf
        self.out_host[k].copy_(self.out, non_blocking=True)
        if self.out_ready[k] is not None:
            self.out_ready[k].record()
        return k

    def results(self, ticket: int) -> tuple[list[list[int]], list[list[int]], list[int], list[int], list[int]]:
        """(drafts [B][γ], target argmax [B][d], accepted [B], next d_1 [B], L after the iteration
        [B]) on the host: waits for that iteration only (dense mode: accepted 0, no drafts)."""
        if self.out_ready[ticket] is not None:
            self.out_ready[ticket].synchronize()
        rows = self.out_host[ticket].tolist()
        g1, d = max(self.gamma, 1), self.d
        return ([r[: self.gamma] for r in rows], [r[g1 : g1 + d] for r in rows], [r[g1 + d] for r in rows],
                [r[g1 + d + 1] for r in rows], [r[g1 + d + 2] for r in rows])
