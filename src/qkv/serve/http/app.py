"""The HTTP application: OpenAI-shaped routes over the batching engine, /health, /metrics,
and the live attention explorer at `/`.

    app = build_app(Served(...), limits=Limits(), api_key=None, door=Door())   # an ASGI app

The app answers behind `qkv.serve.http.front_door` (Host, Origin, CORS, JSON-only bodies, metrics
counting); bodies are parsed by `qkv.serve.api.json_body`, prompts rendered and tokenized by
`qkv.serve.engine.prompt_worker`, off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from qkv.errors import QkvError
from qkv.generation.sampling import Sampling
from qkv.models.hf.tokenizer_guard import TokenizerPanicError
from qkv.serve.api.answer import Answer, Choice
from qkv.serve.engine.jobs import EngineFull, Event, Finished, Job, SharedPrompt
from qkv.serve.explorer.routes import Explorer
from qkv.serve.explorer.why import ExplorerWhy, with_why
from qkv.serve.http.front_door import Door, front_door
from qkv.serve.api.json_body import read_json_body
from qkv.serve.engine.served import Served
from qkv.serve.http.metrics import Metrics
from qkv.serve.engine.prompt_worker import PromptWorker, gil_free_encoder
from qkv.serve.api.schemas import ApiError, CompletionRequest, Limits, parse
from qkv.serve.api.structured import Plan
from qkv.serve.api.tokens import TokenTexts

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is there


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class LoopOutbox:
    """Hands each engine step's events to one event loop in a single call
    (qkv.serve.engine.jobs.Outbox): the events of every running request, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def post(self, events: list[tuple[Any, Event]]) -> None:
        if self.loop.is_closed():  # the server has stopped: no one is there to read them
            return
        self.loop.call_soon_threadsafe(_deliver, events)


def _deliver(events: list[tuple[Any, Event]]) -> None:
    for emit, event in events:
        emit(event)


