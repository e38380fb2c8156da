"""narwhal-check: preflight gates that qualify a fleet before it serves.

``gates`` judges evidence (pure), ``collect`` gathers it from the engines (all I/O), ``runner``
runs the gates in order, ``report`` is the report format and the test narwhal-serve applies to
it, ``plan`` the benchmark-plan format, ``slo`` the analytic load predictions.
"""

from __future__ import annotations

from narwhal.check.plan import PLAN_SCHEMA, BenchmarkPlan
from narwhal.check.report import (
    GATE_NAMES,
    REPORT_SCHEMA,
    CheckReport,
    load_report,
    qualification_problem,
)

__all__ = [
    "GATE_NAMES",
    "PLAN_SCHEMA",
    "REPORT_SCHEMA",
    "BenchmarkPlan",
    "CheckReport",
    "load_report",
    "qualification_problem",
]
