"""The prefill hedge's race (``PDRouter._hedged_prefill``) against scripted engines: the slow leg
runs inline under a timer, the hedge as a task, and every way the two can end is reported once
to the lifecycle and the metrics, with the request holding the hedge's pair.

Real time, small: the hedge point is 0.1 s (half a 0.2 s TTFT budget, scheduler v0), legs
answer within half a second.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import pytest

from narwhal.clock import MonotonicClock
from narwhal.contract import FleetContract, parse_fleet
from narwhal.engines.base import EngineTransportError
from narwhal.metrics import RouterMetrics
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import Lifecycle
from narwhal.routing.roles import DemandTracker
from narwhal.routing.scheduler import SchedulerV0
from narwhal.serve.errors import EngineRefused, RouterError, UpstreamFailed
from narwhal.serve.pd import (
    MetricsObserver,
    PDRouter,
    _EngineClientError,
    _hedge_end,
    _LegFailure,
)
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import EventRenderer, StreamTally
from narwhal.serve.validation import parse_client_request
from narwhal.simengine.fleet import local_fleet_document

MODEL = "moonshotai/Kimi-K3"


@dataclass
class Leg:
    """How one engine answers a prefill leg: after ``delay_s``, ``ok``, ``fail`` (the
    connection breaks), ``refuse`` (HTTP 400), ``malformed`` or ``no_choices`` (200, not a
    completion), or ``orphaned`` (its answer arrives in the turn the request is cancelled:
    handed to the caller's ``on_orphan``, as the router's own connections do)."""

    outcome: str = "ok"
    delay_s: float = 0.0


class _Answer:
    def __init__(self, status: int, body: bytes, chunks: list[bytes] | None = None) -> None:
        self.status = status
        self._body = body
        self._chunks = iter(chunks if chunks is not None else [body])

    async def read(self) -> bytes:
        return self._body

    async def read_chunk(self) -> bytes:
        return next(self._chunks, b"")

    async def aclose(self) -> None:
        pass


class ScriptedEngine:
    def __init__(self, engine_id: str, engines: ScriptedEngines) -> None:
        self.id = engine_id
        self.engines = engines

    async def post(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_orphan: Callable[[int, bytes], None] | None = None,
    ) -> _Answer:
        engines = self.engines
        params = orjson.loads(body).get("kv_transfer_params") or {}
        if params.get("do_remote_prefill"):  # a release leg: pulls the KV, one token
            engines.log.append(f"{self.id} releases from {params['remote_engine_id']}")
            return _Answer(200, b'{"choices": [{"index": 0, "text": "x"}]}')
        # The first prefill leg sent follows the script's first entry, the hedge its second.
        leg = engines.script[len(engines.prefills)]
        engines.prefills.append(self.id)
        try:
            await asyncio.sleep(leg.delay_s)
        except asyncio.CancelledError:
            engines.log.append(f"{self.id} cancelled")
            raise
        engines.log.append(f"{self.id} {leg.outcome}")
        if engines.cancel_when_hedge_answers is not None and len(engines.prefills) == 2:
            # The client leaves in the moment the hedge answers: before the race hears of it
            # (its callback runs first: call_soon), or after the request's task does (at once).
            if engines.cancel_before_the_race_hears:
                engines.cancel_when_hedge_answers.cancel()
            else:
                asyncio.get_running_loop().call_soon(engines.cancel_when_hedge_answers.cancel)
        if leg.outcome == "fail":
            raise EngineTransportError(
                "ClientConnectorError: Cannot connect to host 10.20.0.7:8100",
                public="the connection to the engine failed (ClientConnectorError)",
            )
        if leg.outcome == "refuse":
            return _Answer(400, b'{"error": {"message": "bad"}}')
        if leg.outcome == "malformed":  # JSON, but not a completion
            return _Answer(200, b'{"choices": {"index": 0}}')
        if leg.outcome == "no_choices":  # JSON, with nothing of a completion
            return _Answer(200, b'{"hello": "world"}')
        answer = {
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": self.id},
        }
        if leg.outcome == "orphaned":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # the client leaves in this turn
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if on_orphan is not None:  # else the answer is dropped
                    on_orphan(200, orjson.dumps(answer))
                raise
        return _Answer(200, orjson.dumps(answer))

    async def stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> _Answer:
        params = orjson.loads(body)["kv_transfer_params"]
        engines = self.engines
        try:
            if engines.decode_connect_s:  # waiting for a connection
                engines.decode_waits.set()
                await asyncio.sleep(engines.decode_connect_s)
            if on_send is not None:
                on_send()
            engines.log.append(f"{self.id} decodes from {params['remote_engine_id']}")
            if engines.decode_head_s:
                engines.decode_waits.set()
                await asyncio.sleep(engines.decode_head_s)
        except asyncio.CancelledError:
            engines.log.append(f"{self.id} decode cancelled")
            raise
        return _Answer(200, b"", [b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'])


class ScriptedEngines:
    """The fleet's engines: prefill legs answer as ``script`` says, in the order they are sent
    (the slow leg, then its hedge); decode legs stream a first token at once."""

    def __init__(self, script: list[Leg]) -> None:
        self.script = script
        self.prefills: list[str] = []  # the engines prefill legs went to, in order
        self.log: list[str] = []
        self.cancel_when_hedge_answers: asyncio.Task[object] | None = None
        self.cancel_before_the_race_hears = False
        self.decode_connect_s = 0.0  # before a decode leg is sent
        self.decode_head_s = 0.0  # from then to its answer's head
        self.decode_waits = asyncio.Event()  # a decode leg is in one of those two waits

    def client(self, engine_id: str) -> ScriptedEngine:
        return ScriptedEngine(engine_id, self)


def fleet() -> FleetContract:
    doc = local_fleet_document(
        [1, 2, 3],
        [4, 5, 6],
        initial_roles=["prefill", "prefill", "decode"],
        ttft_s=0.2,
        first_token_timeout_s=0.15,
        routing={"hedge": {"floor_s": 0.05}, "max_prefill_attempts": 1},
        role_control={"enabled": False},
    )
    return parse_fleet(doc, "fleet.json").contract


@dataclass
class Outcome:
    error: BaseException | None
    record: RequestRecord
    router: PDRouter
    engines: ScriptedEngines
    state: FleetState
    snapshot: dict[str, int]  # in-flight prefill legs per engine at ``snapshot_at_s``

    def hedges(self, outcome: str) -> float:
        return self.router.metrics.hedges.labels("prefill", outcome)._value.get()

    def attempts(self) -> list[tuple[str, str, str]]:
        return [(a["leg"], a["engine"], a["outcome"]) for a in self.record.attempts]


async def _run(
    script: list[Leg],
    cancel_after_s: float | None = None,
    cancel_with_hedge: bool = False,
    snapshot_at_s: float | None = None,
    decode_connect_s: float = 0.0,
    decode_head_s: float = 0.0,
    at_once: bool = False,
) -> Outcome:
    """``decode_connect_s`` / ``decode_head_s``: the request is cancelled once its decode leg
    waits that long before it is sent / for its answer's head."""
    contract = fleet()
    clock = MonotonicClock()
    state = FleetState(contract, clock)
    for engine in state.engines.values():
        engine.healthy = True
    metrics = RouterMetrics([e.id for e in contract.engines], contract.name, "0" * 64, None)
    capacity = asyncio.Event()
    lifecycle = Lifecycle(
        state,
        SchedulerV0(),
        demand=DemandTracker(clock, window_s=10.0),
        observer=MetricsObserver(metrics, capacity),
    )
    engines = ScriptedEngines(script)
    engines.decode_connect_s, engines.decode_head_s = decode_connect_s, decode_head_s
    engines.cancel_before_the_race_hears = at_once
    router = PDRouter(contract, lifecycle, engines, metrics, 30.0, capacity)  # type: ignore[arg-type]
    body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4})
    request = parse_client_request(body, False, MODEL, contract.model.max_model_len)
    record = RequestRecord("r1", 0.0, clock.now(), "/v1/completions")
    error: BaseException | None = None
    task = asyncio.ensure_future(router.open(request, record))
    snapshot: dict[str, int] = {}
    if snapshot_at_s is not None:
        asyncio.get_running_loop().call_later(
            snapshot_at_s,
            lambda: snapshot.update({e.id: e.in_flight_prefill for e in state.engines.values()}),
        )
    if cancel_with_hedge:
        engines.cancel_when_hedge_answers = task
    if cancel_after_s is not None:
        await asyncio.sleep(cancel_after_s)
        task.cancel()
    if decode_connect_s or decode_head_s:
        await asyncio.wait_for(engines.decode_waits.wait(), 30)
        task.cancel()
    try:
        stream = await task
        record.outcome = "ok"
        router.finish(stream, record)
        await stream.aclose()
    except (RouterError, asyncio.CancelledError) as exc:
        error = exc
    # Nothing is left in flight on any engine, whatever the race did.
    await asyncio.sleep(0.05)  # a cancelled leg sees its cancellation
    for engine in state.engines.values():
        assert engine.in_flight_prefill == 0 and engine.in_flight_decode == 0, engine.id
        assert engine.pending_decode == 0, engine.id
    return Outcome(error, record, router, engines, state, snapshot)


