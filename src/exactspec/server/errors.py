"""The server's one error type: :class:`ServerError`, answered with OpenAI's error body."""

from __future__ import annotations


class ServerError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: the HTTP status (400 bad request, 401, 404 unknown model, 413, 503 busy).
        message: what is wrong, naming the value and what is allowed.
        param: the request field at fault, if one is.
        headers: extra response headers (``WWW-Authenticate``, ``Retry-After``).
    """

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` as OpenAI answers."""
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}
