"""The model gate: ``/v1/models`` on every engine lists exactly the fleet's model, with a
long enough ``max_model_len``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from narwhal.check.evidence import ModelsResult
from narwhal.check.gates.common import GateOutcome, outcome
from narwhal.contract import FleetContract

__all__ = ["model_gate"]


def model_gate(fleet: FleetContract, results: Sequence[ModelsResult]) -> GateOutcome:
    """``/v1/models`` on every engine lists exactly the fleet's model id, with a
    ``max_model_len`` at least the fleet's."""
    failures: list[str] = []
    engines: dict[str, Any] = {}
    want = fleet.model.id
    for r in results:
        engines[r.engine_id] = {"ids": r.ids, "max_model_len": r.max_model_len, "error": r.error}
        if r.error is not None:
            failures.append(f"{r.engine_id}: /v1/models failed: {r.error}")
            continue
        if r.ids != [want]:
            failures.append(
                f"{r.engine_id}: serves {', '.join(map(repr, r.ids or [])) or 'no model'}, "
                f"not exactly {want!r}"
            )
        if r.max_model_len is None:
            failures.append(f"{r.engine_id}: /v1/models reports no max_model_len")
        elif r.max_model_len < fleet.model.max_model_len:
            failures.append(
                f"{r.engine_id}: max_model_len {r.max_model_len} is below the fleet's "
                f"{fleet.model.max_model_len}"
            )
    return outcome(
        f"{len(results)} engines serve exactly {want} with max_model_len >= "
        f"{fleet.model.max_model_len}",
        failures,
        [],
        {"model": want, "max_model_len": fleet.model.max_model_len, "engines": engines},
    )