def run(
    script: list[Leg],
    cancel_after_s: float | None = None,
    cancel_with_hedge: bool = False,
    snapshot_at_s: float | None = None,
    decode_connect_s: float = 0.0,
    decode_head_s: float = 0.0,
    at_once: bool = False,
) -> Outcome:
    return asyncio.run(
        _run(
            script,
            cancel_after_s,
            cancel_with_hedge,
            snapshot_at_s,
            decode_connect_s,
            decode_head_s,
            at_once,
        )
    )


def test_a_prompt_leg_is_never_hedged() -> None:
    out = run([Leg("ok", 0.0)])
    assert out.error is None
    assert len(out.engines.prefills) == 1
    (slow,) = out.engines.prefills
    assert out.attempts() == [("prefill", slow, "ok"), ("decode", "e2", "first_token")]
    assert out.hedges("hedge") == out.hedges("original") == 0


def test_the_hedge_answers_first_and_interrupts_the_slow_leg() -> None:
    out = run([Leg("ok", 0.4), Leg("ok", 0.0)])
    slow, hedge = out.engines.prefills
    assert out.error is None
    assert out.hedges("hedge") == 1
    assert f"{slow} cancelled" in out.engines.log and f"{slow} ok" not in out.engines.log
    assert out.record.prefill_engine == hedge
    assert f"e2 decodes from {hedge}" in out.engines.log
    assert out.attempts()[0] == ("prefill", slow, "hedged")
    # The slow leg counted once against its engine's breaker.
    assert out.state.engines[slow].breaker.consecutive_failures == 1


