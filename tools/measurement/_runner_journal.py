"""The router journal as evidence: the slice of it that belongs to one load point, the
reconciliation of the client's outcomes against its ``request.end`` records, and the role
state timeline from ``router.start`` and ``role.flip`` records.

The join key is the client's ``X-Request-Id`` (``<run-id>-<index>`` / ``<run-id>-warmup``), which
the router keeps as ``client_request_id`` in both request records; the router's own id (the
``X-Request-Id`` response header) is checked too when the client got one.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal.journal import journal_files
from tools.measurement._trial_stats import ClientRecord

__all__ = [
    "JournalRead",
    "Reconciliation",
    "journal_slice",
    "read_journal",
    "reconcile",
    "state_timeline",
]

# Which journal outcomes are consistent with each client outcome.
_AGREES: dict[str, set[str] | None] = {
    "ok": {"ok"},
    "short_output": {"ok"},
    "stream_error": {"stream_error", "decode_failed"},
    # The client gave up: the router saw a disconnect, unless it had just finished.
    "timeout": {"client_abort", "ok", "router_shutdown"},
    "transport_error": None,  # any: the connection broke, either side may have seen it first
    "http_error": None,  # any non-ok; checked by status below
}


@dataclass
class JournalRead:
    records: list[dict[str, Any]]
    files: list[str]
    invalid_lines: int


def read_journal(path: Path) -> JournalRead:
    """Every record of the journal, rotated files oldest first (as the router's recovery reads
    them). A torn or malformed line is counted, not fatal."""
    records: list[dict[str, Any]] = []
    invalid = 0
    files = journal_files(path)
    for file in files:
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            invalid += 1
            continue
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                invalid += 1
                continue
            if isinstance(obj, dict):
                records.append(obj)
            else:
                invalid += 1
    return JournalRead(records, [str(f) for f in files], invalid)


def journal_slice(
    records: Iterable[dict[str, Any]], run_id: str, wall_start: float, wall_end: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the run's request records plus every other record written inside the window,
    request records inside the window that are not the run's: foreign traffic)."""
    prefix = run_id + "-"
    mine: list[dict[str, Any]] = []
    foreign: list[dict[str, Any]] = []
    for rec in records:
        kind = rec.get("type")
        crid = rec.get("client_request_id")
        ts = rec.get("ts")
        inside = isinstance(ts, int | float) and wall_start <= ts <= wall_end
        if kind in ("request.start", "request.end"):
            if isinstance(crid, str) and crid.startswith(prefix):
                mine.append(rec)
            elif inside:
                foreign.append(rec)
        elif inside:
            mine.append(rec)
    return mine, foreign


@dataclass
class Reconciliation:
    passed: bool
    client_terminal: int  # client records that reached the router (all but connect_error)
    journal_ends: int
    client_by_outcome: dict[str, int]
    journal_by_outcome: dict[str, int]
    problems: list[str] = field(default_factory=list)
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "client_terminal": self.client_terminal,
            "journal_ends": self.journal_ends,
            "client_by_outcome": self.client_by_outcome,
            "journal_by_outcome": self.journal_by_outcome,
            "problems": self.problems,
            "mismatches": self.mismatches[:50],
            "mismatch_count": len(self.mismatches),
        }


