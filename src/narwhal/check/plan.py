"""The benchmark plan: ordered load points a measurement run will execute against a fleet.

``narwhal-check --plan`` predicts each point's attainment before any load is offered; the
measurement tools execute the same file. One pydantic model per file format, strict like the
fleet contract (a typo in a plan must fail loudly, not silently drop a point).

    {"schema": "narwhal.benchmark-plan/v1",
     "fleet": {"path": "fleet-qualified.json", "sha256": "<64 hex>"},
     "client_revision": "31b0b78e...",
     "workload": {"input_tokens": 8192, "output_tokens": 128},
     "points": [{"name": "0.5rps", "rate": 0.5, "requests": 200, "ttft_s": 10.0,
                 "tpot_s": 0.3, "attainment": 0.95, "timeout_s": 180.0}, ...],
     "seed": 1729, "workload_dir": "workload"}          (both optional)

The measurement tools (``tools/measurement/benchmark_plan.py``) read the same format.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["PLAN_SCHEMA", "BenchmarkPlan", "PlanFleetRef", "PlanPoint", "PlanWorkload"]

PLAN_SCHEMA = "narwhal.benchmark-plan/v1"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        allow_inf_nan=False,
        populate_by_name=True,
        serialize_by_alias=True,
    )


class PlanFleetRef(_Model):
    path: str = Field(min_length=1)
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _sha256(cls, value: str) -> str:
        if not _SHA256_RE.fullmatch(value):
            raise ValueError(f"must be 64 lowercase hex digits (got {value!r})")
        return value


class PlanWorkload(_Model):
    input_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)


class PlanPoint(_Model):
    # Names become directory names and request-id prefixes in the measurement tools.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    rate: float = Field(gt=0)  # offered requests per second (Poisson arrivals)
    requests: int = Field(gt=0)
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    attainment: float = Field(gt=0, le=1)
    timeout_s: float = Field(gt=0)


class BenchmarkPlan(_Model):
    schema_version: Literal["narwhal.benchmark-plan/v1"] = Field(alias="schema")
    fleet: PlanFleetRef
    client_revision: str = Field(min_length=1)
    workload: PlanWorkload
    points: list[PlanPoint] = Field(min_length=1)
    # Optional: the workload seed (also seeds the slo gate's simulated arrivals) and a prepared
    # workload directory for the measurement tools to reuse.
    seed: int | None = None
    workload_dir: str | None = None
    # "off" (the reference run's condition): a point counts only when every engine shows prefix
    # caching off (its vllm:cache_config_info, and no prefix-cache hit in the window); "any":
    # not checked (a plan that measures caching on purpose).
    prefix_caching: Literal["off", "any"] = "off"

    @model_validator(mode="after")
    def _unique_names(self) -> BenchmarkPlan:
        seen: set[str] = set()
        for point in self.points:
            if point.name in seen:
                raise ValueError(f"point name {point.name!r} is used twice")
            seen.add(point.name)
        return self
