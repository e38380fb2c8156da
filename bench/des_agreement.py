"""The virtual-time simulator against the live simulated fleet, at a larger size than the test.

The same open-loop Poisson workloads go through narwhal-serve (scheduler v1, flipping off) on 8
live simulated engines (``narwhal.simengine.fleet.SimFleet``, 4 prefill / 4 decode, time scale
S: wall seconds = model seconds / S, budgets TTFT 10 s and TPOT 0.3 s divided by S) and through
the simulator (``narwhal.fleetsim``) on the same fleet file, the router's own profiles
(narwhal-profile run once on the live engines) and the per-leg HTTP overhead measured in each
live run (median prefill leg less its profiled prefill time, from the router's journal). Each
workload gets a fresh router, so the online corrections start from the profile on both sides.

Workloads (rates for 8 engines, wall seconds at S):

- ``prefill``: 1,024-token prompts, 32 output tokens (the test's shape, twice its rate);
- ``decode``: 512-token prompts, 128 output tokens, decode pools near half their batch budget;
- ``saturated``: 4,096-token prompts, 16 output tokens, the prefill pool at 90% of its capacity
  (prefill queues form; the simulator's KV transfer time is a constant 4 ms whatever the
  prompt, the live one grows with it).

The workloads sit under the budgets (attainment 1 on both sides is the expected outcome: it
checks that neither side fails or rejects what the other serves); the medians carry the signal.

Printed per workload: attainment and TTFT/TPOT medians, live and simulated, and the relative
differences against the issue's agreement target (10%). The machinery is
``narwhal.fleetsim.agreement``, shared with ``tests/integration/test_des_agreement.py``.

    .venv/bin/python bench/des_agreement.py [--time-scale 2] [--requests 240] [--seed 7]

Only 127.0.0.1 is contacted. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from narwhal.contract import load_fleet
from narwhal.fleetsim.agreement import compare, leg_overhead_s, replay, run_des_like_live
from narwhal.fleetsim.workloads import poisson_requests, timings_of
from narwhal.profiles.store import ProfileStore, engine_models
from narwhal.serve.cli import serve_command
from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet, start_local_fleet
from narwhal.testing.ports import free_ports
from narwhal.testing.profiling import profile_fleet
from narwhal.testing.routers import router_ready

MODEL = "moonshotai/Kimi-K3"
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


def journal_ends(journal: Path, expected: int, timeout: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        ends = []
        if journal.exists():
            for line in journal.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if rec.get("type") == "request.end":
                        ends.append(rec)
        if len(ends) >= expected or time.monotonic() > deadline:
            return ends
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=240, help="per workload")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-dir", action="store_true")
    args = parser.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w}")
    scale = args.time_scale
    started = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="des-agreement-"))
    out: list[str] = [
        f"command: .venv/bin/python bench/des_agreement.py {' '.join(sys.argv[1:])}".rstrip(),
        f"cpus: {os.cpu_count()}",
        "load_average_at_start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        f"fleet: {ENGINES} simulated engines, 4 prefill / 4 decode, time scale {scale:g};"
        f" budgets TTFT {REAL_TTFT_S / scale:g} s, TPOT {REAL_TPOT_S / scale:g} s wall;"
        " scheduler v1, flipping off; target |des - live| / live <= 10%",
    ]
    table = [("workload", "quantity", "live", "des", "rel diff", "within 10%")]
    verdicts = []
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
        timings = timings_of(contract)
        for i, name in enumerate(names):
            rate, prompt, output = WORKLOADS[name]
            specs = poisson_requests(
                rate=rate * scale,
                count=args.requests,
                prompt_tokens=prompt,
                output_tokens=output,
                seed=args.seed + i,
            )
            with running_router(directory, fleet_path, store, name) as (url, journal):
                time.sleep(1.5)  # load scrapes catch up with the idle fleet
                log(f"{name}: replaying {len(specs)} requests live ({specs[-1].arrival:.0f} s)")
                t = time.perf_counter()
                live = asyncio.run(replay(url, specs, MODEL))
                live_wall = time.perf_counter() - t
                ends = journal_ends(journal, len(specs))
            overhead = leg_overhead_s(ends, timings, prompt)
            legs = [
                e["t_prefill_end"] - e["t_prefill_start"]
                for e in ends
                if e.get("t_prefill_end") is not None and e.get("t_prefill_start") is not None
            ]
            leg_p50 = statistics.median(legs) if legs else float("nan")
            model_s = models["e0"].prefill.seconds(prompt)
            engine_s = timings["e0"].wall(timings["e0"].prefill.chunk_seconds(0, prompt))
            t = time.perf_counter()
            des = run_des_like_live(contract, models, specs, overhead)
            des_wall = time.perf_counter() - t
            agreement = compare(live, des, contract.budgets, overhead)
            log(f"{name}: {agreement.report()}")
            out.append(
                f"workload_{name}: {len(specs)} requests, Poisson {rate * scale:g} req/s wall,"
                f" prompt {prompt}, output {output}; live wall {live_wall:.1f} s, live failed"
                f" {agreement.live_failed}, simulator wall {des_wall:.2f} s; prefill leg p50"
                f" {leg_p50 * 1000:.1f} ms ({len(legs)} legs), the engine's prefill"
                f" {engine_s * 1000:.1f} ms (profiled {model_s * 1000:.1f} ms): leg overhead given"
                f" to the simulator {overhead * 1000:.1f} ms"
            )
            for q, lv, dv, r in agreement.rows():
                ok = abs(r) <= TOLERANCE
                table.append(
                    (name, q, f"{lv:.4f}", f"{dv:.4f}", f"{r:+.1%}", "yes" if ok else "NO")
                )
            verdicts.append(
                f"agreement_{name}: {'met' if agreement.within(TOLERANCE) else 'NOT met'}"
            )
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
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
