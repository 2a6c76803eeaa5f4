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
from qkv.serve.engine.kv_memory import require_kv_memory
from qkv.util.threads import FollowIdleCores


def model_name(source: str) -> str:
    path = Path(os.fspath(source)).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name or source) if path.exists() else source


def load_served(source: str, *, precision: str = "float32", max_batch: int = 8,
                capacity: int | None = None, max_waiting: int | None = None,
                threads: FollowIdleCores | None = None, prefix_reuse: bool = True) -> Served:
    """The model (with its chat template when it has one), ready for the engine."""
    from qkv.chat.conversation import ChatTemplate, load_chat_model
    from qkv.models.loader import load_pretrained
    from qkv.runtime.prepare import load_dtype, prepare_for_decoding

    template: ChatTemplate | None = None
    try:
        chat = load_chat_model(source, dtype=load_dtype(precision))
        model, tokenizer, template, stop = chat.model, chat.tokenizer, chat.template, set(chat.stop_ids)
    except QkvError as error:
        if "chat template" not in str(error) and "end-of-turn" not in str(error):
            raise
        model, tokenizer = load_pretrained(source, dtype=load_dtype(precision))
        stop = set(model.eos_token_ids)
    # Decode steps of the occupied slots as one qkv kernel call per layer where the kernels run
    # the model (float32, int8, int4); not Inductor, whose graphs would follow the batch size.
    prepare_for_decoding(model, precision=precision, inductor=False)
    require_kv_memory(model, max_batch=max_batch, capacity=capacity)  # before the engine allocates it
    engine = Engine(model, max_batch=max_batch, capacity=capacity, max_waiting=max_waiting, threads=threads,
                    prefix_reuse=prefix_reuse)
    return Served(model_name(source), model, tokenizer, template, frozenset(stop), engine)


def serve(app: object, *, sock: socket.socket | None = None, host: str = "127.0.0.1", port: int = 8000,
          door: Door = Door()) -> None:
    """Serve `app` on `sock` (bound here from host and port when not given) until a signal."""
    sock = bind_socket(host, port) if sock is None else sock
    address, bound_port = sock.getsockname()[:2]
    shown = f"[{address}]" if ":" in address else address
    print(f"qkv serve: listening on http://{shown}:{bound_port} (explorer at /, API at /v1)", flush=True)
    run_uvicorn(app, sock, door)
