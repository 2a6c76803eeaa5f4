"""One response in OpenAI's shapes: its choices as the engine's events arrive, whole or as
stream chunks, with logprobs where they were asked for.

A `Choice` follows one engine job: its text (stop strings cut, `TextStream`), and, with
logprobs, one entry per token, handed out with the piece of text that holds the token's
first character (a token held back with a possible stop string waits with it; one cut
off by a stop string is dropped). End tokens are no part of the text; completions list
them in logprobs (as lm-evaluation-harness counts on: one entry per token generated),
chat does not. Completions with echo start with the prompt: its text, and with logprobs
its tokens, the first with a null logprob (it has no context). `text_offset` counts
characters from the prompt's start either way, as OpenAI's API does (vLLM counts a
completion without echo from 0).

A chat choice whose request offers tools (qkv.serve.api.structured's `Plan`) may be a tool
call: its text is read whole, then answered as content or `tool_calls` (finish_reason
"tool_calls"); streamed, it is sent once it has ended, as OpenAI's deltas (content, then per
call its index, id, type and name, then its arguments).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from qkv.generation.detokenize import TextStream
from qkv.generation.decode_loop import Alternatives
from qkv.serve.engine.jobs import Finished, PromptScores, Token
from qkv.serve.errors import ApiError
from qkv.serve.api.schemas import CompletionRequest
from qkv.serve.api.structured import Plan
from qkv.serve.api.tokens import TokenTexts


@dataclass
class _Entry:
    token: int
    logprob: float | None
    top: Alternatives | None  # None: no alternatives (the first prompt token)
    start: int  # offset in the choice's text


class Choice:
    def __init__(self, req: CompletionRequest, chat: bool, texts: TokenTexts, prompt: list[int],
                 prompt_text: str, plan: Plan | None = None) -> None:
        self.req, self.chat, self.texts = req, chat, texts
        self.plan = plan or Plan()  # response_format / tools (qkv.serve.api.structured)
        self._whole_sent = False
        self.stream = TextStream(texts.tokenizer, req.stop)
        self.prefix = prompt_text if req.echo else ""  # text before the generated part
        # text_offset counts from the prompt's start, echoed or not, as OpenAI's completions do
        # (its first generated token's offset is the prompt's length in characters).
        self.offset = len(prompt_text)
        self.prompt = prompt
        self.index = 0
        self.finish: str | None = None
        self.error = ""
        self.error_status = 500  # 400 when the request's own grammar failed (grammar_failure)
        self.tokens = 0  # tokens generated (end tokens not counted)
        self.logprob_sum, self.logprob_count = 0.0, 0
        self.entries: list[_Entry] = []  # handed out (or ready to be)
        self._pending: list[_Entry] = []  # waiting for their text
        self._out = 0  # entries already put in a stream chunk
        self._text_out = 0  # characters of the text already in a chunk
        self.pieces: list[str] = [self.prefix] if self.prefix else []

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def score(self) -> float:
        """Mean logprob per token: how best_of ranks candidates."""
        return self.logprob_sum / self.logprob_count if self.logprob_count else 0.0

    def take(self, event: Token | PromptScores | Finished) -> None:
        if isinstance(event, PromptScores):
            if self.req.logprobs is not None:
                starts = self.texts.starts(self.prompt, skip_special=False)
                self.entries += [_Entry(t, lp, None if lp is None else top, s)
                                 for t, lp, top, s in zip(self.prompt, event.logprobs, event.top, starts)]
            return
        if isinstance(event, Finished):
            self.finish = {"length": "length", "error": "error", "grammar": "error"}.get(event.reason, "stop")
            self.error = event.message
            if event.reason == "grammar":
                failure = grammar_failure(event.message)
                self.error, self.error_status = failure.message, failure.status
            self._add(self.stream.flush())
            if self.stream.stopped and self.finish == "length":  # the held-back text completed a stop string
                self.finish = "stop"
            end = self.offset + self.stream.text_length
            self.entries += [e for e in self._pending if not self.stream.stopped or e.start < end]
            self._pending = []
            return
        if event.logprob is not None:
            self.logprob_sum += event.logprob
            self.logprob_count += 1
        if self.finish is not None or self.stream.stopped:
            return
        if event.stop:
            if self.req.logprobs is not None and not self.chat:
                start = self.offset + self.stream.text_length
                self._pending.append(_Entry(event.id, event.logprob, event.top, start))
            return
        self.tokens += 1
        if self.req.logprobs is not None:
            start = self.offset + self.stream.decoded_length  # the text of the tokens before this one
            self._pending.append(_Entry(event.id, event.logprob, event.top, start))
        self._add(self.stream.push(event.id))
        if self.stream.stopped:
            self.finish = "stop"
            end = self.offset + self.stream.text_length
            self.entries += [e for e in self._pending if e.start < end]
            self._pending = []
            return
        sent = self.offset + self.stream.sent
        held = self.stream.text_length > self.stream.sent
        while self._pending and (self._pending[0].start < sent or not held):
            self.entries.append(self._pending.pop(0))

    def failure(self) -> ApiError:
        """This choice's failed generation as the API's error (400: its grammar; 500: the step)."""
        if self.error_status == 400:
            return ApiError(400, self.error, code="structure_not_followed")
        return ApiError(500, f"generation failed: {self.error}")

    def _add(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)

    # -- OpenAI shapes ---------------------------------------------------------------
    def _alternative(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.texts.text(token), "logprob": logprob, "bytes": self.texts.bytes(token)}

    def logprobs(self, entries: list[_Entry]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {"content": [{**self._alternative(e.token, e.logprob or 0.0),
                                 "top_logprobs": [self._alternative(t, lp) for t, lp in e.top or ()]}
                                for e in entries], "refusal": None}
        top: list[dict[str, float] | None] = []
        for e in entries:
            if e.top is None:
                top.append(None)
                continue
            best: dict[str, float] = {}
            for t, lp in (*e.top, (e.token, e.logprob)):
                key = self.texts.text(t)
                best[key] = max(lp, best.get(key, -float("inf")))  # type: ignore[arg-type]
            top.append(best)
        return {"tokens": [self.texts.text(e.token) for e in entries],
                "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": [e.start for e in entries]}

    def whole(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        finish = self.finish
        if self.chat:
            choice["message"], finish = self.plan.message(self.text, self.finish)  # content, or tool_calls
        else:
            choice["text"] = self.text
        return {**choice, "logprobs": self.logprobs(self.entries), "finish_reason": finish}

    def chunks(self, first: bool) -> Iterator[dict[str, Any]]:
        """What this choice adds to the stream since the last call: a chunk for the new
        text (and its logprobs), then one with finish_reason once it has ended."""
        if self.chat and self.plan.buffers:
            yield from self._whole_chunks(first)
            return
        text = self.text[self._text_out:]
        entries = self.entries[self._out:]
        self._text_out, self._out = len(self.text), len(self.entries)
        if text or entries or first:
            yield self._chunk(text, entries, None, first)
        if self.finish is not None and self.finish != "error":
            yield self._chunk(None, [], self.finish, False)

    def _whole_chunks(self, first: bool) -> Iterator[dict[str, Any]]:
        """A reply that may be a tool call, sent once complete: its content, then each call
        in OpenAI's delta shape (index, id, type and name first; then the arguments)."""
        if first:
            yield self._chunk("", [], None, True)
        if self.finish is None or self._whole_sent:
            return
        self._whole_sent = True
        message, finish = self.plan.message(self.text, self.finish)
        if message.get("content"):
            yield self._chunk(message["content"], self.entries, None, False)
        for i, call in enumerate(message.get("tool_calls") or []):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            for part in (head, {"index": i, "function": {"arguments": call["function"]["arguments"]}}):
                chunk = self._chunk(None, [], None, False)
                chunk["delta"]["tool_calls"] = [part]
                yield chunk
        if finish != "error":
            yield self._chunk(None, [], finish, False)

    def _chunk(self, text: str | None, entries: list[_Entry], finish: str | None, first: bool) -> dict[str, Any]:
        logprobs = self.logprobs(entries) if entries else None
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


