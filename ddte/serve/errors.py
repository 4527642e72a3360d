"""How a request is refused: :class:`RequestError` (the message, the offending field, the HTTP status) and OpenAI's
error object it is answered with."""

from __future__ import annotations

ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class RequestError(ValueError):
    """A request ddte will not serve: the message, the offending field, and the HTTP status (400 by default)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}
