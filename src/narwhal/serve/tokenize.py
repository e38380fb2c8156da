"""``POST /tokenize`` and ``POST /detokenize`` through the router, as vLLM's server has them:
the client's body goes to one engine of the fleet and the engine's answer (status and body,
a 4xx included) comes back unchanged, so a client tokenizes with the fleet's own tokenizer.

Which engine answers, and the moving on past one that fails: ``serve.tokenizer_calls``; with
none left the router answers 503.

These requests are not journaled and not counted as requests in the metrics, like
``/v1/models``: they are not generations (no tokens produced, no engine time to account for),
and the journal's request records are one per generation. Their failures do not feed the
engines' breakers either: the breakers judge the generation legs.
"""

from __future__ import annotations

import itertools
import logging

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from narwhal.engines.lax import NOT_JSON, is_json
from narwhal.serve.bodies import read_limited_body
from narwhal.serve.errors import (
    InvalidRequest,
    NoEngineAvailable,
    RouterError,
    Unauthorized,
)
from narwhal.serve.services import Services
from narwhal.serve.tokenizer_calls import ask_tokenizer

__all__ = ["TOKENIZE_PATHS", "register_tokenize_routes"]

log = logging.getLogger("narwhal.serve")

TOKENIZE_PATHS = ("/tokenize", "/detokenize")


def register_tokenize_routes(app: FastAPI, services: Services) -> None:
    turns = itertools.count()

    async def passthrough(request: Request, path: str) -> Response:
        if not services.auth.client_allowed(request.headers.get("authorization", "")):
            return Unauthorized().response()
        try:
            settings = services.settings
            body = await read_limited_body(
                request, settings.max_body_bytes, settings.body_timeout_s
            )
            if not is_json(request.headers.get("content-type")):
                raise InvalidRequest(NOT_JSON)
        except RouterError as exc:
            return exc.response()
        # No client X-Request-Id goes to an engine (docs/security.md): the engine names it.
        answer, failures = await ask_tokenizer(
            services.engines, services.state, path, body, next(turns)
        )
        if answer is not None:
            # vLLM answers these routes in JSON, errors included.
            return Response(answer[1], answer[0], media_type="application/json")
        if failures:
            log.warning("%s failed on every engine tried: %s", path, "; ".join(failures))
            return NoEngineAvailable(f"{path} failed on every engine tried").response()
        return NoEngineAvailable("no healthy engine").response()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough(request, "/detokenize")
