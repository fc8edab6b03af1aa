"""KV and state pools, sized up front, with admission by budget (DESIGN §4).

- Target KV: ``num_pages`` pages of ``page_size`` slots, one tensor per full-attention layer.
- Draft KV: a full-length paged pool (native; windowed with ring=False) or one ring of
  ``sink + W + d`` slots per request (windowed, ring=True).
- Recurrent state: one conv + SSM state slot per running request in every recurrent layer (GDN or
  Mamba2, ``models.base.recurrent_state``).
- Verify record (speculative recurrent targets): each verify token's recurrence inputs and the conv
  window (K-1 old inputs + d new), per sequence slot, which the rollback after a partial acceptance
  replays. It is sized up front and counted in the budget like the pools, never allocated inside a
  forward.
- Prefix snapshots (``EngineConfig.prefix_cache``): per snapshot slot, what a prefill resumed at a
  page boundary needs besides the cached KV pages (``snapshot_bytes``): the recurrent states, the
  hidden state of the last position before it (the draft lags by one) and the draft's ring or the
  draft page ending there. Filled and read by ``save_snapshot`` / ``load_snapshot``.

A request reserves its worst case at admission (pages for prompt + max_tokens + d), so a running
request can never run out of memory; one that does not fit waits, and one that could never fit is
refused with the limit named. Pages shared from the prefix cache count toward that worst case and
are not taken from the free lists. ``release`` returns everything a request held except the pages
the prefix cache keeps.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from wmtp.config import ModelConfig
from wmtp.engine.config import EngineConfig, SpecConfig
from wmtp.errors import WmtpError
from wmtp.models.base import recurrent_state
from wmtp.quant import bytewise, kv_cache_dtype


# the attributes ``bind`` sets on the model and its layers (views into the pools)
_POOL_VIEWS = ("k_cache", "v_cache", "conv_state", "ssm_state", "verify_record", "state_pools")


class CapacityError(WmtpError):
    """A request that can never fit in the engine's pools (names the limit)."""


class FreeList:
    """Integer ids 0..n-1; allocation order is LIFO (recently freed first: warm memory)."""

    def __init__(self, n: int) -> None:
        self.capacity = n
        self._free = list(range(n - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"FreeList: asked for {n}, {len(self._free)} free")  # callers check first
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"FreeList: double free of {i}")
            self._used.remove(i)
            self._free.append(i)


@dataclass
class Allocation:
    """Everything one request holds."""

    pages: list[int]
    draft_pages: list[int] = field(default_factory=list)
    ring: int | None = None
    state_slot: int | None = None


@dataclass(frozen=True)
class StatePools:
    """Every recurrent layer's states stacked [layers, ...]; the verify record too (None when
    nothing is recorded). Layers hold views of these."""

    conv: torch.Tensor  # [L, slots + 1, C, K-1]
    ssm: torch.Tensor  # [L, slots + 1, *RecurrentState.ssm_shape] fp32
    verify_tokens: torch.Tensor | None  # [L, seqs * d, RecurrentState.record_width] fp32
    verify_windows: torch.Tensor | None  # [L, seqs, K-1+d, C]


@dataclass(frozen=True)
class Snapshots:
    """Prefix-snapshot slots (None where a target or mode has nothing of that kind to restore)."""

    conv: torch.Tensor | None  # [L, slots, C, K-1]: recurrent layers' conv states
    ssm: torch.Tensor | None  # [L, slots, *RecurrentState.ssm_shape] fp32
    hidden: torch.Tensor | None  # [slots, hidden]: h of the position before the boundary (speculative)
    draft: torch.Tensor | None  # [mtp layers, 2, slots, snapshot_draft_slots, kv heads, head_dim]


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    num_draft_pages: int
    num_rings: int
    num_state_slots: int
    num_verify_seqs: int = 0
    num_snapshots: int = 0


