"""The tokenizer over HTTP, in vLLM's shapes, so that clients that count tokens themselves
(lm-evaluation-harness's `tokenizer_backend=remote`) need no copy of the tokenizer:
a chat is counted as vLLM counts it (its `messages` rendered with the chat template as
/v1/chat/completions renders them, the generation prompt added by default), so a client
can tell how many tokens a conversation leaves for the reply. `max_model_len` is the
server's limit per request (--context, at most the model's context length).

    POST /tokenize    {"prompt": str, "add_special_tokens": bool = true}
                      or {"messages": [...], "add_generation_prompt": bool = true,
                          "add_special_tokens": bool = false}
                      -> {"tokens": [int], "count": int, "max_model_len": int}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length"}
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qkv.errors import QkvError
from qkv.serve.errors import ApiError
from qkv.serve.engine.prompt_worker import gil_free_encoder


def _fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise ApiError(400, f"'{name}' is not supported here; send {', '.join(sorted(allowed))}", param=name)
    return body


class TokenizerRoutes:
    def __init__(self, api: Any) -> None:
        self.api = api  # qkv.serve.http.app.Api: the served model, the key check and the body reader

    def routes(self) -> list[tuple[str, Any, list[str]]]:
        return [("/tokenize", self.tokenize, ["POST"]), ("/detokenize", self.detokenize, ["POST"]),
                ("/tokenizer_info", self.info, ["GET"])]

    async def tokenize(self, request: Request) -> Response:
        raw = await self.api.read_body(request)
        if isinstance(raw, dict) and "messages" in raw:
            return await self._tokenize_chat(raw)
        body = _fields(raw, {"model", "prompt", "messages", "add_special_tokens"})
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            raise ApiError(400, "'prompt' must be a string and 'add_special_tokens' a boolean", param="prompt")
        encode = gil_free_encoder(self.api.served.tokenizer)  # on a prompt worker: the event loop goes on
        ids = (await self.api.prompts.run(lambda: encode(prompt, add_special_tokens=special))).ids
        return self._counted(ids)

    async def _tokenize_chat(self, raw: dict[str, Any]) -> Response:
        """vLLM's chat form: the messages rendered by the chat template, then encoded (without
        special tokens by default: the template writes them, as the chat route encodes it)."""
        from qkv.serve.api.messages import parse_messages
        from qkv.serve.api.tools import render_messages, template_format

        if "prompt" in raw:
            raise ApiError(400, "send 'prompt' or 'messages', not both", param="messages")
        body = _fields(raw, {"model", "messages", "add_generation_prompt", "add_special_tokens"})
        generation, special = body.get("add_generation_prompt", True), body.get("add_special_tokens", False)
        if not isinstance(generation, bool) or not isinstance(special, bool):
            raise ApiError(400, "'add_generation_prompt' and 'add_special_tokens' must be booleans",
                           param="add_generation_prompt" if not isinstance(generation, bool) else "add_special_tokens")
        template = self.api.served.template
        if template is None:
            raise ApiError(400, f"the model '{self.api.served.name}' has no chat template; send 'prompt'",
                           param="messages")
        messages = parse_messages(body["messages"])
        encode = gil_free_encoder(self.api.served.tokenizer)

        def ids() -> list[int]:
            try:
                shown, _ = render_messages(messages, None, template_format(template.source))  # as the chat route
                text = template.render(shown, add_generation_prompt=generation)
            except QkvError as error:
                raise ApiError(400, str(error), param="messages") from None
            return encode(text, add_special_tokens=special).ids

        return self._counted(await self.api.prompts.run(ids))  # rendered and encoded off the event loop

    def _counted(self, ids: list[int]) -> Response:
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.api.served.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        body = _fields(await self.api.read_body(request), {"model", "tokens"})
        tokens = body.get("tokens")
        vocab = self.api.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ApiError(400, f"'tokens' must be a list of token ids in 0..{vocab - 1}", param="tokens")
        return JSONResponse({"prompt": self.api.served.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def info(self, request: Request) -> Response:
        self.api.check_key(request)
        served, tokenizer = self.api.served, self.api.served.tokenizer
        template = served.template
        eos = next((tokenizer.id_to_token(t) for t in sorted(served.stop_ids)), None)
        bos = getattr(template, "bos_token", None) or None
        return JSONResponse({"tokenizer_class": "qkv", "eos_token": eos, "bos_token": bos, "pad_token": None,
                             "chat_template": None if template is None else template.source,
                             "model_max_length": served.max_model_len})
