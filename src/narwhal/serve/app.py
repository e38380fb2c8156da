"""The narwhal-serve ASGI application: OpenAI endpoints, readiness, metrics and admin state."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from narwhal import __version__
from narwhal.asgi import EndpointResponse
from narwhal.clock import MonotonicClock
from narwhal.contract import LoadedFleet
from narwhal.engines.client import EnginePool
from narwhal.engines.transport import EngineTransportName
from narwhal.journal import Journal
from narwhal.metrics import RouterMetrics
from narwhal.profiles.store import ProfileStore, engine_models
from narwhal.routing.fleet_state import FleetState, Role
from narwhal.routing.lifecycle import Lifecycle
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.roles import DemandTracker, RoleController
from narwhal.routing.scheduler import SchedulerV0, SchedulerV1
from narwhal.serve.background import probe_all, run_health_loop, run_scrape_loop
from narwhal.serve.errors import RouterError
from narwhal.serve.generation import GenerationEndpoint
from narwhal.serve.pd import DecodeStream, MetricsObserver, PDRouter
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import StreamTally

__all__ = ["ServeSettings", "build_app", "hash_secret"]

log = logging.getLogger("narwhal.serve")


def hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


@dataclass(frozen=True)
class ServeSettings:
    fleet: LoadedFleet
    journal_path: Path
    api_key_hashes: tuple[bytes, ...] = ()
    admin_token_hash: bytes | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    health_interval_s: float = 1.0
    scrape_interval_s: float = 1.0
    prefill_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    protect_metrics: bool = False
    protect_health: bool = False
    journal_fsync_interval_s: float = 1.0
    journal_max_bytes: int = 256 * 1024 * 1024
    journal_on_error: Literal["fail_closed", "best_effort"] = "fail_closed"
    profile_sha256: str | None = None
    profiles: ProfileStore | None = None
    scheduler: Literal["v0", "v1"] = "v0"
    qualification: dict[str, Any] = field(default_factory=dict)
    engine_transport: EngineTransportName = "aiohttp"
    # push: decode events written to the client from the engine connection's data_received;
    # asgi: a task per stream pulls them and sends each piece through ASGI.
    relay: Literal["push", "asgi"] = "push"


@dataclass
class Runtime:
    settings: ServeSettings
    metrics: RouterMetrics
    state: FleetState
    journal: Journal | None = None
    engines: EnginePool | None = None
    router: PDRouter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    roles: RoleController | None = None
    demand: DemandTracker | None = None
    pinned: bool = False
    role_history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=1000))
    _journal_seen: dict[str, int] = field(default_factory=dict)

    # --- roles -------------------------------------------------------------------------

    def apply_flip(
        self,
        engine_id: str,
        to_role: Role,
        reason: str,
        pressures: dict[str, Any] | None,
        forced: bool,
    ) -> dict[str, Any]:
        """Move an engine to another role: state, metrics, journal, timeline, in that order."""
        engine = self.state.engines[engine_id]
        from_role = engine.role
        self.state.set_role(engine_id, to_role)
        if self.roles is not None:
            self.roles.applied()
        m = self.metrics
        m.flips.labels(from_role, to_role).inc()
        m.engine_role.labels(engine_id, from_role).set(0)
        m.engine_role.labels(engine_id, to_role).set(1)
        m.role_generation.set(self.state.role_generation)
        entry = {
            "t": time.time(),
            "engine": engine_id,
            "from_role": from_role,
            "to_role": to_role,
            "reason": reason,
            "pressures": pressures,
            "role_generation": self.state.role_generation,
            "forced": forced,
        }
        self.role_history.append(entry)
        assert self.journal is not None
        self.journal.role_flip(**entry)
        log.info("role flip: %s %s -> %s (%s)", engine_id, from_role, to_role, reason)
        return entry

    def set_pinned(self, pinned: bool) -> None:
        self.pinned = pinned
        if self.roles is not None:
            self.roles.pinned = pinned
        assert self.journal is not None
        self.journal.record("role.pin", pinned=pinned, role_generation=self.state.role_generation)

    # --- request bookkeeping -----------------------------------------------------------

    def finish(
        self,
        record: RequestRecord,
        outcome: str,
        status: int | None,
        error: str | None = None,
        tally: StreamTally | None = None,
        stream: DecodeStream | None = None,
    ) -> None:
        """Close a request: its one request.end record, its metrics. Idempotent."""
        if record.ended:
            return
        record.ended = True
        if outcome == "client_abort" and self.draining:
            outcome = "router_shutdown"
        record.outcome, record.status, record.error = outcome, status, error
        if tally is not None:
            if tally.completion_tokens is not None:
                record.completion_tokens = tally.completion_tokens
            if record.prompt_tokens is None and isinstance(tally.prompt_tokens, int):
                record.prompt_tokens = tally.prompt_tokens  # no prefill leg counted them
            if tally.first_token_at is not None:
                record.t_first_token = tally.first_token_at - record.arrival_mono
            if tally.last_token_at is not None:
                record.t_last_token = tally.last_token_at - record.arrival_mono
        m = self.metrics
        m.requests.labels(outcome).inc()
        budgets = self.settings.fleet.contract.budgets
        tpot_ok = (record.tpot_s() or 0.0) <= budgets.tpot_s
        met = (
            outcome == "ok"
            and record.t_first_token is not None
            and record.t_first_token <= budgets.ttft_s
            and tpot_ok
        )
        if outcome != "client_error":  # a malformed request is nobody's latency
            m.slo.labels("met" if met else "missed").inc()
        if outcome == "ok":
            if record.t_first_token is not None:
                m.ttft.observe(record.t_first_token)
            m.e2e.observe(record.since_arrival())
            tpot = record.tpot_s()
            if tpot is not None:
                m.tpot.observe(tpot)
        assert self.journal is not None
        self.journal.request_end(record.id, outcome, **record.end_fields())
        self.active.discard(record.id)

    async def release_stream(
        self, stream: DecodeStream, record: RequestRecord, complete: bool = False
    ) -> None:
        # Bookkeeping first, synchronously: a cancellation landing in the await below (the
        # client leaving as the stream ends) must not skip it.
        assert self.router is not None
        self.router.finish(stream, record)
        await stream.aclose(drain=complete)

    def sync_journal_metrics(self) -> None:
        """Carry the journal's own counters into Prometheus (they only ever grow)."""
        if self.journal is None:
            return
        stats = self.journal.stats()
        self.metrics.journal_backlog.set(stats.backlog)
        for counter, value, key in (
            (self.metrics.journal_errors, stats.write_errors, "errors"),
            (self.metrics.journal_dropped, stats.dropped, "dropped"),
        ):
            delta = value - self._journal_seen.get(key, 0)
            if delta > 0:
                counter.inc(delta)
                self._journal_seen[key] = value

    def authorized(self, request: Request) -> bool:
        return self.authorized_header(request.headers.get("authorization", ""))

    def authorized_header(self, header: str) -> bool:
        """Whether an ``Authorization`` header value carries one of the API keys."""
        hashes = self.settings.api_key_hashes
        if not hashes:
            return True
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return False
        digest = hash_secret(key.strip())
        # Compare against every key without stopping early: timing says nothing about which.
        matched = False
        for known in hashes:
            matched |= hmac.compare_digest(digest, known)
        return matched

    def admin_authorized(self, request: Request) -> bool:
        token = self.settings.admin_token_hash
        if token is None:
            return False
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hash_secret(given.strip()), token)


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def build_app(settings: ServeSettings) -> FastAPI:
    fleet = settings.fleet.contract
    clock = MonotonicClock()
    metrics = RouterMetrics(
        [e.id for e in fleet.engines], fleet.name, settings.fleet.sha256, settings.profile_sha256
    )
    state = FleetState(
        fleet,
        clock,
        breaker_failures=settings.breaker_failures,
        breaker_open_s=settings.breaker_open_s,
    )
    rt = Runtime(settings=settings, metrics=metrics, state=state)
    for engine in state.engines.values():
        for role in ("prefill", "decode"):
            metrics.engine_role.labels(engine.id, role).set(1 if engine.role == role else 0)
    metrics.role_generation.set(state.role_generation)
    for name, value in (
        ("ttft_seconds", fleet.budgets.ttft_s),
        ("tpot_seconds", fleet.budgets.tpot_s),
        ("attainment", fleet.budgets.attainment),
        ("first_token_timeout_seconds", fleet.engine.first_token_timeout_s),
    ):
        metrics.budget.labels(name).set(value)

    def on_journal_write(latency_s: float, backlog: int) -> None:
        metrics.journal_write.observe(latency_s)
        metrics.journal_backlog.set(backlog)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Recovery reads the whole journal: off the event loop.
        journal = await asyncio.to_thread(
            Journal.open,
            settings.journal_path,
            recover=True,
            fsync_interval_s=settings.journal_fsync_interval_s,
            max_bytes=settings.journal_max_bytes,
            on_error=settings.journal_on_error,
            on_write=on_journal_write,
        )
        rt.journal = journal
        journal.router_start(
            fleet=fleet.name,
            fleet_sha256=settings.fleet.sha256,
            profile_sha256=settings.profile_sha256,
            qualification=settings.qualification,
            engines={e.id: e.role for e in state.engines.values()},
        )
        rt.engines = EnginePool(fleet, transport=settings.engine_transport)
        prefill_timeout = settings.prefill_timeout_s or max(30.0, 3 * fleet.budgets.ttft_s)
        predictor = None
        scheduler: SchedulerV0 | SchedulerV1 = SchedulerV0()
        if settings.scheduler == "v1":
            assert settings.profiles is not None, "scheduler v1 needs a profile store"
            predictor = LatencyPredictor(engine_models(settings.profiles))
            scheduler = SchedulerV1(predictor, fleet.budgets)
        rt.demand = DemandTracker(clock, window_s=max(10.0, 6 * fleet.roles.tick_s))
        capacity = asyncio.Event()
        lifecycle = Lifecycle(
            state,
            scheduler,
            predictor=predictor,
            demand=rt.demand,
            observer=MetricsObserver(metrics, capacity),
        )
        rt.router = PDRouter(fleet, lifecycle, rt.engines, metrics, prefill_timeout, capacity)
        if predictor is not None and fleet.roles.enabled:
            rt.roles = RoleController(
                predictor, fleet.budgets, fleet.roles, clock, pinned=rt.pinned
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(probe_all(state, rt.engines, metrics), 3.0)
        rt.tasks = [
            asyncio.create_task(
                run_health_loop(state, rt.engines, metrics, settings.health_interval_s)
            ),
            asyncio.create_task(
                run_scrape_loop(state, rt.engines, metrics, settings.scrape_interval_s)
            ),
            asyncio.create_task(_run_role_loop(rt, fleet.roles.tick_s)),
        ]
        try:
            yield
        finally:
            rt.draining = True
            deadline = time.monotonic() + settings.drain_timeout_s
            while rt.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for task in rt.tasks:
                task.cancel()
            await asyncio.gather(*rt.tasks, return_exceptions=True)
            await rt.engines.aclose()
            # A journal that lost a record cannot vouch for a clean stop, even when this
            # record itself still fits (a full disk can take a short record after a long one).
            journal.router_stop(
                clean=not rt.active and journal.healthy,
                journal_error=journal.last_error,
                journal_dropped=journal.dropped,
            )
            await asyncio.to_thread(journal.close, 10.0)

    app = FastAPI(
        title="narwhal-serve",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.runtime = rt

    completions_endpoint = GenerationEndpoint(rt, chat=False)
    chat_endpoint = GenerationEndpoint(rt, chat=True)

    # Declared on the framework app (the OpenAPI schema describes them, and a request that
    # comes through the framework is served the same); serve() puts the endpoints themselves
    # in front of the framework's middleware (narwhal.asgi.HotRouteDispatch).
    @app.post("/v1/completions", include_in_schema=True)
    async def completions(request: Request) -> Response:
        return EndpointResponse(completions_endpoint)

    @app.post("/v1/chat/completions", include_in_schema=True)
    async def chat_completions(request: Request) -> Response:
        return EndpointResponse(chat_endpoint)

    app.state.hot_routes = {
        "/v1/completions": completions_endpoint,
        "/v1/chat/completions": chat_endpoint,
    }

    def key_denied() -> Response:
        return RouterError(
            401,
            "invalid or missing API key",
            "authentication_error",
            "client_error",
            headers={"WWW-Authenticate": "Bearer"},
        ).response()

    def admin_denied(request: Request) -> Response | None:
        if settings.admin_token_hash is None:
            return RouterError(
                403,
                "admin endpoints are disabled (no admin token configured)",
                "permission_error",
                "client_error",
            ).response()
        if not rt.admin_authorized(request):
            return RouterError(
                401, "admin token required", "authentication_error", "client_error"
            ).response()
        return None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not rt.authorized(request):
            return key_denied()
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": fleet.model.id,
                        "object": "model",
                        "created": int(rt.started_at),
                        "owned_by": "narwhal",
                        "root": fleet.model.id,
                        "parent": None,
                        "max_model_len": fleet.model.max_model_len,
                        "permission": [],
                    }
                ],
            }
        )

    @app.get("/health")
    async def health(request: Request) -> Response:
        if settings.protect_health and not rt.authorized(request):
            return key_denied()
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        if settings.protect_health and not rt.authorized(request):
            return key_denied()
        ok, reason = state.ready()
        journal_ok = rt.journal is not None and rt.journal.accepting
        if not journal_ok:
            ok, reason = False, "the journal is not accepting records"
        if rt.draining:
            ok, reason = False, "draining"
        return _json({"ready": ok, "reason": reason}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        if settings.protect_metrics and not rt.authorized(request):
            return key_denied()
        rt.sync_journal_metrics()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/state")
    async def admin_state(request: Request) -> Response:
        if (denied := admin_denied(request)) is not None:
            return denied
        now = clock.now()
        journal = rt.journal
        return _json(
            {
                "fleet": {
                    "name": fleet.name,
                    "sha256": settings.fleet.sha256,
                    "profile_sha256": settings.profile_sha256,
                },
                "role_generation": state.role_generation,
                "roles": {
                    "controller": rt.roles is not None,
                    "pinned": rt.pinned,
                    "history": list(rt.role_history),
                    "pressures": rt.roles.pressures(state, rt.demand).as_dict()
                    if rt.roles is not None and rt.demand is not None
                    else None,
                },
                "draining": rt.draining,
                "in_flight_requests": len(rt.active),
                "journal": None
                if journal is None
                else {
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
        )

    @app.post("/admin/roles/pin")
    async def admin_pin(request: Request) -> Response:
        if (denied := admin_denied(request)) is not None:
            return denied
        try:
            body = orjson.loads(await request.body())
            pinned = body["pinned"]
            if not isinstance(pinned, bool):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return RouterError(
                400,
                'expected {"pinned": true|false}',
                "invalid_request_error",
                "client_error",
                "pinned",
            ).response()
        rt.set_pinned(pinned)
        return _json({"pinned": rt.pinned})

    @app.post("/admin/roles/flip")
    async def admin_flip(request: Request) -> Response:
        if (denied := admin_denied(request)) is not None:
            return denied
        try:
            body = orjson.loads(await request.body())
            engine_id, to_role = body["engine"], body["to"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return RouterError(
                400,
                'expected {"engine": ID, "to": "prefill"|"decode"}',
                "invalid_request_error",
                "client_error",
            ).response()
        engine = state.engines.get(engine_id) if isinstance(engine_id, str) else None
        if engine is None:
            return RouterError(
                404, f"no engine {engine_id!r}", "not_found_error", "client_error", "engine"
            ).response()
        if to_role not in ("prefill", "decode") or not engine.can(to_role):
            return RouterError(
                400,
                f"engine {engine_id} is not permitted the role {to_role!r}",
                "invalid_request_error",
                "client_error",
                "to",
            ).response()
        if engine.role == to_role:
            return _json({"flipped": False, "engine": engine_id, "role": to_role})
        minimum = fleet.roles.min_prefill if engine.role == "prefill" else fleet.roles.min_decode
        if len(state.in_role(engine.role)) - 1 < minimum:
            return RouterError(
                409,
                f"flipping {engine_id} would leave fewer than {minimum} {engine.role} engines",
                "conflict",
                "client_error",
            ).response()
        entry = rt.apply_flip(engine_id, to_role, "forced by operator", None, forced=True)
        return _json({"flipped": True, **entry})

    return app


async def _run_role_loop(rt: Runtime, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        for engine in rt.state.engines.values():
            engine.settle_drain()
        if rt.demand is not None:
            # Every request is recorded in the demand window, but only reading it drops what
            # has aged out: without a controller that reads it (no profile store, role control
            # off, pinned) it would grow by one entry per request for as long as we run.
            rt.demand.rate()
        if rt.roles is None or rt.demand is None:
            continue
        decision = rt.roles.tick(rt.state, rt.demand)
        if decision is not None:
            rt.apply_flip(
                decision.engine,
                decision.to_role,
                decision.reason,
                decision.pressures.as_dict(),
                forced=False,
            )
