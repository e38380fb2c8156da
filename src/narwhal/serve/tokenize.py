"""``POST /tokenize`` and ``POST /detokenize`` through the router, as vLLM's server has them:
the client's body goes to one engine of the fleet and the engine's answer (status and body,
a 4xx included) comes back unchanged, so a client tokenizes with the fleet's own tokenizer.

Any role will do (every engine serves the same model). Engines the router's health probes
call down are skipped; among the rest, one whose breaker is closed and which is not draining
is preferred, taken in turn so the work spreads. A transport failure or a 5xx moves on to the
next engine, at most ``MAX_ATTEMPTS`` in all; with none left the router answers 503.

These requests are not journaled and not counted as requests in the metrics, like
``/v1/models``: they are not generations (no tokens produced, no engine time to account for),
and the journal's request records are one per generation. Their failures do not feed the
engines' breakers either: the breakers judge the generation legs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from narwhal.engines.lax import NOT_JSON, is_json
from narwhal.engines.transport import EngineTransportError
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import FleetState
from narwhal.serve.bodies import read_limited_body
from narwhal.serve.errors import (
    InvalidRequest,
    NoEngineAvailable,
    RouterError,
    Unauthorized,
)
from narwhal.serve.services import Services

__all__ = ["MAX_ATTEMPTS", "TOKENIZE_PATHS", "register_tokenize_routes", "tokenize_candidates"]

log = logging.getLogger("narwhal.serve")

TOKENIZE_PATHS = ("/tokenize", "/detokenize")
# Engines tried per request: a fleet-wide outage should not cost the client a full sweep.
MAX_ATTEMPTS = 3
# Per attempt. Tokenizing runs in vLLM's API server process, not its engine loop, so it does
# not queue behind generations; an engine this slow to tokenize is better skipped.
ATTEMPT_TIMEOUT_S = 30.0


def tokenize_candidates(state: FleetState, turn: int) -> list[str]:
    """Engine ids in the order to try them, starting each preference tier at ``turn``:
    first breaker closed and not draining, then draining, then breaker open or half-open (a
    failing generation leg says little about the engine's tokenizer); never an engine whose
    last health probe failed."""
    tiers: tuple[list[str], list[str], list[str]] = ([], [], [])
    for engine in state.engines.values():
        if engine.healthy is False:
            continue
        if engine.breaker.state is not BreakerState.CLOSED:
            tiers[2].append(engine.id)
        elif engine.draining_from is not None:
            tiers[1].append(engine.id)
        else:
            tiers[0].append(engine.id)
    ordered: list[str] = []
    for tier in tiers:
        if tier:
            start = turn % len(tier)
            ordered += tier[start:] + tier[:start]
    return ordered


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
        headers = {"Content-Type": "application/json"}
        failures: list[str] = []
        for engine_id in tokenize_candidates(services.state, next(turns))[:MAX_ATTEMPTS]:
            client = services.engines.client(engine_id)
            try:
                async with asyncio.timeout(ATTEMPT_TIMEOUT_S):
                    response = await client.post(path, body, headers)
                    try:
                        content = await response.read()
                    finally:
                        await response.aclose()
            except (EngineTransportError, TimeoutError) as exc:
                why = "timed out" if isinstance(exc, TimeoutError) else str(exc)
                failures.append(f"{engine_id}: {why}")
                continue
            if response.status >= 500:
                failures.append(f"{engine_id}: HTTP {response.status}")
                continue
            # vLLM answers these routes in JSON, errors included.
            return Response(content, response.status, media_type="application/json")
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
