"""The live attention explorer: the page at `/` and the endpoint it posts text to.

POST /explorer/trace {"text", "layer", "head" (both counted from 0, as transformers counts
them), "query" (the token's position counted from 1, as `qkv explain --query` and the book's
x(2) count it; null = the last token), "generate" (0..16 new tokens)} answers what
`qkv explain --json` prints for that selection: the tokens, the query's keys, scores,
weights and context (qkv.trace records only the chosen layer and query, with its
faithfulness check), the analysis (sink share, key/value groups, key norms, RoPE pairs;
positions from 1), and for each generated token its weights over the growing KV cache.
Every position in the answer counts from 1: `"query": 7` comes back as `"position": 7`.
Every head of the layer is recorded for the one query (heads x keys numbers), so the sink
share and the key/value groups compare the heads. The model runs on the engine thread,
between decode steps, so tracing never races the batch.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from qkv.errors import QkvError
from qkv.serve.engine.prompt_worker import gil_free_encoder
from qkv.serve.api.json_body import read_json_body
from qkv.serve.api.schemas import ApiError
from qkv.serve.explorer.host import ExplorerHost
from qkv.serve.explorer.page import PAGE
from qkv.serve.engine.text import display_tokens


MAX_TRACE_TOKENS = 1024
MAX_GENERATE = 16


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ApiError(400, f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    return value


class Explorer:
    def __init__(self, api: ExplorerHost) -> None:
        self.api = api
        self.html = PAGE

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.html, headers={"Content-Security-Policy":
                                                "default-src 'self'; style-src 'unsafe-inline'; "
                                                "script-src 'unsafe-inline'; connect-src 'self'"})

    async def trace(self, request: Request) -> Response:
        self.api.check_key(request)
        body = await read_json_body(request, self.api.limits.max_body_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str) or not body["text"].strip():
            raise ApiError(400, "'text' must be a non-empty string", param="text")
        layer = _int(body, "layer", 0)
        head = _int(body, "head", 0)
        query = _int(body, "query", None)
        generate = _int(body, "generate", 0) or 0
        if not 0 <= generate <= MAX_GENERATE:
            raise ApiError(400, f"'generate' must be between 0 and {MAX_GENERATE}, got {generate}", param="generate")
        text = body["text"]
        # Tokenized on a prompt worker, not the engine thread: a long text must not stall decoding.
        encode = gil_free_encoder(self.api.served.tokenizer)
        ids = await self.api.prompts.run(lambda: encode(text).ids)
        future = self.api.served.engine.call(lambda: self._record(ids, layer, head, query, generate))
        try:
            return JSONResponse(await asyncio.wrap_future(future))
        except QkvError as error:
            raise ApiError(400, str(error)) from None

    def _record(self, ids: list[int], layer: int | None, head: int | None, query: int | None,
                generate: int) -> dict[str, Any]:
        from qkv.trace import trace
        from qkv.trace.explain.analysis import analyse
        from qkv.trace.record.export import layer_summary, query_row
        from qkv.trace.record.recorder import attention_modules

        served = self.api.served
        model = served.model
        limit = min(MAX_TRACE_TOKENS, model.context_length - generate)
        if not 1 <= len(ids) <= limit:
            raise QkvError(f"the text has {len(ids)} tokens; the explorer takes 1 to {limit}")
        modules = attention_modules(model)
        layer = 0 if layer is None else layer
        if not 0 <= layer < len(modules):
            raise QkvError(f"layer {layer} is out of range: the model has {len(modules)} layers (0..{len(modules) - 1})")
        num_heads = int(getattr(modules[layer][1], "num_heads", 1))
        head = 0 if head is None else head
        if not 0 <= head < num_heads:
            raise QkvError(f"head {head} is out of range: layer {layer} has {num_heads} heads (0..{num_heads - 1})")
        position = len(ids) if query is None else query
        if not 1 <= position <= len(ids):
            raise QkvError(f"query {position} is out of range: positions count from 1 and the text has "
                           f"{len(ids)} tokens (1..{len(ids)})")
        query = position - 1  # the recorder's index, from 0
        tokens = display_tokens(served.tokenizer, ids)
        input_ids = torch.tensor([ids])
        recorded = trace(model, input_ids, layer=[layer], head=None, query=[query], tokens=tokens)
        focus = recorded.layer(layer)
        result: dict[str, Any] = {
            "model": served.name, "tokens": tokens, **query_row(focus, tokens, head, query),
            "layer_info": layer_summary(focus), "num_layers": len(modules), "num_heads": num_heads,
            "analysis": analyse(focus, head, query),
        }
        if generate:
            from qkv.trace.record.generation import trace_generation

            steps = trace_generation(model, input_ids, generate, layer=layer, head=head)
            all_tokens = tokens + display_tokens(served.tokenizer, [step.token_id for step in steps])
            result["generation"] = [
                {"token": all_tokens[step.position], "position": step.position + 1,
                 "cached_keys": step.cache_length, "key_tokens": all_tokens[: step.position + 1],
                 "weights": query_row(step.layer, all_tokens, head, 0)["weights"]}
                for step in steps
            ]
        return result
