"""The qualification run directory's file names: one list, read by the steps that write the
files and by the report that reads them."""

from __future__ import annotations

__all__ = [
    "BENCHMARK",
    "CHECK_REPORT",
    "FLEET_FINAL",
    "FLEET_QUALIFIED",
    "JOURNAL",
    "PLAN",
    "PLOTS_DIR",
    "PROFILE_STORE",
    "ROUTER_PID",
    "STEP_PID",
    "WORKLOAD",
]

FLEET_FINAL = "fleet-final.json"
FLEET_QUALIFIED = "fleet-qualified.json"
PROFILE_STORE = "profile-store.json"
PLAN = "benchmark-plan.json"
CHECK_REPORT = "check-report.json"
JOURNAL = "router-journal.jsonl"
WORKLOAD = "workload"
BENCHMARK = "benchmark"
PLOTS_DIR = "report-plots"  # the report's plots as SVG files (report.md links them)
ROUTER_PID = "router.pid"  # the router this run started, while it runs
STEP_PID = "step.pid"  # the step command running now: its process group, while it runs
