"""`qkv` itself: --version from the package metadata, and --help without importing torch."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from qkv.cli.main import SUBCOMMANDS, main


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"qkv {version('qkv')}\n"


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_and_version_do_not_import_torch(argv: list[str]) -> None:
    probe = ("import sys\nfrom qkv.cli.main import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules)" % argv)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def test_help_lists_every_command_and_each_command_has_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out
    for name, summary in SUBCOMMANDS.items():
        assert name in listing and summary.split()[0] in listing
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert f"usage: qkv {name}" in capsys.readouterr().out


def test_an_unknown_command_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["explian"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'explian'" in err
