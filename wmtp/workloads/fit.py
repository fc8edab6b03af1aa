"""Exact-token-length text assembly.

A prompt is ``head + haystack + tail``; the haystack is a sequence of small units (words, sentences,
list entries) joined by a separator. BPE token counts are not additive across arbitrary joins, so
every length here is measured by encoding the whole candidate string with the real tokenizer; the
fitters binary-search the number of whole units and then cut one unit at character level to land on
the exact count. The cut unit is the one farthest from the fixed text it abuts (the last unit when
filling forwards, the first when filling backwards), so needles and questions are never cut.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from wmtp.errors import WmtpError

Count = Callable[[str], int]


class PromptTokenizer:
    """The HF ``tokenizers`` tokenizer of a checkpoint directory, encoding without special tokens (as
    ``wmtp.tokenizer.TextTokenizer.encode`` does); also maps character offsets to token indices."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.dir = Path(path)
        f = self.dir / "tokenizer.json"
        if not f.exists():
            raise WmtpError(f"{self.dir}: no tokenizer.json (give the checkpoint or tokenizer directory)")
        raw = f.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.tok = Tokenizer.from_str(raw.decode())
        self.chat_template = self._chat_template()

    def _chat_template(self) -> str | None:
        cfg = self.dir / "tokenizer_config.json"
        if cfg.exists():
            t = json.loads(cfg.read_text()).get("chat_template")
            if isinstance(t, str):
                return t
        jinja = self.dir / "chat_template.jinja"
        return jinja.read_text() if jinja.exists() else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def token_index(self, text: str, char_pos: int) -> int:
        """Index of the token that holds character ``char_pos`` of ``text``."""
        idx = self.tok.encode(text, add_special_tokens=False).char_to_token(char_pos)
        if idx is None:
            raise WmtpError(f"character {char_pos} maps to no token")
        return idx


def _most_units(count: Count, text, lo: int, hi: int, n: int) -> int:
    """Largest m in [lo, hi] with count(text(m)) <= n, by bisection (count(text(lo)) <= n given)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text(mid)) <= n:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_forward(count: Count, head: str, units: Sequence[str], sep: str, tail: str, n: int,
                min_units: int = 0) -> tuple[str, int]:
    """Haystack H = sep.join(units[:m]) (+ sep + a prefix of units[m]) with count(head + H + tail) == n
    and m >= min_units; returns (H, units touched). Raises WmtpError if the budget cannot hold
    ``min_units`` units or no cut lands exactly on n (or the units run out)."""

    def text(m: int, partial: str | None = None, joiner: str = sep) -> str:
        body = sep.join(units[:m])
        if partial is not None:  # "" = the joiner alone: one more candidate length
            body = body + joiner + partial if m else partial
        return head + body + tail

    if count(text(min_units)) > n:
        raise WmtpError(f"{n} tokens cannot hold the fixed parts of this prompt "
                        f"({count(text(min_units))} tokens needed); ask for more tokens")
    lo = _most_units(count, text, min_units, len(units), n)
    for m in range(lo, max(min_units, lo - 3) - 1, -1):  # a jump past n at one unit: back off a unit
        if count(text(m)) == n:
            return _body(text(m), head, tail), m
        if m >= len(units):
            break
        for j, part in _partials(units, m, +1, sep):
            cut = _cut_chars(lambda c: count(text(m, part(c), j)), n, part.length)
            if cut is not None:
                return _body(text(m, part(cut), j), head, tail), m + 1
    raise WmtpError(f"could not reach exactly {n} tokens (haystack exhausted or tokenizer jumps); "
                    f"try another seed or length")


def fit_backward(count: Count, head: str, units: Sequence[str], sep: str, tail: str, n: int,
                 lead: str = "") -> tuple[str, int]:
    """Like ``fit_forward`` but takes the LAST units (H = [suffix of units[-m-1]] + sep + sep.join(
    units[-m:])) so that the text right before ``tail`` is kept whole and the cut falls at the start.
    A non-empty H is returned with ``lead`` in front (the separator after a needle)."""

    def text(m: int, partial: str | None = None, joiner: str = sep) -> str:
        body = sep.join(units[len(units) - m:]) if m else ""
        if partial is not None:  # "" = the joiner alone: one more candidate length
            body = partial + joiner + body if m else partial
        return head + (lead + body if body else "") + tail

    if count(text(0)) > n:
        raise WmtpError(f"{n} tokens cannot hold the fixed parts of this prompt ({count(text(0))} "
                        f"tokens needed); ask for more tokens")
    lo = _most_units(count, text, 0, len(units), n)
    for m in range(lo, max(0, lo - 3) - 1, -1):
        if count(text(m)) == n:
            return _body(text(m), head, tail), m
        if m >= len(units):
            break
        for j, part in _partials(units, len(units) - m - 1, -1, sep):
            cut = _cut_chars(lambda c: count(text(m, part(c), j)), n, part.length)
            if cut is not None:
                return _body(text(m, part(cut), j), head, tail), m + 1
    raise WmtpError(f"could not reach exactly {n} tokens (haystack exhausted or tokenizer jumps); "
                    f"try another seed or length")


def _partials(units: Sequence[str], i: int, step: int, sep: str):
    """Candidate cut pieces, best first: (joiner, piece(c) -> str of c characters).

    One more character can cost two tokens at once (a merge undone plus a new token, or the
    character plus a line break), so a length skipped by one candidate is reached by another: the
    boundary unit ``units[i]`` cut on its natural side (its start when filling forwards, its end when
    filling backwards), then other joiners, the other side, and the next units outwards."""
    joiners = tuple(dict.fromkeys((sep, " ", "\n")))
    for k in range(4):
        idx = i + step * k
        if not 0 <= idx < len(units):
            break
        u = units[idx]
        natural = (lambda c, u=u: u[:c]) if step > 0 else (lambda c, u=u: u[len(u) - c:])
        other = (lambda c, u=u: u[len(u) - c:]) if step > 0 else (lambda c, u=u: u[:c])
        for piece in (natural, other):
            for j in joiners:
                yield j, _Piece(piece, len(u))


class _Piece:
    """A cut of one unit to c characters (c < len), with its length for the search."""

    def __init__(self, fn, length: int) -> None:
        self.fn, self.length = fn, length

    def __call__(self, c: int) -> str:
        return self.fn(c)


def _body(full: str, head: str, tail: str) -> str:
    return full[len(head):len(full) - len(tail)]


def _cut_chars(count_at: Callable[[int], int], n: int, length: int) -> int | None:
    """Search for c in 0..length-1 with count_at(c) == n (count_at is non-decreasing in c in
    practice; a binary search narrows, a short scan confirms)."""
    lo, hi = 0, length - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if count_at(mid) < n:
            lo = mid + 1
        else:
            hi = mid
    for c in range(max(0, lo - 2), min(length, lo + 3)):
        if count_at(c) == n:
            return c
    for c in range(length):  # not monotone here: scan the whole unit
        if count_at(c) == n:
            return c
    return None
