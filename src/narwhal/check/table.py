"""The human summary of a check report: one row per gate, then the overall verdict."""

from __future__ import annotations

from narwhal.contract import CheckReport

__all__ = ["render_table"]


def render_table(report: CheckReport) -> str:
    """The human summary: one row per gate, then the overall verdict."""
    rows = [["gate", "verdict", "time_s", "summary"]]
    for g in report.gates:
        summary = g.summary
        if g.verdict == "fail" and g.failures:
            summary = g.failures[0] + (
                f" (and {len(g.failures) - 1} more)" if len(g.failures) > 1 else ""
            )
        elif g.skip is not None:
            summary = f"{g.skip.kind}: {g.skip.reason}"
        rows.append([g.name, g.verdict.upper(), f"{g.duration_s:.2f}", summary])
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]]) for r in rows]
    store = report.profile_store.sha256[:12] if report.profile_store else "none"
    lines.append(
        f"overall: {report.verdict.upper()}{'' if report.complete else ' (partial)'}  "
        f"fleet {report.fleet.name} sha256 {report.fleet.sha256[:12]}  profile store {store}"
    )
    return "\n".join(lines)
