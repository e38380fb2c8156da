"""``narwhal-profile``: profile live engines and write a profile store.

    narwhal-profile --fleet FLEET --limits LIMITS --prefill-lens 256,1024,4096,8192 \\
        --decode-input-lens 512,4096,8192 --decode-concurrency 1,2,4 --decode-tokens 64 \\
        --prefill-repeats 3 [--engines e0,e1] [--out STORE] [--force]

Exit 0 with a complete store; 1 when any engine could not be profiled (nothing is written as
the store; the partial results go to STORE.partial.json, marked incomplete); 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from narwhal.contract import (
    ContractError,
    LoadedFleet,
    load_fleet,
    read_json_document,
    sha256_hex,
    validate_document,
)
from narwhal.contract.cli_errors import OneLineParser
from narwhal.contract.loader import validation_reasons
from narwhal.contract.paths import empty_path, input_overwritten, why_unwritable
from narwhal.profiler.runner import profile_fleet
from narwhal.profiles.store import ProfileStore, ProfilingLimits, ProfilingPlan, store_bytes
from narwhal.profiles.table import profile_table

__all__ = ["main"]


class UsageError(Exception):
    pass


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--{name}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"--{name}: values must be positive integers, got {text!r}")
    if len(set(values)) != len(values):
        raise UsageError(f"--{name}: duplicate values in {text!r}")
    return values


# The comma-separated integer lists: their value is taken even when it starts with "-".
_LIST_FLAGS = ("--prefill-lens", "--decode-input-lens", "--decode-concurrency")


def _join_list_values(argv: Sequence[str]) -> list[str]:
    """``--prefill-lens -5,128`` as ``--prefill-lens=-5,128``: argparse takes "-5,128" for an
    option (only "-5" reads as a negative number) and said "expected one argument"; joined,
    the value reaches the range check, which names it."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if arg in _LIST_FLAGS and value[:1] == "-" and value[1:2].isdigit():
            out.append(f"{arg}={value}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="narwhal-profile", description=__doc__.splitlines()[0])
    p.add_argument("--fleet", required=True, help="fleet contract JSON")
    p.add_argument("--limits", required=True, help="profiling limits JSON")
    p.add_argument(
        "--prefill-lens",
        default="256,1024,4096,8192",
        help="comma-separated prompt lengths in tokens of the prefill probes (default %(default)s)",
    )
    p.add_argument(
        "--decode-input-lens",
        default="512,4096,8192",
        help="comma-separated prompt lengths in tokens of the decode probes (default %(default)s)",
    )
    p.add_argument(
        "--decode-concurrency",
        default="1,2,4",
        help="comma-separated numbers of concurrent streams per decode probe (default %(default)s)",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=64,
        help="output tokens of each decode probe stream (default %(default)s)",
    )
    p.add_argument(
        "--prefill-repeats",
        type=int,
        default=3,
        help="times each prefill length is probed (default %(default)s)",
    )
    p.add_argument("--engines", help="comma-separated engine ids (default: all)")
    p.add_argument(
        "--out",
        default="profile-store.json",
        help="where to write the profile store, with STORE.sha256 beside it (default %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="profile engines that are not idle")
    p.add_argument("--quiet", action="store_true", help="no per-probe progress")
    return p


def run(args: argparse.Namespace) -> int:
    paths = (("--fleet", args.fleet), ("--limits", args.limits), ("--out", args.out))
    if (why := empty_path(paths)) is not None:
        raise UsageError(why)
    loaded = load_fleet(args.fleet)
    fleet = loaded.contract
    limits = validate_document(
        read_json_document(args.limits), ProfilingLimits, args.limits, strict=True
    )
    try:
        plan = ProfilingPlan(
            prefill_lens=_int_list(args.prefill_lens, "prefill-lens"),
            prefill_repeats=args.prefill_repeats,
            decode_input_lens=_int_list(args.decode_input_lens, "decode-input-lens"),
            decode_concurrency=_int_list(args.decode_concurrency, "decode-concurrency"),
            decode_tokens=args.decode_tokens,
        )
    except ValidationError as exc:
        # Named by the flag that set the field (they are the plan's fields, dashed).
        loc, reason = validation_reasons(exc)[0]
        where = f"--{str(loc[0]).replace('_', '-')}" if loc else "profiling plan"
        raise UsageError(f"{where}: {reason}") from None
    longest = max(max(plan.prefill_lens), max(plan.decode_input_lens) + plan.decode_tokens)
    if longest > fleet.model.max_model_len:
        raise UsageError(
            f"a probe of {longest} tokens exceeds the fleet's max_model_len "
            f"{fleet.model.max_model_len}"
        )
    if plan.tokens_needed() > limits.max_tokens_per_engine:
        raise UsageError(
            f"{args.limits}: max_tokens_per_engine {limits.max_tokens_per_engine} "
            f"is below the {plan.tokens_needed()} tokens this plan needs per engine"
        )
    ids = [e.id for e in fleet.engines]
    if args.engines is not None:
        ids = [e.strip() for e in args.engines.split(",") if e.strip()]
        if not ids:
            raise UsageError("--engines: no engine id given")
        unknown = [e for e in ids if e not in {s.id for s in fleet.engines}]
        if unknown:
            raise UsageError(f"--engines: {', '.join(unknown)} not in the fleet")
        # Named twice, an engine was profiled twice at once: its probes overlapped.
        twice = sorted({e for e in ids if ids.count(e) > 1})
        if twice:
            raise UsageError(
                f"--engines: duplicate engine ids {', '.join(twice)} in {args.engines!r}"
            )
    out = Path(args.out)
    _refuse_overwriting_inputs(out, loaded, args.limits)
    _check_writable(out)

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    print(
        f"profiling {len(ids)} engine(s) of {fleet.name} ({plan.tokens_needed()} tokens each)",
        file=sys.stderr,
    )
    profiles, failures = asyncio.run(
        profile_fleet(
            fleet, ids, plan, limits, args.force, progress, engine_api_key=loaded.engine_api_key
        )
    )
    store = ProfileStore.model_validate(
        {
            "schema": "narwhal.profiles/v1",
            "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "complete": not failures,
            "fleet_name": fleet.name,
            "fleet_sha256": loaded.sha256,
            "plan": plan.model_dump(),
            "limits": limits.model_dump(by_alias=True),
            "engines": {k: v.model_dump() for k, v in profiles.items()},
            "failures": failures,
        }
    )
    data = store_bytes(store)
    if failures:
        partial = _partial_path(out)
        _write(partial, data)
        for engine_id, why in sorted(failures.items()):
            print(f"narwhal-profile: {engine_id}: {why}", file=sys.stderr)
        print(
            f"narwhal-profile: incomplete: {len(failures)} engine(s) failed; partial results "
            f"in {partial}; no store written",
            file=sys.stderr,
        )
        return 1
    _write(out, data)
    digest = sha256_hex(store.model_dump(mode="json", by_alias=True))
    _write(Path(str(out) + ".sha256"), f"{digest}  {out.name}\n".encode())
    print("\n".join(profile_table(store)))
    print(f"profile store: {out}  sha256 {digest}")
    return 0


def _partial_path(out: Path) -> Path:
    """Where an incomplete run writes its results instead of ``out``."""
    return out.with_name(out.stem + ".partial.json")


def _refuse_overwriting_inputs(out: Path, loaded: LoadedFleet, limits: str) -> None:
    """Before any engine is probed: the store, its sidecar or the partial results would
    replace an input (the fleet's own profile_store.path is not one: re-profiling replaces
    it)."""
    named = {
        "the file given with --fleet": loaded.path,
        "the file given with --limits": Path(limits),
    }
    if (key_path := loaded.api_key_path) is not None:
        named["the fleet's engine.api_key_file"] = key_path
    beside = [Path(str(out) + ".sha256"), _partial_path(out)]
    if why := input_overwritten("--out", out, beside, named):
        raise UsageError(why)


def _check_writable(out: Path) -> None:
    """Before any engine is probed (a run takes minutes): ``--out`` names a file this process
    can write, its directory created if missing."""
    why = why_unwritable(out)
    if why is not None:
        raise UsageError(f"--out: {why}")


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None


class OutputError(Exception):
    """The results could not be written (after the probes ran)."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_join_list_values(sys.argv[1:] if argv is None else argv))
    try:
        return run(args)
    except (ContractError, UsageError) as exc:
        print(f"narwhal-profile: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:
        print(f"narwhal-profile: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
