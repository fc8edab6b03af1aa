"""Greedy output-diff table (reviewers: per-cell divergence counts, dense vs native vs windowed).

Speculation is lossless, so in exact arithmetic every mode emits the same greedy tokens; in bf16
the verify itself is not bit-deterministic across batch shapes, so a pair can diverge after a
near-tie. The table lets a reader compare native-vs-dense with windowed-vs-native divergence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import combinations


@dataclass(frozen=True)
class DiffCell:
    """One (mode pair, prompt) cell. ``n_diff`` counts positions i < max(len_a, len_b) where the
    tokens differ or one output is missing; ``first_diff`` is the first such i (None: identical)."""

    mode_a: str
    mode_b: str
    prompt: str
    n_diff: int
    first_diff: int | None
    len_a: int
    len_b: int

    def to_dict(self) -> dict:
        return asdict(self)


def diff_tokens(a: Sequence[int], b: Sequence[int]) -> tuple[int, int | None]:
    """(number of differing positions, first differing position or None)."""
    n = max(len(a), len(b))
    diffs = [i for i in range(n) if i >= len(a) or i >= len(b) or a[i] != b[i]]
    return len(diffs), (diffs[0] if diffs else None)


def output_diff_table(outputs: Mapping[str, Mapping[str, Sequence[int]]]) -> list[DiffCell]:
    """``outputs[mode][prompt] = generated token ids``; one cell per mode pair (in the mapping's
    order) and prompt both modes have."""
    cells = []
    for ma, mb in combinations(list(outputs), 2):
        for prompt in outputs[ma]:
            if prompt not in outputs[mb]:
                continue
            a, b = outputs[ma][prompt], outputs[mb][prompt]
            n, first = diff_tokens(a, b)
            cells.append(DiffCell(ma, mb, str(prompt), n, first, len(a), len(b)))
    return cells


def summarize_diffs(cells: Sequence[DiffCell]) -> list[dict]:
    """Per mode pair: cells, cells that differ, total differing tokens, total tokens compared."""
    pairs: dict[tuple[str, str], dict] = {}
    for c in cells:
        s = pairs.setdefault((c.mode_a, c.mode_b), {"mode_a": c.mode_a, "mode_b": c.mode_b, "cells": 0,
                                                     "cells_differing": 0, "tokens_differing": 0, "tokens": 0})
        s["cells"] += 1
        s["cells_differing"] += c.n_diff > 0
        s["tokens_differing"] += c.n_diff
        s["tokens"] += max(c.len_a, c.len_b)
    return list(pairs.values())


def greedy_outputs(model, prompts: Mapping[str, Sequence[int]], specs: Mapping[str, object], max_tokens: int,
                   max_num_seqs: int = 1, prefill_chunk: int = 512) -> dict[str, dict[str, list[int]]]:
    """Greedy (temperature 0, ignore_eos) generations of every prompt under every ``SpecConfig``,
    one fresh engine per mode on the same model: ``{mode_name: {prompt_name: token ids}}``."""
    from wmtp.engine.config import EngineConfig
    from wmtp.engine.engine import Engine
    from wmtp.engine.sampling import SamplingParams

    longest = max(len(p) for p in prompts.values()) + max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, dict[str, list[int]]] = {}
    for name, spec in specs.items():
        eng = Engine(model, spec, EngineConfig(max_model_len=longest + 16, max_num_seqs=max_num_seqs,
                                               prefill_chunk=prefill_chunk))
        rids = {p: eng.add_request(list(ids), params) for p, ids in prompts.items()}
        while eng.has_unfinished():
            eng.step()
        out[name] = {p: eng.requests[r].tokens[len(prompts[p]):] for p, r in rids.items()}
    return out
