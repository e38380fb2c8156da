"""Which engines the router's /tokenize passthrough tries, in which order."""

from __future__ import annotations

from narwhal.clock import VirtualClock
from narwhal.contract import parse_fleet
from narwhal.routing.breaker import BreakerState
from narwhal.routing.fleet_state import FleetState
from narwhal.serve.tokenizer_calls import tokenize_candidates
from narwhal.simengine.fleet import local_fleet_document


def _state(engines: int) -> FleetState:
    doc = local_fleet_document(list(range(9000, 9000 + engines)), list(range(9100, 9100 + engines)))
    return FleetState(parse_fleet(doc, "test").contract, VirtualClock(100.0))


def test_any_role_taken_in_turn() -> None:
    state = _state(3)
    assert {e.role for e in state.engines.values()} == {"prefill", "decode"}
    assert tokenize_candidates(state, 0) == ["e0", "e1", "e2"]
    assert tokenize_candidates(state, 1) == ["e1", "e2", "e0"]
    assert tokenize_candidates(state, 5) == ["e2", "e0", "e1"]


def test_closed_and_not_draining_first_then_draining_then_broken_never_down() -> None:
    state = _state(5)
    engines = state.engines
    engines["e0"].breaker.state = BreakerState.OPEN
    engines["e1"].draining_from = "prefill"
    engines["e2"].healthy = False
    engines["e3"].healthy = True
    assert tokenize_candidates(state, 0) == ["e3", "e4", "e1", "e0"]
    assert tokenize_candidates(state, 1) == ["e4", "e3", "e1", "e0"]


def test_no_engine_up_is_an_empty_list() -> None:
    state = _state(2)
    for engine in state.engines.values():
        engine.healthy = False
    assert tokenize_candidates(state, 0) == []
