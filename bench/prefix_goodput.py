"""Goodput of KV-cache-aware routing on Kimi's own traffic (the Mooncake FAST'25 traces), in
virtual time, with its uncertainty.

Each system replays the Mooncake conversation and synthetic traces (``../shared/data/
mooncake-fast25``: per request its arrival, prompt and output lengths, and the hash ids of its
512-token prompt blocks) through the virtual-time simulator (``narwhal.fleetsim``) on fleets of
``--sizes`` engines, on the simulator's calibration, budgets TTFT 10 s and TPOT 0.3 s,
attainment target 95%. Roles are static (no role flipping), and each system is measured at each
of the ``--splits`` (the share of engines in the prefill role) and reported at its best: a
prefix cache takes work off the prefill pool only, so which split suits a system depends on
how much its routing saves there, and an operator deploying it would pick that split. Prompts
are clipped to the fleet's ``max_model_len`` (32,768) less their output (the count is
printed). A fleet for which the trace holds fewer than ``--requests-per-engine`` (60) requests an
engine gets it played back to back (``fleetsim.workloads.back_to_back``: each copy's prompts its
own, sharing prefixes within the copy as the trace does): at 512 engines the conversation trace's
hour compresses to about one request's lifetime, a burst, not a steady load. Every engine has a
prefix cache of ``--cache-tokens`` tokens (least recently used out), keyed by the trace's 512-token
blocks as chain keys: a request's cached prefix skips its prefill there, and a decode engine
pulls only the blocks it lacks (at ``--transfer-s-per-token``: the KV of Kimi's MLA layers,
61 x 576 values x 2 bytes = 70,272 bytes a token, over a 50 GB/s link). Clients give up on a
request with no first token after ``--abandon-after-s`` (the TTFT budget, as the live
clients do; 0: they wait), which frees its engines (``DesConfig.abandon_after_s``).

Systems (``--systems``):

- ``narwhal``: scheduler v1 with its prefix index (``routing.prefix``; in the simulator the
  index learns from the router's own routing history, as for engines that publish no KV
  events; ``--history-ttl-s``);
- ``narwhal_blind``: scheduler v1 without it (today's cache-blind v1; the engines still cache);
- the baselines of ``narwhal.routing.baselines``: ``cache_aware`` (vllm-router 0.1.17's and
  sglang-router's approximate tree, modelled on the trace's blocks), ``round_robin``,
  ``power_of_two``, ``least_outstanding``.

Goodput is the highest offered rate (requests/s, the trace's arrival pattern compressed or
stretched to it) at which the requests meet both budgets at least 95% of the time, found by
search (``narwhal.testing.goodput.search_crossing``); its uncertainty a block bootstrap over
consecutive arrivals (``--block``, ``--resamples``), ratios paired on the same resamples and
called a gain or loss only when their 95% interval excludes 1.

Printed: per size and trace, each system's goodput and interval; at the rate measured just
below its goodput, its prefix hit rate (engine-found cached tokens over prompt tokens of the
answered requests) beside the trace's ideal (one LRU cache of the prefill pool's total
capacity; and unbounded), TTFT p50 and p90, KV pulled per request (tokens and MB) and misses;
then the ratio lines ``ratio_goodput_<a>_over_<b>_<trace>_<size>`` with intervals.

    .venv/bin/python bench/prefix_goodput.py [--sizes 8,64] [--traces conversation,synthetic]
        [--systems narwhal,narwhal_blind,cache_aware,...] [--quick]

Contacts nothing; one process. ``--quick``: 8 engines, conversation only, 200 resamples (every
split: each system's best is needed for honest ratios).

``--live``: the same traces against a live fleet of 8 simulated engines instead (with vLLM's
prefix cache and KV events), through the real routers: narwhal-serve cache-aware (its index
fed by the engines' KV events) and cache-blind, vllm-router 0.1.17 ``cache_aware``,
``round_robin`` and ``power_of_two``, sglang-router 0.3.2 ``cache_aware``. That run is
``bench/goodput.py`` with its ``mooncake_conv`` / ``mooncake_syn`` workloads (its docstring says
how trials, budgets and the search work); every argument this script does not know is passed
to it (``--time-scale``, ``--windows``, ``--durations``, ``--prefill``, ``--budget-s`` ...):

    .venv/bin/python bench/prefix_goodput.py --live [--traces conversation] [--windows 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from narwhal.contract import FleetContract, parse_fleet
from narwhal.fleetsim.simulator import DesConfig, DesResult, run_des
from narwhal.fleetsim.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    PrefixTrace,
    back_to_back,
    ideal_hit_rate,
    mooncake_requests,
    read_mooncake_trace,
    timings_of,
)
from narwhal.routing.baselines import BASELINES
from narwhal.simengine.fleet import local_fleet_document
from narwhal.simengine.timing import CALIBRATION
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
    search_crossing,
    to_blocks,
)
from narwhal.testing.traces import trace_dir

DATA_DIR = trace_dir("mooncake-fast25", Path(__file__).resolve().parents[1])
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
TTFT_S, TPOT_S, TARGET = 10.0, 0.3, 0.95
MAX_MODEL_LEN = 32768
KV_BYTES_PER_TOKEN = 61 * 576 * 2  # Kimi K2's MLA: 61 layers, 512 + 64 values, bf16
VLLM_ROUTER = ("cache_aware", "round_robin", "power_of_two")
NARWHAL = ("narwhal", "narwhal_blind")
SYSTEMS = [*NARWHAL, *BASELINES]
OUTCOMES = ("rejected", "ttft_late", "tpot_late", "failed")


@dataclass(frozen=True)
class Point(RatePoint):
    """One system at one offered rate over the whole trace."""

    hit_rate: float = 0.0
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    pulled_per_request: float = 0.0
    misses: dict[str, int] = field(default_factory=dict)


def fleet_of(size: int, prefill_share: float, cache_tokens: int, system: str, ttl: float):
    n_prefill = max(1, min(size - 1, round(size * prefill_share)))
    doc = local_fleet_document(
        [20000 + i for i in range(size)],
        [40000 + i for i in range(size)],
        initial_roles=["prefill"] * n_prefill + ["decode"] * (size - n_prefill),
        # num_blocks: the engine's KV capacity, which the router's index holds it to.
        sim={
            "block_size": MOONCAKE_BLOCK_TOKENS,
            "num_blocks": max(1, cache_tokens // MOONCAKE_BLOCK_TOKENS),
        },
        ttft_s=TTFT_S,
        tpot_s=TPOT_S,
        first_token_timeout_s=0.85 * TTFT_S,
        max_model_len=MAX_MODEL_LEN,
        name=f"prefix-{n_prefill}p{size - n_prefill}d",
    )
    doc["engine"]["prefix_caching"] = {
        "block_size": MOONCAKE_BLOCK_TOKENS,
        "capacity_blocks": max(1, cache_tokens // MOONCAKE_BLOCK_TOKENS),
    }
    doc["routing"] = {"prefix": {"enabled": system == "narwhal", "history_ttl_s": ttl}}
    return parse_fleet(doc, "<prefix-bench>").contract, n_prefill


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    fleet: FleetContract, system: str, trace: PrefixTrace, rate: float, args: argparse.Namespace
) -> Point:
    config = DesConfig(
        fleet,
        timings_of(fleet),
        scheduler="v1" if system in NARWHAL else system,
        flipping=False,
        seed=args.seed,
        transfer_s_per_token=args.transfer_s_per_token,
        prefix_cache_tokens=args.cache_tokens,
        abandon_after_s=args.abandon_after_s,
    )
    result: DesResult = run_des(config, mooncake_requests(trace.rows, rate))
    met, sizes = to_blocks([o == "met" for o in result.outcomes], args.block)
    return Point(
        rate,
        tuple(met),
        tuple(sizes),
        result.hit_rate,
        percentile(result.ttft, 0.5),
        percentile(result.ttft, 0.9),
        result.pulled_tokens / result.completed if result.completed else 0.0,
        dict(Counter(o for o in result.outcomes if o != "met")),
    )


def capacity(n_prefill: int, trace: PrefixTrace) -> float:
    """Requests/s a cache-blind prefill pool takes (a search's starting point)."""
    mean_s = sum(CALIBRATION.prefill.chunk_seconds(0, p) for _, p, _, _ in trace.rows) / len(
        trace.rows
    )
    return n_prefill / mean_s


def ratio_line(
    found: dict[str, tuple[float, list[Point]]],
    resampled: dict[str, list[float]],
    name: str,
    others: list[str],
    label: str,
    tag: str,
) -> str:
    """``name``'s goodput over the best of ``others``, with its paired bootstrap interval
    (empty when either is not measured)."""
    r = paired_ratio({s: g for s, (g, _) in found.items()}, resampled, name, others)
    if r is None:
        return ""
    return (
        f"ratio_goodput_{name}_over_{label}_{tag}: {r.ratio:.2f} [{r.low:.2f}, {r.high:.2f}] "
        f"{r.verdict} ({r.best}, {r.best_goodput:.3f} req/s)"
    )


LIVE_SYSTEMS = (
    "narwhal_v1",
    "narwhal_v1_blind",
    "vllm_round_robin",
    "vllm_power_of_two",
    "vllm_default",
    "sglang_cache_aware",
)
LIVE_WORKLOADS = {"conversation": "mooncake_conv", "synthetic": "mooncake_syn"}


def live(args: argparse.Namespace, rest: list[str]) -> int:
    """Replace this process with bench/goodput.py on the Mooncake workloads."""
    argv = [
        sys.executable,
        str(Path(__file__).with_name("goodput.py")),
        "--workloads",
        ",".join(LIVE_WORKLOADS[t] for t in args.traces.split(",") if t),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    # The virtual-time systems' names are not the live ones: the live set unless named.
    argv += ["--systems", args.systems or ",".join(LIVE_SYSTEMS), "--seed", str(args.seed)]
    sys.stdout.flush()
    os.execv(sys.executable, [*argv, *rest])


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--sizes", default="8,64", help="fleet sizes in engines, comma-separated (default 8,64)"
    )
    parser.add_argument(
        "--traces",
        default="conversation,synthetic",
        help=f"Mooncake traces to replay, comma-separated, of {','.join(TRACES)}",
    )
    parser.add_argument(
        "--systems", help=f"default: {','.join(SYSTEMS)} (--live: {','.join(LIVE_SYSTEMS)})"
    )
    parser.add_argument("--splits", default="0.25,0.375,0.5", help="prefill shares to try")
    parser.add_argument(
        "--cache-tokens",
        type=int,
        default=4_000_000,
        help="each engine's prefix cache in tokens, least recently used out (default 4,000,000)",
    )
    parser.add_argument(
        "--history-ttl-s",
        type=float,
        default=1800.0,
        help="narwhal: how long its index keeps a routed prefix (routing.prefix.history_ttl_s)",
    )
    parser.add_argument(
        "--requests-per-engine",
        type=int,
        default=60,
        help="a fleet the trace holds fewer requests an engine for gets it played back to back",
    )
    parser.add_argument(
        "--transfer-s-per-token",
        type=float,
        default=KV_BYTES_PER_TOKEN / 50e9,
        help="KV transfer time per pulled token, seconds (default: 70,272 bytes over 50 GB/s)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=200,
        help="block bootstrap: consecutive requests resampled together (default 200)",
    )
    parser.add_argument(
        "--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)"
    )
    parser.add_argument(
        "--precision",
        type=float,
        default=0.03,
        help="relative precision the goodput search bisects to (default 0.03)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the simulator (random policies) and the bootstrap",
    )
    add_patience_argument(parser, TTFT_S)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 engines, the conversation trace, 200 resamples (every split still)",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="the 8-engine live fleet through the real routers (bench/goodput.py); unknown"
        " arguments go to it",
    )
    args, rest = parser.parse_known_args()
    if rest and not args.live:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.abandon_after_s = patience_of(parser, args)
    if args.quick:
        # Every split still: each system is measured at its best, and at 8 engines the
        # best differ (narwhal's 2 prefill engines, the cache-blind policies' 3); without the
        # 0.375 split the quick ratios read 1.52 where the full run reads 1.25.
        args.sizes, args.traces, args.resamples = "8", "conversation", 200
    problem = bound_error(
        args,
        [("cache_tokens", 0, True), ("history_ttl_s", 0, False), ("requests_per_engine", 1, True),
         ("transfer_s_per_token", 0, True), ("block", 1, True), ("resamples", 1, True),
         ("precision", 0, False)],
    ) or precision_error(args.precision)  # fmt: skip
    if problem:
        parser.error(problem)
    try:
        sizes = number_list(args.sizes, "--sizes", int, 2)
        shares = sorted(set(number_list(args.splits, "--splits", float, 0, 1, low_allowed=False)))
    except ValueError as exc:
        parser.error(str(exc))
    traces = [t for t in args.traces.split(",") if t]
    for t in traces:
        if t not in TRACES:
            parser.error(f"unknown trace {t}: one of {', '.join(TRACES)}")
        if not (DATA_DIR / TRACES[t]).exists():
            parser.error(f"the {t} trace needs {DATA_DIR / TRACES[t]}")
    if args.live:
        return live(args, rest)
    systems = [s for s in (args.systems or ",".join(SYSTEMS)).split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            parser.error(f"unknown system {s}: one of {', '.join(SYSTEMS)}")
    started = time.perf_counter()
    header = [
        f"command: {' '.join(sys.argv)}",
        f"budgets: TTFT {TTFT_S} s, TPOT {TPOT_S} s, attainment target {TARGET}",
        f"fleets: static roles, each system at its best prefill share of {args.splits}; "
        "simulator calibration timing; "
        f"prefix cache {args.cache_tokens:,} tokens per engine, blocks of "
        f"{MOONCAKE_BLOCK_TOKENS}; KV pull {args.transfer_s_per_token * 1e6:.2f} us/token",
        f"clients: {clients_line(args.abandon_after_s)}",
        f"uncertainty: block bootstrap, blocks of {args.block} requests, "
        f"{args.resamples} resamples, 95% intervals",
    ]
    table = [("engines", "trace", "system", "split", "goodput_rps", "95%_interval", "hit_rate",
              "ideal_hit", "ttft_p50", "ttft_p90", "kv_pulled_tok", "kv_pulled_MB",
              *OUTCOMES, "runs")]  # fmt: skip
    ratios: list[str] = []
    loaded = {t: read_mooncake_trace(DATA_DIR / TRACES[t], MAX_MODEL_LEN) for t in traces}
    for t, trace in loaded.items():
        header.append(
            f"trace {t}: {len(trace.rows)} requests, {trace.clipped} prompts clipped to "
            f"{MAX_MODEL_LEN} tokens less their output; ideal hit rate unbounded "
            f"{ideal_hit_rate(trace.rows, None):.3f}"
        )
    for size in sizes:
        for t, whole in loaded.items():
            copies = -(-args.requests_per_engine * size // len(whole.rows))
            trace = back_to_back(whole, copies)
            if copies > 1:
                header.append(
                    f"trace {t} at {size} engines: played {copies} times back to back (each "
                    f"copy's prompts its own), {len(trace.rows)} requests"
                )
            found: dict[str, tuple[float, list[Point]]] = {}
            splits: dict[str, int] = {}
            for system in systems:
                tried: set[int] = set()
                for share in shares:
                    fleet, n_prefill = fleet_of(
                        size, share, args.cache_tokens, system, args.history_ttl_s
                    )
                    if n_prefill in tried:
                        continue
                    tried.add(n_prefill)
                    start = 0.5 * capacity(n_prefill, trace)
                    clock = time.perf_counter()
                    result = search_crossing(
                        lambda rate, f=fleet, s=system, tr=trace: measure(f, s, tr, rate, args),
                        start,
                        args.precision,
                        TARGET,
                    )
                    print(
                        f"[{size} engines, {t}] {system} {n_prefill}P/{size - n_prefill}D: "
                        f"{result[0]:.3f} req/s ({len(result[1])} runs, "
                        f"{time.perf_counter() - clock:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    if system not in found or result[0] > found[system][0]:
                        found[system], splits[system] = result, n_prefill
            blocks = len(next(iter(found.values()))[1][0].met)
            draws = bootstrap_draws(blocks, args.resamples, random.Random(args.seed))
            resampled = {
                s: [crossing(points, TARGET, w) for w in draws] for s, (_, points) in found.items()
            }
            for system, (rate, points) in found.items():
                lo, hi = interval(resampled[system])
                point = ([p for p in points if p.rate <= rate] or points[:1])[-1]
                # The ideal for the caches of the prefill pool this system was measured on.
                ideal = ideal_hit_rate(trace.rows, args.cache_tokens * splits[system])
                table.append((
                    str(size), t, system, f"{splits[system]}P/{size - splits[system]}D",
                    f"{rate:.3f}", f"{lo:.3f}-{hi:.3f}",
                    f"{point.hit_rate:.3f}", f"{ideal:.3f}", fmt(point.ttft_p50),
                    fmt(point.ttft_p90), f"{point.pulled_per_request:.0f}",
                    f"{point.pulled_per_request * KV_BYTES_PER_TOKEN / 1e6:.0f}",
                    *(str(point.misses.get(o, 0)) for o in OUTCOMES), str(len(points)),
                ))  # fmt: skip

            tag = f"{t}_{size}"
            ratios += [
                ratio_line(found, resampled, "narwhal", list(VLLM_ROUTER), "best_vllm_router", tag),
                ratio_line(found, resampled, "narwhal", ["round_robin"], "round_robin", tag),
                ratio_line(found, resampled, "narwhal", ["narwhal_blind"], "narwhal_blind", tag),
                ratio_line(found, resampled, "narwhal", list(BASELINES), "best_baseline", tag),
            ]
            ratios = [r for r in ratios if r]
    header.append(f"bench_wall_s: {time.perf_counter() - started:.0f}")
    print("\n".join(header))
    print()
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    print()
    print("\n".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
