"""Seeded RULER-style synthetic workloads (Hsieh et al., 2024) with prompts of an exact token length.

Tasks (the paper's six; constructions follow RULER's ``scripts/data/synthetic``, re-implemented here):

- ``niah_single``      one needle "One of the special magic numbers for {adj-noun} is: {7 digits}." in
                       an essay haystack (RULER niah_single_2; ``corpus="noise"`` gives niah_single_1's
                       repeated-sentence haystack, ``corpus="shakespeare"`` a public-domain one);
                       answer: the number.
- ``niah_multivalue``  four needles with the same key and different numbers; answer: all four.
- ``niah_multiquery``  four needles with different keys; the question asks for all four keys.
- ``vt``               variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... (4 hops) hidden in
                       repeated noise sentences; answer: the 5 variable names.
- ``cwe``              common-words extraction: a numbered list where 10 words appear 30 times and
                       the rest 3 times; answer: the 10 common words.
- ``fwe``              frequent-words extraction: random 6-letter "coded" words with Zipf(alpha=2)
                       frequencies; answer: the 3 most frequent (after the '....' noise word).

QA mode: the prompt ends with RULER's answer prefix, so a model continues with the answer. Every
prompt has exactly ``tokens`` tokens under the given tokenizer (encoded without special tokens),
asserted on return. Same (task, tokens, tokenizer, seed, options) -> identical record, byte for byte
(string seeds feed ``random.Random``, which hashes them with SHA-512: no PYTHONHASHSEED dependence).

Needle placement: by default RULER's scheme (distinct depths drawn from 40 evenly spaced depths in
[0, 100] %); or ``depths=[...]`` fractions; or ``needle_offsets=[...]``: each needle's first token sits
exactly that many tokens before the end of the prompt (offset = len(prompt) - start index), which
places a needle at an exact distance outside a draft window. For vt the "needles" are the chain lines.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from wmtp.errors import WmtpError
from wmtp.workloads.corpora import CORPORA, load_corpus, word_list
from wmtp.workloads.fit import PromptTokenizer, fit_backward, fit_forward

FORMAT = "wmtp-workload/1"
RULER_DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # 40 evenly spaced depths, 0..1
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."

NIAH_Q = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the {kind} afterwards.\n")
NIAH_TAIL = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT_Q = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_TAIL = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables "
             "are assigned the value {value}, they are: ")
CWE_Q = ("Below is a numbered list of words. In these words, some appear more often than others. "
         "Memorize the ones that appear most often.\n")
CWE_TAIL = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_Q = ("Read the following coded text and track the frequency of each coded word. Find the three most "
         "frequently appeared coded words. ")
FWE_TAIL = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
            "most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's generation budgets


@dataclass
class Prompt:
    """What a task builder hands to the assembler: fixed head/tail (instruction, question, answer
    prefix), needles with their offsets from the end, and the haystack unit stream."""

    head: str
    tail: str
    answer_prefix: str
    answers: list[str]
    units: list[str]
    sep: str
    needles: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# registry and public API
# ---------------------------------------------------------------------------------------------
Builder = Callable[..., dict]
TASKS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        TASKS[name] = fn
        return fn
    return deco


def make_workload(task: str, tokens: int, tokenizer: str | PromptTokenizer, seed: int = 0, **options: Any) -> dict:
    """One workload record (see ``FORMAT``): prompt text and token ids of exactly ``tokens`` tokens,
    answers, answer prefix, needle spans, seed, source corpus. ``options``: ``corpus`` (niah),
    ``depths`` / ``needle_offsets`` (niah, vt), ``chat`` (wrap in the tokenizer's chat template)."""
    if task not in TASKS:
        raise WmtpError(f"unknown workload task {task!r}; available: {sorted(TASKS)}")
    if tokens < 16:
        raise WmtpError(f"tokens={tokens}: too short for any task")
    import inspect

    accepted = set(inspect.signature(TASKS[task]).parameters) - {"task", "tokens", "tok", "seed"}
    if task.startswith("niah_"):
        accepted = {"corpus", "depths", "needle_offsets", "chat"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise WmtpError(f"task {task!r} takes no option(s) {unknown}; it takes {sorted(accepted)}")
    tok = tokenizer if isinstance(tokenizer, PromptTokenizer) else PromptTokenizer(tokenizer)
    return TASKS[task](task=task, tokens=tokens, tok=tok, seed=seed, **options)


def score(task: str, output_text: str, answers: Sequence[str]) -> float:
    """RULER's string_match_all: the fraction of expected answers that occur in the output
    (case-insensitive substring). 1.0 = every answer present; identical for every task here."""
    if task not in TASKS:
        raise WmtpError(f"unknown workload task {task!r}; available: {sorted(TASKS)}")
    if not answers:
        raise WmtpError("score: no expected answers")
    out = output_text.lower()
    return sum(a.lower() in out for a in answers) / len(answers)


# ---------------------------------------------------------------------------------------------
# assembly: exact length, needles at exact offsets
# ---------------------------------------------------------------------------------------------
def _chat_wrap(tok: PromptTokenizer, chat: bool) -> tuple[str, str]:
    """(before, after) the user message in the tokenizer's chat template, generation prompt on."""
    if not chat:
        return "", ""
    if tok.chat_template is None:
        raise WmtpError(f"{tok.dir}: chat=True but the tokenizer has no chat template")
    import jinja2

    mark = "\x00WMTP_USER\x00"
    text = jinja2.Environment().from_string(tok.chat_template).render(
        messages=[{"role": "user", "content": mark}], add_generation_prompt=True,
        bos_token="", eos_token="")
    before, after = text.split(mark)
    return before, after


def _depth_offsets(tok: PromptTokenizer, p: Prompt, n: int, depths: Sequence[float]) -> list[int]:
    """Token offsets from the end for needles at haystack depth fractions (0 = right after the
    instruction, 1 = right before the question), spaced so that every needle fits."""
    head, tail = tok.count(p.head), tok.count(p.tail)
    sizes = [tok.count(" " + s) for s in p.needles]
    room = n - head - tail - sum(sizes) - 8 * len(sizes)
    if room < 0:
        raise WmtpError(f"{n} tokens cannot hold the instruction, question and {len(sizes)} needle(s); "
                        f"ask for more tokens")
    offsets, before = [], 0
    for d, size in zip(depths, sizes):
        start = head + 4 + round(min(max(d, 0.0), 1.0) * room) + before
        offsets.append(n - start)
        before += size + 8
    return offsets


def _assemble(tok: PromptTokenizer, p: Prompt, n: int, offsets: list[int]) -> tuple[str, list[int]]:
    """Prompt text of exactly n tokens with needle i starting ``offsets[i]`` tokens before the end.

    Built back to front: the haystack after the last needle is fitted first, then each earlier
    gap, then the haystack after the instruction (so haystack text keeps reading order)."""
    if offsets != sorted(offsets, reverse=True) or len(set(offsets)) != len(offsets):
        raise WmtpError(f"needle offsets must be distinct and given in prompt order (decreasing): {offsets}")
    lead = " " if p.sep == " " else ""  # a needle's first token includes the separating space
    units = p.units
    after = p.tail  # text from the current needle's end to the end of the prompt
    for needle, off in zip(reversed(p.needles), reversed(offsets)):
        skip = tok.token_index(lead + needle, len(lead))  # 1 if the space is a token of its own
        need = tok.count(lead + needle + after) - skip
        if need > off:
            raise WmtpError(f"a needle at offset {off} needs at least {need} tokens after its start (itself and "
                            f"everything after it): offsets too close together or too close to the end")
        gap, used = fit_backward(tok.count, lead + needle, units, p.sep, after, off + skip, lead=p.sep)
        units = units[:len(units) - used]
        after = p.sep + needle + gap + after
    first, _ = fit_backward(tok.count, p.head, units, p.sep, after, n)
    text = p.head + first + after
    got = tok.count(text)
    if got != n:
        raise WmtpError(f"internal: assembled {got} tokens, wanted {n}")
    return text, _needle_spans(tok, text, p.needles)


def _needle_spans(tok: PromptTokenizer, text: str, needles: list[str]) -> list[tuple[int, int]]:
    """(first token, one past the last token) of each needle, in prompt order."""
    spans, pos = [], 0
    for s in needles:
        pos = text.index(s, pos)
        spans.append((tok.token_index(text, pos), tok.token_index(text, pos + len(s) - 1) + 1))
        pos += len(s)
    return spans


def _record(task: str, family: str, seed: int, n: int, tok: PromptTokenizer, text: str, p: Prompt,
            spans: list[tuple[int, int]], source: dict, options: dict) -> dict:
    ids = tok.encode(text)
    assert len(ids) == n, (len(ids), n)
    needles = [{"text": s, "start_token": a, "end_token": b, "offset_from_end": n - a}
               for s, (a, b) in zip(p.needles, spans)]
    return {
        "format": FORMAT, "task": task, "family": family, "seed": seed, "tokens": n,
        "tokens_to_generate": TOKENS_TO_GENERATE[family],
        "answers": p.answers, "answer_prefix": p.answer_prefix,
        "needles": needles, "source": source, "options": options,
        "tokenizer_sha256": tok.sha256, "meta": p.meta,
        "prompt": text, "token_ids": ids,
    }


def _rng(task: str, seed: int, what: str) -> random.Random:
    return random.Random(f"wmtp-ruler:{task}:{seed}:{what}")


def _placement(tok: PromptTokenizer, p: Prompt, n: int, rng: random.Random, depths, needle_offsets) -> list[int]:
    if needle_offsets is not None:
        if len(needle_offsets) != len(p.needles):
            raise WmtpError(f"needle_offsets has {len(needle_offsets)} entries; this task has "
                            f"{len(p.needles)} needle(s)")
        return [int(o) for o in needle_offsets]
    if depths is None:
        depths = sorted(rng.sample(RULER_DEPTHS, len(p.needles)))
    elif len(depths) != len(p.needles):
        raise WmtpError(f"depths has {len(depths)} entries; this task has {len(p.needles)} needle(s)")
    return _depth_offsets(tok, p, n, depths)


# ---------------------------------------------------------------------------------------------
# haystacks
# ---------------------------------------------------------------------------------------------
def _essay_units(corpus: str, rng: random.Random, n_chars: int) -> list[str]:
    """Sentences of the corpus (whitespace collapsed, as RULER does), documents in sorted order
    rotated to a seeded start document, repeated if needed, at least ``n_chars`` characters. Sentence
    units keep every needle between sentences, as RULER inserts them."""
    docs = load_corpus(corpus)
    start = rng.randrange(len(docs))
    order = docs[start:] + docs[:start]
    sents: list[str] = []
    total = 0
    while total < n_chars:
        for _, text in order:
            for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text).strip()):
                words = s.split(" ")
                for i in range(0, len(words), 40):  # verse runs on for pages: bound unit size
                    sents.append(" ".join(words[i:i + 40]))
                total += len(s) + 1
            if total >= n_chars:
                break
    return sents


