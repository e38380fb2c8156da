"""The simulator's baseline policies against the live vllm-router (0.1.17, P/D mode) on the
8-engine simulated fleet (4 prefill, 4 decode, static): for each of its policies
(round_robin, power_of_two, cache_aware) the goodput (the rate where attainment crosses 95%)
live and in the simulator agree within 10%, both interpolated from attainment at the same
rates, 15% either side of the simulator's crossing (a further rate is tried when the live
crossing lies outside them). vllm-router's ``power_of_two`` draws at random (see
``narwhal.routing.baselines``): one live run is one draw, whose goodput spreads about 28% either
side of the expected one (the simulator's seeds: 3.6 to 6.4 requests/s about 5.0 here), so
there the live goodput must lie within 10% of the range the simulator's seeds reach, a wide
check (the 10% agreement of its expected goodput is bench/baselines_agreement.py's, with
repeats, in docs/routing.md). For every policy, when the first live draw misses, a second is
taken at the same rates and their mean judged, fitted non-increasing in rate: the live side is
timed on a shared host, where one stall costs a trial several requests at once. The
workload is prefill-bound (8,192-token prompts, 32 output tokens) to keep the test near two
and a half minutes on two cores; the larger version, decode-bound with three rates and
repeats, is ``bench/baselines_agreement.py``; both use ``narwhal.fleetsim.agreement``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from narwhal.contract import FleetContract, load_fleet
from narwhal.fleetsim.agreement import (
    Calibration,
    attainment,
    calibrate,
    des_attainment,
    run_des_like_live,
)
from narwhal.fleetsim.simulator import RequestSpec
from narwhal.fleetsim.workloads import poisson_requests, timings_of
from narwhal.testing import procs
from narwhal.testing.fleet import wait_idle
from narwhal.testing.goodput import crossing_of
from narwhal.testing.ports import free_ports
from narwhal.testing.procs import wait_until
from narwhal.testing.replay import replay_streams
from narwhal.testing.routers import peer_router_command, router_ready
from tests.helpers import MODEL, RouterProcess, running_fleet, running_router

pytestmark = [pytest.mark.slow, pytest.mark.interop]

ROUTER = Path(sys.executable).parent / "vllm-router"
SCALE = 2.0
# Prefill-bound (32 output tokens drain in 5 s of wall time, 128 would take 19 s a trial):
# the bench runs the decode-bound shape, 128 output tokens.
PROMPT, OUTPUT = 8192, 32
REQUESTS = 120
# vllm-router --policy (None: its default) -> the simulator's baseline for streamed requests.
POLICIES = {
    "round_robin": ("round_robin", "round_robin"),
    "power_of_two": ("power_of_two", "vllm_power_of_two"),
    "cache_aware": (None, "cache_aware"),
}
MULTIPLES = (0.85, 1.15)  # the trial rates, around the simulator's crossing
STEP = 1.15  # a further live rate past the highest (or below the lowest), when not bracketed
MAX_TRIALS = 4
RANDOM_SEEDS = 20  # the simulator's draws of a policy that draws at random


def _ends(router: RouterProcess, count: int) -> list[dict[str, Any]]:
    wait_until(lambda: len(router.ends()) >= count, 15)
    return list(router.ends().values())


def _specs(rate: float, seed: int) -> list[RequestSpec]:
    """Wall seconds; the same draws at every rate, scaled."""
    return poisson_requests(rate * SCALE, REQUESTS, PROMPT, OUTPUT, seed=seed)


def _des_attainment(
    contract: FleetContract, calibration: Calibration, specs: list[RequestSpec], scheduler: str
) -> float:
    """Averaged over 8 seeds for the policy that draws at random (its expected curve: one live
    run is one draw of it)."""
    seeds = 8 if scheduler == "vllm_power_of_two" else 1
    return statistics.fmean(
        des_attainment(
            run_des_like_live(contract, None, specs, calibration, scheduler, seed=seed),
            specs,
            contract.budgets,
        )
        for seed in range(seeds)
    )


def _des_crossing(attainment_at: Callable[[list[RequestSpec]], float]) -> float:
    """The simulator's goodput on a 4% rate grid, attainment at each rate from
    ``attainment_at``."""
    points: list[tuple[float, float]] = []
    rate = 0.5
    while rate < 12.0:
        points.append((rate, attainment_at(_specs(rate, 5))))
        if points[-1][1] < 0.75:
            break
        rate *= 1.04
    value, how = crossing_of(points, 0.95)
    assert how == "bracketed", points
    return value


def _des_seed_crossings(
    contract: FleetContract, calibration: Calibration, scheduler: str
) -> list[float]:
    """The goodput of each of the simulator's draws of a random policy."""

    def one(seed: int) -> Callable[[list[RequestSpec]], float]:
        def attainment_at(specs: list[RequestSpec]) -> float:
            result = run_des_like_live(contract, None, specs, calibration, scheduler, seed=seed)
            return des_attainment(result, specs, contract.budgets)

        return attainment_at

    return sorted(_des_crossing(one(seed)) for seed in range(RANDOM_SEEDS))


