"""Qualification runs with evidence: load trials, benchmark plans and the runner
(docs/measurement.md)."""
