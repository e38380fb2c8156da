"""narwhal-check: preflight gates that qualify a fleet before it serves.

``gates`` judges evidence (pure, one module per gate), ``collect`` gathers it from the engines
(all I/O), ``runner`` runs the gates in order, ``table`` prints the report, ``plan`` is the
benchmark-plan format. The report format itself, and the test narwhal-serve applies to it, is
``narwhal.contract.check_report``: narwhal-serve reads it without importing narwhal-check.
"""

from __future__ import annotations

from narwhal.check.plan import PLAN_SCHEMA, BenchmarkPlan

__all__ = ["PLAN_SCHEMA", "BenchmarkPlan"]
