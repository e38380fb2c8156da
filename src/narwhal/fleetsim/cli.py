"""``narwhal-fleetsim``: replay a workload through the router's routing in virtual time."""

from __future__ import annotations

import json
import sys

from narwhal.contract import ContractError, load_fleet
from narwhal.contract.cli_errors import OneLineParser
from narwhal.contract.flags import positive
from narwhal.contract.paths import empty_path
from narwhal.fleetsim.simulator import DesConfig, run_des
from narwhal.fleetsim.workloads import (
    poisson_requests,
    read_azure_trace,
    synthetic_fleet,
    timings_of,
    trace_requests,
)
from narwhal.routing.baselines import BASELINES

__all__ = ["main"]

# A synthetic fleet's size bound. Its memory grows with the square of its size (every
# prefill-decode pair is a permitted KV transfer pair): 2,000 engines take 0.34 GB, 8,000
# took 4.6 GB and 20,000 more than this machine's 24 GB. The benchmarks run 512.
MAX_ENGINES = 4_096


# Simulated time a Poisson run may span (about 116 days): longer took hours of wall time.
MAX_SIMULATED_S = 1e7


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="narwhal-fleetsim", description="Virtual-time fleet simulation of Narwhal's routing."
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--fleet", help="a fleet file (engines' sim blocks give their timing)")
    src.add_argument("--engines", help="a synthetic fleet: PREFILL:DECODE, e.g. 500:500")
    parser.add_argument("--trace", help="Azure-format trace CSV (else Poisson, see --rate)")
    parser.add_argument(
        "--rate-scale",
        type=positive(float),
        default=1.0,
        help="with --trace, divide its inter-arrival times by this (default %(default)s)",
    )
    parser.add_argument(
        "--rate",
        type=positive(float),
        default=1.0,
        help="Poisson arrival rate in requests/s, without --trace (default %(default)s)",
    )
    parser.add_argument(
        "--requests",
        type=positive(int),
        default=1000,
        help="requests to simulate: Poisson arrivals, or the first rows of --trace (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive(int),
        default=8192,
        help="prompt tokens of each Poisson request (default %(default)s)",
    )
    parser.add_argument(
        "--output-tokens",
        type=positive(int),
        default=128,
        help="output tokens of each Poisson request (default %(default)s)",
    )
    parser.add_argument(
        "--scheduler",
        choices=["v1", "v0", *BASELINES],
        default="v1",
        help="Narwhal's scheduler (v1, v0) or a baseline policy of the routers it replaces",
    )
    parser.add_argument(
        "--no-flipping",
        action="store_true",
        help="run without the role controller: engines keep their roles (it runs only under v1)",
    )
    parser.add_argument(
        "--ttft", type=positive(float), help="TTFT budget (s) of a synthetic fleet (default 10)"
    )
    parser.add_argument(
        "--tpot", type=positive(float), help="TPOT budget (s) of a synthetic fleet (default 0.3)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the Poisson arrivals and the scheduler's random choices (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--abandon-after-s",
        type=positive(float),
        default=None,
        help="clients give up on a request with no first token after this many seconds"
        " (default: they wait)",
    )
    args = parser.parse_args(argv)
    # An unset $TRACE read as no trace (a Poisson run), and --fleet '' crashed.
    if (why := empty_path((("--fleet", args.fleet), ("--trace", args.trace)))) is not None:
        print(f"narwhal-fleetsim: {why}", file=sys.stderr)
        return 2
    try:
        if args.fleet:
            if args.ttft is not None or args.tpot is not None:
                print(
                    "narwhal-fleetsim: --ttft/--tpot: a fleet file's budgets apply "
                    "(its budgets.ttft_s and budgets.tpot_s); they are for --engines",
                    file=sys.stderr,
                )
                return 2
            fleet = load_fleet(args.fleet).contract
            timings = timings_of(fleet)
        else:
            try:
                n_p, n_d = (int(x) for x in args.engines.split(":"))
            except ValueError:
                print("narwhal-fleetsim: --engines: expected PREFILL:DECODE", file=sys.stderr)
                return 2
            if n_p < 1 or n_d < 1 or n_p + n_d > MAX_ENGINES:
                print(
                    f"narwhal-fleetsim: --engines: at least 1 of each role and at most "
                    f"{MAX_ENGINES:,} in all, got {n_p}:{n_d}",
                    file=sys.stderr,
                )
                return 2
            budgets = {"ttft_s": args.ttft or 10.0, "tpot_s": args.tpot or 0.3}
            fleet, timings = synthetic_fleet(
                n_p,
                n_d,
                budgets,
                roles={"cooldown_s": 60, "dwell_s": 120, "tick_s": 5},
            )
    except ContractError as exc:
        print(f"narwhal-fleetsim: {exc}", file=sys.stderr)
        return 2
    if args.trace:
        try:
            rows = read_azure_trace(args.trace, args.requests)
        except OSError as exc:
            print(f"narwhal-fleetsim: --trace {args.trace}: cannot read: {exc.strerror or exc}",
                  file=sys.stderr)  # fmt: skip
            return 2
        except ValueError as exc:
            print(f"narwhal-fleetsim: --trace {exc}", file=sys.stderr)
            return 2
        if not rows:
            print(f"narwhal-fleetsim: --trace {args.trace}: no requests in it", file=sys.stderr)
            return 2
        # Half the context for the prompt leaves the answer room; a longer prompt is cut to it
        # and counted (a replay that silently shortened its longest prompts reads optimistic).
        max_prompt = fleet.model.max_model_len // 2
        clipped = sum(1 for _, prompt, _ in rows if prompt > max_prompt)
        if clipped:
            rows = [(t, min(prompt, max_prompt), out) for t, prompt, out in rows]
            print(
                f"narwhal-fleetsim: {clipped:,} of {len(rows):,} trace prompts clipped to "
                f"{max_prompt:,} tokens (half the fleet's max_model_len)",
                file=sys.stderr,
            )
        # An answer is bounded by the context as an engine bounds it (a trace's output of
        # 10^11 tokens ran the simulator for good).
        limit = fleet.model.max_model_len
        rows = [(t, prompt, min(out, limit - prompt)) for t, prompt, out in rows]
        specs = trace_requests(rows, args.rate_scale)
    else:
        limit = fleet.model.max_model_len
        if args.prompt_tokens + args.output_tokens > limit:
            # An engine refuses such a request: simulating it served would measure nothing.
            print(
                f"narwhal-fleetsim: --prompt-tokens {args.prompt_tokens} + --output-tokens "
                f"{args.output_tokens} exceed the fleet's max_model_len {limit}",
                file=sys.stderr,
            )
            return 2
        if args.requests / args.rate > MAX_SIMULATED_S:
            # The role controller and the scrapes tick through every simulated second.
            print(
                f"narwhal-fleetsim: --requests {args.requests} at --rate {args.rate:g} span "
                f"{args.requests / args.rate:.3g} s; at most {MAX_SIMULATED_S:.0e} s are simulated",
                file=sys.stderr,
            )
            return 2
        specs = poisson_requests(
            args.rate, args.requests, args.prompt_tokens, args.output_tokens, args.seed
        )
    config = DesConfig(
        fleet,
        timings,
        scheduler=args.scheduler,
        flipping=not args.no_flipping,
        seed=args.seed,
        abandon_after_s=args.abandon_after_s,
    )
    result = run_des(config, specs)
    summary = result.summary()
    if args.trace:
        summary["trace_prompts_clipped"] = clipped
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
