"""The check report (``narwhal.check-report/v1``): what ``narwhal-check`` proved about a fleet,
and the one test ``narwhal-serve --check-report`` applies before serving it. narwhal-check
writes it and narwhal-serve reads it, so the format lives here, below both.

A report names the exact inputs it judged (fleet and profile-store SHA-256s, the plan's if any,
each engine's generation) and carries every gate's verdict with its evidence and timing. Its
own identity is the SHA-256 of its canonical JSON, which the router journals.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from narwhal.contract.hashing import sha256_hex
from narwhal.contract.loader import read_json_document, validate_document

__all__ = [
    "DEFAULT_REPORT_NAME",
    "GATE_NAMES",
    "REPORT_SCHEMA",
    "CheckReport",
    "EngineIdentity",
    "FileRef",
    "FleetRef",
    "GateName",
    "GateReport",
    "SkipInfo",
    "SkipKind",
    "load_report",
    "qualification_problem",
]

# Where narwhal-check writes its report unless told (--report), in the directory it runs from;
# narwhal-serve looks for it there and beside the fleet file.
DEFAULT_REPORT_NAME = "check-report.json"

REPORT_SCHEMA = "narwhal.check-report/v1"
# The order gates run in: cheap identity checks first, so a wrong engine is named before any
# timing gate spends minutes measuring it.
GATE_NAMES: tuple[GateName, ...] = (
    "health",
    "contract",
    "generation",
    "model",
    "pace",
    "tokenization",
    "kv_transfer",
    "slo",
)
GateName = Literal[
    "health", "contract", "generation", "model", "pace", "tokenization", "kv_transfer", "slo"
]
Verdict = Literal["pass", "fail", "skip"]
# not_requested: left out by --gates; no_input: its input (profile store) was not given;
# blocked: an earlier gate failed in a way that makes this one meaningless (health).
SkipKind = Literal["not_requested", "no_input", "blocked"]


class _Model(BaseModel):
    # Strict, as the fleet file's models: "yes" is not a verdict's boolean, nor "12.5" a
    # duration (a report edited by hand is refused naming the field).
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, populate_by_name=True, serialize_by_alias=True
    )


class FileRef(_Model):
    path: str
    sha256: str


class FleetRef(FileRef):
    name: str


class EngineIdentity(_Model):
    url: str
    # As the engine's attestation reported it when the check started; None: unreadable.
    generation: str | None


class SkipInfo(_Model):
    kind: SkipKind
    reason: str


class GateReport(_Model):
    name: GateName
    verdict: Verdict
    summary: str
    failures: list[str] = Field(default_factory=list)
    # What a passing gate could not prove (an unpinned hash, a metric the engine lacks).
    notes: list[str] = Field(default_factory=list)
    skip: SkipInfo | None = None
    # Seconds since the check started, and how long the gate took (monotonic clock).
    started_s: float = Field(ge=0)
    duration_s: float = Field(ge=0)
    evidence: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> GateReport:
        if (self.verdict == "skip") != (self.skip is not None):
            raise ValueError(f"gate {self.name}: a skip (and only a skip) carries skip info")
        if (self.verdict == "fail") != bool(self.failures):
            raise ValueError(f"gate {self.name}: a failure (and only a failure) lists failures")
        return self


class CheckReport(_Model):
    schema_version: Literal["narwhal.check-report/v1"] = Field(alias="schema")
    created_at: str
    narwhal_version: str
    fleet: FleetRef
    profile_store: FileRef | None
    plan: FileRef | None
    engines: dict[str, EngineIdentity]
    # The tolerances and probe sizes the gates used: a verdict means nothing without them.
    settings: dict[str, Any]
    gates: list[GateReport]
    verdict: Literal["pass", "fail"]
    # Every gate was requested (no "not_requested" skip): only a complete report qualifies.
    complete: bool
    duration_s: float = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> CheckReport:
        names = [g.name for g in self.gates]
        if names != list(GATE_NAMES):
            raise ValueError(f"gates must be exactly {', '.join(GATE_NAMES)} in that order")
        failed = any(g.verdict == "fail" for g in self.gates)
        if self.verdict != ("fail" if failed else "pass"):
            raise ValueError("verdict must be fail exactly when a gate failed")
        partial = any(g.skip is not None and g.skip.kind == "not_requested" for g in self.gates)
        if self.complete == partial:
            raise ValueError("complete must be true exactly when every gate was requested")
        return self

    def gate(self, name: str) -> GateReport:
        for g in self.gates:
            if g.name == name:
                return g
        raise KeyError(name)

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def load_report(path: str | os.PathLike[str]) -> tuple[CheckReport, str]:
    """Read and validate a report: (report, its SHA-256). ContractError (one line) otherwise."""
    source = os.fspath(path)
    raw = read_json_document(path)
    report = validate_document(raw, CheckReport, source)
    return report, sha256_hex(raw)


def _short(digest: str | None) -> str:
    return "none" if digest is None else digest[:12]


def qualification_problem(
    report: CheckReport,
    fleet_sha256: str,
    fleet_path: str,
    profile_sha256: str | None,
) -> str | None:
    """Why ``report`` does not qualify serving this fleet with this profile store (None: it
    does). Pure; the wording is what narwhal-serve prints on its one line."""
    if report.verdict != "pass":
        failed = [g.name for g in report.gates if g.verdict == "fail"]
        return f"the report did not pass (failed gates: {', '.join(failed)})"
    if not report.complete:
        missing = [
            g.name for g in report.gates if g.skip is not None and g.skip.kind == "not_requested"
        ]
        return (
            f"the report is partial (gates not run: {', '.join(missing)}); "
            "qualify with a full narwhal-check run"
        )
    if report.fleet.sha256 != fleet_sha256:
        same_file = os.path.realpath(report.fleet.path) == os.path.realpath(fleet_path)
        why = (
            "the fleet file changed after the check (stale report)"
            if same_file
            else f"the report is for another fleet ({report.fleet.path})"
        )
        return (
            f"fleet sha256 differs: report {_short(report.fleet.sha256)}, served "
            f"{_short(fleet_sha256)}: {why}"
        )
    reported = report.profile_store.sha256 if report.profile_store else None
    if reported != profile_sha256:
        return (
            f"profile store sha256 differs: report {_short(reported)}, served "
            f"{_short(profile_sha256)}"
        )
    return None