@contextlib.contextmanager
def _vllm_router(directory: Path, contract: FleetContract, policy: str | None) -> Iterator[int]:
    port, prometheus_port = free_ports(2)
    prefill = [e.url for e in contract.engines if e.initial_role == "prefill"]
    decode = [e.url for e in contract.engines if e.initial_role == "decode"]
    url = f"http://127.0.0.1:{port}"
    with procs.running(
        peer_router_command(ROUTER, prefill, decode, port, prometheus_port, policy=policy),
        directory / f"vllm-router-{policy}.log",
        ready=functools.partial(router_ready, url, peer=True),
        name="vllm-router",
        stop_timeout=10,
    ):
        yield port


@dataclass(frozen=True)
class Stack:
    directory: Path
    contract: FleetContract
    calibration: Calibration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The 8-engine fleet (4 prefill, 4 decode, static) and one calibration of the live stack
    (through narwhal-serve, whose journal times the legs)."""
    if not ROUTER.exists():
        pytest.skip("vllm-router is not installed in this environment")
    directory = tmp_path_factory.mktemp("baselines")
    with running_fleet(
        directory,
        8,
        initial_roles=["prefill"] * 4 + ["decode"] * 4,
        roles=[["prefill"]] * 4 + [["decode"]] * 4,
        sim={"time_scale": SCALE, "max_num_seqs": 64, "num_blocks": 65536, "block_bytes": 1024},
        ttft_s=10 / SCALE,
        tpot_s=0.3 / SCALE,
        first_token_timeout_s=8.5 / SCALE,
        max_model_len=16384,
        role_control={"enabled": False},
    ) as fleet:
        contract = load_fleet(fleet.fleet_path).contract
        with running_router(directory, fleet.fleet_path, "--scheduler", "v0") as router:
            calibration = asyncio.run(
                calibrate(
                    router.url,
                    {e.id: e.url for e in contract.engines},
                    timings_of(contract),
                    [e.id for e in contract.engines if e.initial_role == "prefill"],
                    MODEL,
                    lambda n: _ends(router, n),
                    isolated=6,
                    loaded_per_engine=8,
                )
            )
        yield Stack(directory, contract, calibration)


def _non_increasing(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The least-squares non-increasing fit of attainment over rate (pool adjacent
    violators): expected attainment falls as the rate rises, so a point above a lower rate's
    is a stall of the host in one trial, not the policy's curve (a CI run's draw gave 0.78 at
    4.3 requests/s and 0.91 at 5.8)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run of rates
    ordered = sorted(points)
    for _, value in ordered:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted: list[float] = []
    for total, count in blocks:
        fitted += [total / count] * int(count)
    return [(rate, value) for (rate, _), value in zip(ordered, fitted, strict=True)]


def _live_curve(
    stack: Stack, policy: str, rates: list[float], draw: int
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Live and simulated attainment at ``rates`` and, when the live crossing lies outside
    them, at one step past them on its side (up to ``MAX_TRIALS`` rates); ``draw`` keeps each
    live draw's prompts its own."""
    flag, scheduler = POLICIES[policy]
    contract, budgets = stack.contract, stack.contract.budgets
    live_points: list[tuple[float, float]] = []
    des_points: list[tuple[float, float]] = []
    rates = list(rates)
    while rates:
        rate = rates.pop(0)
        # Its own prompts (the engines keep their prefix caches from one trial to the next).
        salt = 1000 * list(POLICIES).index(policy) + 100 * draw + len(live_points)
        specs = _specs(rate, 5)
        assert wait_idle([e.url for e in contract.engines], 60)
        with _vllm_router(stack.directory, contract, flag) as port:
            live = asyncio.run(replay_streams(port, specs, MODEL, salt=salt))
        live_points.append((rate, attainment(live, budgets)))
        des_points.append((rate, _des_attainment(contract, stack.calibration, specs, scheduler)))
        if not rates and len(live_points) < MAX_TRIALS:
            how = crossing_of(live_points, 0.95)[1]
            tried = [r for r, _ in live_points]
            if how == "above":
                rates.append(max(tried) * STEP)
            elif how == "below":
                rates.append(min(tried) / STEP)
    return live_points, des_points


