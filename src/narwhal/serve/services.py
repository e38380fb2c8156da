"""Every part of a running narwhal-serve, built whole before the first request: the fleet's
state and the routing lifecycle, the engine clients, the request ledger and its journal, the
role service, the metrics. ``start`` begins the background loops; ``stop`` drains and closes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from narwhal.clock import MonotonicClock
from narwhal.coordination import Coordinator, EtcdClient
from narwhal.coordination.replica import namespace_of
from narwhal.engines.client import EnginePool
from narwhal.journal import Journal
from narwhal.metrics import RouterMetrics, kv_events_task
from narwhal.profiles.store import engine_models
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import Lifecycle
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.roles import DemandTracker, RoleController
from narwhal.routing.scheduler import SchedulerV0, SchedulerV1
from narwhal.serve.auth import Auth
from narwhal.serve.background import (
    kv_event_subscribers,
    probe_all,
    run_generation_watch,
    run_health_loop,
    run_scrape_loop,
)
from narwhal.serve.ledger import RequestLedger
from narwhal.serve.pd import MetricsObserver, PDRouter
from narwhal.serve.roles import RoleService
from narwhal.serve.settings import ServeSettings
from narwhal.serve.supervisor import supervise

__all__ = ["Services"]

log = logging.getLogger("narwhal.serve")


# Health probes per look at the engines' attestations (a restart takes an engine down for at
# least one probe; its attestation need not be read as often).
GENERATION_WATCH_PROBES = 5


@dataclass
class Services:
    settings: ServeSettings
    clock: MonotonicClock
    metrics: RouterMetrics
    state: FleetState
    journal: Journal
    engines: EnginePool
    router: PDRouter
    ledger: RequestLedger
    roles: RoleService
    auth: Auth
    started_at: float = field(default_factory=time.time)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stepping_down: bool = False

    @classmethod
    def open(cls, settings: ServeSettings) -> Services:
        """Build every part; the journal is opened (and recovered) here, before anything
        serves. Loop-bound resources (engine connections, the loops) come with ``start``."""
        fleet = settings.fleet.contract
        clock = MonotonicClock()
        metrics = RouterMetrics(
            [e.id for e in fleet.engines],
            fleet.name,
            settings.fleet.sha256,
            settings.profile_sha256,
        )
        state = FleetState(
            fleet,
            clock,
            breaker_failures=settings.breaker_failures,
            breaker_open_s=settings.breaker_open_s,
        )
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

        journal = Journal.open(
            settings.journal_path,
            stamp={"replica": settings.replica_id} if settings.replica_id else None,
            recover=True,
            fsync_interval_s=settings.journal_fsync_interval_s,
            max_bytes=settings.journal_max_bytes,
            on_error=settings.journal_on_error,
            on_write=on_journal_write,
        )
        # The requests a killed router left open end here (the journal's router_restart): the
        # outcome counter has one per request that reached a router, as the journal does, and
        # each missed its budgets (the fleet failed it), as the attainment counts it.
        metrics.requests.labels("router_restart").inc(journal.recovered_closed)
        metrics.slo.labels("missed").inc(journal.recovered_closed)
        predictor: LatencyPredictor | None = None
        scheduler: SchedulerV0 | SchedulerV1 = SchedulerV0()
        if settings.scheduler == "v1":
            if settings.profiles is None:
                raise ValueError("scheduler v1 needs a profile store")
            predictor = LatencyPredictor(engine_models(settings.profiles))
            scheduler = SchedulerV1(predictor, fleet.budgets)
        demand = DemandTracker(clock, window_s=max(10.0, 6 * fleet.roles.tick_s))
        capacity = asyncio.Event()
        lifecycle = Lifecycle(
            state,
            scheduler,
            predictor=predictor,
            demand=demand,
            observer=MetricsObserver(metrics, capacity),
        )
        engines = EnginePool(
            fleet, transport=settings.engine_transport, api_key=settings.fleet.engine_api_key
        )
        prefill_timeout = settings.prefill_timeout_s or max(30.0, 3 * fleet.budgets.ttft_s)
        controller = None
        if predictor is not None and fleet.roles.enabled:
            controller = RoleController(predictor, fleet.budgets, fleet.roles, clock)
        roles = RoleService(fleet, state, metrics, journal, demand, controller)
        if settings.coordination:
            assert settings.replica_id is not None
            roles.replica_id = settings.replica_id
            roles.coordinator = Coordinator(
                EtcdClient(settings.coordination),
                namespace_of(fleet.name, settings.fleet.sha256),
                settings.replica_id,
                roles.shared_now,
                roles.apply_shared,
                lease_ttl_s=settings.coordination_lease_ttl_s,
            )
        roles.sync_coordination_metrics()
        return cls(
            settings=settings,
            clock=clock,
            metrics=metrics,
            state=state,
            journal=journal,
            engines=engines,
            router=PDRouter(fleet, lifecycle, engines, metrics, prefill_timeout, capacity),
            ledger=RequestLedger(journal, metrics, fleet.budgets),
            roles=roles,
            auth=Auth(settings.api_key_hashes, settings.admin_token_hash),
        )

    async def start(self) -> None:
        settings = self.settings
        fleet = settings.fleet.contract
        self.journal.router_start(
            fleet=fleet.name,
            fleet_sha256=settings.fleet.sha256,
            profile_sha256=settings.profile_sha256,
            profile_store=settings.profile_store_path,
            qualification=settings.qualification,
            engines={e.id: e.role for e in self.state.engines.values()},
            command=settings.command,
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(probe_all(self.state, self.engines, self.metrics), 3.0)
        state, engines, metrics = self.state, self.engines, self.metrics
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            (
                "health_probes",
                lambda: run_health_loop(state, engines, metrics, settings.health_interval_s),
            ),
            (
                "engine_scrapes",
                lambda: run_scrape_loop(state, engines, metrics, settings.scrape_interval_s),
            ),
            ("role_controller", lambda: self.roles.run(fleet.roles.tick_s)),
        ]
        if (coordinator := self.roles.coordinator) is not None:
            loops.append(("etcd_coordination", coordinator.run))
        if settings.profiles is not None:
            profiled = {
                engine_id: profile.generation
                for engine_id, profile in settings.profiles.engines.items()
                if profile.generation is not None
            }
            attestations = {
                e.id: e.attestation_url
                for e in fleet.engines
                if e.attestation_url and e.id in profiled
            }
            if attestations:
                every = GENERATION_WATCH_PROBES * settings.health_interval_s
                loops.append(
                    (
                        "generation_watch",
                        lambda: run_generation_watch(attestations, profiled, metrics, every),
                    )
                )
        loops += [
            (kv_events_task(subscriber.engine_id), subscriber.run)
            for subscriber in kv_event_subscribers(state, metrics)
        ]
        self.tasks = [
            asyncio.create_task(supervise(name, start, metrics), name=name) for name, start in loops
        ]
        if (coordinator := self.roles.coordinator) is not None:
            # Serve from the first request on with the roles etcd holds (a replica started
            # late would otherwise route a moment by its own); an etcd that does not answer
            # delays the start by one client timeout per listed member at most (the client
            # tries them in turn: a silent member ahead of a live one costs its timeout), then
            # the replica serves as it is.
            client = coordinator.client
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    coordinator.first_attempt.wait(), client.timeout_s * len(client.endpoints)
                )

    def hand_over_leadership(self) -> None:
        """At a drain's start (on the event loop): a coordinated replica leaves the election in
        the background, so that another replica runs the role controller while this one
        finishes its requests (a drain lasts up to --drain-timeout). On the loop only: not
        from a signal handler (uvicorn's handle_exit), which calls on_tick to do it."""
        coordinator = self.roles.coordinator
        if coordinator is None or coordinator.retired or self._stepping_down:
            return
        self._stepping_down = True
        self.tasks.append(asyncio.create_task(coordinator.step_down(), name="step_down"))

    async def stop(self) -> None:
        ledger = self.ledger
        ledger.draining = True
        self.hand_over_leadership()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while ledger.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Release legs whose requests ended first still free KV on the prefill engines: they
        # end within their own deadline, before the engines' connections close.
        await self.router.settle_releases(max(0.0, deadline - time.monotonic()))
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if (coordinator := self.roles.coordinator) is not None:
            # Hand leadership over now rather than after the lease's TTL.
            await coordinator.resign()
            await coordinator.client.aclose()
        await self.engines.aclose()
        journal = self.journal
        # A journal that lost a record cannot vouch for a clean stop, even when this record
        # itself still fits (a full disk can take a short record after a long one).
        journal.router_stop(
            clean=not ledger.active and journal.healthy,
            journal_error=journal.last_error,
            journal_dropped=journal.dropped,
        )
        await asyncio.to_thread(journal.close, 10.0)
