"""The benchmark plan: an ordered list of load points against one qualified fleet.

Shared format (``narwhal.benchmark-plan/v1``), read by ``benchmark_runner.py`` and by the
preflight's ``narwhal-check --plan``::

    {"schema": "narwhal.benchmark-plan/v1",
     "fleet": {"path": str, "sha256": str},
     "client_revision": str,
     "workload": {"input_tokens": int, "output_tokens": int},
     "points": [{"name": str, "rate": float, "requests": int, "ttft_s": float,
                 "tpot_s": float, "attainment": float, "timeout_s": float}],
     "seed": int (optional), "workload_dir": str (optional), "prefix_caching": "off"|"any"}

The model is narwhal-check's (``narwhal.check.plan``): one definition of the format.

Relative paths (``fleet.path``, ``workload_dir``) are relative to the plan file's directory, so a
run bundle can be moved as a whole. The plan's identity is the SHA-256 of its canonical JSON
(``narwhal.contract.hashing``), like a fleet's: key order and whitespace do not change it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from narwhal.check.plan import PLAN_SCHEMA, BenchmarkPlan, PlanPoint, PlanWorkload
from narwhal.check.plan import PlanFleetRef as PlanFleet
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


class PlanError(Exception):
    """The plan file cannot be read or is not a valid plan (one line)."""


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
