"""Chat-template rendering and tokenizing on worker threads, off the event loop, with a deadline.

    worker = PromptWorker(timeout=30.0)
    ids = await worker.run(api._prompt_ids, request)   # ApiError 400 past the deadline, 503 when busy

On the event loop, a 1 MiB prompt (about 1 s to tokenize) or a slow chat template would stall
every stream and /health with it. Here they run on a few threads of their own, and the loop
keeps answering: a chat template renders in a child process (qkv.chat.template_process), and
`gil_free_encoder` encodes through the tokenizers library's `encode_batch`, which releases the
GIL while it works (its `encode` holds it to the end: a thread alone would not help). Past the
deadline the request is answered (400, the prompt is too slow to prepare) and nothing of it
runs on: a render started by the job ends at the same deadline, its child killed
(`render_deadline`), since a template's one C-level operation (a bignum power, a sort) is
beyond what any check between steps can interrupt; a thread cannot be stopped from outside,
so what else the job does runs to its own bounds (the tokenizer's). At most
`max_pending` jobs, running or queued, abandoned ones included, so no flood of slow prompts
piles up work without end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from qkv.chat.template_process import render_deadline
from qkv.serve.errors import ApiError

Result = TypeVar("Result")
RENDER_MARGIN_S = 0.1  # past the deadline, before a render it started is killed


def gil_free_encoder(tokenizer: Any) -> Callable[..., Any]:
    """`tokenizer.encode(text, add_special_tokens=...)`, the same Encoding, without the GIL held."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:
        return tokenizer.encode

    def encode(text: str, add_special_tokens: bool = True) -> Any:
        return batch([text], add_special_tokens=add_special_tokens)[0]

    return encode


class PromptWorker:
    def __init__(self, *, timeout: float = 30.0, threads: int = 2, max_pending: int = 32) -> None:
        self.timeout, self.max_pending = timeout, max_pending
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="qkv-prompt")
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished (or cancelled before they started)."""
        with self._lock:
            return self._pending

    def _done(self, _: concurrent.futures.Future[object]) -> None:
        with self._lock:
            self._pending -= 1

    async def run(self, fn: Callable[..., Result], *args: object) -> Result:
        """`fn(*args)` on a worker thread, answered within `timeout` seconds or refused."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise ApiError(503, f"the server is preparing {self._pending} prompts already; retry shortly",
                               headers={"Retry-After": "1"})
            self._pending += 1
        started = threading.Event()
        # A render ends just after this request's deadline: the answer is the deadline's own 400.
        until = time.monotonic() + self.timeout + RENDER_MARGIN_S

        def job() -> Result:
            started.set()
            try:
                with render_deadline(until):  # a chat template's render is killed then (module docstring)
                    return fn(*args)
            except Exception:
                raise
            except BaseException as error:  # a Rust panic in the tokenizer (pyo3's PanicException)
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    raise
                raise ApiError(500, f"the tokenizer failed on this prompt: {type(error).__name__}: {error}") from None

        future = self._pool.submit(job)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except asyncio.TimeoutError:
            future.cancel()  # dropped from the queue if it had not started
            if started.is_set():
                raise ApiError(400, f"the prompt took longer than {self.timeout:g} s to render and tokenize; "
                               "send a shorter prompt", code="prompt_timeout") from None
            raise ApiError(503, f"the server could not start preparing the prompt within {self.timeout:g} s; "
                           "retry shortly", headers={"Retry-After": "1"}) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
