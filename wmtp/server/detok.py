"""Streaming text from token ids: incremental detokenisation and stop strings."""

from __future__ import annotations

from wmtp.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns token ids, pushed a few at a time, into text deltas without broken UTF-8.

    Each push decodes only a short window: the ids since the last emitted boundary plus the chunk
    before it as context (decoders such as sentencepiece's strip a leading space at the start of a
    decode, so the context keeps the window's text aligned with the full decode). A window whose
    text ends in U+FFFD ends inside a multi-byte character: nothing is emitted until a later token
    completes it (or ``flush`` gives up at the end of the request).

    Invariant (byte-level BPE): ``"".join(push(...) for each chunk) + flush() == decode(all ids)``.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context chunk
        self.read = 0  # end of the text already emitted

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if not final and text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


class TokenIdText:
    """Stand-in for a model without a tokenizer: the text is the space-separated token ids (as the
    ``generate`` command prints them)."""

    def __init__(self) -> None:
        self.started = False

    def push(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text = (" " if self.started else "") + " ".join(map(str, ids))
        self.started = True
        return text

    def flush(self) -> str:
        return ""


class StopStrings:
    """Cuts the text before the stop string that completes first (ties: the one starting first); the
    stop string itself is not output.

    While streaming it holds back the last ``len(longest stop) - 1`` characters, which could be the
    start of a stop string completed by the next delta; ``final=True`` releases them. Invariant: the
    output does not depend on how the text was split into deltas.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def push(self, text: str, final: bool) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        buf = self.buf + text
        hits = [(i + len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.buf = ""
            return buf[: min(hits)[1]], True
        cut = len(buf) if final else max(len(buf) - self.hold, 0)
        self.buf = buf[cut:]
        return buf[:cut], False
