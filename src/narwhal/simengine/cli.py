"""``narwhal-sim``: run one simulated vLLM engine, or every engine of a fleet file.

narwhal-sim engine --fleet configs/fleet/local-sim.json --engine-id e0
narwhal-sim engine --port 8100 --nixl-port 8200 --model m --time-scale 10
narwhal-sim fleet --fleet configs/fleet/local-sim.json
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from narwhal.contract import ContractError, SimulatedEngineSettings, load_fleet
from narwhal.simengine.engine import EngineConfig
from narwhal.simengine.faults import FaultSettings
from narwhal.simengine.timing import sim_models

__all__ = ["main"]

log = logging.getLogger("narwhal.simengine")

_SIM_FIELDS = tuple(SimulatedEngineSettings.model_fields)


class UsageError(Exception):
    pass


def _engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("engine", help="run one simulated engine")
    p.add_argument("--fleet", help="take this engine's settings from a fleet file")
    p.add_argument("--engine-id", help="engine id (with --fleet: which engine to run)")
    p.add_argument("--host", help="HTTP bind address (default: from the fleet URL, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default: from the fleet URL)")
    p.add_argument("--nixl-host", help="NIXL side-channel host (default 127.0.0.1)")
    p.add_argument("--nixl-port", type=int, help="NIXL side-channel port")
    p.add_argument("--model", help="served model name")
    p.add_argument("--model-revision")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--tp", type=int, help="tensor parallel size reported in kv_transfer_params")
    p.add_argument("--gpu-arch")
    p.add_argument("--accelerator")
    p.add_argument("--config-sha256")
    p.add_argument("--shard-manifest-sha256")
    p.add_argument(
        "--admin-token", help="enables /sim/faults and /sim/state with this bearer token"
    )
    for name in _SIM_FIELDS:
        if name == "extra_args":
            continue
        kind = SimulatedEngineSettings.model_fields[name].annotation
        p.add_argument(f"--{name.replace('_', '-')}", type=int if kind is int else float, dest=name)
    faults = p.add_argument_group("fault injection (also settable at run time via /sim/faults)")
    faults.add_argument(
        "--fault-fail-next", type=int, default=0, help="answer the next N requests 503"
    )
    faults.add_argument("--fault-crash-on-prefill", action="store_true")
    faults.add_argument("--fault-crash-on-kv-read", action="store_true")
    faults.add_argument("--fault-crash-after-tokens", type=int)
    faults.add_argument("--fault-hang-kv-read-s", type=float, default=0.0)
    faults.add_argument("--fault-stall-first-token-s", type=float, default=0.0)
    faults.add_argument("--fault-drop-stream-after-tokens", type=int)
    faults.add_argument("--fault-metrics", choices=["ok", "lie", "stop", "hang"], default="ok")
    p.add_argument("--log-level", default="warning")


def _fleet_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet", help="run every engine of a fleet file until Ctrl-C or SIGTERM")
    p.add_argument("--fleet", required=True)
    p.add_argument("--engines", help="comma-separated engine ids (default: all)")
    p.add_argument("--admin-token")
    p.add_argument("--log-dir", help="write each engine's log here (default: inherit the terminal)")
    p.add_argument("--startup-timeout", type=float, default=60.0)


def _resolve_engine(args: argparse.Namespace) -> tuple[Any, str, int]:
    from narwhal.simengine.server import SimEngineSettings

    sim = SimulatedEngineSettings()
    engine_id = args.engine_id or "sim0"
    host, port = "127.0.0.1", None
    nixl_host, nixl_port = "127.0.0.1", None
    model, revision, max_model_len, tp = "sim-model", "sim", 16384, 1
    gpu_arch, accelerator = "sim", "simulated"
    config_sha, shard_sha = None, None
    if args.fleet:
        if not args.engine_id:
            raise UsageError("--fleet needs --engine-id")
        fleet = load_fleet(args.fleet).contract
        try:
            spec = fleet.engine_by_id(args.engine_id)
        except KeyError as exc:
            raise UsageError(f"{args.fleet}: no engine {args.engine_id!r}") from exc
        url = urlsplit(spec.url)
        host, port = url.hostname or host, url.port
        nixl_host, nixl_port = spec.nixl.host, spec.nixl.port
        model, revision, max_model_len = (
            fleet.model.id,
            fleet.model.revision,
            fleet.model.max_model_len,
        )
        tp, gpu_arch, accelerator = fleet.engine.tp, fleet.engine.gpu_arch, fleet.engine.accelerator
        config_sha, shard_sha = fleet.model.config_sha256, fleet.model.shard_manifest_sha256
        sim = spec.sim or sim
    values = sim.model_dump()
    for name in _SIM_FIELDS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    sim = SimulatedEngineSettings.model_validate(values)
    host = args.host or host
    port = args.port or port
    nixl_host = args.nixl_host or nixl_host
    nixl_port = args.nixl_port or nixl_port
    if port is None:
        raise UsageError("--port is required without --fleet")
    if nixl_port is None:
        raise UsageError("--nixl-port is required without --fleet")
    # The slowdown goes to the fault settings (changeable at run time), not the step timing.
    timing = replace(sim_models(sim), slowdown=1.0)
    engine = EngineConfig(
        engine_id=engine_id,
        served_model_name=args.model or model,
        max_model_len=args.max_model_len or max_model_len,
        block_size=sim.block_size,
        num_blocks=sim.num_blocks,
        block_bytes=sim.block_bytes,
        max_num_seqs=sim.max_num_seqs,
        max_num_batched_tokens=sim.max_num_batched_tokens,
        model_seed=sim.model_seed,
        eos_prob=sim.eos_prob,
        kv_lease_s=sim.kv_lease_s,
        kv_read_timeout_s=sim.kv_read_timeout_s,
        tp_size=args.tp or tp,
        nixl_host=nixl_host,
        nixl_port=nixl_port,
        timing=timing,
    )
    faults = FaultSettings(
        fail_next=args.fault_fail_next,
        crash_on_prefill=args.fault_crash_on_prefill,
        crash_on_kv_read=args.fault_crash_on_kv_read,
        crash_after_tokens=args.fault_crash_after_tokens,
        hang_kv_read_s=args.fault_hang_kv_read_s,
        stall_first_token_s=args.fault_stall_first_token_s,
        slowdown=sim.slowdown,
        drop_stream_after_tokens=args.fault_drop_stream_after_tokens,
        metrics=args.fault_metrics,
    )
    settings = SimEngineSettings(
        engine=engine,
        model_revision=args.model_revision or revision,
        vocab_seed=sim.vocab_seed,
        config_sha256=args.config_sha256 or config_sha,
        shard_manifest_sha256=args.shard_manifest_sha256 or shard_sha,
        gpu_arch=args.gpu_arch or gpu_arch,
        accelerator=args.accelerator or accelerator,
        admin_token=args.admin_token,
        faults=faults,
    )
    return settings, host, port


def _run_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from narwhal.simengine.server import build_app

    settings, host, port = _resolve_engine(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    config = uvicorn.Config(
        build_app(settings),
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()
    return 0


def _run_fleet(args: argparse.Namespace) -> int:
    from narwhal.simengine.fleet import SimFleet, SimFleetError

    ids = [e.strip() for e in args.engines.split(",")] if args.engines else None
    fleet = SimFleet(args.fleet, admin_token=args.admin_token, log_dir=args.log_dir, engine_ids=ids)
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
            time.sleep(0.2)
    except SimFleetError as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    print("fleet stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _engine_parser(sub)
    _fleet_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "engine":
            return _run_engine(args)
        return _run_fleet(args)
    except (ContractError, UsageError) as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # pydantic errors from overrides
        print(f"narwhal-sim: invalid engine settings: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
