"""The simulator's baseline policies against the live vllm-router: goodput, live and virtual.

One simulated fleet of 8 engines (``narwhal.testing.fleet``; 4 prefill and 4 decode, static
roles, time scale S: wall seconds = model seconds / S; budgets TTFT 10 s and TPOT 0.3 s
divided by S, attainment 95%) runs vllm-router 0.1.17 (``--vllm-pd-disaggregation``, every
engine given as ``--prefill`` or ``--decode``) with ``--policy round_robin``, ``--policy
power_of_two`` and no ``--policy`` (its default, cache_aware), as ``bench/goodput.py`` runs
it; the simulator (``narwhal.fleetsim``) runs the same fleet file with the baseline policy
that stands for each (``narwhal.routing.baselines``: round_robin; vllm_power_of_two, as
vllm-router 0.1.17's power_of_two is in P/D mode, blind to load, a uniform random choice per
role, simulated with 8 seeds and its attainment averaged; cache_aware) and one calibration of
the live stack (``narwhal.fleetsim.agreement.calibrate``, through narwhal-serve: per-leg HTTP
overhead, host work per prefill, KV transfer time), measured before any trial.

The workload is ``bench/goodput.py``'s ``fixed`` shape: Poisson arrivals, 8,192-token prompts
(random token ids: no two share a KV block), 128 output tokens, streamed, ``ignore_eos``.
vllm-router has no journal: the live figures are the client's (raw sockets,
``narwhal.testing.rawhttp``), TTFT from sending to the first token, TPOT over the rest; a
request meets the SLO when it answers with both within budget. The simulator's attainment
leaves out Narwhal's first-token deadline (vllm-router has none).

Goodput (the rate where attainment crosses 95%) is measured the same way on both sides, from
attainment at the same few rates: the simulator's crossing on a fine grid of rates first
(cheap), then ``--rates`` multiples of it (0.85, 1.0, 1.15 by default) live and in the
simulator, each rate one trial of ``--requests`` requests (the same Poisson draws scaled to
the rate, a fresh router per trial so that counters and trees start empty, as the
simulator's do); goodput is interpolated linearly between the last rate that passes and the
first that misses (``narwhal.testing.goodput.crossing_of``). Measured on the same rates, both
sides' interpolation is the same function of their attainments, so where the live and
virtual attainments agree at the bracketing rates the goodputs agree; a side whose crossing
is outside the rates is reported as a bound (``above``/``below``), not a figure.

Printed: the calibration; per policy and trial the rate, live and virtual attainment (and
TTFT/TPOT p50); per policy and repeat the live and virtual goodput, their relative
difference and whether it is within 10%; over ``--repeats`` (new Poisson draws) the range.

    .venv/bin/python bench/baselines_agreement.py [--time-scale 2] [--requests 160]
        [--repeats 1] [--policies round_robin,power_of_two,cache_aware] [--rates 0.85,1,1.15]

Only 127.0.0.1 is contacted. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from narwhal.contract import FleetContract, load_fleet
from narwhal.fleetsim.agreement import (
    Calibration,
    LiveOutcome,
    attainment,
    calibrate,
    des_attainment,
    run_des_like_live,
)
from narwhal.fleetsim.simulator import RequestSpec
from narwhal.fleetsim.workloads import poisson_requests, timings_of
from narwhal.serve.cli import serve_command
from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet, start_local_fleet, wait_idle
from narwhal.testing.goodput import bound_error, crossing_of, number_list
from narwhal.testing.journals import journal_ends
from narwhal.testing.ports import free_ports
from narwhal.testing.replay import replay_streams
from narwhal.testing.routers import peer_router_command, router_ready

MODEL = "moonshotai/Kimi-K3"
ENGINES, PREFILL = 8, 4
REAL_TTFT_S, REAL_TPOT_S, TARGET = 10.0, 0.3, 0.95
TOLERANCE = 0.10
PROMPT, OUTPUT = 8192, 128
# vllm-router --policy (None: its default, cache_aware) -> the simulator's baseline for it
# when every request streams.
POLICIES = {
    "round_robin": ("round_robin", "round_robin"),
    "power_of_two": ("power_of_two", "vllm_power_of_two"),
    "cache_aware": (None, "cache_aware"),
}
ROUTER_BIN = Path(sys.executable).parent / "vllm-router"
# A policy that draws at random is simulated with this many seeds and its attainment averaged:
# the expected curve, where one live run is one draw of it (the others are deterministic).
RANDOM_SEEDS = {"vllm_power_of_two": 8}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_fleet(directory: Path, scale: float) -> tuple[SimFleet, Path]:
    path = directory / "fleet.json"
    fleet, _ = start_local_fleet(
        path,
        ENGINES,
        log_dir=directory,
        on_retry=lambda exc: log(f"fleet did not start ({exc}); retrying on new ports"),
        initial_roles=["prefill"] * PREFILL + ["decode"] * (ENGINES - PREFILL),
        roles=[["prefill"]] * PREFILL + [["decode"]] * (ENGINES - PREFILL),
        sim={"time_scale": scale, "max_num_seqs": 64, "num_blocks": 65536, "block_bytes": 1024},
        ttft_s=REAL_TTFT_S / scale,
        tpot_s=REAL_TPOT_S / scale,
        first_token_timeout_s=0.85 * REAL_TTFT_S / scale,
        max_model_len=16384,
        role_control={"enabled": False},
        name="baselines-agreement",
    )
    return fleet, path


def calibrate_stack(directory: Path, fleet_path: Path, contract: FleetContract) -> Calibration:
    """The live stack's calibration, through narwhal-serve (its journal times the legs)."""
    port = free_ports(1)[0]
    journal = directory / "journal-calibration.jsonl"
    cmd = serve_command(
        fleet_path, port, journal, "--skip-qualification", "--scheduler", "v0",
        "--log-level", "warning",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with procs.running(
        cmd,
        directory / "router-calibration.log",
        ready=functools.partial(router_ready, url),
        name="narwhal-serve",
        stop_timeout=30,
    ):
        time.sleep(1.5)  # load scrapes catch up with the idle fleet
        return asyncio.run(
            calibrate(
                url,
                {e.id: e.url for e in contract.engines},
                timings_of(contract),
                [e.id for e in contract.engines if e.initial_role == "prefill"],
                MODEL,
                functools.partial(journal_ends, journal),
            )
        )


@contextlib.contextmanager
def vllm_router(directory: Path, contract: FleetContract, policy: str | None) -> Iterator[int]:
    """vllm-router in P/D mode on the fleet, ready; its port."""
    port, prometheus_port = free_ports(2)
    urls = {e.id: e.url for e in contract.engines}
    prefill = [urls[e.id] for e in contract.engines if e.initial_role == "prefill"]
    decode = [urls[e.id] for e in contract.engines if e.initial_role == "decode"]
    cmd = peer_router_command(ROUTER_BIN, prefill, decode, port, prometheus_port, policy=policy)
    url = f"http://127.0.0.1:{port}"
    with procs.running(
        cmd,
        directory / f"vllm-router-{policy or 'default'}.log",
        ready=functools.partial(router_ready, url, peer=True),
        name="vllm-router",
        stop_timeout=10,
    ):
        yield port


def specs_at(rate_model: float, count: int, seed: int, scale: float) -> list[RequestSpec]:
    """``count`` Poisson arrivals at ``rate_model`` requests/s of the real fleet, in wall
    seconds; one seed gives the same draws at every rate, scaled."""
    return poisson_requests(
        rate=rate_model * scale, count=count, prompt_tokens=PROMPT, output_tokens=OUTPUT, seed=seed
    )


def des_mean_attainment(
    contract: FleetContract, calibration: Calibration, specs: list[RequestSpec], scheduler: str
) -> float:
    """The simulator's attainment, averaged over seeds for a policy that draws at random."""
    return statistics.fmean(
        des_attainment(
            run_des_like_live(contract, None, specs, calibration, scheduler, seed=seed),
            specs,
            contract.budgets,
        )
        for seed in range(RANDOM_SEEDS.get(scheduler, 1))
    )


def des_goodput(
    contract: FleetContract,
    calibration: Calibration,
    scheduler: str,
    count: int,
    seed: int,
    scale: float,
) -> float:
    """The simulator's own crossing on a fine grid of rates (model requests/s)."""
    points: list[tuple[float, float]] = []
    rate = 0.5
    while rate < 12.0:
        specs = specs_at(rate, count, seed, scale)
        points.append((rate, des_mean_attainment(contract, calibration, specs, scheduler)))
        if points[-1][1] < TARGET - 0.2:
            break
        rate *= 1.03
    value, how = crossing_of(points, TARGET)
    return value if how == "bracketed" else float("nan")


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Trial:
    rate: float  # model requests/s
    live: float  # attainment
    des: float
    live_ttft_p50: float
    des_ttft_p50: float
    live_tpot_p50: float
    des_tpot_p50: float
    live_failed: int

    def row(self, scale: float) -> str:
        return (
            f"rate {self.rate:.3f}/s: attainment live {self.live:.3f} des {self.des:.3f};"
            f" TTFT p50 live {self.live_ttft_p50 * scale:.2f} des {self.des_ttft_p50 * scale:.2f}"
            f" s; TPOT p50 live {self.live_tpot_p50 * scale:.3f}"
            f" des {self.des_tpot_p50 * scale:.3f} s (model seconds);"
            f" live failed {self.live_failed}"
        )


def rel(des: float, live: float) -> float:
    return (des - live) / live if live else float("inf")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-scale",
        type=float,
        default=2.0,
        help="engines' time scale: wall seconds = model seconds / this (default %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=160, help="per trial")
    parser.add_argument("--repeats", type=int, default=1, help="new Poisson draws each")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated vllm-router policies to compare (default %(default)s)",
    )
    parser.add_argument(
        "--rates", default="0.85,1,1.15", help="trial rates, multiples of the simulator's crossing"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=11,
        help="seed of the Poisson draws and prompt salts; each repeat adds 1000 (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--keep-dir",
        action="store_true",
        help="keep the run's temporary directory instead of deleting it (its path is printed)",
    )
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            parser.error(f"unknown policy {p}: one of {', '.join(POLICIES)}")
    if not policies:
        parser.error(f"--policies: expected one or more of {', '.join(POLICIES)}")
    problem = bound_error(
        args, [("time_scale", 0, False), ("requests", 1, True), ("repeats", 1, True)]
    )
    if problem:
        parser.error(problem)
    try:
        multiples = sorted(number_list(args.rates, "--rates", float, 0, low_allowed=False))
    except ValueError as exc:
        parser.error(str(exc))
    if not ROUTER_BIN.exists():
        print(f"vllm-router is not installed ({ROUTER_BIN})", file=sys.stderr)
        return 2
    scale = args.time_scale
    salts = itertools.count(args.seed * 1_000_003)

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # through the finally blocks: every process stopped

    signal.signal(signal.SIGTERM, on_term)
    started = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="baselines-agreement-"))
    out = [
        f"command: .venv/bin/python bench/baselines_agreement.py {' '.join(sys.argv[1:])}".rstrip(),
        f"cpus: {os.cpu_count()}",
        "load_average_at_start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"fleet: {ENGINES} simulated engines, {PREFILL} prefill / {ENGINES - PREFILL} decode"
        f" (static), time scale {scale:g}; budgets TTFT {REAL_TTFT_S:g} s, TPOT"
        f" {REAL_TPOT_S:g} s (model), attainment {TARGET}; workload {PROMPT} tokens in,"
        f" {OUTPUT} out, Poisson, streamed; {args.requests} requests per trial; rates in"
        " model requests/s (wall = rate x time scale)",
    ]
    # policy -> per repeat: (live goodput, how, des goodput, how, des fine-grid goodput, trials)
    results: dict[str, list[tuple[float, str, float, str, float, list[Trial]]]] = {
        p: [] for p in policies
    }
    fleet: SimFleet | None = None
    try:
        log(f"starting {ENGINES} simulated engines in {directory}")
        fleet, fleet_path = start_fleet(directory, scale)
        contract = load_fleet(fleet_path).contract
        budgets = contract.budgets
        urls = [e.url for e in contract.engines]
        log("calibrating the live stack through narwhal-serve")
        calibration = calibrate_stack(directory, fleet_path, contract)
        out.append(f"calibration: {calibration.report()}")
        log(f"calibration: {calibration.report()}")
        for repeat in range(args.repeats):
            seed = args.seed + 1000 * repeat
            for policy in policies:
                flag, scheduler = POLICIES[policy]
                fine = des_goodput(contract, calibration, scheduler, args.requests, seed, scale)
                base = 2.0 if math.isnan(fine) else fine  # (nan: no crossing found)
                trials: list[Trial] = []
                for m in multiples:
                    rate = base * m
                    specs = specs_at(rate, args.requests, seed, scale)
                    if not wait_idle(urls, 60):
                        log("warning: the fleet is not idle before the trial")
                    with vllm_router(directory, contract, flag) as port:
                        time.sleep(1.0)
                        log(f"{policy} #{repeat + 1}: {len(specs)} requests at {rate:.3f}/s")
                        live: list[LiveOutcome] = asyncio.run(
                            # A salt of its own per trial: no prompt is sent twice to the fleet,
                            # whose engines keep their prefix caches from trial to trial.
                            replay_streams(port, specs, MODEL, salt=next(salts))
                        )
                    des = run_des_like_live(contract, None, specs, calibration, scheduler)
                    answered = [o for o in live if o.status == 200 and o.ttft is not None]
                    trial = Trial(
                        rate=rate,
                        live=attainment(live, budgets),
                        des=des_mean_attainment(contract, calibration, specs, scheduler),
                        live_ttft_p50=p50([o.ttft for o in answered if o.ttft is not None]),
                        des_ttft_p50=p50(des.ttft),
                        live_tpot_p50=p50([o.tpot for o in answered if o.tpot is not None]),
                        des_tpot_p50=p50(des.tpot),
                        live_failed=len(live) - len(answered),
                    )
                    log(f"{policy} #{repeat + 1}: {trial.row(scale)}")
                    trials.append(trial)
                live_g, live_how = crossing_of([(t.rate, t.live) for t in trials], TARGET)
                des_g, des_how = crossing_of([(t.rate, t.des) for t in trials], TARGET)
                results[policy].append((live_g, live_how, des_g, des_how, fine, trials))
    finally:
        if fleet is not None:
            fleet.stop()
        if args.keep_dir:
            out.append(f"kept: {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    for policy, runs in results.items():
        for repeat, (_, _, _, _, fine, trials) in enumerate(runs):
            out.append(
                f"trials_{policy}_{repeat + 1}: simulator's own crossing (fine grid)"
                f" {fine:.3f}/s; " + " | ".join(t.row(scale) for t in trials)
            )
    out.append("load_average_at_end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    out.append(f"bench_wall_s: {time.perf_counter() - started:.0f}")
    print("\n".join(out))
    print()
    table = [
        ("policy", "run", "live goodput", "des goodput", "rel diff", f"within {TOLERANCE:.0%}")
    ]
    verdicts = []
    for policy, runs in results.items():
        diffs = []
        for repeat, (live_g, live_how, des_g, des_how, _, _) in enumerate(runs):
            ok = live_how == des_how == "bracketed" and abs(rel(des_g, live_g)) <= TOLERANCE
            diff = rel(des_g, live_g)
            diffs.append(diff)
            table.append(
                (
                    policy,
                    str(repeat + 1),
                    f"{live_g:.3f}" + ("" if live_how == "bracketed" else f" ({live_how})"),
                    f"{des_g:.3f}" + ("" if des_how == "bracketed" else f" ({des_how})"),
                    f"{diff:+.1%}",
                    "yes" if ok else "NO",
                )
            )
        if diffs:
            met = all(row[5] == "yes" for row in table[1:] if row[0] == policy)
            verdicts.append(
                f"agreement_{policy}: goodput rel diff {min(diffs):+.1%}..{max(diffs):+.1%}"
                f" over {len(diffs)} runs; {'met' if met else 'NOT met'}"
            )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
