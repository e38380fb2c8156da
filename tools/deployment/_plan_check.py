"""The rules a launch plan must follow, alone and against a fleet contract.

Every rule reports ``<plan file>: <place>: <reason>`` as one line and checking goes on, so an
operator fixes a plan in one pass. The rules come from how recipes fail in practice (MAD's
Kimi-K3 write-up): image tags moved under a single build session, a dropped kernel-selection
flag silently selected a slow MoE path, and a recipe validated on gfx950 must not run on
another architecture.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit

from narwhal.contract import LoadedFleet
from tools.deployment._plan import EnginePlan, LaunchPlan, LoadedPlan, SimulatedSettings

__all__ = [
    "SIDE_CHANNEL_ENV",
    "engine_ports",
    "kv_transfer_config",
    "plan_problems",
    "plans_problems",
]

_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
SIDE_CHANNEL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")

# Flags rendered from structured plan fields: setting them by hand as well would let the two
# disagree, and the one that wins would depend on vLLM's argument parser.
_RESERVED_VLLM = {
    "--host": "engines[].host",
    "--port": "engines[].port",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--served-model-name": "model.id",
    "--model": "model.id",
    "--revision": "model.revision",
    "--max-model-len": "model.max_model_len",
}
_RESERVED_SIM = {
    "--engine-id": "engines[].id",
    "--fleet": "the plan itself",
    "--host": "engines[].host",
    "--port": "engines[].port",
    "--nixl-host": "engines[].side_channel.host",
    "--nixl-port": "engines[].side_channel.port",
    "--model": "model.id",
    "--model-revision": "model.revision",
    "--max-model-len": "model.max_model_len",
    "--tp": "tp",
    "--gpu-arch": "simulated.gpu_arch",
    "--accelerator": "simulated.accelerator",
    "--config-sha256": "the attestation sidecar",
    "--shard-manifest-sha256": "the attestation sidecar",
}
KV_TRANSFER_FLAG = "--kv-transfer-config"
KV_EVENTS_FLAG = "--kv-events-config"
# vLLM's KVEventsConfig defaults for what a plan leaves out.
_VLLM_KV_EVENTS_DEFAULTS = {"endpoint": "tcp://*:5557"}


def _mapping_flag(value: Any) -> dict[str, Any] | None:
    """A vLLM flag whose value is a mapping, given as one or as a JSON string: the mapping, or
    None when absent or not JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def kv_transfer_config(plan: LaunchPlan) -> dict[str, Any] | None:
    """The plan's ``--kv-transfer-config`` as a mapping (None if absent or not JSON)."""
    return _mapping_flag(plan.vllm_args.get(KV_TRANSFER_FLAG))


def plans_problems(plans: list[LoadedPlan], fleet: LoadedFleet | None) -> list[str]:
    """Every problem of each plan, then the ones between plans (ports, engines twice)."""
    problems: list[str] = []
    for lp in plans:
        problems += plan_problems(lp, fleet)
    seen_engines: dict[str, str] = {}
    for lp in plans:
        for i, eng in enumerate(lp.plan.engines):
            if eng.id in seen_engines and seen_engines[eng.id] != str(lp.path):
                problems.append(
                    f"{lp.path}: engines[{i}]: engine {eng.id!r} is also launched by "
                    f"{seen_engines[eng.id]}"
                )
            seen_engines.setdefault(eng.id, str(lp.path))
    if len(plans) > 1:
        problems += _port_problems(
            [(lp, i, e) for lp in plans for i, e in enumerate(lp.plan.engines)]
        )
    return problems


def plan_problems(lp: LoadedPlan, fleet: LoadedFleet | None) -> list[str]:
    """Every rule ``lp`` breaks; with a fleet, also every disagreement with it."""
    plan, src = lp.plan, str(lp.path)
    out: list[str] = []

    def add(where: str, reason: str) -> None:
        out.append(f"{src}: {where}: {reason}")

    _kind_rules(plan, add)
    _env_rules(plan, add)
    _arg_rules(plan, add)
    seen: set[str] = set()
    for i, eng in enumerate(plan.engines):
        if eng.id in seen:
            add(f"engines[{i}].id", f"duplicate engine id {eng.id!r}")
        seen.add(eng.id)
        if eng.gpus is not None:
            if len(eng.gpus) != plan.tp:
                add(f"engines[{i}].gpus", f"{len(eng.gpus)} GPUs for TP {plan.tp}")
            if len(set(eng.gpus)) != len(eng.gpus):
                add(f"engines[{i}].gpus", "a GPU is listed twice")
    _gpu_sharing(plan, add)
    _simulated_flags(plan, add)
    out += _port_problems([(lp, i, e) for i, e in enumerate(plan.engines)])
    if fleet is not None:
        _fleet_rules(plan, fleet, add)
    return out


