"""Ring attention against single-process attention, on real gloo processes.

Each world size N is one torchrun launch of tests/attention/ring_worker.py that runs every
case (causal or not, contiguous or zigzag shards, GQA 9:3 as in SmolLM2 and plain
multi-head, float32 and bfloat16, lengths not divisible by N, both block kernels); this
test process builds the whole-sequence inputs, puts the ranks' shards back together and
compares outputs and input gradients with PyTorch's own scaled_dot_product_attention.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qkv.attention.ring import Ring, ShardLayout, _plan, ring_attention
from qkv.errors import QkvError

WORKER = Path(__file__).with_name("ring_worker.py")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_case(name: str, *, seq_len: int, heads: tuple[int, int], causal: bool, sharding: str,
              dtype: torch.dtype = torch.float32, kernel: str = "auto", seed: int = 0) -> dict:
    h, h_kv = heads
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (2, h, seq_len, 16), (2, h_kv, seq_len, 16)
    return {
        "name": name, "causal": causal, "sharding": sharding, "kernel": kernel,
        "q": torch.randn(shape_q, generator=g).to(dtype), "k": torch.randn(shape_kv, generator=g).to(dtype),
        "v": torch.randn(shape_kv, generator=g).to(dtype), "dout": torch.randn(shape_q, generator=g).to(dtype),
    }


def cases_for(n: int) -> list[dict]:
    odd = 7 * n + 3  # not divisible by N, nor by 2N
    cases = []
    for causal in (False, True):
        for sharding in ("contiguous", "zigzag"):
            for heads in ((9, 3), (4, 4)):
                name = f"{'causal' if causal else 'full'}-{sharding}-{heads[0]}:{heads[1]}"
                cases.append(make_case(name, seq_len=odd, heads=heads, causal=causal, sharding=sharding))
            cases.append(make_case(f"bf16-{causal}-{sharding}", seq_len=odd, heads=(9, 3), causal=causal,
                                   sharding=sharding, dtype=torch.bfloat16))
    cases.append(make_case("explicit-zigzag", seq_len=odd, heads=(9, 3), causal=True, sharding="zigzag",
                           kernel="explicit"))
    cases.append(make_case("explicit-full", seq_len=odd, heads=(4, 2), causal=False, sharding="contiguous",
                           kernel="explicit"))
    cases.append(make_case("one-token-each", seq_len=n, heads=(9, 3), causal=True, sharding="zigzag"))
    cases.append(make_case("divisible", seq_len=8 * n, heads=(9, 3), causal=True, sharding="zigzag"))
    return cases


def reference(case: dict) -> dict[str, torch.Tensor]:
    q, k, v = (case[name].clone().requires_grad_() for name in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case["causal"], enable_gqa=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), case["dout"])
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def run_ring(n: int, cases: list[dict], tmp_path: Path) -> list[dict]:
    cases_file = tmp_path / "cases.pt"
    torch.save(cases, cases_file)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(cases_file), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=150,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])  # 3: shards of unequal length, two hops (4 runs in `qkv bench --only ring`)
def test_ring_equals_single_process_attention(n: int, tmp_path: Path) -> None:
    cases = cases_for(n)
    ranks = run_ring(n, cases, tmp_path)
    for case in cases:
        layout = ShardLayout(case["q"].shape[2], n, case["sharding"])
        expected = reference(case)
        tol = TOLERANCE[case["q"].dtype]
        for name in ("out", "dq", "dk", "dv"):
            got = layout.unshard([r[case["name"]][name] for r in ranks], dim=2)
            assert got.dtype == case["q"].dtype
            torch.testing.assert_close(got, expected[name], rtol=tol, atol=tol, msg=f"{case['name']} {name}")
    # Keys and values travel with their H_kv heads only, each block once per pass (N - 1 hops),
    # and the float32 key/value gradients once more (N hops) in the backward pass.
    gqa = "causal-zigzag-9:3"
    seq_len, kv_bytes_per_token = cases[0]["q"].shape[2], 2 * 2 * 3 * 16 * 4  # B, k+v, H_kv, D, fp32
    for rank, result in enumerate(ranks):
        layout = ShardLayout(seq_len, n, "zigzag")
        received = [layout.length((rank - s - 1) % n) for s in range(n)]
        sent = [layout.length((rank - s) % n) for s in range(n)]
        expected_bytes = kv_bytes_per_token * (2 * sum(sent[: n - 1]) + sum(sent))
        assert result[gqa]["bytes_sent"] == expected_bytes
        # Peak keys/values held: own shard + the block in use + the block arriving.
        assert result[gqa]["peak_kv_bytes"] <= kv_bytes_per_token * (layout.length(rank) + 2 * max(received))
        assert "mismatched world sizes" in ranks[rank]["mismatched"]
    message, waited = ranks[0]["timeout"]
    assert "timed out" in message or "got no block" in message
    assert waited < 10


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("seq_len", [1, 7, 12])
def test_one_process_needs_no_group(sharding: str, seq_len: int) -> None:
    case = make_case("one", seq_len=seq_len, heads=(9, 3), causal=True, sharding=sharding)
    ring = Ring(ShardLayout(seq_len, 1, sharding))
    q, k, v = (case[name].clone().requires_grad_() for name in "qkv")
    out = ring_attention(q, k, v, ring, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), case["dout"])
    expected = reference(case)
    torch.testing.assert_close(out, expected["out"], rtol=1e-5, atol=1e-5)
    for got, name in zip(grads, ("dq", "dk", "dv")):
        torch.testing.assert_close(got, expected[name], rtol=1e-5, atol=1e-5)
    assert ring.stats.bytes_sent == 0


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_layouts_cover_every_position_once(sharding: str, n: int) -> None:
    for seq_len in range(n, 4 * n + 3):
        layout = ShardLayout(seq_len, n, sharding)
        positions = torch.cat([layout.positions(r) for r in range(n)])
        assert sorted(positions.tolist()) == list(range(seq_len))
        lengths = [layout.length(r) for r in range(n)]
        assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 2
        x = torch.arange(seq_len).view(1, seq_len)
        assert torch.equal(layout.unshard([layout.shard(x, r, dim=1) for r in range(n)], dim=1), x)


def test_causal_plan_skips_the_future_and_masks_only_the_diagonal() -> None:
    layout = ShardLayout(16, 4, "contiguous")
    assert _plan(layout.ranges(1), layout.ranges(3), causal=True) == []  # all in the future
    (past,) = _plan(layout.ranges(2), layout.ranges(0), causal=True)
    assert not past.masked
    (diagonal,) = _plan(layout.ranges(2), layout.ranges(2), causal=True)
    assert diagonal.masked
    zigzag = ShardLayout(16, 4, "zigzag")  # rank 0 holds 0-1 and 14-15, rank 3 holds 6-7 and 8-9
    (later_half,) = _plan(zigzag.ranges(0), zigzag.ranges(3), causal=True)
    assert later_half.rows == slice(2, 4) and later_half.cols == slice(0, 4) and not later_half.masked
    (both_halves,) = _plan(zigzag.ranges(3), zigzag.ranges(0), causal=True)
    assert both_halves.rows == slice(0, 4) and both_halves.cols == slice(0, 2) and not both_halves.masked


def test_bad_rings_are_one_clear_error() -> None:
    with pytest.raises(QkvError, match="cannot be shared by 4 processes"):
        ShardLayout(3, 4)
    with pytest.raises(QkvError, match="needs an initialised torch.distributed process group"):
        Ring(ShardLayout(8, 2), 0, timeout=timedelta(seconds=1))
    ring = Ring(ShardLayout(8, 1))
    x = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="takes no mask"):
        ring.attend(x, x, x, mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="holds 8 tokens"):
        ring_attention(x[:, :, :5], x, x, ring)
