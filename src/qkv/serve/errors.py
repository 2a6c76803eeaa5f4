"""The server's one error: an HTTP status and one clear line, answered as
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
like OpenAI's API, so its clients raise their usual exceptions."""

from __future__ import annotations

from typing import Any

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
               413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
               500: "server_error", 503: "server_overloaded"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}
