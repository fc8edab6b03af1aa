"""Prefix caching (DESIGN §12): a content-addressed index of full prompt pages, refcounted and
evicted least-recently-used first, and the snapshots from which a prefill resumes at a page boundary.

Nodes. A node is one full target page at depth k (positions [k·ps, (k+1)·ps), ps = page size),
keyed by its parent node and its ps token ids: a key names the tokens of the page and of all its
predecessors, exactly (the dict compares the tokens; no hash collision can alias two prefixes).
With a paged draft pool (native; windowed with ``ring=False``) node k also holds draft page k-1:
draft slot p holds (embed(x_{p+1}), h_p), so draft page k-1 is fixed by the tokens of pages 0..k,
and the request that wrote target page k wrote it (its last slot needs x_{k·ps}, page k's first token).

Resuming. At admission a request walks its prompt's pages through the index, at most
len(prompt) - 1 tokens deep (at least the last prompt token is prefilled, so the first output token
and the draft's d_1 come from the ordinary path), and cuts the match back to the deepest page that
has a snapshot: P tokens. The snapshot (``MemoryManager.save_snapshot``) holds the recurrent states
after x_{P-1}, h_{P-1} (the hidden state the draft, lagging by one, needs for slot P-1) and the
draft's ring, or its draft page ending at P. The request shares the P/ps target pages (and draft
pages 0..P/ps-2), gets the snapshot in its own state slot, ring or tail draft page, h_{P-1} as its
pending hidden state, and prefills from P on exactly as the uncached prefill continues from P.
Targets whose resume needs nothing but KV (attention-only, dense) take no snapshots and resume at
any matched page.

Snapshot boundaries of a prompt of n tokens: every ``prefix_snapshot_interval`` pages and the last
page boundary <= n. The engine ends prefill chunks there (``chunk_end``) and calls ``record_chunk``
after each chunk, which registers the chunk's full pages and takes the snapshot. A windowed draft
prefill writes only slots that some query can read (``draft_runs``): with the cache these include
the keys a context ending at the next boundary reads, so a ring snapshot holds every slot a resumed
request reads; a paged windowed draft writes every slot, since its pages serve requests resuming
at other requests' boundaries.

Invariants:
- Shared pages are never written: only full pages wholly inside a prompt are registered, and a
  request writes target KV only at positions >= its resume point (prefill) or >= its prompt length
  (decode, verify), draft KV at positions >= resume point - 1, inside its own tail draft page.
- A request's nodes are a root path, so every holder of a node holds its ancestors and refs(parent)
  >= refs(child); nodes whose refs drop to 0 enter the LRU deepest first, so the LRU's oldest node
  is always a leaf. Eviction takes only nodes with refs 0: never a page a running request reads.
- Admission counts only the pages a request adds: its worst case less the shared pages, against
  the free pages plus those eviction can free (the hit's own nodes excluded).

Requests that arrive together. A waiting request whose prompt shares a prefix with a request still
prefilling it is admitted only once that prefill has passed the deepest point it could resume from
(``resume_point``; the engine's ``_awaits_prefix``), so a document sent by several users at once is
prefilled once; a prefix shorter than one prefill chunk is computed again rather than waited for.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from wmtp.engine.config import EngineConfig
from wmtp.engine.memory import Allocation, MemoryManager
from wmtp.engine.window import DraftWindow

Key = tuple[int, tuple[int, ...]]  # (parent node id or -1, the page's token ids)


@dataclass(eq=False)  # identity semantics: nodes are looked up by key, compared by object
class _Node:
    id: int
    key: Key
    parent: _Node | None
    page: int  # target page
    draft_page: int | None  # draft page depth - 1 (paged draft pools; None at depth 0)
    refs: int = 0  # requests holding it
    children: int = 0  # nodes keyed under it
    snapshot: int | None = None  # snapshot slot at the boundary that ends this page


class PrefixCache:
    """The index, its LRU and the snapshot slots over one ``MemoryManager``'s pools (module
    docstring). With ``EngineConfig.prefix_cache`` off, or where a resume needs snapshots and
    ``prefix_snapshots=0`` leaves none, it only forwards admission and release."""

    def __init__(self, memory: MemoryManager, eng: EngineConfig) -> None:
        self.memory, self.page = memory, eng.page_size
        self.interval = eng.prefix_snapshot_interval * eng.page_size  # tokens between periodic boundaries
        self.needs_snapshot = memory.snapshot_bytes > 0  # a resume restores more than KV pages
        # whether prefills end chunks at boundaries and take snapshots there
        self.snapshots_on = eng.prefix_cache and memory.sizes.num_snapshots > 0
        self.enabled = self.snapshots_on or (eng.prefix_cache and not self.needs_snapshot)
        self._index: dict[Key, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # nodes with refs 0, least recently used first
        self._snapshot_lru: OrderedDict[int, _Node] = OrderedDict()  # nodes holding a snapshot, the same order
        self._chains: dict[int, list[_Node]] = {}  # request id -> the nodes it holds, root first
        self._ids = itertools.count()
        self.hit_requests = self.hit_tokens = self.evicted_pages = 0

    # ---- admission and release -----------------------------------------------------------------
    def admit(self, req_id: int, prompt: list[int],
              total_tokens: int) -> tuple[Allocation, int, torch.Tensor | None] | None:
        """Reserve a request's memory, sharing the longest cached prefix it can resume from; returns
        (allocation, resume point P, pending hidden state h_{P-1} or None), or None when it does not
        fit now (nothing changed)."""
        nodes = self._match(prompt) if self.enabled else []
        shared = ([n.page for n in nodes], [n.draft_page for n in nodes[1:]] if self.memory.draft_is_paged else [])
        hit = {n.id for n in nodes}
        evictable = [n for n in self._lru.values() if n.id not in hit]
        spare = (len(shared[0]) + len(evictable), len(shared[1]) + sum(n.draft_page is not None for n in evictable))
        if not self.memory.can_admit(total_tokens, spare):
            return None
        self._pin(nodes)
        self._evict_for(total_tokens, shared)
        alloc = self.memory.admit(req_id, total_tokens, shared)
        self._chains[req_id] = nodes
        resume, hidden = len(nodes) * self.page, None
        if resume:
            self.hit_requests += 1
            self.hit_tokens += resume
            if self.needs_snapshot:
                hidden = self.memory.load_snapshot(nodes[-1].snapshot, alloc, resume)
                self._snapshot_lru.move_to_end(nodes[-1].id)
        return alloc, resume, hidden

    def release(self, req_id: int) -> None:
        """Free a finished request's memory; the pages of its nodes stay cached (LRU once unheld)."""
        chain = self._chains.pop(req_id)
        self.memory.release(req_id, ({n.page for n in chain}, {n.draft_page for n in chain}))
        for node in reversed(chain):  # deepest first: the LRU's oldest node stays a leaf
            node.refs -= 1
            if node.refs == 0:
                self._lru[node.id] = node

    def _match(self, prompt: list[int]) -> list[_Node]:
        """The cached nodes a prompt resumes from (module docstring: at most len - 1 tokens, cut
        back to the deepest snapshot where one is needed)."""
        nodes: list[_Node] = []
        for k in range((len(prompt) - 1) // self.page):
            node = self._index.get(self._key(nodes[-1] if nodes else None, prompt, k))
            if node is None:
                break
            nodes.append(node)
        while self.needs_snapshot and nodes and nodes[-1].snapshot is None:
            nodes.pop()
        return nodes

    def resume_point(self, other: list[int], prompt: list[int]) -> int:
        """The deepest point ``prompt`` can resume from once a request prefilling ``other`` has passed
        it: within their common full pages (at most len(prompt) - 1 tokens, as ``_match``), the last of
        ``other``'s snapshot boundaries, or the last common page where a resume needs only KV."""
        ps, k = self.page, 0
        limit = min(len(other), len(prompt) - 1) // ps
        while k < limit and other[k * ps : (k + 1) * ps] == prompt[k * ps : (k + 1) * ps]:
            k += 1
        shared = k * ps
        if not self.needs_snapshot or self._is_boundary(len(other), shared):
            return shared
        return shared // self.interval * self.interval

    def _key(self, parent: _Node | None, prompt: list[int], k: int) -> Key:
        return (-1 if parent is None else parent.id, tuple(prompt[k * self.page : (k + 1) * self.page]))

    def _pin(self, nodes: list[_Node]) -> None:
        for node in nodes:
            node.refs += 1
            self._lru.pop(node.id, None)

    def _evict_for(self, total_tokens: int, shared: tuple[list[int], list[int]]) -> None:
        """Evict LRU nodes until the free lists hold the pages a request of ``total_tokens`` adds."""
        m, need = self.memory, self.memory.need(total_tokens)
        while (m.pages.num_free < len(need.pages) - len(shared[0])
               or m.draft_pages.num_free < len(need.draft_pages) - len(shared[1])):
            self._evict(next(iter(self._lru.values())))

    def _evict(self, node: _Node) -> None:
        if node.children or node.refs:
            raise RuntimeError(f"prefix cache: evicting node {node.id} with {node.children} children, {node.refs} refs")
        del self._lru[node.id], self._index[node.key]
        if node.parent is not None:
            node.parent.children -= 1
        self.memory.pages.free([node.page])
        if node.draft_page is not None:
            self.memory.draft_pages.free([node.draft_page])
        if node.snapshot is not None:
            del self._snapshot_lru[node.id]
            self.memory.snapshot_slots.free([node.snapshot])
        self.evicted_pages += 1

    # ---- prefill -------------------------------------------------------------------------------
    def chunk_end(self, prompt_len: int, start: int, end: int) -> int:
        """A prefill chunk [start, end) shortened to end at the next snapshot boundary."""
        return min(end, self._next_boundary(prompt_len, start + 1)) if self.snapshots_on else end

    def draft_runs(self, window: DraftWindow, lo: int, hi: int, prompt_len: int) -> list[tuple[int, int]]:
        """The slots of [lo, hi) a windowed draft prefill writes (module docstring): without
        snapshots those its own context ever reads; with a ring also those a context ending at the
        next boundary reads; with a paged draft pool every slot."""
        if not self.snapshots_on:
            return window.ever_read_runs(lo, hi, prompt_len)
        if not self.memory.spec.uses_ring:
            return [(lo, hi)]
        return window.ever_read_runs(lo, hi, min(prompt_len, self._next_boundary(prompt_len, hi + 1) + 1))

    def record_chunk(self, req_id: int, prompt: list[int], prefilled: int, hidden: torch.Tensor | None) -> None:
        """After a prefill chunk ending at ``prefilled``: register the full pages it completed and,
        at a snapshot boundary, snapshot the request (``hidden`` = h_{prefilled-1})."""
        if not self.enabled:
            return
        chain, alloc = self._chains[req_id], self.memory.held[req_id][0]
        for k in range(len(chain), prefilled // self.page):
            self._register(chain, alloc, prompt, k)
        if not self.snapshots_on or not self._is_boundary(len(prompt), prefilled):
            return
        node = chain[prefilled // self.page - 1]
        if node.snapshot is None:  # else an identical prefix was snapshotted here already
            node.snapshot = self._snapshot_slot()
            self.memory.save_snapshot(node.snapshot, alloc, prefilled, hidden)
        self._snapshot_lru[node.id] = node
        self._snapshot_lru.move_to_end(node.id)

    def _register(self, chain: list[_Node], alloc: Allocation, prompt: list[int], k: int) -> None:
        """Hold the node of page k: the request's own page k as a new node, or the node another
        request registered for the same prefix (the request's copy then stays private)."""
        parent = chain[-1] if chain else None
        key = self._key(parent, prompt, k)
        node = self._index.get(key)
        if node is None:
            draft = alloc.draft_pages[k - 1] if k and self.memory.draft_is_paged else None
            node = self._index[key] = _Node(next(self._ids), key, parent, alloc.pages[k], draft)
            if parent is not None:
                parent.children += 1
        self._pin([node])
        chain.append(node)

    def _snapshot_slot(self) -> int:
        """A free snapshot slot, else the least recently used snapshot's (snapshots are copied on a
        hit, never held, so any can go)."""
        if self.memory.snapshot_slots.num_free:
            return self.memory.snapshot_slots.allocate(1)[0]
        _, old = self._snapshot_lru.popitem(last=False)
        slot, old.snapshot = old.snapshot, None
        return slot

    def _next_boundary(self, prompt_len: int, pos: int) -> int:
        """The first snapshot boundary >= ``pos`` (1 <= pos <= prompt_len), else the prompt's end."""
        candidates = (-(-pos // self.interval) * self.interval, prompt_len // self.page * self.page, prompt_len)
        return min(b for b in candidates if pos <= b <= prompt_len)

    def _is_boundary(self, prompt_len: int, pos: int) -> bool:
        return pos > 0 and (pos % self.interval == 0 or pos == prompt_len // self.page * self.page)

    # ---- metrics -------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Requests that resumed from the cache, the prompt tokens they skipped, pages cached now
        (held or not), pages evicted so far, snapshots held now."""
        return {"hit_requests": self.hit_requests, "hit_tokens": self.hit_tokens, "cached_pages": len(self._index),
                "evicted_pages": self.evicted_pages, "snapshots": len(self._snapshot_lru)}