def _kind_rules(plan: LaunchPlan, add: Any) -> None:
    if plan.kind == "container":
        if plan.image is None:
            add("image", "a container plan needs an image pinned by digest (NAME@sha256:...)")
        elif "@" not in plan.image:
            add(
                "image",
                f"{plan.image!r} is a tag without a digest; pin it as NAME@sha256:<64 hex digits>"
                " (tags move: the same tag served two digests within one build session)",
            )
        elif not _DIGEST_RE.search(plan.image):
            add("image", f"{plan.image!r}: the digest must be sha256: and 64 lowercase hex digits")
        if not _COMMIT_RE.fullmatch(plan.model.revision):
            add(
                "model.revision",
                f"{plan.model.revision!r} is not a 40-hex commit; pin the revision "
                "(a branch moves the way an image tag does)",
            )
        if plan.model.checkpoint is None:
            add("model.checkpoint", "a container plan mounts its checkpoint: name the directory")
        if plan.simulated is not None:
            add("simulated", "only a simulated plan has a simulated block")
    else:
        if plan.image is not None:
            add("image", "a simulated plan runs no image; remove it")
        if plan.vllm_args:
            add("vllm_args", "a simulated plan takes narwhal-sim flags under simulated.args")
        if plan.container is not None:
            add("container", "only a container plan has a container block")
        sim_arch = (plan.simulated.gpu_arch if plan.simulated else None) or "sim"
        if sim_arch not in plan.validated_gpu_archs:
            add(
                "simulated.gpu_arch",
                f"{sim_arch!r} is outside the validated set {_names(plan.validated_gpu_archs)}",
            )


def _env_rules(plan: LaunchPlan, add: Any) -> None:
    for name in SIDE_CHANNEL_ENV:
        if name in plan.env:
            add(f"env.{name}", "set per engine from engines[].side_channel; remove it here")
    for name, required in plan.required_env.items():
        if name not in plan.env:
            add(
                "env",
                f"required kernel-selection flag {name} is missing "
                f"(the plan requires {name}={required})",
            )
        elif plan.env[name] != required:
            add(f"env.{name}", f"is {plan.env[name]!r}; the plan requires {required!r}")
    for i, eng in enumerate(plan.engines):
        for name in SIDE_CHANNEL_ENV:
            if name in eng.env:
                add(f"engines[{i}].env.{name}", "set from engines[].side_channel; remove it here")
        for name, value in eng.env.items():
            required = plan.required_env.get(name)
            if required is not None and value != required:
                add(
                    f"engines[{i}].env.{name}",
                    f"changes required flag {name} to {value!r}; the plan requires {required!r}",
                )


def _arg_rules(plan: LaunchPlan, add: Any) -> None:
    reserved = _RESERVED_VLLM if plan.kind == "container" else _RESERVED_SIM
    groups: list[tuple[str, dict[str, Any]]] = [("vllm_args", plan.vllm_args)]
    if plan.simulated is not None:
        groups.append(("simulated.args", plan.simulated.args))
    groups += [(f"engines[{i}].args", e.args) for i, e in enumerate(plan.engines)]
    for where, args in groups:
        for flag, value in args.items():
            if not flag.startswith("-"):
                add(f"{where}.{flag}", "flags start with '-'")
            elif flag in reserved:
                add(f"{where}.{flag}", f"rendered from {reserved[flag]}; remove it here")
            elif value is False:
                add(f"{where}.{flag}", "false renders nothing; remove the flag instead")
            if flag == KV_TRANSFER_FLAG and where.startswith("engines"):
                add(f"{where}.{flag}", "the KV transfer config is plan-wide (vllm_args)")
    if plan.kind == "container":
        kv = kv_transfer_config(plan)
        if KV_TRANSFER_FLAG not in plan.vllm_args:
            add(
                "vllm_args",
                f"{KV_TRANSFER_FLAG} is missing (NixlConnector with kv_role kv_both is what "
                "lets every engine prefill, decode or both)",
            )
        elif kv is None:
            add(f"vllm_args.{KV_TRANSFER_FLAG}", "must be a mapping or a JSON object")
        else:
            if kv.get("kv_connector") != "NixlConnector":
                add(
                    f"vllm_args.{KV_TRANSFER_FLAG}.kv_connector",
                    f"{kv.get('kv_connector')!r}; Narwhal moves KV with NixlConnector",
                )
            if kv.get("kv_role") != "kv_both":
                add(
                    f"vllm_args.{KV_TRANSFER_FLAG}.kv_role",
                    f"{kv.get('kv_role')!r}; the role controller needs kv_both",
                )


