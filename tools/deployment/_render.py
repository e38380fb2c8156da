"""The exact command each engine of a plan runs, and its attestation sidecar's command.

Rendering is pure: a plan in, argv lists out. ``render`` prints them, ``start`` runs the
simulated ones, and an operator pastes the container ones on each host: one definition of
the command, so what was checked is what runs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from tools.deployment._plan import ContainerSettings, EnginePlan, LaunchPlan, SimulatedSettings
from tools.deployment._plan_check import kv_transfer_config

__all__ = ["EngineCommand", "flag_args", "render_engine", "render_sidecar", "shell_line"]


@dataclass(frozen=True)
class EngineCommand:
    engine_id: str
    host: str
    argv: list[str]
    # Environment the process needs beyond the caller's: empty for containers (their
    # environment is in the argv as -e flags), the plan's env for simulated engines.
    env: dict[str, str] = field(default_factory=dict)


def flag_args(args: dict[str, Any]) -> list[str]:
    """A flag mapping as argv, in the mapping's order (the plan's order)."""
    out: list[str] = []
    for flag, value in args.items():
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, dict):
            # vLLM parses JSON-valued flags; compact separators keep the rendered line short.
            out += [flag, json.dumps(value, separators=(",", ":"), sort_keys=False)]
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def render_engine(
    plan: LaunchPlan, eng: EnginePlan, sim_program: str = "narwhal-sim"
) -> EngineCommand:
    if plan.kind == "container":
        return EngineCommand(eng.id, eng.host, _container_argv(plan, eng))
    sim = plan.simulated or SimulatedSettings()
    argv = [
        sim_program,
        "engine",
        "--engine-id",
        eng.id,
        "--host",
        eng.host,
        "--port",
        str(eng.port),
        "--nixl-host",
        eng.side_channel.host,
        "--nixl-port",
        str(eng.side_channel.port),
        "--model",
        plan.model.id,
        "--model-revision",
        plan.model.revision,
        "--max-model-len",
        str(plan.model.max_model_len),
        "--tp",
        str(plan.tp),
        "--gpu-arch",
        sim.gpu_arch,
        "--accelerator",
        sim.accelerator,
        *flag_args({**sim.args, **eng.args}),
    ]
    return EngineCommand(eng.id, eng.host, argv, plan.engine_env(eng))


def _container_argv(plan: LaunchPlan, eng: EnginePlan) -> list[str]:
    c = plan.container or ContainerSettings()
    assert plan.image is not None and plan.model.checkpoint is not None  # checked first
    env = {
        **plan.engine_env(eng),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": eng.side_channel.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(eng.side_channel.port),
    }
    if eng.gpus is not None:
        env["HIP_VISIBLE_DEVICES"] = ",".join(str(g) for g in eng.gpus)
    argv = [c.runtime, "run", "--detach", "--name", f"{c.name_prefix}{eng.id}", *c.options]
    argv += ["--volume", f"{plan.model.checkpoint}:{c.model_mount}:ro"]
    for name, value in env.items():
        argv += ["--env", f"{name}={value}"]
    argv += [plan.image, *c.entrypoint, c.model_mount]
    argv += [
        "--served-model-name",
        plan.model.id,
        "--host",
        eng.host,
        "--port",
        str(eng.port),
        "--tensor-parallel-size",
        str(plan.tp),
        "--max-model-len",
        str(plan.model.max_model_len),
    ]
    argv += flag_args({**plan.vllm_args, **eng.args})
    return argv


def render_sidecar(
    plan: LaunchPlan,
    eng: EnginePlan,
    *,
    script: str = "tools/deployment/attestation_sidecar.py",
    python: str = "python3",
    checkpoint: str | None = None,
    engine_pidfile: str | None = None,
    cache: str | None = None,
) -> list[str] | None:
    """The sidecar command for one engine, or None if the plan gives it no port."""
    if eng.attestation_port is None:
        return None
    kv = kv_transfer_config(plan) or {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    argv = [
        python,
        script,
        "--engine-id",
        eng.id,
        "--host",
        eng.host,
        "--port",
        str(eng.attestation_port),
        "--checkpoint",
        checkpoint or plan.model.checkpoint or "CHECKPOINT_DIR",
        "--model-id",
        plan.model.id,
        "--model-revision",
        plan.model.revision,
        "--tp",
        str(plan.tp),
        "--kv-connector",
        str(kv.get("kv_connector")),
        "--kv-role",
        str(kv.get("kv_role")),
        "--nixl-host",
        eng.side_channel.host,
        "--nixl-port",
        str(eng.side_channel.port),
    ]
    if plan.image is not None and "@" in plan.image:
        argv += ["--image-digest", plan.image.rsplit("@", 1)[1]]
    if plan.kind == "container":
        # The digest the running container reports, not only the one the plan declares.
        c = plan.container or ContainerSettings()
        argv += ["--container", f"{c.name_prefix}{eng.id}", "--container-runtime", c.runtime]
    if plan.kind == "simulated":
        # No rocminfo where simulated engines run: the architecture is declared, and so is
        # the accelerator the engines attest (the sidecar's must say the same).
        sim = plan.simulated or SimulatedSettings()
        argv += ["--gpu-arch", sim.gpu_arch, "--accelerator", sim.accelerator]
    if engine_pidfile:
        argv += ["--engine-pidfile", engine_pidfile]
    if cache:
        argv += ["--cache", cache]
    return argv


def shell_line(cmd: EngineCommand | list[str]) -> str:
    """One pasteable shell line; a simulated engine's environment goes first via env(1)."""
    if isinstance(cmd, list):
        return shlex.join(cmd)
    prefix = ["env", *(f"{k}={v}" for k, v in cmd.env.items())] if cmd.env else []
    return shlex.join(prefix + cmd.argv)
