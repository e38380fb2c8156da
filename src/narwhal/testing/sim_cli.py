"""``narwhal-sim``: run one simulated vLLM engine, or every engine of a fleet file.

narwhal-sim engine --fleet configs/fleet/local-sim.json --engine-id e0
narwhal-sim engine --port 8100 --nixl-port 8200 --model m --time-scale 10
narwhal-sim fleet --fleet configs/fleet/local-sim.json

``engine`` is the simulated engine's own command (``narwhal.simengine.cli``); ``fleet`` is the
local launcher (``narwhal.testing.fleet``), which starts one ``engine`` process per engine.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from narwhal.contract import ContractError, load_fleet
from narwhal.contract.flags import positive
from narwhal.simengine.cli import add_engine_parser, run_engine
from narwhal.testing.fleet import SimFleet, SimFleetError

__all__ = ["main"]

# How often the launcher looks for an engine that exited while the fleet runs.
_WATCH_INTERVAL_S = 0.2


def _add_fleet_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet", help="run every engine of a fleet file until Ctrl-C or SIGTERM")
    p.add_argument("--fleet", required=True)
    p.add_argument("--engines", help="comma-separated engine ids (default: all)")
    p.add_argument("--admin-token")
    p.add_argument("--log-dir", help="write each engine's log here (default: inherit the terminal)")
    p.add_argument("--startup-timeout", type=positive(float), default=60.0)


def _run_fleet(args: argparse.Namespace) -> int:
    ids = None
    if args.engines is not None:
        ids = [e.strip() for e in args.engines.split(",") if e.strip()]
        if not ids:
            return _usage("--engines: no engine id given")
    if args.log_dir is not None and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        return _usage(f"--log-dir: {args.log_dir} is not a directory")
    try:
        if ids is not None:
            known = {e.id for e in load_fleet(args.fleet).contract.engines}
            unknown = [e for e in ids if e not in known]
            if unknown:
                return _usage(f"--engines: {', '.join(unknown)} not in the fleet")
        fleet = SimFleet(
            args.fleet, admin_token=args.admin_token, log_dir=args.log_dir, engine_ids=ids
        )
    except ContractError as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 2
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        fleet.start(timeout=args.startup_timeout)
        for engine in fleet.engines.values():
            pid = engine.process.pid if engine.process else "?"
            print(f"{engine.engine_id} ready at {engine.url} (pid {pid})", flush=True)
        print("fleet running; Ctrl-C stops it", flush=True)
        reported: set[str] = set()
        while not stop["now"]:
            for engine in fleet.engines.values():
                if not engine.alive and engine.engine_id not in reported:
                    code = engine.process.returncode if engine.process else None
                    print(
                        f"{engine.engine_id} exited with code {code}", file=sys.stderr, flush=True
                    )
                    reported.add(engine.engine_id)
            time.sleep(_WATCH_INTERVAL_S)
    except SimFleetError as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    print("fleet stopped", flush=True)
    return 0


def _usage(message: str) -> int:
    print(f"narwhal-sim: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_engine_parser(sub)
    _add_fleet_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "engine":
        return run_engine(args)
    return _run_fleet(args)


if __name__ == "__main__":
    sys.exit(main())
