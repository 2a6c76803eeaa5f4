"""`--tensor-parallel N` from the command line, under torchrun on loopback: `qkv generate` writes
the one-process text once (rank 0), `qkv perplexity` prints the one-process figure and `qkv chat`
the one-process replies; bad input (N that does not divide the KV heads, no torchrun, options that do not combine) is one
line and exit code 2, never a hang."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from qkv.cli.main import main
from tests.cli.torchrun import torchrun
from tests.models.conftest import save_tiny

PROMPT = "Keys, queries and values"
VERDICT_START = ("I HAD always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it was no "
                 "great surprise to me to hear that, in the height of his glory, he had dropped his painting, married a "
                 "rich widow, and established himself in a villa on the Riviera. ") * 3




@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny("llama", folder)  # 2 KV heads
    return folder


def test_generate_over_two_ranks_writes_the_one_process_text_once(llama: Path, capsysbinary) -> None:
    args = ["generate", "--model", str(llama), "--prompt", PROMPT, "--max-new-tokens", "12", "--dtype", "float32",
            "--temperature", "0.8", "--seed", "5"]
    assert main(args) == 0
    one = capsysbinary.readouterr().out.decode()
    done = torchrun(2, *args, "--tensor-parallel", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == one
    assert done.stderr.count("tokens/s") == 1 and "tensor-parallel over 2 processes" in done.stderr


def test_perplexity_over_two_ranks_is_the_one_process_figure(llama: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Your journey starts with one step. Keys, queries and values: attention from the key up. " * 3)
    args = ["perplexity", "--model", str(llama), "--data", str(text), "--context-length", "40"]
    assert main(args) == 0
    one = float(re.search(r"perplexity ([0-9.]+)", capsys.readouterr().out).group(1))
    done = torchrun(2, *args, "--tensor-parallel", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("perplexity ") and "tensor-parallel over 2" in done.stdout
    # the same numbers summed in another order (partial products added by the all-reduce)
    assert float(re.search(r"perplexity ([0-9.]+)", done.stdout).group(1)) == pytest.approx(one, rel=1e-5)


def test_n_that_does_not_divide_the_kv_heads_is_one_line(tmp_path: Path) -> None:
    save_tiny("qwen2", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    done = torchrun(2, "generate", "--model", str(tmp_path), "--prompt", PROMPT, "--tensor-parallel", "2")
    assert done.returncode != 0
    line = "qkv generate: error: --tensor-parallel 2 does not divide"
    assert done.stderr.count(line) == 1, done.stderr[-3000:]
    assert "3 key/value heads" in done.stderr and "choose --tensor-parallel 1, 3" in done.stderr


def test_without_torchrun_or_with_options_that_do_not_combine_it_is_one_line(llama: Path, tmp_path: Path,
                                                                              capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["generate", "--model", str(llama), "--prompt", PROMPT, "--tensor-parallel", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--tensor-parallel 2 needs 2 processes: run `torchrun" in err, err
    text = tmp_path / "t.txt"
    text.write_text("Your journey starts with one step.")
    code = main(["perplexity", "--model", str(llama), "--data", str(text), "--tensor-parallel", "2",
                 "--context-parallel"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "drop --context-parallel" in err, err


def test_one_rank_is_the_plain_command(llama: Path, capsysbinary, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["generate", "--model", str(llama), "--prompt", PROMPT, "--max-new-tokens", "8", "--dtype", "int8"]
    assert main(args) == 0
    one = capsysbinary.readouterr().out
    assert main([*args, "--tensor-parallel", "1"]) == 0
    assert capsysbinary.readouterr().out == one


@pytest.mark.slow
def test_smollm2_over_its_three_kv_heads_writes_the_one_process_text(capsysbinary) -> None:
    """float32 ranks give one process's logits to 1e-5, so the greedy text is the same."""
    args = ["generate", "--model", "smollm2", "--prompt", "The capital of France is", "--max-new-tokens", "16",
            "--dtype", "float32"]
    assert main(args) == 0
    one = capsysbinary.readouterr().out.decode()
    done = torchrun(3, *args, "--tensor-parallel", "3", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == one


@pytest.mark.slow
def test_smollm2_int4_over_three_ranks_is_the_one_process_perplexity(tmp_path: Path, capsys) -> None:
    """At int4 (the default precision of SmolLM2's Q4_1 file) the ranks' partial sums round apart
    from one process's by a float ulp, which a rounded activation can turn into a whole step (1/127
    of its block's largest): a greedy near-tie can then go either way, on one CPU and not another.
    So the int4 ranks are held to the one-process figure over a text, where such steps average out."""
    text = tmp_path / "verdict.txt"
    text.write_text(VERDICT_START)
    args = ["perplexity", "--model", "smollm2", "--data", str(text), "--context-length", "128", "--dtype", "int4"]
    assert main(args) == 0
    one = float(re.search(r"perplexity ([0-9.]+)", capsys.readouterr().out).group(1))
    done = torchrun(3, *args, "--tensor-parallel", "3", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "int4" in done.stdout and "tensor-parallel over 3 processes" in done.stdout
    assert float(re.search(r"perplexity ([0-9.]+)", done.stdout).group(1)) == pytest.approx(one, rel=5e-3)


@pytest.mark.slow
def test_chat_over_smollm2s_three_kv_heads_writes_the_one_process_replies(capsys, monkeypatch) -> None:
    """Rank 0 reads the piped messages and writes the replies; its sessions share each step
    (prefill, decode, truncate between turns) with ranks 1 and 2 (qkv.runtime.tensor_parallel_steps).
    The one-process replies come from main(argv) here, reading the same messages as piped stdin."""
    messages = "Hello there\nWhat is two plus two?\n"
    args = ["chat", "--model", "smollm2", "--temperature", "0", "--max-new-tokens", "12", "--dtype", "float32"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(messages))  # not a terminal: one message per line
    code = main(args)
    one = capsys.readouterr()
    assert code == 0, one.err[-3000:]
    done = torchrun(3, *args, "--tensor-parallel", "3", timeout=300, stdin=messages)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == one.out and one.out.count("\n") == 2
    assert done.stderr.count("decode steps run") == 1  # rank 0 says how it decodes; the others follow quietly


def test_chat_with_a_kv_cache_option_is_refused_by_name(llama: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one rank, no group: the same checks
    code = main(["chat", "--model", str(llama), "--tensor-parallel", "1", "--kv-cache", "sink"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "drop the --kv-cache options" in err, err
