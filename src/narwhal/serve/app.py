"""The narwhal-serve ASGI application: wiring only. The parts are built by ``Services``; the
routes live with what they serve (``generation``, ``admin``) or here when they only read state
(models, health, readiness, metrics)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from narwhal import __version__
from narwhal.asgi import register_hot_route
from narwhal.serve.admin import json_response, register_admin_routes
from narwhal.serve.errors import NotFound, Unauthorized, error_body
from narwhal.serve.generation import GenerationEndpoint
from narwhal.serve.responses import ResponsesEndpoint
from narwhal.serve.services import Services
from narwhal.serve.settings import ServeSettings
from narwhal.serve.tokenize import register_tokenize_routes

__all__ = ["build_app"]


def build_app(settings: ServeSettings) -> FastAPI:
    """The application, with every part built (``app.state.services``); serving starts with
    its lifespan."""
    services = Services.open(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await services.start()
        try:
            yield
        finally:
            await services.stop()

    app = FastAPI(
        title="narwhal-serve",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        # A path with a stray slash is an unknown path (an OpenAI-shaped 404), not a redirect
        # built from the client's Host header, which the openai SDK would follow with the
        # prompt to wherever that header points.
        redirect_slashes=False,
    )
    app.state.services = services
    # The generation routes are the hot path: narwhal.asgi.HotRouteDispatch serves them ahead
    # of the framework's middleware; their declaration here is their one registration.
    register_hot_route(app, "/v1/completions", GenerationEndpoint(services, chat=False))
    register_hot_route(app, "/v1/chat/completions", GenerationEndpoint(services, chat=True))
    register_hot_route(app, "/v1/responses", ResponsesEndpoint(GenerationEndpoint(services, True)))
    # Errors the framework answers itself (an unknown path, a method a route does not take)
    # in the OpenAI error shape every other error of the router has.
    app.add_exception_handler(StarletteHTTPException, _framework_error)
    _register_info_routes(app, services)
    register_tokenize_routes(app, services)
    register_admin_routes(app, services)
    return app


# (method, what follows the id) of the Responses API's operations on a stored response.
_STORED_RESPONSE_OPERATIONS = frozenset(
    {("GET", ""), ("DELETE", ""), ("POST", "cancel"), ("GET", "input_items")}
)


async def _framework_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    where = f"{request.method} {request.url.path}"
    if status == 404:
        message = f"Invalid URL ({where}): no such route"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow", "none")
        message = f"Method not allowed ({where}): this route takes {allowed}"
    else:
        message = f"{exc.detail} ({where})"
    type_ = "invalid_request_error" if status < 500 else "internal_error"
    return Response(
        orjson.dumps(error_body(message, type_, None, status)),
        status_code=status,
        media_type="application/json",
        headers=exc.headers,
    )


def _register_info_routes(app: FastAPI, services: Services) -> None:
    settings = services.settings
    fleet = settings.fleet.contract
    auth = services.auth

    def allowed(request: Request) -> bool:
        return auth.client_allowed(request.headers.get("authorization", ""))

    def card() -> dict[str, Any]:
        return {
            "id": fleet.model.id,
            "object": "model",
            "created": int(services.started_at),
            "owned_by": "narwhal",
            "root": fleet.model.id,
            "parent": None,
            "max_model_len": fleet.model.max_model_len,
            "permission": [],
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not allowed(request):
            return Unauthorized().response()
        return json_response({"object": "list", "data": [card()]})

    # The OpenAI SDK's models.retrieve(id); model ids hold slashes (org/name).
    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        if not allowed(request):
            return Unauthorized().response()
        if model != fleet.model.id:
            return NotFound(
                f"The model '{model}' does not exist; this router serves '{fleet.model.id}'",
                "model",
                code="model_not_found",
            ).response()
        return json_response(card())

    # responses.retrieve / delete / cancel / input_items: the router stores no responses
    # (store: true is refused), so none can be found.
    @app.api_route(
        "/v1/responses/{response_id:path}",
        methods=["GET", "DELETE", "POST"],
        include_in_schema=False,  # one handler for three methods: one operation id each
    )
    async def stored_response(request: Request, response_id: str) -> Response:
        if not allowed(request):
            return Unauthorized().response()
        # Only the operations on a stored response (the SDK's retrieve, delete, cancel and
        # input_items) ask for one: another path here (responses.input_tokens.count,
        # responses.compact: POST /v1/responses/input_tokens, /compact) is a route the router
        # does not serve, and is answered as every such route is, not as a missing id.
        response_id, _, operation = response_id.partition("/")
        if not response_id or (request.method, operation) not in _STORED_RESPONSE_OPERATIONS:
            return await _framework_error(request, StarletteHTTPException(404))
        return NotFound(
            f"No response with id '{response_id}': narwhal-serve stores no responses "
            "(send the whole conversation in 'input', with store: false)",
            "response_id",
        ).response()

    @app.get("/health")
    async def health(request: Request) -> Response:
        if settings.protect_health and not allowed(request):
            return Unauthorized().response()
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        if settings.protect_health and not allowed(request):
            return Unauthorized().response()
        ok, reason = services.state.ready()
        if not services.journal.accepting:
            ok, reason = False, "the journal is not accepting records"
        if services.ledger.draining:
            ok, reason = False, "draining"
        return json_response({"ready": ok, "reason": reason}, 200 if ok else 503)

    # Load balancers and uptime checks that probe with HEAD get the GET's status and headers
    # (the server sends no body); outside the schema, one operation id per route.
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)
    # vLLM's /ping (the SageMaker probe, GET or POST): behind the router, "can it serve" is
    # readiness, not the process being up.
    app.add_api_route("/ping", ready, methods=["GET", "POST"], include_in_schema=False)

    @app.get("/version")
    async def version(request: Request) -> Response:
        # vLLM's /version key, and what an operator asks next: which contract this router runs.
        if settings.protect_health and not allowed(request):
            return Unauthorized().response()
        return json_response(
            {
                "version": __version__,
                "server": "narwhal-serve",
                "fleet": fleet.name,
                "fleet_sha256": settings.fleet.sha256,
                "profile_sha256": settings.profile_sha256,
            }
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if settings.protect_metrics and not allowed(request):
            return Unauthorized().response()
        services.ledger.sync_journal_metrics()
        services.roles.sync_coordination_metrics()
        return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
