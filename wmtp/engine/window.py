"""The draft window rule and the draft-KV ring: the single source of truth (DESIGN §3, §4).

Kernels take (sink, window) and the ring geometry as scalar arguments and apply these formulas;
the PyTorch reference, the engine's memory accounting and the probes call these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftWindow:
    """Visible keys for a draft query at position q: ``{k <= q : k < sink or k > q - window}``.

    Invariant: for ``q < sink + window`` this is plain causal attention.
    """

    sink: int = 64
    window: int = 4032

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"draft window W={self.window} must be >= 1")
        if self.sink < 0:
            raise ValueError(f"draft sink={self.sink} must be >= 0")

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean mask, broadcasting q_pos against k_pos."""
        return (k_pos <= q_pos) & ((k_pos < self.sink) | (k_pos > q_pos - self.window))

    def recent_start(self, q_pos: int) -> int:
        """First position of the recent part of the window for query q (may be inside the sink)."""
        return max(q_pos - self.window + 1, 0)

    def key_positions(self, q_first: int, q_last: int) -> torch.Tensor:
        """Sorted key positions any query in [q_first, q_last] may read: O(sink + W + span)."""
        start = self.recent_start(q_first)
        sink_end = min(self.sink, start)
        return torch.cat([torch.arange(sink_end), torch.arange(start, q_last + 1)])

    def ring_size(self, num_draft_tokens: int) -> int:
        """Ring slots per request: sink + W + d (the +d lets an iteration write ahead safely)."""
        return self.sink + self.window + num_draft_tokens

    def ring_slot(self, pos: torch.Tensor | int, num_draft_tokens: int) -> torch.Tensor | int:
        """Slot of draft position ``pos`` inside its request's ring."""
        modulus = self.window + num_draft_tokens
        if isinstance(pos, int):
            return pos if pos < self.sink else self.sink + (pos - self.sink) % modulus
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink) % modulus)

    def ever_read(self, pos: int, context_len: int) -> bool:
        """Can the draft slot at ``pos`` still be read once the context has ``context_len`` tokens?"""
        return pos < self.sink or pos > context_len - 1 - self.window

    def ever_read_runs(self, lo: int, hi: int, context_len: int) -> list[tuple[int, int]]:
        """The positions of [lo, hi) that ``ever_read`` keeps, as at most two [start, end) runs
        (the sink, then the tail of the last W): O(1), no per-position list."""
        runs = [(lo, min(hi, self.sink)), (max(lo, self.sink, context_len - self.window), hi)]
        return [(a, b) for a, b in runs if a < b]


def causal_key_positions(q_last: int) -> torch.Tensor:
    """Key positions for full causal attention (target and native draft)."""
    return torch.arange(q_last + 1)
