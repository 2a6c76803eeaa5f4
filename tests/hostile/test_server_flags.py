"""`qkv serve` command lines with a flag out of range, a KV cache too big for the machine, a port
in use or a host that does not resolve: each is exactly one line on stderr naming the flag,
exit code 2, nothing printed on stdout (no "listening on" before the refusal), under 5 s and
under 1 GB of extra memory (harness.py runs every case in a forked child under that limit)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("hostile-server-flags")

HARNESS = Path(__file__).with_name("harness.py")
MAX_SECONDS = 5.0
MAX_EXTRA_MEMORY = 1 << 30

# (extra argv, a word the one line must name)
CASES: dict[str, tuple[list[str], str]] = {
    "context 0": (["--context", "0"], "--context"),
    "context -5": (["--context", "-5"], "--context"),
    "max-tokens -1": (["--max-tokens", "-1"], "--max-tokens"),
    "max-tokens 0": (["--max-tokens", "0"], "--max-tokens"),
    "max-waiting -1": (["--max-waiting", "-1"], "--max-waiting"),
    "max-batch 0": (["--max-batch", "0"], "--max-batch"),
    "max-batch 1000000": (["--max-batch", "1000000"], "--max-batch"),
    "max-batch 10**15": (["--max-batch", "1000000000000000"], "--max-batch"),
    "port 0": (["--port", "0"], "--port"),
    "port 70000": (["--port", "70000"], "--port"),
    "read-timeout nan": (["--read-timeout", "nan"], "--read-timeout"),
    "read-timeout 0": (["--read-timeout", "0"], "--read-timeout"),
    "idle-timeout inf": (["--idle-timeout", "inf"], "--idle-timeout"),
    "idle-timeout -1": (["--idle-timeout", "-1"], "--idle-timeout"),
    "prompt-timeout 1e9": (["--prompt-timeout", "1e9"], "--prompt-timeout"),
    "max-connections 0": (["--max-connections", "0"], "--max-connections"),
    "allowed-host with port": (["--allowed-host", "example.com:80"], "--allowed-host"),
    "allowed-host url": (["--allowed-host", "http://example.com"], "--allowed-host"),
    "cors-origin no scheme": (["--cors-origin", "example.com"], "--cors-origin"),
    "cors-origin with path": (["--cors-origin", "http://example.com/app"], "--cors-origin"),
    "api-key empty": (["--api-key", ""], "--api-key"),
    "host does not resolve": (["--host", "no-such-host.invalid"], "--host"),
    "port in use": (["--port", "{busy}"], "in use"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tiny_chat_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hostile-serve-flags")
    (root / "outside").mkdir()
    (root / "work").mkdir()
    with socket.socket() as busy:  # a port another program holds, listening
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = []
        for name, (extra, _) in CASES.items():
            extra = [arg.replace("{busy}", str(port)) for arg in extra]
            argv = ["serve", "--model", str(tiny_chat_folder), "--threads", "1", *extra]
            if "--port" not in extra:
                # A flag case that got past its check could not start serving on the busy port; the
                # KV cases must get past the bind (it comes first) to reach their check: if it failed
                # to refuse, the server would run until the harness's time limit, and so fail.
                argv += ["--port", str(free_port() if "max-batch 1" in name else port)]
            cases.append({"id": name, "argv": argv, "cwd": str(root)})
        (root / "cases.json").write_text(json.dumps(cases))
        run = subprocess.run([sys.executable, str(HARNESS), str(root / "cases.json"), str(root / "results.json"),
                              str(root / "outside"), str(root / "work")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((root / "results.json").read_text())
    return {result["id"]: {**result, "parent_rss": data["parent_rss"]} for result in data["results"]}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_serve_flags_are_one_line_and_exit_2(results: dict[str, dict], name: str) -> None:
    result = results[name]
    word = CASES[name][1]
    assert result["code"] == 2 and not result["timed_out"], result
    assert result["stderr"].count("\n") == 1 and "Traceback" not in result["stderr"], result["stderr"]
    assert result["stderr"].startswith("qkv serve: error:") and word in result["stderr"], result["stderr"]
    assert result["stdout"] == ""  # nothing announced: no "listening on" before the refusal
    assert result["seconds"] < MAX_SECONDS
    assert result["max_rss"] - result["parent_rss"] < MAX_EXTRA_MEMORY
