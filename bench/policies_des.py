"""Goodput of Narwhal's schedulers against the baseline policies, in virtual time.

Each system (``--systems``: Narwhal ``v1`` and ``v0``, and the baselines of
``narwhal.routing.baselines``: ``round_robin``, ``power_of_two``, ``least_outstanding``) routes
the same workloads through the virtual-time simulator (``narwhal.fleetsim``) on synthetic fleets
of each ``--sizes`` engines (half prefill, half decode, static: no role flipping, so every
system gets the same split), on the simulator's calibration (``narwhal.simengine.timing``),
budgets TTFT 10 s and TPOT 0.3 s, attainment target 95%.

Workloads (``--workloads``), each run over ``--windows`` different stretches of its source,
``--requests-per-engine`` requests per engine each:

- ``code`` / ``conv``: consecutive requests of the Azure LLM inference traces (2023-11-16; code:
  long prompts, short answers; conversation: the opposite), prompts capped at 8,192 tokens,
  their recorded arrival pattern compressed or stretched to the offered rate; window k starts
  k x ``--window-stride`` requests into the trace;
- ``fixed``: 8,192-token prompts and 128-token answers, Poisson arrivals (a seed per window).

Goodput is the highest offered rate (requests/s) at which the requests of all windows together
meet both budgets at least 95% of the time (met / offered): found by doubling or halving from a
capacity estimate until the target is bracketed, then bisection to ``--precision`` (relative),
then linear interpolation of attainment between the bracket's ends. The simulator is
deterministic, so there is no trial noise to repeat away; what varies is the workload, which is
why each point pools several windows, and the table prints each window's own attainment at the
goodput found.

Printed (stdout): per fleet size and workload, each system's goodput, attainment at that rate
per window, its misses (rejected, TTFT late, TPOT late) and the ratio of v1 to the best baseline
(round robin, power of two, least outstanding).

    .venv/bin/python bench/policies_des.py [--sizes 8,64] [--workloads code,conv,fixed]
        [--systems v1,round_robin,power_of_two,least_outstanding] [--windows 3]

Contacts nothing; one process. About two minutes at 8 and 64 engines (``v0``, which scores
every pair, takes five more per search at 64); 512 takes far longer.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from narwhal.contract import FleetContract
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, run_des
from narwhal.fleetsim.workloads import poisson_requests, read_azure_trace, synthetic_fleet
from narwhal.profiles.models import EngineModels
from narwhal.routing.baselines import BASELINES
from narwhal.simengine.timing import CALIBRATION

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "azure-llm-2023"
TRACES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}
TTFT_S, TPOT_S, TARGET = 10.0, 0.3, 0.95
MAX_PROMPT = 8192
SYSTEMS = ["v1", "v0", *BASELINES]


@dataclass(frozen=True)
class Point:
    rate: float
    attainment: float  # met / offered over all windows
    per_window: tuple[float, ...]
    rejected: int
    ttft_late: int  # answered, first token after the TTFT budget
    tpot_late: int  # answered in time, but TPOT over budget or the first-token deadline missed


def windows(
    workload: str, count: int, n_windows: int, stride: int, seed: int
) -> list[list[tuple[float, int, int]]]:
    """Each window's (arrival in its source's seconds, prompt, output) rows."""
    if workload == "fixed":
        return [
            [(s.arrival, s.prompt_tokens, s.output_tokens) for s in
             poisson_requests(1.0, count, MAX_PROMPT, 128, seed + k)]
            for k in range(n_windows)
        ]  # fmt: skip
    rows = read_azure_trace(
        DATA_DIR / TRACES[workload], (n_windows - 1) * stride + count, MAX_PROMPT
    )
    out = []
    for k in range(n_windows):
        window = rows[k * stride : k * stride + count]
        t0 = window[0][0]
        out.append([(t - t0, p, g) for t, p, g in window])
    return out


def at_rate(rows: list[tuple[float, int, int]], rate: float) -> list[RequestSpec]:
    """The window's arrival pattern scaled to a mean of ``rate`` requests/s."""
    span = rows[-1][0] or 1.0
    scale = (len(rows) / span) / rate  # new time = old time x scale
    return [RequestSpec(t * scale, p, g) for t, p, g in rows]


def measure(
    fleet: FleetContract,
    timings: dict[str, EngineModels],
    system: str,
    all_rows: list[list[tuple[float, int, int]]],
    rate: float,
    seed: int,
) -> Point:
    met = offered = rejected = ttft_late = tpot_late = 0
    per_window = []
    for rows in all_rows:
        config = DesConfig(fleet, timings, scheduler=system, flipping=False, seed=seed)
        result = run_des(config, at_rate(rows, rate))
        met += result.met_slo
        offered += result.offered
        rejected += result.rejected
        # Answered but missed: its first token after the TTFT budget, or else its TPOT over
        # budget or its first-token deadline missed.
        late_ttft = sum(1 for t in result.ttft if t > TTFT_S)
        ttft_late += late_ttft
        tpot_late += result.completed - result.met_slo - late_ttft
        per_window.append(result.attainment)
    return Point(rate, met / offered, tuple(per_window), rejected, ttft_late, tpot_late)


