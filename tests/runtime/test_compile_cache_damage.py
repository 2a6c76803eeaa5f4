"""A damaged Inductor cache: every file of a warm cache cut in half, the next process that
compiles the same model still gives the eager numbers, with at most a line per kind of
damage on stderr and no traceback (qkv.runtime.compile)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.runtime.compile import probe_once

SCRIPT = """
import torch
from torch import nn
from qkv.runtime.compile import compile_decoder

torch.manual_seed(0)
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
    def forward(self, x):
        return torch.relu(self.linear(x)) + x
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
model = Model().eval()
x = torch.randn(3, 16)
with torch.no_grad():
    eager = model(x)
    report = compile_decoder(model)
    assert report.compiled, report
    compiled = model(x)
print("same" if torch.allclose(eager, compiled, atol=1e-5) else "different")
"""


def _run(cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.skipif(probe_once("inductor") is not None, reason="Inductor cannot compile here")
def test_a_truncated_inductor_cache_falls_back_in_a_line(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert first.returncode == 0 and first.stdout.strip() == "same", first.stderr[-2000:]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files, "Inductor kept nothing on disk"
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    second = _run(tmp_path)
    assert second.returncode == 0 and second.stdout.strip() == "same", second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert "Traceback" not in second.stderr and len(lines) <= 2, second.stderr[-2000:]
    assert all(line.startswith("qkv: ") for line in lines), lines
