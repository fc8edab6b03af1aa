"""``wmtp bench multiturn`` end to end on the host: a tiny model behind the real server, users talking
concurrently; the cache must serve later turns from earlier ones without changing a token."""

from __future__ import annotations

import json

import pytest

from wmtp.cli import main as cli_main

ARGS = ["bench", "multiturn", "--preset", "tiny-qwen3.5-moe", "--device", "cpu", "--doc-tokens", "300",
        "--users", "2", "--turns", "3", "--question-tokens", "8", "--answer-tokens", "4", "--chunk", "64",
        "--page-size", "16", "--window", "32", "--sink", "8", "-d", "3"]


@pytest.mark.parametrize("mode", ["dense", "windowed"])
def test_later_turns_hit_the_cache_and_answers_are_unchanged(mode, tmp_path):
    out = tmp_path / "mt.json"
    assert cli_main(ARGS + ["--mode", mode, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "multiturn" and res["meta"]["command"].startswith("wmtp bench multiturn")
    off, on = res["rows"]
    assert (off["prefix_cache"], on["prefix_cache"]) == (False, True)
    for r in (off, on):
        assert len(r["ttft_s"]) == 2 and all(len(u) == 3 and min(u) > 0 for u in r["ttft_s"])
        assert all(len(a) == 4 for u in r["answers"] for a in u)
    assert off["answers"] == on["answers"] and off["cached_tokens"] == 0 and on["divergence"] == [None, None]
    # each user's turns 2 and 3 resume at least from the page-aligned document (16-token pages)
    assert on["cached_tokens"] >= 2 * 2 * (300 // 16 * 16)
    from wmtp.analysis.report import build_report

    build_report(tmp_path, tmp_path / "r" / "REPORT.md")
    assert "## Multi-turn serving with the prefix cache" in (tmp_path / "r" / "REPORT.md").read_text()


def test_bad_sizes_are_refused_by_name(tmp_path, capsys):
    assert cli_main(ARGS + ["--turns", "0", "--out", str(tmp_path / "x.json")]) != 0
    assert "--turns" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_cache_off_and_on_run_apart_into_one_file(tmp_path):
    """``--cache off`` then ``--cache on`` (each under a call's time limit on the GPU machine) leave one
    file with both rows, checked for equal answers; a run with other settings starts the file afresh."""
    out = tmp_path / "mt.json"
    args = ARGS + ["--mode", "windowed", "--out", str(out)]
    assert cli_main(args + ["--cache", "off"]) == 0
    assert [r["prefix_cache"] for r in json.loads(out.read_text())["rows"]] == [False]
    assert cli_main(args + ["--cache", "on"]) == 0
    res = json.loads(out.read_text())
    off, on = res["rows"]
    assert [r["command"] for r in res["meta"]["earlier_runs"]] == ["wmtp " + " ".join(args + ["--cache", "off"])]
    assert (off["prefix_cache"], on["prefix_cache"]) == (False, True) and off["answers"] == on["answers"]
    assert on["cached_tokens"] > 0
    assert cli_main(args + ["--cache", "on", "--turns", "2"]) == 0
    assert [r["prefix_cache"] for r in json.loads(out.read_text())["rows"]] == [True]


def test_a_changed_answer_is_an_error_in_float32_and_reported_in_bfloat16(capsys):
    """The first differing token per user (later turns carry the earlier answers, so one flip changes
    the rest); float32 must match exactly, a 16-bit run reports where its rounding flipped a tie."""
    from wmtp.bench.multiturn import _check_answers, first_divergence
    from wmtp.errors import WmtpError

    off = [[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 9], [9, 9]]]
    on = [[[1, 2], [3, 0]], [[5, 6], [7, 8]], [[0, 9], [0, 0]]]
    div = first_divergence(off, on)
    assert div == [[1, 1], None, [0, 0]]
    rows = [{"answers": off}, {"answers": on, "divergence": div}]
    with pytest.raises(WmtpError, match=r"user 0: turn 2, token 2; user 2: turn 1, token 1"):
        _check_answers(rows, "float32")
    assert _check_answers(rows, "bfloat16") == 0
    assert "reported, not an error, in bfloat16" in capsys.readouterr().out
    assert _check_answers([{"answers": off}, {"answers": off, "divergence": first_divergence(off, off)}], "float32") == 0
