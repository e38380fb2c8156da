"""The operator's routes, behind the admin token: ``GET /admin/state`` (fleet, roles, engines,
journal), ``POST /admin/roles/pin`` and ``POST /admin/roles/flip``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from narwhal.serve.bodies import read_limited_body
from narwhal.serve.errors import InvalidRequest, RouterError
from narwhal.serve.services import Services

__all__ = ["json_response", "register_admin_routes"]


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def register_admin_routes(app: FastAPI, services: Services) -> None:
    async def body_of(request: Request) -> Any:
        """The JSON body, None when it is not JSON; PayloadTooLarge past --max-body-bytes."""
        settings = services.settings
        raw = await read_limited_body(request, settings.max_body_bytes, settings.body_timeout_s)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None

    @app.get("/admin/state")
    async def admin_state(request: Request) -> Response:
        if (refused := services.auth.admin_refusal(_authorization(request))) is not None:
            return refused.response()
        return json_response(state_document(services))

    @app.post("/admin/roles/pin")
    async def admin_pin(request: Request) -> Response:
        if (refused := services.auth.admin_refusal(_authorization(request))) is not None:
            return refused.response()
        try:
            body = await body_of(request)
        except RouterError as exc:  # past --max-body-bytes
            return exc.response()
        pinned = body.get("pinned") if isinstance(body, dict) else None
        if not isinstance(pinned, bool):
            return InvalidRequest('expected {"pinned": true|false}', "pinned").response()
        try:
            await services.roles.set_pinned(pinned)
        except RouterError as exc:
            return exc.response()
        return json_response({"pinned": services.roles.pinned})

    @app.post("/admin/roles/flip")
    async def admin_flip(request: Request) -> Response:
        if (refused := services.auth.admin_refusal(_authorization(request))) is not None:
            return refused.response()
        try:
            body = await body_of(request)
        except RouterError as exc:  # past --max-body-bytes
            return exc.response()
        if not isinstance(body, dict) or "engine" not in body or "to" not in body:
            return InvalidRequest(
                'expected {"engine": ID, "to": "prefill"|"decode"[, "role_generation": N]}'
            ).response()
        expected = body.get("role_generation")
        if expected is not None and (type(expected) is not int or expected < 0):
            return InvalidRequest(
                "role_generation: expected the generation the flip was decided at (an integer)",
                "role_generation",
            ).response()
        try:
            entry = await services.roles.force_flip(body["engine"], body["to"], expected)
        except RouterError as exc:
            return exc.response()
        if entry is None:
            return json_response({"flipped": False, "engine": body["engine"], "role": body["to"]})
        return json_response({"flipped": True, **entry})


def _authorization(request: Request) -> str:
    return request.headers.get("authorization", "")


def state_document(services: Services) -> dict[str, Any]:
    """What ``GET /admin/state`` answers."""
    settings = services.settings
    fleet = settings.fleet.contract
    state = services.state
    journal = services.journal
    roles = services.roles
    now = services.clock.now()
    pressures = roles.pressures()
    return {
        "fleet": {
            "name": fleet.name,
            "sha256": settings.fleet.sha256,
            "profile_sha256": settings.profile_sha256,
        },
        "role_generation": state.role_generation,
        "coordination": roles.coordination_state(),
        "roles": {
            "controller": roles.controller is not None,
            "pinned": roles.pinned,
            "history": list(roles.history),
            "pressures": pressures.as_dict() if pressures is not None else None,
        },
        "draining": services.ledger.draining,
        "in_flight_requests": len(services.ledger.active),
        "journal": {
            "path": str(settings.journal_path),
            "accepting": journal.accepting,
            "healthy": journal.healthy,
            "backlog": journal.backlog,
            "last_error": journal.last_error,
        },
        "engines": [
            {
                "id": e.id,
                "url": e.url,
                "roles": list(e.roles),
                "role": e.role,
                "role_since_s": round(now - e.role_since, 3),
                "healthy": e.healthy,
                "breaker": e.breaker.state.name.lower(),
                "in_flight": {"prefill": e.in_flight_prefill, "decode": e.in_flight_decode},
                "scraped": {
                    "running": e.scraped.running,
                    "waiting": e.scraped.waiting,
                    "kv_cache_usage": e.scraped.kv_cache_usage,
                    "age_s": None if e.scraped.at is None else round(now - e.scraped.at, 3),
                },
            }
            for e in state.engines.values()
        ],
    }
