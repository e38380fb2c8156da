"""Errors the router answers with, in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["RouterError", "error_body", "error_response"]


class RouterError(Exception):
    """A request-level failure with the status, type and journal outcome it maps to."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        outcome: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.outcome = outcome
        self.param = param
        self.headers = headers or {}
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code or self.status)

    @classmethod
    def passthrough(cls, status: int, raw_body: bytes) -> RouterError:
        """An engine's own 4xx answer, handed to the client unchanged (if it is OpenAI JSON)."""
        message = f"engine refused the request (HTTP {status})"
        try:
            parsed = orjson.loads(raw_body)
            error = parsed.get("error") if isinstance(parsed, dict) else None
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                message = error["message"]
            elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
                message = parsed["message"]
        except orjson.JSONDecodeError:
            pass
        err = cls(status, message, "invalid_request_error", "client_error")
        return err

    def response(self) -> Response:
        return error_response(self.body(), self.status, self.headers)


def error_body(
    message: str, type_: str, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", "client_error", param)
