"""The request ledger's outcome metrics: which requests count towards SLO attainment."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from narwhal.contract import Budgets
from narwhal.journal import Journal
from narwhal.metrics import RouterMetrics
from narwhal.serve.ledger import RequestLedger
from narwhal.serve.record import RequestRecord


@pytest.mark.parametrize(
    ("outcome", "counted"),
    [
        ("ok", "met"),
        ("rejected", "missed"),
        ("decode_failed", "missed"),
        ("deadline_exceeded", "missed"),
        ("client_error", None),
        # A client that left is not the fleet's to answer for: the attainment alert and the
        # dashboards leave it out, and so does the "exact" counter they are compared with.
        ("client_abort", None),
    ],
)
def test_attainment_counts_what_the_alert_counts(
    tmp_path: Path, outcome: str, counted: str | None
) -> None:
    journal = Journal.open(tmp_path / "journal.jsonl", max_bytes=0)
    metrics = RouterMetrics(["e0"], "f", "0" * 64, None)
    ledger = RequestLedger(journal, metrics, Budgets(ttft_s=10.0, tpot_s=0.3, attainment=0.95))
    record = RequestRecord("r1", time.time(), time.monotonic(), "/v1/completions")
    assert ledger.open(record)
    if outcome == "ok":
        record.t_first_token = 0.1
    ledger.close(record, outcome, 200 if outcome == "ok" else 499)
    journal.close()
    slo = {r: metrics.slo.labels(r)._value.get() for r in ("met", "missed")}
    assert slo == {r: 1.0 if r == counted else 0.0 for r in ("met", "missed")}


def test_every_request_end_has_its_attempts_even_with_no_leg_tried() -> None:
    # router.md lists attempts among every request.end's fields: a request turned away or with
    # no pair to serve it (503) had none, and a reader of r["attempts"] failed on it.
    record = RequestRecord("r2", time.time(), time.monotonic(), "/v1/completions")
    assert record.end_fields()["attempts"] == []
    record.attempt("prefill", "e0", "ok")
    assert [a["engine"] for a in record.end_fields()["attempts"]] == ["e0"]
