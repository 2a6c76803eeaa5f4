"""Loading what to serve, and running it under uvicorn.

    sock = bind_socket("127.0.0.1", 8000)        # a port in use is refused before anything else
    served = load_served("smollm2", max_batch=8)   # prepared as `qkv generate` prepares it; KV memory checked first
    serve(build_app(served, ...), sock=sock, door=Door())
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.errors import QkvError
from qkv.names import DEFAULT_PRECISION
from qkv.serve.engine.served import Served
from qkv.serve.http.connections import bind_socket, run_uvicorn
from qkv.serve.engine.batching import Engine
from qkv.serve.http.front_door import Door
from qkv.serve.http.metrics import Metrics
from qkv.serve.engine.kv_memory import require_kv_memory
from qkv.runtime.session import DecodeSession
from qkv.util.threads import FollowIdleCores

if TYPE_CHECKING:
    from qkv.models.loader import LoadedModel
    from qkv.runtime.prepare import DecodeSetup


def model_name(source: str) -> str:
    path = Path(os.fspath(source)).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name or source) if path.exists() else source


def load_served(source: str, *, precision: str = DEFAULT_PRECISION, max_batch: int = 8,
                capacity: int | None = None, max_waiting: int | None = None,
                threads: FollowIdleCores | None = None, prefix_reuse: bool = True) -> Served:
    """The model (with its chat template when it has one), prepared as `qkv generate` prepares
    it (qkv.runtime.prepare: a GGUF file's blocks stay its blocks), ready for the engine; what
    it was loaded from and how it runs (precision, kernels) are kept for the start-up line and
    /v1/models, since a server's client cannot see its command line."""
    from qkv.runtime.prepare import prepare

    # Decode steps of the occupied slots as one qkv kernel call per layer where the kernels run
    # the model; never Inductor, whose graphs would follow the batch size.
    try:
        prepared = prepare(source, precision, inductor=False, chat=True)
    except QkvError as error:  # no template: refused before any weight is read
        if "chat template" not in str(error):
            raise
        prepared = prepare(source, precision, inductor=False)
    return served_from(source, prepared.loaded, prepared.setup, max_batch=max_batch, capacity=capacity,
                       max_waiting=max_waiting, threads=threads, prefix_reuse=prefix_reuse)


def served_from(source: str, loaded: LoadedModel, setup: DecodeSetup, *, max_batch: int = 8,
                capacity: int | None = None, max_waiting: int | None = None,
                threads: FollowIdleCores | None = None, prefix_reuse: bool = True,
                session_type: Callable[..., DecodeSession] = DecodeSession) -> Served:
    """A loaded and prepared model (one process's, or rank 0's slice under --tensor-parallel,
    whose `session_type` shares each step with the other ranks) with its engine."""
    from qkv.chat.conversation import ChatTemplate, chat_model_from

    model, tokenizer = loaded.model, loaded.tokenizer
    template: ChatTemplate | None = None
    stop = set(model.eos_token_ids)
    if loaded.chat_template is not None:
        try:
            chat = chat_model_from(loaded)
            template, stop = chat.template, set(chat.stop_ids)
        except QkvError as error:
            if "end-of-turn" not in str(error):
                raise
    require_kv_memory(model, max_batch=max_batch, capacity=capacity)  # before the engine allocates it
    engine = Engine(model, max_batch=max_batch, capacity=capacity, max_waiting=max_waiting, threads=threads,
                    prefix_reuse=prefix_reuse, setup=setup, session_type=session_type)
    kernels = setup.kernels.describe() if setup.kernels is not None else "PyTorch's kernels"
    return Served(model_name(source), model, tokenizer, template, frozenset(stop), engine,
                  precision=setup.precision, kernels=kernels, path=str(loaded.path))


def describe(served: Served) -> str:
    """How the server runs its model, in one line (as `qkv generate` says its setup)."""
    return (f"{served.name} from {served.path}: {served.precision} weights on {served.kernels}; "
            f"{served.max_model_len} positions a request (prompt + answer; the model's context is "
            f"{served.model.context_length}), {served.engine.max_batch} decoded together")


def serve(app: object, *, sock: socket.socket | None = None, host: str = "127.0.0.1", port: int = 8000,
          door: Door = Door(), served: Served | None = None, metrics: Metrics | None = None) -> None:
    """Serve `app` on `sock` (bound here from host and port when not given) until a signal;
    says what it serves (`served`) and where when it starts, and one line when it stops
    (with the requests `metrics` counted), so a terminal shows that it has ended."""
    sock = bind_socket(host, port) if sock is None else sock
    address, bound_port = sock.getsockname()[:2]
    shown = f"[{address}]" if ":" in address else address
    if served is not None:
        print(f"qkv serve: {describe(served)}", flush=True)
    print(f"qkv serve: listening on http://{shown}:{bound_port} (explorer at /, API at /v1)", flush=True)

    def stopped() -> None:
        count = "" if metrics is None else f" ({metrics.requests_served()} requests served)"
        print(f"qkv serve: stopped{count}", flush=True)

    run_uvicorn(app, sock, door, on_stop=stopped)
