"""The virtual-time simulator runs scheduler v1's local-prefill picks (routing.local_prefill)."""

from __future__ import annotations

from narwhal.contract import parse_fleet
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, _Simulation
from narwhal.fleetsim.workloads import poisson_requests, timings_of
from narwhal.simengine.fleet import local_fleet_document


def simulate(enabled: bool, specs: list[RequestSpec]) -> _Simulation:
    doc = local_fleet_document(
        list(range(20000, 20004)),
        list(range(40000, 40004)),
        initial_roles=["prefill", "prefill", "decode", "decode"],
        ttft_s=10.0,
        tpot_s=0.3,
        first_token_timeout_s=8.5,
        role_control={"enabled": False},
        routing={"local_prefill": {"enabled": enabled, "max_prompt_tokens": 1024}},
    )
    fleet = parse_fleet(doc, "t").contract
    timings = timings_of(fleet)
    models = {e: t.in_wall_seconds() for e, t in timings.items()}
    sim = _Simulation(DesConfig(fleet, timings, flipping=False), models)
    sim.run(specs)
    return sim


def short_and_long(count: int) -> list[RequestSpec]:
    out = []
    for i, spec in enumerate(poisson_requests(2.0, count, 0, 32, seed=3)):
        out.append(RequestSpec(spec.arrival, 300 if i % 2 == 0 else 6000, spec.output_tokens))
    return out


def test_local_picks_are_simulated_and_every_request_completes() -> None:
    specs = short_and_long(200)
    sim = simulate(True, specs)
    local = [r for r in sim.requests if r.local]
    assert local and all(r.spec.prompt_tokens == 300 for r in local)
    assert all(r.prefill == r.decode for r in local)
    assert all(r.outcome == "ok" and r.first_token is not None for r in sim.requests)
    for r in local:
        assert r.spec.arrival <= r.first_token <= r.last_token  # type: ignore[operator]
    # Every leg and every queued local prefill is accounted for once the run ends.
    for engine in sim.state.engines.values():
        assert engine.in_flight_decode == 0 and engine.in_flight_prefill == 0
        assert not engine.prefill_work and engine.pending_decode == 0
    for engine in sim.engines.values():
        assert not engine.decoding and not engine.prefill_queue and engine.context_sum == 0
    # The local legs correct their engines' local predictions, and a perfect profile stays
    # inside the drift band.
    lo, hi = sim.predictor.drift_band
    for engine_id in {r.decode for r in local}:
        ewma = sim.predictor.ratios[(engine_id, "local")]
        assert ewma.samples > 0 and lo <= ewma.value <= hi, (engine_id, ewma)


def test_without_the_option_nothing_is_local() -> None:
    sim = simulate(False, short_and_long(60))
    assert not any(r.local for r in sim.requests)
    assert all(r.outcome == "ok" for r in sim.requests)
