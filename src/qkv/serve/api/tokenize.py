"""The tokenizer over HTTP, in vLLM's shapes, so that clients that count tokens themselves
(lm-evaluation-harness's `tokenizer_backend=remote`) need no copy of the tokenizer:

    POST /tokenize    {"prompt": str, "add_special_tokens": bool = true}
                      -> {"tokens": [int], "count": int, "max_model_len": int}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length"}
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
        body = _fields(await self.api.read_body(request), {"model", "prompt", "add_special_tokens"})
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            raise ApiError(422, "'prompt' must be a string and 'add_special_tokens' a boolean", param="prompt")
        encode = gil_free_encoder(self.api.served.tokenizer)  # on a prompt worker: the event loop goes on
        ids = (await self.api.prompts.run(lambda: encode(prompt, add_special_tokens=special))).ids
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.api.served.engine.capacity})

    async def detokenize(self, request: Request) -> Response:
        body = _fields(await self.api.read_body(request), {"model", "tokens"})
        tokens = body.get("tokens")
        vocab = self.api.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ApiError(422, f"'tokens' must be a list of token ids in 0..{vocab - 1}", param="tokens")
        return JSONResponse({"prompt": self.api.served.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def info(self, request: Request) -> Response:
        self.api.check_key(request)
        served, tokenizer = self.api.served, self.api.served.tokenizer
        template = served.template
        eos = next((tokenizer.id_to_token(t) for t in sorted(served.stop_ids)), None)
        bos = getattr(template, "bos_token", None) or None
        return JSONResponse({"tokenizer_class": "qkv", "eos_token": eos, "bos_token": bos, "pad_token": None,
                             "chat_template": None if template is None else template.source,
                             "model_max_length": served.engine.capacity})
