"""Chat templates rendered in a child process with a memory limit, killed at a deadline.

Why a process and not more checks in the sandbox: a template is a small program, and the
operations that make big values are many and open-ended (`*` on strings and lists, `join`,
`replace`, `expandtabs`, `center`/`ljust`/`zfill`, `format` widths, `indent`, `wordwrap`,
`tojson(indent=)`, `sum(start=[])`, `batch`, `sort` of a large list, and whatever a new
Jinja2 adds). Checking each result after it is made is too late (the issue's probe reached
5 GB before the check), and checking each before it is made means a cost model per method
that is only as good as its list. A time limit checked between steps is bypassed by one
expensive builtin per step (40 `sort`s of a million items ran 52 s). A process with an
address-space limit and a parent that kills it at the deadline bounds all of these, known
or not, at once: nothing the template does can take more than `MEMORY_BYTES` or
`qkv.chat.sandbox.MAX_SECONDS` plus a little.

What it costs (benchmarks/HISTORY.md, "Issue 28"): one start per qkv process (Python and
Jinja2 only, no torch), and per render a JSON round trip over two pipes; SmolLM2's template
renders in the same order of time as in-process rendering, well below a decode step.

The sandbox's own bounds (qkv.chat.sandbox: steps, depth, sizes) still run inside the child, so
the common bombs are refused with their precise reason; the process limits are the floor
under them. One child serves the whole process, one render at a time (a lock), and a child
that was killed or died is started again for the next render.

Shape legend: none (text in, text out).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MEMORY_BYTES = 256 << 20  # what a render may allocate on top of the child's start
START_SECONDS = 60.0  # Python and Jinja2 start (generous: a loaded machine)
GRACE_SECONDS = 0.5  # past the sandbox's own deadline, before the kill
MAX_REPLY_BYTES = 16 << 20  # the rendered text is at most qkv.chat.sandbox.MAX_CHARS characters
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # src: the child imports qkv from here


class TemplateProcessError(Exception):
    """A render failed; `kind` is parse | limit | refused | memory | failed | time | crashed."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# ----------------------------------------------------------------------------- the child


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _answer(request: dict[str, Any], env: Any, compiled: dict[str, Any]) -> dict[str, Any]:
    from jinja2 import TemplateError

    from qkv.chat.sandbox import TemplateLimitError, TemplateRefusal, render

    source = request["source"]
    try:
        template = compiled.get(source)
        if template is None:
            template = env.bounded_template(source)
            if len(compiled) >= 8:
                compiled.clear()
            compiled[source] = template
    except (TemplateError, RecursionError, MemoryError, SyntaxError) as error:
        return {"error": "parse", "message": _reason(error)}
    if request.get("check"):
        return {"text": ""}
    try:
        return {"text": render(template, **request["variables"])}
    except TemplateRefusal as error:
        return {"error": "refused", "message": str(error)[:200]}
    except TemplateLimitError as error:
        return {"error": "limit", "message": str(error)}
    except MemoryError:
        return {"error": "memory", "message": f"the template tried to allocate more than {MEMORY_BYTES >> 20} MB"}
    except Exception as error:  # noqa: BLE001 - the template is someone else's code
        return {"error": "failed", "message": _reason(error)}


def _reason(error: BaseException) -> str:
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def serve() -> None:
    """The child's loop: one JSON request a line on stdin, one JSON answer a line on stdout."""
    from qkv.chat.sandbox import chat_environment

    env = chat_environment()
    compiled: dict[str, Any] = {}
    out = sys.stdout.buffer
    limit = _vm_size() + MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        # A child whose parent died mid-render stops after a few CPU seconds more.
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime) + 10
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
        try:
            answer = _answer(json.loads(line), env, compiled)
            reply = json.dumps(answer).encode()
        except MemoryError:
            reply = json.dumps({"error": "memory", "message": "the template's output did not fit the memory limit"}).encode()
        out.write(reply + b"\n")
        out.flush()
        if b'"error": "memory"' in reply:  # what it freed may stay mapped: the next render gets a new child
            return


# ----------------------------------------------------------------------------- the parent


