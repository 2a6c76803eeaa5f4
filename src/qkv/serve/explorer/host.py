"""What the explorer needs of the server it runs in, as a small interface (the HTTP app's `Api`
is one): what is served, the request limits, the prompt workers and the API key check.
"""

from __future__ import annotations

from typing import Protocol

from starlette.requests import Request

from qkv.serve.api.schemas import Limits
from qkv.serve.engine.prompt_worker import PromptWorker
from qkv.serve.engine.served import Served


class ExplorerHost(Protocol):
    served: Served
    limits: Limits
    prompts: PromptWorker

    def check_key(self, request: Request) -> None:
        """Refuse a request without the server's API key (401), when it has one."""
