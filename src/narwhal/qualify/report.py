"""The qualification report: one run directory read into a page a person takes in at a glance
(``report.html``, self-contained: inline CSS and SVG, no script) and the same in Markdown
(``report.md``, its plots as SVG files under ``report-plots/``).

The run directory, as narwhal-qualify lays it out::

    fleet-qualified.json   the fleet contract served (budgets, first-token deadline)
    profile-store.json     narwhal-profile's store
    check-report.json      narwhal-check's report (the kv_transfer gate's handoff probes)
    router-journal.jsonl   narwhal-serve's journal (router.start, role.flip, router.stop)
    benchmark/             benchmark_runner.py's output: report.json, points/NN-NAME/...

Only ``benchmark/report.json`` is required (``ReportError`` without it). The tables copy what
the benchmark runner computed there; the plots read the per-request client records it kept
(``points/*/client/client_records.jsonl``, with the load-trial client's definitions: TTFT is
sent to first token, TPOT ``(e2e - ttft) / (output_tokens - 1)``, ITL the gaps between streamed
chunks). Any other missing input becomes a line in the page saying what is missing.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from narwhal.contract import (
    CheckReport,
    ContractError,
    LoadedFleet,
    load_report,
    parse_fleet,
    read_json_document,
    sha256_hex,
)
from narwhal.qualify import plots
from narwhal.qualify.layout import (
    BENCHMARK,
    CHECK_REPORT,
    FLEET_QUALIFIED,
    JOURNAL,
    PLOTS_DIR,
    PROFILE_STORE,
)

__all__ = ["BENCHMARK_REPORT", "PLOT_IDS", "ReportError", "write_report"]

BENCHMARK_REPORT = f"{BENCHMARK}/report.json"
#: Every figure the page holds, in order (each ``<figure class="plot" id=...>``).
PLOT_IDS = ("ttft", "tpot", "itl", "attainment", "kv-probes", "roles")

_RESULT_HEADER = (
    "Point",
    "Offered rate",
    "Completed rate including drain",
    "Output throughput including drain",
    "TTFT p50 / p95 / p99",
    "TPOT p50 / p95 / p99",
    "Result",
    "Verdict",
)


class ReportError(Exception):
    """The run directory cannot make a report (its benchmark report is missing or unreadable)."""


@dataclass(frozen=True)
class _Plot:
    id: str
    title: str
    caption: str
    svg: str | None = None
    # Why there is no plot (None: there is one).
    missing: str | None = None


@dataclass
class _Point:
    name: str
    status: str
    doc: dict[str, Any]
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    recorded: bool = False  # its client records were read (the lists above are from them)

    @property
    def summary(self) -> dict[str, Any] | None:
        s = self.doc.get("summary")
        return s if isinstance(s, dict) else None

    def budget(self, key: str) -> float | None:
        budgets = (self.summary or {}).get("budgets") or {}
        value = budgets.get(key)
        return float(value) if isinstance(value, int | float) else None


@dataclass
class _Run:
    dir: Path
    bench: dict[str, Any]
    points: list[_Point]
    fleet: LoadedFleet | None
    check: CheckReport | None
    check_sha: str | None
    profile_sha: str | None
    # Journal records that are not requests' (router.start, role.flip, router.stop); None:
    # no journal in the run directory.
    journal: list[dict[str, Any]] | None
    notes: list[str]


# --- reading the run directory --------------------------------------------------------------


def _read_bench(run_dir: Path) -> dict[str, Any]:
    path = run_dir / BENCHMARK_REPORT
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"{path}: no benchmark report (benchmark_runner.py --out)") from None
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: unreadable benchmark report: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
        raise ReportError(f"{path}: not a benchmark report (no points list)")
    return doc


def _point_dir(run_dir: Path, doc: dict[str, Any]) -> Path:
    """The point's evidence under this run directory (the report names the absolute directory
    it was written to; the run directory may since have moved)."""
    recorded = doc.get("evidence_dir")
    base = run_dir / "benchmark" / "points"
    if isinstance(recorded, str) and (base / Path(recorded).name).is_dir():
        return base / Path(recorded).name
    return base / f"{int(doc.get('index', 0)):02d}-{doc.get('name')}"


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The objects in a JSONL file; a torn or foreign line is skipped."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _load_point(run_dir: Path, doc: dict[str, Any], notes: list[str]) -> _Point:
    p = _Point(name=str(doc.get("name")), status=str(doc.get("status")), doc=doc)
    path = _point_dir(run_dir, doc) / "client" / "client_records.jsonl"
    if not path.is_file():
        notes.append(f"point {p.name}: no client records ({path.relative_to(run_dir)})")
        return p
    p.recorded = True
    for rec in _jsonl(path):
        if rec.get("warmup") or rec.get("outcome") != "ok":
            continue
        sent, first, end = (_num(rec.get(k)) for k in ("sent_s", "first_token_s", "end_s"))
        if sent is None or first is None:
            continue
        ttft = first - sent
        p.ttft.append(ttft)
        tokens = rec.get("output_tokens")
        if end is not None and isinstance(tokens, int) and tokens > 0:
            p.tpot.append(0.0 if tokens == 1 else (end - sent - ttft) / (tokens - 1))
        gaps = rec.get("itl")
        if isinstance(gaps, list):
            p.itl.extend(float(g) for g in gaps if isinstance(g, int | float))
    return p


def _load_fleet(run_dir: Path, notes: list[str]) -> LoadedFleet | None:
    path = run_dir / FLEET_QUALIFIED
    if not path.is_file():
        notes.append(f"no {FLEET_QUALIFIED} in the run directory")
        return None
    try:
        return parse_fleet(read_json_document(path), str(path), path=path)
    except ContractError as exc:
        notes.append(f"{FLEET_QUALIFIED} unreadable: {exc}")
        return None


def _load_check(run_dir: Path, notes: list[str]) -> tuple[CheckReport | None, str | None]:
    path = run_dir / CHECK_REPORT
    if not path.is_file():
        notes.append(f"no {CHECK_REPORT} in the run directory: no qualification gates")
        return None, None
    try:
        return load_report(path)
    except ContractError as exc:
        notes.append(f"{CHECK_REPORT} unreadable: {exc}")
        return None, None


def _load_profile_sha(run_dir: Path, notes: list[str]) -> str | None:
    path = run_dir / PROFILE_STORE
    if not path.is_file():
        notes.append(f"no {PROFILE_STORE} in the run directory")
        return None
    try:
        return sha256_hex(read_json_document(path))
    except ContractError as exc:
        notes.append(f"{PROFILE_STORE} unreadable: {exc}")
        return None


def _load_journal(run_dir: Path, notes: list[str]) -> list[dict[str, Any]] | None:
    path = run_dir / JOURNAL
    if not path.is_file():
        notes.append(f"no {JOURNAL} in the run directory")
        return None
    out: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            # Request records are most of a journal and none of the role timeline: skip them
            # before parsing.
            if '"type":"request.' in line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _load(run_dir: Path) -> _Run:
    bench = _read_bench(run_dir)
    notes: list[str] = []
    points = [_load_point(run_dir, doc, notes) for doc in bench["points"] if isinstance(doc, dict)]
    fleet = _load_fleet(run_dir, notes)
    check, check_sha = _load_check(run_dir, notes)
    profile_sha = _load_profile_sha(run_dir, notes)
    journal = _load_journal(run_dir, notes)
    return _Run(run_dir, bench, points, fleet, check, check_sha, profile_sha, journal, notes)


# --- tables ---------------------------------------------------------------------------------


def _triple(dist: object, factor: float, fmt: str, unit: str) -> str:
    if not isinstance(dist, dict) or dist.get("p50") is None:
        return "-"
    return " / ".join(format(dist[k] * factor, fmt) for k in ("p50", "p95", "p99")) + f" {unit}"


def _fixed(value: object, fmt: str, unit: str) -> str:
    return "-" if not isinstance(value, int | float) else f"{format(value, fmt)} {unit}"


def _result_rows(run: _Run) -> list[tuple[str, ...]]:
    """benchmark/report.md's table, with the point's name first; a point that was not measured
    says why instead of numbers."""
    rows: list[tuple[str, ...]] = []
    for p in run.points:
        rate = p.doc.get("rate")
        offered = "-" if not isinstance(rate, int | float) else f"{rate:g} request/s"
        s = p.summary
        if p.status != "measured" or s is None:
            failed = [g.get("name") for g in p.doc.get("gates", []) if not g.get("passed")]
            why = f"not measured ({p.status}: {', '.join(map(str, failed)) or 'no summary'})"
            rows.append((p.name, offered, "-", "-", "-", "-", why, "no verdict"))
            continue
        rows.append(
            (
                p.name,
                offered,
                _fixed(s.get("completed_rate_rps"), ".3f", "request/s"),
                _fixed(s.get("output_throughput_tps"), ".1f", "tokens/s"),
                _triple(s.get("ttft_s"), 1.0, ".3f", "s"),
                _triple(s.get("tpot_s"), 1000.0, ".1f", "ms"),
                str(s.get("result", "-")),
                _verdict_cell(p),
            )
        )
    return rows


def _verdict_cell(p: _Point) -> str:
    """``pass (0.958 >= target 0.95)`` or ``FAIL (0.917 < target 0.95)``: the verdict and
    what decided it."""
    s = p.summary or {}
    verdict, attainment, target = (
        s.get("verdict"),
        _num(s.get("attainment")),
        p.budget("attainment"),
    )
    if attainment is None or target is None:
        return str(verdict or "-")
    if verdict == "pass":
        return f"pass ({attainment:.3f} >= target {target:g})"
    return f"FAIL ({attainment:.3f} < target {target:g})"


def _point_failure(p: _Point) -> str | None:
    """Why a point did not pass, in one line: the gates it failed, or the attainment it
    missed and which requests missed it (from the client's records)."""
    failed = [str(g.get("name")) for g in p.doc.get("gates", []) if not g.get("passed")]
    s = p.summary
    if p.status != "measured" or s is None:
        gates = ", ".join(failed) or "no summary"
        return f"point {p.name}: not measured ({p.status}): {gates}"
    if s.get("verdict") == "pass":
        return None
    line = f"point {p.name}: {s.get('result')}"
    attainment, target = _num(s.get("attainment")), p.budget("attainment")
    if attainment is not None and target is not None:
        line += f", attainment {attainment:.3f} below its target {target:g}"
    causes = []
    ttft_b, tpot_b = p.budget("ttft_s"), p.budget("tpot_s")
    # Which completed requests broke which budget: only the client's records say (a request
    # over both counts in both).
    if ttft_b is not None and p.recorded:
        over = sum(1 for v in p.ttft if v > ttft_b)
        causes.append(f"{over} over the TTFT budget of {ttft_b:g} s")
    if tpot_b is not None and p.recorded:
        over = sum(1 for v in p.tpot if v > tpot_b)
        causes.append(f"{over} over the TPOT budget of {tpot_b * 1000:g} ms")
    outcomes = s.get("by_outcome")
    if isinstance(outcomes, dict):
        others = {k: v for k, v in outcomes.items() if k != "ok" and v}
        lost = sum(v for v in others.values() if isinstance(v, int))
        detail = ", ".join(f"{v} {k}" for k, v in sorted(others.items()))
        causes.append(f"{lost} not completed" + (f" ({detail})" if detail else ""))
    if causes:
        line += ": " + ", ".join(causes)
    return line


def _failures(run: _Run) -> list[str]:
    """Every reason the run did not qualify, one line each."""
    out = [line for p in run.points if (line := _point_failure(p)) is not None]
    post = run.bench.get("post_load_check")
    if isinstance(post, dict) and post.get("status") == "fail":
        out.append(f"post-load KV check failed: {post.get('reason')}")
    return out


def _input_rows(run: _Run) -> list[tuple[str, str]]:
    """The benchmark report's pinned inputs, then what the run directory itself holds."""
    inputs = run.bench.get("inputs")
    rows = [(str(k), str(v)) for k, v in inputs.items()] if isinstance(inputs, dict) else []
    if run.fleet is not None:
        c = run.fleet.contract
        b = c.budgets
        rows.append((f"{FLEET_QUALIFIED} SHA-256", run.fleet.sha256))
        rows.append(
            (
                f"{FLEET_QUALIFIED} budgets",
                f"TTFT {b.ttft_s:g} s, TPOT {b.tpot_s:g} s, attainment {b.attainment:g}; "
                f"first-token deadline {c.engine.first_token_timeout_s:g} s",
            )
        )
    if run.check is not None:
        rows.append((f"{CHECK_REPORT} SHA-256", str(run.check_sha)))
        complete = "complete" if run.check.complete else "partial"
        rows.append((f"{CHECK_REPORT} verdict", f"{run.check.verdict} ({complete})"))
    if run.profile_sha is not None:
        rows.append((f"{PROFILE_STORE} SHA-256", run.profile_sha))
    return rows


def _gate_rows(run: _Run) -> list[tuple[str, str, str]]:
    if run.check is None:
        return []
    return [(g.name, g.verdict, g.summary) for g in run.check.gates]


# --- plots ----------------------------------------------------------------------------------


def _distribution(
    run: _Run, plot_id: str, title: str, attr: str, budget_key: str | None, unit: str, scale: float
) -> _Plot:
    series = [
        plots.Series(p.name, getattr(p, attr), p.budget(budget_key) if budget_key else None)
        for p in run.points
        if getattr(p, attr)
    ]
    budget = "its budget dashed" if budget_key else "no budget applies"
    caption = (
        f"{title}, one curve per point (the share of completed, measured requests at or below "
        f"each value; {budget}). From the client's records, "
        "benchmark/points/*/client/client_records.jsonl."
    )
    if not series:
        return _Plot(plot_id, title, caption, missing="no completed requests in the client records")
    return _Plot(
        plot_id,
        title,
        caption,
        plots.distribution_svg(plot_id, series, xlabel=f"{title} ({unit})", scale=scale),
    )


def _itl_plot(run: _Run) -> _Plot:
    plot = _distribution(run, "itl", "Inter-token latency", "itl", None, "ms", 1000.0)
    if plot.svg is None:
        return _Plot(
            plot.id,
            plot.title,
            plot.caption,
            missing="the client's records carry no per-token timing (no itl gaps): "
            "no inter-token latency to plot",
        )
    caption = (
        "Inter-token latency: the gaps between consecutive streamed chunks as the client "
        "received them (the records' itl field), pooled over each point's completed requests, "
        "one curve per point. No budget applies to a single gap; TPOT is the budgeted mean."
    )
    return _Plot(plot.id, plot.title, caption, plot.svg)


def _attainment_plot(run: _Run) -> _Plot:
    title = "Attainment per point"
    caption = (
        "Share of each point's measured requests within limits (completed with TTFT and TPOT "
        "within the point's budgets), against its attainment target (dashed)."
    )
    labels, values, targets = [], [], []
    for p in run.points:
        s = p.summary
        att, target = _num((s or {}).get("attainment")), p.budget("attainment")
        if s is None or att is None or target is None:
            continue
        labels.append(f"{p.name}\n{s.get('result', '').removesuffix(' within limits')}")
        values.append(att)
        targets.append(target)
    if not labels:
        return _Plot("attainment", title, caption, missing="no measured point has a summary")
    return _Plot(
        "attainment", title, caption, plots.attainment_svg("attainment", labels, values, targets)
    )


def _probes_plot(run: _Run) -> _Plot:
    title = "KV handoff probes: first token against the deadline"
    caption = (
        "narwhal-check's kv_transfer gate: each handoff probe's first-token latency (decode leg "
        "start to its first token, the router's deadline clock), per prefill -> decode pair, "
        "against the fleet's first-token deadline (dashed) and the gate's recommended "
        "deadline (dotted). From check-report.json."
    )
    if run.check is None:
        return _Plot("kv-probes", title, caption, missing=f"no readable {CHECK_REPORT}")
    gate = run.check.gate("kv_transfer")
    evidence = gate.evidence
    pairs = evidence.get("pairs")
    if gate.verdict == "skip" or not isinstance(pairs, dict) or not pairs:
        why = gate.skip.reason if gate.skip is not None else "no probes in its evidence"
        return _Plot("kv-probes", title, caption, missing=f"the kv_transfer gate: {why}")
    probes: dict[str, list[float]] = {}
    errors = 0
    for name, doc in pairs.items():
        values = []
        for probe in doc.get("probes", []) if isinstance(doc, dict) else []:
            first = _num(probe.get("first_token_s"))
            if first is not None:
                values.append(first)
            if probe.get("error"):
                errors += 1
        probes[str(name)] = values
    deadline = _num(evidence.get("first_token_timeout_s"))
    if deadline is None and run.fleet is not None:
        deadline = run.fleet.contract.engine.first_token_timeout_s
    if deadline is None or not any(probes.values()):
        return _Plot("kv-probes", title, caption, missing="no probe reached a first token")
    advice = evidence.get("recommendation")
    recommended = _num(advice.get("recommended_first_token_timeout_s")) if advice else None
    caption += f" Gate verdict: {gate.verdict}. {gate.summary}."
    if errors:
        caption += f" {errors} probe(s) failed and have no point here."
    return _Plot(
        "kv-probes", title, caption, plots.probes_svg("kv-probes", probes, deadline, recommended)
    )


def _journal_changes(
    records: list[dict[str, Any]],
) -> tuple[float, list[tuple[float, str, str]], float] | None:
    """(origin, [(wall time, engine, role)], end) from the journal's router.start (each sets
    every engine's role), role.flip and router.stop records; None without a router.start."""
    starts = [r for r in records if r.get("type") == "router.start"]
    if not starts or _num(starts[0].get("ts")) is None:
        return None
    origin = float(starts[0]["ts"])
    changes: list[tuple[float, str, str]] = []
    end = origin
    for r in records:
        ts = _num(r.get("ts"))
        if ts is None:
            continue
        end = max(end, ts)
        if r.get("type") == "router.start" and isinstance(r.get("engines"), dict):
            changes += [(ts, str(e), str(role)) for e, role in r["engines"].items()]
        elif r.get("type") == "role.flip" and r.get("engine") and r.get("to_role"):
            changes.append((ts, str(r["engine"]), str(r["to_role"])))
    return origin, changes, end


def _snapshot_changes(run: _Run) -> tuple[float, list[tuple[float, str, str]], float] | None:
    """The same from the points' /admin/state snapshots (before and after each point, timed by
    the point's window) and the role history they carry."""
    changes: list[tuple[float, str, str]] = []
    for p in run.points:
        window = p.doc.get("window") or {}
        directory = _point_dir(run.dir, p.doc)
        for name, key in (
            ("admin_state_before.json", "wall_start"),
            ("admin_state_after.json", "wall_end"),
        ):
            t = _num(window.get(key))
            try:
                state = json.loads((directory / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            for flip in (state.get("roles") or {}).get("history") or []:
                ft = _num(flip.get("t"))
                if ft is not None and flip.get("engine") and flip.get("to_role"):
                    changes.append((ft, str(flip["engine"]), str(flip["to_role"])))
            if t is not None:
                for e in state.get("engines") or []:
                    if e.get("id") and e.get("role"):
                        changes.append((t, str(e["id"]), str(e["role"])))
    if not changes:
        return None
    times = [c[0] for c in changes]
    return min(times), changes, max(times)


def _spans(
    origin: float, changes: list[tuple[float, str, str]], end: float
) -> list[plots.RoleSpan]:
    spans: list[plots.RoleSpan] = []
    current: dict[str, tuple[str, float]] = {}
    for ts, engine, role in sorted(changes, key=lambda c: c[0]):
        held = current.get(engine)
        if held is not None and held[0] == role:
            continue
        if held is not None:
            spans.append(plots.RoleSpan(engine, held[0], held[1] - origin, ts - origin))
        current[engine] = (role, ts)
    for engine, (role, since) in current.items():
        spans.append(plots.RoleSpan(engine, role, since - origin, max(end, since) - origin))
    return spans


def _roles_plot(run: _Run) -> _Plot:
    title = "Role timeline"
    found = _journal_changes(run.journal) if run.journal is not None else None
    source = f"{JOURNAL} (router.start, role.flip, router.stop)"
    xlabel = "seconds since the router started"
    if found is None:
        found = _snapshot_changes(run)
        source = "the points' /admin/state snapshots (benchmark/points/*/admin_state_*.json)"
        xlabel = "seconds since the first snapshot"
    caption = (
        f"Which engine held which role over time, from {source}; the benchmark points' "
        "windows shaded."
    )
    if found is None:
        why = "no role records: neither a journal with router.start nor admin state snapshots"
        return _Plot("roles", title, caption, missing=why)
    origin, changes, end = found
    windows: list[tuple[str, float, float]] = []
    for p in run.points:
        w = p.doc.get("window") or {}
        start, stop = _num(w.get("wall_start")), _num(w.get("wall_end"))
        if start is not None and stop is not None:
            windows.append((p.name, start - origin, stop - origin))
            end = max(end, stop)
    if run.journal is not None:
        flips = sum(1 for r in run.journal if r.get("type") == "role.flip")
        caption += f" {flips} role flip(s) journaled."
    svg = plots.roles_svg("roles", _spans(origin, changes, end), windows, xlabel=xlabel)
    return _Plot("roles", title, caption, svg)


def _plots(run: _Run) -> list[_Plot]:
    return [
        _distribution(run, "ttft", "Time to first token", "ttft", "ttft_s", "s", 1.0),
        _distribution(run, "tpot", "Time per output token", "tpot", "tpot_s", "ms", 1000.0),
        _itl_plot(run),
        _attainment_plot(run),
        _probes_plot(run),
        _roles_plot(run),
    ]


# --- the page and the Markdown --------------------------------------------------------------

_CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 70rem; color: #222;
       padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; }
.meta { color: #666; margin-top: 0; }
.verdict { font-size: 1.2rem; padding: 0.4rem 0.8rem; border-radius: 4px; display: inline-block; }
.verdict.pass { background: #e3f3e6; color: #1e6b30; }
.verdict.fail { background: #f8e1e1; color: #8a1f1f; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.sha { font-family: ui-monospace, monospace; font-size: 0.85rem; word-break: break-all; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(32rem, 1fr)); gap: 1rem; }
figure.plot { margin: 0; border: 1px solid #ddd; border-radius: 4px; padding: 0.5rem; }
figure.plot svg { width: 100%; height: auto; }
figcaption { font-size: 0.85rem; color: #444; }
figcaption b { color: #222; }
p.missing { color: #8a5a00; background: #fff6e0; padding: 0.4rem; }
ul.notes li { color: #8a5a00; }
ul.failures li { color: #8a1f1f; }
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _is_sha(cell: str) -> bool:
    return len(cell) == 64 and all(c in "0123456789abcdef" for c in cell)


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]], numeric: set[int]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in numeric else ' class="sha"' if _is_sha(cell) else ""
            cells.append(f"<td{cls}>{_esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def _md_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


@dataclass(frozen=True)
class _Page:
    title: str
    run_dir: Path
    generated: str
    overall: str
    reason: str
    failures: list[str]
    results: list[tuple[str, ...]]
    inputs: list[tuple[str, str]]
    gates: list[tuple[str, str, str]]
    plots: list[_Plot]
    notes: list[str]


def _render_html(page: _Page) -> str:
    out: list[str] = []
    add = out.append
    add("<!DOCTYPE html>")
    add('<html lang="en"><head><meta charset="utf-8">')
    add('<meta name="viewport" content="width=device-width, initial-scale=1">')
    add(f"<title>{_esc(page.title)}</title><style>{_CSS}</style></head><body>")
    add(f"<h1>{_esc(page.title)}</h1>")
    add(f'<p class="meta">Run directory {_esc(page.run_dir)}; report written {page.generated}</p>')
    verdict = "pass" if page.overall == "pass" else "fail"
    add(
        f'<p class="verdict {verdict}" id="overall">Overall: <b>{_esc(page.overall)}</b>. '
        f"{_esc(page.reason)}</p>"
    )
    if page.failures:
        add('<p class="why">The fleet did not qualify:</p><ul class="failures" id="failures">')
        add("".join(f"<li>{_esc(line)}</li>" for line in page.failures) + "</ul>")
    add('<h2 id="results">Results</h2>')
    add(_html_table(_RESULT_HEADER, page.results, numeric={1, 2, 3, 4, 5}))
    add(
        "<p>Each point excludes its warmup request. Rates and throughputs divide by the time "
        "from the first measured send to the last completion (including the drain), as in "
        "benchmark/report.md.</p>"
    )
    add('<h2 id="inputs">Pinned inputs</h2>')
    add(_html_table(("Input", "Value"), list(page.inputs), numeric=set()))
    add('<h2 id="gates">Qualification gates (narwhal-check)</h2>')
    if page.gates:
        add(_html_table(("Gate", "Verdict", "Summary"), list(page.gates), numeric=set()))
    else:
        add(f'<p class="missing">No qualification gates: no readable {CHECK_REPORT}.</p>')
    add('<h2 id="plots">Plots</h2>')
    add('<div class="plots">')
    for plot in page.plots:
        add(f'<figure class="plot" id="{plot.id}">')
        if plot.svg is not None:
            add(plot.svg)
        else:
            add(f'<p class="missing">Not plotted: {_esc(plot.missing)}.</p>')
        add(f"<figcaption><b>{_esc(plot.title)}.</b> {_esc(plot.caption)}</figcaption></figure>")
    add("</div>")
    add('<h2 id="notes">Missing inputs</h2>')
    if page.notes:
        add('<ul class="notes">' + "".join(f"<li>{_esc(n)}</li>" for n in page.notes) + "</ul>")
    else:
        add("<p>None: every input of the run directory was read.</p>")
    add("</body></html>")
    return "\n".join(out) + "\n"


def _render_md(page: _Page) -> str:
    out = [f"# {page.title}", ""]
    out += [f"Run directory {page.run_dir}; report written {page.generated}", ""]
    out += [f"Overall: **{page.overall}**. {page.reason}", ""]
    if page.failures:
        out += ["The fleet did not qualify:", ""]
        out += [f"- {line}" for line in page.failures] + [""]
    out += ["## Results", ""]
    out += _md_table(_RESULT_HEADER, page.results)
    out += ["", "## Pinned inputs", ""]
    out += _md_table(("Input", "Value"), list(page.inputs))
    out += ["", "## Qualification gates (narwhal-check)", ""]
    if page.gates:
        out += _md_table(("Gate", "Verdict", "Summary"), list(page.gates))
    else:
        out.append(f"No qualification gates: no readable {CHECK_REPORT}.")
    out += ["", "## Plots", ""]
    for plot in page.plots:
        out += [f"### {plot.title}", ""]
        if plot.svg is not None:
            out.append(f"![{plot.title}]({PLOTS_DIR}/{plot.id}.svg)")
        else:
            out.append(f"*Not plotted: {plot.missing}.*")
        out += ["", plot.caption, ""]
    out += ["## Missing inputs", ""]
    out += [f"- {n}" for n in page.notes] or ["None: every input of the run directory was read."]
    return "\n".join(out) + "\n"


def write_report(run_dir: Path, *, title: str) -> tuple[Path, Path]:
    """Reads the files above from ``run_dir``; writes ``run_dir/report.html`` and
    ``run_dir/report.md`` (its plots as ``run_dir/report-plots/*.svg``); returns both paths.

    ``ReportError`` when ``benchmark/report.json`` is missing or unreadable; any other
    missing input is a line in the report.
    """
    run_dir = Path(run_dir)
    run = _load(run_dir)
    figures = _plots(run)
    notes = run.notes + [f"plot {p.id}: {p.missing}" for p in figures if p.missing is not None]
    page = _Page(
        title=title,
        run_dir=run_dir,
        generated=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        overall=str(run.bench.get("overall", "unknown")),
        reason=str(run.bench.get("overall_reason", "")),
        failures=_failures(run) if run.bench.get("overall") != "pass" else [],
        results=_result_rows(run),
        inputs=_input_rows(run),
        gates=_gate_rows(run),
        plots=figures,
        notes=notes,
    )
    plot_dir = run_dir / PLOTS_DIR
    plot_dir.mkdir(exist_ok=True)
    for plot in figures:
        target = plot_dir / f"{plot.id}.svg"
        if plot.svg is not None:
            target.write_text(plot.svg, encoding="utf-8")
        else:
            target.unlink(missing_ok=True)
    html_path, md_path = run_dir / "report.html", run_dir / "report.md"
    html_path.write_text(_render_html(page), encoding="utf-8")
    md_path.write_text(_render_md(page), encoding="utf-8")
    return html_path, md_path
