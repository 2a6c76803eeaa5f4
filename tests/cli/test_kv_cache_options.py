"""--kv-cache on `qkv generate`, `qkv chat` and `qkv perplexity`: each kind runs, a sink
cache streams past the context, and bad options are one line with exit code 2."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from qkv.cli.main import main

PROMPT = "The cat sat on the mat. " * 3


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["full", "int4", "int2", "sink"])
def test_generate_runs_each_kind(tiny_chat_folder: Path, kind: str, capsys) -> None:
    code, out, err = run(capsys, "generate", "--model", str(tiny_chat_folder), "--prompt", PROMPT,
                         "--max-new-tokens", "8", "--kv-cache", kind, "--window", "60", "--residual", "8",
                         "--no-compile")
    assert code == 0 and out.startswith(PROMPT), err


def test_generate_with_a_sink_cache_goes_past_the_context(tiny_chat_folder: Path, capsys) -> None:
    args = ["generate", "--model", str(tiny_chat_folder), "--prompt", PROMPT, "--max-new-tokens", "300",
            "--no-compile"]
    code, _, err = run(capsys, *args)  # 256 positions: the default full cache becomes a sink cache past them
    assert code == 0 and "context length (256)" in err and "sink cache" in err, err
    code, out, err = run(capsys, *args, "--kv-cache", "sink", "--window", "100")
    assert code == 0 and "300 tokens" in err, err


def test_perplexity_through_a_sink_cache_streams_past_the_context(tiny_chat_folder: Path, tmp_path: Path,
                                                                    capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Keys, queries and values. Attention is all you need, they said. " * 40)
    base = ["perplexity", "--model", str(tiny_chat_folder), "--data", str(text)]
    code, _, err = run(capsys, *base, "--kv-cache", "int4")
    assert code == 2 and "only --kv-cache sink" in err
    code, out, err = run(capsys, *base, "--kv-cache", "sink", "--window", "60", "--chunk", "16")
    assert code == 0 and "through a sink KV cache" in out, err


def test_chat_with_a_quantized_cache_and_past_the_context(tiny_chat_folder: Path, monkeypatch, capsys) -> None:
    lines = "\n".join(["The cat sat on the mat."] * 12) + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    code, out, err = run(capsys, "chat", "--model", str(tiny_chat_folder), "--max-new-tokens", "12",
                         "--max-context", "128", "--kv-cache", "int4", "--residual", "8", "--no-compile",
                         "--temperature", "0")
    assert code == 0, err
    assert len(out.splitlines()) >= 12  # every message answered (a reply may hold a newline of its own)
    assert err.count("outgrew the 128-token context") == 1  # said once


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-cache", "int3"], "--kv-cache must be one of"),
    (["--kv-cache", "sink", "--window", "0"], "--window"),
    (["--kv-cache", "sink", "--window", "8", "--sink-tokens", "9"], "--sink-tokens must be between"),
    (["--kv-cache", "sink", "--window", "250"], "exceed the model's context length"),
])
@pytest.mark.parametrize("command", ["generate", "chat", "perplexity"])
def test_bad_cache_options_are_one_line_and_exit_2(tiny_chat_folder: Path, tmp_path: Path, command: str,
                                                    args: list[str], message: str, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 4)
    extra = {"generate": ["--prompt", "The cat", "--no-compile"], "chat": ["--no-compile"],
             "perplexity": ["--data", str(text)]}[command]
    try:
        code = main([command, "--model", str(tiny_chat_folder), *extra, *args])
    except SystemExit as exit_:  # argparse's own checks
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
