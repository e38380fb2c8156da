"""Speed of the virtual-time fleet simulator (``narwhal.fleetsim``) on a large fleet.

Measures how many simulated requests per second of wall time ``run_des`` replays on a fleet of
``--engines`` engines (1,000 by default), and whether a million requests at that size fit in
five minutes (issue 24: >= 3,333 simulated requests/s).

Fleet: ``synthetic_fleet`` on the simulator's calibration (``narwhal.simengine.timing``), budgets
TTFT 10 s and TPOT 0.3 s, every engine may play either role, role flipping on with the limits of
bench/role_flipping.py's des512 setting (one flip per 5 s tick, dwell 60 s), scheduler v1
sampling ``--candidates`` engines per role (32: the simulator's default). The initial split is
the workload's ideal one (each pool's share of engine-seconds).

Workload: Poisson arrivals (seeded); each request's prompt and output lengths are those of a
random row of the Azure LLM inference traces (2023-11-16; half from the code trace: long
prompts, short answers; half from the conversation trace: shorter prompts, long answers; the
role_flipping mix, prompts clipped to 8,192 tokens). Without the traces (``DATA_DIR``), a
lognormal stand-in of the same two classes. The rate is ``--load`` (default 0.7) times the
fleet's capacity at the ideal split: prefill engines at 1 / mean prefill seconds, decode
engines at B* / step(B*) tokens/s within the TPOT budget, so the fleet stays busy and within
its budgets (attainment near 1 is expected and printed as a sanity check).

Printed (stdout, ``name: value``): engines, requests, simulated seconds, wall and CPU seconds
(the simulation alone: ``run_des``; the workload is generated beforehand), simulated requests
per second of wall time, peak RSS of the process, the simulation's own summary (attainment,
TTFT and TPOT medians, flips), and whether the five-minute target for a million requests is met
(measured when ``--requests`` is 1,000,000 or more, else extrapolated from the measured rate).

    .venv/bin/python bench/des_speed.py [--requests 1000000] [--quick] [--engines 1000]
        [--load 0.7] [--candidates 32] [--seed 0] [--profile out.pstats]

``--quick``: 100,000 requests (about half a minute once the simulator is fast). Contacts
nothing; runs one process.
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import sys
import time
from pathlib import Path

from narwhal.contract.flags import number_type, positive
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, run_des
from narwhal.fleetsim.workloads import read_azure_trace, synthetic_fleet
from narwhal.simengine.timing import CALIBRATION
from narwhal.testing.traces import trace_dir

DATA_DIR = trace_dir("azure-llm-2023", Path(__file__).resolve().parents[1])
TRACES = ("AzureLLMInferenceTrace_code.csv", "AzureLLMInferenceTrace_conv.csv")
TTFT_S, TPOT_S = 10.0, 0.3
MAX_NUM_SEQS = 64
MAX_PROMPT = 8192
ROLES = {"min_prefill": 1, "min_decode": 1, "cooldown_s": 5.0, "dwell_s": 60.0, "tick_s": 5.0}
TARGET_REQUESTS, TARGET_WALL_S = 1_000_000, 300.0


def length_pool(seed: int) -> tuple[list[list[tuple[int, int]]], str]:
    """(prompt, output) rows of each class, and where they came from."""
    if all((DATA_DIR / t).exists() for t in TRACES):
        pools = [
            [(p, g) for _, p, g in read_azure_trace(DATA_DIR / t, max_prompt=MAX_PROMPT)]
            for t in TRACES
        ]
        return pools, f"Azure LLM inference traces 2023 ({DATA_DIR})"
    rng = random.Random(seed)

    def draw(prompt_median: float, output_median: float) -> tuple[int, int]:
        p = min(MAX_PROMPT, max(1, round(rng.lognormvariate(math.log(prompt_median), 0.8))))
        return p, max(1, round(rng.lognormvariate(math.log(output_median), 0.9)))

    return [
        [draw(1500, 20) for _ in range(10_000)],
        [draw(800, 200) for _ in range(10_000)],
    ], "lognormal stand-in (traces not found)"


def capacity(pools: list[list[tuple[int, int]]], engines: int) -> tuple[int, float]:
    """(ideal number of prefill engines, requests/s the fleet serves at that split)."""
    rows = [r for pool in pools for r in pool]
    prefill = CALIBRATION.prefill
    decode = CALIBRATION.decode
    mean_prefill_s = sum(prefill.chunk_seconds(0, p) for p, _ in rows) / len(rows)
    mean_prompt = sum(p for p, _ in rows) / len(rows)
    mean_output = sum(g for _, g in rows) / len(rows)
    context = mean_prompt + mean_output / 2
    b_star = max(
        1,
        min(
            MAX_NUM_SEQS,
            math.floor((TPOT_S - decode.intercept - decode.ctx_coef * context) / decode.slope),
        ),
    )
    tokens_per_s = b_star / decode.seconds_per_token(b_star, context)
    prefill_work, decode_work = mean_prefill_s, mean_output / tokens_per_s  # engine-s/request
    n_prefill = max(
        1, min(engines - 1, round(engines * prefill_work / (prefill_work + decode_work)))
    )
    rate = min(n_prefill / prefill_work, (engines - n_prefill) / decode_work)
    return n_prefill, rate


def workload(
    pools: list[list[tuple[int, int]]], rate: float, count: int, seed: int
) -> list[RequestSpec]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        p, g = rng.choice(pools[rng.getrandbits(1)])
        out.append(RequestSpec(t, p, g))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests",
        type=positive(int),
        default=TARGET_REQUESTS,
        help="simulated requests to replay (default %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="100,000 requests")
    parser.add_argument(
        "--engines",
        type=number_type(int, 2),
        default=1000,
        help="engines in the fleet (default %(default)s)",
    )
    parser.add_argument(
        "--load",
        type=positive(float),
        default=0.7,
        help="offered rate as a fraction of the fleet's capacity (default %(default)s)",
    )
    parser.add_argument(
        "--candidates",
        type=positive(int),
        default=32,
        help="engines per role scheduler v1 samples for each request (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the arrivals, the request lengths and the simulation (default %(default)s)",
    )
    parser.add_argument("--profile", help="write cProfile stats of run_des to this file")
    args = parser.parse_args()
    count = 100_000 if args.quick else args.requests

    pools, source = length_pool(args.seed)
    n_prefill, capacity_rps = capacity(pools, args.engines)
    rate = args.load * capacity_rps
    specs = workload(pools, rate, count, args.seed)
    fleet, timings = synthetic_fleet(
        n_prefill,
        args.engines - n_prefill,
        {"ttft_s": TTFT_S, "tpot_s": TPOT_S},
        roles={"enabled": True, **ROLES},
        first_token_timeout_s=0.85 * TTFT_S,
    )
    config = DesConfig(
        fleet,
        timings,
        scheduler="v1",
        flipping=True,
        max_num_seqs=MAX_NUM_SEQS,
        candidates=args.candidates,
        seed=args.seed,
    )
    print(f"lengths: {source}", file=sys.stderr, flush=True)
    print(
        f"running {count} requests at {rate:.1f} req/s on {args.engines} engines"
        f" ({n_prefill} prefill to start) ...",
        file=sys.stderr,
        flush=True,
    )
    started, cpu_started = time.perf_counter(), time.process_time()
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(run_des, config, specs)
        profiler.dump_stats(args.profile)
    else:
        result = run_des(config, specs)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    speed = count / wall if wall > 0 else float("inf")
    summary = result.summary()

    rows = [
        ("engines", str(args.engines)),
        ("initial_split", f"{n_prefill} prefill / {args.engines - n_prefill} decode"),
        ("requests", str(count)),
        ("offered_rate_rps", f"{rate:.1f} ({args.load:g} x capacity {capacity_rps:.1f})"),
        ("candidates", str(args.candidates)),
        ("simulated_s", f"{result.duration_s:.1f}"),
        ("wall_s", f"{wall:.1f}"),
        ("cpu_s", f"{cpu:.1f} (the machine is shared: CPU time varies less than wall time)"),
        ("simulated_requests_per_s", f"{speed:.0f}"),
        ("peak_rss_mb", f"{peak_rss_mb:.0f}"),
        (
            "summary",
            f"attainment {summary['attainment']}, completed {summary['completed']},"
            f" rejected {summary['rejected']}, ttft_p50 {summary['ttft_p50']:.3f}s,"
            f" tpot_p50 {summary['tpot_p50']:.4f}s, flips {summary['flips']},"
            f" mean utilisation {summary['mean_utilisation']}",
        ),
    ]
    need = TARGET_REQUESTS / TARGET_WALL_S
    if count >= TARGET_REQUESTS:
        met = wall * TARGET_REQUESTS / count <= TARGET_WALL_S
        how = f"measured: {count} requests in {wall:.1f} s"
    else:
        met = speed >= need
        how = f"extrapolated: 1,000,000 requests in ~{TARGET_REQUESTS / speed:.0f} s"
    rows.append(
        (
            "target_1m_in_5min",
            f"{'met' if met else 'NOT met'} ({how}; needs >= {need:.0f} requests/s)",
        )
    )
    for name, value in rows:
        print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