def _source(corpus: str | None) -> dict:
    out: dict[str, Any] = {"generator": "wmtp.workloads.ruler (RULER constructions, Apache-2.0)"}
    if corpus:
        if corpus not in CORPORA:
            raise WmtpError(f"unknown corpus {corpus!r}; available: {sorted(CORPORA) + ['noise']}")
        out["corpus"] = corpus
        out["package"] = CORPORA[corpus][0]
    out["word_lists"] = "wonderwords (MIT)"
    return out


# ---------------------------------------------------------------------------------------------
# tasks
# ---------------------------------------------------------------------------------------------
def _key(rng: random.Random) -> str:
    return f"{rng.choice(word_list('adjectives'))}-{rng.choice(word_list('nouns'))}"


def _niah(task: str, tokens: int, tok: PromptTokenizer, seed: int, n_keys: int, n_values: int, n_query: int,
          corpus: str = "pg_essays", depths=None, needle_offsets=None, chat: bool = False) -> dict:
    rng = _rng(task, seed, "needles")
    keys: list[str] = []
    while len(keys) < n_keys:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    values = [[str(rng.randint(10**6, 10**7 - 1)) for _ in range(n_values)] for _ in keys]
    needles = [NEEDLE.format(kind="numbers", key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queried = rng.sample(range(n_keys), n_query)
    query = keys[queried[0]] if n_query == 1 else ", ".join(keys[i] for i in queried[:-1]) + ", and " + keys[queried[-1]]
    answers = [v for i in queried for v in values[i]]
    kind = "numbers"
    head_t, tail_t, prefix_t = NIAH_Q, NIAH_TAIL, NIAH_PREFIX
    if len(answers) == 1:  # RULER's singular wording for one expected value
        kind = "number"
        head_t = head_t.replace("Some", "A").replace(" are ", " is ")
        tail_t = tail_t.replace("are all", "is")
        prefix_t = prefix_t.replace(" are", " is")
    before, after = _chat_wrap(tok, chat)
    prefix = prefix_t.format(kind=kind, query=query)
    prefix = prefix.lstrip() if chat else prefix  # the assistant turn starts a fresh line
    if corpus == "noise":  # RULER's noise haystack (niah_single_1): one sentence repeated, one per line
        units, sep = [NOISE] * (tokens // 8 + 8), "\n"
    else:
        units, sep = _essay_units(corpus, _rng(task, seed, "haystack"), 8 * tokens + 512), " "
    p = Prompt(head=before + head_t.format(kind=kind), tail=tail_t.format(kind=kind, query=query) + after + prefix,
               answer_prefix=prefix, answers=answers, units=units, sep=sep, needles=needles,
               meta={"keys": keys, "query": query})
    offsets = _placement(tok, p, tokens, _rng(task, seed, "depths"), depths, needle_offsets)
    text, spans = _assemble(tok, p, tokens, offsets)
    opts = {"corpus": corpus, "depths": depths, "needle_offsets": needle_offsets, "chat": chat}
    return _record(task, "niah", seed, tokens, tok, text, p, spans, _source(None if corpus == "noise" else corpus), opts)


@register("niah_single")
def niah_single(**kw: Any) -> dict:
    return _niah(n_keys=1, n_values=1, n_query=1, **kw)


@register("niah_multivalue")
def niah_multivalue(**kw: Any) -> dict:
    return _niah(n_keys=1, n_values=4, n_query=1, **kw)


@register("niah_multiquery")
def niah_multiquery(**kw: Any) -> dict:
    return _niah(n_keys=4, n_values=1, n_query=4, **kw)


def _var_names(rng: random.Random, k: int) -> list[str]:
    names: list[str] = []
    while len(names) < k:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names:
            names.append(v)
    return names


def _vt_chain(rng: random.Random, hops: int) -> tuple[list[str], list[str], str]:
    names = _var_names(rng, hops + 1)
    value = str(rng.randint(10000, 99999))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, hops + 1)]
    return lines, names, value


@register("vt")
def vt(task: str, tokens: int, tok: PromptTokenizer, seed: int, hops: int = 4, depths=None, needle_offsets=None,
       chat: bool = False) -> dict:
    rng = _rng(task, seed, "chain")
    lines, names, value = _vt_chain(rng, hops)
    icl = ""
    if tokens >= 2048:  # RULER prepends one solved example when the context has room
        ex_lines, ex_names, ex_value = _vt_chain(_rng(task, seed, "example"), hops)
        ex_body = "\n".join([NOISE, ex_lines[0], NOISE] + ex_lines[1:] + [NOISE])
        icl = (VT_Q + ex_body + VT_TAIL.format(value=ex_value)
               + VT_PREFIX.format(n=hops + 1, value=ex_value) + " ".join(ex_names) + "\n\n")
    before, after = _chat_wrap(tok, chat)
    prefix = VT_PREFIX.format(n=hops + 1, value=value)
    prefix = prefix.lstrip() if chat else prefix
    p = Prompt(head=before + icl + VT_Q, tail=VT_TAIL.format(value=value) + after + prefix, answer_prefix=prefix,
               answers=names, units=[NOISE] * (tokens // 8 + 8), sep="\n", needles=lines,
               meta={"value": value, "hops": hops, "icl_example": bool(icl)})
    offsets = _placement(tok, p, tokens, _rng(task, seed, "depths"), depths, needle_offsets)
    text, spans = _assemble(tok, p, tokens, offsets)
    opts = {"hops": hops, "depths": depths, "needle_offsets": needle_offsets, "chat": chat}
    return _record(task, "vt", seed, tokens, tok, text, p, spans, _source(None), opts)


@register("cwe")
def cwe(task: str, tokens: int, tok: PromptTokenizer, seed: int, num_common: int = 10, freq_common: int = 30,
        freq_uncommon: int = 3, chat: bool = False) -> dict:
    vocab = sorted(set(word_list("nouns")) | set(word_list("adjectives")) | set(word_list("verbs")))

    def numbered(words: list[str], start: int = 1) -> list[str]:
        return [f"{i + start}. {w}" for i, w in enumerate(words)]

    def instance(k: int, rc: int, ru: int, what: str) -> tuple[list[str], list[str], list[str]]:
        """k distinct words (first num_common common), shuffled repeat list, leftover words."""
        if k > len(vocab):
            raise WmtpError(f"cwe needs {k} distinct words; the word lists hold {len(vocab)}: ask for fewer tokens")
        r = _rng(task, seed, f"{what}:{k}")
        words = r.sample(vocab, k)
        common, uncommon = words[:num_common], words[num_common:]
        seq = common * rc + uncommon * ru
        r.shuffle(seq)
        return seq, common, words

    shot = ""
    if tokens >= 4096:  # one solved example (40 words: 10 x 10 + 30 x 3), as RULER does at >= 4K
        seq, common, _ = instance(40, 10, 3, "example")
        shot = CWE_Q + " ".join(numbered(seq)) + CWE_TAIL + CWE_PREFIX + " " + " ".join(numbered(common)) + "\n"
    before, after = _chat_wrap(tok, chat)
    head = before + shot + CWE_Q
    prefix = CWE_PREFIX.lstrip() if chat else CWE_PREFIX
    tail = CWE_TAIL + after + prefix
    build = lambda k: numbered(instance(k, freq_common, freq_uncommon, "list")[0])  # noqa: E731
    # largest list that fits whole, then exact fill with once-only words not in the list (the last
    # possibly cut): the counted structure is never truncated, so the answers stay exact
    k = _largest_fitting(tok, head, tail, tokens, build, num_common + 1)
    seq, common, chosen = instance(k, freq_common, freq_uncommon, "list")
    taken = set(chosen)
    rest = [w for w in vocab if w not in taken]
    units = numbered(seq)
    fill = numbered(_rng(task, seed, "fill").sample(rest, min(64, len(rest))), start=len(seq) + 1)
    body, used = fit_forward(tok.count, head, units + fill, " ", tail, tokens, min_units=len(units))
    p = Prompt(head=head, tail=tail, answer_prefix=prefix, answers=common, units=[], sep=" ",
               meta={"distinct_words": k, "list_entries": len(seq), "fill_entries": used - len(units),
                     "freq_common": freq_common, "freq_uncommon": freq_uncommon, "few_shot": bool(shot)})
    text = head + body + tail
    return _record(task, "cwe", seed, tokens, tok, text, p, [], _source(None),
                   {"num_common": num_common, "freq_common": freq_common, "freq_uncommon": freq_uncommon, "chat": chat})


def _largest_fitting(tok: PromptTokenizer, head: str, tail: str, tokens: int, build: Callable[[int], list[str]],
                     lo: int) -> int:
    """Largest k >= lo with count(head + ' '.join(build(k)) + tail) <= tokens (doubling, then bisection)."""
    fits = lambda k: tok.count(head + " ".join(build(k)) + tail) <= tokens  # noqa: E731
    if not fits(lo):
        raise WmtpError(f"{tokens} tokens cannot hold the smallest instance of this task; ask for more tokens")
    hi = lo
    while True:
        try:
            ok = fits(hi * 2)
        except WmtpError:  # ran out of distinct words: bisect below
            ok = False
        if not ok:
            break
        hi *= 2
    lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            ok = fits(mid)
        except WmtpError:
            ok = False
        if ok:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1: partial sum + integral tail (deterministic)."""
    n = 10000
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha


@register("fwe")
def fwe(task: str, tokens: int, tok: PromptTokenizer, seed: int, alpha: float = 2.0, word_len: int = 6,
        chat: bool = False) -> dict:
    r = _rng(task, seed, "vocab")
    vocab_size = max(16, (tokens - TOKENS_TO_GENERATE["fwe"]) // 50)  # RULER's default vocabulary size
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < vocab_size + 64:  # + 64 once-only fill words
        w = "".join(r.choices(string.ascii_lowercase, k=word_len))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab, fill = vocab[:vocab_size], vocab[vocab_size:]
    vocab[0] = "...."  # RULER: the most frequent "word" is noise the question says to ignore
    z = _zeta(alpha)

    def counts(k: int) -> list[int]:
        return [int(k * (i + 1) ** -alpha / z) for i in range(vocab_size)]

    def build(k: int) -> list[str]:
        seq = [w for w, c in zip(vocab, counts(k)) for _ in range(c)]
        _rng(task, seed, f"shuffle:{k}").shuffle(seq)
        return seq

    before, after = _chat_wrap(tok, chat)
    head = before + FWE_Q
    prefix = FWE_PREFIX.lstrip() if chat else FWE_PREFIX
    tail = FWE_TAIL + after + prefix
    k = _largest_fitting(tok, head, tail, tokens, build, 16)
    c = counts(k)
    if not c[3] > max(c[4], 1):
        raise WmtpError(f"fwe at {tokens} tokens: the top-3 coded words are not uniquely most frequent "
                        f"(counts {c[:5]}); ask for more tokens")
    units = build(k)
    body, used = fit_forward(tok.count, head, units + fill, " ", tail, tokens, min_units=len(units))
    p = Prompt(head=head, tail=tail, answer_prefix=prefix, answers=vocab[1:4], units=[], sep=" ",
               meta={"vocab_size": vocab_size, "words": len(units), "fill_words": used - len(units),
                     "top_counts": c[:5], "alpha": alpha})
    text = head + body + tail
    return _record(task, "fwe", seed, tokens, tok, text, p, [], _source(None),
                   {"alpha": alpha, "word_len": word_len, "chat": chat})


def to_json(record: dict) -> str:
    """Canonical serialisation (sorted keys, ASCII, fixed separators, trailing newline): the same
    record always gives the same bytes."""
    import json

    return json.dumps(record, sort_keys=True, ensure_ascii=True, indent=1, separators=(",", ": ")) + "\n"


def write_workload(record: dict, path: str) -> None:
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(to_json(record).encode("ascii"))