def goodput(
    fleet: FleetContract,
    timings: dict[str, EngineModels],
    system: str,
    all_rows: list[list[tuple[float, int, int]]],
    start: float,
    precision: float,
    seed: int,
) -> tuple[float, Point | None, int]:
    """(goodput in requests/s, the point measured nearest below it, runs spent)."""
    runs = 0

    def at(rate: float) -> Point:
        nonlocal runs
        runs += 1
        return measure(fleet, timings, system, all_rows, rate, seed)

    first = at(start)
    low: Point | None = None
    high: Point | None = None
    if first.attainment >= TARGET:
        low = first
        while high is None:
            point = at(low.rate * 2)
            if point.attainment >= TARGET:
                low = point
            else:
                high = point
            if low.rate > start * 1e3:
                return low.rate, low, runs  # never misses: as good as it gets here
    else:
        high = first
        while low is None:
            point = at(high.rate / 2)
            if point.attainment >= TARGET:
                low = point
            else:
                high = point
            if high.rate < start * 1e-3:
                return 0.0, None, runs
    while high.rate / low.rate > 1 + precision:
        point = at(math.sqrt(low.rate * high.rate))
        if point.attainment >= TARGET:
            low = point
        else:
            high = point
    # Between the bracket's ends, where attainment crosses the target.
    drop = low.attainment - high.attainment
    fraction = (low.attainment - TARGET) / drop if drop > 0 else 0.0
    return low.rate + fraction * (high.rate - low.rate), low, runs


def capacity(n_prefill: int, all_rows: list[list[tuple[float, int, int]]]) -> float:
    """Requests/s the prefill pool can take on these prompts (a search's starting point)."""
    prompts = [p for rows in all_rows for _, p, _ in rows]
    mean_s = sum(CALIBRATION.prefill.chunk_seconds(0, p) for p in prompts) / len(prompts)
    return n_prefill / mean_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument("--workloads", default="code,conv,fixed")
    # v0 scores every (prefill, decode) pair: minutes per search at 64 engines, so opt-in.
    parser.add_argument("--systems", default=",".join(s for s in SYSTEMS if s != "v0"))
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--requests-per-engine", type=int, default=40)
    parser.add_argument("--window-stride", type=int, default=2000)
    parser.add_argument("--precision", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            parser.error(f"unknown system {s}: one of {', '.join(SYSTEMS)}")
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in ("code", "conv", "fixed"):
            parser.error(f"unknown workload {w}")
        if w in TRACES and not (DATA_DIR / TRACES[w]).exists():
            parser.error(f"the {w} workload needs {DATA_DIR / TRACES[w]}")
    started = time.perf_counter()
    lines = [
        f"command: {' '.join(sys.argv)}",
        f"budgets: TTFT {TTFT_S} s, TPOT {TPOT_S} s, attainment target {TARGET}",
        "fleets: half prefill, half decode, static; simulator calibration timing",
    ]
    table = [("engines", "workload", "system", "goodput_rps", "attainment per window",
              "rejected", "ttft_late", "tpot_or_deadline_late", "runs")]  # fmt: skip
    ratios = []
    for size in (int(s) for s in args.sizes.split(",") if s):
        n_prefill = size // 2
        fleet, timings = synthetic_fleet(
            n_prefill, size - n_prefill, {"ttft_s": TTFT_S, "tpot_s": TPOT_S}
        )
        for workload in workloads:
            all_rows = windows(
                workload,
                args.requests_per_engine * size,
                args.windows,
                args.window_stride,
                args.seed,
            )
            start = 0.5 * capacity(n_prefill, all_rows)
            found: dict[str, float] = {}
            for system in systems:
                t = time.perf_counter()
                rate, point, runs = goodput(
                    fleet, timings, system, all_rows, start, args.precision, args.seed
                )
                found[system] = rate
                print(
                    f"[{size} engines, {workload}] {system}: {rate:.3f} req/s"
                    f" ({runs} runs, {time.perf_counter() - t:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                cells = ("-", "-", "-", "-") if point is None else (
                    " ".join(f"{a:.3f}" for a in point.per_window),
                    str(point.rejected), str(point.ttft_late), str(point.tpot_late),
                )  # fmt: skip
                table.append((str(size), workload, system, f"{rate:.3f}", *cells, str(runs)))
            baselines = {s: r for s, r in found.items() if s in BASELINES}
            if "v1" in found and baselines:
                best = max(baselines, key=lambda s: baselines[s])
                ratio = found["v1"] / baselines[best] if baselines[best] else float("inf")
                ratios.append(
                    f"ratio_goodput_v1_over_best_baseline_{workload}_{size}: {ratio:.2f}"
                    f" (best baseline {best}, {baselines[best]:.3f} req/s)"
                )
    lines.append(f"bench_wall_s: {time.perf_counter() - started:.0f}")
    print("\n".join(lines))
    print()
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    print()
    print("\n".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
