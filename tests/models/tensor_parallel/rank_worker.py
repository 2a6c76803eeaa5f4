"""One rank of the tensor-parallel tests, started by torchrun from the tests beside it.

Usage: python rank_worker.py MODEL PRECISION[,PRECISION...] OUT_DIR [die]
       python rank_worker.py FOLDER mismatch OUT_DIR      (rank r checks FOLDER/file{r})
Each rank saves the logits of its model built from its float slices (unprepared: the float32
reference), the greedy and seeded-sampled tokens of its model prepared at each PRECISION (through
the modules, and greedy through the native layer step split at the all-reduces), and how
many of its linear layers multiply stored blocks and which block matrices it holds decoded, and
tokens sampled from a seed rank 0 drew. With `die`, rank 1 exits after the first
forward pass; the others must stop with one line, within the 20 s timeout of every collective.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from qkv.errors import QkvError
from qkv.generation.loop import generate
from qkv.models.loader import open_model
from qkv.models.tensor_parallel.group import check_same_files, join_tensor_parallel, shared_seed
from qkv.models.tensor_parallel.opened import open_rank
from qkv.runtime.prepare import load_dtype
from qkv.runtime.tensor_parallel import prepare_rank

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101]])  # (1, T)


def main() -> None:
    torch.set_num_threads(1)
    model, precisions, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    die = len(sys.argv) > 4 and sys.argv[4] == "die"
    tp = join_tensor_parallel(int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=20))
    if precisions == "mismatch":
        try:
            check_same_files(tp, [Path(model) / f"file{tp.rank}"], out / f"memo{tp.rank}.json")
        except QkvError as error:
            print(f"rank {tp.rank}: {error}", file=sys.stderr, flush=True)
            os._exit(2)
        os._exit(0)
    results: dict[str, object] = {}
    rank = open_rank(open_model(model, keep_blocks=True), tp)
    with torch.no_grad():
        results["logits"] = rank.build().model(IDS)
    if die and tp.rank == 1:
        os._exit(3)
    try:
        for precision in precisions.split(","):
            prepared = open_rank(open_model(model, load_dtype(precision), keep_blocks=True), tp)
            loaded, setup = prepare_rank(prepared, precision)
            with torch.no_grad():
                results[f"logits/{precision}"] = loaded.model(IDS)
            results[f"greedy/{precision}"] = generate(loaded.model, IDS, 8)
            results[f"sampled/{precision}"] = generate(loaded.model, IDS, 8, temperature=1.0, seed=7)
            # the decode steps on qkv's native layer, two calls a layer split at the all-reduces
            results[f"native/{precision}"] = generate(loaded.model, IDS, 8, setup=setup)
            results[f"layer_step/{precision}"] = setup.layer_step is not None  # type: ignore[assignment]
            results[f"block_layers/{precision}"] = torch.tensor(
                sum("Block" in type(m).__name__ for m in loaded.model.modules()))
            results[f"decoded/{precision}"] = list(prepared.source.decoded)  # type: ignore[assignment]
            # no seed given: rank 0 draws one for all (what `qkv generate` does without --seed)
            results[f"unseeded/{precision}"] = generate(loaded.model, IDS, 8, temperature=1.0,
                                                        seed=shared_seed(tp, None))
    except QkvError as error:
        print(f"rank {tp.rank}: {error}", file=sys.stderr, flush=True)
        os._exit(2)
    torch.save(results, out / f"rank{tp.rank}.pt")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
