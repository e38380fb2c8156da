"""The errors the router answers with, in OpenAI's shape ``{"error": {message, type, param,
code}}``, each with its HTTP status and the outcome its journal record carries.

::

    RouterError
    ├── ClientError                 outcome client_error
    │   ├── InvalidRequest          400 invalid_request_error
    │   ├── Unauthorized            401 authentication_error (WWW-Authenticate: Bearer)
    │   ├── Forbidden               403 permission_error
    │   ├── NotFound                404 not_found_error
    │   ├── Conflict                409 conflict
    │   ├── PayloadTooLarge         413 invalid_request_error
    │   └── EngineRefused           the engine's own 4xx, its message passed through; an
    │                                   engine's 401/403 (the router's engine key) is a 502
    │                                   upstream_error, outcome internal_error
    ├── AdmissionRejected           429 rate_limit_exceeded, outcome rejected (Retry-After)
    ├── NotAccepting                503 service_unavailable, outcome rejected (Retry-After)
    ├── NoEligiblePair              503 service_unavailable, outcome unavailable (Retry-After)
    ├── NoEngineAvailable           503 service_unavailable, outcome unavailable (Retry-After):
    │                                   no engine answered /tokenize or /detokenize
    ├── UpstreamFailed              502 upstream_error, outcome prefill_failed / decode_failed
    │                                   / stream_error
    ├── FirstTokenDeadlineExceeded  504 timeout, outcome deadline_exceeded
    └── InternalError               500 internal_error, outcome internal_error
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import orjson
from starlette.responses import Response

__all__ = [
    "AdmissionRejected",
    "BodyTimeout",
    "ClientClosedRequest",
    "ClientError",
    "Conflict",
    "EngineRefused",
    "FirstTokenDeadlineExceeded",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "NoEligiblePair",
    "NoEngineAvailable",
    "NotAccepting",
    "NotFound",
    "PayloadTooLarge",
    "RouterError",
    "Unauthorized",
    "UpstreamFailed",
    "error_body",
    "with_detail",
]


class RouterError(Exception):
    """A request-level failure: its status, OpenAI error type and journal outcome."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    outcome: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code or self.status)

    @property
    def journal_error(self) -> str:
        """The request's journaled error: what its client was told (and, for an upstream
        failure, what it was not)."""
        return self.message

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


class ClientError(RouterError):
    outcome = "client_error"


class InvalidRequest(ClientError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ClientError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str = "invalid or missing API key") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ClientError):
    status = 403
    type = "permission_error"


class NotFound(ClientError):
    status = 404
    type = "not_found_error"


class Conflict(ClientError):
    status = 409
    type = "conflict"


class PayloadTooLarge(ClientError):
    status = 413
    type = "invalid_request_error"


class BodyTimeout(ClientError):
    """The request's body did not arrive within --body-timeout: the connection is closed, so
    a client that stalls mid-body holds no request slot (nor a drain) for longer."""

    status = 408
    type = "invalid_request_error"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request body did not arrive within {timeout_s:g} s",
            headers={"Connection": "close"},
        )


class ClientClosedRequest(ClientError):
    """The client hung up while its request body arrived: nobody reads the answer (499, as
    proxies log it), and the route ends quietly instead of raising out of the framework."""

    status = 499
    type = "invalid_request_error"
    outcome = "client_abort"

    def __init__(self) -> None:
        super().__init__("the client closed the connection before its request body arrived")


class EngineRefused(ClientError):
    """An engine's own 4xx answer: the client's error, handed on with the engine's message."""

    type = "invalid_request_error"

    def __init__(self, status: int, raw_body: bytes) -> None:
        message = f"engine refused the request (HTTP {status})"
        param: str | None = None
        try:
            parsed = orjson.loads(raw_body)
            error = parsed.get("error") if isinstance(parsed, dict) else None
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                message = error["message"]
                # The field vLLM names (``logprobs``, ``max_tokens``...): SDKs show it.
                if isinstance(error.get("param"), str):
                    param = error["param"]
            elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
                message = parsed["message"]
            elif isinstance(error, str):
                message = f"engine answered HTTP {status}: {error}"  # vLLM's 401 body
        except orjson.JSONDecodeError:
            pass
        if status in (401, 403):
            # The client's credentials never reach an engine (the router sends the fleet's
            # engine key, or none), so an engine refusing them is the deployment's fault, not
            # the client's: a 502 that says what to fix, recorded as the router's error.
            super().__init__(
                f"the engine refused the router's credentials ({message}): "
                "engine.api_key_file in the fleet file must name a file holding the engines' "
                "--api-key",
                code="engine_unauthorized",
            )
            self.status = 502  # type: ignore[misc]
            self.type = "upstream_error"  # type: ignore[misc]
            self.outcome = "internal_error"  # type: ignore[misc]
            return
        super().__init__(message, param)
        self.status = status  # type: ignore[misc]  # the engine's, per instance


class AdmissionRejected(RouterError):
    status = 429
    type = "rate_limit_exceeded"
    outcome = "rejected"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(
            f"request rejected by admission control: {message}",
            code=reason,
            headers={"Retry-After": "1"},
        )


class NotAccepting(RouterError):
    """The router takes no requests now (it is shutting down, its journal cannot record)."""

    status = 503
    type = "service_unavailable"
    outcome = "rejected"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class NoEligiblePair(RouterError):
    status = 503
    type = "service_unavailable"
    outcome = "unavailable"

    def __init__(self, reason: str) -> None:
        super().__init__(f"no engine pair can serve: {reason}", headers={"Retry-After": "1"})


class NoEngineAvailable(RouterError):
    """No engine could answer a request that any one engine can serve (/tokenize)."""

    status = 503
    type = "service_unavailable"
    outcome = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class CoordinationUnavailable(RouterError):
    """Roles cannot change now: the replicas' coordination service (etcd) is unreachable."""

    status = 503
    type = "service_unavailable"
    outcome = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(
            f"roles cannot change while etcd is unreachable ({message}); requests are still "
            "served with the roles last seen",
            headers={"Retry-After": "1"},
        )


class UpstreamFailed(RouterError):
    status = 502
    type = "upstream_error"

    def __init__(
        self,
        outcome: Literal["prefill_failed", "decode_failed", "stream_error"],
        message: str,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome = outcome  # type: ignore[misc]  # which leg failed, per instance
        # For the journal only: what the client is not told (a transport error's text names
        # the engine's address).
        self.detail = detail

    @property
    def journal_error(self) -> str:
        return with_detail(self.message, self.detail)


class FirstTokenDeadlineExceeded(RouterError):
    status = 504
    type = "timeout"
    outcome = "deadline_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="first_token_deadline_exceeded")


class InternalError(RouterError):
    def __init__(self, message: str = "internal router error") -> None:
        super().__init__(message)


def with_detail(told: str, detail: str | None) -> str:
    """A journaled error: what the client was told, then in brackets what it was not (a
    transport error's text, which names the engine's address), unless it says nothing more."""
    return told if detail is None or detail in told else f"{told} ({detail})"


def error_body(
    message: str, type_: str, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
