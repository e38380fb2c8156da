"""Cross-check Narwhal's measurements with a client nobody here wrote: NVIDIA aiperf.

    aiperf_xcheck.py --base URL --model M --journal ROUTER_JOURNAL --out DIR
                     --input-tokens N --output-tokens M --rate R --requests K
                     [--aiperf BIN] [--tokenizer ORG/NAME] [--hf-home DIR] [--sim-tokenizer]
                     [--load-trial-summary SUMMARY.json] [--seed S]
                     [--ttft-rel 0.3] [--ttft-abs 0.03]

aiperf runs the same workload shape (N input tokens, M output tokens with ``ignore_eos``,
Poisson arrivals at R/s, K requests after one warmup, streaming) against narwhal-serve with
``HF_HUB_OFFLINE=1``; every request carries one ``X-Request-Id`` tag, so the router journal's
``request.end`` records of the run are exactly aiperf's. Compared:

- request count: aiperf's profiled requests == the journal's ``ok`` ends minus the warmup, and
  aiperf saw no error (exact);
- output tokens: aiperf's own count (its tokenizer on the returned text) == the journal's
  ``completion_tokens`` summed (exact);
- input tokens: aiperf's mean input length (its tokenizer) vs the journal's ``prompt_tokens``
  (the engine's count), within 1%;
- TTFT median: aiperf's p50 vs the journal's median ``t_first_token`` (router arrival to first
  token), and vs ``load_trial.py``'s p50 when a summary is given: within
  max(--ttft-abs seconds, --ttft-rel of the larger).

``--sim-tokenizer`` installs a tokenizer mirroring narwhal-sim's vocabulary into HF_HOME as
``--tokenizer`` (see sim_tokenizer.py). Writes DIR/xcheck.json. Exit status: 0 all agree;
1 a disagreement or aiperf failed; 2 bad arguments or aiperf not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root for `tools` (tools/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from narwhal.contract.flags import base_url, number_type, positive
from narwhal.testing import procs
from tools.measurement._out_dir import OutDirError, prepare_out_dir
from tools.measurement._runner_journal import read_journal
from tools.measurement.sim_tokenizer import DEFAULT_NAME, install

__all__ = ["main"]

PROG = "aiperf_xcheck.py"
REPO = Path(__file__).resolve().parents[2]
# Where `make aiperf` installs it: a venv of its own (its pins clash with the router's).
DEFAULT_AIPERF = REPO / ".venv" / "aiperf" / "bin" / "aiperf"


class UsageError(Exception):
    pass


def _find_aiperf(given: str | None) -> Path:
    if given:
        path = Path(given)
        if not path.exists():
            raise UsageError(f"--aiperf {given}: not found")
        return path
    if DEFAULT_AIPERF.exists():
        return DEFAULT_AIPERF
    found = shutil.which("aiperf")
    if found:
        return Path(found)
    raise UsageError("aiperf is not installed (run `make aiperf`, or pass --aiperf BIN)")


def _agree(a: float | None, b: float | None, rel: float, absolute: float) -> dict[str, Any]:
    if a is None or b is None:
        return {"a": a, "b": b, "agree": False, "allowed": None}
    allowed = max(absolute, rel * max(abs(a), abs(b)))
    return {"a": a, "b": b, "diff": abs(a - b), "allowed": allowed, "agree": abs(a - b) <= allowed}


def run_aiperf(args: argparse.Namespace, tag: str, out: Path, hf_home: Path) -> dict[str, Any]:
    artifacts = out / "aiperf"
    cmd = [
        str(_find_aiperf(args.aiperf)),
        "profile",
        "--model",
        args.model,
        "--tokenizer",
        args.tokenizer,
        "--url",
        args.base,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--isl",
        str(args.input_tokens),
        "--isl-stddev",
        "0",
        "--osl",
        str(args.output_tokens),
        "--osl-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--request-rate",
        repr(args.rate),
        "--arrival-pattern",
        "poisson",
        "--request-count",
        str(args.requests),
        "--warmup-request-count",
        "1",
        "--random-seed",
        str(args.seed),
        "--header",
        f"X-Request-Id:{tag}",
        "--request-timeout-seconds",
        repr(args.timeout),
        "--output-artifact-dir",
        str(artifacts),
        "--ui",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    bound = 3.0 * args.requests / args.rate + 2 * args.timeout + 180
    with (out / "aiperf.log").open("wb") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=bound)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"aiperf did not finish within {bound:.0f} s") from None
    if proc.returncode != 0:
        tail = (out / "aiperf.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise RuntimeError(f"aiperf exited {proc.returncode}: {tail[0][:300] if tail else ''}")
    export = artifacts / "profile_export_aiperf.json"
    if not export.exists():
        raise RuntimeError(f"aiperf wrote no {export.name}")
    data = json.loads(export.read_text())
    (out / "aiperf_command.txt").write_text(" ".join(cmd) + "\n")

    def metric(name: str, key: str) -> float | None:
        value = (data.get(name) or {}).get(key)
        return float(value) if value is not None else None

    errors = (
        (data.get("error_summary") or []) if isinstance(data.get("error_summary"), list) else []
    )
    ttft_ms = metric("time_to_first_token", "p50")
    return {
        "command": cmd,
        "aiperf_version": data.get("aiperf_version"),
        "request_count": metric("request_count", "avg"),
        "errors": sum(int(e.get("count", 0)) for e in errors if isinstance(e, dict)),
        "ttft_p50_s": None if ttft_ms is None else ttft_ms / 1000.0,
        "output_tokens": metric("output_token_count", "sum"),
        "input_tokens_mean": metric("input_sequence_length", "avg"),
    }


def journal_side(journal: Path, tag: str) -> dict[str, Any]:
    ends = [
        r
        for r in read_journal(journal).records
        if r.get("type") == "request.end" and r.get("client_request_id") == tag
    ]
    ends.sort(key=lambda r: r.get("arrival") or 0.0)
    ok = [r for r in ends if r.get("outcome") == "ok"]
    # aiperf's warmup phase finishes before profiling starts: its request arrived first.
    profiled = ok[1:]
    ttfts = [r["t_first_token"] for r in profiled if isinstance(r.get("t_first_token"), float)]
    return {
        "ends": len(ends),
        "ok": len(ok),
        "profiled": len(profiled),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "output_tokens": sum(int(r.get("completion_tokens") or 0) for r in profiled),
        "prompt_tokens_mean": statistics.mean(int(r.get("prompt_tokens") or 0) for r in profiled)
        if profiled
        else None,
    }


def xcheck(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        prepare_out_dir(out)
    except OutDirError as exc:
        raise UsageError(str(exc)) from None
    hf_home = Path(args.hf_home) if args.hf_home else out / "hf-home"
    if args.sim_tokenizer:
        try:
            install(hf_home, args.tokenizer)
        except ImportError:
            raise UsageError("--sim-tokenizer needs the 'tokenizers' package") from None
    tag = f"aiperf-{int(time.time() * 1000):x}"
    aip = run_aiperf(args, tag, out, hf_home)
    # The router writes each request.end just after its response; give the last one a moment.
    jr: dict[str, Any] = {}

    def all_ended() -> bool:
        jr.update(journal_side(Path(args.journal), tag))
        return jr["ends"] >= (aip["request_count"] or 0) + 1

    procs.wait_until(all_ended, 10, 0.2)
    checks: dict[str, Any] = {
        "request_count": {
            "aiperf": aip["request_count"],
            "journal": jr["profiled"],
            "aiperf_errors": aip["errors"],
            "agree": aip["request_count"] == jr["profiled"] == args.requests and not aip["errors"],
        },
        "output_tokens": {
            "aiperf": aip["output_tokens"],
            "journal": jr["output_tokens"],
            "expected": args.requests * args.output_tokens,
            "agree": aip["output_tokens"]
            == jr["output_tokens"]
            == args.requests * args.output_tokens,
        },
        # aiperf sends text its tokenizer sized; the engine's own count is the journal's.
        "input_tokens_mean": _agree(
            aip["input_tokens_mean"], jr["prompt_tokens_mean"], rel=0.01, absolute=1.0
        ),
        "ttft_p50_aiperf_vs_journal": _agree(
            aip["ttft_p50_s"], jr["ttft_p50_s"], args.ttft_rel, args.ttft_abs
        ),
    }
    if args.load_trial_summary:
        summary = json.loads(Path(args.load_trial_summary).read_text())
        lt_tokens = summary["total_output_tokens"] / max(1, summary["completed"])
        checks["ttft_p50_aiperf_vs_load_trial"] = _agree(
            aip["ttft_p50_s"], summary["ttft_s"]["p50"], args.ttft_rel, args.ttft_abs
        )
        checks["output_tokens_per_request_vs_load_trial"] = {
            "aiperf": (aip["output_tokens"] or 0) / max(1.0, aip["request_count"] or 1.0),
            "load_trial": lt_tokens,
            "agree": (aip["output_tokens"] or 0) / max(1.0, aip["request_count"] or 1.0)
            == lt_tokens,
        }
        checks["request_count_vs_load_trial"] = {
            "aiperf": aip["request_count"],
            "load_trial": summary["requests"],
            "agree": aip["request_count"] == summary["requests"],
        }
    agree = all(c["agree"] for c in checks.values())
    result = {
        "schema": "narwhal.aiperf-xcheck/v1",
        "tag": tag,
        "agree": agree,
        "tolerances": {"ttft_rel": args.ttft_rel, "ttft_abs_s": args.ttft_abs},
        "checks": checks,
        "aiperf": aip,
        "journal": jr,
    }
    (out / "xcheck.json").write_text(json.dumps(result, indent=2) + "\n")
    failed = [k for k, c in checks.items() if not c["agree"]]
    print(
        f"{PROG}: {'agree' if agree else 'DISAGREE: ' + ', '.join(failed)}; {out / 'xcheck.json'}"
    )
    return 0 if agree else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base",
        required=True,
        type=base_url,
        help="narwhal-serve's base URL, e.g. http://127.0.0.1:8000",
    )
    p.add_argument("--model", required=True, help="model name aiperf requests")
    p.add_argument("--journal", required=True, help="the router's journal (JSONL) to compare with")
    p.add_argument(
        "--out", required=True, help="output directory (created): xcheck.json, aiperf's artifacts"
    )
    p.add_argument(
        "--input-tokens", type=positive(int), required=True, help="prompt tokens per request"
    )
    p.add_argument(
        "--output-tokens",
        type=positive(int),
        required=True,
        help="output tokens per request (sent with ignore_eos)",
    )
    p.add_argument(
        "--rate", type=positive(float), required=True, help="Poisson arrival rate (requests/s)"
    )
    p.add_argument(
        "--requests", type=positive(int), required=True, help="profiled requests, after 1 warmup"
    )
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=180.0,
        help="aiperf's per-request timeout in seconds (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=1729, help="aiperf's random seed (default %(default)s)"
    )
    p.add_argument(
        "--aiperf",
        help="aiperf executable (default: .venv/aiperf/bin/aiperf from make aiperf, else on PATH)",
    )
    p.add_argument(
        "--tokenizer",
        default=DEFAULT_NAME,
        help="tokenizer hub name (org/name) in HF_HOME's cache for aiperf (default %(default)s)",
    )
    p.add_argument("--hf-home", help="HF_HOME for aiperf (default: OUT/hf-home)")
    p.add_argument(
        "--sim-tokenizer",
        action="store_true",
        help="first install a tokenizer mirroring narwhal-sim's vocabulary as --tokenizer",
    )
    p.add_argument(
        "--load-trial-summary",
        help="a load_trial.py summary.json of the same workload shape, to compare with too",
    )
    p.add_argument(
        "--ttft-rel",
        type=number_type(float, 0),
        default=0.3,
        help="TTFT median tolerance, relative to the larger (default %(default)s)",
    )
    p.add_argument(
        "--ttft-abs",
        type=number_type(float, 0),
        default=0.03,
        help="TTFT median tolerance in seconds, if larger than the relative one (default "
        "%(default)s)",
    )
    args = p.parse_args(argv)
    try:
        return xcheck(args)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
