"""CUDA graphs for the decode iteration (DESIGN §2), one set per batch size.

Each set holds four forwards over fixed shapes, replayed in order every iteration with no host
round trip between them:

- ``chain``: the γ−1 greedy draft steps. Step i takes the previous token (d_1 first, read from
  ``next_d1`` where the previous iteration's extend left it) and the previous MTP output, writes
  draft slot L−2+i and proposes d_{i+1}; writes ``drafts`` [B, γ].
- ``verify``: the target forward over [x_{L−1}, d_1..d_γ] per request (the drafts are copied into
  its ids on the device) and the target's argmax [B, d]; the GDN layers record their per-token
  states.
- ``accept``: greedy acceptance on the device (or the forced count), then the GDN states of each
  request back to its accepted prefix (hybrid targets).
- ``extend``: the draft-extend over slots L−1..L−1+a with the target's true hidden states and the
  tokens [d_1..d_a, bonus], padded to d rows per request (padding rows write the pool's trash slot
  and are never read), which gives the next d_1 and MTP output.

Dense mode (γ = 0) has only ``verify``, with d = 1.

Invariants: every per-iteration input sits in static device buffers that the host fills with one
host-to-device copy before ``chain`` (everything the iteration needs is known then: the extend's
slots are staged for all d positions and masked on the device by the accepted count); the results
(drafts, target argmax, accepted counts, next d_1) come back in one device-to-host copy after
``extend``: one host sync per iteration. Captured code reads no host value that changes between
replays; host work per iteration is O(B·d), whatever the context length (block-table rows are
copied only when the batch's requests change). A request that finishes in an iteration has its
accept / extend writes land in its own slots before the host releases them (stream order).
With ``capture=False`` the same functions run eagerly (CPU tests): a replay is then a call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from wmtp.models.context import ForwardContext, PagedSlots, RingSlots

if TYPE_CHECKING:
    from wmtp.engine.engine import Engine, Request


class _Staging:
    """Named int64 fields packed in one host buffer (pinned on CUDA) mirrored by one device
    buffer: the host writes values, ``upload`` is one copy, and each field has a device view."""

    def __init__(self, fields: dict[str, tuple[int, ...]], device: torch.device) -> None:
        self.shapes = fields
        self.offsets: dict[str, int] = {}
        n = 0
        for name, shape in fields.items():
            self.offsets[name] = n
            n += math.prod(shape)
        pin = device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.values: list[int] = [0] * n

    def view(self, name: str) -> torch.Tensor:
        o = self.offsets[name]
        return self.dev[o : o + math.prod(self.shapes[name])].view(self.shapes[name])

    def set(self, name: str, flat: list[int]) -> None:
        o = self.offsets[name]
        self.values[o : o + len(flat)] = flat

    def upload(self) -> None:
        self.host.copy_(torch.tensor(self.values, dtype=torch.int64))
        self.dev.copy_(self.host, non_blocking=True)


class DecodeGraphs:
    """The static buffers, contexts and (optionally captured) graphs for batches of ``B`` greedy
    requests of one engine. One iteration: ``prepare``, ``run`` chain / verify / accept / extend,
    ``results``."""

    def __init__(self, engine: Engine, batch: int, capture: bool, pool=None) -> None:
        self.eng, self.B = engine, batch
        spec, cfg = engine.spec, engine.model.config
        self.gamma, self.d = spec.gamma, spec.verify_tokens
        dev, B, d, g = engine.device, batch, self.d, max(self.gamma - 1, 0)
        mem = engine.memory
        self.stage = _Staging({
            "chain_pos": (g, B), "chain_slot": (g, B), "windowed": (B,), "ver_pos": (B, d), "ver_slot": (B, d),
            "ver_x": (B,), "ver_start": (B,), "state": (B,), "ext_slot": (B, d), "forced": (B,),
        }, dev)
        max_pages = mem.pages_for(engine.eng.max_model_len + spec.num_draft_tokens)
        self.target_table = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
        self.ring = spec.uses_ring
        self.draft_table = (torch.zeros(B, 1, dtype=torch.int64, device=dev) if self.ring
                            else torch.zeros(B, max_pages, dtype=torch.int32, device=dev))
        self.hidden_in = torch.zeros(B, cfg.hidden_size, device=dev, dtype=engine.dtype)
        # results, packed for one copy to the host: drafts [B, γ] | target [B, d] | accepted | next d_1
        g1 = max(self.gamma, 1)
        self.out = torch.zeros(B, g1 + d + 2, dtype=torch.int64, device=dev)
        self.drafts, self.target = self.out[:, :g1], self.out[:, g1 : g1 + d]
        self.accepted, self.next_d1 = self.out[:, g1 + d], self.out[:, g1 + d + 1]
        self.ver_hidden = torch.zeros(B * d, cfg.hidden_size, device=dev, dtype=engine.dtype)
        self.next_hidden = torch.zeros(B, cfg.hidden_size, device=dev, dtype=engine.dtype)
        self.ext_ids = torch.zeros(B, d, dtype=torch.int64, device=dev)
        self.ext_slot = torch.zeros(B, d, dtype=torch.int64, device=dev)
        self.ext_len = torch.zeros(B, dtype=torch.int64, device=dev)
        self.cols = torch.arange(d, device=dev)
        self.trash_draft = torch.tensor(mem.trash_draft_slot, device=dev)
        self.out_host = torch.zeros(self.out.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.rows: list[int] = []  # ids of the requests whose tables are loaded, in row order
        self._build_contexts()
        self._fill_safe()
        self.graphs: dict[str, Callable[[], None]] = {}
        fns = {"verify": self._verify}
        if self.gamma:
            fns.update(chain=self._chain, accept=self._accept, extend=self._extend)
        for name, fn in fns.items():
            self.graphs[name] = self._capture(fn, pool) if capture else fn

    # ---- contexts over the static buffers ------------------------------------------------------
    def _lens(self, q_start: torch.Tensor, q_len: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, dev = self.B, self.eng.device
        lens = q_len if isinstance(q_len, torch.Tensor) else torch.full((B,), q_len, dtype=torch.int64, device=dev)
        n = q_len if isinstance(q_len, int) else self.d
        return q_start, lens, torch.arange(B, dtype=torch.int64, device=dev) * n

    def _ctx(self, q_len: int, positions, slots, lens, target: bool, record: bool = False) -> ForwardContext:
        """A context whose device fields are the static buffers; host lists only give shapes."""
        from wmtp.kernels.paged_attention import AttentionMeta

        eng, spec, B = self.eng, self.eng.spec, self.B
        if target:
            kv = PagedSlots(self.target_table, eng.eng.page_size)
            windows, keys = None, eng.eng.max_model_len + spec.num_draft_tokens
        else:
            window = spec.draft_window  # None in native mode
            kv = (RingSlots(self.draft_table.view(-1), window, spec.num_draft_tokens) if self.ring
                  else PagedSlots(self.draft_table, eng.eng.page_size))
            windows = None if window is None else [window] * B
            keys = window.ring_size(spec.num_draft_tokens) if self.ring else eng.eng.max_model_len + spec.num_draft_tokens
        ctx = ForwardContext([0] * B, [q_len] * B, kv, self.stage.view("state") if target else None,
                             windows=windows, device=eng.device, record_states=record)
        ctx.bind_static(positions.reshape(-1), slots.reshape(-1), lens)
        sink, win = (windows[0].sink, windows[0].window) if windows else (0, 1)
        table = kv.base.view(-1, 1) if self.ring and not target else kv.block_table
        ctx.backend_cache["attention_meta"] = AttentionMeta(
            lens[0], lens[1], lens[2], self.stage.view("windowed") if windows else torch.zeros_like(lens[1]),
            table, 1 if (self.ring and not target) else eng.eng.page_size, self.ring and not target, sink, win,
            (win + spec.num_draft_tokens) if self.ring and not target else 1, q_len, keys, may_window=windows is not None)
        return ctx

    def _build_contexts(self) -> None:
        a = self.stage
        self.ver_ctx = self._ctx(self.d, a.view("ver_pos"), a.view("ver_slot"), self._lens(a.view("ver_start"), self.d),
                                 target=True, record=self.gamma > 0)
        self.ver_ids = torch.zeros(self.B, self.d, dtype=torch.int64, device=self.eng.device)
        if not self.gamma:
            return
        self.chain_ctx = [self._ctx(1, a.view("chain_pos")[i], a.view("chain_slot")[i],
                                    self._lens(a.view("chain_pos")[i], 1), target=False)
                          for i in range(self.gamma - 1)]
        self.ext_ctx = self._ctx(self.d, a.view("ver_pos"), self.ext_slot,
                                 self._lens(a.view("ver_start"), self.ext_len), target=False)

    def _fill_safe(self) -> None:
        """Point every write at the trash slots (warm-up and capture run the forwards once)."""
        mem, B, d = self.eng.memory, self.B, self.d
        self.stage.set("chain_slot", [mem.trash_draft_slot] * (max(self.gamma - 1, 0) * B))
        self.stage.set("ver_slot", [mem.trash_kv_slot] * (B * d))
        self.stage.set("state", [mem.trash_state_slot] * B)
        self.stage.set("ext_slot", [mem.trash_draft_slot] * (B * d))
        self.stage.set("forced", [-1] * B)
        self.stage.upload()

    # ---- the forwards (captured once; they only read and write static buffers) ----------------
    @torch.no_grad()
    def _chain(self) -> None:
        model = self.eng.model
        ids, hid = self.next_d1, self.hidden_in
        self.drafts[:, 0] = ids
        for i, ctx in enumerate(self.chain_ctx, start=1):
            hid = model.mtp_forward(ids, hid, ctx)
            ids = model.compute_logits(hid).argmax(-1)
            self.drafts[:, i] = ids

    @torch.no_grad()
    def _verify(self) -> None:
        model = self.eng.model
        self.ver_ids[:, 0] = self.stage.view("ver_x")
        if self.gamma:
            self.ver_ids[:, 1:] = self.drafts
        hidden = model(self.ver_ids.view(-1), self.ver_ctx)
        self.ver_hidden.copy_(hidden)
        self.target.copy_(model.compute_logits(hidden).argmax(-1).view(self.B, self.d))

    @torch.no_grad()
    def _accept(self) -> None:
        """Accepted counts (greedy, or the staged forced count where >= 0), then the GDN rollback."""
        from wmtp.engine.sampling import accept_greedy_batch

        forced = self.stage.view("forced")
        a = torch.where(forced >= 0, forced, accept_greedy_batch(self.drafts, self.target))
        self.accepted.copy_(a)
        if self.ver_ctx.recorded:
            self.eng.model.rollback_states(self.stage.view("state"), a, self.ver_ctx.recorded)

    @torch.no_grad()
    def _extend(self) -> None:
        """Extend inputs from the accepted counts on the device: ids [d_1..d_a, bonus, 0...], the
        first a + 1 slots of each request (the rest to the trash slot)."""
        model, a, d = self.eng.model, self.accepted, self.d
        bonus = self.target.gather(1, a[:, None])
        drafts = torch.nn.functional.pad(self.drafts, (0, d - self.gamma))
        self.ext_ids.copy_(torch.where(self.cols < a[:, None], drafts, torch.where(self.cols == a[:, None], bonus, 0)))
        self.ext_slot.copy_(torch.where(self.cols <= a[:, None], self.stage.view("ext_slot"), self.trash_draft))
        self.ext_len.copy_(a + 1)
        out = model.mtp_forward(self.ext_ids.view(-1), self.ver_hidden, self.ext_ctx)
        last = out[torch.arange(self.B, device=a.device) * d + a]
        self.next_hidden.copy_(last)
        self.next_d1.copy_(model.compute_logits(last).argmax(-1))

    def _capture(self, fn: Callable[[], None], pool) -> Callable[[], None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: compiles kernels, settles the allocator (writes go to trash slots)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    # ---- host side of one iteration ------------------------------------------------------------
    def _load_rows(self, reqs: list[Request]) -> None:
        """Copy block-table rows when the batch changed, and the requests' draft state (d_1 and the
        MTP output) unless the previous iteration's extend left it in ``next_d1`` / ``next_hidden``."""
        ids = [r.id for r in reqs]
        if ids != self.rows:
            self.target_table.zero_()
            for b, r in enumerate(reqs):
                row = r.page_rows[0]
                self.target_table[b, : row.numel()] = row
                if self.ring:
                    self.draft_table[b, 0] = self.eng._ring_base(r)
                elif self.gamma:
                    self.draft_table[b, : r.page_rows[1].numel()] = r.page_rows[1]
            self.rows = ids
        if not self.gamma:
            return
        if any(r.draft_hidden.data_ptr() != self.next_hidden[b].data_ptr() for b, r in enumerate(reqs)):
            self.hidden_in.copy_(torch.cat([r.draft_hidden for r in reqs]))
            self.next_d1.copy_(torch.tensor([r.draft_token for r in reqs]), non_blocking=False)
        else:
            self.hidden_in.copy_(self.next_hidden)

    def _draft_slot(self, req: Request, pos: int) -> int:
        spec = self.eng.spec
        if self.ring:
            return self.eng._ring_base(req) + spec.draft_window.ring_slot(pos, spec.num_draft_tokens)
        return _paged_slot(req.alloc.draft_pages, pos, self.eng.eng.page_size)

    def prepare(self, reqs: list[Request], lens: list[int], forced: int | None) -> None:
        """Stage everything the iteration needs (L = committed tokens; ``forced``: accept exactly
        this many drafts, benchmark-only)."""
        self._load_rows(reqs)
        a, eng, d, page = self.stage, self.eng, self.d, self.eng.eng.page_size
        chain_pos = [L - 2 + i for i in range(1, self.gamma) for L in lens]
        a.set("chain_pos", chain_pos)
        a.set("chain_slot", [self._draft_slot(reqs[j % self.B], p) for j, p in enumerate(chain_pos)])
        a.set("windowed", [eng.spec.window_for(L) is not None for L in lens])
        ver_pos = [L - 1 + j for L in lens for j in range(d)]
        a.set("ver_pos", ver_pos)
        a.set("ver_slot", [_paged_slot(reqs[i // d].alloc.pages, p, page) for i, p in enumerate(ver_pos)])
        a.set("ver_x", [r.tokens[-1] for r in reqs])
        a.set("ver_start", [L - 1 for L in lens])
        if self.gamma:
            a.set("ext_slot", [self._draft_slot(reqs[i // d], p) for i, p in enumerate(ver_pos)])
            a.set("forced", [-1 if forced is None else forced] * self.B)
        if eng.model.config.is_hybrid:
            a.set("state", [r.alloc.state_slot for r in reqs])
        a.upload()

    def run(self, name: str) -> None:
        """Replay (or, uncaptured, call) one of the forwards."""
        self.graphs[name]()

    def results(self) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
        """(drafts [B][γ], target argmax [B][d], accepted [B], next d_1 [B]) on the host: the
        iteration's one sync (dense mode: accepted 0, no drafts)."""
        self.out_host.copy_(self.out)
        rows = self.out_host.tolist()
        g1, d = max(self.gamma, 1), self.d
        return ([r[: self.gamma] for r in rows], [r[g1 : g1 + d] for r in rows], [r[g1 + d] for r in rows],
                [r[g1 + d + 1] for r in rows])


def _paged_slot(pages: list[int], pos: int, page_size: int) -> int:
    return pages[pos // page_size] * page_size + pos % page_size
