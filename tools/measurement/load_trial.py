"""Open-loop load trials against an OpenAI-compatible endpoint (narwhal-serve or one engine).

    load_trial.py prepare --base URL --input-tokens N --output-tokens M --seed S --out DIR
                          [--num-prompts K] [--model M] [--seed-prompt TEXT] [--tokenize-url URL]
    load_trial.py prepare --base URL --trace FILE --seed S --out DIR
                          [--trace-start ROW] [--trace-rows K] [--model M] [--tokenize-url URL]
    load_trial.py run --base URL --workload DIR --rate R --requests K --ttft S --tpot S
                      --attainment A --timeout S --out DIR
                      [--model M] [--seed S] [--run-id ID] [--arrivals poisson|trace]
                      [--trace-speedup X] [--api-key-env NAME]

``prepare`` writes DIR/workload.json; ``run`` writes DIR/client_records.jsonl and
DIR/summary.json and prints one line. Definitions: docs/measurement.md.

Exit status: 0 done (run: verdict pass); 1 run: verdict fail, or the endpoint failed; 2 bad
arguments or an unreadable/invalid input file.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root for `tools` (tools/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from narwhal.contract import Budgets
from narwhal.contract.flags import http_url_problem, number_type, positive
from tools.measurement._out_dir import OutDirError, prepare_out_dir
from tools.measurement._provenance import versions
from tools.measurement._trial_client import TrialConfig, poisson_schedule, run_trial
from tools.measurement._trial_stats import TrialSummary, summarize
from tools.measurement._trial_workload import (
    DEFAULT_SEED_PROMPT,
    PoolAttempt,
    SeedError,
    WorkloadError,
    build_fixed_workload,
    build_trace_workload,
    fetch_pool,
    load_workload,
    make_pool,
    read_trace,
    save_workload,
)

__all__ = ["main", "prepare", "run"]

PROG = "load_trial.py"
RECORDS_FILE = "client_records.jsonl"
SUMMARY_FILE = "summary.json"


class UsageError(Exception):
    pass


def _check_base(base: str) -> None:
    """``--base`` as an HTTP(S) URL with a host (UsageError, exit 2, otherwise)."""
    if http_url_problem(base) is not None:  # a port of letters too
        raise UsageError(f"--base: {base!r} is not a router URL (http://HOST:PORT)")


class EndpointError(Exception):
    pass


def _served_model(client: httpx.Client) -> tuple[str, int | None]:
    response = client.get("/v1/models")
    if response.status_code != 200:
        raise EndpointError(f"GET /v1/models answered HTTP {response.status_code}")
    data = response.json().get("data") or []
    if not data:
        raise EndpointError("GET /v1/models lists no model")
    return str(data[0]["id"]), data[0].get("max_model_len")


def prepare(args: argparse.Namespace) -> int:
    _check_base(args.base)  # httpx.InvalidURL's traceback for a port of letters, otherwise
    headers = _auth_headers(args.api_key_env)
    # Inputs first: a bad trace file is a usage error, whatever the endpoint does.
    trace = read_trace(Path(args.trace), args.trace_start, args.trace_rows) if args.trace else None
    if trace is None and (args.input_tokens is None or args.output_tokens is None):
        raise UsageError("--input-tokens and --output-tokens are required without --trace")
    with httpx.Client(base_url=args.base, timeout=args.http_timeout, headers=headers) as client:
        try:
            served, max_model_len = _served_model(client)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{args.base}: {type(exc).__name__}: {exc}") from None
        model = args.model or served
        attempts: list[PoolAttempt] = []
        try:
            source, ids = fetch_pool(client, model, args.seed_prompt, args.tokenize_url, attempts)
        except httpx.HTTPError as exc:
            raise EndpointError(f"seed completion: {type(exc).__name__}: {exc}") from None
    pool = make_pool(source, args.seed_prompt, ids)
    provenance = {
        "base": args.base,
        "created_wall": time.time(),
        "pool_attempts": [{"method": a.method, "result": a.result} for a in attempts],
        "command": [PROG, *sys.argv[1:]],
        "versions": versions(),
    }
    if trace is not None:
        rows, digest = trace
        wl = build_trace_workload(
            model,
            pool,
            Path(args.trace),
            digest,
            rows,
            args.trace_start,
            args.seed,
            int(max_model_len or args.max_model_len),
            provenance,
        )
    else:
        room = max_model_len or args.max_model_len
        if room and args.input_tokens + args.output_tokens > room:
            raise UsageError(
                f"{args.input_tokens} + {args.output_tokens} tokens exceed the model's "
                f"max_model_len {room}"
            )
        wl = build_fixed_workload(
            model,
            pool,
            args.input_tokens,
            args.output_tokens,
            args.seed,
            args.num_prompts,
            provenance,
        )
    path = save_workload(wl, Path(args.out))
    print(
        f"{PROG}: workload {path}: {len(wl.requests)} prompts + 1 warmup, pool of "
        f"{len(pool.ids)} ids ({len(pool.distinct)} distinct) from {source}, sha256 {wl.sha256}"
    )
    return 0


def _auth_headers(env_name: str | None) -> dict[str, str]:
    if not env_name:
        return {}
    key = os.environ.get(env_name)
    if not key:
        raise UsageError(f"--api-key-env {env_name}: the variable is not set")
    return {"Authorization": f"Bearer {key}"}


def _run_id(out: Path) -> str:
    # Unique per run and safe for X-Request-Id ([A-Za-z0-9._:-]): the join key with the journal.
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", out.name)[:48] or "trial"
    return f"{stem}-{int(time.time() * 1000):x}"


def run(args: argparse.Namespace) -> int:
    _check_base(args.base)
    wl = load_workload(Path(args.workload))
    if args.requests > len(wl.requests):
        raise UsageError(
            f"--requests {args.requests} exceeds the workload's {len(wl.requests)} prompts"
        )
    arrivals = args.arrivals or ("trace" if wl.has_arrivals else "poisson")
    requests = wl.requests[: args.requests]
    seed = wl.seed if args.seed is None else args.seed
    if arrivals == "trace":
        if not wl.has_arrivals:
            raise UsageError("--arrivals trace: the workload has no arrival times")
        origin = requests[0].arrival_s or 0.0
        schedule = [((r.arrival_s or 0.0) - origin) / args.trace_speedup for r in requests]
        offered = (len(schedule) - 1) / schedule[-1] if schedule[-1] > 0 else None
        arrival_info: dict[str, Any] = {"process": "trace", "speedup": args.trace_speedup}
    else:
        if args.rate is None:
            raise UsageError("--rate is required for Poisson arrivals")
        schedule = poisson_schedule(len(requests), args.rate, seed)
        offered = args.rate
        arrival_info = {"process": "poisson", "rate_rps": args.rate, "seed": seed}
    run_id = args.run_id if args.run_id is not None else _run_id(Path(args.out))
    if not re.fullmatch(r"[A-Za-z0-9._:-]{1,100}", run_id):
        raise UsageError("--run-id: 1-100 characters of [A-Za-z0-9._:-]")
    api_key = _auth_headers(args.api_key_env).get("Authorization", "")[7:] or None
    cfg = TrialConfig(
        base=args.base,
        model=args.model or wl.model,
        run_id=run_id,
        timeout_s=args.timeout,
        api_key=api_key,
    )
    out = Path(args.out)
    try:
        prepare_out_dir(out)
    except OutDirError as exc:
        raise UsageError(str(exc)) from None
    trial = asyncio.run(run_trial(cfg, wl.warmup, requests, schedule))
    with (out / RECORDS_FILE).open("w", encoding="utf-8") as fh:
        for rec in trial.records:
            fh.write(rec.model_dump_json() + "\n")
    summary: TrialSummary = summarize(
        trial.records,
        budgets=Budgets(ttft_s=args.ttft, tpot_s=args.tpot, attainment=args.attainment),
        timeout_s=args.timeout,
        offered_rate_rps=offered,
        run_id=run_id,
        base=args.base,
        model=cfg.model,
        workload={
            "path": str(Path(args.workload)),
            "sha256": wl.sha256,
            "seed": wl.seed,
            "input_tokens": wl.input_tokens,
            "output_tokens": wl.output_tokens,
            "trace": wl.trace.model_dump() if wl.trace else None,
        },
        arrivals=arrival_info,
        t0_wall=trial.t0_wall,
        started_wall=trial.started_wall,
        ended_wall=trial.ended_wall,
        command=[PROG, *sys.argv[1:]],
        versions=versions(),
    )
    (out / SUMMARY_FILE).write_text(summary.model_dump_json(by_alias=True, indent=2) + "\n")
    ttft, tpot = summary.ttft_s, summary.tpot_s

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    rate = summary.completed_rate_rps
    failures = Counter(
        f"{rec.outcome}: {rec.error}" if rec.error else rec.outcome
        for rec in trial.records
        if not rec.completed
    )
    if failures:
        # The reason beside the verdict (every record is in client_records.jsonl): a wrong
        # model or a router that is not there reads as "0/N" otherwise.
        (why, count), *_ = failures.most_common(1)
        print(f"{PROG}: {count} of the {len(trial.records)} requests failed with {why[:300]}")
    print(
        f"{PROG}: {summary.result}, verdict {summary.verdict}; completed "
        f"{summary.completed}/{summary.requests} at {rate or 0:.3f} req/s incl. drain; "
        f"TTFT p50/p95/p99 {ms(ttft.p50)}/{ms(ttft.p95)}/{ms(ttft.p99)} ms; "
        f"TPOT {ms(tpot.p50)}/{ms(tpot.p95)}/{ms(tpot.p99)} ms"
    )
    return 0 if summary.verdict == "pass" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="write a workload (token-id prompts) to DIR")
    p.add_argument("--base", required=True, help="the router (or an engine) base URL")
    p.add_argument("--out", required=True, help="directory to write workload.json in")
    p.add_argument(
        "--seed", type=int, required=True, help="seed of the prompts drawn from the token pool"
    )
    p.add_argument(
        "--input-tokens", type=positive(int), help="prompt tokens per request (without --trace)"
    )
    p.add_argument(
        "--output-tokens", type=positive(int), help="output tokens per request (without --trace)"
    )
    p.add_argument(
        "--num-prompts",
        type=positive(int),
        default=256,
        help="prompts to write besides the warmup, without --trace (default %(default)s)",
    )
    p.add_argument("--trace", help="an Azure-format trace CSV (TIMESTAMP,ContextTokens,...)")
    p.add_argument(
        "--trace-start",
        type=number_type(int, 0),
        default=0,
        help="first trace data row to use, 0 the first (default %(default)s)",
    )
    p.add_argument(
        "--trace-rows",
        type=positive(int),
        default=200,
        help="trace rows to use from --trace-start (default %(default)s)",
    )
    p.add_argument("--model", help="default: the first model /v1/models lists")
    p.add_argument(
        "--max-model-len",
        type=positive(int),
        default=16384,
        help="used when /v1/models does not say",
    )
    p.add_argument(
        "--seed-prompt",
        default=DEFAULT_SEED_PROMPT,
        help="text whose prompt token ids form the pool prompts are drawn from (default: a "
        "sentence about narwhals)",
    )
    p.add_argument(
        "--tokenize-url", help="an engine's or the router's URL whose /tokenize may be asked"
    )
    p.add_argument("--api-key-env", help="environment variable holding the API key")
    p.add_argument(
        "--http-timeout",
        type=positive(float),
        default=120.0,
        help="seconds allowed for each call to the endpoint (default %(default)s)",
    )
    p.set_defaults(func=prepare)

    r = sub.add_parser("run", help="run one open-loop load point")
    r.add_argument("--base", required=True, help="the router (or an engine) base URL")
    r.add_argument("--workload", required=True, help="workload directory (or file) from prepare")
    r.add_argument("--rate", type=positive(float), help="offered requests/s (Poisson)")
    r.add_argument(
        "--requests",
        type=positive(int),
        required=True,
        help="requests to send: the workload's first K prompts, after its warmup",
    )
    r.add_argument("--ttft", type=positive(float), required=True, help="TTFT budget, s")
    r.add_argument("--tpot", type=positive(float), required=True, help="TPOT budget, s")
    r.add_argument(
        "--attainment",
        type=number_type(float, 0, 1, low_allowed=False),
        required=True,
        help="target, 0-1",
    )
    r.add_argument("--timeout", type=positive(float), required=True, help="per request, s")
    r.add_argument(
        "--out", required=True, help="directory (created) for client_records.jsonl and summary.json"
    )
    r.add_argument("--model", help="default: the workload's model")
    r.add_argument("--seed", type=int, help="arrival seed (default: the workload's)")
    r.add_argument("--run-id", help="prefix of every X-Request-Id (the journal join key)")
    r.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        help="arrival process (default: trace when the workload has arrival times, else poisson)",
    )
    r.add_argument(
        "--trace-speedup",
        type=positive(float),
        default=1.0,
        help="with trace arrivals, divide the inter-arrival times by this (default %(default)s)",
    )
    r.add_argument("--api-key-env", help="environment variable holding the API key")
    r.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (UsageError, WorkloadError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except (EndpointError, SeedError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
