"""The RUN.yaml of ``narwhal-qualify``: one declarative file for a whole qualification run.

MAD-style: it names what the run is made of (the fleet, the launch plans, an optional
deployment, the profiling limits and probe sizes, the check's settings, the router's address,
the workload, the benchmark points and the budgets), never how to run it. It is checked as a
whole before anything starts, one line per problem::

    schema: narwhal.qualify/v1
    name: local-sim
    run_dir: runs/qualify-local-sim        # where every output goes (relative: to the checkout)
    fleet: configs/fleet/local-sim.json
    launch_plans: [configs/launch/local-sim.yaml]
    deployment: null                       # or {file: hosts.yaml, commit: <sha>}
    profiling: {limits: configs/fleet/profiling-limits.json, prefill_lens: [256, 1024], ...}
    check: {pace_repeats: 1, kv_probes: 1}
    router: {host: 127.0.0.1, port: 18080}
    workload: {input_tokens: 8192, output_tokens: 128, seed: 1729}
    budgets: {ttft_s: 10, tpot_s: 0.3, attainment: 0.95}
    benchmark: {timeout_s: 180, points: [{name: r2, rate: 2, requests: 20}, ...]}

Relative paths are relative to the checkout (the directory holding ``tools/``), so the same
file runs from anywhere. Pure: ``parse_run_file`` takes the text; ``load_run_file`` reads it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from narwhal.contract import (
    ContractError,
    LoadedFleet,
    load_fleet,
    read_json_document,
    validate_document,
)
from narwhal.contract.loader import validation_reasons
from narwhal.contract.models import format_loc
from narwhal.contract.paths import file_in_the_way
from narwhal.contract.yamlfile import StrictYamlLoader, load_yaml
from narwhal.profiles.store import ProfilingLimits, ProfilingPlan

__all__ = [
    "RUN_SCHEMA",
    "BenchmarkSection",
    "LoadedRun",
    "RunFile",
    "RunFileError",
    "load_run_file",
    "parse_run_file",
    "profiling_problems",
]

RUN_SCHEMA = "narwhal.qualify/v1"


class RunFileError(Exception):
    """A RUN.yaml that cannot run: ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    # A typo in a run file must fail before a 20-minute run, not silently become a default;
    # nor may a value of another type become one of this type (`attainment: true` was 1.0).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Deployment(_Strict):
    file: str = Field(min_length=1, description="deploy_hosts.py --deployment")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$", description="the commit deployed (HEAD)")


class Profiling(_Strict):
    """narwhal-profile's flags. Their bounds are the profiler's own (``ProfilingPlan``, checked
    by ``profiling_problems``), not copies that could drift from it."""

    limits: str = Field(min_length=1)
    prefill_lens: list[int] = Field(default=[256, 1024, 4096, 8192], min_length=1)
    decode_input_lens: list[int] = Field(default=[512, 4096, 8192], min_length=1)
    decode_concurrency: list[int] = Field(default=[1, 2, 4], min_length=1)
    decode_tokens: int = Field(default=64, gt=0)
    prefill_repeats: int = Field(default=3, gt=0)

    @field_validator("prefill_lens", "decode_input_lens", "decode_concurrency")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        # As narwhal-profile reads its comma-separated flags: positive, no value twice.
        if any(v <= 0 for v in values):
            raise ValueError("every entry must be a positive integer")
        if len(set(values)) != len(values):
            raise ValueError(f"duplicate values in {values}")
        return values

    def plan(self) -> dict[str, object]:
        """The profiling plan these flags make, as narwhal-profile builds it."""
        return {
            "prefill_lens": self.prefill_lens,
            "prefill_repeats": self.prefill_repeats,
            "decode_input_lens": self.decode_input_lens,
            "decode_concurrency": self.decode_concurrency,
            "decode_tokens": self.decode_tokens,
        }


class Check(_Strict):
    pace_repeats: int | None = Field(default=None, gt=0)
    # Relative deviation the pace gate allows from the profile (narwhal-check's default when
    # omitted): looser where the engines share a machine with other work.
    pace_tolerance: float | None = Field(default=None, gt=0)
    kv_probes: int | None = Field(default=None, gt=0)


class Router(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, gt=0, lt=65536)
    ready_timeout_s: float = Field(default=60.0, gt=0)


class Workload(_Strict):
    input_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    seed: int = 1729


class Budgets(_Strict):
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    attainment: float = Field(gt=0, le=1)


class BenchmarkPoint(_Strict):
    # Names become directory names and request-id prefixes in the measurement tools.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    rate: float = Field(gt=0)
    requests: int = Field(gt=0)