def _simulated_flags(plan: LaunchPlan, add: Any) -> None:
    """A simulated engine's rendered command line, parsed and resolved as narwhal-sim would:
    an unknown flag or a value it refuses (``--time-scale: nan``) fails the check, not every
    engine's start."""
    if plan.kind != "simulated":
        return
    from narwhal.simengine.cli import engine_flags_problem
    from tools.deployment._render import render_engine  # which imports this module

    for i, eng in enumerate(plan.engines):
        problem = engine_flags_problem(render_engine(plan, eng).argv[2:])
        if problem is not None:
            add(f"engines[{i}] ({eng.id})", f"narwhal-sim engine refuses its flags: {problem}")


def _gpu_sharing(plan: LaunchPlan, add: Any) -> None:
    owner: dict[tuple[str, int], str] = {}
    for i, eng in enumerate(plan.engines):
        for gpu in eng.gpus or []:
            key = (eng.host, gpu)
            if key in owner and owner[key] != eng.id:
                add(f"engines[{i}].gpus", f"GPU {gpu} on {eng.host} is also given to {owner[key]}")
            owner.setdefault(key, eng.id)


def engine_ports(plan: LaunchPlan, eng: EnginePlan) -> list[tuple[str, str, int]]:
    # (what, address, port). vLLM's NIXL handshake listens on the base side-channel port per
    # data-parallel rank; these plans run DP 1, so one port.
    ports = [
        ("port", eng.host, eng.port),
        ("side_channel.port", eng.side_channel.host, eng.side_channel.port),
    ]
    if eng.attestation_port is not None:
        ports.append(("attestation_port", eng.host, eng.attestation_port))
    if plan.kind == "container":
        # KV event sockets vLLM binds (on every address: the engine's host is what they take).
        cfg = _mapping_flag({**plan.vllm_args, **eng.args}.get(KV_EVENTS_FLAG))
        if cfg is not None and _publishes(cfg):
            for key in ("endpoint", "replay_endpoint"):
                address = _port_of(cfg.get(key, _VLLM_KV_EVENTS_DEFAULTS.get(key)))
                if address is not None and (key == "replay_endpoint" or _binds(address[0])):
                    ports.append((f"{KV_EVENTS_FLAG}.{key}", eng.host, address[1]))
    return ports


def _port_problems(engines: list[tuple[LoadedPlan, int, EnginePlan]]) -> list[str]:
    out: list[str] = []
    taken: dict[tuple[str, int], str] = {}
    for lp, i, eng in engines:
        for what, address, port in engine_ports(lp.plan, eng):
            key = (address, port)
            here = f"engines[{i}].{what}"
            if key in taken:
                out.append(
                    f"{lp.path}: {here}: port {port} on {address} collides with {taken[key]}"
                )
            else:
                taken[key] = f"{here} ({eng.id})"
    return out


