"""Clients that give up on a first token (``DesConfig.abandon_after_s``, as
``bench/goodput.py``'s clients do at the TTFT budget): the virtual-time simulator cancels the
request wherever it is, frees what its engines held for it, and counts it TTFT late."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.contract import parse_fleet
from narwhal.fleetsim.cli import main as fleetsim_main
from narwhal.fleetsim.simulator import DesConfig, KVBlocks, RequestSpec, _Simulation, run_des
from narwhal.fleetsim.workloads import kv_blocks_of, poisson_requests, timings_of
from narwhal.simengine.fleet import local_fleet_document

BLOCKS = 2048  # x 16 tokens: five 6,000-token prompts fill a prefill engine, so some wait


def overloaded_fleet(local: bool = False, admission: str = "reject") -> Any:
    doc = local_fleet_document(
        list(range(20000, 20003)),
        list(range(40000, 40003)),
        initial_roles=["prefill", "decode", "decode"],
        sim={"num_blocks": BLOCKS, "block_size": 16},
        ttft_s=10.0,
        tpot_s=0.3,
        first_token_timeout_s=8.5,
        role_control={"enabled": False},
        routing={
            "admission": admission,
            "local_prefill": {"enabled": local, "max_prompt_tokens": 8192},
        },
    )
    return parse_fleet(doc, "t").contract


def specs(count: int = 150, rate: float = 4.0) -> list[RequestSpec]:
    # One prefill engine takes about 1.5 of these a second: sustained overload.
    return poisson_requests(rate, count, 6000, 64, seed=5)


def simulate(config: DesConfig, requests: list[RequestSpec]) -> _Simulation:
    models = {e: t.in_wall_seconds() for e, t in config.timings.items()}
    sim = _Simulation(config, models)
    sim.run(requests)
    return sim


@pytest.mark.parametrize(
    ("scheduler", "local", "admission"),
    [
        ("round_robin", False, "reject"),  # every request admitted: queues at the engines
        ("v1", False, "queue"),  # some wait in the router's admission queue
        ("v1", True, "reject"),  # local prefills on the decode engines
    ],
)
def test_an_abandoned_request_leaves_nothing_behind(
    scheduler: str, local: bool, admission: str
) -> None:
    fleet = overloaded_fleet(local, admission)
    config = DesConfig(
        fleet,
        timings_of(fleet),
        scheduler=scheduler,
        flipping=False,
        kv_blocks=kv_blocks_of(fleet),
        abandon_after_s=10.0,
    )
    sim = simulate(config, specs())
    outcomes = [r.outcome for r in sim.requests]
    assert len(outcomes) == 150 and set(outcomes) <= {"ok", "rejected", "abandoned"}
    assert outcomes.count("abandoned") > 0
    for r in sim.requests:
        if r.outcome == "abandoned":
            assert r.first_token is None and r.last_token is None
            assert r.prefill_blocks == 0 and r.decode_blocks == 0
    check_nothing_left(sim, dict.fromkeys(sim.engines, BLOCKS))


def check_nothing_left(sim: _Simulation, blocks: dict[str, int]) -> None:
    for engine in sim.engines.values():
        assert engine.free_blocks == blocks[engine.id], engine.id
        assert not (engine.prefill_queue or engine.kv_waiting or engine.pending)
        assert not (engine.joining or engine.decoding or engine.loading)
    for state in sim.state.engines.values():
        assert state.in_flight_prefill == 0 and state.in_flight_decode == 0
        assert state.pending_decode == 0 and not state.pending_spans
    assert not sim.lifecycle.queued and not sim.by_ticket


def test_a_request_abandoned_waiting_for_or_pulling_its_kv_frees_both_engines() -> None:
    """Decode-bound: the decode engine's KV holds two legs, each pull takes seconds. Requests
    are given up on while their decode leg waits for blocks and while it pulls: the decode
    engine's blocks and the prompt KV the prefill engine held for the pull both come back."""
    fleet = overloaded_fleet()
    kv = {"e0": KVBlocks(BLOCKS, 16), "e1": KVBlocks(800, 16), "e2": KVBlocks(800, 16)}
    config = DesConfig(
        fleet,
        timings_of(fleet),
        scheduler="round_robin",
        flipping=False,
        kv_blocks=kv,
        transfer_s_per_token=0.001,  # 6 s a pull
        abandon_after_s=10.0,
    )
    sim = simulate(config, poisson_requests(0.5, 40, 6000, 64, seed=5))
    abandoned = [r for r in sim.requests if r.outcome == "abandoned"]
    assert abandoned and any(r.pulled_tokens for r in abandoned)  # some while pulling
    check_nothing_left(sim, {e: b.num_blocks for e, b in kv.items()})


def test_abandoned_requests_count_ttft_late_and_stop_loading_the_fleet() -> None:
    fleet = overloaded_fleet()
    waiting, patient = (
        run_des(
            DesConfig(
                fleet,
                timings_of(fleet),
                scheduler="round_robin",
                flipping=False,
                kv_blocks=kv_blocks_of(fleet),
                abandon_after_s=after,
            ),
            specs(),
        )
        for after in (10.0, None)
    )
    assert waiting.abandoned > 0 and patient.abandoned == 0
    assert waiting.outcomes.count("ttft_late") >= waiting.abandoned
    assert len(waiting.outcomes) == waiting.offered == 150
    # Given up, they free the prefill engine for those behind them: more meet the budgets,
    # and the fleet is done sooner, than when every late request is served to its end.
    assert waiting.met_slo > patient.met_slo
    assert waiting.duration_s < patient.duration_s


def test_narwhal_fleetsim_takes_abandon_after_s(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engines", "1:2", "--rate", "4", "--requests", "60", "--prompt-tokens", "6000"]
    assert fleetsim_main([*argv, "--scheduler", "round_robin", "--abandon-after-s", "10"]) == 0
    out = capsys.readouterr().out
    assert '"abandoned": ' in out and '"abandoned": 0,' not in out
