"""The error every refusal of the HTTP API raises: OpenAI's error object, with its HTTP status."""

from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                              429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: Optional[str], message: str, code: str = "invalid_value") -> ApiError:
    """A 400 naming `param` (None: the body as a whole)."""
    return ApiError(400, message, param=param, code=code)
