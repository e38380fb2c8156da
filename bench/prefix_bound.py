"""The fluid bound on goodput for the Mooncake traces at the simulator's calibration.

What no router can beat for a given prefix hit rate, so that issue 19's goals have a ceiling
beside them.

A fluid fleet has no queues and no bursts: each prefill engine prefills one request after
another without a gap, each decode engine holds as many sequences as the TPOT budget allows,
always. Per request (the trace as ``bench/prefix_goodput.py`` replays it: prompts clipped to
``max_model_len`` less their output):

- its prefill takes the calibration's prefill time of its *uncached* tokens, chunk by chunk
  (8,192-token chunks, each with its step's fixed cost), after the tokens an earlier request
  computed: the unbounded cache's prefix (the trace's ideal), or that prefix scaled by ``h /
  ideal`` for a router that finds a hit rate ``h``;
- its decode holds a slot of a decode engine for its output's length at the budget's pace: an
  engine carries the largest batch whose step, at the trace's time-weighted mean context, fits
  the TPOT budget, so it serves ``batch / (mean output x budget)`` requests/s.

With ``P`` prefill engines of ``N`` the fleet carries ``min(P / prefill_s, (N - P) x decode)``
requests/s: printed at the best fractional split (what ideal role flipping could reach) and at
the best static split of whole engines (what ``bench/prefix_goodput.py`` measures, each system at
its best split). The ratio of two such bounds, one at the ideal hit rate and one at a lower rate,
is the most a router finding every prefix could gain over one finding ``h``, all else equal; a
measured goodput given with ``--measured NAME=REQ_S`` is printed against the ideal's bound.

    .venv/bin/python bench/prefix_bound.py [--traces conversation,synthetic] [--sizes 8,64]
        [--hit-rates 0.18,0.30] [--measured round_robin=1.540 ...]

Contacts nothing; reads the traces in ``../shared/data/mooncake-fast25``; a few seconds.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from narwhal.fleetsim.workloads import ideal_cached_tokens, read_mooncake_trace
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing.traces import trace_dir

DATA_DIR = trace_dir("mooncake-fast25", Path(__file__).resolve().parents[1])
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
TPOT_S = 0.3
MAX_MODEL_LEN = 32768  # as bench/prefix_goodput.py clips the prompts


@dataclass(frozen=True)
class Request:
    prompt: int
    output: int
    cached: int  # tokens the unbounded cache holds for it (whole blocks, never the last token)


def requests_of(path: Path) -> list[Request]:
    trace = read_mooncake_trace(path, MAX_MODEL_LEN)
    cached = ideal_cached_tokens(trace.rows, None, trace.block_tokens)
    return [
        Request(prompt, output, hit)
        for (_, prompt, output, _), hit in zip(trace.rows, cached, strict=True)
    ]


def prefill_seconds(prompt: int, cached: int) -> float:
    """The least time the calibration's engines spend prefilling ``prompt`` tokens after
    ``cached`` of them (the last token is always computed): each token's own cost, and the
    step's fixed cost as a share of a full step (an engine charges it once per step, shared
    by every prompt it packs into one; a bound takes every step full)."""
    model = CALIBRATION.prefill
    offset, total = min(cached, prompt - 1), 0.0
    while offset < prompt:
        n = min(model.max_tokens, prompt - offset)
        total += model.chunk_seconds(offset, n) - model.a * (1 - n / model.max_tokens)
        offset += n
    return total


@dataclass(frozen=True)
class Bound:
    hit_rate: float
    prefill_s: float  # mean per request
    decode_rps: float  # requests/s one decode engine serves
    batch: int

    def fractional(self, engines: int) -> tuple[float, float]:
        """(requests/s, prefill engines) at the best split of a fluid fleet."""
        d, p = self.decode_rps, self.prefill_s
        return engines * d / (1 + d * p), engines * d * p / (1 + d * p)

    def static(self, engines: int) -> tuple[float, int]:
        """(requests/s, prefill engines) at the best split of whole engines."""
        return max(
            (min(n / self.prefill_s, (engines - n) * self.decode_rps), n) for n in range(1, engines)
        )


def bound_at(requests: list[Request], ideal: float, hit_rate: float) -> Bound:
    share = hit_rate / ideal if ideal else 0.0
    prefill_s = sum(prefill_seconds(r.prompt, round(r.cached * share)) for r in requests) / len(
        requests
    )
    outputs = sum(r.output for r in requests)
    # A sequence's context grows from its prompt to prompt + output: weighted by time held.
    context = sum((r.prompt + r.output / 2) * r.output for r in requests) / outputs
    decode = CALIBRATION.decode
    batch = 0
    while decode.seconds_per_token(batch + 1, context) <= TPOT_S:
        batch += 1
    mean_output = outputs / len(requests)
    return Bound(hit_rate, prefill_s, batch / (mean_output * TPOT_S), batch)


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
        help="hit rates (prompt tokens found cached) to bound beside the trace's ideal,"
        " e.g. a cache-blind router's measured rate",
    )
    parser.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="NAME=REQ_S",
        help="a measured goodput (repeatable; with --traces and --sizes of one each) printed"
        " against the ideal's bound",
    )
    args = parser.parse_args()
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
        ideal = sum(r.cached for r in requests) / sum(r.prompt for r in requests)
        above = [h for h in rates if h > ideal]
        if above:
            # No router finds more than an unbounded cache holds.
            parser.error(f"--hit-rates: {trace}'s ideal is {ideal:.3f}, got {above[0]}")
        bounds = [bound_at(requests, ideal, h) for h in (ideal, *rates)]
        print(
            f"{trace}: {len(requests)} requests, ideal hit rate (unbounded cache) {ideal:.3f};"
            f" a decode engine holds {bounds[0].batch} sequences within the TPOT budget:"
            f" {bounds[0].decode_rps:.3f} req/s"
        )
        for size in sizes:
            for b in bounds:
                frac, frac_p = b.fractional(size)
                whole, whole_p = b.static(size)
                label = "ideal" if b is bounds[0] else f"{b.hit_rate:.3f}"
                print(
                    f"  {size} engines, hit rate {label}: prefill {b.prefill_s:.3f} s/request;"
                    f" bound {frac:.3f} req/s at {frac_p:.2f}P (fluid split),"
                    f" {whole:.3f} at {whole_p}P/{size - whole_p}D (whole engines)"
                )
            top_frac, top_whole = bounds[0].fractional(size)[0], bounds[0].static(size)[0]
            for b in bounds[1:]:
                print(
                    f"  bound_ratio_ideal_over_hit_{b.hit_rate:.3f}_{trace}_{size}:"
                    f" {top_frac / b.fractional(size)[0]:.3f} (fluid split),"
                    f" {top_whole / b.static(size)[0]:.3f} (whole engines)"
                )
            for name, value in measured.items():
                print(
                    f"  bound_over_measured_{name}_{trace}_{size}: {top_frac / value:.3f}"
                    f" (fluid split), {top_whole / value:.3f} (whole engines)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