def test_the_slow_leg_answers_before_its_hedge() -> None:
    out = run([Leg("ok", 0.2), Leg("ok", 0.4)])
    slow, hedge = out.engines.prefills
    assert out.error is None
    assert out.hedges("original") == 1 and out.hedges("hedge") == 0
    assert f"{hedge} cancelled" in out.engines.log
    assert out.record.prefill_engine == slow
    assert f"e2 decodes from {slow}" in out.engines.log
    # The hedge neither answered nor failed: no verdict on its engine.
    assert out.state.engines[hedge].breaker.consecutive_failures == 0
    assert out.state.engines[hedge].answered_at == -math.inf


def test_the_slow_leg_fails_and_the_hedge_still_answers() -> None:
    out = run([Leg("fail", 0.2), Leg("ok", 0.3)])
    slow, hedge = out.engines.prefills
    assert out.error is None
    assert out.hedges("hedge") == 1
    assert out.record.prefill_engine == hedge
    assert ("prefill", slow, "failed") in out.attempts()


@pytest.mark.parametrize("hedge_first", [False, True], ids=["slow-first", "hedge-first"])
def test_both_legs_fail_as_one_failure(hedge_first: bool) -> None:
    slow, hedge = (
        (Leg("fail", 0.3), Leg("fail", 0.0))
        if hedge_first
        else (Leg("fail", 0.2), Leg("fail", 0.3))
    )
    script = [slow, hedge]
    out = run(script)
    assert isinstance(out.error, RouterError)
    assert out.hedges("failed") == 1
    assert len(out.engines.prefills) == 2  # max_prefill_attempts 1: no third leg
    # Each engine's failure counted once, whichever came first.
    for engine in out.engines.prefills:
        assert out.state.engines[engine].breaker.consecutive_failures == 1, engine


def test_the_hedge_fails_first_and_the_slow_leg_still_answers() -> None:
    out = run([Leg("ok", 0.3), Leg("fail", 0.0)], snapshot_at_s=0.2)
    slow, hedge = out.engines.prefills
    assert out.error is None
    # While the request waits on the slow leg, its engine (doing the work) carries the leg.
    assert out.snapshot[slow] == 1 and out.snapshot[hedge] == 0, out.snapshot
    assert out.hedges("original") == 1
    assert out.record.prefill_engine == slow
    # The hedge's failure counted against its engine; the slow leg's, counted when it was
    # hedged, cleared by its answer (slow, not hung).
    assert out.state.engines[hedge].breaker.consecutive_failures == 1
    assert out.state.engines[slow].breaker.consecutive_failures == 0