class BenchmarkSection(_Strict):
    timeout_s: float = Field(default=180.0, gt=0)
    prefix_caching: Literal["off", "any"] = "off"
    points: list[BenchmarkPoint] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _unique(cls, points: list[BenchmarkPoint]) -> list[BenchmarkPoint]:
        names = [p.name for p in points]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"point names used twice: {', '.join(twice)}")
        return points


class RunFile(_Strict):
    schema_version: Literal["narwhal.qualify/v1"] = Field(alias="schema")
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    run_dir: str = Field(min_length=1)
    fleet: str = Field(min_length=1)
    launch_plans: list[str] = Field(min_length=1)
    deployment: Deployment | None = None
    profiling: Profiling
    check: Check = Field(default_factory=Check)
    router: Router = Field(default_factory=Router)
    workload: Workload
    budgets: Budgets
    benchmark: BenchmarkSection


@dataclass(frozen=True)
class LoadedRun:
    """A checked run file with every path resolved against the checkout."""

    run: RunFile
    path: Path
    checkout: Path
    run_dir: Path
    fleet_path: Path
    fleet: LoadedFleet
    launch_plans: list[Path]
    limits: Path
    deployment_file: Path | None

    @property
    def simulated(self) -> bool:
        """Every engine is a simulated one the chain may start itself."""
        return all(e.sim is not None for e in self.fleet.contract.engines)


def _resolve(checkout: Path, value: str) -> Path:
    p = Path(value)
    return p if p.is_absolute() else checkout / p


class _RunFileLoader(StrictYamlLoader):
    """YAML 1.1 (PyYAML) reads ``1e3`` and ``5e-1`` as strings (a float needs a dot and a
    signed exponent there); YAML 1.2 and JSON read them as the numbers an operator meant, and
    the run file's strict schema would refuse the strings."""


_RunFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_run_file(text: str, source: str) -> RunFile:
    """The run file's model, or RunFileError with one line per schema problem."""
    try:
        raw = load_yaml(text, _RunFileLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RunFileError([f"{source}: not YAML{where}: {getattr(exc, 'problem', exc)}"]) from None
    if not isinstance(raw, dict):
        raise RunFileError([f"{source}: a run file is a YAML mapping"])
    if raw.get("schema") != RUN_SCHEMA:
        raise RunFileError([f"{source}: schema must be {RUN_SCHEMA!r}, not {raw.get('schema')!r}"])
    try:
        return RunFile.model_validate(raw)
    except ValidationError as exc:
        # In the fleet loader's words ("expected an object (got 5)"), not pydantic's, which
        # name its classes ("a valid dictionary or instance of Workload").
        raise RunFileError(
            [
                f"{source}: {format_loc(loc) or '(document)'}: {reason}"
                for loc, reason in validation_reasons(exc)
            ]
        ) from None


def load_run_file(
    path: str | os.PathLike[str], checkout: Path, run_dir: str | None = None
) -> LoadedRun:
    """Read and check a run file: its schema, then every file it names and the budgets
    against the fleet's. Every problem is collected before RunFileError is raised."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise RunFileError([f"{source}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise RunFileError([f"{source}: not UTF-8 text (byte {exc.start})"]) from None
    run = parse_run_file(text, source)
    problems: list[str] = []

    def existing(field: str, value: str) -> Path:
        p = _resolve(checkout, value)
        if not p.is_file():
            problems.append(f"{source}: {field}: no such file: {p}")
        return p

    fleet_path = existing("fleet", run.fleet)
    plans = [existing(f"launch_plans[{i}]", v) for i, v in enumerate(run.launch_plans)]
    limits = existing("profiling.limits", run.profiling.limits)
    deployment = existing("deployment.file", run.deployment.file) if run.deployment else None
    fleet: LoadedFleet | None = None
    if fleet_path.is_file():
        try:
            fleet = load_fleet(fleet_path)
        except ContractError as exc:
            problems.append(f"{source}: fleet: {exc}")
    problems += profiling_problems(source, run.profiling, fleet, limits)
    if fleet is not None:
        problems += _budget_problems(source, run, fleet)
        longest = run.workload.input_tokens + run.workload.output_tokens
        if longest > fleet.contract.model.max_model_len:
            problems.append(
                f"{source}: workload: {run.workload.input_tokens} + {run.workload.output_tokens} "
                f"tokens exceed the fleet's max_model_len {fleet.contract.model.max_model_len}"
            )
        sims = [e.sim is not None for e in fleet.contract.engines]
        if any(sims) and not all(sims):
            problems.append(f"{source}: fleet: mixes simulated and real engines")
        for i, engine in enumerate(fleet.contract.engines):
            if engine.sim is None and engine.attestation_url is None:
                problems.append(
                    f"{source}: fleet: engines[{i}].attestation_url: a real engine is finalized "
                    "and watched through its attestation sidecar: name its URL"
                )
    resolved_run_dir = _resolve(checkout, run_dir or run.run_dir)
    problems += _run_dir_problems(source, resolved_run_dir, checkout)
    if problems:
        raise RunFileError(problems)
    assert fleet is not None
    return LoadedRun(
        run=run,
        path=Path(source),
        checkout=checkout,
        run_dir=resolved_run_dir,
        fleet_path=fleet_path,
        fleet=fleet,
        launch_plans=plans,
        limits=limits,
        deployment_file=deployment,
    )


def profiling_problems(
    source: str, profiling: Profiling, fleet: LoadedFleet | None, limits: Path
) -> list[str]:
    """What narwhal-profile would refuse (exit 2) minutes into the run, found before it
    starts: the plan against the profiler's own model (its bounds: two prefill lengths or
    more, four decode tokens or more, ...), the limits file read by the profiler's loader,
    a probe longer than the fleet's max_model_len, a plan the limits cannot pay for."""
    out: list[str] = []
    plan: ProfilingPlan | None = None
    try:
        plan = ProfilingPlan.model_validate(profiling.plan())
    except ValidationError as exc:
        for loc, reason in validation_reasons(exc):
            out.append(f"{source}: {format_loc(('profiling', *loc))}: {reason}")
    budget: ProfilingLimits | None = None
    if limits.is_file():
        try:
            budget = validate_document(
                read_json_document(limits), ProfilingLimits, str(limits), strict=True
            )
        except ContractError as exc:
            out.append(f"{source}: profiling.limits: {exc}")
    if plan is None:
        return out
    if fleet is not None:
        max_len = fleet.contract.model.max_model_len
        # The profiler's own measure of its longest probe (narwhal-profile refuses it).
        for field, longest in (
            ("prefill_lens", max(plan.prefill_lens)),
            ("decode_input_lens", max(plan.decode_input_lens) + plan.decode_tokens),
        ):
            if longest > max_len:
                what = "a prefill probe" if field == "prefill_lens" else "a decode probe"
                out.append(
                    f"{source}: profiling.{field}: {what} of {longest} tokens exceeds the "
                    f"fleet's max_model_len {max_len}"
                )
    if budget is not None and plan.tokens_needed() > budget.max_tokens_per_engine:
        out.append(
            f"{source}: profiling.limits: max_tokens_per_engine {budget.max_tokens_per_engine} "
            f"is below the {plan.tokens_needed()} tokens this profiling plan needs per engine"
        )
    return out


def _run_dir_problems(source: str, run_dir: Path, checkout: Path) -> list[str]:
    """The run directory is the run's alone: the bundle packs all of it, and a rerun deletes
    a step's outputs in it."""
    where = run_dir.resolve()
    if where == checkout.resolve() or where in checkout.resolve().parents:
        return [f"{source}: run_dir: {run_dir} holds the checkout; give the run a directory"]
    if where.exists() and not where.is_dir():
        return [f"{source}: run_dir: {run_dir} is not a directory"]
    if (blocker := file_in_the_way(where)) is not None:
        # Under a regular file it could not be made: found only part way through the run.
        return [f"{source}: run_dir: {blocker} is not a directory"]
    if where.is_dir() and any(where.iterdir()) and not (where / "steps.json").exists():
        return [
            f"{source}: run_dir: {run_dir} holds other files and no steps.json: not a "
            "narwhal-qualify run directory (give an empty or new one)"
        ]
    return []


def _budget_problems(source: str, run: RunFile, fleet: LoadedFleet) -> list[str]:
    """The run measures against the fleet's own budgets or stricter ones: a looser budget
    would qualify a fleet for an SLO it was never held to."""
    fb = fleet.contract.budgets
    out = []
    for name, mine, theirs in (
        ("ttft_s", run.budgets.ttft_s, fb.ttft_s),
        ("tpot_s", run.budgets.tpot_s, fb.tpot_s),
    ):
        if mine > theirs:
            out.append(f"{source}: budgets.{name}: {mine:g} is looser than the fleet's {theirs:g}")
    if run.budgets.attainment < fb.attainment:
        out.append(
            f"{source}: budgets.attainment: {run.budgets.attainment:g} is below the fleet's "
            f"{fb.attainment:g}"
        )
    return out
