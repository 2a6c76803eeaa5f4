"""The HTTP application: OpenAI-shaped routes over the batching engine, /health, /metrics,
and the live attention explorer at `/`.

    app = build_app(Served(...), limits=Limits(), api_key=None)   # a Starlette app
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from qkv.chat import ChatTemplate
from qkv.errors import QkvError
from qkv.generation.sampling import Sampling
from qkv.serve.engine import Engine, EngineFull, Finished
from qkv.serve.metrics import Metrics
from qkv.serve.schemas import ApiError, CompletionRequest, Limits, parse
from qkv.serve.structured import Plan
from qkv.serve.text import TextStream


@dataclass
class Served:
    """What the server serves: one model, its tokenizer, chat template and end tokens."""

    name: str
    model: Any  # CausalDecoder
    tokenizer: Any  # tokenizers.Tokenizer
    template: ChatTemplate | None
    stop_ids: frozenset[int]
    engine: Engine
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: Any = None  # qkv.generation.constraints.Grammars, built on the first structured request


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _json_body(request: Request, limits: Limits) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the request body is over {limits.max_body_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise ApiError(413, f"the request body is over {limits.max_body_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


class Api:
    def __init__(self, served: Served, *, limits: Limits, api_key: str | None, metrics: Metrics) -> None:
        self.served, self.limits, self.api_key, self.metrics = served, limits, api_key, metrics

    # -- plumbing ------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if given != f"Bearer {self.api_key}":
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.served.name}'",
                           param="model", code="model_not_found")

    # -- routes --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.served.name})

    async def metrics_page(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.served.engine.stats),
                                 media_type="text/plain; version=0.0.4")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.served.name, "object": "model", "created": self.served.created, "owned_by": "qkv"}

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self.check_key(request)
        self.check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    # -- generation ----------------------------------------------------------------------
    def _prompt_ids(self, req: CompletionRequest, plan: Plan) -> list[int]:
        encode = self.served.tokenizer.encode
        if req.messages is not None:
            if self.served.template is None:
                raise ApiError(400, f"the model '{self.served.name}' has no chat template; use /v1/completions")
            try:
                text = plan.render(self.served.template, req.messages)  # tools shown as the template wants
            except QkvError as error:
                raise ApiError(400, str(error), param="messages") from None
            return encode(text, add_special_tokens=False).ids
        assert req.prompt is not None
        return encode(req.prompt).ids

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        self.check_key(request)
        req = parse(await _json_body(request, self.limits), chat=chat, limits=self.limits)
        self.check_model(req.model)
        # response_format / tools -> grammar (qkv.serve.structured); off the event loop: the first
        # one builds the token tables (~0.4 s on SmolLM2)
        structured = req.response_schema is not None or req.tools
        plan = await asyncio.to_thread(Plan.for_request, req, self.served) if structured else Plan()
        ids = self._prompt_ids(req, plan)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        capacity = self.served.engine.capacity
        if len(ids) + req.max_tokens > capacity:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; with max_tokens {req.max_tokens} that is over "
                           f"the model's context of {capacity} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | Finished] = asyncio.Queue()
        try:
            job = self.served.engine.submit(ids, max_tokens=req.max_tokens, sampling=sampling,
                                            stop_ids=self.served.stop_ids, constraint=plan.constraint,
                                            emit=lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        except EngineFull as error:
            raise ApiError(503, str(error), headers={"Retry-After": "1"}) from None
        except QkvError as error:
            raise ApiError(400, str(error)) from None
        answer = _Answer(req, chat, self.served.name, len(ids), plan=plan)
        pieces = self._pieces(job, queue, TextStream(self.served.tokenizer, req.stop), answer)
        if req.stream:
            return StreamingResponse(answer.sse(pieces), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            text = "".join([piece async for piece in _until_disconnected(pieces, request)])
        finally:
            job.cancel()
        if answer.finish == "error":
            raise ApiError(500, f"generation failed: {answer.error}")
        return JSONResponse(answer.whole(text))

    async def _pieces(self, job: Any, queue: asyncio.Queue[int | Finished], text: TextStream,
                      answer: _Answer) -> AsyncIterator[str]:
        """The answer's text in pieces, as the engine makes tokens; ends the job on exit."""
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Finished):
                    answer.finish = {"length": "length", "error": "error"}.get(item.reason, "stop")
                    answer.error = item.message
                    rest = text.flush()
                    if rest:
                        yield rest
                    return
                answer.completion_tokens += 1
                piece = text.push(item)
                if piece:
                    yield piece
                if text.stopped:
                    answer.finish = "stop"
                    return
        finally:
            job.cancel()


