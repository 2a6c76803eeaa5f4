"""One rank of the context-parallel model tests, started by torchrun from
tests/models/test_context_parallel.py.

Usage: python context_parallel_worker.py tiny OUT_DIR      (tiny GPT and Llama, logits and grads)
       python context_parallel_worker.py smollm2 OUT_DIR TEXT CONTEXT STRIDE   (perplexity)
Each rank saves what it computed; the test compares it with one process.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from qkv.models.context_parallel import ContextParallel, sharded_forward
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.models.llama import LlamaForCausalLM
from qkv.models.configs.llama import LlamaConfig


def tiny_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    gpt = GPT2Decoder(GPTConfig(vocab_size=97, context_length=64, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0))
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=36, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, head_dim=8, rope_theta=100000.0,
    ))
    return {"gpt": gpt, "llama": llama}


def tiny(out_dir: Path, rank: int) -> None:
    ids = torch.randint(0, 97, (2, 29), generator=torch.Generator().manual_seed(1))  # (B, S)
    results = {}
    for sharding in ("zigzag", "contiguous"):
        cp = ContextParallel(dist.group.WORLD, sharding, timedelta(seconds=60))
        for name, model in tiny_models().items():
            part = sharded_forward(model, ids[:, :-1], cp)
            targets = part.ring.layout.shard(ids[:, 1:], rank, dim=1)
            loss = torch.nn.functional.cross_entropy(part.logits.flatten(0, 1), targets.flatten(), reduction="sum")
            (loss / ids[:, 1:].numel()).backward()  # the mean over the whole batch
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g)
            results[f"{name}-{sharding}"] = {"logits": part.logits.detach(), "grads": grads}
    torch.save(results, out_dir / f"rank{rank}.pt")


def smollm2(out_dir: Path, rank: int, text: str, context: int, stride: int) -> None:
    from qkv.models.loader import load_pretrained
    from qkv.eval.perplexity import perplexity

    torch.set_num_threads(1)
    model, tokenizer = load_pretrained("smollm2")
    ids = torch.tensor(tokenizer.encode(Path(text).read_text(encoding="utf-8")).ids)
    results = {}
    for sharding in ("zigzag", "contiguous"):
        cp = ContextParallel(dist.group.WORLD, sharding)
        got = perplexity(model, ids, context_length=context, stride=stride, context_parallel=cp)
        results[sharding] = {"tokens": got.tokens, "windows": got.windows, "nll": got.nll,
                             "perplexity": got.perplexity}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    out_dir = Path(sys.argv[2])
    if sys.argv[1] == "tiny":
        tiny(out_dir, rank)
    else:
        smollm2(out_dir, rank, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
