"""The benchmark plan: an ordered list of load points against one qualified fleet.

Shared format (``narwhal.benchmark-plan/v1``), read by ``benchmark_runner.py`` and by the
preflight's ``narwhal-check --plan``::

    {"schema": "narwhal.benchmark-plan/v1",
     "fleet": {"path": str, "sha256": str},
     "client_revision": str,
     "workload": {"input_tokens": int, "output_tokens": int},
     "points": [{"name": str, "rate": float, "requests": int, "ttft_s": float,
                 "tpot_s": float, "attainment": float, "timeout_s": float}],
     "seed": int (optional), "workload_dir": str (optional)}

Relative paths (``fleet.path``, ``workload_dir``) are relative to the plan file's directory, so a
run bundle can be moved as a whole. The plan's identity is the SHA-256 of its canonical JSON
(``narwhal.contract.hashing``), like a fleet's: key order and whitespace do not change it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from narwhal.contract.hashing import sha256_hex

__all__ = [
    "PLAN_SCHEMA",
    "BenchmarkPlan",
    "LoadedPlan",
    "PlanError",
    "PlanFleet",
    "PlanPoint",
    "PlanWorkload",
    "load_plan",
]

PLAN_SCHEMA = "narwhal.benchmark-plan/v1"


class PlanError(Exception):
    """The plan file cannot be read or is not a valid plan (one line)."""


class _Strict(BaseModel):
    # A typo in a plan must not silently become a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanFleet(_Strict):
    path: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class PlanWorkload(_Strict):
    input_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)


class PlanPoint(_Strict):
    # Names become directory names and request-id prefixes: keep them to a safe alphabet.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    rate: float = Field(gt=0)
    requests: int = Field(gt=0)
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    attainment: float = Field(gt=0, le=1)
    timeout_s: float = Field(gt=0)


class BenchmarkPlan(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["narwhal.benchmark-plan/v1"] = Field(alias="schema")
    fleet: PlanFleet
    client_revision: str = Field(min_length=1)
    workload: PlanWorkload
    points: list[PlanPoint] = Field(min_length=1)
    # Optional: the workload seed (prepare) and a prepared workload to reuse.
    seed: int | None = None
    workload_dir: str | None = None
    # "off" (the reference run's condition): a point counts only when every engine shows prefix
    # caching off (its vllm:cache_config_info, and no prefix-cache hit in the window); "any":
    # not checked (a plan that measures caching on purpose).
    prefix_caching: Literal["off", "any"] = "off"

    @field_validator("points")
    @classmethod
    def _unique_names(cls, points: list[PlanPoint]) -> list[PlanPoint]:
        seen: set[str] = set()
        for point in points:
            if point.name in seen:
                raise ValueError(f"point name {point.name!r} is used twice")
            seen.add(point.name)
        return points


@dataclass(frozen=True)
class LoadedPlan:
    plan: BenchmarkPlan
    path: Path
    sha256: str

    def resolve(self, relative: str) -> Path:
        """A path from the plan, relative to the plan file's directory."""
        p = Path(relative)
        return p if p.is_absolute() else (self.path.parent / p)

    @property
    def fleet_path(self) -> Path:
        return self.resolve(self.plan.fleet.path)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "(document)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err.get('msg', 'invalid')}{more}"


def load_plan(path: str | Path) -> LoadedPlan:
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: a plan is a JSON object")
    if raw.get("schema") != PLAN_SCHEMA:
        raise PlanError(f"{path}: schema must be {PLAN_SCHEMA!r}, not {raw.get('schema')!r}")
    try:
        plan = BenchmarkPlan.model_validate(raw)
    except ValidationError as exc:
        raise PlanError(f"{path}: {_first_error(exc)}") from None
    return LoadedPlan(plan=plan, path=path, sha256=sha256_hex(raw))
