"""The command line: every command listed, generate and score run end to end on tiny models."""

from __future__ import annotations

import pytest

from wmtp.cli import COMMANDS, build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert {"generate", "make-checkpoint", "score", "presets"} <= set(COMMANDS)


def test_make_checkpoint_then_generate_and_score(tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    assert main(["make-checkpoint", "--preset", "tiny-qwen3.5-moe", "--out", str(ckpt)]) == 0
    assert main(["generate", "--model", str(ckpt), "--mode", "windowed", "--window", "8", "--sink", "2",
                 "--prompt", "The quick brown fox jumps over the lazy dog", "--max-tokens", "12"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("[windowed] 12 tokens | AL ") and "draft KV" in last and "(ring)" in last
    assert main(["score", "--model", str(ckpt), "--prompt", "The quick brown fox"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_generate_bad_input_is_a_clear_error(tmp_path, capsys):
    ckpt = tmp_path / "no-tokenizer"
    assert main(["make-checkpoint", "--preset", "tiny-llama", "--out", str(ckpt)]) == 0
    (ckpt / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(ckpt), "--prompt", "not numbers"]) == 2
    assert "token ids" in capsys.readouterr().err
    # a preset's random weights come with the built-in small tokenizer: text is fine
    assert main(["generate", "--preset", "tiny-llama", "--prompt", "some words", "--max-tokens", "2"]) == 0
    assert main(["generate", "--preset", "tiny-llama", "--prompt", "1 2", "-d", "0"]) == 2
    assert "num_draft_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("command,flag", [(["generate"], "--prompt-file"),
                                          (["draft-vocab", "--size", "8", "--out", "unused.json"], "--corpus"),
                                          (["serve"], "--chat-template")])
@pytest.mark.parametrize("kind", ["missing", "directory", "not text"])
def test_an_unreadable_file_is_named(command, flag, kind, tmp_path, capsys):
    path = {"missing": tmp_path / "nothing.txt", "directory": tmp_path}.get(kind, tmp_path / "bytes.bin")
    if kind == "not text":
        path.write_bytes(bytes([0xC3, 0x28, 0xFF]))
    assert main([*command, "--preset", "tiny-llama", flag, str(path)]) == 2
    assert f"{flag} {path}" in capsys.readouterr().err
