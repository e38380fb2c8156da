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

import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.profiles.models import DecodeLatencyModel, PrefillLatencyModel
from narwhal.profiles.store import EngineModels
from narwhal.routing.admission import Admit, Queue, Reject
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import Lifecycle
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.scheduler import Pair, SchedulerV1
from narwhal.simengine.fleet import local_fleet_document

PROMPT_TOKENS = 512


def make_lifecycle(admission: str) -> tuple[Lifecycle, VirtualClock, LatencyPredictor]:
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
    clock = VirtualClock(100.0)
    state = FleetState(fleet, clock)
    lifecycle = Lifecycle(state, SchedulerV1(predictor, fleet.budgets), predictor=predictor)
    return lifecycle, clock, predictor


def after_a_burst(predictor: LatencyPredictor) -> None:
    """What a burst on a starved machine teaches: prefills 8x, handoffs 0.9 s."""
    for _ in range(20):
        predictor.observe("e0", "prefill", 0.1, 10.0)  # clamped at the 8x bound
        predictor.observe_handoff("e1", 0.95, 0.05)


@pytest.mark.parametrize("admission", ["reject", "queue"])
@pytest.mark.parametrize("busy", ["in_flight_decode", "pending_decode", "in_flight_prefill"])
def test_an_idle_pair_takes_the_request_a_busy_one_does_not(admission: str, busy: str) -> None:
    lifecycle, clock, predictor = make_lifecycle(admission)
    after_a_burst(predictor)
    ticket = lifecycle.arrive("r1", max_tokens=24, prompt_tokens=PROMPT_TOKENS)
    pick = lifecycle.scheduler.pick(lifecycle.state, lifecycle.shape(ticket))
    assert not isinstance(pick, Pair) and pick.over_budget is not None  # the latch

    verdict = lifecycle.admit(ticket)
    assert isinstance(verdict, Admit) and verdict.idle
    assert (verdict.pair.prefill, verdict.pair.decode) == ("e0", "e1")
    lifecycle.cancel(ticket)  # the client left: the pair is idle again

    # With a decode in flight on the pair, one admitted to it, or a prefill in flight, the
    # pair is not idle: the budgets decide, as before.
    engine = lifecycle.state.engines["e0" if busy == "in_flight_prefill" else "e1"]
    setattr(engine, busy, 1)
    ticket = lifecycle.arrive("r2", max_tokens=24, prompt_tokens=PROMPT_TOKENS)
    verdict = lifecycle.admit(ticket)
    if admission == "queue":
        assert isinstance(verdict, Queue) and lifecycle.queued == 1
        clock.advance(0.31)  # past the queue's timeout
        [(left, verdict)] = lifecycle.drain()
        assert left is ticket and lifecycle.queued == 0
    assert isinstance(verdict, Reject)
    assert verdict.reason == ("over_budget" if admission == "reject" else "queue_timeout")
