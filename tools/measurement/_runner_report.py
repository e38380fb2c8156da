"""The plan-level outputs: a MAD-compatible CSV and a human report in the qualification
run's shape. Only points whose every gate passed reach the CSV (a dashboard reading only
the core columns must never pick up an invalid measurement); the report lists the others
with the gates they failed."""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "MAD_CORE_COLUMNS",
    "NARWHAL_COLUMNS",
    "csv_name",
    "mad_command",
    "write_csv",
    "write_markdown",
]

MAD_CORE_COLUMNS = (
    "model",
    "benchmark",
    "tp",
    "inp",
    "out",
    "num_prompts",
    "max_concurrency",
    "cmd",
    "performance",
    "metric",
    "unit",
)
NARWHAL_COLUMNS = (
    "point",
    "offered_rate_rps",
    "completed_rate_rps",
    "result",
    "attainment",
    "attainment_target",
    "verdict",
    "fleet_sha256",
    "workload_sha256",
    "plan_sha256",
    "narwhal_commit",
    "client_revision",
    "peak_concurrency",
)
# (metric, summary field, distribution key or None, factor to MAD's unit, unit)
_METRICS = (
    ("throughput_tot", "total_token_throughput_tps", None, 1.0, "tok/sec"),
    ("throughput_gen", "output_throughput_tps", None, 1.0, "tok/sec"),
    ("median_ttft", "ttft_s", "p50", 1000.0, "ms"),
    ("median_tpot", "tpot_s", "p50", 1000.0, "ms"),
    ("median_itl", "itl_s", "p50", 1000.0, "ms"),
    ("median_e2el", "e2el_s", "p50", 1000.0, "ms"),
)


def csv_name(model: str) -> str:
    # MAD names the file after the model's repository name: perf_Kimi-K3.csv.
    return f"perf_{model.rsplit('/', 1)[-1]}.csv"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def mad_command(server: str | None, client: str) -> str:
    """The ``cmd`` cell: MAD records the server's command and the client's; the server's is
    the one the router journaled with its ``router.start`` (None: not known, the client's
    alone)."""
    return client if server is None else f"server: {server}; client: {client}"


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows``: one dict per measured point (see benchmark_runner.csv_context)."""
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*MAD_CORE_COLUMNS, *NARWHAL_COLUMNS])
        writer.writeheader()
        for row in rows:
            summary = row["summary"]
            for metric, field_name, key, factor, unit in _METRICS:
                value = summary.get(field_name)
                if key is not None:
                    value = (value or {}).get(key)
                writer.writerow(
                    {
                        "model": row["model"],
                        "benchmark": "serving",
                        "tp": row["tp"],
                        "inp": row["inp"],
                        "out": row["out"],
                        "num_prompts": row["num_prompts"],
                        # Open-loop arrivals: the client caps nothing (offered_rate_rps is the
                        # load axis, as request rate is for vllm bench serve); the column holds
                        # the most requests the client had in flight at once.
                        "max_concurrency": summary.get("peak_concurrency", ""),
                        "cmd": row["cmd"],
                        "performance": _num(None if value is None else value * factor),
                        "metric": metric,
                        "unit": unit,
                        "point": row["point"],
                        "offered_rate_rps": _num(summary.get("offered_rate_rps")),
                        "completed_rate_rps": _num(summary.get("completed_rate_rps")),
                        "result": summary.get("result"),
                        "attainment": _num(summary.get("attainment")),
                        "attainment_target": _num(row["attainment_target"]),
                        "verdict": summary.get("verdict"),
                        "fleet_sha256": row["fleet_sha256"],
                        "workload_sha256": row["workload_sha256"],
                        "plan_sha256": row["plan_sha256"],
                        "narwhal_commit": row["narwhal_commit"],
                        "client_revision": row["client_revision"],
                        "peak_concurrency": summary.get("peak_concurrency"),
                    }
                )


def _triple(dist: dict[str, Any] | None, factor: float, fmt: str) -> str:
    if not dist or dist.get("p50") is None:
        return "-"
    return " / ".join(format(dist[k] * factor, fmt) for k in ("p50", "p95", "p99"))


def _when(ts: object) -> str:
    if not isinstance(ts, int | float):
        return "?"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:g} request/s"


def _verdict(summary: dict[str, Any]) -> str:
    """The point's verdict with the attainment that decided it."""
    verdict, attainment = summary.get("verdict"), summary.get("attainment")
    if not isinstance(attainment, int | float):
        return str(verdict)
    return f"{verdict} (attainment {attainment:.3f})"


