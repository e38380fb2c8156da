"""Goodput of Narwhal's scheduler against the baseline policies, in virtual time, with its
uncertainty.

Each system routes the same workloads through the virtual-time simulator (``narwhal.fleetsim``)
on synthetic fleets of each ``--sizes`` engines (half prefill, half decode, static: no role
flipping, so every system gets the same split; or with ``--splits``, each system at the best
of several static splits, as an operator deploying it would pick), on the simulator's calibration
(``narwhal.simengine.timing``), budgets TTFT 10 s and TPOT 0.3 s, attainment target 95%.

Systems (``--systems``):

- ``v1``: Narwhal's scheduler and admission as deployed; clients ask for exactly the tokens
  they get (``max_tokens`` = the output's length, as ``bench/goodput.py`` sends them to the
  live fleet), and the router expects a decoding answer to end at the lesser of that and the
  90th percentile of the answers recently completed (``narwhal.routing.output_length``);
- ``v1_oracle``: the same, told each output's length and trusting it (it expects every answer
  to run to its ``max_tokens``);
- ``v1_max1024``: ``v1`` with clients that do not say: each asks for ``max_tokens`` 1,024 (or
  its output's length, when longer);
- ``v0`` (opt-in: it scores every pair, minutes per search at 64 engines): least outstanding
  work;
- the baselines of ``narwhal.routing.baselines`` (round robin, power of two, least outstanding
  requests, and any other registered there): what operators would otherwise deploy.

Workloads (``--workloads``): ``code`` / ``conv``, the Azure LLM inference traces (2023-11-16;
code: long prompts, short answers; conversation: the opposite), prompts capped at 8,192
tokens, each window's recorded arrival pattern compressed or stretched to the offered rate;
``fixed``: 8,192-token prompts and 128-token answers, Poisson arrivals (a seed per window).
A window is ``--requests-per-engine`` x engines consecutive requests; ``--windows`` of them,
spread evenly over the trace without overlap (as many as fit: the code trace holds 8,818
requests, so 7 windows of 150 requests per engine at 8 engines; a fleet it cannot fill gets it
played back to back, each window then one pass).

Windows are long (150 requests per engine: at 8 engines about 3 minutes of the code trace's
arrivals at its goodput, 9 of conversation's: many lifetimes of a typical request) and
clients give up on a request with no first token after ``--abandon-after-s`` (the TTFT
budget, as ``bench/goodput.py``'s clients do; 0: they wait), so that a window measures the
fleet in its steady state. Windows of 40 requests per engine (this benchmark's earlier
default) measured how a fleet absorbs one burst that then drains with nothing behind it: at
8 engines the code trace's 320 requests arrive in 20 s and the conversation trace's in about
2 decode lifetimes, so a policy that admits everything is paid for its late requests by the
quiet after the window, which a fleet in service never gets. Measured both ways, the order of
the systems changes (docs/routing.md).

Goodput is the highest offered rate (requests/s) at which the requests of all windows
together meet both budgets at least 95% of the time (met / offered): found by doubling or
halving from a capacity estimate until the target is bracketed, bisection to ``--precision``
(relative), then linear interpolation of attainment between the bracket's ends.

Uncertainty. The simulator is deterministic: what varies is the workload. Every request's
outcome is kept at every rate measured (the search's and four more around the goodput found,
at 0.8, 0.9, 1.1 and 1.25 times it), and the requests are cut into blocks of ``--block``
consecutive arrivals (blocks carry queues across their edges: a block bootstrap). A
bootstrap resample draws blocks with replacement; its goodput is where its attainment, read
upwards over the rates measured, first falls below the target (interpolated). The 95%
interval is the 2.5th to 97.5th percentile over ``--resamples`` resamples; a ratio's interval
is paired (both systems on the same resample; the best baseline is the best on that
resample). A ratio is called a gain or a loss only when its interval excludes 1.

Printed (stdout): per fleet size and workload, each system's split (its best of ``--splits``)
and goodput with its interval, its
attainment per window at the rate measured just below its goodput, that point's misses
(rejected, TTFT late, TPOT late, failed) and the pools' utilisation there (their busy time
over the run: low on the Azure traces, whose bursts decide), and the ratio lines
``ratio_goodput_v1[_variant]_over_best_baseline_<workload>_<size>`` with their intervals, and
the lines ``fluid_bound_<workload>_<size>``: the fluid bound on the same windows
(``narwhal.testing.fluid_bound``: no queues, no bursts, the costliest 5% of requests missed),
at the half split every system runs, at the best split of whole engines and at a fluid one,
and how far the best baseline and v1 are from it. The most any router could gain over the
best baseline here is that quotient; the trace's bursts, which the bound does not see, keep
every system well below it on the code trace at 8 engines. ``--bound-only``: the bound alone,
no simulation (seconds; a minute at 512 engines).

    .venv/bin/python bench/policies_des.py [--sizes 8,64] [--workloads code,conv,fixed]
        [--splits 0.5] [--systems v1,v1_oracle,round_robin,...] [--windows 16]
        [--requests-per-engine 150] [--abandon-after-s 10] [--quick] [--bound-only]

Contacts nothing; one process. Run times are in docs/routing.md beside the figures.
``--quick``: 8 engines, 3 windows, 200 resamples, v1 and the baselines.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from narwhal.contract import FleetContract
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, run_des
from narwhal.fleetsim.workloads import poisson_requests, read_azure_trace, synthetic_fleet
from narwhal.profiles.models import EngineModels
from narwhal.routing.baselines import BASELINES
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing.fluid_bound import FluidFleet, Window
from narwhal.testing.goodput import (
    RatePoint,
    add_patience_argument,
    bootstrap_draws,
    bound_error,
    clients_line,
    crossing,
    interval,
    number_list,
    paired_ratio,
    patience_of,
    precision_error,
    quick_defaults,
    search_crossing,
    to_blocks,
)
from narwhal.testing.traces import trace_dir

DATA_DIR = trace_dir("azure-llm-2023", Path(__file__).resolve().parents[1])
TRACES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}
TTFT_S, TPOT_S, TARGET = 10.0, 0.3, 0.95
MAX_PROMPT = 8192
FIXED_REQUESTS = 20_000  # per seed: more than any window asks for
BLIND_MAX_TOKENS = 1024
V1_SYSTEMS = ("v1", "v1_oracle", "v1_max1024")
SYSTEMS = [*V1_SYSTEMS, "v0", *BASELINES]
OUTCOMES = ("rejected", "ttft_late", "tpot_late", "failed")

Rows = list[tuple[float, int, int]]  # (arrival in its source's seconds, prompt, output)


@dataclass(frozen=True)
class Point(RatePoint):
    """One system at one offered rate, over all windows."""

    per_window: tuple[float, ...] = ()  # attainment per window
    misses: dict[str, int] = field(default_factory=dict)
    utilisation: tuple[float, float] = (0.0, 0.0)  # prefill and decode pools' busy fraction


def windows(
    workload: str, count: int, n_windows: int, seed: int, traces: dict[str, Rows]
) -> list[Rows]:
    """Up to ``n_windows`` windows of ``count`` requests each, spread evenly over the source
    (a trace of ``traces``, read once) without overlap (the whole trace when it holds fewer
    than ``count``)."""
    if workload == "fixed":
        return [
            [(s.arrival, s.prompt_tokens, s.output_tokens)
             for s in poisson_requests(1.0, count, MAX_PROMPT, 128, seed + k)]
            for k in range(n_windows)
        ]  # fmt: skip
    rows = traces[workload]
    if count > len(rows):
        # A fleet the trace cannot fill (512 engines: the whole code trace is 17 requests an
        # engine, one burst it absorbs at any rate): the trace played back to back until it
        # holds ``count``, each copy starting a mean gap after the one before.
        span = rows[-1][0] - rows[0][0]
        gap = span / (len(rows) - 1)
        one = [(t - rows[0][0], p, g) for t, p, g in rows]
        rows = [
            (copy * (span + gap) + t, p, g)
            for copy in range(-(-count // len(one)))
            for t, p, g in one
        ]
    fit = max(1, min(n_windows, len(rows) // count))
    stride = (len(rows) - count) // (fit - 1) if fit > 1 else 0
    out = []
    for k in range(fit):
        window = rows[k * stride : k * stride + count]
        t0 = window[0][0]
        out.append([(t - t0, p, g) for t, p, g in window])
    return out


def at_rate(rows: Rows, rate: float, max_tokens: int | None = None) -> list[RequestSpec]:
    """The window's arrival pattern scaled to a mean of ``rate`` requests/s; with
    ``max_tokens``, each client asks for that many tokens (or its output's length, if more)."""
    span = rows[-1][0] or 1.0
    scale = (len(rows) / span) / rate  # new time = old time x scale
    return [
        RequestSpec(t * scale, p, g, max(max_tokens, g) if max_tokens else None) for t, p, g in rows
    ]


def measure(
    fleet: FleetContract,
    timings: dict[str, EngineModels],
    system: str,
    all_rows: list[Rows],
    rate: float,
    block: int,
    seed: int,
    abandon_after_s: float | None = None,
) -> Point:
    met: list[int] = []
    sizes: list[int] = []
    per_window: list[float] = []
    misses: Counter[str] = Counter()
    busy = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    roles = {e.id: e.initial_role for e in fleet.engines}
    scheduler = "v1" if system in V1_SYSTEMS else system
    for rows in all_rows:
        config = DesConfig(
            fleet,
            timings,
            scheduler=scheduler,
            flipping=False,
            seed=seed,
            output_oracle=system == "v1_oracle",
            abandon_after_s=abandon_after_s,
        )
        specs = at_rate(rows, rate, BLIND_MAX_TOKENS if system == "v1_max1024" else None)
        result = run_des(config, specs)
        outcomes = result.outcomes
        counts, lengths = to_blocks([o == "met" for o in outcomes], block)
        met += counts
        sizes += lengths
        misses.update(o for o in outcomes if o != "met")
        per_window.append(result.attainment)
        for engine, fraction in result.utilisation.items():
            pool = busy[roles[engine]]
            pool[0] += fraction
            pool[1] += 1
    utilisation = (
        busy["prefill"][0] / max(1, busy["prefill"][1]),
        busy["decode"][0] / max(1, busy["decode"][1]),
    )
    return Point(rate, tuple(met), tuple(sizes), tuple(per_window), dict(misses), utilisation)


def search(
    fleet: FleetContract,
    timings: dict[str, EngineModels],
    system: str,
    all_rows: list[Rows],
    start: float,
    precision: float,
    block: int,
    seed: int,
    abandon_after_s: float | None = None,
) -> tuple[float, list[Point]]:
    """(goodput, every point measured, sorted by rate)."""
    return search_crossing(
        lambda rate: measure(fleet, timings, system, all_rows, rate, block, seed, abandon_after_s),
        start,
        precision,
        TARGET,
    )


def capacity(n_prefill: int, all_rows: list[Rows]) -> float:
    """Requests/s the prefill pool can take on these prompts (a search's starting point)."""
    prompts = [p for rows in all_rows for _, p, _ in rows]
    mean_s = sum(CALIBRATION.prefill.chunk_seconds(0, p) for p in prompts) / len(prompts)
    return n_prefill / mean_s


def fluid_bound(
    size: int, all_rows: list[Rows], goodputs: dict[str, float], prefills: list[int]
) -> str:
    """The fluid bound (``narwhal.testing.fluid_bound``) on these windows' requests at this
    fleet size, against the systems measured: what no router reaches at any rate, at the best
    of the splits the systems ran (``prefills``: prefill engines; the half split by default),
    at the best split of whole engines, and at a fluid one."""
    offered = [Window([(t, p, 0, g) for t, p, g in rows]) for rows in all_rows]
    every, _ = FluidFleet.of(offered, CALIBRATION.prefill, CALIBRATION.decode, TTFT_S, TPOT_S)
    cost = [every.with_met_share(TARGET), every]
    at_run, run_p = max((cost[0].at_split(p, size - p), p) for p in prefills)
    every_run = cost[1].at_split(run_p, size - run_p)
    whole, whole_p = cost[0].static(size)
    fluid = cost[0].fractional(size)[0]
    tried = ", the best of the splits run," if len(prefills) > 1 else ""
    line = (
        f"{at_run:.3f} req/s at {run_p}P/{size - run_p}D{tried} ({TARGET:.0%} met, the"
        f" costliest missed; {every_run:.3f} meeting every request), {whole:.3f} at the best"
        f" split of whole engines ({whole_p}P/{size - whole_p}D), {fluid:.3f} at a fluid split"
    )
    baselines = {s: g for s, g in goodputs.items() if s in BASELINES}
    if baselines:
        best = max(baselines, key=baselines.__getitem__)
        line += (
            f"; over the best baseline ({best}) {at_run / baselines[best]:.2f}"
            f" [{every_run / baselines[best]:.2f} meeting every request]"
        )
    for name in (s for s in V1_SYSTEMS if s in goodputs):
        line += f"; {name} at {goodputs[name] / at_run:.2f} of it"
    return line


def prefill_engines(size: int, shares: list[float]) -> list[int]:
    """The prefill engines of each share of ``size`` (rounded down, at least one engine in
    each role), each split once, in order."""
    return sorted({max(1, min(size - 1, int(size * share))) for share in shares})


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--sizes",
        default="8,64",
        help="comma-separated fleet sizes in engines (default %(default)s)",
    )
    parser.add_argument(
        "--splits",
        default="0.5",
        help="comma-separated shares of the engines in the prefill role (rounded down, at least"
        " one engine in each role); each system runs at each and is reported at its best"
        " (default %(default)s: half prefill, every system on one split)",
    )
    parser.add_argument(
        "--workloads",
        default="code,conv,fixed",
        help="comma-separated, of code, conv, fixed (default %(default)s)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(s for s in SYSTEMS if s != "v0"),
        help=f"comma-separated, of {', '.join(SYSTEMS)} (default %(default)s)",
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=16,
        help="windows of each workload, as many as fit the trace (default %(default)s)",
    )
    parser.add_argument(
        "--requests-per-engine",
        type=int,
        default=150,
        help="a window's requests per engine of the fleet (default %(default)s)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=80,
        help="consecutive requests per bootstrap block (default %(default)s)",
    )
    parser.add_argument(
        "--resamples", type=int, default=1000, help="bootstrap resamples (default %(default)s)"
    )
    parser.add_argument(
        "--precision",
        type=float,
        default=0.02,
        help="relative width at which the goodput bisection stops (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the fixed workload's arrivals, the simulation and the bootstrap "
        "(default %(default)s)",
    )
    add_patience_argument(parser, TTFT_S)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 engines, 3 windows, 200 resamples, v1 and the baselines (each as the command"
        " line names it, if it does)",
    )
    parser.add_argument(
        "--bound-only",
        action="store_true",
        help="print the fluid bound on the windows and simulate nothing (seconds)",
    )
    args = parser.parse_args()
    abandon = patience_of(parser, args)
    if args.quick:
        quick_defaults(
            args,
            sys.argv[1:],
            {"sizes": "8", "windows": 3, "resamples": 200, "systems": ",".join(["v1", *BASELINES])},
        )
    problem = bound_error(
        args,
        [("windows", 1, True), ("requests_per_engine", 1, True), ("block", 1, True),
         ("resamples", 1, True), ("precision", 0, False)],
    ) or precision_error(args.precision)  # fmt: skip
    if problem:
        parser.error(problem)
    try:
        # At least one engine in each role.
        sizes = number_list(args.sizes, "--sizes", int, 2)
        shares = number_list(args.splits, "--splits", float, 0, 1, low_allowed=False)
    except ValueError as exc:
        parser.error(str(exc))
    systems = [] if args.bound_only else [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            parser.error(f"unknown system {s}: one of {', '.join(SYSTEMS)}")
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads:
        parser.error(f"--workloads: expected one or more of code, conv, fixed: {args.workloads!r}")
    traces: dict[str, Rows] = {}
    for w in workloads:
        if w not in ("code", "conv", "fixed"):
            parser.error(f"unknown workload {w}")
        if w in TRACES:
            path = DATA_DIR / TRACES[w]
            if not path.exists():
                parser.error(f"the {w} workload needs {path}")
            try:
                traces[w] = read_azure_trace(path, None, MAX_PROMPT)
            except (OSError, ValueError) as exc:
                parser.error(f"the {w} workload: {exc}")
            if (n := len(traces[w])) < 2:
                parser.error(f"the {w} workload: {path} holds {n} requests; a window needs 2")
    started = time.perf_counter()
    header = [
        f"command: {' '.join(sys.argv)}",
        f"budgets: TTFT {TTFT_S} s, TPOT {TPOT_S} s, attainment target {TARGET}",
        (
            "fleets: half prefill (rounded down), the rest decode, static"
            if shares == [0.5]
            else f"fleets: static roles, each system at its best prefill share of {args.splits}"
            " (rounded down)"
        )
        + "; simulator calibration timing",
        f"clients: {clients_line(abandon)}; windows of {args.requests_per_engine} requests"
        " per engine",
        f"uncertainty: block bootstrap, blocks of {args.block} requests, "
        f"{args.resamples} resamples, 95% intervals",
    ]
    table = [("engines", "workload", "system", "split", "goodput_rps", "95%_interval", "windows",
              "attainment_per_window", "rejected", "ttft_late", "tpot_late", "failed",
              "util_prefill", "util_decode", "runs")]  # fmt: skip
    ratios: list[str] = []
    bounds: list[str] = []
    for size in sizes:
        prefills = prefill_engines(size, shares)
        fleets = {
            n_prefill: synthetic_fleet(
                n_prefill, size - n_prefill, {"ttft_s": TTFT_S, "tpot_s": TPOT_S}
            )
            for n_prefill in prefills
        }
        for workload in workloads:
            all_rows = windows(
                workload, args.requests_per_engine * size, args.windows, args.seed, traces
            )
            rng = random.Random(args.seed)
            found: dict[str, tuple[float, list[Point]]] = {}
            split: dict[str, int] = {}
            for system in systems:
                for n_prefill, (fleet, timings) in fleets.items():
                    t = time.perf_counter()
                    result = search(
                        fleet, timings, system, all_rows, 0.5 * capacity(n_prefill, all_rows),
                        args.precision, args.block, args.seed, abandon,
                    )  # fmt: skip
                    print(
                        f"[{size} engines, {workload}] {system} {n_prefill}P/{size - n_prefill}D:"
                        f" {result[0]:.3f} req/s ({len(result[1])} runs,"
                        f" {time.perf_counter() - t:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    if system not in found or result[0] > found[system][0]:
                        found[system], split[system] = result, n_prefill
            goodputs = {s: g for s, (g, _) in found.items()}
            bound = fluid_bound(size, all_rows, goodputs, prefills)
            bounds.append(f"fluid_bound_{workload}_{size}: {bound}")
            if not found:
                continue
            blocks = len(next(iter(found.values()))[1][0].met)
            draws = bootstrap_draws(blocks, args.resamples, rng)
            resampled = {
                s: [crossing(points, TARGET, w) for w in draws] for s, (_, points) in found.items()
            }
            for system, (rate, points) in found.items():
                lo, hi = interval(resampled[system])
                below = [p for p in points if p.rate <= rate] or points[:1]
                point = below[-1]
                table.append((
                    str(size), workload, system, f"{split[system]}P/{size - split[system]}D",
                    f"{rate:.3f}", f"{lo:.3f}-{hi:.3f}",
                    str(len(all_rows)), " ".join(f"{a:.3f}" for a in point.per_window),
                    *(str(point.misses.get(o, 0)) for o in OUTCOMES),
                    f"{point.utilisation[0]:.2f}", f"{point.utilisation[1]:.2f}",
                    str(len(points)),
                ))  # fmt: skip
            baselines = [s for s in found if s in BASELINES]
            for name in (s for s in V1_SYSTEMS if s in found):
                r = paired_ratio(goodputs, resampled, name, baselines)
                if r is None:
                    continue
                suffix = "" if name == "v1" else f"_{name.removeprefix('v1_')}"
                ratios.append(
                    f"ratio_goodput_v1{suffix}_over_best_baseline_{workload}_{size}: "
                    f"{r.ratio:.2f} [{r.low:.2f}, {r.high:.2f}] {r.verdict} (best baseline "
                    f"{r.best}, {r.best_goodput:.3f} req/s)"
                )
    header.append(f"bench_wall_s: {time.perf_counter() - started:.0f}")
    print("\n".join(header))
    print()
    if len(table) > 1:
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        print()
    if ratios:
        print("\n".join(ratios))
        print()
    print("\n".join(bounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
