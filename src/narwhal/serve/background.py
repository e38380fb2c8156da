"""The router's background loops: active health probes, engine /metrics scrapes, the watch of
engines' generations against their profiles, and the subscriptions to engines' KV cache events
that keep the prefix index precise."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping

import httpx

from narwhal.clock import Clock
from narwhal.engines.client import EnginePool
from narwhal.engines.kv_events import KVEventSubscriber, ReadEvent, apply_kv_events
from narwhal.engines.scrape import parse_engine_load
from narwhal.engines.transport import EngineTransportError, fetch
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import EngineState, FleetState
from narwhal.routing.prefix import PrefixIndex

__all__ = [
    "kv_event_subscribers",
    "probe_all",
    "run_generation_watch",
    "run_health_loop",
    "run_scrape_loop",
]

log = logging.getLogger(__name__)

# Probes that may time out in a row before a healthy engine is marked unhealthy: a loaded host
# stalls an engine's API server for seconds at a time, and one slow answer should not take the
# engine out of routing for a whole probe interval. A refused or reset connection, or an answer
# other than 200, marks it at once: the engine is gone or says it is not well. A probe that times
# out while the engine answers legs is tolerated however many in a row: busy, not hung. vLLM's API
# server answers /health on the event loop that also tokenizes and streams, and on a loaded host
# misses the probe's timeout while it serves; a hung engine (SIGSTOP, a wedged GPU) answers nothing,
# and its legs fail on their own deadlines (hedge, stall, first token) meanwhile.
PROBE_TIMEOUTS_TOLERATED = 1


async def _probe(
    engine: EngineState,
    state: FleetState,
    pool: EnginePool,
    metrics: RouterMetrics,
    interval_s: float,
) -> None:
    # A leg that succeeded since the previous probe was sent vouches for this one.
    vouched_from = state.clock.now() - interval_s
    failure: str | None = None
    try:
        status, _ = await fetch(pool.probe(engine.id), "/health")
        if status != 200:
            failure = "status"
    except EngineTransportError as exc:
        failure = "timeout" if exc.timeout else "unreachable"
    if failure is not None:
        metrics.health_probe_failures.labels(engine.id, failure).inc()
    if failure == "unreachable":
        engine.unreachable = True
    elif failure is None and engine.unreachable:
        engine.unreachable = False
        _back_after_unreachable(engine, state)
    if failure == "timeout":
        engine.probe_timeouts += 1
        busy = engine.answered_at >= vouched_from
        if engine.healthy and (engine.probe_timeouts <= PROBE_TIMEOUTS_TOLERATED or busy):
            log.info(
                "engine %s: health probe timed out (%d in a row; tolerated%s)",
                engine.id,
                engine.probe_timeouts,
                ": it answers legs" if busy else "",
            )
            return
    else:
        engine.probe_timeouts = 0
    ok = failure is None
    was = engine.healthy
    engine.healthy = ok
    # A passing probe closes only a half-open breaker that failing probes helped open: an
    # engine that answers /health but fails requests waits for a half-open request instead.
    engine.breaker.record_health(ok)
    if was is not ok:
        log.log(
            logging.INFO if ok else logging.WARNING,
            "engine %s is %s",
            engine.id,
            "healthy" if ok else "unhealthy",
        )
    metrics.engine_healthy.labels(engine.id).set(1 if ok else 0)
    metrics.breaker_state.labels(engine.id).set(int(engine.breaker.state))


def _back_after_unreachable(engine: EngineState, state: FleetState) -> None:
    """The engine answers again after nothing listened: most likely a restarted process, whose
    prefix cache is empty. Its index entries go now rather than when its first event batch
    shows the sequence starting over (a restarted engine that is sent nothing publishes
    nothing, and was routed by blocks it no longer holds): the index under-reports rather than
    claims what an engine lost. An engine that publishes events is indexed from them again."""
    index = state.prefix_index
    if index is None or not index.blocks_held(engine.id):
        return
    log.warning(
        "engine %s answers again after being unreachable: its prefix index entries dropped "
        "(a restarted engine holds no cache)",
        engine.id,
    )
    index.clear(engine.id)


async def probe_all(
    state: FleetState, pool: EnginePool, metrics: RouterMetrics, interval_s: float = 0.0
) -> None:
    await asyncio.gather(
        *(_probe(e, state, pool, metrics, interval_s) for e in state.engines.values())
    )


async def run_health_loop(
    state: FleetState, pool: EnginePool, metrics: RouterMetrics, interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await probe_all(state, pool, metrics, interval_s)


async def _scrape(
    engine: EngineState, state: FleetState, pool: EnginePool, metrics: RouterMetrics
) -> None:
    try:
        status, body = await fetch(pool.probe(engine.id), "/metrics")
        load = parse_engine_load(body) if status == 200 else None
    except EngineTransportError:
        load = None
    if load is None:
        metrics.scrape_errors.labels(engine.id).inc()
        return
    scraped = engine.scraped
    scraped.running = load["running"]
    scraped.waiting = load["waiting"]
    scraped.kv_cache_usage = load["kv_cache_usage"]
    scraped.at = state.clock.now()
    for signal, value in load.items():
        metrics.engine_load.labels(engine.id, signal).set(value)


async def run_scrape_loop(
    state: FleetState, pool: EnginePool, metrics: RouterMetrics, interval_s: float
) -> None:
    while True:
        await asyncio.gather(*(_scrape(e, state, pool, metrics) for e in state.engines.values()))
        await asyncio.sleep(interval_s)


async def run_generation_watch(
    attestations: Mapping[str, str],
    profiled: Mapping[str, str],
    metrics: RouterMetrics,
    interval_s: float,
) -> None:
    """Each engine's generation, as its attestation endpoint (``attestations``) reports it,
    against the one its profile was measured at (``profiled``). The router checks them when it
    starts; an engine restarted since runs another generation, possibly at another speed, and
    the router goes on routing it by the old profile (the online correction absorbs a
    different speed): it is flagged (``narwhal_engine_profile_stale``, a warning in the log)
    until it runs the profiled generation again. An attestation that does not answer changes
    nothing."""
    stale: set[str] = set()
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:

        async def check(engine_id: str, url: str) -> None:
            try:
                live = str((await client.get(url)).json()["generation"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return
            now = live != profiled[engine_id]
            if now and engine_id not in stale:
                stale.add(engine_id)
                log.warning(
                    "engine %s runs generation %s, profiled at %s (restarted): it is routed "
                    "by its old profile until re-profiled (narwhal-profile)",
                    engine_id,
                    live,
                    profiled[engine_id],
                )
            elif not now and engine_id in stale:
                stale.discard(engine_id)
                log.info("engine %s runs its profiled generation again", engine_id)
            metrics.profile_stale.labels(engine_id).set(1 if now else 0)

        while True:
            await asyncio.sleep(interval_s)
            # Every engine at once, each judged as its answer comes: one sidecar that hangs
            # would otherwise hold back the engines after it by its timeout, every round.
            # A task group: a fault in one check cancels the others before the loop ends (its
            # supervisor starts it again), rather than leave them reading on a closed client.
            async with asyncio.TaskGroup() as group:
                for engine_id, url in attestations.items():
                    group.create_task(check(engine_id, url))


def kv_event_subscribers(state: FleetState, metrics: RouterMetrics) -> list[KVEventSubscriber]:
    """One subscriber per engine that publishes KV events (``kv_events`` in the fleet), each
    feeding the prefix index; none when the fleet routes without prefixes. An engine's entries
    come from routing history until its first batch arrives, from its events after."""
    index = state.prefix_index
    if index is None:
        return []
    out = []
    for spec in state.fleet.engines:
        # Read from the index at each scrape, whatever feeds it (events or routing history):
        # set only as batches applied, it read 0 for an engine indexed from history.
        metrics.prefix_index_blocks.labels(spec.id).set_function(
            functools.partial(_blocks_held, index, spec.id, state.clock)
        )
        if spec.kv_events is None:
            continue
        metrics.kv_events_configured.labels(spec.id).set(1)
        out.append(
            KVEventSubscriber(
                spec.id,
                spec.kv_events.endpoint,
                spec.kv_events.replay_endpoint,
                spec.kv_events.topic,
                _applier(index, spec.id, metrics),
                _resetter(index, spec.id, metrics),
                on_unreadable=metrics.kv_event_unreadable.labels(spec.id).inc,
                # A restarted engine holds nothing: the text prompts' history goes too.
                on_restart=functools.partial(index.clear, spec.id),
                catch_up=True,
            )
        )
    return out


def _blocks_held(index: PrefixIndex, engine_id: str, clock: Clock) -> float:
    # Read on the event loop (/metrics is an async route): expiring history here is safe.
    return float(index.blocks_held(engine_id, clock.now()))


def _applier(
    index: PrefixIndex, engine_id: str, metrics: RouterMetrics
) -> Callable[[list[ReadEvent]], None]:
    batches = metrics.kv_event_batches.labels(engine_id)
    # Read from the index at each scrape: whether its entries for the engine come from the
    # engine's events is the index's own state (set by each batch, cleared by a reset).
    metrics.kv_events_followed.labels(engine_id).set_function(
        lambda: 1.0 if index.is_precise(engine_id) else 0.0
    )
    warned = False

    def apply(events: list[ReadEvent]) -> None:
        nonlocal warned
        foreign = apply_kv_events(index, engine_id, events)
        if foreign is not None and not warned:
            warned = True
            log.warning(
                "engine %s publishes blocks of %d tokens; the fleet's "
                "engine.prefix_caching.block_size is %d: its events cannot be indexed",
                engine_id,
                foreign,
                index.block_size,
            )
        batches.inc()

    return apply


def _resetter(index: PrefixIndex, engine_id: str, metrics: RouterMetrics) -> Callable[[], None]:
    def reset() -> None:
        # What the engine published can no longer be trusted: its entries go, and until its
        # next readable batch it is routed by history, as an engine that publishes nothing
        # (one that never sent a readable batch keeps the history it has: an unreadable
        # batch says nothing about where the router sent prompts).
        index.set_precise(engine_id, False)
        metrics.kv_event_resets.labels(engine_id).inc()

    return reset