@pytest.mark.parametrize("refused", ["slow", "hedge"])
def test_a_refusal_from_either_leg_ends_the_request(refused: str) -> None:
    script = (
        [Leg("refuse", 0.2), Leg("ok", 0.4)]
        if refused == "slow"
        else [Leg("ok", 0.4), Leg("refuse", 0.0)]
    )
    out = run(script)
    assert isinstance(out.error, EngineRefused)
    assert out.hedges("refused") == 1
    if refused == "slow":  # the hedge was cancelled: no verdict on its engine
        _, hedge = out.engines.prefills
        assert out.state.engines[hedge].answered_at == -math.inf


@pytest.mark.parametrize("hedge", ["fail", "malformed"])
def test_a_hedge_that_failed_is_counted_even_when_the_client_leaves(hedge: str) -> None:
    """The hedge fails (or answers what is not a completion) at once, the slow leg runs on and
    the client leaves before it ends: the hedge's engine has its failure counted all the same,
    and no raw exception reaches the client."""
    out = run([Leg("ok", 0.5), Leg(hedge, 0.0)], cancel_after_s=0.3, snapshot_at_s=0.2)
    slow, hedged = out.engines.prefills
    assert isinstance(out.error, asyncio.CancelledError)
    assert out.snapshot[slow] == 1 and out.snapshot[hedged] == 0, out.snapshot
    assert out.state.engines[hedged].breaker.consecutive_failures == 1
    assert out.state.engines[slow].breaker.consecutive_failures == 1


@pytest.mark.parametrize("answer", ["malformed", "no_choices"])
def test_a_malformed_hedge_answer_leaves_the_slow_leg_to_answer(answer: str) -> None:
    out = run([Leg("ok", 0.3), Leg(answer, 0.0)])
    slow, hedged = out.engines.prefills
    assert out.error is None
    assert out.hedges("original") == 1
    assert out.record.prefill_engine == slow
    assert out.state.engines[hedged].breaker.consecutive_failures == 1


def test_a_request_cancelled_mid_race_cancels_both_legs() -> None:
    out = run([Leg("ok", 0.5), Leg("ok", 0.5)], cancel_after_s=0.2)
    slow, hedge = out.engines.prefills
    assert isinstance(out.error, asyncio.CancelledError)
    assert f"{slow} cancelled" in out.engines.log and f"{hedge} cancelled" in out.engines.log
    assert out.hedges("hedge") == out.hedges("original") == 0


@pytest.mark.parametrize("at_once", [False, True], ids=["race-hears-first", "request-first"])
def test_a_client_leaving_as_the_hedge_answers_settles_the_hedge(at_once: bool) -> None:
    """The client leaves in the moment the hedge answers, before the race hears of it: the
    hedge's engine served well (a success, not an abandoned request), its answer is the
    prefill's, and its KV, which no decode leg will pull, is released."""
    out = run([Leg("ok", 0.5), Leg("ok", 0.0)], cancel_with_hedge=True, at_once=at_once)
    slow, hedge = out.engines.prefills
    assert isinstance(out.error, asyncio.CancelledError)
    assert f"{slow} cancelled" in out.engines.log
    assert not any("decodes" in line for line in out.engines.log)
    assert out.hedges("hedge") == 1
    assert out.state.engines[hedge].answered_at > -math.inf
    assert out.state.engines[hedge].breaker.consecutive_failures == 0
    # Its KV, which no decode leg will pull, is released (pulled by a release leg at once).
    assert f"e2 releases from {hedge}" in out.engines.log
    assert ("handoff", hedge, "releasing") in out.attempts()
    assert out.router.metrics.kv_released.labels(hedge)._value.get() == 1
    assert out.router.metrics.stranded.labels(hedge, "client_abort")._value.get() == 0


def test_a_request_cancelled_before_its_decode_leg_was_sent_releases_the_kv() -> None:
    """The client leaves while the decode leg waits for a connection to its engine: the KV the
    prefill handed out would be held until its lease (nobody pulls it); a release leg to the
    decode engine pulls it instead, and runs on after the request is gone."""
    out = run([Leg("ok")], decode_connect_s=5.0)
    (prefill,) = out.engines.prefills
    assert isinstance(out.error, asyncio.CancelledError)
    assert out.engines.log == [
        f"{prefill} ok",
        "e2 decode cancelled",
        f"e2 releases from {prefill}",
    ]
    assert ("decode", "e2", "cancelled") in out.attempts()
    assert ("handoff", prefill, "releasing") in out.attempts()
    assert out.router.metrics.kv_released.labels(prefill)._value.get() == 1


