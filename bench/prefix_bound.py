"""The fluid bound on goodput for the Mooncake traces at the simulator's calibration.

What no router can beat for a given prefix hit rate, so that issue 19's goals have a ceiling
beside them. The bound's arithmetic is ``narwhal.testing.fluid_bound``'s: a fluid fleet (no
queues, no bursts), each request costing its prefill engine the calibration's time for its
*uncached* tokens and its decode engine a slot for its output at the TPOT budget's pace.

Per request (the trace as ``bench/prefix_goodput.py`` replays it: prompts clipped to
``max_model_len`` less their output) the uncached tokens are those after the prefix an earlier
request computed: the unbounded cache's (the trace's ideal), or that prefix scaled by ``h /
ideal`` for ``--hit-rates h`` (the ideal's hits spread thinner: not a bound on every router
finding ``h``, as hits concentrated on fewer requests save more of their cost).

Goodput is the rate at which ``--target`` (95%) of requests meet both budgets, so a router may
miss the rest, and the bound lets it miss the costliest; beside it, the bound of a router that
meets every request. Each is printed at the best fractional split (what ideal role flipping
could reach) and at the best split of whole engines (what ``bench/prefix_goodput.py``
measures, each system at its best split). The ratio of two bounds, one at the ideal hit rate
and one at a lower rate, is the most a router finding every prefix could gain over one finding
``h``, all else equal; a measured goodput given with ``--measured NAME=REQ_S`` is printed
against the ideal's bound.

    .venv/bin/python bench/prefix_bound.py [--traces conversation,synthetic] [--sizes 8,64]
        [--hit-rates 0.18,0.30] [--measured round_robin=1.540 ...] [--target 0.95]

Contacts nothing; reads the traces in ``../shared/data/mooncake-fast25``; seconds.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from narwhal.fleetsim.workloads import ideal_cached_tokens, read_mooncake_trace
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing.fluid_bound import FluidFleet, Window
from narwhal.testing.traces import trace_dir

DATA_DIR = trace_dir("mooncake-fast25", Path(__file__).resolve().parents[1])
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
TTFT_S, TPOT_S = 10.0, 0.3
MAX_MODEL_LEN = 32768  # as bench/prefix_goodput.py clips the prompts
# bench/prefix_goodput.py's default: a fleet the trace holds fewer requests an engine for gets
# the trace played back to back, which this bound (one copy) does not model.
REQUESTS_PER_ENGINE = 60

Request = tuple[float, int, int, int]  # arrival, prompt, tokens the unbounded cache holds, output


def requests_of(path: Path) -> list[Request]:
    trace = read_mooncake_trace(path, MAX_MODEL_LEN)
    cached = ideal_cached_tokens(trace.rows, None, trace.block_tokens)
    return [
        (t, prompt, hit, output)
        for (t, prompt, output, _), hit in zip(trace.rows, cached, strict=True)
    ]


def fleet_at(requests: list[Request], ideal: float, hit_rate: float) -> tuple[FluidFleet, float]:
    """The fluid fleet of a router finding ``hit_rate`` of prompt tokens cached, every request
    to be met, and its decode batch: the trace one window, as ``bench/prefix_goodput.py``
    replays it."""
    share = hit_rate / ideal if ideal else 0.0
    window = Window([(t, p, round(c * share), o) for t, p, c, o in requests])
    return FluidFleet.of([window], CALIBRATION.prefill, CALIBRATION.decode, TTFT_S, TPOT_S)


def quotient(top: tuple[float, float], under: tuple[float, float]) -> str:
    """Two (fluid split, whole engines) rates' quotients, printed."""
    return f"{top[0] / under[0]:.3f} (fluid split), {top[1] / under[1]:.3f} (whole engines)"


