"""A chat template slower than --prompt-timeout, on a real `qkv serve` process: the request
is answered at the deadline, /health answers throughout, and the render is stopped then,
not left to burn a core until the template's own limit (the sandbox's second, or a C-level
operation no check between steps can interrupt)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx

from tests.serve_process import serve_process

# Each step sorts 99,999 numbers (within every sandbox bound), so the render runs until the
# sandbox's own time limit (1 s) stops it: long past the server's 0.2 s prompt deadline.
SLOW_TEMPLATE = "{% for i in range(1000) %}{{ (range(99999)|list|sort(reverse=true))|length }}{% endfor %}"
PROMPT_TIMEOUT = 0.2


def _children_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each living child of `pid` (the template renderer)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[int(child)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def test_a_slow_template_is_stopped_at_the_prompt_deadline(tiny_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "slow"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SLOW_TEMPLATE}))
    with serve_process(folder, "--dtype", "float32", "--threads", "1", "--prompt-timeout", str(PROMPT_TIMEOUT),
                       log=tmp_path / "serve.log") as server:
        health: list[int] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                health.append(httpx.get(server.url + "/health", timeout=5).status_code)
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           json={"model": "slow", "messages": [{"role": "user", "content": "hi"}]})
            time.sleep(0.25)  # the render's margin past the deadline (RENDER_MARGIN_S)
            before = _children_cpu(server.process.pid)
            time.sleep(1.0)  # the sandbox's own limit: a render left running would run on through it
            after = _children_cpu(server.process.pid)
        finally:
            done.set()
            poller.join(timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_timeout", r.text
    assert health and set(health) == {200}
    burnt = sum(after[pid] - before[pid] for pid in before.keys() & after.keys())
    assert burnt < 0.02, f"{burnt:.2f} s of CPU in the template child after the answer: the render ran on"