def _budgets(point: dict[str, Any]) -> str:
    """The budgets the point was judged by: the plan's for the point, else its summary's."""
    budgets = point.get("budgets") or (point.get("summary") or {}).get("budgets") or {}
    ttft, tpot, target = (budgets.get(k) for k in ("ttft_s", "tpot_s", "attainment"))
    if not all(isinstance(v, int | float) for v in (ttft, tpot, target)):
        return "-"
    return f"{ttft:g} s / {tpot * 1000:g} ms, {target:g}"


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    lines: list[str] = []
    add = lines.append
    add(f"# Benchmark report: {report['model']}")
    add("")
    add(f"Overall: **{report['overall']}**. {report['overall_reason']}")
    add("")
    add("## Pinned inputs")
    add("")
    add("| Input | Value |")
    add("|---|---|")
    for label, value in report["inputs"].items():
        add(f"| {label} | {value} |")
    add("")
    add("## Measured points")
    add("")
    add(
        "| Point | Offered rate | Completed rate including drain | Output throughput including "
        "drain | TTFT p50 / p95 / p99 | TPOT p50 / p95 / p99 | Result | Verdict "
        "| Budgets: TTFT / TPOT, attainment target |"
    )
    add("|---|---|---|---|---|---|---|---|---|")
    for point in report["points"]:
        s = point.get("summary")
        if point["status"] != "measured" or not s:
            continue
        add(
            f"| {point['name']} | {_rate(point['rate'])} | "
            f"{'-' if s['completed_rate_rps'] is None else format(s['completed_rate_rps'], '.3f')}"
            f" request/s | "
            f"{'-' if s['output_throughput_tps'] is None else format(s['output_throughput_tps'], '.1f')}"  # noqa: E501
            f" tokens/s | {_triple(s['ttft_s'], 1.0, '.3f')} s | "
            f"{_triple(s['tpot_s'], 1000.0, '.1f')} ms | {s['result']} | "
            f"{_verdict(s)} | {_budgets(point)} |"
        )
    add("")
    add(
        "Each point excludes its one warmup request from this table; the client and journal "
        "counts under Evidence per point (report.md) include it. Rates and throughputs divide by "
        "the time from the first measured send to the last completion (including the drain). "
        "Each point is judged by its own budgets, which may be stricter than the fleet's."
    )
    add("")
    add("## Evidence per point")
    add("")
    add("| Point | Status | Gates | Client / journal terminal | Diagnostics |")
    add("|---|---|---|---|---|")
    for point in report["points"]:
        gates = ", ".join(
            f"{g['name']} {'pass' if g['passed'] else 'FAIL'}" for g in point["gates"]
        )
        rec = point.get("reconciliation") or {}
        counts = (
            f"{rec.get('client_terminal', '-')} / {rec.get('journal_ends', '-')}" if rec else "-"
        )
        diags = ", ".join(sorted({d["kind"] for d in point["diagnostics"]})) or "none"
        add(f"| {point['name']} | {point['status']} | {gates} | {counts} | {diags} |")
    add("")
    failed = [p for p in report["points"] if p["status"] != "measured"]
    if failed:
        add("Points that failed a gate are excluded from the CSV:")
        add("")
        for point in failed:
            names = [g["name"] for g in point["gates"] if not g["passed"]]
            add(f"- {point['name']}: {', '.join(names) or point['status']}")
        add("")
    add("## State timeline")
    add("")
    timeline = report.get("timeline") or []
    if not timeline:
        add("No router.start or role.flip records in the plan's window.")
    for entry in timeline:
        if entry["event"] == "role.flip":
            add(
                f"- {_when(entry.get('ts'))}: {entry.get('engine')} {entry.get('from')} -> "
                f"{entry.get('to')} (generation {entry.get('generation')})"
            )
        else:
            add(f"- {_when(entry.get('ts'))}: {entry['event']} roles {entry.get('roles')}")
    add("")
    add("## Post-load KV check")
    add("")
    post = report.get("post_load_check") or {}
    add(f"{post.get('status', 'not run')}: {post.get('reason', '')}")
    add("")
    add("## Commands")
    add("")
    for cmd in report["commands"]:
        add(f"    {cmd}")
    add("")
    if report.get("bundle"):
        add("## Evidence")
        add("")
        add(
            f"`{report['bundle']}` beside this report holds all of this run's output, the router's"
            " journal, the check report it served on and the profile store; its SHA-256 is in"
            f" `{report['bundle']}.sha256`."
        )
        for note in report.get("evidence_notes") or ():
            add(f"- not in it: {note}")
        add("")
    path.write_text("\n".join(lines), encoding="utf-8")
