"""The health gate against recorded evidence."""

from __future__ import annotations

from narwhal.check.evidence import Call, EngineHealth
from narwhal.check.gates.health import health_gate
from tests.check.support import fleet_doc, loaded


def test_health_names_silent_engines() -> None:
    fleet = loaded(fleet_doc(2)).contract
    results = [
        EngineHealth("e0", Call(200, 0.01), Call(200, 0.01), {"generation": "x"}),
        EngineHealth("e1", Call(None, 5.0, "no answer within 5 s"), Call(503, 0.01), None),
    ]
    out = health_gate(fleet, results, 5.0)
    assert out.failures == [
        "e1: /health did not answer 200: no answer within 5 s",
        "e1: attestation did not answer 200: HTTP 503",
    ]
