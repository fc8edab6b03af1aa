"""What one model forward needs to know besides the tokens: positions, KV addressing, state slots.

A forward processes a flat batch of T tokens from B requests. Request b contributes ``q_lens[b]``
query tokens at the contiguous positions ``q_starts[b] .. q_starts[b] + q_lens[b] - 1`` (prefill
chunk, decode, verify, draft-extend and draft step are all of this form). Its keys are the
positions ``0 .. q_last`` held in the layer's flat KV cache at the slots that ``kv_slots`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from wmtp.engine.window import DraftWindow


class KVSlots(Protocol):
    """Maps (request index in the batch, key positions) to slots of a flat ``[num_slots, ...]`` cache."""

    def slots(self, req: int, positions: torch.Tensor) -> torch.Tensor: ...

    def group_slots(self, reqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[G, S] slots of the same ``positions`` [S] for each of the requests ``reqs`` [G]."""
        ...


def to_device(data, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values as a tensor on ``device``, queued on the stream: ``torch.tensor(data, device=...)``
    copies through a stream sync, so the host waits for every kernel queued before it and the GPU then
    idles while the host queues the next ones. (The pageable source is staged before the copy call
    returns, so it may be freed at once.)"""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


@dataclass
class PagedSlots:
    """Paged target / full-length draft pool: ``slot = block_table[b, p // page] * page + p % page``."""

    block_table: torch.Tensor  # [B, max_blocks] int
    page_size: int

    def slots(self, req: int, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(self.block_table.device)
        pages = self.block_table[req, torch.div(positions, self.page_size, rounding_mode="floor")]
        return pages.long() * self.page_size + positions % self.page_size

    def group_slots(self, reqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(self.block_table.device)
        pages = self.block_table[reqs][:, torch.div(positions, self.page_size, rounding_mode="floor")]
        return pages.long() * self.page_size + positions % self.page_size

    def batch_slots(self, positions: torch.Tensor, num_pages: torch.Tensor, trash: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` [B, n] (device tensors, no host sync): row b's position p, when
        ``0 <= p < num_pages[b] * page``, else ``trash`` (past a request's reserved pages)."""
        page = torch.div(positions, self.page_size, rounding_mode="floor")
        ok = (positions >= 0) & (page < num_pages[:, None])
        pages = self.block_table.gather(1, page.clamp(0, self.block_table.shape[1] - 1))
        return torch.where(ok, pages.long() * self.page_size + positions % self.page_size, trash)


@dataclass
class RingSlots:
    """Per-request draft ring (DESIGN §4): ``slot = base[b] + ring_slot(p)``."""

    base: torch.Tensor  # [B] first slot of each request's ring
    window: DraftWindow
    num_draft_tokens: int

    def slots(self, req: int, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(self.base.device)
        return self.base[req].long() + self.window.ring_slot(positions, self.num_draft_tokens)

    def group_slots(self, reqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(self.base.device)
        return self.base[reqs].long()[:, None] + self.window.ring_slot(positions, self.num_draft_tokens)

    def batch_slots(self, positions: torch.Tensor, active: torch.Tensor, trash: torch.Tensor) -> torch.Tensor:
        """Slots of ``positions`` [B, n] (device tensors, no host sync) for the rows where
        ``active`` [B], ``trash`` elsewhere."""
        slots = self.base.long()[:, None] + self.window.ring_slot(positions.clamp(min=0), self.num_draft_tokens)
        return torch.where(active[:, None], slots, trash)


@dataclass
class ForwardContext:
    """Per-forward metadata shared by every layer of one model (target or MTP head)."""

    q_starts: list[int]
    q_lens: list[int]
    kv_slots: KVSlots | None = None
    state_slots: torch.Tensor | None = None  # [B] recurrent-state slot per request (hybrid targets)
    windows: list[DraftWindow | None] | None = None  # per request draft window; None = full causal
    device: torch.device | str = "cpu"
    # Filled by GDN layers when ``record_states`` is set (speculative verify; every request has the
    # same q_len n; the states are left as they were): per layer, (conv windows [B, K-1+n, C] = old
    # conv state then this forward's inputs, each token's delta-rule inputs [B*n, record_width]) so
    # the engine can replay any accepted prefix.
    record_states: bool = False
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per-forward data a backend derives once and every layer reuses (e.g. kernel metadata).
    backend_cache: dict[str, object] = field(default_factory=dict)
    # (cos, sin) of ``positions`` when the caller computed them already (the static decode path
    # computes every forward's at the start of the iteration, in one go); None: the model does.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if len(self.q_starts) != len(self.q_lens):
            raise ValueError("ForwardContext: q_starts and q_lens differ in length")

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[T] positions of all query tokens, request-major."""
        parts = [torch.arange(s, s + n) for s, n in zip(self.q_starts, self.q_lens)]
        return torch.cat(parts).to(self.device, non_blocking=True) if parts else torch.zeros(0, dtype=torch.long)

    @cached_property
    def token_offsets(self) -> list[int]:
        """Start of each request's tokens in the flat batch (length B + 1)."""
        out = [0]
        for n in self.q_lens:
            out.append(out[-1] + n)
        return out

    @cached_property
    def device_lens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_start, q_len, token offset) per request, int32 on ``device``: what kernels read instead
        of the host lists (one copy per forward, shared by every layer)."""
        host = torch.tensor([self.q_starts, self.q_lens, self.token_offsets[:-1]], dtype=torch.int32)
        return tuple(host.to(self.device, non_blocking=True).unbind(0))

    def bind_static(self, positions: torch.Tensor, write_slots: torch.Tensor,
                    device_lens: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Make the device-side fields these static buffers (CUDA-graph capture and replay): the
        host lists keep only the shapes, which a graph fixes; the values are whatever the buffers
        hold when the graph runs."""
        self.__dict__.update(positions=positions, write_slots=write_slots, device_lens=device_lens)

    def record_buffers(self, record: tuple[torch.Tensor, torch.Tensor] | None,
                       conv_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A recurrent layer's preallocated verify record (tokens, windows [seqs, K-1+d, C], sized
        for the largest verify d) viewed for this forward's n = q_len tokens: the windows packed as
        [seqs, K-1+n, C] (an adaptive depth verifies fewer than d)."""
        if record is None or not self.record_states:
            return record
        return record[0], packed_windows(record[1], conv_kernel - 1 + self.q_lens[0])

    def window(self, req: int) -> DraftWindow | None:
        return None if self.windows is None else self.windows[req]

    @cached_property
    def write_slots(self) -> torch.Tensor:
        """[T] cache slot each query token's new K/V is written to."""
        assert self.kv_slots is not None, "ForwardContext.kv_slots is needed by attention layers"
        parts = [
            self.kv_slots.slots(b, torch.arange(s, s + n, device=self.device))
            for b, (s, n) in enumerate(zip(self.q_starts, self.q_lens))
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.device)


def packed_windows(buf: torch.Tensor, rows: int) -> torch.Tensor:
    """``buf`` [..., seqs, R, C] (each leading slice contiguous) as [..., seqs, rows, C], rows <= R:
    the first seqs·rows·C elements of each leading slice, so a record of fewer verify tokens is laid
    out as if its buffer had been allocated for them."""
    *lead, seqs, R, C = buf.shape
    if rows > R:
        raise ValueError(f"packed_windows: {rows} rows do not fit the record's {R}")
    return buf.reshape(*lead, seqs * R * C)[..., : seqs * rows * C].view(*lead, seqs, rows, C)