def _fleet_rules(plan: LaunchPlan, loaded: LoadedFleet, add: Any) -> None:
    fleet = loaded.contract
    fsrc = str(loaded.path)
    if plan.tp != fleet.engine.tp:
        add("tp", f"{plan.tp} differs from the fleet's engine.tp ({fleet.engine.tp}) in {fsrc}")
    if fleet.engine.gpu_arch not in plan.validated_gpu_archs:
        add(
            "validated_gpu_archs",
            f"the fleet's GPU architecture {fleet.engine.gpu_arch!r} is outside the validated "
            f"set {_names(plan.validated_gpu_archs)}; this recipe was not validated there",
        )
    if plan.model.id != fleet.model.id:
        add("model.id", f"{plan.model.id!r} differs from the fleet's {fleet.model.id!r}")
    if plan.model.revision != fleet.model.revision:
        add(
            "model.revision",
            f"{plan.model.revision!r} differs from the fleet's {fleet.model.revision!r}",
        )
    if plan.model.max_model_len != fleet.model.max_model_len:
        add(
            "model.max_model_len",
            f"{plan.model.max_model_len} differs from the fleet's {fleet.model.max_model_len}",
        )
    kv = kv_transfer_config(plan) if plan.kind == "container" else None
    if kv is not None:
        for key in ("kv_connector", "kv_role", "kv_buffer_device"):
            if kv.get(key) not in (None, getattr(fleet.engine, key)):
                add(
                    f"vllm_args.{KV_TRANSFER_FLAG}.{key}",
                    f"{kv.get(key)!r} differs from the fleet's {getattr(fleet.engine, key)!r}",
                )
    caching = fleet.engine.prefix_caching.enabled
    sim = plan.simulated or SimulatedSettings()
    shared = plan.vllm_args if plan.kind == "container" else sim.args
    for i, eng in enumerate(plan.engines):
        runs = _prefix_caching(shared, eng.args)
        if runs != caching:
            add(
                f"engines[{i}]",
                f"{eng.id} runs with prefix caching {'on' if runs else 'off'} (vLLM's default is "
                "on; --no-enable-prefix-caching turns it off) but the fleet's "
                f"engine.prefix_caching.enabled is {str(caching).lower()}: the router's prefix "
                "index would describe caches that are not there",
            )
    known = {e.id: (k, e) for k, e in enumerate(fleet.engines)}
    for i, eng in enumerate(plan.engines):
        if eng.id not in known:
            add(
                f"engines[{i}]",
                f"engine {eng.id!r} is not in the fleet (its engines: {', '.join(known)})",
            )
            continue
        k, spec = known[eng.id]
        args = {**shared, **eng.args}
        if plan.kind == "container":
            _kv_events_rules(i, eng, args, spec.kv_events, f"engines[{k}]", add)
        size = args.get("--block-size")
        if (
            caching
            and size is not None
            and str(size) != str(fleet.engine.prefix_caching.block_size)
        ):
            add(
                f"engines[{i}]",
                f"{eng.id} runs with --block-size {size} but the fleet's "
                f"engine.prefix_caching.block_size is {fleet.engine.prefix_caching.block_size}: "
                "the router's prefix index keys blocks of the fleet's size and would match none "
                "of the engine's",
            )
        url = urlsplit(spec.url)
        if (url.hostname, url.port) != (eng.host, eng.port):
            add(
                f"engines[{i}]",
                f"{eng.id} serves http://{eng.host}:{eng.port}; the fleet says {spec.url}",
            )
        if (spec.nixl.host, spec.nixl.port) != (eng.side_channel.host, eng.side_channel.port):
            add(
                f"engines[{i}].side_channel",
                f"{eng.id} side channel {eng.side_channel.host}:{eng.side_channel.port}; "
                f"the fleet says {spec.nixl.host}:{spec.nixl.port}",
            )
        if eng.attestation_port is not None:
            if spec.attestation_url is None:
                add(
                    f"engines[{i}].attestation_port",
                    f"the fleet has no attestation_url for {eng.id}",
                )
            else:
                att = urlsplit(spec.attestation_url)
                if (att.hostname, att.port) != (eng.host, eng.attestation_port):
                    add(
                        f"engines[{i}].attestation_port",
                        f"{eng.id} sidecar at {eng.host}:{eng.attestation_port}; the fleet's "
                        f"attestation_url is {spec.attestation_url}",
                    )


