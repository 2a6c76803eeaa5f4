"""Whole decoders run context-parallel equal one process: the tiny GPT and a tiny Llama with
GQA 9:3 and RoPE (logits and every parameter's gradient, N = 3), and SmolLM2's perplexity on
the-verdict over 2 processes (zigzag and contiguous shards)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.attention.ring import Ring, ShardLayout
from qkv.models.context_parallel import attach_ring
from qkv.eval.perplexity import perplexity

WORKER = Path(__file__).with_name("context_parallel_worker.py")
VERDICT = Path(__file__).resolve().parents[3] / "shared" / "data" / "the-verdict.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, *args: str, timeout: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), str(WORKER), *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def load_worker():
    spec = importlib.util.spec_from_file_location("context_parallel_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_decoders_context_parallel_equal_one_process(tmp_path: Path) -> None:
    n = 3
    launch(n, "tiny", str(tmp_path), timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    ids = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(1))
    for sharding in ("zigzag", "contiguous"):
        layout = ShardLayout(28, n, sharding)
        for name, model in load_worker().tiny_models().items():
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            key = f"{name}-{sharding}"
            got = layout.unshard([r[key]["logits"] for r in ranks], dim=1)
            torch.testing.assert_close(got, logits.detach(), rtol=1e-5, atol=1e-5, msg=key)
            for pname, p in model.named_parameters():
                for r in ranks:
                    torch.testing.assert_close(r[key]["grads"][pname], p.grad, rtol=1e-4, atol=1e-6,
                                               msg=f"{key} {pname}")


def test_a_ring_is_attached_only_inside_the_block() -> None:
    model = load_worker().tiny_models()["llama"]
    ring = Ring(ShardLayout(8, 1))
    with attach_ring(model, ring):
        assert all(layer.ring is ring for layer in model.attention_layers())
    assert all(layer.ring is None for layer in model.attention_layers())


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_perplexity_over_2_processes(smollm2_model, tmp_path: Path) -> None:
    text = tmp_path / "verdict.txt"
    text.write_text(VERDICT.read_text(encoding="utf-8")[:1200], encoding="utf-8")
    context, stride = 128, 64
    launch(2, "smollm2", str(tmp_path), str(text), str(context), str(stride), timeout=400)
    model, tokenizer = smollm2_model
    ids = torch.tensor(tokenizer.encode(text.read_text(encoding="utf-8")).ids)
    one = perplexity(model, ids, context_length=context, stride=stride)
    for r in range(2):
        result = json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8"))
        for parallel in result.values():  # zigzag and contiguous shards
            assert (parallel["tokens"], parallel["windows"]) == (one.tokens, one.windows)
            assert f"{parallel['perplexity']:.4g}" == f"{one.perplexity:.4g}"
            assert math.isclose(parallel["nll"], one.nll, rel_tol=1e-5)
