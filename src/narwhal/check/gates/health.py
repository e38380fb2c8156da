"""The health gate: every engine's /health and attestation endpoint answer in time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from narwhal.check.evidence import EngineHealth
from narwhal.check.gates.common import GateOutcome, outcome, rounded
from narwhal.contract import FleetContract

__all__ = ["health_gate"]


def health_gate(
    fleet: FleetContract, results: Sequence[EngineHealth], bound_s: float
) -> GateOutcome:
    """Every engine's /health and attestation endpoint answer 200 within ``bound_s``."""
    failures: list[str] = []
    notes: list[str] = []
    engines: dict[str, Any] = {}
    for r in results:
        row: dict[str, Any] = {
            "health": {"status": r.health.status, "latency_s": rounded(r.health.latency_s)}
        }
        if not r.health.ok:
            failures.append(f"{r.engine_id}: /health did not answer 200: {r.health.describe()}")
        if r.attestation is None:
            row["attestation"] = None
            notes.append(f"{r.engine_id}: the fleet gives no attestation_url")
        else:
            row["attestation"] = {
                "status": r.attestation.status,
                "latency_s": rounded(r.attestation.latency_s),
            }
            if not r.attestation.ok:
                failures.append(
                    f"{r.engine_id}: attestation did not answer 200: {r.attestation.describe()}"
                )
            elif r.attestation_doc is None:
                failures.append(f"{r.engine_id}: attestation is not a JSON object")
        engines[r.engine_id] = row
    return outcome(
        f"{len(results)} engines and their attestations answered within {bound_s} s",
        failures,
        notes,
        {"bound_s": bound_s, "engines": engines},
    )