def reconcile(
    client: list[ClientRecord], journal: list[dict[str, Any]], run_id: str
) -> Reconciliation:
    """Every client request that reached the router has exactly one ``request.end`` (and one
    ``request.start``) whose outcome agrees with the client's and, for completed requests,
    whose completion token count equals the client's; the journal has no request of this run
    the client did not send."""
    prefix = run_id + "-"
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    ends: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in journal:
        crid = rec.get("client_request_id")
        if not (isinstance(crid, str) and crid.startswith(prefix)):
            continue
        if rec.get("type") == "request.start":
            starts[crid].append(rec)
        elif rec.get("type") == "request.end":
            ends[crid].append(rec)
    problems: list[str] = []
    mismatches: list[dict[str, Any]] = []
    reached = [r for r in client if r.outcome != "connect_error"]
    client_ids = {r.client_request_id for r in client}

    def mismatch(rec: ClientRecord, why: str, end: dict[str, Any] | None = None) -> None:
        mismatches.append(
            {
                "client_request_id": rec.client_request_id,
                "client_outcome": rec.outcome,
                "journal_outcome": end.get("outcome") if end else None,
                "why": why,
            }
        )

    for rec in client:
        got = ends.get(rec.client_request_id, [])
        if rec.outcome == "connect_error":
            if got:
                mismatch(rec, "the client never connected but the journal has the request", got[0])
            continue
        if not got:
            mismatch(rec, "no request.end in the journal")
            continue
        if len(got) > 1:
            mismatch(rec, f"{len(got)} request.end records", got[0])
            continue
        end = got[0]
        if len(starts.get(rec.client_request_id, [])) != 1:
            mismatch(rec, f"{len(starts.get(rec.client_request_id, []))} request.start records")
        if rec.router_request_id and end.get("id") != rec.router_request_id:
            mismatch(rec, f"router id {rec.router_request_id} != journal id {end.get('id')}", end)
            continue
        allowed = _AGREES.get(rec.outcome)
        jout = end.get("outcome")
        if rec.outcome == "http_error":
            if jout == "ok" or (rec.status is not None and end.get("status") != rec.status):
                mismatch(rec, f"client HTTP {rec.status}, journal status {end.get('status')}", end)
        elif allowed is not None and jout not in allowed:
            mismatch(rec, "outcomes disagree", end)
        elif rec.outcome in ("ok", "short_output") and (
            end.get("completion_tokens") != rec.output_tokens
        ):
            mismatch(
                rec,
                f"completion tokens: client {rec.output_tokens}, "
                f"journal {end.get('completion_tokens')}",
                end,
            )
    unknown = sorted(set(ends) - client_ids)
    if unknown:
        problems.append(
            f"{len(unknown)} request.end record(s) of this run the client has no record of "
            f"(first: {unknown[0]})"
        )
    journal_ends = sum(len(v) for v in ends.values())
    if journal_ends != len(reached):
        problems.append(
            f"counts differ: {len(reached)} client requests reached the router, the journal "
            f"ended {journal_ends}"
        )
    if mismatches:
        problems.append(f"{len(mismatches)} request(s) disagree (see mismatches)")
    return Reconciliation(
        passed=not problems,
        client_terminal=len(reached),
        journal_ends=journal_ends,
        client_by_outcome=dict(sorted(Counter(r.outcome for r in client).items())),
        journal_by_outcome=dict(
            sorted(Counter(str(e.get("outcome")) for v in ends.values() for e in v).items())
        ),
        problems=problems,
        mismatches=mismatches,
    )


def _flip_fields(rec: dict[str, Any]) -> dict[str, Any]:
    # role.flip's fields are the role controller's; accept the obvious spellings.
    def pick(*names: str) -> Any:
        for name in names:
            if name in rec:
                return rec[name]
        return None

    return {
        "ts": rec.get("ts"),
        "engine": pick("engine", "engine_id"),
        "from": pick("from_role", "from", "old_role"),
        "to": pick("to_role", "to", "new_role"),
        "generation": pick("generation", "role_generation"),
        "reason": pick("reason"),
        "forced": pick("forced"),
    }


def state_timeline(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Role states over time: each ``router.start`` (its initial roles), ``role.flip`` and
    ``role.pin`` (operator pinning), with the whole role map after it."""
    timeline: list[dict[str, Any]] = []
    roles: dict[str, str] = {}
    for rec in records:
        kind = rec.get("type")
        if kind == "router.start":
            engines = rec.get("engines")
            roles = dict(engines) if isinstance(engines, dict) else {}
            timeline.append(
                {
                    "ts": rec.get("ts"),
                    "event": "router.start",
                    "pid": rec.get("pid"),
                    "roles": dict(roles),
                }
            )
        elif kind == "role.flip":
            flip = _flip_fields(rec)
            if isinstance(flip["engine"], str) and isinstance(flip["to"], str):
                roles[flip["engine"]] = flip["to"]
            timeline.append({**flip, "event": "role.flip", "roles": dict(roles)})
        elif kind == "role.pin":
            timeline.append(
                {
                    "ts": rec.get("ts"),
                    "event": "role.pin",
                    "pinned": rec.get("pinned"),
                    "roles": dict(roles),
                }
            )
    return timeline
