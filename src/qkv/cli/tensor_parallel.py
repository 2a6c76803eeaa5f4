"""`--tensor-parallel N` for `qkv generate`, `qkv perplexity` and `qkv serve`: under torchrun,
every process holds a slice of every layer (qkv.models.tensor_parallel) and runs the same
command; rank 0 writes the output. Under `qkv serve` rank 0 serves HTTP and the others follow
the steps its engine shares with them (`serve_rank`, qkv.runtime.tensor_parallel_steps).
Importing this module imports no torch.

Before anything loads, each rank opens the file's headers and checks that torchrun started N
processes and that every rank opened the same bytes (content digests). A refusal (N does not
divide the KV heads, mismatched files) is the same on every rank and rank 0 says it; a rank
that finds another gone (`RankLost`) says so itself, since rank 0 may be the one that died.
Every collective is bounded by the group's timeout (qkv.models.tensor_parallel.group).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qkv.errors import QkvError

if TYPE_CHECKING:
    from qkv.models.loader import LoadedModel
    from qkv.models.tensor_parallel.group import TensorParallel
    from qkv.runtime.prepare import DecodeSetup


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel", type=int, metavar="N",
                        help="split every layer over the N processes of a torchrun launch (`torchrun "
                        "--nproc-per-node N -m qkv ... --tensor-parallel N`, `--nnodes` across machines): "
                        "each holds whole key/value heads with their query heads, a slice of the MLP and "
                        "of the vocabulary, read from the file alone; N must divide the KV heads")


def under_tensor_parallel(args: argparse.Namespace, command: str,
                          body: Callable[[argparse.Namespace, TensorParallel], int], *, barrier: bool = True) -> int:
    """Run `body(args, tp)` as one rank of --tensor-parallel N (module docstring).

    A rank of a group leaves with `os._exit` once its output is flushed: a process that ran
    qkv's native kernels and gloo aborts in C++ teardown at interpreter exit ("terminate called
    without an active exception"), after its work is done; exiting at once keeps the exit code
    the command's. `barrier`: no rank leaves before every rank's body has returned (a server's
    ranks leave on rank 0's stop plan instead). Without a group (N = 1, no torchrun) it
    returns and raises as any command."""
    from qkv.models.tensor_parallel.group import RankLost, join_tensor_parallel

    tp = join_tensor_parallel(args.tensor_parallel)
    if tp.group is None:
        return body(args, tp)
    code = 2
    try:
        code = body(args, tp)
        if barrier:
            tp.barrier()  # no rank leaves while another is still in a collective
    except QkvError as error:
        if tp.rank == 0 or isinstance(error, RankLost):  # a refusal is the same everywhere: rank 0 says it
            print(f"qkv {command}: error: {error}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def load_rank(args: argparse.Namespace, tp: TensorParallel, *, chat: bool = False) -> tuple[LoadedModel, DecodeSetup]:
    """This rank's slice of `--model`, prepared at `--dtype`; the files checked the same on every rank."""
    from qkv.models.hf.untrusted import available_memory
    from qkv.models.loader import open_model
    from qkv.models.tensor_parallel.group import check_same_files
    from qkv.models.tensor_parallel.opened import open_rank
    from qkv.names import AUTO, BLOCKS
    from qkv.util.cache_integrity import cache_folder
    from qkv.runtime.prepare import block_products_run, load_dtype
    from qkv.runtime.tensor_parallel import prepare_rank
    from qkv.util.progress import slow_step

    precision = args.precision
    keep_blocks = precision == BLOCKS or (precision == AUTO and block_products_run())
    given = getattr(args, "max_memory", None)  # qkv serve has no --max-memory
    budget = given if given is not None else available_memory()
    limit = None if budget is None else budget * tp.world  # each rank holds 1/N of the weights
    with slow_step(f"opening {args.model}"):
        opened = open_model(args.model, load_dtype(precision), max_memory=limit, chat=chat, keep_blocks=keep_blocks)
    with slow_step("checking that every rank opened the same file"):
        check_same_files(tp, opened.files, cache_folder() / "digests.json")
    rank = open_rank(opened, tp)
    with slow_step(f"loading rank {tp.rank}'s slice"):
        prepared = prepare_rank(rank, precision)
    decoded = rank.source.decoded
    if decoded and tp.rank == 0:  # said once: every rank's slices have the same boundaries
        kinds = sorted({name.rsplit(".", 2)[-2] for name in decoded})
        print(f"tensor parallel: {len(decoded)} block matrices ({', '.join(kinds)}) are split inside their blocks "
              f"over {tp.world} ranks; each rank holds its slice of them as float32", file=sys.stderr, flush=True)
    return prepared


def _load_for_serving(args: argparse.Namespace, tp: TensorParallel) -> tuple[LoadedModel, DecodeSetup]:
    """`load_rank` with the chat template where the model has one (as `load_served` loads)."""
    try:
        return load_rank(args, tp, chat=True)
    except QkvError as error:  # no template: the same on every rank, refused before any weight is read
        if "chat template" not in str(error):
            raise
        return load_rank(args, tp)


def serve_rank(args: argparse.Namespace, tp: TensorParallel, door: Any) -> int:
    """`qkv serve` as one rank: rank 0 binds the port, serves HTTP and leads every step;
    the others follow its steps until its stop plan (or until they find it gone: RankLost).
    A port rank 0 cannot bind is said by rank 0 and ends every rank before anything loads."""
    import signal

    from qkv.runtime.tensor_parallel_steps import follow

    sock, refusal = None, None
    if tp.rank == 0:
        from qkv.serve.http.connections import bind_socket

        try:
            sock = bind_socket(args.host, args.port)
        except QkvError as error:
            refusal = str(error)
    refusal = tp.gather_objects(refusal, "check that rank 0 could bind its port")[0]
    if refusal is not None:
        raise QkvError(str(refusal))
    if tp.rank != 0:
        loaded, setup = _load_for_serving(args, tp)
        for stop in (signal.SIGINT, signal.SIGTERM):  # a follower stops on rank 0's word, not on a signal
            signal.signal(stop, signal.SIG_IGN)
        follow(loaded.model, tp, setup=setup)
        return 0
    assert sock is not None
    try:
        return _lead_server(args, tp, door, sock)
    finally:
        sock.close()


def _lead_server(args: argparse.Namespace, tp: TensorParallel, door: Any, sock: Any) -> int:
    import functools
    import signal

    from qkv.runtime.tensor_parallel_steps import LeadSession
    from qkv.serve.api.schemas import Limits
    from qkv.serve.http.app import build_app
    from qkv.serve.http.metrics import Metrics
    from qkv.serve.http.server import serve, served_from
    from qkv.util.threads import FollowIdleCores

    loaded, setup = _load_for_serving(args, tp)
    lost: list[QkvError] = []

    def on_lost(error: QkvError) -> None:  # a follower is gone: answer errors, then stop the server
        lost.append(error)
        os.kill(os.getpid(), signal.SIGINT)

    session_type = functools.partial(LeadSession, tp=tp, on_lost=on_lost)
    follow_cores = FollowIdleCores() if args.threads is None else None
    served = served_from(args.model, loaded, setup, max_batch=args.max_batch, capacity=args.context,
                         max_waiting=args.max_waiting, threads=follow_cores, prefix_reuse=args.prefix_reuse,
                         session_type=session_type)
    served.kernels += f", tensor-parallel over {tp.world} processes"
    metrics = Metrics()
    app = build_app(served, limits=Limits(max_tokens=args.max_tokens), api_key=args.api_key, door=door,
                    metrics=metrics)
    try:
        serve(app, sock=sock, door=door, served=served, metrics=metrics)
    except KeyboardInterrupt:
        if lost:
            raise lost[0] from None
        raise
    if lost:
        raise lost[0]
    return 0
