"""The simulated engine's command line: ``narwhal-sim engine`` runs one simulated vLLM engine.

narwhal-sim engine --fleet configs/fleet/local-sim.json --engine-id e0
narwhal-sim engine --port 8100 --nixl-port 8200 --model m --time-scale 10

``narwhal-sim`` itself (``narwhal.testing.sim_cli``) adds ``fleet``, the local fleet launcher;
``python -m narwhal.simengine.cli engine ...`` runs an engine without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from dataclasses import replace
from typing import Any, NoReturn
from urllib.parse import urlsplit

from pydantic import ValidationError

from narwhal.asgi import tcp_bind_problem
from narwhal.contract import ContractError, SimulatedEngineSettings, load_fleet
from narwhal.contract.flags import number_type
from narwhal.contract.loader import validation_reasons
from narwhal.simengine.engine import EngineConfig
from narwhal.simengine.faults import FaultSettings
from narwhal.simengine.kv_events import KVEventsSettings, check_bindable
from narwhal.simengine.timing import sim_models

__all__ = ["UsageError", "add_engine_parser", "engine_flags_problem", "main", "run_engine"]

log = logging.getLogger("narwhal.simengine")

_SIM_FIELDS = tuple(SimulatedEngineSettings.model_fields)


class UsageError(Exception):
    """A command line that cannot run (exit code 2)."""


_PORT = number_type(int, 1, 65535)


def add_engine_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The ``engine`` subcommand's arguments."""
    p = sub.add_parser("engine", help="run one simulated engine")
    p.add_argument("--fleet", help="take this engine's settings from a fleet file")
    p.add_argument("--engine-id", help="engine id (with --fleet: which engine to run)")
    p.add_argument("--host", help="HTTP bind address (default: from the fleet URL, else 127.0.0.1)")
    p.add_argument("--port", type=_PORT, help="HTTP port (default: from the fleet URL)")
    p.add_argument("--nixl-host", help="NIXL side-channel host (default 127.0.0.1)")
    p.add_argument("--nixl-port", type=_PORT, help="NIXL side-channel port")
    p.add_argument("--model", help="served model name")
    p.add_argument(
        "--model-revision",
        help="model revision the attestation reports (default: the fleet's, else sim)",
    )
    p.add_argument(
        "--max-model-len",
        type=number_type(int, 1),
        help="longest prompt plus output, in tokens (default: the fleet's, else 16384)",
    )
    p.add_argument(
        "--tp", type=number_type(int, 1), help="tensor parallel size reported in kv_transfer_params"
    )
    p.add_argument(
        "--gpu-arch",
        help="GPU architecture the attestation reports (default: the fleet's, else sim)",
    )
    p.add_argument(
        "--accelerator",
        help="accelerator the attestation reports (default: the fleet's, else simulated)",
    )
    p.add_argument(
        "--config-sha256",
        help="model config SHA-256 the attestation reports (default: the fleet's, else one "
        "derived from the model name, max model length and vocabulary seed)",
    )
    p.add_argument(
        "--shard-manifest-sha256",
        help="weight shard manifest SHA-256 the attestation reports (default: the fleet's, else "
        "one derived from the model seed)",
    )
    p.add_argument(
        "--admin-token", help="enables /sim/faults and /sim/state with this bearer token"
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        help="as vLLM's: /v1 routes require 'Authorization: Bearer KEY' with one of these keys "
        "(default: the VLLM_API_KEY environment variable, if set)",
    )
    for name in _SIM_FIELDS:
        if name == "extra_args":
            continue
        kind = SimulatedEngineSettings.model_fields[name].annotation
        flag = f"--{name.replace('_', '-')}"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, dest=name)
        else:
            p.add_argument(flag, type=int if kind is int else float, dest=name)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="prefix caching, as vLLM's flag (default: the fleet's "
        "engine.prefix_caching.enabled, else on)",
    )
    p.add_argument(
        "--kv-events-config",
        help="vLLM's KV event publisher settings (JSON), e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (default: the fleet engine\'s kv_events)',
    )
    faults = p.add_argument_group("fault injection (also settable at run time via /sim/faults)")
    faults.add_argument(
        "--fault-fail-next", type=int, default=0, help="answer the next N requests 503"
    )
    faults.add_argument(
        "--fault-crash-on-prefill",
        action="store_true",
        help="exit as a crash (code 137) when the next prompt starts computing",
    )
    faults.add_argument(
        "--fault-crash-on-kv-read",
        action="store_true",
        help="exit as a crash (code 137) when a decode leg is about to pull remote KV",
    )
    faults.add_argument(
        "--fault-crash-after-tokens",
        type=int,
        help="exit as a crash (code 137) once a stream has sent N tokens",
    )
    faults.add_argument(
        "--fault-hang-kv-read-s",
        type=float,
        default=0.0,
        help="seconds each KV read of a decode leg stalls, bounded by the KV read timeout "
        "(default %(default)s)",
    )
    faults.add_argument(
        "--fault-stall-first-token-s",
        type=float,
        default=0.0,
        help="seconds the first token of each request is held back (default %(default)s)",
    )
    faults.add_argument(
        "--fault-drop-stream-after-tokens",
        type=int,
        help="streams drop their connection, with no terminating chunk, after N tokens",
    )
    faults.add_argument(
        "--fault-error-after-tokens",
        type=int,
        help="fail generation after N tokens: an error event (a 500 when not streamed)",
    )
    faults.add_argument(
        "--fault-metrics",
        choices=["ok", "lie", "stop", "hang"],
        default="ok",
        help="/metrics: lie reports an idle engine, stop answers 503, hang never answers "
        "(default %(default)s)",
    )
    p.add_argument("--log-level", default="warning", help="logging level (default %(default)s)")