async def _until_disconnected(pieces: AsyncIterator[str], request: Request) -> AsyncIterator[str]:
    """Pass pieces on; stop (and so free the slot) if the client goes away meanwhile."""
    iterator = pieces.__aiter__()
    while True:
        next_piece = asyncio.ensure_future(iterator.__anext__())
        while not next_piece.done():
            done, _ = await asyncio.wait({next_piece}, timeout=0.5)
            if not done and await request.is_disconnected():
                next_piece.cancel()
                await iterator.aclose()  # type: ignore[attr-defined]
                return
        try:
            yield next_piece.result()
        except StopAsyncIteration:
            return


@dataclass
class _Answer:
    """One response in OpenAI's shapes (whole, or as stream chunks)."""

    req: CompletionRequest
    chat: bool
    model: str
    prompt_tokens: int
    completion_tokens: int = 0
    finish: str = "stop"
    error: str = ""
    plan: Plan = field(default_factory=Plan)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind,
                "created": self.created, "model": self.model}

    def whole(self, text: str) -> dict[str, Any]:
        if self.chat:
            message, finish = self.plan.message(text, self.finish)  # content, or tool_calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish}
        return {**self._head(False), "choices": [choice], "usage": self.usage}

    def _chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {**self._head(True), "choices": [choice]}
        if self.req.include_usage:
            body["usage"] = None
        return body

    async def sse(self, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
        def event(body: dict[str, Any]) -> str:
            return f"data: {json.dumps(body)}\n\n"

        if self.chat:
            yield event(self._chunk("", None, first=True))
        if self.plan.buffers:  # a reply that may be a tool call is read whole, then sent
            text = "".join([piece async for piece in pieces])
            message, self.finish = self.plan.message(text, self.finish)
            for chunk in _tool_chunks(self, message):
                yield event(chunk)
        async for piece in pieces:
            yield event(self._chunk(piece, None))
        if self.finish == "error":
            yield event(ApiError(500, f"generation failed: {self.error}").body())
        else:
            yield event(self._chunk(None, self.finish))
        if self.req.include_usage:
            yield event({**self._head(True), "choices": [], "usage": self.usage})
        yield "data: [DONE]\n\n"


def _tool_chunks(answer: _Answer, message: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream chunks of a whole message: its content, then each tool call in OpenAI's
    delta shape (index, id, type and name first; then the arguments)."""
    chunks = [answer._chunk(message["content"], None)] if message.get("content") else []
    for i, call in enumerate(message.get("tool_calls") or []):
        head = {"index": i, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}
        for part in (head, {"index": i, "function": {"arguments": call["function"]["arguments"]}}):
            chunk = answer._chunk(None, None)
            chunk["choices"][0]["delta"]["tool_calls"] = [part]
            chunks.append(chunk)
    return chunks


def build_app(served: Served, *, limits: Limits = Limits(), api_key: str | None = None,
              metrics: Metrics | None = None, start_engine: bool = True) -> Starlette:
    from qkv.serve.explorer import Explorer

    metrics = metrics or Metrics()
    api = Api(served, limits=limits, api_key=api_key, metrics=metrics)
    explorer = Explorer(api)

    def guarded(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                response = _error(error)
            except Exception as error:  # noqa: BLE001 - an answer, never a traceback
                response = _error(ApiError(500, f"internal error: {type(error).__name__}: {error}"))
            metrics.count(request.url.path if request.url.path.count("/") < 4 else "other", response.status_code)
            return response
        return endpoint

    routes = [
        Route("/", guarded(explorer.page), methods=["GET"]),
        Route("/explorer/trace", guarded(explorer.trace), methods=["POST"]),
        Route("/health", guarded(api.health), methods=["GET"]),
        Route("/metrics", guarded(api.metrics_page), methods=["GET"]),
        Route("/v1/models", guarded(api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(api.model), methods=["GET"]),
        Route("/v1/completions", guarded(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(api.chat_completions), methods=["POST"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        message = "method not allowed" if status == 405 else f"no route {request.url.path}"
        return JSONResponse(ApiError(status, message).body(), status_code=status)

    def lifespan(app: Starlette) -> Any:
        import contextlib

        @contextlib.asynccontextmanager
        async def span() -> AsyncIterator[None]:
            if start_engine:
                served.engine.start()
            try:
                yield
            finally:
                if start_engine:
                    served.engine.stop()
        return span()

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)