def _port_of(endpoint: Any) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` ZMQ address (an IPv6 host without its
    brackets), or None."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return (host, int(port)) if host and port.isdigit() else None


def _binds(host: str) -> bool:
    """Whether vLLM's publisher binds its PUB socket on an address of this host: only a
    wildcard (``*``) or an IPv6 one (``::``); any other host it connects to
    (``ZmqEventPublisher._is_bind_endpoint``), and nobody then listens where the router
    connects."""
    return "*" in host or "::" in host


def _ipv6(host: str) -> bool:
    # vLLM turns ZMQ's IPv6 on only for tcp://*:0: any other IPv6 address fails to bind.
    return ":" in host


def _publishes(cfg: dict[str, Any] | None) -> bool:
    """Whether vLLM started with this ``--kv-events-config`` publishes over ZMQ."""
    return (
        cfg is not None
        and cfg.get("enable_kv_cache_events") is True
        and cfg.get("publisher", "zmq") == "zmq"
    )


def _kv_events_rules(
    i: int,
    eng: EnginePlan,
    args: dict[str, Any],
    fleet_events: Any,
    fleet_path: str,
    add: Any,
) -> None:
    """A vLLM engine publishes its KV events where the fleet tells the router to read them
    (``engines[].kv_events``), and publishes none the fleet leaves unread: ZMQ connects without
    complaint to an address nobody publishes on, so a mismatch shows only as a router that
    routes the engine by history (NarwhalKVEventsNotFollowed, after the fact)."""
    where = f"engines[{i}]"
    cfg = _mapping_flag(args.get(KV_EVENTS_FLAG))
    publishes = _publishes(cfg)
    if fleet_events is None:
        if publishes:
            add(
                where,
                f"{eng.id} publishes KV events ({KV_EVENTS_FLAG}) but the fleet names none for "
                f"it ({fleet_path}.kv_events): the router would not read them and would route "
                "its prefixes by history; add kv_events to the fleet or drop the flag",
            )
        return
    wanted = f"the fleet reads them at {fleet_events.endpoint} ({fleet_path}.kv_events)"
    if cfg is None and args.get(KV_EVENTS_FLAG) is not None:
        add(f"{where}: {KV_EVENTS_FLAG}", "must be a mapping or a JSON object")
        return
    if not publishes:
        add(
            where,
            f"{eng.id} publishes no KV events but {wanted}: give it {KV_EVENTS_FLAG} with "
            '"enable_kv_cache_events": true and "publisher": "zmq"',
        )
        return
    assert cfg is not None
    for key, fleet_value in (
        ("endpoint", fleet_events.endpoint),
        ("replay_endpoint", fleet_events.replay_endpoint),
    ):
        if fleet_value is None:
            continue
        fleet_host, fleet_port = _port_of(fleet_value) or ("", 0)
        value = cfg.get(key, _VLLM_KV_EVENTS_DEFAULTS.get(key))
        bound = _port_of(value)
        if bound is None:
            add(
                f"{where}: {KV_EVENTS_FLAG}.{key}",
                f"{eng.id} binds none but the fleet reads {fleet_value} "
                f"({fleet_path}.kv_events.{key})",
            )
        elif _ipv6(bound[0]):
            add(
                f"{where}: {KV_EVENTS_FLAG}.{key}",
                f"{value}: vLLM binds its KV event sockets without ZMQ's IPv6 (only tcp://*:0 "
                f"turns it on), so an IPv6 address fails to bind; use tcp://*:{fleet_port}",
            )
        elif key == "endpoint" and not _binds(bound[0]):
            # The replay socket is always bound; the PUB socket only on these.
            add(
                f"{where}: {KV_EVENTS_FLAG}.{key}",
                f"{value} makes vLLM connect its publisher to that address rather than bind it "
                "(it binds a wildcard, tcp://*:PORT): nobody listens where the router "
                f"connects; use tcp://*:{fleet_port}",
            )
        elif bound[1] != fleet_port or bound[0] not in ("*", "0.0.0.0", fleet_host, eng.host):
            add(
                f"{where}: {KV_EVENTS_FLAG}.{key}",
                f"{eng.id} binds {value} but the fleet reads {fleet_value} "
                f"({fleet_path}.kv_events.{key})",
            )
    topic = cfg.get("topic", "")
    if topic != fleet_events.topic:
        add(
            f"{where}: {KV_EVENTS_FLAG}.topic",
            f"{topic!r} differs from the fleet's {fleet_events.topic!r} "
            f"({fleet_path}.kv_events.topic)",
        )


def _prefix_caching(shared: dict[str, Any], own: dict[str, Any]) -> bool:
    """Whether an engine started with these flags caches prefixes (vLLM's default: it does)."""
    return not {**shared, **own}.get("--no-enable-prefix-caching")


def _names(values: list[str]) -> str:
    return "[" + ", ".join(values) + "]"