def _numbers(
    parser: argparse.ArgumentParser, flag: str, text: str, kind: type[int] | type[float]
) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x]
    except ValueError:
        parser.error(f"{flag}: comma-separated numbers, got {text!r}")
    if any(not math.isfinite(v) for v in values):
        parser.error(f"{flag}: finite numbers, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="conversation,synthetic")
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument(
        "--hit-rates",
        default="",
        help="hit rates (prompt tokens found cached) to bound beside the trace's ideal, the"
        " ideal's hits scaled to each, e.g. a cache-blind router's measured rate",
    )
    parser.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="NAME=REQ_S",
        help="a measured goodput (repeatable; with --traces and --sizes of one each) printed"
        " against the ideal's bound",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="attainment target: the share of requests the bound must meet (default %(default)s)",
    )
    args = parser.parse_args()
    if not 0 < args.target <= 1:
        parser.error(f"--target: a share above 0 and at most 1, got {args.target}")
    traces = [t for t in args.traces.split(",") if t]
    unknown = [t for t in traces if t not in TRACES]
    if unknown or not traces:
        parser.error(f"--traces: one or more of {', '.join(TRACES)}, got {args.traces!r}")
    sizes = _numbers(parser, "--sizes", args.sizes, int)
    rates = _numbers(parser, "--hit-rates", args.hit_rates, float)
    if not sizes or any(s < 2 for s in sizes):
        parser.error(f"--sizes: fleets of at least 2 engines, got {args.sizes!r}")
    if any(not 0 <= h <= 1 for h in rates):
        parser.error(f"--hit-rates: shares of prompt tokens, 0 to 1, got {args.hit_rates!r}")
    measured: dict[str, float] = {}
    for item in args.measured:
        name, _, value = item.partition("=")
        try:
            measured[name] = float(value)
        except ValueError:
            parser.error(f"--measured: NAME=REQ_S, got {item!r}")
        if not name or not math.isfinite(measured[name]) or measured[name] <= 0:
            parser.error(f"--measured: a name and a goodput above 0, got {item!r}")
    if measured and (len(traces) != 1 or len(sizes) != 1):
        parser.error("--measured needs one trace and one size")
    if not DATA_DIR.exists():
        print(f"the Mooncake traces are not at {DATA_DIR}", file=sys.stderr)
        return 2
    for trace in traces:
        requests = requests_of(DATA_DIR / TRACES[trace])
        ideal = sum(r[2] for r in requests) / sum(r[1] for r in requests)
        too_big = [n for n in sizes if n * REQUESTS_PER_ENGINE > len(requests)]
        if too_big:
            parser.error(
                f"--sizes: {trace}'s {len(requests)} requests are one copy of the trace up to"
                f" {len(requests) // REQUESTS_PER_ENGINE} engines (bench/prefix_goodput.py plays"
                f" it back to back beyond), got {too_big[0]}"
            )
        above = [h for h in rates if h > ideal]
        if above:
            # No router finds more than an unbounded cache holds.
            parser.error(f"--hit-rates: {trace}'s ideal is {ideal:.3f}, got {above[0]}")
        built = {h: fleet_at(requests, ideal, h) for h in (ideal, *rates)}
        fleets = {
            (h, share): fleet.with_met_share(share)
            for h, (fleet, _) in built.items()
            for share in (args.target, 1.0)
        }
        batch = built[ideal][1]
        print(
            f"{trace}: {len(requests)} requests, ideal hit rate (unbounded cache) {ideal:.3f};"
            f" a decode engine holds {batch:.2f} sequences at the TPOT budget; bounds at"
            f" {args.target:.0%} of requests met (the costliest missed), [every request met]"
        )
        for size in sizes:
            split = {
                key: (fleet.fractional(size), fleet.static(size)) for key, fleet in fleets.items()
            }
            for h in (ideal, *rates):
                (frac, frac_p), (whole, whole_p) = split[h, args.target]
                (all_frac, _), (all_whole, all_p) = split[h, 1.0]
                label = "ideal" if h == ideal else f"{h:.3f}"
                print(
                    f"  {size} engines, hit rate {label}: prefill"
                    f" {sum(fleets[h, 1.0].prefill_s) / len(requests):.3f} s/request;"
                    f" bound {frac:.3f} req/s at {frac_p:.2f}P (fluid split),"
                    f" {whole:.3f} at {whole_p}P/{size - whole_p}D (whole engines)"
                    f" [{all_frac:.3f}; {all_whole:.3f} at {all_p}P/{size - all_p}D]"
                )

            rates_of = {key: (frac[0], whole[0]) for key, (frac, whole) in split.items()}
            top, top_all = rates_of[ideal, args.target], rates_of[ideal, 1.0]
            for h in rates:
                print(
                    f"  bound_ratio_ideal_over_hit_{h:.3f}_{trace}_{size}:"
                    f" {quotient(top, rates_of[h, args.target])}"
                    f" [{quotient(top_all, rates_of[h, 1.0])}]"
                )
            for name, value in measured.items():
                print(
                    f"  bound_over_measured_{name}_{trace}_{size}:"
                    f" {quotient(top, (value, value))} [{quotient(top_all, (value, value))}]"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
