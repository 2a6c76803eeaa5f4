"""The README and docs/ as a user reads them: every `qkv` command in their code blocks parses with
the real command line (every flag and value it names exists), every relative link leads to a
file that exists, and the README stays a map (at most 250 lines).

What each command does is tested where its subcommand is (tests/cli/...); this test catches the
drift between the pages and the parser: a renamed flag, a removed choice, a misspelt command.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from qkv.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _commands(page: Path) -> list[str]:
    """The `qkv ...` invocations in a page's code blocks, continuation lines joined, comments,
    pipes into other programs, redirections and trailing `&` cut."""
    found = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            if not re.search(r"(^|[|;&]\s*)(\S*/)?qkv\s", line):
                continue  # not a shell line that runs qkv (Python, output, another tool)
            lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words, command = list(lexer), []
            for word in [*words, ";"]:
                if word and set(word) <= set("|&;<>"):
                    if command and command[0].rsplit("/", 1)[-1] == "qkv":
                        found.append(shlex.join(command[1:]))
                    command = [] if ">" not in word and "<" not in word else ["(redirected)"]
                elif command != ["(redirected)"]:
                    command.append(word)
    return found


CASES = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in _commands(page)]


def test_the_pages_name_commands() -> None:
    assert len(CASES) > 40, "the README and docs name qkv's commands"


@pytest.mark.parametrize(("page", "command"), CASES)
def test_every_documented_command_parses(page: str, command: str) -> None:
    argv = shlex.split(command)
    if not argv or argv[0].startswith("-"):  # `qkv --version`, `qkv --help`
        return
    parser = build_parser(argv[0])
    try:
        parser.parse_args(argv)
    except SystemExit as stop:  # --help exits 0; a bad flag exits 2
        assert stop.code == 0, f"{page}: qkv {command}"


def test_every_relative_link_leads_to_a_file() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://|mailto:", target) and not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert broken == []


def test_the_readme_is_a_map() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert "make demo" in "\n".join(lines) and "make test" in "\n".join(lines)
