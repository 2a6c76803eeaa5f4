"""Loading what to serve, and running it under uvicorn.

    sock = bind_socket("127.0.0.1", 8000)        # a port in use is refused before anything else
    served = load_served("smollm2", precision="float32", max_batch=8)   # KV memory checked first
    serve(build_app(served, ...), sock=sock, door=Door())
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from qkv.errors import QkvError
from qkv.serve.engine.served import Served
from qkv.serve.http.connections import bind_socket, run_uvicorn
from qkv.serve.engine.batching import Engine
from qkv.serve.http.front_door import Door
from qkv.serve.http.metrics import Metrics
from qkv.serve.engine.kv_memory import require_kv_memory
from qkv.util.threads import FollowIdleCores


def model_name(source: str) -> str:
    path = Path(os.fspath(source)).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name or source) if path.exists() else source


def load_served(source: str, *, precision: str = "float32", max_batch: int = 8,
                capacity: int | None = None, max_waiting: int | None = None,
                threads: FollowIdleCores | None = None, prefix_reuse: bool = True) -> Served:
    """The model (with its chat template when it has one), ready for the engine; what it
    was loaded from and how it runs (precision, kernels) are kept for the start-up line
    and /v1/models, since a server's client cannot see its command line."""
    from qkv.chat.conversation import ChatTemplate, chat_model_from
    from qkv.models.loader import load
    from qkv.runtime.prepare import load_dtype, prepare_for_decoding

    template: ChatTemplate | None = None
    try:
        loaded = load(source, load_dtype(precision), chat=True)
        chat = chat_model_from(loaded)
        model, tokenizer, template, stop = chat.model, chat.tokenizer, chat.template, set(chat.stop_ids)
    except QkvError as error:
        if "chat template" not in str(error) and "end-of-turn" not in str(error):
            raise
        loaded = load(source, load_dtype(precision))
        model, tokenizer = loaded.model, loaded.tokenizer
        stop = set(model.eos_token_ids)
    # Decode steps of the occupied slots as one qkv kernel call per layer where the kernels run
    # the model (float32, int8, int4); not Inductor, whose graphs would follow the batch size.
    setup = prepare_for_decoding(model, precision=precision, inductor=False)
    require_kv_memory(model, max_batch=max_batch, capacity=capacity)  # before the engine allocates it
    engine = Engine(model, max_batch=max_batch, capacity=capacity, max_waiting=max_waiting, threads=threads,
                    prefix_reuse=prefix_reuse)
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
