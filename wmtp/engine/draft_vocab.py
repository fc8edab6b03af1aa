"""A pruned draft vocabulary V′ (``SpecConfig.draft_vocab``): the MTP head's logits over V′ only.

The draft's lm_head is the largest read of a windowed draft step (the 248,320-row head of the 35B is
1 GB in bf16); proposing only tokens of V′ reads |V′| rows of it instead. Lossless either way: the
target verifies every proposal, a greedy draft is the argmax over V′, and a sampled draft's q is
its distribution over V′ (zero elsewhere), which the exact acceptance rule takes as any q.

V′ is a frequency ranking written by ``wmtp draft-vocab`` (``rank_file``): JSON with ``ids`` (token
ids, most frequent first, ties by id), ``counts`` beside them and how they were counted
(``source``); ``SpecConfig.draft_vocab_size`` keeps the first K. The model side (the gathered head,
logits scattered back to the full vocabulary) is ``TargetLM.draft_head`` / ``draft_logits``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from wmtp.errors import ConfigError


def rank(counts: Counter, size: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids by count, most frequent first (ties: the lower id), and their counts; the first
    ``size`` (all when None)."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return [t for t, _ in ranked], [c for _, c in ranked]


def count_tokens(sequences: Iterable[Iterable[int]]) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(seq)
    return counts


def write_rank_file(path: str | Path, counts: Counter, size: int | None, source: dict) -> Path:
    """``rank(counts, size)`` as a rank file, with ``source`` (what was counted, and how)."""
    ids, freq = rank(counts, size)
    out = Path(path)
    out.write_text(json.dumps({"ids": ids, "counts": freq, "tokens_counted": sum(counts.values()),
                               "source": source}, indent=1))
    return out


def load_ids(vocab: str | Path | tuple[int, ...] | list[int], size: int | None, vocab_size: int) -> list[int]:
    """The draft vocabulary's token ids: a rank file's (or the given ids), the first ``size``; an
    error naming the problem for ids outside [0, vocab_size), repeats, or an empty set."""
    where = "SpecConfig.draft_vocab"
    if isinstance(vocab, (str, Path)):
        where = f"{vocab}"
        try:
            obj = json.loads(Path(vocab).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"SpecConfig.draft_vocab: cannot read the rank file {vocab} ({e})") from None
        ids = obj.get("ids") if isinstance(obj, dict) else None
        if not isinstance(ids, list):
            raise ConfigError(f"{where}: no \"ids\" list (write one with `wmtp draft-vocab`)")
    else:
        ids = list(vocab)
    if size is not None:
        if size > len(ids):
            raise ConfigError(f"SpecConfig.draft_vocab_size={size} exceeds the {len(ids)} ids of {where}")
        ids = ids[:size]
    if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ConfigError(f"{where}: draft vocabulary ids must be a non-empty list of ints in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: draft vocabulary ids repeat")
    return ids
