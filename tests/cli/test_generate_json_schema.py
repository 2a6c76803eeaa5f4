"""`qkv generate --json-schema FILE`: the output is JSON valid under the schema, on a tiny
random chat model (which knows nothing of JSON); a bad schema file is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from qkv.cli.main import main
from qkv.generation import generate
from qkv.generation.constraints import Grammars, json_schema_grammar
from qkv.models.loader import load_pretrained

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["word", "n", "ok"], "additionalProperties": False}


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_output_validates(tiny_chat_folder: Path, tmp_path: Path, capsys) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for seed in ("1", "2", "3"):
        code, out, err = _run(capsys, "--model", str(tiny_chat_folder), "--chat", "--prompt", "hi", "--json-schema",
                              str(schema), "--max-new-tokens", "150", "--temperature", "1", "--seed", seed,
                              "--threads", "1")
        assert code == 0, err
        jsonschema.validate(json.loads(out), SCHEMA)


def test_a_constrained_greedy_row_is_the_masked_argmax(tiny_chat_folder: Path) -> None:
    """Without the cache too (the reference loop): both follow the grammar to the same tokens."""
    model, tokenizer = load_pretrained(tiny_chat_folder)
    end = tokenizer.token_to_id("<|end|>")
    grammars = Grammars(tokenizer, vocab_size=296, stop_ids={end})
    prompt = torch.tensor([tokenizer.encode("The cat").ids])
    outs = [generate(model, prompt, 150, eos_token_id=end, use_cache=cached,
                     constraint=grammars.constraint(json_schema_grammar(SCHEMA)))[0, prompt.shape[1]:].tolist()
            for cached in (True, False)]
    assert outs[0] == outs[1]
    jsonschema.validate(json.loads(tokenizer.decode(outs[0])), SCHEMA)


@pytest.mark.parametrize(("content", "message"), [("{not json", "not JSON"), ("[1]", "is an object"),
                                                   ('{"type": "string", "format": "nope"}', "nope")])
def test_bad_schema_files_are_one_line(tiny_chat_folder: Path, tmp_path: Path, capsys, content, message) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(content)
    code, out, err = _run(capsys, "--model", str(tiny_chat_folder), "--chat", "--prompt", "hi",
                          "--json-schema", str(schema), "--threads", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def _hostile_files() -> dict[str, str]:
    from tests.generation.test_schema_limits import LOOPS, ref_chain

    deep = {n: '{"type": "array", "items": ' * n + '{"type": "integer"}' + "}" * n for n in (5_000, 30_000)}
    compact = {"separators": (",", ":")}  # a 30,000-long chain within the 1 MiB a schema file may have
    return {"a $ref chain of 3,000": json.dumps(ref_chain(3_000), **compact),
            "a $ref chain of 30,000": json.dumps(ref_chain(30_000), **compact),
            "nesting 5,000 deep": deep[5_000], "nesting 30,000 deep": deep[30_000],
            "nesting 500 deep": '{"type": "array", "items": ' * 500 + '{"type": "integer"}' + "}" * 500,
            **{f"the loop {name}": json.dumps(schema) for name, schema in LOOPS.items()}}


HOSTILE = _hostile_files()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schema_files_are_one_line(tiny_chat_folder: Path, tmp_path: Path, capsys, name: str) -> None:
    """Too deep (to read, or for the compiler) or recursive with no document: one line naming
    it, exit 2, before the model is loaded (no traceback, no segfault)."""
    schema = tmp_path / "schema.json"
    schema.write_text(HOSTILE[name])
    code, out, err = _run(capsys, "--model", str(tiny_chat_folder), "--chat", "--prompt", "hi",
                          "--json-schema", str(schema), "--threads", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert any(words in err for words in ("too deep", "nested", "recursive with no finite document")), err


def test_a_3000_chain_is_refused_by_the_command(tiny_chat_folder: Path, tmp_path: Path) -> None:
    """The command as a user runs it, in its own process (the library's segfault would kill it)."""
    import subprocess
    import sys

    schema = tmp_path / "schema.json"
    schema.write_text(HOSTILE["a $ref chain of 3,000"])
    run = subprocess.run([sys.executable, "-m", "qkv", "generate", "--model", str(tiny_chat_folder), "--prompt", "hi",
                          "--json-schema", str(schema)], capture_output=True, text=True, timeout=120)
    errors = [line for line in run.stderr.strip().splitlines() if not line.endswith("...")]  # status lines of slow waits
    assert run.returncode == 2 and "too deep" in run.stderr and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
