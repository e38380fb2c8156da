"""Launch plans: the pydantic models of ``configs/launch/*.yaml`` and their loader.

A plan declares how one group of engines is started: image (by digest), model, TP, the GPU
architectures the recipe was validated on, environment (with the kernel-selection flags it
requires), engine arguments and the engines it produces. Loading checks shape only (types,
strictly as the fleet loader does, and unknown keys); the rules that relate fields to each
other and to a fleet live in ``_plan_check`` so that ``check`` can report every problem at once
instead of the first.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from narwhal.contract.loader import validation_reasons
from narwhal.contract.yamlfile import load_yaml
from tools.deployment._yamlerror import yaml_error_line

__all__ = [
    "PLAN_SCHEMA",
    "ArgValue",
    "ContainerSettings",
    "EnginePlan",
    "LaunchPlan",
    "LoadedPlan",
    "ModelRef",
    "PlanError",
    "SideChannel",
    "SimulatedSettings",
    "load_plan",
]

PLAN_SCHEMA = "narwhal.launch/v1"
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class PlanError(Exception):
    """A plan file that cannot be used. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = [_CONTROL_CHARS.sub(" ", p) for p in problems]
        super().__init__(self.problems[0] if self.problems else "invalid plan")


def _env_value(value: Any) -> Any:
    # YAML reads `AITER_SITUV2_A8W4: 1` as an int; the environment only has strings. A YAML
    # boolean is refused: `on`/`yes` become True in YAML 1.1, and "True" is not what a flag
    # reading "1" expects.
    if isinstance(value, bool):
        raise ValueError("environment values must be strings or numbers, not booleans")
    if isinstance(value, int | float):
        return str(value)
    return value


EnvValue = Annotated[str, BeforeValidator(_env_value)]


def _arg_value(value: Any) -> Any:
    # Checked by hand rather than as a pydantic union: a union reports one complaint per
    # member, and a plan author needs one line saying what a flag value may be.
    scalar = (bool, int, float, str)
    if isinstance(value, (*scalar, dict)):
        return value
    if isinstance(value, list) and all(
        isinstance(v, scalar) and not isinstance(v, bool) for v in value
    ):
        return value
    raise ValueError("a flag value must be a string, a number, true, a mapping or a list")


# A flag's value: true renders the bare flag, a mapping renders compact JSON, a list repeats
# the flag once per item; anything else is its string form.
ArgValue = Annotated[Any, BeforeValidator(_arg_value)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Model):
    id: str = Field(min_length=1)
    # A commit for production plans: a branch name moves the way an image tag does.
    revision: str = Field(min_length=1)
    # Checkpoint directory on the engine host; mounted read-only into the container, hashed
    # by the attestation sidecar.
    checkpoint: str | None = None
    max_model_len: int = Field(gt=0)


class SideChannel(_Model):
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class EnginePlan(_Model):
    id: str = Field(min_length=1)
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    side_channel: SideChannel
    attestation_port: int | None = Field(default=None, ge=1, le=65535)
    gpus: list[int] | None = None
    # Per-engine additions; they may not change a required flag (see _plan_check).
    env: dict[str, EnvValue] = Field(default_factory=dict)
    args: dict[str, ArgValue] = Field(default_factory=dict)


class ContainerSettings(_Model):
    runtime: Literal["docker", "podman"] = "docker"
    name_prefix: str = "narwhal-"
    # Where the checkpoint appears inside the container.
    model_mount: str = "/models/checkpoint"
    options: list[str] = Field(default_factory=list)
    entrypoint: list[str] = Field(default_factory=lambda: ["vllm", "serve"])


class SimulatedSettings(_Model):
    gpu_arch: str = "sim"
    accelerator: str = "simulated"
    args: dict[str, ArgValue] = Field(default_factory=dict)


class LaunchPlan(_Model):
    schema_version: Literal["narwhal.launch/v1"] = Field(alias="schema")
    name: str = Field(min_length=1)
    kind: Literal["container", "simulated"]
    image: str | None = None
    model: ModelRef
    tp: int = Field(ge=1)
    validated_gpu_archs: list[str] = Field(min_length=1)
    required_env: dict[str, EnvValue] = Field(default_factory=dict)
    env: dict[str, EnvValue] = Field(default_factory=dict)
    vllm_args: dict[str, ArgValue] = Field(default_factory=dict)
    container: ContainerSettings | None = None
    simulated: SimulatedSettings | None = None
    engines: list[EnginePlan] = Field(min_length=1)

    def engine(self, engine_id: str) -> EnginePlan:
        for eng in self.engines:
            if eng.id == engine_id:
                return eng
        raise KeyError(engine_id)

    def engine_env(self, eng: EnginePlan) -> dict[str, str]:
        """The plan's environment with the engine's additions (no side-channel variables)."""
        return {**self.env, **eng.env}


class LoadedPlan:
    """A parsed plan with the file it came from and the SHA-256 of its bytes."""

    def __init__(self, plan: LaunchPlan, path: Path, sha256: str) -> None:
        self.plan = plan
        self.path = path
        self.sha256 = sha256


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def load_plan(path: str | Path) -> LoadedPlan:
    """Read and validate a plan's shape; PlanError lists every problem, one line each."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PlanError([f"{source}: cannot read: {exc.strerror or exc}"]) from None
    try:
        raw = load_yaml(data)
    except yaml.YAMLError as exc:
        raise PlanError([f"{source}: {yaml_error_line(exc)}"]) from None
    if not isinstance(raw, dict):
        raise PlanError([f"{source}: top level must be a mapping"])
    try:
        # Strict, as the fleet loader reads a fleet: `tp: true` is no TP of 1 and `port:
        # "8000"` no port, and the line says which type the field takes.
        plan = LaunchPlan.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise PlanError(
            [f"{source}: {_loc(loc)}: {reason}" for loc, reason in validation_reasons(exc)]
        ) from None
    return LoadedPlan(plan, Path(path), hashlib.sha256(data).hexdigest())