class MemoryManager:
    """Owns the pools and their tensors; binds them to the model's layers."""

    def __init__(self, model_cfg: ModelConfig, spec: SpecConfig, eng: EngineConfig, dtype: torch.dtype) -> None:
        self.cfg, self.spec, self.eng, self.dtype = model_cfg, spec, eng, dtype
        self.elt = torch.empty(0, dtype=dtype).element_size()
        self.kv_dtype = kv_cache_dtype(eng.kv_cache_dtype, dtype)  # target and draft K / V
        self.kv_elt = torch.empty(0, dtype=self.kv_dtype).element_size()
        self.state = recurrent_state(model_cfg)
        self.sizes = self._plan()
        self.pages = FreeList(self.sizes.num_pages)
        self.draft_pages = FreeList(self.sizes.num_draft_pages)
        self.rings = FreeList(self.sizes.num_rings)
        self.state_slots = FreeList(self.sizes.num_state_slots)
        self.seq_slots = FreeList(eng.max_num_seqs)
        self.snapshot_slots = FreeList(self.sizes.num_snapshots)
        self.held: dict[int, tuple[Allocation, int]] = {}  # request id -> (allocation, seq slot)
        self.state_pools: StatePools | None = None  # set by bind (recurrent targets)
        self.draft_kv: torch.Tensor | None = None  # set by bind (speculative): [mtp layers, 2, slots + 1, ...]
        self.snapshots: Snapshots | None = None  # set by bind (prefix snapshots)

    # ---- sizing ------------------------------------------------------------------------------
    @property
    def draft_is_paged(self) -> bool:
        return self.spec.speculative and not self.spec.uses_ring

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.eng.page_size)

    @property
    def target_page_bytes(self) -> int:
        return self.eng.page_size * self.cfg.target_kv_bytes_per_token(self.kv_elt)

    @property
    def draft_slot_bytes(self) -> int:
        return self.cfg.draft_kv_bytes_per_token(self.kv_elt) * max(self.cfg.num_mtp_attention_layers, 1)

    @property
    def state_slot_bytes(self) -> int:
        st = self.state
        return 0 if st is None else st.layers * (st.conv_bytes(self.elt) + st.ssm_bytes)

    @property
    def verify_seq_bytes(self) -> int:
        """Bytes one sequence slot's verify record takes over all recurrent layers: d tokens' fp32
        recurrence inputs (``RecurrentState.record_width``) and K-1+d conv-window rows (0 where
        nothing is recorded: dense mode, or no recurrent layers)."""
        st, d = self.state, self.spec.verify_tokens
        if st is None or not self.spec.speculative:
            return 0
        window = (st.conv_kernel - 1 + d) * st.conv_dim * self.elt
        return st.layers * (d * st.record_width * 4 + window)

    @property
    def snapshot_draft_slots(self) -> int:
        """Draft slots one prefix snapshot copies: the whole ring (its sink and last W + d slots), or
        the draft page ending at the boundary (the earlier ones are shared like target pages)."""
        return self.spec.ring_size if self.spec.uses_ring else self.eng.page_size if self.draft_is_paged else 0

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one prefix snapshot; 0 where KV pages alone resume a prefill (dense attention-only
        targets), which then need no snapshots."""
        hidden = self.cfg.hidden_size * self.elt if self.spec.speculative else 0
        return self.state_slot_bytes + hidden + self.snapshot_draft_slots * self.draft_slot_bytes

    def _plan(self) -> PoolSizes:
        e, s = self.eng, self.spec
        per_seq_pages = self.pages_for(e.max_model_len + s.num_draft_tokens)
        rings = e.max_num_seqs if s.uses_ring else 0
        states = e.max_num_seqs if self.state is not None else 0
        verify_seqs = e.max_num_seqs if self.verify_seq_bytes else 0
        snapshots = 0
        if e.prefix_cache and self.snapshot_bytes:
            snapshots = 4 * e.max_num_seqs if e.prefix_snapshots is None else e.prefix_snapshots
        if e.num_kv_pages is not None:
            pages = e.num_kv_pages
        elif e.kv_memory_bytes is not None:
            fixed = (rings * s.ring_size * self.draft_slot_bytes + states * self.state_slot_bytes
                     + verify_seqs * self.verify_seq_bytes + snapshots * self.snapshot_bytes)
            per_page = self.target_page_bytes + (e.page_size * self.draft_slot_bytes if self.draft_is_paged else 0)
            pages = (e.kv_memory_bytes - fixed) // max(per_page, 1)
            if pages < per_seq_pages // max(e.max_num_seqs, 1) or pages < 1:
                raise CapacityError(
                    f"kv_memory_bytes={e.kv_memory_bytes} leaves room for {max(pages, 0)} KV pages after "
                    f"{fixed} bytes of rings/states/verify states/prefix snapshots; raise it or lower "
                    "max_num_seqs (or prefix_snapshots)"
                )
        else:
            pages = e.max_num_seqs * per_seq_pages
        return PoolSizes(pages, pages if self.draft_is_paged else 0, rings, states, verify_seqs, snapshots)

    def bytes_report(self) -> dict[str, int]:
        """Bytes of each pool (what the metrics and the memory table report)."""
        z = self.sizes
        return {
            "target_kv": z.num_pages * self.target_page_bytes,
            "draft_pool": z.num_draft_pages * self.eng.page_size * self.draft_slot_bytes,
            "draft_ring": z.num_rings * self.spec.ring_size * self.draft_slot_bytes,
            "state_pool": z.num_state_slots * self.state_slot_bytes,
            "verify_record": z.num_verify_seqs * self.verify_seq_bytes,
            "prefix_snapshots": z.num_snapshots * self.snapshot_bytes,
        }

    def allocation_bytes(self, alloc: Allocation) -> dict[str, int]:
        """Bytes one request holds in each pool (its per-request memory metrics)."""
        return {
            "target_kv": len(alloc.pages) * self.target_page_bytes,
            "draft_pool": len(alloc.draft_pages) * self.eng.page_size * self.draft_slot_bytes,
            "draft_ring": (alloc.ring is not None) * self.spec.ring_size * self.draft_slot_bytes,
            "state_pool": (alloc.state_slot is not None) * self.state_slot_bytes,
            "verify_record": self.verify_seq_bytes,  # its sequence slot's record
        }

    # ---- tensors -----------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module, device: torch.device | str) -> None:
        """Allocate the pool tensors and attach per-layer views to the model's layers.

        Every pool has one extra *trash* slot past its last real one (``trash_*``): padded rows of
        a CUDA-graph forward write there, so a fixed-shape forward never touches a request's data.
        """
        c, slots = self.cfg, self.sizes.num_pages * self.eng.page_size
        attn = model.attention_layers()
        self.trash_kv_slot = slots
        kv = torch.zeros(len(attn), 2, slots + 1, c.num_kv_heads, c.head_dim, device=device, dtype=self.kv_dtype)
        for i, layer in enumerate(attn):
            layer.k_cache, layer.v_cache = kv[i, 0], kv[i, 1]
        draft_slots = (self.sizes.num_draft_pages * self.eng.page_size) + self.sizes.num_rings * self.spec.ring_size
        self.trash_draft_slot = draft_slots
        mtp = model.mtp_attention_layers()
        if self.spec.speculative and mtp:
            dkv = torch.zeros(len(mtp), 2, draft_slots + 1, c.num_kv_heads, c.head_dim, device=device,
                              dtype=self.kv_dtype)
            for i, layer in enumerate(mtp):
                layer.k_cache, layer.v_cache = dkv[i, 0], dkv[i, 1]
            self.draft_kv = dkv
        n, layers, st = self.sizes.num_state_slots, model.recurrent_layers(), self.state
        self.trash_state_slot = n
        if layers:  # one tensor per kind, viewed per layer: the rollback moves every layer in one op
            conv = torch.zeros(len(layers), n + 1, st.conv_dim, st.conv_kernel - 1, device=device, dtype=self.dtype)
            ssm = torch.zeros(len(layers), n + 1, *st.ssm_shape, device=device, dtype=torch.float32)
            seqs, d = self.sizes.num_verify_seqs, self.spec.verify_tokens
            rec = win = None
            if seqs:
                rec = torch.empty(len(layers), seqs * d, st.record_width, device=device, dtype=torch.float32)
                win = torch.empty(len(layers), seqs, st.conv_kernel - 1 + d, st.conv_dim, device=device,
                                  dtype=self.dtype)
            for i, layer in enumerate(layers):
                layer.conv_state, layer.ssm_state = conv[i], ssm[i]
                layer.verify_record = None if rec is None else (rec[i], win[i])
            self.state_pools = model.state_pools = StatePools(conv, ssm, rec, win)
        if self.sizes.num_snapshots:
            self.snapshots = self._snapshot_tensors(device)
        self._views = [(m, {a: getattr(m, a) for a in _POOL_VIEWS if a in m.__dict__}) for m in model.modules()]
        model.bound_pools = self

    @staticmethod
    def unbind(model: torch.nn.Module) -> None:
        """Drop every pool view from the model's layers and the model's reference to the manager
        that bound them: a deleted engine's pools are then freed (the model kept the last manager's
        alive, and with it every pool, until another engine bound its own)."""
        for m in model.modules():
            for a in _POOL_VIEWS:
                if a in m.__dict__:
                    setattr(m, a, None)
        model.bound_pools = None

    def attach(self, model: torch.nn.Module) -> None:
        """Point the model's layers at this manager's pools again: another engine over the same
        weights (``bind`` of its own manager) moved them to its pools since."""
        for m, views in self._views:
            m.__dict__.update(views)
        model.bound_pools = self

    def _snapshot_tensors(self, device: torch.device | str) -> Snapshots:
        n, pools, dkv = self.sizes.num_snapshots, self.state_pools, self.draft_kv
        conv = ssm = hidden = draft = None
        if pools is not None:
            conv = torch.zeros(pools.conv.shape[0], n, *pools.conv.shape[2:], device=device, dtype=pools.conv.dtype)
            ssm = torch.zeros(pools.ssm.shape[0], n, *pools.ssm.shape[2:], device=device, dtype=pools.ssm.dtype)
        if self.spec.speculative:
            hidden = torch.zeros(n, self.cfg.hidden_size, device=device, dtype=self.dtype)
        if dkv is not None:
            draft = torch.zeros(*dkv.shape[:2], n, self.snapshot_draft_slots, *dkv.shape[3:], device=device,
                                dtype=dkv.dtype)
        return Snapshots(conv, ssm, hidden, draft)

    # ---- admission ---------------------------------------------------------------------------
    def need(self, total_tokens: int) -> Allocation:
        """What a request of ``total_tokens`` (prompt + max_tokens) reserves (ids left empty)."""
        n = self.pages_for(total_tokens + self.spec.num_draft_tokens)
        return Allocation(pages=[0] * n, draft_pages=[0] * n if self.draft_is_paged else [],
                          ring=0 if self.spec.uses_ring else None, state_slot=0 if self.state is not None else None)

    def check_fits_ever(self, prompt_len: int, max_tokens: int) -> None:
        total = prompt_len + max_tokens
        if total > self.eng.max_model_len:
            raise CapacityError(
                f"prompt of {prompt_len} tokens + max_tokens {max_tokens} = {total} exceeds max_model_len="
                f"{self.eng.max_model_len}"
            )
        need = self.need(total)
        if len(need.pages) > self.pages.capacity:
            raise CapacityError(
                f"request needs {len(need.pages)} KV pages of {self.eng.page_size} tokens; the pool has "
                f"{self.pages.capacity}"
            )

    def can_admit(self, total_tokens: int, spare: tuple[int, int] = (0, 0)) -> bool:
        """Whether a request of ``total_tokens`` fits now, counting ``spare`` (target, draft) pages
        it can have besides the free ones: shared with, or evictable from, the prefix cache."""
        n = self.need(total_tokens)
        return (
            self.seq_slots.num_free >= 1
            and self.pages.num_free + spare[0] >= len(n.pages)
            and self.draft_pages.num_free + spare[1] >= len(n.draft_pages)
            and (n.ring is None or self.rings.num_free >= 1)
            and (n.state_slot is None or self.state_slots.num_free >= 1)
        )

    def admit(self, req_id: int, total_tokens: int, shared: tuple[list[int], list[int]] = ([], [])) -> Allocation:
        """Reserve a request's worst case; its first pages are ``shared`` (target, draft) pages the
        prefix cache owns, the rest come from the free lists."""
        if not self.can_admit(total_tokens, (len(shared[0]), len(shared[1]))):
            raise RuntimeError("admit() without can_admit()")
        if req_id in self.held:
            raise RuntimeError(f"request {req_id} is already admitted")
        n = self.need(total_tokens)
        alloc = Allocation(
            pages=shared[0] + self.pages.allocate(len(n.pages) - len(shared[0])),
            draft_pages=shared[1] + self.draft_pages.allocate(len(n.draft_pages) - len(shared[1])),
            ring=self.rings.allocate(1)[0] if n.ring is not None else None,
            state_slot=self.state_slots.allocate(1)[0] if n.state_slot is not None else None,
        )
        if alloc.state_slot is not None:
            if self.state_pools is not None:  # every recurrent layer's slot at once
                self.state_pools.conv[:, alloc.state_slot].zero_()
                self.state_pools.ssm[:, alloc.state_slot].zero_()
        self.held[req_id] = (alloc, self.seq_slots.allocate(1)[0])
        return alloc

    def release(self, req_id: int, keep: tuple[Collection[int], Collection[int]] = ((), ())) -> None:
        """Free what a request held, except the (target, draft) pages in ``keep`` (the prefix cache's)."""
        alloc, seq = self.held.pop(req_id)
        self.pages.free([p for p in alloc.pages if p not in keep[0]])
        self.draft_pages.free([p for p in alloc.draft_pages if p not in keep[1]])
        if alloc.ring is not None:
            self.rings.free([alloc.ring])
        if alloc.state_slot is not None:
            self.state_slots.free([alloc.state_slot])
        self.seq_slots.free([seq])

    # ---- prefix snapshots --------------------------------------------------------------------
    def save_snapshot(self, slot: int, alloc: Allocation, boundary: int, hidden: torch.Tensor | None) -> None:
        """Copy what a prefill resumed at ``boundary`` needs into snapshot ``slot``: the request's
        recurrent states (after position boundary - 1), ``hidden`` (h of position boundary - 1) and its
        draft slots (``snapshot_draft_slots``; those past boundary - 2 are not written yet and are
        rewritten by the resumed prefill before any read)."""
        s = self.snapshots
        if s.conv is not None:
            s.conv[:, slot] = self.state_pools.conv[:, alloc.state_slot]
            s.ssm[:, slot] = self.state_pools.ssm[:, alloc.state_slot]
        if s.hidden is not None:
            s.hidden[slot] = hidden[0]
        if s.draft is not None:
            bytewise(s.draft)[:, :, slot] = bytewise(self.draft_kv)[:, :, self._snapshot_draft_index(alloc, boundary)]

    def load_snapshot(self, slot: int, alloc: Allocation, boundary: int) -> torch.Tensor | None:
        """Restore snapshot ``slot`` into a newly admitted request's own state slot and draft slots;
        returns a copy of its hidden state (None in dense mode)."""
        s = self.snapshots
        if s.conv is not None:
            self.state_pools.conv[:, alloc.state_slot] = s.conv[:, slot]
            self.state_pools.ssm[:, alloc.state_slot] = s.ssm[:, slot]
        if s.draft is not None:
            bytewise(self.draft_kv)[:, :, self._snapshot_draft_index(alloc, boundary)] = bytewise(s.draft)[:, :, slot]
        return None if s.hidden is None else s.hidden[slot : slot + 1].clone()

    def _snapshot_draft_index(self, alloc: Allocation, boundary: int) -> torch.Tensor:
        """Flat draft-pool slots of a request that a snapshot at ``boundary`` holds: its ring, or its
        draft page ending at the boundary."""
        n = self.snapshot_draft_slots
        first = alloc.ring * n if self.spec.uses_ring else alloc.draft_pages[boundary // self.eng.page_size - 1] * n
        return torch.arange(first, first + n, device=self.draft_kv.device)

    def usage(self) -> dict[str, int]:
        """Units in use per pool (0 everywhere when idle and nothing is cached: the leak check)."""
        return {
            "pages": self.pages.capacity - self.pages.num_free,
            "draft_pages": self.draft_pages.capacity - self.draft_pages.num_free,
            "rings": self.rings.capacity - self.rings.num_free,
            "state_slots": self.state_slots.capacity - self.state_slots.num_free,
            "seqs": self.seq_slots.capacity - self.seq_slots.num_free,
        }
