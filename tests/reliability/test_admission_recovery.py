"""Admission after a burst: learnt predictions must not lock an idle fleet out.

Scheduler v1 multiplies its profiled predictions by corrections learnt from the requests it
serves. A burst can push them past the budgets; admission then rejects every request, no
request is served, nothing is observed, and nothing ever brings the corrections back: before
the fix, an idle fleet answered 429 to everything, for good, after three seconds of overload
(``tests/reliability/test_overload.py`` shows it live). Now an idle pair always takes the
request, and its measurement corrects the predictions; a busy pair still rejects.

In process, no engines: the router's admission step on a state that the test sets.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from narwhal.clock import MonotonicClock
from narwhal.contract import parse_fleet
from narwhal.metrics import RouterMetrics
from narwhal.profiles.models import DecodeLatencyModel, PrefillLatencyModel
from narwhal.profiles.store import EngineModels
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.scheduler import Pair, SchedulerV1
from narwhal.serve.errors import RouterError
from narwhal.serve.pd import PDRouter
from narwhal.serve.record import RequestRecord
from narwhal.serve.validation import ClientRequest, parse_client_request
from narwhal.simengine.fleet import local_fleet_document

PROMPT = list(range(300, 812))  # 512 tokens


def make_router(admission: str) -> tuple[PDRouter, FleetState, LatencyPredictor]:
    doc = local_fleet_document(
        [1, 2],
        [3, 4],
        initial_roles=["prefill", "decode"],
        ttft_s=1.0,
        tpot_s=0.066,
        first_token_timeout_s=0.9,
        routing={"admission": admission, "queue_timeout_s": 0.3},
    )
    fleet = parse_fleet(doc, "fleet.json").contract
    models = {
        e.id: EngineModels(
            PrefillLatencyModel(0.01, 5e-5, 0.0, 64, 8192),
            DecodeLatencyModel(0.02, 0.01, 0.0, 64, 16384),
            None,
        )
        for e in fleet.engines
    }
    predictor = LatencyPredictor(models)
    state = FleetState(fleet, MonotonicClock())
    metrics = RouterMetrics([e.id for e in fleet.engines], fleet.name, "0" * 64, None)
    router = PDRouter(
        fleet,
        state,
        SchedulerV1(predictor, fleet.budgets),
        None,  # type: ignore[arg-type] - admission never calls an engine
        metrics,
        30.0,
        predictor,
    )
    return router, state, predictor


def after_a_burst(predictor: LatencyPredictor) -> None:
    """What a burst on a starved machine teaches: prefills 8x, handoffs 0.9 s."""
    for _ in range(20):
        predictor.observe("e0", "prefill", 0.1, 10.0)  # clamped at the 8x bound
        predictor.observe_handoff("e1", 0.95, 0.05)


def request() -> tuple[ClientRequest, RequestRecord]:
    raw = f'{{"model": "moonshotai/Kimi-K3", "prompt": {PROMPT}, "max_tokens": 24}}'.encode()
    creq = parse_client_request(raw, False, "moonshotai/Kimi-K3", 16384)
    record = RequestRecord(
        id="r", arrival=time.time(), arrival_mono=time.monotonic(), endpoint="/v1/completions"
    )
    return creq, record


@pytest.mark.parametrize("admission", ["reject", "queue"])
@pytest.mark.parametrize("busy", ["in_flight_decode", "pending_decode", "in_flight_prefill"])
def test_an_idle_pair_takes_the_request_a_busy_one_does_not(admission: str, busy: str) -> None:
    router, state, predictor = make_router(admission)
    after_a_burst(predictor)
    creq, record = request()
    pick = router.scheduler.pick(state, router.shape(creq, record))
    assert not isinstance(pick, Pair) and pick.over_budget is not None  # the latch

    pair = asyncio.run(router._admit(creq, record))
    assert (pair.prefill, pair.decode) == ("e0", "e1")
    assert [(a["leg"], a["outcome"]) for a in record.attempts] == [("admission", "idle_pair")]

    # With a decode in flight on the pair, one admitted to it, or a prefill in flight, the
    # pair is not idle: the budgets decide, as before.
    engine = state.engines["e0" if busy == "in_flight_prefill" else "e1"]
    setattr(engine, busy, 1)
    creq, record = request()
    with pytest.raises(RouterError) as refused:
        asyncio.run(router._admit(creq, record))
    assert refused.value.status == 429
    assert refused.value.code == ("over_budget" if admission == "reject" else "queue_timeout")
