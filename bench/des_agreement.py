"""The virtual-time simulator against the live simulated fleet, at a larger size than the test.

The same open-loop workloads go through narwhal-serve (scheduler v1, flipping off) on 8 live
simulated engines (``narwhal.testing.fleet``, 4 prefill / 4 decode, time scale S: wall seconds
= model seconds / S, budgets TTFT 10 s and TPOT 0.3 s divided by S) and through the simulator
(``narwhal.fleetsim``) on the same fleet file, the router's own profiles (narwhal-profile run
once on the live engines) and one calibration of the live stack, measured before any workload
and the same for all of them (``narwhal.fleetsim.agreement.calibrate``: the per-leg HTTP
overhead from isolated requests, the host's step inflation from a burst, the KV transfer time
against prompt length). Each workload run gets a fresh router, so the online corrections start
from the profile on both sides.

Workloads (rates for 8 engines, in model seconds):

- ``prefill``: Poisson, 1,024-token prompts, 32 output tokens;
- ``decode``: Poisson, 512-token prompts, 128 output tokens, decode pools near half their batch;
- ``saturated``: Poisson, 4,096-token prompts, 16 output tokens, the prefill pool at 90% of its
  capacity (prefill queues form; decode engines fill their KV caches with long prompts);
- ``azure``: the Azure code trace's own arrivals, prompt and output lengths (a consecutive
  slice, a different one per repeat; prompts capped at 8,192 tokens, outputs at 128), its rate
  scaled so the prefill pool is 65% busy on average (``--azure-load``): bursts queue and
  drain (TTFT p90 up to 3.5 s against 0.43 s unloaded, a few requests rejected). At 75% the
  first slice's burst sat at the router's admission threshold, where the live fleet itself
  swung between 6 and 19 rejections of 240 from one run of the same requests to the next.

TTFT percentiles run over the offered requests (one never answered, rejected at admission or
failed, counts as infinitely late), TPOT percentiles over the answered ones: over answered
requests alone, the side that rejected a few more in a burst showed the shorter tail. The live
figures are the router's own (its journal: from each request's arrival to its first
and last token), as the simulator's are; the client's figures for the same requests are printed
beside them (``client_side_<run>``) with the client's lag (its TTFT less the router's): on two
cores shared with the fleet, the load generator falls behind in bursts.

Each workload runs ``--repeats`` times (new seeds or trace slices). Printed: the calibration
with its spread; per workload and quantity (attainment, TTFT p50/p90, TPOT p50/p90) the live
and simulated values of every repeat, the relative differences, their range, and whether every
repeat is within the issue's 10%; and the step inflation each workload itself produced
(evidence for the calibration, not given to the simulator). The machinery is
``narwhal.fleetsim.agreement``, shared with ``tests/integration/test_des_agreement.py``.

    .venv/bin/python bench/des_agreement.py [--time-scale 2] [--requests 240] [--repeats 3]

Only 127.0.0.1 is contacted. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from narwhal.contract import load_fleet
from narwhal.fleetsim.agreement import (
    Agreement,
    LiveOutcome,
    calibrate,
    compare,
    engine_counters,
    host_seconds,
    replay,
    router_outcomes,
    run_des_like_live,
    step_inflation,
)
from narwhal.fleetsim.simulator import RequestSpec
from narwhal.fleetsim.workloads import (
    poisson_requests,
    read_azure_trace,
    timings_of,
    trace_requests,
)
from narwhal.profiles.store import ProfileStore, engine_models
from narwhal.serve.cli import serve_command
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet, start_local_fleet
from narwhal.testing.journals import journal_ends
from narwhal.testing.ports import free_ports
from narwhal.testing.profiling import profile_fleet
from narwhal.testing.routers import router_ready
from narwhal.testing.traces import trace_dir

ROOT = Path(__file__).resolve().parent.parent
MODEL = "moonshotai/Kimi-K3"
PREFILL_IDS = ("e0", "e1", "e2", "e3")
DECODE_IDS = ("e4", "e5", "e6", "e7")
REAL_TTFT_S = 10.0
REAL_TPOT_S = 0.3
ENGINES = 8
TOLERANCE = 0.10
# name -> (requests/s per 8 engines in model time, prompt tokens, output tokens)
WORKLOADS = {
    "prefill": (2.4, 1024, 32),
    "decode": (2.0, 512, 128),
    "saturated": (8.0, 4096, 16),
}
NAMES = [*WORKLOADS, "azure"]
AZURE_CODE = trace_dir("azure-llm-2023", ROOT) / "AzureLLMInferenceTrace_code.csv"
AZURE_LOAD = 0.65
AZURE_MAX_OUTPUT = 128


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_fleet(directory: Path, scale: float) -> tuple[SimFleet, Path]:
    path = directory / "fleet.json"
    fleet, _ = start_local_fleet(
        path,
        ENGINES,
        log_dir=directory,
        on_retry=lambda exc: log(f"fleet did not start ({exc}); retrying on new ports"),
        initial_roles=["prefill"] * 4 + ["decode"] * 4,
        sim={"time_scale": scale},
        ttft_s=REAL_TTFT_S / scale,
        tpot_s=REAL_TPOT_S / scale,
        first_token_timeout_s=0.85 * REAL_TTFT_S / scale,
        role_control={"enabled": False},
        name="des-agreement",
    )
    return fleet, path


def profile(directory: Path, fleet_path: Path) -> Path:
    return profile_fleet(
        directory,
        fleet_path,
        "--prefill-lens", "256,1024,2048",
        "--decode-input-lens", "512,1024",
        "--decode-concurrency", "1,2,4",
        "--decode-tokens", "16",
        "--prefill-repeats", "2",
        store="store.json",
    )  # fmt: skip


@contextlib.contextmanager
def running_router(
    directory: Path, fleet_path: Path, store: Path, name: str
) -> Iterator[tuple[str, Path]]:
    """narwhal-serve (scheduler v1) on the fleet, ready; (its URL, its journal)."""
    port = free_ports(1)[0]
    journal = directory / f"journal-{name}.jsonl"
    log_path = directory / f"router-{name}.log"
    cmd = serve_command(
        fleet_path, port, journal,
        "--skip-qualification",
        "--profiles", str(store), "--scheduler", "v1",
        "--log-level", "warning",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    ready = functools.partial(router_ready, url)
    with procs.running(cmd, log_path, ready=ready, name="router", stop_timeout=30):
        yield url, journal


async def replay_sampling_scrapes(
    url: str, specs: list[RequestSpec], engines: dict[str, str], label: str
) -> tuple[list[LiveOutcome], list[float]]:
    """The workload through the router, and meanwhile, once a second, how long each engine's
    /metrics takes to answer: the lag of what the router's scrape reads (the simulator reads
    its engines' load instantly)."""
    done = asyncio.Event()
    latencies: list[float] = []

    async def sample() -> None:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            while not done.is_set():
                for engine_url in engines.values():
                    t = time.perf_counter()
                    await client.get(engine_url + "/metrics")
                    latencies.append(time.perf_counter() - t)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 1.0)

    sampler = asyncio.create_task(sample())
    try:
        return await replay(url, specs, MODEL, id_prefix=label), latencies
    finally:
        done.set()
        await sampler