@pytest.mark.parametrize("policy", list(POLICIES))
def test_baseline_goodput_agrees_with_the_live_vllm_router(stack: Stack, policy: str) -> None:
    _, scheduler = POLICIES[policy]
    contract = stack.contract
    base = _des_crossing(
        functools.partial(_des_attainment, contract, stack.calibration, scheduler=scheduler)
    )
    live_points, des_points = _live_curve(
        stack, policy, [base * multiple for multiple in MULTIPLES], draw=0
    )
    message = f"{policy}: live {live_points}, simulator {des_points}; {stack.calibration.report()}"
    live_g, live_how = crossing_of(live_points, 0.95)
    des_g, des_how = crossing_of(des_points, 0.95)
    # Shown with -rP: the figures behind a pass.
    print(f"goodput live {live_g:.3f} ({live_how}) des {des_g:.3f} ({des_how}); {message}")
    assert live_how == "bracketed", message
    if scheduler == "vllm_power_of_two":
        draws = _des_seed_crossings(contract, stack.calibration, scheduler)
        low, high = 0.9 * draws[0], 1.1 * draws[-1]
        print(f"{policy}: the simulator's {len(draws)} draws {draws[0]:.3f}..{draws[-1]:.3f}")
        if not low <= live_g <= high:
            # One live draw at a rate is one draw of the policy's coin flips, plus whatever
            # the shared two-core host did to it (a CI run once saw 0.89 where every
            # simulated draw gave 0.99): a second live draw at the same rates, and the mean
            # attainment of the two is judged, both shown.
            live_points, message = _with_a_second_draw(stack, policy, live_points, message)
            live_g, live_how = crossing_of(live_points, 0.95)
            assert live_how == "bracketed", message
        assert low <= live_g <= high, (
            f"goodput live {live_g:.3f} outside 10% of the simulator's draws "
            f"{draws[0]:.3f}..{draws[-1]:.3f}: {message}"
        )
        return
    assert des_how == "bracketed", message
    if abs(des_g - live_g) / live_g > 0.10:
        # The live side is timed on a shared two-core host (this runs in CI beside nothing,
        # but the host is not ours alone): one stall during a trial costs several requests
        # their TPOT at once. A second live draw, judged by the mean of the two, both shown;
        # a policy the simulator models wrongly misses in both.
        live_points, message = _with_a_second_draw(stack, policy, live_points, message)
        live_g, live_how = crossing_of(live_points, 0.95)
        assert live_how == "bracketed", message
    assert abs(des_g - live_g) / live_g <= 0.10, (
        f"goodput live {live_g:.3f} des {des_g:.3f}: {message}"
    )


def _with_a_second_draw(
    stack: Stack, policy: str, live_points: list[tuple[float, float]], message: str
) -> tuple[list[tuple[float, float]], str]:
    """The live curve as the mean attainment of ``live_points`` and a second live draw at the
    same rates (made non-increasing), and ``message`` naming the second draw."""
    again, _ = _live_curve(stack, policy, [rate for rate, _ in live_points], draw=1)
    second = dict(again)
    mean = _non_increasing(
        [(rate, (value + second[rate]) / 2) for rate, value in live_points if rate in second]
    )
    goodput, how = crossing_of(mean, 0.95)
    print(f"{policy}: goodput live, mean of two draws {goodput:.3f} ({how})")
    return mean, f"{message}; second live draw {again}"