@dataclass
class Answer:
    req: CompletionRequest
    chat: bool
    model: str
    prompt_tokens: int
    choices: list[Choice] = field(default_factory=list)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def usage(self) -> dict[str, int]:
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.finish == "error"), None)

    def failure(self) -> ApiError | None:
        """What a request whose generation failed is answered: the first failed choice's error."""
        return next((c.failure() for c in self.choices if c.finish == "error"), None)

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind,
                "created": self.created, "model": self.model}

    def best(self) -> list[Choice]:
        """The choices returned: per prompt, the n of best_of candidates of highest mean logprob."""
        per_prompt = self.req.best_of
        kept: list[Choice] = []
        for p in range(0, len(self.choices), per_prompt):
            group = self.choices[p : p + per_prompt]
            if per_prompt > self.req.n:
                group = sorted(group, key=lambda c: c.score, reverse=True)[: self.req.n]
            kept += group
        for i, choice in enumerate(kept):
            choice.index = i
        return kept

    def whole(self) -> dict[str, Any]:
        usage = self.usage  # every candidate generated counts, as OpenAI bills best_of
        return {**self.head(False), "choices": [c.whole() for c in self.best()], "usage": usage}

    def event(self, body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"

    def chunk_events(self, choice: Choice, first: bool) -> Iterator[str]:
        for part in choice.chunks(first):
            body = {**self.head(True), "choices": [part]}
            if self.req.include_usage:
                body["usage"] = None
            yield self.event(body)
        if choice.finish == "error":
            yield self.event(choice.failure().body())

    def closing_events(self) -> Iterator[str]:
        if self.req.include_usage:
            yield self.event({**self.head(True), "choices": [], "usage": self.usage})
        yield "data: [DONE]\n\n"


def grammar_failure(message: str) -> ApiError:
    """A request whose grammar (response_format or tools) admitted no next token mid-answer: the
    structure it asked for cannot be written by this model within its bounds, a 400 that says so."""
    return ApiError(400, f"the requested structure (response_format or tools) could not be followed: {message}; "
                         "simplify the schema or loosen its bounds", code="structure_not_followed")
