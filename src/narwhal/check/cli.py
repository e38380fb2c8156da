"""``narwhal-check``: preflight gates that qualify a fleet before it serves.

    narwhal-check --fleet FLEET [--profiles STORE] [--gates g1,g2] [--report OUT] [--plan PLAN]

Gates, in order: health, contract, generation, model, pace, tokenization, kv_transfer, slo.
Prints one row per gate and writes the JSON report (``narwhal.check-report/v1``) to OUT with
OUT.sha256 beside it. Exit 0 when no requested gate failed (a gate is skipped only when it was
not requested or its input, the profile store, is absent); 1 when a gate failed; 2 on bad
arguments or inputs (one line, no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import sys
from pathlib import Path

from narwhal.check.plan import BenchmarkPlan
from narwhal.check.runner import NEEDS_STORE, CheckInputs, run_check
from narwhal.check.settings import CheckSettings
from narwhal.check.table import render_table
from narwhal.clock import MonotonicClock
from narwhal.contract import (
    DEFAULT_REPORT_NAME,
    GATE_NAMES,
    ContractError,
    FileRef,
    load_fleet,
    read_json_document,
    sha256_hex,
    validate_document,
)
from narwhal.contract.cli_errors import OneLineParser
from narwhal.contract.paths import empty_path, input_overwritten, why_unwritable
from narwhal.profiles.store import parse_profile_store

__all__ = ["main"]


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    d = CheckSettings()
    p = OneLineParser(prog="narwhal-check", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--fleet", required=True, help="fleet contract JSON")
    p.add_argument(
        "--profiles", help="profile store (default: the fleet's profile_store.path, if any)"
    )
    p.add_argument("--gates", help=f"comma-separated subset of {','.join(GATE_NAMES)}")
    p.add_argument(
        "--report",
        default=DEFAULT_REPORT_NAME,
        help="where to write the report (default %(default)s)",
    )
    p.add_argument("--plan", help="benchmark plan (narwhal.benchmark-plan/v1) for the slo gate")
    p.add_argument(
        "--health-timeout",
        type=float,
        default=d.health_timeout_s,
        help="seconds allowed for each health, attestation, /v1/models and metrics call "
        "(default %(default)s)",
    )
    p.add_argument(
        "--probe-timeout",
        type=float,
        default=d.probe_timeout_s,
        help="seconds allowed for any single generation probe (default %(default)s)",
    )
    p.add_argument(
        "--generation-tokens",
        type=int,
        default=d.generation_tokens,
        help="greedy tokens each engine generates in the generation gate (default %(default)s)",
    )
    p.add_argument(
        "--pace-tolerance",
        type=float,
        default=d.pace_tolerance,
        help="relative deviation allowed from the profile store (default %(default)s)",
    )
    p.add_argument(
        "--pace-repeats",
        type=int,
        default=d.pace_repeats,
        help="timed prefill probes per engine in the pace gate, after one warm-up (default "
        "%(default)s)",
    )
    p.add_argument(
        "--token-tolerance",
        type=float,
        default=d.token_tolerance,
        help="relative error allowed in the router's prompt-length estimate (default %(default)s)",
    )
    p.add_argument(
        "--kv-probes",
        type=int,
        default=d.kv_probes,
        help="handoffs per pair (default %(default)s)",
    )
    p.add_argument(
        "--kv-prompt-tokens",
        type=int,
        default=None,
        help="prompt tokens of each handoff probe (default: the plan's input_tokens, else the "
        "store's longest profiled prompt, else 1024)",
    )
    p.add_argument(
        "--kv-output-tokens",
        type=int,
        default=d.kv_output_tokens,
        help="decode tokens streamed by each handoff probe (default %(default)s)",
    )
    p.add_argument(
        "--kv-window",
        type=float,
        default=None,
        help="observation window per leg (default: max(TTFT budget, 2 x deadline))",
    )
    p.add_argument(
        "--kv-margin",
        type=float,
        default=d.kv_margin,
        help="relative margin of a recommended deadline over the observed maximum (default "
        "%(default)s)",
    )
    p.add_argument(
        "--tpot-headroom",
        type=float,
        default=d.tpot_headroom,
        help="fraction of the TPOT budget the batch-1 decode time must leave free in the slo "
        "gate (default %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _settings(args: argparse.Namespace) -> CheckSettings:
    positive = {
        "--health-timeout": args.health_timeout,
        "--probe-timeout": args.probe_timeout,
        "--pace-tolerance": args.pace_tolerance,
        "--token-tolerance": args.token_tolerance,
    }
    # Finite too: the report records every setting, and JSON has no infinity.
    for flag, value in positive.items():
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{flag}: must be a finite number greater than 0 (got {value})")
    for flag, value in {
        "--generation-tokens": args.generation_tokens,
        "--pace-repeats": args.pace_repeats,
        "--kv-probes": args.kv_probes,
        "--kv-output-tokens": args.kv_output_tokens,
    }.items():
        if value < 1:
            raise UsageError(f"{flag}: must be at least 1 (got {value})")
    if args.kv_prompt_tokens is not None and args.kv_prompt_tokens < 1:
        raise UsageError(f"--kv-prompt-tokens: must be at least 1 (got {args.kv_prompt_tokens})")
    if args.kv_window is not None and not (args.kv_window > 0 and math.isfinite(args.kv_window)):
        raise UsageError(
            f"--kv-window: must be a finite number greater than 0 (got {args.kv_window})"
        )
    if not (args.kv_margin >= 0 and math.isfinite(args.kv_margin)):
        raise UsageError(
            f"--kv-margin: must be a finite number, not negative (got {args.kv_margin})"
        )
    if not 0 <= args.tpot_headroom < 1:
        raise UsageError(f"--tpot-headroom: must be in [0, 1) (got {args.tpot_headroom})")
    return CheckSettings(
        health_timeout_s=args.health_timeout,
        probe_timeout_s=args.probe_timeout,
        generation_tokens=args.generation_tokens,
        pace_tolerance=args.pace_tolerance,
        pace_repeats=args.pace_repeats,
        token_tolerance=args.token_tolerance,
        kv_probes=args.kv_probes,
        kv_prompt_tokens=args.kv_prompt_tokens,
        kv_output_tokens=args.kv_output_tokens,
        kv_window_s=args.kv_window,
        kv_margin=args.kv_margin,
        tpot_headroom=args.tpot_headroom,
    )


def _gates(text: str | None) -> tuple[list[str], bool]:
    """(requested gates, whether the user chose them)."""
    if text is None:
        return list(GATE_NAMES), False
    names = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in names if g not in GATE_NAMES]
    if unknown:
        raise UsageError(
            f"--gates: unknown gate(s) {', '.join(unknown)} (gates: {', '.join(GATE_NAMES)})"
        )
    if not names:
        raise UsageError("--gates: name at least one gate")
    return names, True


def _refuse_empty_paths(args: argparse.Namespace) -> None:
    """An empty path (an unset variable in a script) names no file: ``--profiles ''`` read as
    "no store" and ``--report ''`` as the working directory."""
    why = empty_path(
        (
            ("--fleet", args.fleet),
            ("--profiles", args.profiles),
            ("--plan", args.plan),
            ("--report", args.report),
        )
    )
    if why is not None:
        raise UsageError(why)


def _refuse_overwriting_inputs(out: Path, inputs: CheckInputs, args: argparse.Namespace) -> None:
    """Before anything is written: the report, or its sidecar, would replace an input."""
    loaded = inputs.fleet
    named = {"the file given with --fleet": loaded.path}
    if inputs.store_ref is not None:
        given = (
            "the file given with --profiles" if args.profiles else "the fleet's profile_store.path"
        )
        named[given] = Path(inputs.store_ref.path)
    if inputs.plan_ref is not None:
        named["the file given with --plan"] = Path(inputs.plan_ref.path)
    if (key_path := loaded.api_key_path) is not None:
        named["the fleet's engine.api_key_file"] = key_path
    if why := input_overwritten("--report", out, [Path(str(out) + ".sha256")], named):
        raise UsageError(why)


def build_inputs(args: argparse.Namespace) -> tuple[CheckInputs, list[str]]:
    requested, explicit = _gates(args.gates)
    loaded = load_fleet(args.fleet)
    fleet = loaded.contract
    store = store_ref = None
    store_path = args.profiles or loaded.profile_store_path
    if store_path and not args.profiles and not Path(store_path).exists():
        # The fleet's own pin: say which field named it (the path alone read as a flag's).
        raise UsageError(f"{loaded.path}: profile_store.path: {store_path}: no such file")
    if store_path:
        store, digest = parse_profile_store(read_json_document(store_path), store_path)
        if not store.complete:
            raise UsageError(
                f"{store_path}: the profile store is incomplete (failed engines: "
                f"{', '.join(sorted(store.failures)) or 'unknown'}); re-profile"
            )
        if fleet.profile_store is not None and fleet.profile_store.sha256 != digest:
            raise UsageError(
                f"{store_path}: sha256 {digest} differs from the fleet's "
                f"profile_store.sha256 {fleet.profile_store.sha256}"
            )
        store_ref = FileRef(path=store_path, sha256=digest)
    elif explicit and NEEDS_STORE & set(requested):
        needing = sorted(NEEDS_STORE & set(requested))
        raise UsageError(f"--gates {','.join(needing)} needs a profile store (--profiles STORE)")
    plan = plan_ref = None
    if args.plan:
        raw = read_json_document(args.plan)
        plan = validate_document(raw, BenchmarkPlan, args.plan)
        plan_ref = FileRef(path=args.plan, sha256=sha256_hex(raw))
        if store is None:
            raise UsageError("--plan: predicting a plan needs a profile store (--profiles STORE)")
    return CheckInputs(loaded, store, store_ref, plan, plan_ref), requested


def run(args: argparse.Namespace) -> int:
    _refuse_empty_paths(args)
    settings = _settings(args)
    inputs, requested = build_inputs(args)
    out = Path(args.report)
    _refuse_overwriting_inputs(out, inputs, args)
    # Before the gates run (minutes): a report that cannot be written fails now.
    why = why_unwritable(out)
    if why is not None:
        raise UsageError(f"--report: {why}")

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    report = asyncio.run(
        run_check(
            inputs,
            settings,
            requested,
            MonotonicClock(),
            lambda: dt.datetime.now(dt.UTC),
            progress,
        )
    )
    document = report.document()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
        digest = sha256_hex(document)
        Path(str(out) + ".sha256").write_text(f"{digest}  {out.name}\n")
    except OSError as exc:
        raise UsageError(f"--report: cannot write {out}: {exc.strerror or exc}") from None
    print(render_table(report))
    for gate in report.gates:
        for failure in gate.failures:
            print(f"  {gate.name}: FAIL {failure}")
        for note in gate.notes:
            print(f"  {gate.name}: note: {note}")
    print(f"report: {out}  sha256 {digest}")
    return 1 if report.verdict == "fail" else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ContractError, UsageError) as exc:
        print(f"narwhal-check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
