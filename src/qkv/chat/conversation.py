"""Chat with an instruction model: its chat template, and a conversation kept in the KV cache.

A chat template (Jinja2, shipped with the model: GGUF metadata `tokenizer.chat_template`
or `chat_template` in a folder's tokenizer_config.json) turns a list of messages into the
exact text the model was fine-tuned on. It is rendered in a sandbox, as transformers does,
inside a child process with a memory limit and a deadline (qkv.chat.template_process).

`ChatSession` keeps the whole conversation's keys and values in the model's KV cache
between turns: each turn renders the conversation, checks that the text already in the
cache is its beginning, and prefills only the rest (the end of the previous reply, the new
user message, the assistant header). If the rendering ever rewrites earlier text, the
session falls back to prefilling everything, so the cache never holds text the template
would not produce.

When a conversation outgrows the context, a model with RoPE carries on with a sink cache
(qkv.attention.caches.sink_cache): the first `STREAM_SINKS` tokens plus a window of the newest,
the whole conversation prefilled into it once, and `notice` says so once. Older turns then
fall out of what the model sees, but generation goes on without error or collapse.

Shape legend: T new tokens of a turn, S cached tokens, V vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qkv.attention.caches.kv_cache import CacheKind, StaticKVCache
from qkv.attention.caches.sink_cache import SinkKVCache
from qkv.errors import QkvError
from qkv.generation import Sampling, continue_from
from qkv.runtime import DecodeSession, DecodeSetup, cache_capacity, reusable_prefix
from qkv.runtime.prompt_parts import common_prefix
from qkv.models.decoder import CausalDecoder

if TYPE_CHECKING:
    from qkv.models.loader import LoadedModel

Message = dict[str, str]

STREAM_SINKS = 4  # first tokens a streaming conversation keeps (StreamingLLM's choice)


def streaming_kind(capacity: int) -> CacheKind:
    """The sink cache a conversation of `capacity` positions streams with: 4 sinks, a window
    of the rest less one prefill part, so that sinks + window + part <= capacity positions
    are ever rotated (the model's trained range)."""
    part = max(1, min(256, capacity // 4))
    window = capacity - STREAM_SINKS - part
    if window < 1:
        raise QkvError(f"a context of {capacity} tokens is too small to stream a conversation; use a larger one")
    return SinkKVCache.kind(sinks=STREAM_SINKS, window=window, prefill_chunk=part)


class ChatTemplate:
    """A model's Jinja2 chat template, rendered like transformers' apply_chat_template, in a
    sandbox that also bounds loop iterations, recursion and output size (qkv.chat.sandbox), in a
    child process that bounds memory and time whatever the template does
    (qkv.chat.template_process)."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        from qkv.chat.template_process import TemplateProcessError, shared

        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            shared().check(source)
        except TemplateProcessError as error:
            raise _error(error) from None

    def render(self, messages: list[Message], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model's text, rendered in qkv.chat.template_process's child;
        `tools` (OpenAI function specs) goes to templates that show tools (qkv.serve.api.tools)."""
        from qkv.chat.template_process import TemplateProcessError, shared

        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        if tools is not None:
            variables["tools"] = tools
        try:
            return shared().render(self.source, variables)
        except TemplateProcessError as error:
            raise _error(error) from None


_TEMPLATE_ERRORS = {
    "parse": "the model's chat template does not parse: {}",
    "refused": "the chat template refused the conversation: {}",
    "limit": "the model's chat template went over a limit: {}",
    "memory": "the model's chat template went over its memory limit: {}",
    "time": "the model's chat template went over a limit: {}",
}


def _error(error: Exception) -> QkvError:
    kind = getattr(error, "kind", "failed")
    return QkvError(_TEMPLATE_ERRORS.get(kind, "the model's chat template failed: {}").format(error))


@dataclass
class ChatModel:
    """A model ready to chat: weights, tokenizer, template and the ids that end a reply."""

    model: CausalDecoder
    tokenizer: Any  # tokenizers.Tokenizer
    template: ChatTemplate
    stop_ids: frozenset[int]


def load_chat_model(
    path_or_name: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *, max_memory: int | None = None
) -> ChatModel:
    """`smollm2`, a GGUF file, or a checkpoint folder with a chat template -> ChatModel,
    through the one loader (qkv.models.loader)."""
    from qkv.models.loader import load

    return chat_model_from(load(path_or_name, dtype, max_memory=max_memory, chat=True))


def chat_model_from(loaded: LoadedModel) -> ChatModel:
    """A ChatModel from what the loader gave (loaded with chat=True: it has a template)."""
    found = loaded.chat_template
    assert found is not None  # load(chat=True) refuses a model without one
    template = ChatTemplate(found.source, bos_token=found.bos_token, eos_token=found.eos_token)
    model, tokenizer = loaded.model, loaded.tokenizer
    stop = set(model.eos_token_ids)
    if template.eos_token is not None and tokenizer.token_to_id(template.eos_token) is not None:
        stop.add(tokenizer.token_to_id(template.eos_token))
    if not stop:
        raise QkvError(f"{loaded.path}: no end-of-turn token is known, so a reply could never end")
    return ChatModel(model, tokenizer, template, frozenset(stop))


@dataclass(frozen=True)
class ReplySettings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


class ChatSession:
    """A multi-turn conversation whose history stays in the model's KV cache.

    `send(text)` yields the reply's token ids as they are made; when the caller stops
    early (or the reply ends) the reply so far becomes the assistant's message. The cache
    lives in one `DecodeSession`, sized to the conversation (rounded up) and enlarged,
    by prefilling the conversation again, when a turn needs more room.
    """

    def __init__(
        self,
        chat: ChatModel,
        *,
        system: str | None = None,
        max_context: int | None = None,
        seed: int | None = None,
        notice: Callable[[str], object] | None = None,
        kind: CacheKind = StaticKVCache,
        setup: DecodeSetup | None = None,
        session_type: Callable[..., DecodeSession] = DecodeSession,
    ) -> None:
        self.chat = chat
        self.setup = setup  # how the model was prepared (qkv.runtime.prepare): its sessions step as prepared
        self.session_type = session_type  # tensor parallel: sessions that share each step with the other ranks
        self.notice = notice  # told once when the conversation starts streaming
        self.kind = kind  # the cache kind asked for (qkv chat --kv-cache)
        # A kind that evicts old tokens streams from the first turn, and says nothing.
        self.streams_by_choice = chat.model.streams_past_context(kind)
        self.streaming = False
        self.system = system
        self.capacity = min(max_context or chat.model.context_length, chat.model.context_length)
        self.generator = Sampling(seed=seed).generator()
        self.session: DecodeSession | None = None
        self.messages: list[Message] = []
        self.cached_ids: list[int] = []  # tokens whose keys/values are in the cache, in order
        self.last_prefill = 0  # how many tokens the latest turn ran through prefill
        self.whole_parts = 0  # leading cached positions written by whole prefill parts (reusable)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.cached_ids = []
        self.whole_parts = 0
        if self.streaming and not self.streams_by_choice:  # a new conversation fits again
            self.close()
            self.streaming = False
        if self.session is not None:
            self.session.reset()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    @property
    def cached_text(self) -> str:
        return self.chat.tokenizer.decode(self.cached_ids, skip_special_tokens=False)

    def _new_ids(self, rendered: str) -> list[int]:
        """Tokens of the part of `rendered` that the cache does not hold yet (and keeps).

        The cache keeps the whole prefill parts of the conversation's tokens that the new
        rendering starts with (qkv.runtime.reusable_prefix): the rest is prefilled as a
        server prefills the whole conversation, so a turn's reply is what `qkv serve` gives
        the same messages. A sink cache (past the context) keeps everything it holds."""
        encode = self.chat.tokenizer.encode
        if self.streaming or self.streams_by_choice:
            cached = self.cached_text
            if self.cached_ids and rendered.startswith(cached):
                return encode(rendered[len(cached):], add_special_tokens=False).ids
            self.cached_ids = []  # the template rewrote earlier text: start over
            return encode(rendered, add_special_tokens=False).ids
        full = encode(rendered, add_special_tokens=False).ids
        keep = reusable_prefix(len(full), min(common_prefix(self.cached_ids, full), self.whole_parts))
        self.cached_ids = self.cached_ids[:keep]
        return full[keep:]

    def _session_for(self, needed: int) -> DecodeSession:
        """The open session, with room for `needed` positions (a larger one, holding
        nothing yet, when the current one is too small)."""
        if self.session is not None and self.session.capacity >= needed:
            return self.session
        self.close()
        self.cached_ids = []
        if self.streams_by_choice:
            return self._open_streaming(self.kind)
        capacity = cache_capacity(needed, self.capacity)
        self.session = self.session_type(self.chat.model, capacity=capacity, kind=self.kind,
                                         setup=self.setup).__enter__()
        return self.session

    def _open_streaming(self, kind: CacheKind) -> DecodeSession:
        """A session with a sink cache of `kind`, empty: the whole conversation goes in next."""
        self.close()
        self.cached_ids = []
        self.session = self.session_type(self.chat.model, capacity=self.capacity, kind=kind,
                                         setup=self.setup).__enter__()
        self.streaming = True
        return self.session

    def _start_streaming(self, kind: CacheKind) -> None:
        """Go on in a sink cache when the conversation outgrew the context, and say so."""
        self._open_streaming(kind)
        if self.notice is not None:
            self.notice(f"the conversation outgrew the {self.capacity}-token context: going on with the first "
                        f"{STREAM_SINKS} tokens and a window of the most recent ones (a sink cache); "
                        "older turns fall out of view, /reset starts over")

    def send(self, text: str, sampling: ReplySettings = ReplySettings()) -> Iterator[int]:
        """Add the user's message, prefill its new tokens now, and return an iterator over
        the reply's token ids (made as it is consumed)."""
        if sampling.max_new_tokens < 1:
            raise QkvError(f"max_new_tokens must be at least 1, got {sampling.max_new_tokens}")
        choice = Sampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        messages = [*self.messages, {"role": "user", "content": text}]
        rendered = self.chat.template.render(messages, add_generation_prompt=True)
        new_ids = self._new_ids(rendered)
        needed = len(self.cached_ids) + len(new_ids) + sampling.max_new_tokens
        if needed > self.capacity and not self.streaming and not self.streams_by_choice:
            kind = streaming_kind(self.capacity)
            if not self.chat.model.streams_past_context(kind):
                raise QkvError(
                    f"the conversation needs {needed} tokens ({len(self.cached_ids)} cached, {len(new_ids)} new, "
                    f"{sampling.max_new_tokens} for the reply) but the context holds {self.capacity}; "
                    "/reset to start over")
            self._start_streaming(kind)
        session = self.session if self.streaming and self.session is not None else self._session_for(needed)
        if not self.cached_ids:  # a new or enlarged cache: the whole conversation goes in
            new_ids = self.chat.tokenizer.encode(rendered, add_special_tokens=False).ids
        try:
            session.truncate(len(self.cached_ids))
        except NotImplementedError:  # a quantized cache cannot rewind that far: start it over
            session.reset()
            self.cached_ids = []
            new_ids = self.chat.tokenizer.encode(rendered, add_special_tokens=False).ids
        self.messages = messages
        logits = session.prefill(torch.tensor([new_ids]))  # (1, V)
        self.cached_ids.extend(new_ids)
        self.whole_parts = reusable_prefix(len(self.cached_ids) + 1, len(self.cached_ids))  # prefilled whole parts
        self.last_prefill = len(new_ids)
        return self._reply(session, logits, sampling, choice)

    def _reply(self, session: DecodeSession, logits: torch.Tensor, sampling: ReplySettings,
               choice: Sampling) -> Iterator[int]:
        reply: list[int] = []
        steps = continue_from(session, logits, sampling.max_new_tokens, sampling=choice,
                              stop=tuple(self.chat.stop_ids), generator=self.generator)
        try:
            for new in steps:
                token = int(new[0])
                if reply:
                    self.cached_ids.append(reply[-1])  # decoded into the cache to make this one
                if token in self.chat.stop_ids:
                    break
                reply.append(token)
                yield token
        finally:
            steps.close()
            content = self.chat.tokenizer.decode(reply, skip_special_tokens=False)
            self.messages.append({"role": "assistant", "content": content})

    def reply(self, text: str, sampling: ReplySettings = ReplySettings()) -> str:
        """The whole reply to `text` as a string."""
        ids = list(self.send(text, sampling))
        return self.chat.tokenizer.decode(ids, skip_special_tokens=False)