def test_a_request_cancelled_after_its_decode_leg_was_sent_leaves_the_kv_to_the_engine() -> None:
    """Cancelled once the decode leg was written: the decode engine aborts it as the
    connection closes and frees the prefill engine's KV itself (vLLM notifies the prefill
    engine without a transfer): no release leg, which would pull freed blocks."""
    out = run([Leg("ok")], decode_head_s=5.0)
    (prefill,) = out.engines.prefills
    assert isinstance(out.error, asyncio.CancelledError)
    assert out.engines.log == [f"{prefill} ok", f"e2 decodes from {prefill}", "e2 decode cancelled"]
    assert not any(a[0] == "handoff" for a in out.attempts()), out.attempts()
    assert out.router.metrics.kv_released.labels(prefill)._value.get() == 0


def test_how_a_hedge_ended_when_the_slow_leg_ended_first() -> None:
    """``_hedge_end``: still running is cancelled by the race's end; one that already answered,
    was refused or failed (its own callback not yet run) is said so."""

    async def ends() -> list[str]:
        loop = asyncio.get_running_loop()
        running: asyncio.Future[object] = loop.create_future()
        answered: asyncio.Future[object] = loop.create_future()
        answered.set_result(("params", 3, None))
        refused: asyncio.Future[object] = loop.create_future()
        refused.set_exception(_EngineClientError(400, b"{}"))
        failed: asyncio.Future[object] = loop.create_future()
        failed.set_exception(_LegFailure("connection reset"))
        cancelled: asyncio.Future[object] = loop.create_future()
        cancelled.cancel()
        return [_hedge_end(f) for f in (running, answered, refused, failed, cancelled)]

    assert asyncio.run(ends()) == ["cancelled", "answered", "refused", "failed", "cancelled"]


def test_a_client_is_told_what_failed_not_the_engines_addresses() -> None:
    """Every prefill leg fails to connect: the 502 says how and on which engine, and only the
    journal's attempts (for operators) name the address the transport error gave."""
    out = run([Leg("fail", 0.0)] * 4)
    assert isinstance(out.error, RouterError) and out.error.status == 502
    assert "ClientConnectorError" in out.error.message
    assert "10.20.0.7" not in out.error.message
    assert any("10.20.0.7" in str(a.get("error")) for a in out.record.attempts)


def test_a_broken_stream_tells_its_client_the_kind_and_the_journal_the_address() -> None:
    """Mid-stream, as before the first token: the client's error event names the failure's
    kind; the whole transport text (the engine's address) is kept for the journal."""
    renderer = EventRenderer(StreamTally(), False, 1)  # no trace: nothing to migrate to
    lost = EngineTransportError(
        "ClientOSError: [Errno 104] Connection reset by peer (10.20.0.7:8100)",
        public="the connection to the engine failed (ClientOSError)",
    )
    told = renderer.ended(lost)
    assert b"the connection to the engine failed (ClientOSError)" in told
    assert b"10.20.0.7" not in told and told.endswith(b"data: [DONE]\n\n")
    assert renderer.detail is not None and "10.20.0.7" in renderer.detail
    failed = UpstreamFailed("stream_error", "decode stream broke: the kind", str(lost))
    assert "10.20.0.7" not in failed.message and "10.20.0.7" in failed.journal_error


def test_a_prefill_answer_arriving_as_the_client_leaves_has_its_kv_released() -> None:
    """The client leaves in the turn of the loop its prefill leg's whole answer arrives: the
    answer is handed back rather than dropped, and the KV it hands out goes to a release leg
    (the prefill engine would hold it for its lease otherwise)."""
    out = run([Leg("orphaned", 0.0)])
    assert isinstance(out.error, asyncio.CancelledError)
    (prefill,) = out.engines.prefills
    assert f"e2 releases from {prefill}" in out.engines.log
    assert ("handoff", prefill, "releasing") in out.attempts()
    assert not any("decodes" in line for line in out.engines.log)
    assert out.router.metrics.kv_released.labels(prefill)._value.get() == 1