class TemplateProcess:
    """The child that renders templates, started on first use (module docstring)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def check(self, source: str) -> None:
        """Raise TemplateProcessError("parse", ...) when `source` does not compile."""
        self._ask({"source": source, "check": True}, deadline=START_SECONDS)

    def render(self, source: str, variables: dict[str, Any]) -> str:
        """The rendered text; killed at the sandbox's limit, or sooner at the caller's own
        deadline when one is set for this thread (`render_deadline`)."""
        from qkv.chat.sandbox import MAX_SECONDS

        request = {"source": source, "variables": variables}
        return self._ask(request, deadline=MAX_SECONDS + GRACE_SECONDS, until=getattr(_CALLER, "until", None))["text"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    # -- the child ----------------------------------------------------------------------

    def _start(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        code = f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from qkv.chat.template_process import serve; serve()"
        try:
            child = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, close_fds=True)
        except OSError as error:
            raise TemplateProcessError("crashed", f"cannot start the process that renders templates ({error})") from None
        self._child = child
        self._read_line(child, time.monotonic() + START_SECONDS)
        return child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()

    def _read_line(self, child: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
        assert child.stdout is not None
        fd = child.stdout.fileno()
        chunks: list[bytes] = []
        size = 0
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self._stop()
                    raise TemplateProcessError("time", "the template ran past its time limit and was stopped")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._stop()
                    raise TemplateProcessError("crashed", "the process rendering the template died (out of memory?)")
                chunks.append(chunk)
                size += len(chunk)
                if chunk.endswith(b"\n"):
                    return json.loads(b"".join(chunks))
                if size > MAX_REPLY_BYTES:
                    self._stop()
                    raise TemplateProcessError("limit", "the template's output is larger than the size limit")

    def _ask(self, request: dict[str, Any], *, deadline: float, until: float | None = None) -> dict[str, Any]:
        """`deadline`: seconds the child has for it once it has it; `until` (time.monotonic()):
        when the caller stops waiting, the wait for the lock included."""
        payload = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
        if not self._lock.acquire(timeout=-1 if until is None else max(0.0, until - time.monotonic())):
            raise TemplateProcessError("time", "the template could not start rendering before the request's deadline")
        try:
            for attempt in (1, 2):  # a child that died idle (its CPU limit, a signal) is replaced once
                reused = self._child is not None
                child = self._start()
                try:
                    assert child.stdin is not None
                    child.stdin.write(payload)
                    child.stdin.flush()
                    end = time.monotonic() + deadline
                    answer = self._read_line(child, end if until is None else min(end, until))
                    break
                except (OSError, TemplateProcessError) as error:
                    self._stop()
                    crashed = not isinstance(error, TemplateProcessError) or error.kind == "crashed"
                    if not (crashed and reused and attempt == 1):
                        if isinstance(error, TemplateProcessError):
                            raise
                        raise TemplateProcessError("crashed", "the process rendering the template died") from None
            if answer.get("error") == "memory":
                self._stop()  # it exits after a memory error: wait for it here
        finally:
            self._lock.release()
        if "error" in answer:
            raise TemplateProcessError(str(answer["error"]), str(answer.get("message", "")))
        return answer


_CALLER = threading.local()  # the deadline of the caller on this thread (render_deadline)


@contextlib.contextmanager
def render_deadline(until: float) -> Iterator[None]:
    """Renders this thread asks for while open end by `until` (time.monotonic()) at the
    latest, the child killed then: a caller that answers at its own deadline (the server's
    prompt worker, qkv.serve.engine.prompt_worker) leaves no render running behind it."""
    previous = getattr(_CALLER, "until", None)
    _CALLER.until = until if previous is None else min(previous, until)
    try:
        yield
    finally:
        _CALLER.until = previous


_SHARED: TemplateProcess | None = None
_SHARED_LOCK = threading.Lock()


_SHARED_PID = 0


def shared() -> TemplateProcess:
    """The process's one template child (a forked process starts its own: the pipes and the
    lock it inherited belong to its parent)."""
    global _SHARED, _SHARED_PID, _SHARED_LOCK
    if _SHARED_PID != os.getpid():
        _SHARED, _SHARED_PID, _SHARED_LOCK = None, os.getpid(), threading.Lock()
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = TemplateProcess()
        return _SHARED
