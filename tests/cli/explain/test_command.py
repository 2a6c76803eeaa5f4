"""`qkv explain` on the book's example: the numbers a reader sees, JSON, bad options."""

import json
import os
import re
import subprocess
import sys

import pytest

from qkv.cli.main import main
from qkv.book.walkthrough import run_walkthrough


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qkv", *args], capture_output=True, text=True, timeout=120,
        env=None if env is None else {**os.environ, **env},
    )


def run_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`main(argv)` without a new interpreter: the exit code (argparse's SystemExit or the return
    value), stdout and stderr. The process boundary itself is checked once, by run_cli."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _vector(values: list[float]) -> str:
    return "[" + ", ".join("-inf" if v == float("-inf") else f"{v:.4f}" for v in values) + "]"


def test_default_prints_the_books_steps_and_context() -> None:
    result = run_cli("explain")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for token in ("Your", "journey", "starts", "with", "one", "step"):
        assert token in out
    for step in ("keys = inputs @ W_key", "scores", "softmax", "context"):
        assert step in out
    assert "[0.3061, 0.8210]" in out  # the book's printed context vector of "journey"
    assert "0.2264" in out  # the book's weight of "journey" on itself
    assert "\x1b[" not in out  # plain text when stdout is not a terminal


def test_json_has_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("tokens", "inputs", "W_query", "W_key", "W_value", "query", "keys", "values",
                "scores", "scaled_scores", "weights", "context"):
        assert key in data
    assert data["tokens"][1] == "journey"
    assert data["context"] == pytest.approx([0.3061, 0.8210], abs=5e-5)
    assert len(data["keys"]) == 6 and len(data["keys"][0]) == 2
    assert sum(data["weights"]) == pytest.approx(1.0, abs=1e-6)
    assert data["scaled_scores"] == pytest.approx([s / 2**0.5 for s in data["scores"]], rel=1e-5)


def test_causal_hides_later_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json", "--causal", "--query", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weights"][3:] == [0.0, 0.0, 0.0]
    assert data["scaled_scores"][3:] == [None, None, None]


def test_options_change_the_computation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json", "--d-out", "4", "--seed", "5", "--query", "6"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["query"]) == 4 and data["query_token"] == "step"


@pytest.mark.parametrize(
    "args, fragment",
    [(["--query", "0"], "between 1 and 6"), (["--query", "7"], "between 1 and 6"),
     (["--d-out", "0"], "--d-out"), (["--query", "two"], "neither a position nor one of the tokens"),
     (["--query", "3", "--d-out", "nine"], "argument --d-out: must be a whole number"),
     (["--d-out", "1000000000"], "argument --d-out: must be from 1 to 64"),
     (["--seed", "1e23"], "argument --seed: must be a whole number"),
     (["--layer", "-1"], "--layer -1 is out of range"), (["--layer", "1"], "--layer 1 is out of range"),
     (["some text", "--model", "minilm", "--seed", "5"], "--seed")],
)
def test_bad_options_give_one_line_and_exit_code_2(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_in_process(capsys, "explain", *args)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err
    assert out == ""


def test_a_bad_option_from_the_command_line_gives_one_line_and_exit_code_2() -> None:
    result = run_cli("explain", "--query", "3", "--d-out", "nine")
    assert result.returncode == 2
    assert "argument --d-out: must be a whole number" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, fragment",
    [(["--layer", "99"], "--layer 99 is out of range: the book's example has 1 attention layer"),
     (["--layer", "-1"], "--layer -1 is out of range"),
     (["--head", "99"], "--head 99 is out of range: the book's example has 1 head"),
     (["--head", "1", "--json"], "--head 1 is out of range"),
     (["--threads", "0"], "--threads must be at least 1")],
)
def test_flags_the_books_example_cannot_honour_are_rejected(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_in_process(capsys, "explain", *args)
    assert (code, out) == (2, ""), err
    assert fragment in err and err.count("\n") == 1


def test_a_flag_the_books_example_cannot_honour_from_the_command_line() -> None:
    result = run_cli("explain", "--layer", "99")
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert "--layer 99 is out of range" in result.stderr and result.stderr.count("\n") == 1


def test_layer_and_head_zero_are_the_books_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--json", "--layer", "0", "--head", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == pytest.approx([0.3061, 0.8210], abs=5e-5)


def test_book_only_flags_with_a_model_are_named_in_a_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "text", "--model", "minilm", "--causal", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert ("--seed and --causal apply to the book's example only, since a --model brings its own "
            "weights and masking; drop them or drop --model") in err


def test_a_missing_model_folder_reads_as_in_generate(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-folder")
    assert main(["explain", "text", "--model", missing]) == 2
    explain_error = capsys.readouterr().err.split("error: ", 1)[1]
    assert main(["generate", "--model", missing, "--prompt", "text"]) == 2
    assert capsys.readouterr().err.split("error: ", 1)[1] == explain_error


@pytest.mark.parametrize("env", [{}, {"FORCE_COLOR": "1", "COLUMNS": "80", "TERM": "xterm-256color"}],
                         ids=["pipe", "80-column terminal"])
def test_steps_print_their_numbers_and_rows_stay_whole_at_80_columns(env: dict[str, str]) -> None:
    result = run_cli("explain", "--causal", "--query", "4", env=env)
    assert result.returncode == 0, result.stderr
    out = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    lines = out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    walk = run_walkthrough(query_position=4, causal=True)
    assert f"  scores = {_vector(walk.scores.tolist())}" in lines  # step 5
    assert f"  scaled = {_vector(walk.scaled_scores.tolist())}" in lines  # step 6
    start = next(i for i, line in enumerate(lines) if line.startswith("7. "))
    end = next(i for i, line in enumerate(lines) if line.startswith("8. "))
    table = lines[start:end]
    for token, score, weight in zip(walk.tokens, walk.scores.tolist(), walk.weights.tolist()):
        row = [l for l in table if l.strip().startswith(token + " ") and f"{weight:.4f}" in l]
        assert len(row) == 1 and f"{score:.4f}" in row[0] and "…" not in row[0], (token, table[:12])


def test_the_books_example_loads_only_what_it_prints_with() -> None:
    """What made the six-token example slow to print: modules it never needs (tokenizers and
    the tracer) and torch machinery pulled in on first use (symbolic shapes by
    torch.broadcast_shapes, distributed tensors by torch.testing), about a second each."""
    probe = ("import sys, contextlib, io\n"
             "from qkv.cli.main import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    assert main(['explain']) == 0\n"
             "print(sorted(m for m in ('tokenizers', 'qkv.trace.record.recorder', 'torch.fx.experimental.symbolic_shapes',"
             " 'torch.distributed.tensor', 'sympy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_projection_matrices_label_each_row(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_in_process(capsys, "explain")
    assert code == 0, err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("2. "))
    end = next(i for i, line in enumerate(lines) if line.startswith("3. "))
    section = lines[start:end]
    header = next(line for line in section if line.split()[:1] == ["row"])
    assert header.split() == ["row", "W_query", "W_key", "W_value"]
    walk = run_walkthrough(query_position=2)
    for i in range(walk.W_query.shape[0]):  # a row of W is one input feature, across all columns
        (row,) = [line for line in section if line.strip().startswith(f"feature {i + 1} ")]
        cells = [_vector(m[i].tolist()) for m in (walk.W_query, walk.W_key, walk.W_value)]
        assert all(cell in row for cell in cells)
        assert row.index(cells[0]) < row.index(cells[1]) < row.index(cells[2])  # under their headers
