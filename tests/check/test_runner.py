"""The runner's sequencing, with a fake collector and a virtual clock."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from narwhal.check.evidence import Call, EngineHealth, ModelsResult
from narwhal.check.runner import CheckInputs, run_check
from narwhal.check.settings import CheckSettings
from narwhal.clock import VirtualClock
from narwhal.contract import GATE_NAMES
from tests.check.support import attestation, fleet_doc, loaded


class FakeCollector:
    """Answers like a healthy fleet, except that ``down`` engines do not answer /health."""

    def __init__(self, fleet: Any, clock: VirtualClock, down: frozenset[str] = frozenset()):
        self.fleet, self.clock, self.down = fleet, clock, down
        self.attestations: dict[str, Any] = {}
        self.attestation_errors: dict[str, str] = {}
        self.closed = False

    async def fetch_attestations(self) -> None:
        for e in self.fleet.engines:
            self.attestations[e.id] = attestation(self.fleet, e)

    def generation_of(self, spec: Any) -> str:
        return f"gen-{spec.id}"

    async def health(self) -> list[EngineHealth]:
        self.clock.advance(0.25)
        return [
            EngineHealth(
                e.id,
                Call(None, 5.0, "refused") if e.id in self.down else Call(200, 0.01),
                Call(200, 0.01),
                self.attestations[e.id],
            )
            for e in self.fleet.engines
        ]

    async def models(self) -> list[ModelsResult]:
        self.clock.advance(0.5)
        return [ModelsResult(e.id, [self.fleet.model.id], 16384) for e in self.fleet.engines]

    async def aclose(self) -> None:
        self.closed = True


def _run(lf: Any, requested: list[str], collector: FakeCollector, clock: VirtualClock) -> Any:
    return asyncio.run(
        run_check(
            CheckInputs(lf),
            CheckSettings(),
            requested,
            clock,
            lambda: dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            collector=collector,  # type: ignore[arg-type]
        )
    )


def test_runner_orders_times_and_skips_gates() -> None:
    lf = loaded(fleet_doc(2))
    clock = VirtualClock(100.0)
    fake = FakeCollector(lf.contract, clock)
    report = _run(lf, ["model", "health", "contract"], fake, clock)
    assert fake.closed
    assert [g.verdict for g in report.gates] == [
        "pass", "pass", "skip", "pass", "skip", "skip", "skip", "skip"
    ]  # fmt: skip
    model = report.gate("model")
    assert model.started_s == 0.25 and model.duration_s == 0.5  # the virtual clock's times
    assert report.gate("pace").skip.kind == "not_requested"
    assert report.verdict == "pass" and not report.complete
    assert report.created_at == "2026-01-01T00:00:00+00:00"
    assert report.engines["e1"].generation == "gen-e1"
    assert report.settings["gates_requested"] == ["health", "contract", "model"]


def test_runner_blocks_live_gates_after_a_health_failure_and_skips_storeless_gates() -> None:
    lf = loaded(fleet_doc(2))
    clock = VirtualClock()
    report = _run(lf, list(GATE_NAMES), FakeCollector(lf.contract, clock, frozenset({"e1"})), clock)
    assert report.verdict == "fail" and report.complete
    assert report.gate("health").failures == ["e1: /health did not answer 200: refused"]
    for name in ("contract", "generation", "model", "tokenization", "kv_transfer"):
        skip = report.gate(name).skip
        assert skip is not None and skip.kind == "blocked" and "e1" in skip.reason
    for name in ("pace", "slo"):
        skip = report.gate(name).skip
        assert skip is not None and skip.kind == "no_input"