class _FlagsRefused(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors are exceptions rather than a usage text and an exit (``-h``
    among the flags too: it would print the help and exit 0, read as a pass)."""

    def error(self, message: str) -> NoReturn:
        raise _FlagsRefused(message)

    def print_help(self, file: Any = None) -> None:
        pass

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise _FlagsRefused(message or "-h/--help is not an engine setting")


def engine_flags_problem(argv: list[str]) -> str | None:
    """Why ``narwhal-sim engine`` would refuse these flags (those after ``engine``), or None:
    what a launch plan's check asks before anything starts. Nothing is bound or read beyond
    what the flags name."""
    parser = _RaisingParser(prog="narwhal-sim")
    add_engine_parser(parser.add_subparsers(dest="command", required=True))
    try:
        _resolve_engine(parser.parse_args(["engine", *argv]))
    except (_FlagsRefused, UsageError, ContractError) as exc:
        return str(exc)
    except ValueError as exc:  # ValidationError too
        return _invalid_settings(exc)
    return None


def _resolve_engine(args: argparse.Namespace) -> tuple[Any, str, int]:
    from narwhal.simengine.server import SimEngineSettings

    sim = SimulatedEngineSettings()
    engine_id = args.engine_id or "sim0"
    host, port = "127.0.0.1", None
    nixl_host, nixl_port = "127.0.0.1", None
    model, revision, max_model_len, tp = "sim-model", "sim", 16384, 1
    gpu_arch, accelerator = "sim", "simulated"
    config_sha, shard_sha = None, None
    prefix_caching = True
    kv_events: KVEventsSettings | None = None
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
        prefix_caching = fleet.engine.prefix_caching.enabled
        if spec.kv_events is not None:
            kv_events = KVEventsSettings(
                endpoint=spec.kv_events.endpoint,
                replay_endpoint=spec.kv_events.replay_endpoint,
                topic=spec.kv_events.topic,
            )
    if args.enable_prefix_caching is not None:
        prefix_caching = args.enable_prefix_caching
    if args.kv_events_config is not None:
        try:
            kv_events = KVEventsSettings.parse(args.kv_events_config)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
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
        enable_prefix_caching=prefix_caching,
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
        error_after_tokens=args.fault_error_after_tokens,
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
        prompt_tokens_details=sim.enable_prompt_tokens_details,
        kv_events=kv_events,
        # As vLLM: --api-key wins over VLLM_API_KEY; empty values guard nothing.
        api_keys=tuple(k for k in (args.api_key or [os.environ.get("VLLM_API_KEY", "")]) if k),
    )
    return settings, host, port


def _run_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from narwhal.simengine.server import DroppedStreamLogFilter, build_app

    settings, host, port = _resolve_engine(args)
    nixl_host = settings.engine.nixl_host
    for flag, (bind_host, bind_port) in (
        ("--port", (host, port)),
        ("--nixl-port", (nixl_host, settings.engine.nixl_port)),
    ):
        if (problem := tcp_bind_problem(bind_host, bind_port)) is not None:
            raise UsageError(f"{flag}: {problem}")
    if settings.engine.nixl_port == port and _overlap(host, nixl_host, port):
        raise UsageError(f"--nixl-port: {port} is the engine's HTTP port too, on {nixl_host}")
    if settings.kv_events is not None:
        try:
            check_bindable(settings.kv_events)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
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
    # After the config: it sets up uvicorn's loggers.
    logging.getLogger("uvicorn.error").addFilter(DroppedStreamLogFilter())
    uvicorn.Server(config).run()
    return 0


def _overlap(a: str, b: str, port: int) -> bool:
    """Whether servers on hosts ``a`` and ``b`` (both resolvable) would take the same address
    on ``port``: an address both resolve to, or a family's wildcard beside any of its own."""

    def addresses(host: str) -> set[tuple[int, str]]:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        return {(int(family), str(address[0])) for family, _, _, _, address in infos}

    wildcard: dict[int, str] = {socket.AF_INET: "0.0.0.0", socket.AF_INET6: "::"}
    mine, theirs = addresses(a), addresses(b)
    for family, address in mine:
        for other_family, other in theirs:
            if family != other_family:
                continue
            if address == other or wildcard.get(family) in (address, other):
                return True
    return False


def run_engine(args: argparse.Namespace) -> int:
    """Run the ``engine`` subcommand; bad settings are a one-line message and exit code 2."""
    try:
        return _run_engine(args)
    except (ContractError, UsageError) as exc:
        print(f"narwhal-sim: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # ValidationError too
        print(f"narwhal-sim: {_invalid_settings(exc)}", file=sys.stderr)
        return 2


def _invalid_settings(exc: ValueError) -> str:
    if not isinstance(exc, ValidationError):
        return f"invalid engine settings: {str(exc).splitlines()[0]}"
    # Flags checked by SimulatedEngineSettings, FaultSettings. A field is its flag:
    # --time-scale for time_scale, --fault-fail-next for fail_next.
    prefix = "--fault-" if exc.title == FaultSettings.__name__ else "--"
    problems = "; ".join(
        f"{prefix}{'.'.join(str(part) for part in loc).replace('_', '-')}: {reason}"
        if loc
        else reason
        for loc, reason in validation_reasons(exc)
    )
    return f"invalid engine settings: {problems}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal-sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_engine_parser(sub)
    return run_engine(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
