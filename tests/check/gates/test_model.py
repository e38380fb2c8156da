"""The model gate against recorded /v1/models answers."""

from __future__ import annotations

from narwhal.check.evidence import ModelsResult
from narwhal.check.gates.model import model_gate
from tests.check.support import fleet_doc, loaded


def test_model_gate_requires_exactly_the_fleet_model() -> None:
    fleet = loaded(fleet_doc(3)).contract
    out = model_gate(
        fleet,
        [
            ModelsResult("e0", [fleet.model.id], 16384),
            ModelsResult("e1", ["other"], 16384),
            ModelsResult("e2", [fleet.model.id], 8192),
        ],
    )
    assert out.failures == [
        f"e1: serves 'other', not exactly {fleet.model.id!r}",
        "e2: max_model_len 8192 is below the fleet's 16384",
    ]
