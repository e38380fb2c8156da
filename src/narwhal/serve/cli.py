"""``narwhal-serve``: the P/D router.

    narwhal-serve --fleet FLEET.json --host 127.0.0.1 --port 8000 --journal JOURNAL.jsonl \\
        [--skip-qualification | --check-report REPORT.json] [--profiles STORE.json] \\
        [--api-keys-file FILE] [--admin-token-file FILE]

Without --check-report, the router serves a fleet that narwhal-check's report qualifies where
the check leaves it by default: check-report.json in the working directory or beside the fleet.

Bad arguments or a bad fleet file: one line naming the problem, exit 2.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import math
import os
import re
import shlex
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any, Literal

from narwhal.asgi import tcp_bind_problem
from narwhal.contract import DEFAULT_REPORT_NAME, ContractError, load_fleet
from narwhal.contract.cli_errors import OneLineParser
from narwhal.contract.flags import out_of_range
from narwhal.contract.paths import empty_path, file_in_the_way
from narwhal.engines.client import ENGINE_TRANSPORTS
from narwhal.journal.claim import JournalInUse, claim_journal, journal_problem

__all__ = ["main", "serve_arguments", "serve_command"]

log = logging.getLogger("narwhal.serve")


def serve_arguments(
    fleet: str | Path, port: int, journal: str | Path, *extra: str, host: str = "127.0.0.1"
) -> list[str]:
    """narwhal-serve's arguments for a router on ``host:port`` (the demo, tests and benchmarks
    start their routers with these)."""
    return [
        "--fleet",
        str(fleet),
        "--host",
        host,
        "--port",
        str(port),
        "--journal",
        str(journal),
        *extra,
    ]


def serve_command(
    fleet: str | Path, port: int, journal: str | Path, *extra: str, host: str = "127.0.0.1"
) -> list[str]:
    """The whole command line: this interpreter running narwhal-serve with ``serve_arguments``."""
    return [
        sys.executable,
        "-m",
        "narwhal.serve.cli",
        *serve_arguments(fleet, port, journal, *extra, host=host),
    ]


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="narwhal-serve", description="Narwhal P/D router.")
    p.add_argument("--fleet", required=True, help="fleet contract JSON")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default %(default)s; without API keys a non-loopback host "
        "falls back to 127.0.0.1)",
    )
    p.add_argument(
        "--port", type=int, default=8000, help="TCP port to listen on (default %(default)s)"
    )
    p.add_argument("--journal", required=True, help="JSONL request journal path")
    p.add_argument("--profiles", help="profile store from narwhal-profile (enables scheduler v1)")
    p.add_argument(
        "--scheduler",
        choices=["auto", "v0", "v1"],
        default="auto",
        help="v1 routes and admits by the profiled latency models; v0 by least "
        "outstanding work; auto: v1 when a profile store is given",
    )
    q = p.add_mutually_exclusive_group()
    q.add_argument("--check-report", help="narwhal-check report that qualifies this fleet")
    q.add_argument(
        "--skip-qualification",
        action="store_true",
        help="serve an unqualified fleet (development only; logged loudly)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted API key (repeatable; prefer --api-keys-file or NARWHAL_API_KEYS)",
    )
    p.add_argument("--api-keys-file", help="file with one API key per line")
    p.add_argument("--admin-token-file", help="file holding the admin token for /admin/*")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest request body accepted, in bytes (413 above it; default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds to receive a request's whole head, and then its whole body (408 and the "
        "connection closed past either; default 60)",
    )
    p.add_argument(
        "--prefill-timeout",
        type=float,
        help="bound on one prefill leg (default: 3 x the TTFT budget, at least 30 s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests (default 30)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        help="seconds between /health probes of every engine (default %(default)s)",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between scrapes of every engine's /metrics for its load (default "
        "%(default)s)",
    )
    p.add_argument(
        "--breaker-failures",
        type=int,
        default=3,
        help="consecutive failures that open an engine's circuit breaker (default 3)",
    )
    p.add_argument(
        "--breaker-open-seconds",
        type=float,
        default=5.0,
        help="seconds an open breaker waits before a half-open probe (default 5)",
    )
    p.add_argument("--protect-metrics", action="store_true", help="require an API key on /metrics")
    p.add_argument(
        "--protect-health",
        action="store_true",
        help="require an API key on /health, /ready, /ping and /version",
    )
    p.add_argument(
        "--journal-fsync-interval",
        type=float,
        default=1.0,
        help="seconds between fsyncs of the journal file (default %(default)s)",
    )
    p.add_argument(
        "--journal-max-bytes",
        type=int,
        default=256 * 1024 * 1024,
        help="journal size in bytes at which it is rotated; five older files are kept (default "
        "%(default)s)",
    )
    p.add_argument(
        "--journal-on-error",
        choices=["fail_closed", "best_effort"],
        default="fail_closed",
        help="when the journal cannot write: refuse requests, or serve unrecorded",
    )
    p.add_argument(
        "--engine-transport",
        choices=list(ENGINE_TRANSPORTS),
        default="aiohttp",
        help="what moves the bytes to and from engines (docs/performance.md compares them)",
    )
    p.add_argument(
        "--relay",
        choices=["push", "asgi"],
        default=None,
        help="how decode events reach the client: pushed from the engine connection as they "
        "arrive (needs --engine-transport aiohttp; its default), or pulled by a task per "
        "stream (the default with httpx)",
    )
    p.add_argument(
        "--gc",
        choices=["tuned", "default"],
        default="tuned",
        help="garbage-collector settings: tuned for many open streams, or CPython's defaults",
    )
    c = p.add_argument_group("several replicas (docs/operations.md)")
    c.add_argument(
        "--coordination",
        metavar="etcd://HOST:PORT[,HOST:PORT...]",
        help="share engine roles with the other replicas through etcd, and elect the one that "
        "runs the role controller; without it this router is alone",
    )
    c.add_argument(
        "--replica-id",
        help="this replica's name, unique among the fleet's replicas (carried by every journal "
        "record); required with --coordination",
    )
    c.add_argument(
        "--coordination-lease-ttl",
        type=int,
        default=5,
        metavar="SECONDS",
        help="the etcd lease of each replica, 2 to 3600 (default %(default)s): a dead leader is "
        "replaced within about this",
    )
    p.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["critical", "error", "warning", "info", "debug"],
        help="logging level (default %(default)s)",
    )
    return p


# The flags that name a file. An empty one (an unset $STORE in a script) is refused: it read
# as the flag not given, and the router started without what it names (no profile store: the
# v0 scheduler; no keys file: no keys).
_PATH_FLAGS = ("fleet", "journal", "profiles", "check_report", "api_keys_file", "admin_token_file")
# A file of keys or a token is a few KiB at most: what is past this is not such a file.
_MAX_SECRETS_FILE_BYTES = 1 << 20
# The longest interval a background loop (health probes, scrapes, journal fsync) may be set to.
MAX_INTERVAL_S = 86400.0
# A replica's etcd lease: a dead leader holds the role controller this long at most. An hour
# is far past any outage a lease should ride out (etcd itself grants up to 285 years; the
# longest used here keeps the keep-alives out of a profiling run: docs/operations.md).
MAX_LEASE_TTL_S = 3600


def _read_secrets(path: str, what: str, warnings: list[str]) -> list[str]:
    try:
        mode = Path(path).stat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            # A device such as /dev/zero has no end. A pipe is read (a shell's process
            # substitution, --api-keys-file <(vault read ...), keeps a secret off the disk).
            raise UsageError(f"{path}: cannot read {what}: not a regular file or a pipe")
        with open(path, "rb") as file:
            data = file.read(_MAX_SECRETS_FILE_BYTES + 1)
        if len(data) > _MAX_SECRETS_FILE_BYTES:
            raise UsageError(f"{path}: cannot read {what}: larger than 1 MiB")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"{path}: cannot read {what}: {why or exc}") from None
    # A comment is a line whose first visible character is '#', indented or not (an indented
    # '#revoked-key' was read as a key).
    lines = (ln.strip() for ln in text.splitlines())
    values = [ln for ln in lines if ln and not ln.startswith("#")]
    if not values:
        raise UsageError(f"{path}: no {what} in the file")
    if stat.S_ISREG(mode) and mode & 0o077:
        warnings.append(
            f"{path}: other users may read the {what} (mode {mode & 0o777:o}): chmod 600"
        )
    return values


def _header_safe(secret: str) -> bool:
    """What a client can send in an Authorization header as written: visible ASCII. A key
    with other characters could never match (clients send them as Latin-1 bytes, or not)."""
    return all("!" <= c <= "~" for c in secret)


def live_generations(fleet: Any, timeout: float = 3.0) -> dict[str, str | None]:
    """Each engine's generation as its attestation endpoint reports it now (None: unknown)."""
    import httpx

    out: dict[str, str | None] = {}
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        for engine in fleet.engines:
            if not engine.attestation_url:
                out[engine.id] = engine.generation
                continue
            try:
                out[engine.id] = str(client.get(engine.attestation_url).json()["generation"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                log.warning("engine %s: attestation unreachable; generation not checked", engine.id)
                out[engine.id] = engine.generation
    return out


def _load_profiles(fleet: Any, path: str) -> tuple[Any, str]:
    from narwhal.contract import read_json_document
    from narwhal.profiles.store import generation_problems, parse_profile_store

    store, digest = parse_profile_store(read_json_document(path), path)
    contract = fleet.contract
    if not store.complete:
        raise UsageError(
            f"{path}: the profile store is incomplete (failed engines: "
            f"{', '.join(sorted(store.failures)) or 'unknown'}); re-profile"
        )
    ref = contract.profile_store
    if ref is not None and ref.sha256 != digest:
        raise UsageError(
            f"{path}: sha256 {digest} differs from the fleet's profile_store.sha256 {ref.sha256}"
        )
    problems = generation_problems(store, live_generations(contract))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(f"{path}: {problems[0]}{more}")
    return store, digest


def _verify_report(
    path: str, fleet: Any, profile_sha: str | None, warnings: list[str]
) -> dict[str, Any]:
    """The qualification the router journals, from a narwhal-check report that passed for
    exactly this fleet file and profile store; UsageError (one line) otherwise."""
    from narwhal.contract import load_report, qualification_problem

    report, digest = load_report(path)
    problem = qualification_problem(report, fleet.sha256, str(fleet.path), profile_sha)
    if problem is not None:
        raise UsageError(f"{path}: does not qualify this fleet: {problem}")
    # The report proved the engine processes it saw; a restart since is worth a loud line
    # (with a profile store, _load_profiles has already refused restarted engines).
    checked = {e: i.generation for e, i in report.engines.items()}
    live = live_generations(fleet.contract)
    restarted = sorted(
        e for e, g in checked.items() if g is not None and live.get(e) not in (None, g)
    )
    if restarted:
        warnings.append(
            f"engines restarted since the check report was made: {', '.join(restarted)} "
            "(re-run narwhal-check to qualify the running processes)"
        )
    log.info(
        "serving a qualified fleet: %s sha256 %s, report %s sha256 %s (%s)",
        fleet.path,
        fleet.sha256,
        path,
        digest,
        report.created_at,
    )
    return {
        "status": "qualified",
        "report": str(Path(path).absolute()),  # for tools that read it from elsewhere
        "report_sha256": digest,
        "report_created_at": report.created_at,
        "fleet_sha256": report.fleet.sha256,
        "profile_sha256": report.profile_store.sha256 if report.profile_store else None,
        "engine_generations": checked,
    }


def _report_candidates(fleet: Any) -> list[Path]:
    """Where narwhal-check leaves its report by default (``check-report.json``, in the
    directory it ran from), looked for in the working directory and beside the fleet file."""
    out: list[Path] = []
    for folder in (Path.cwd(), Path(fleet.path).resolve().parent):
        candidate = folder / DEFAULT_REPORT_NAME
        if candidate not in out:
            out.append(candidate)
    return out


def _find_report(fleet: Any, profile_sha: str | None, warnings: list[str]) -> dict[str, Any] | None:
    """The qualification from the default-named check report that qualifies this fleet (the
    reference run serves without naming it), or None when there is none; UsageError (one
    line) when reports exist and none qualifies, with the first one's reason."""
    first_problem: str | None = None
    for path in _report_candidates(fleet):
        if not path.is_file():
            continue
        try:
            return _verify_report(str(path), fleet, profile_sha, warnings)
        except (ContractError, UsageError) as exc:
            first_problem = first_problem or str(exc)
    if first_problem is not None:
        raise UsageError(
            f"{first_problem} (pass --check-report REPORT or --skip-qualification for development)"
        )
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_settings(args: argparse.Namespace) -> tuple[Any, str]:
    from narwhal.serve.auth import hash_secret
    from narwhal.serve.settings import ServeSettings

    paths = ((f"--{name.replace('_', '-')}", getattr(args, name)) for name in _PATH_FLAGS)
    if (why := empty_path(paths)) is not None:
        raise UsageError(why)
    fleet = load_fleet(args.fleet)
    if not (0 < args.port < 65536):
        raise UsageError(f"--port: {args.port} is not a TCP port")
    for name in (
        "max_body_bytes",
        "body_timeout",
        "drain_timeout",
        "health_interval",
        "scrape_interval",
        "journal_fsync_interval",
        "journal_max_bytes",
        "breaker_failures",
        "breaker_open_seconds",
    ):
        # A loop's interval past a day is a slip of the exponent (1e20 is a finite number): its
        # loop would in effect never run again (no health probe, no fsync) without a word.
        high = MAX_INTERVAL_S if name.endswith("interval") else None
        reason = out_of_range(getattr(args, name), 0, high, low_allowed=False)
        if reason is not None:
            raise UsageError(f"--{name.replace('_', '-')}: {reason}")
    if args.prefill_timeout is not None:
        reason = out_of_range(args.prefill_timeout, 0, low_allowed=False)
        if reason is not None:
            raise UsageError(f"--prefill-timeout: {reason}")
    relay: Literal["push", "asgi"] = args.relay or (
        "push" if args.engine_transport == "aiohttp" else "asgi"
    )
    if relay == "push" and args.engine_transport != "aiohttp":
        # Pushing rides the router's own engine connections; over httpx it would quietly be
        # the pull relay.
        raise UsageError(
            f"--relay push: needs --engine-transport aiohttp (got {args.engine_transport})"
        )
    coordination: tuple[str, ...] = ()
    if args.coordination is not None:
        from narwhal.coordination import parse_coordination_url

        try:
            coordination = tuple(parse_coordination_url(args.coordination))
        except ValueError as exc:
            raise UsageError(f"--coordination: {exc}") from None
        if not args.replica_id:
            raise UsageError("--coordination needs --replica-id ID (unique among the replicas)")
    # Checked with or without --coordination: a value that could never work is a mistake now,
    # not when coordination is turned on.
    if args.coordination_lease_ttl < 2:
        raise UsageError("--coordination-lease-ttl: at least 2 seconds")
    if args.coordination_lease_ttl > MAX_LEASE_TTL_S:
        raise UsageError(
            f"--coordination-lease-ttl: at most {MAX_LEASE_TTL_S} seconds (a dead leader "
            f"keeps the role controller that long; got {args.coordination_lease_ttl})"
        )
    replica_name = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
    if args.replica_id is not None and not re.fullmatch(replica_name, args.replica_id):
        raise UsageError(
            f"--replica-id: {args.replica_id!r} is not a name of at most 63 letters, digits, "
            "'.', '_', '-' (beginning with a letter or digit)"
        )
    if not args.host.strip():
        # An empty host is every interface to the server: say so, don't do it by accident.
        raise UsageError("--host: empty (name the address to listen on; 0.0.0.0 for every one)")
    if args.journal.endswith("/") or os.path.basename(args.journal) in (".", ".."):
        # A directory's name: Path() drops the slash, and out/new/ became the file out/new.
        raise UsageError(f"--journal: {args.journal} names a directory (a journal is a file)")
    journal = Path(args.journal)
    try:
        journal_mode: int | None = journal.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        journal_mode = None  # a new journal (or a parent that is no directory: said below)
    except (OSError, ValueError) as exc:  # a loop of links, a name too long, a NUL
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise UsageError(f"--journal: {journal}: {why or exc}") from None
    if journal_mode is not None and stat.S_ISDIR(journal_mode):
        raise UsageError(f"--journal: {journal} is a directory")
    if journal_mode is not None and not stat.S_ISREG(journal_mode):
        # /dev/null took every record and failed each fsync: the router answered 503 to all.
        raise UsageError(f"--journal: {journal} is not a regular file")
    if (blocker := file_in_the_way(journal)) is not None:
        raise UsageError(f"--journal: {blocker} is not a directory")
    if (problem := journal_problem(journal)) is not None:
        raise UsageError(f"--journal: {journal} is not a Narwhal journal ({problem})")
    blank = [k for k in args.api_key if not k.strip()]
    if blank:
        # An empty key would count as "keys configured" (no loopback fallback) yet admit no one.
        raise UsageError("--api-key: an API key must not be empty")
    # Warnings wait until every check passed: a refused start prints only its one line.
    warnings: list[str] = []
    sources = [("--api-key", list(args.api_key))]
    if args.api_keys_file:
        keys_file = args.api_keys_file
        sources.append((keys_file, _read_secrets(keys_file, "API keys", warnings)))
    from_env = os.environ.get("NARWHAL_API_KEYS")
    if from_env is not None:
        env_keys = [k.strip() for k in from_env.split(",") if k.strip()]
        if from_env.strip() and not env_keys:
            raise UsageError("NARWHAL_API_KEYS: no API key in it (comma-separated keys)")
        sources.append(("NARWHAL_API_KEYS", env_keys))
    keys: list[str] = []
    for source, given in sources:
        if not all(_header_safe(key) for key in given):
            raise UsageError(
                f"{source}: an API key must be printable ASCII without spaces (an HTTP header "
                "carries no other bytes as they were written)"
            )
        keys += given
    admin_hash = None
    if args.admin_token_file:
        token = _read_secrets(args.admin_token_file, "admin token", warnings)[0]
        if not _header_safe(token):
            raise UsageError(
                f"{args.admin_token_file}: the admin token must be printable ASCII without spaces"
            )
        admin_hash = hash_secret(token)
    host = args.host
    if not keys and not _is_loopback(host):
        warnings.append(f"no API keys configured: binding to 127.0.0.1 instead of {host}")
        host = "127.0.0.1"
    if not keys:
        warnings.append("no API keys configured: any local client can use this router")
    profiles, profile_sha = None, None
    store_path = args.profiles or fleet.profile_store_path
    if store_path and not args.profiles and not Path(store_path).exists():
        # The fleet's own pin: say which field named it (the path alone read as a flag's).
        raise UsageError(f"{fleet.path}: profile_store.path: {store_path}: no such file")
    if store_path:
        profiles, profile_sha = _load_profiles(fleet, store_path)
    scheduler = args.scheduler
    if scheduler == "auto":
        scheduler = "v1" if profiles is not None else "v0"
    if scheduler == "v1" and profiles is None:
        raise UsageError("--scheduler v1 needs a profile store (--profiles STORE)")
    if args.check_report:
        qualification = _verify_report(args.check_report, fleet, profile_sha, warnings)
    elif not args.skip_qualification and (found := _find_report(fleet, profile_sha, warnings)):
        qualification = found
    elif args.skip_qualification:
        warnings.append(
            f"SERVING AN UNQUALIFIED FLEET (--skip-qualification): {fleet.path} "
            f"sha256 {fleet.sha256}"
        )
        qualification = {"status": "skipped"}
    else:
        looked = " and ".join(str(p) for p in _report_candidates(fleet))
        raise UsageError(
            f"this fleet is not qualified: no narwhal-check report at {looked}; pass "
            "--check-report REPORT (from narwhal-check) or --skip-qualification for development"
        )
    # Before the warnings: a router that cannot listen says so in its one line.
    if (problem := tcp_bind_problem(host, args.port)) is not None:
        raise UsageError(f"--host/--port: {problem}")
    # Last: every check above passed, so a refused start leaves no claim held.
    try:
        journal_claim = claim_journal(journal)
    except JournalInUse as exc:
        raise UsageError(
            f"--journal: {journal} is in use by another router (process {exc.holder}): every"
            " router writes a journal of its own"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"--journal: {journal}: cannot write there: {exc.strerror or exc}"
        ) from None
    for warning in warnings:
        log.warning("%s", warning)
    settings = ServeSettings(
        fleet=fleet,
        # Absolute: /admin/state and router.start name it for tools that run elsewhere (a
        # benchmark runner finds the journal there); the router's own cwd does not move.
        journal_path=journal.absolute(),
        api_key_hashes=tuple(hash_secret(k.strip()) for k in keys),
        admin_token_hash=admin_hash,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        health_interval_s=args.health_interval,
        scrape_interval_s=args.scrape_interval,
        prefill_timeout_s=args.prefill_timeout,
        drain_timeout_s=args.drain_timeout,
        breaker_failures=args.breaker_failures,
        breaker_open_s=args.breaker_open_seconds,
        protect_metrics=args.protect_metrics,
        protect_health=args.protect_health,
        journal_fsync_interval_s=args.journal_fsync_interval,
        journal_max_bytes=args.journal_max_bytes,
        journal_on_error=args.journal_on_error,
        profile_sha256=profile_sha,
        profiles=profiles,
        profile_store_path=str(Path(store_path).resolve()) if store_path else None,
        scheduler=scheduler,
        qualification=qualification,
        engine_transport=args.engine_transport,
        relay=relay,
        command=getattr(args, "command", None),
        coordination=coordination,
        replica_id=args.replica_id,
        coordination_lease_ttl_s=args.coordination_lease_ttl,
        journal_claim=journal_claim,
    )
    return settings, host


def masked_command(argv: list[str]) -> str:
    """``argv`` as a shell line, with the values of secret-bearing options masked."""
    out: list[str] = []
    hide = False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
        elif arg == "--api-key":
            out.append(arg)
            hide = True
        elif arg.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(arg)
    return shlex.join(out)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.command = masked_command([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # One line per engine call would drown the router's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings, host = build_settings(args)
    except (ContractError, UsageError) as exc:
        print(f"narwhal-serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from narwhal.asgi import HotRouteDispatch
    from narwhal.serve.app import build_app
    from narwhal.serve.http_protocol import bounded_http_protocol

    app = build_app(settings)
    if args.gc == "tuned":
        _tune_gc()

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if args.gc == "tuned" and self.started:
                _freeze_start_up()

        drain_deadline: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop admitting at once, and go on listening while the requests in flight end:
            # clients and load balancers get 503 `draining` (and /ready says so), not a
            # refused connection, until none is left or --drain-timeout passes (on_tick);
            # uvicorn's own shutdown then closes the socket. A second signal shuts down now.
            if self.drain_deadline is None and not self.should_exit:
                app.state.services.ledger.draining = True
                self.drain_deadline = time.monotonic() + args.drain_timeout
                return
            if not self.should_exit:
                # The drain cut short: what is open is cancelled after a second, not after
                # another --drain-timeout (a third signal exits without waiting at all).
                self.config.timeout_graceful_shutdown = 1
            super().handle_exit(sig, frame)
            # A drained shutdown is a success: exit 0 rather than re-raise the signal.
            self._captured_signals.clear()

        async def on_tick(self, counter: int) -> bool:
            deadline = self.drain_deadline
            if deadline is not None:
                # On the loop, unlike handle_exit (a signal handler): leadership is handed
                # over as the drain starts.
                app.state.services.hand_over_leadership()
            if deadline is not None and not self.should_exit:
                left = deadline - time.monotonic()
                if left <= 0 or not app.state.services.ledger.active:
                    # What is still open is cancelled after a second (the handlers end it
                    # with an OpenAI error); responses being written get what time is left.
                    self.config.timeout_graceful_shutdown = max(1, math.ceil(left))
                    self.should_exit = True
            return await super().on_tick(counter)

    config = uvicorn.Config(
        HotRouteDispatch.of(app),
        host=host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=max(1, math.ceil(args.drain_timeout)),
        loop="uvloop",
        # uvicorn's httptools protocol, bounded: a request's head within --body-timeout and
        # 64 KiB, and disconnects told to pipelined requests (serve/http_protocol.py).
        http=bounded_http_protocol(args.body_timeout),
        ws="none",  # no WebSocket routes: an upgrade is answered as the HTTP request it is
        lifespan="on",
    )
    server = Server(config)
    server.run()
    return 0 if server.started else 1


def _tune_gc() -> None:
    """Garbage collection sized for thousands of open streams.

    Each open stream holds a few hundred tracked objects (tasks, frames, responses). With the
    default thresholds CPython ran a full collection each time that population grew by a
    quarter: bench/streams_memory.py saw 30 of them while 10,000 streams opened, up to 6 s
    each, long enough for every health probe to time out at once. Freezing what start-up
    allocated takes it out of every collection; a larger young generation makes collections
    rarer, the object graph being mostly acyclic request state freed by reference counting.
    Generation 1 is collected every fourth young collection: while streams open most young
    objects survive, and with CPython's 10 (or 20) young collections between generation-1
    collections, one of them took 733 ms; with 4, the longest was 311 ms.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 4, 100)


def _freeze_start_up() -> None:
    """Once serving: freeze what the lifespan built too (engine connections, the first etcd
    session, the modules they imported on first use). Left young, those few thousand objects
    would be traversed by the first collection and bring it forward by their number, a start
    that differs from one router to another (a coordinated replica's ~3,500 more)."""
    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