def client_lag(client: list[LiveOutcome], router: list[LiveOutcome]) -> str:
    """How much later the client saw each first token than the router did (its own lag)."""
    lags = sorted(
        c.ttft - r.ttft
        for c, r in zip(client, router, strict=True)
        if c.ttft is not None and r.ttft is not None
    )
    if not lags:
        return "client lag: no request answered on both sides"
    return (
        f"client's TTFT less the router's: p50 {statistics.median(lags) * 1000:.1f} ms,"
        f" max {lags[-1] * 1000:.1f} ms"
    )


def workload_specs(
    name: str, requests: int, seed: int, repeat: int, scale: float, azure_load: float = AZURE_LOAD
) -> list[RequestSpec]:
    """The workload's requests in wall seconds (repeat r: its own seed or trace slice)."""
    if name == "azure":
        rows = read_azure_trace(AZURE_CODE, limit=requests * (repeat + 1), max_prompt=8192)
        rows = rows[requests * repeat :]
        t0 = rows[0][0]
        # Outputs capped (the trace's reach 841 tokens, two minutes of decode at this scale).
        rows = [(t - t0, p, min(g, AZURE_MAX_OUTPUT)) for t, p, g in rows]
        # The prefill pool busy ``azure_load`` of the slice's span on average.
        work = sum(CALIBRATION.prefill.chunk_seconds(0, p) for _, p, _ in rows)
        rate_scale = azure_load * rows[-1][0] * 4 / work
        return trace_requests(rows, rate_scale * scale)
    rate, prompt, output = WORKLOADS[name]
    return poisson_requests(
        rate=rate * scale,
        count=requests,
        prompt_tokens=prompt,
        output_tokens=output,
        seed=seed + 101 * repeat + list(WORKLOADS).index(name),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-scale",
        type=float,
        default=2.0,
        help="engines' time scale: wall seconds = model seconds / this (default %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=240, help="per workload run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per workload")
    parser.add_argument(
        "--workloads",
        default=",".join(NAMES),
        help="comma-separated workloads to run (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=7,
        help="seed of the calibration and the Poisson workloads' arrivals (default %(default)s)",
    )
    parser.add_argument(
        "--azure-load",
        type=float,
        default=AZURE_LOAD,
        help="the azure workload's mean prefill pool load",
    )
    parser.add_argument(
        "--keep-dir",
        action="store_true",
        help="keep the run's temporary directory instead of deleting it (its path is printed)",
    )
    args = parser.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in NAMES:
            parser.error(f"unknown workload {w}")
    if "azure" in names and not AZURE_CODE.exists():
        parser.error(f"the azure workload needs {AZURE_CODE}")
    scale = args.time_scale
    started = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="des-agreement-"))
    out: list[str] = [
        f"command: .venv/bin/python bench/des_agreement.py {' '.join(sys.argv[1:])}".rstrip(),
        f"cpus: {os.cpu_count()}",
        "load_average_at_start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"fleet: {ENGINES} simulated engines, 4 prefill / 4 decode, time scale {scale:g};"
        f" budgets TTFT {REAL_TTFT_S / scale:g} s, TPOT {REAL_TPOT_S / scale:g} s wall;"
        f" scheduler v1, flipping off; {args.repeats} runs per workload;"
        f" target |des - live| / live <= {TOLERANCE:.0%} in every run",
    ]
    # Per workload, per run: (the simulator on the calibration, on the run's own host work).
    runs: dict[str, list[tuple[Agreement, Agreement]]] = {name: [] for name in names}
    fleet: SimFleet | None = None
    try:
        log(f"starting {ENGINES} simulated engines in {directory}")
        fleet, fleet_path = start_fleet(directory, scale)
        log("profiling the fleet (narwhal-profile)")
        t = time.perf_counter()
        store = profile(directory, fleet_path)
        out.append(f"profile_wall_s: {time.perf_counter() - t:.1f}")
        models = engine_models(ProfileStore.model_validate_json(store.read_text()))
        pf, df = models["e0"].prefill, models["e0"].decode
        out.append(
            f"profile_e0: prefill a={pf.a * scale:.4f} b={pf.b * scale:.3e} c={pf.c * scale:.3e};"
            f" decode intercept={df.intercept * scale:.4f} slope={df.slope * scale:.5f}"
            f" ctx={df.ctx_coef * scale:.2e} (model s; calibration 0.02 1e-4 1.2e-9;"
            " 0.24 0.0015 1.3e-7)"
        )
        contract = load_fleet(fleet_path).contract
        engines = {e.id: e.url for e in contract.engines}
        with running_router(directory, fleet_path, store, "calibration") as (url, journal):
            time.sleep(1.5)  # load scrapes catch up with the idle fleet
            log("calibrating the live stack (isolated requests, then a steady load)")
            calibration = asyncio.run(
                calibrate(
                    url,
                    engines,
                    timings_of(contract),
                    PREFILL_IDS,
                    MODEL,
                    functools.partial(journal_ends, journal),
                    seed=args.seed,
                )
            )
        log(f"calibration: {calibration.report()}")
        out.append(f"calibration: {calibration.report()}")
        out.append(
            "calibration_isolated_host: "
            + " ".join(f"{n}:{h * 1000:.2f}ms" for n, h in calibration.isolated_host)
        )
        out.append(
            "calibration_transfers: "
            + " ".join(f"{n}:{s * 1000:.2f}ms" for n, s in calibration.transfers)
        )
        for name in names:
            for repeat in range(args.repeats):
                specs = workload_specs(
                    name, args.requests, args.seed, repeat, scale, args.azure_load
                )
                label = f"{name}-{repeat + 1}"
                with running_router(directory, fleet_path, store, label) as (url, journal):
                    time.sleep(1.5)
                    log(
                        f"{label}: replaying {len(specs)} requests live ({specs[-1].arrival:.0f} s)"
                    )
                    before = asyncio.run(engine_counters(engines))
                    t = time.perf_counter()
                    client, scrapes = asyncio.run(
                        replay_sampling_scrapes(url, specs, engines, label)
                    )
                    live_wall = time.perf_counter() - t
                    after = asyncio.run(engine_counters(engines))
                    live = router_outcomes(journal_ends(journal, len(specs)), len(specs), label)
                # The host work per prefill this run's engines reported, against what the
                # calibration predicts for the same prompts.
                answered = [s for s, o in zip(specs, live, strict=True) if o.status == 200]
                mean_prompt = statistics.fmean(s.prompt_tokens for s in answered)
                run_host = host_seconds(before, after, PREFILL_IDS) / len(answered)
                t = time.perf_counter()
                des = run_des_like_live(contract, models, specs, calibration)
                des_wall = time.perf_counter() - t
                given = calibration.with_host_s(run_host, mean_prompt)
                des_given = run_des_like_live(contract, models, specs, given)
                agreement = compare(live, des, contract.budgets)
                agreement_given = compare(live, des_given, contract.budgets)
                client_side = compare(client, des, contract.budgets)
                runs[name].append((agreement, agreement_given))
                log(f"{label}: calibrated: {agreement.report()}")
                log(f"{label}: run's host work: {agreement_given.report()}")
                inflation = " ".join(
                    f"{v:.3f}"
                    for e, v in sorted(step_inflation(before, after).items())
                    if e in DECODE_IDS
                )
                out.append(
                    f"run_{label}: {len(specs)} requests over {specs[-1].arrival:.1f} s wall,"
                    f" prompts mean {statistics.fmean(s.prompt_tokens for s in specs):.0f},"
                    f" outputs mean {statistics.fmean(s.output_tokens for s in specs):.1f};"
                    f" live wall {live_wall:.1f} s, {agreement.failures()},"
                    f" simulator wall {des_wall:.2f} s; host work per prefill measured"
                    f" {run_host * 1000:.1f} ms, calibration"
                    f" {calibration.host_s(mean_prompt) * 1000:.1f} ms; decode engines' step"
                    f" inflation {inflation}; an engine's /metrics answered in"
                    f" {statistics.median(scrapes) * 1000:.1f} ms p50,"
                    f" {max(scrapes) * 1000:.1f} ms max ({len(scrapes)} reads);"
                    f" {client_lag(client, live)}"
                )
                out.append(f"client_side_{label}: {client_side.report()}")
    finally:
        if fleet is not None:
            fleet.stop()
        if not args.keep_dir:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            out.append(f"kept: {directory}")
    out.append("load_average_at_end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    out.append(f"bench_wall_s: {time.perf_counter() - started:.0f}")
    print("\n".join(out))
    print()
    table = [
        ("workload", "quantity", "run", "live", "des", "rel diff", "des (run's host)", "rel diff")
    ]
    within = f"within {TOLERANCE:.0%}"
    summary = [
        ("workload", "quantity", "diff range", within, "diff range (run's host)", within),
    ]
    verdicts = []
    for name, pairs in runs.items():
        if not pairs:
            continue
        for k, (calibrated, given) in enumerate(pairs):
            for (q, lv, dv, r), given_row in zip(calibrated.rows(), given.rows(), strict=True):
                gv, gr = given_row[2], given_row[3]
                cells = [f"{lv:.4f}", f"{dv:.4f}", f"{r:+.1%}", f"{gv:.4f}", f"{gr:+.1%}"]
                table.append((name, q, str(k + 1), *cells))
        for q, *_ in pairs[0][0].rows():
            cells = []
            for side in (0, 1):
                diffs = [next(r for r in pair[side].rows() if r[0] == q)[3] for pair in pairs]
                ok = all(abs(d) <= TOLERANCE for d in diffs)
                cells += [f"{min(diffs):+.1%}..{max(diffs):+.1%}", "yes" if ok else "NO"]
            summary.append((name, q, *cells))
        for side, how in ((0, "calibrated"), (1, "given each run's host work")):
            met = all(pair[side].within(TOLERANCE) for pair in pairs)
            verdict = "met" if met else "NOT met"
            verdicts.append(f"agreement_{name} ({how}): {verdict} in {len(pairs)} runs")
    for rows in (table, summary):
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