class Api:
    def __init__(self, served: Served, *, limits: Limits, api_key: str | None, metrics: Metrics) -> None:
        self.served, self.limits, self.api_key, self.metrics = served, limits, api_key, metrics
        self.prompts = PromptWorker()  # build_app gives it the door's prompt deadline
        self.texts = TokenTexts(served.tokenizer)
        self.vocab_size = int(served.model.cfg.vocab_size)
        self._outbox: LoopOutbox | None = None

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
        self.check_key(request)
        return PlainTextResponse(self.metrics.render(self.served.engine.stats),
                                 media_type="text/plain; version=0.0.4")

    def _model_card(self) -> dict[str, Any]:
        # OpenAI's four fields, then vLLM's max_model_len and qkv's own: how the model is served.
        return {"id": self.served.name, "object": "model", "created": self.served.created, "owned_by": "qkv",
                "max_model_len": self.served.max_model_len, "qkv": self.served.card()}

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
    def _chat_ids(self, req: CompletionRequest, plan: Plan) -> list[int]:
        if self.served.template is None:
            raise ApiError(400, f"the model '{self.served.name}' has no chat template; use /v1/completions")
        try:
            text = plan.render(self.served.template, req.messages or [])  # tools shown as the template wants
        except QkvError as error:
            raise ApiError(400, str(error), param="messages") from None
        return gil_free_encoder(self.served.tokenizer)(text, add_special_tokens=False).ids

    def _prepared(self, req: CompletionRequest, chat: bool) -> tuple[Plan, list[tuple[list[int], str]]]:
        """The request's plan and its prompts, in one job on a prompt worker (one hand-over to a
        thread and back per request, not one per part). The plan: response_format / tools -> a
        grammar (qkv.serve.api.structured; the first one builds the token tables, ~0.4 s on
        SmolLM2); a chat's also knows the template's tool format, for earlier calls in its messages."""
        plan = Plan.for_request(req, self.served) if chat or req.response_schema is not None else Plan()
        return plan, self._prompts(req, chat, plan)

    def _prompts(self, req: CompletionRequest, chat: bool, plan: Plan) -> list[tuple[list[int], str]]:
        """Each prompt's token ids and the text an echo shows. Runs on a prompt worker
        (`PromptWorker`), so the event loop goes on meanwhile. A prompt the tokenizer's bounds
        refuse (qkv.models.hf.tokenizer_guard: it would grow too far) is the client's 400; a
        tokenizer that fails on it (a panic) is the server's 500."""
        try:
            return self._encoded(req, chat, plan)
        except TokenizerPanicError as error:
            raise ApiError(500, str(error)) from None
        except QkvError as error:
            raise ApiError(400, str(error), param="messages" if chat else "prompt") from None

    def _encoded(self, req: CompletionRequest, chat: bool, plan: Plan) -> list[tuple[list[int], str]]:
        if chat:
            return [(self._chat_ids(req, plan), "")]
        encode = gil_free_encoder(self.served.tokenizer)
        out = []
        for prompt in req.prompts or []:
            if isinstance(prompt, str):
                out.append((encode(prompt).ids, prompt))
            else:
                out.append((prompt, self.served.tokenizer.decode(prompt, skip_special_tokens=False)))
        return out

    def _jobs(self, req: CompletionRequest, chat: bool, prompts: list[tuple[list[int], str]],
              emit: Any, plan: Plan, outbox: LoopOutbox) -> tuple[list[Job], Answer]:
        limit = self.served.max_model_len  # --context, at most the model's own context length
        answer = Answer(req, chat, self.served.name, sum(len(ids) for ids, _ in prompts))
        base = Sampling(temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                        logit_bias=tuple(req.logit_bias.items()), presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty)
        # The chosen tokens' logprobs rank best_of candidates even when the client asked for none.
        logprobs = req.logprobs if req.logprobs is not None else 0 if req.best_of > req.n else None
        jobs = []
        for p, (ids, text) in enumerate(prompts):
            if not ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            if len(ids) + req.max_tokens > limit:
                raise ApiError(400, f"the prompt{f' {p}' if len(prompts) > 1 else ''} has {len(ids)} tokens; with "
                               f"max_tokens {req.max_tokens} that is over this server's context of {limit} tokens "
                               f"(max_model_len: --context, at most the model's {self.served.model.context_length})",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            share = SharedPrompt() if req.best_of > 1 else None
            for j in range(req.best_of):
                sampling = base if j == 0 or req.seed is None else replace(base, seed=(req.seed + j) % 2**63)
                choice = Choice(req, chat, self.texts, ids, text, plan=plan)
                choice.index = len(answer.choices)
                answer.choices.append(choice)
                jobs.append(Job(ids, req.max_tokens, sampling, self.served.stop_ids,
                                emit=functools.partial(emit, choice.index), logprobs=logprobs,
                                score_prompt=req.echo and req.logprobs is not None, share=share,
                                constraint=plan.constraint(), outbox=outbox))
        return jobs, answer

    async def read_body(self, request: Request) -> Any:
        """The JSON body of an authorised request, bounded in size."""
        self.check_key(request)
        return await read_json_body(request, self.limits.max_body_bytes)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        req = parse(await self.read_body(request), chat=chat, limits=self.limits, vocab_size=self.vocab_size)
        self.check_model(req.model)
        plan, prompts = await self.prompts.run(self._prepared, req, chat)  # off the event loop, with a deadline
        loop = asyncio.get_running_loop()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = LoopOutbox(loop)  # every request's events: one call onto the loop per step
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emit(index: int, event: Event) -> None:  # on the event loop (LoopOutbox)
            queue.put_nowait((index, event))

        jobs, answer = self._jobs(req, chat, prompts, emit, plan, self._outbox)
        try:
            self.served.engine.submit_jobs(jobs)
        except EngineFull as error:
            raise ApiError(503, str(error), headers={"Retry-After": "1"}) from None
        except QkvError as error:
            raise ApiError(400, str(error)) from None
        if req.stream:
            return StreamingResponse(_stream(answer, jobs, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in _events(answer, jobs, queue, request):
                pass
        finally:
            for job in jobs:
                job.cancel()
        failure = answer.failure()
        if failure is not None:
            raise failure
        return JSONResponse(answer.whole())


async def _events(answer: Answer, jobs: list[Job], queue: asyncio.Queue[tuple[int, Event]],
                  request: Request | None) -> AsyncIterator[Choice]:
    """Hand each event to its choice, and yield the choice, until every job has finished.
    With `request`, stop early (the jobs are then cancelled by the caller) once its client
    has gone away: checked every DISCONNECT_POLL_S, whether events keep coming or not."""
    open_jobs = len(jobs)
    checked = time.monotonic()
    while open_jobs:
        if request is None:  # a stream: its response notices a closed connection itself
            index, event = await queue.get()  # no timer per token (a wait_for's is most of the loop's work)
        else:
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return
                checked = time.monotonic()
            try:
                index, event = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
        choice = answer.choices[index]
        choice.take(event)
        if isinstance(event, Finished):
            open_jobs -= 1
        elif choice.stream.stopped:
            jobs[index].cancel()  # a stop string: the engine need not go on
        yield choice


async def _stream(answer: Answer, jobs: list[Job], queue: asyncio.Queue[tuple[int, Event]]) -> AsyncIterator[str]:
    """Server-sent events: a first chunk per chat choice, then each choice's chunks as its
    events come (a closed connection ends this generator, and so the jobs)."""
    try:
        if answer.chat:
            for choice in answer.choices:
                for event in answer.chunk_events(choice, first=True):
                    yield event
        async for choice in _events(answer, jobs, queue, None):
            for event in answer.chunk_events(choice, first=False):
                yield event
        yield "".join(answer.closing_events())
    finally:
        for job in jobs:
            job.cancel()


def build_app(served: Served, *, limits: Limits = Limits(), api_key: str | None = None,
              metrics: Metrics | None = None, start_engine: bool = True, door: Door = Door()) -> Any:
    from qkv.serve.api.tokenize import TokenizerRoutes

    metrics = metrics or Metrics()
    api = Api(served, limits=limits, api_key=api_key, metrics=metrics)
    api.prompts = PromptWorker(timeout=door.prompt_timeout)
    explorer = Explorer(api)
    explorer.html = with_why(explorer.html)  # click a key's row: its score split (qkv.serve.explorer.why)
    explorer_why = ExplorerWhy(api)

    def guarded(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as error:
                response = _error(error)
            except Exception as error:  # noqa: BLE001 - an answer, never a traceback
                response = _error(ApiError(500, f"internal error: {type(error).__name__}: {error}"))
            return response  # counted on /metrics by the front door
        return endpoint

    routes = [
        Route("/", guarded(explorer.page), methods=["GET"]),
        Route("/explorer/trace", guarded(explorer.trace), methods=["POST"]),
        Route("/explorer/why", guarded(explorer_why.why), methods=["POST"]),
        Route("/health", guarded(api.health), methods=["GET"]),
        Route("/metrics", guarded(api.metrics_page), methods=["GET"]),
        Route("/v1/models", guarded(api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(api.model), methods=["GET"]),
        Route("/v1/completions", guarded(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(api.chat_completions), methods=["POST"]),
        *(Route(path, guarded(handler), methods=methods) for path, handler, methods in TokenizerRoutes(api).routes()),
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
                api.prompts.close()
                if start_engine:
                    served.engine.stop()
        return span()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)
    return front_door(app, door, metrics)
