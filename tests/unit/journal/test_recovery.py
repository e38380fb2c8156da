"""Recovery: reading a journal back, closing each request left open exactly once."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from narwhal.journal import OUTCOME_ROUTER_RESTART, Journal, recover
from tests.unit.journal.support import OpenJournal, ends_per_id, records


def test_recover_missing_journal(tmp_path: Path) -> None:
    result = recover(tmp_path / "none.jsonl")
    assert result.files == [] and result.records_read == 0
    assert result.open_requests == {} and result.clean_shutdown is None
    assert not result.torn_tail


def test_recovery_closes_each_open_request_once(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    first = Journal.open(path)
    first.router_start(fleet_sha256="f" * 64)
    for i, request_id in enumerate(["a", "b", "c"]):
        first.request_start(
            request_id, 100.0 + i, endpoint="/v1/completions", client_request_id=f"x-{i}"
        )
    first.request_end("b", "ok")
    # A crash: no router.stop, and the process died in the middle of the next record.
    assert first.close()
    with open(path, "ab") as f:
        f.write(b'{"type":"request.start","ts":1.0,"id":"d","arri')

    second = open_journal(path)
    result = second.recovery
    assert result is not None
    assert result.open_ids == ["a", "c"]
    assert result.open_requests["a"]["arrival"] == 100.0
    assert result.records_read == 5
    assert result.torn_tail and result.invalid_line_count == 1
    assert result.invalid_lines[0].torn and result.invalid_lines[0].lineno == 6
    assert result.clean_shutdown is False
    assert result.previous_start is not None and result.previous_start["pid"] == os.getpid()
    assert second.open_requests() == []  # recovered ids are closed, not adopted
    second.router_start(fleet_sha256="f" * 64)
    second.router_stop()
    assert second.close()

    lines = path.read_bytes().splitlines()
    assert lines[5].startswith(b'{"type":"request.start","ts":1.0,"id":"d"')
    recs = [orjson.loads(line) for i, line in enumerate(lines) if i != 5]
    restart_ends = [r for r in recs if r.get("outcome") == OUTCOME_ROUTER_RESTART]
    assert [(r["id"], r["arrival"]) for r in restart_ends] == [("a", 100.0), ("c", 102.0)]
    assert all(r["previous_pid"] == os.getpid() for r in restart_ends)
    # The fields every request.end carries (docs/router.md), from the request's start where it
    # said them: a QA pass found them missing.
    assert [(r["endpoint"], r["client_request_id"]) for r in restart_ends] == [
        ("/v1/completions", "x-0"),
        ("/v1/completions", "x-2"),
    ]
    assert all(r["status"] is None and r["attempts"] == [] for r in restart_ends)
    # the closing ends come before the new process's router.start, which records the recovery
    types = [r["type"] for r in recs]
    new_start = types.index("router.start", 1)
    assert types[new_start - 2 : new_start] == ["request.end", "request.end"]
    summary = recs[new_start]["recovery"]
    assert summary["closed_requests"] == 2 and summary["torn_tail"] is True
    assert summary["previous_clean_shutdown"] is False
    assert ends_per_id_lines(recs) == {"a": 1, "b": 1, "c": 1}

    # Recovering again finds nothing open and writes nothing.
    size = path.stat().st_size
    third = open_journal(path)
    assert third.recovery is not None
    assert third.recovery.open_requests == {}
    assert third.recovery.clean_shutdown is True
    assert not third.recovery.torn_tail  # the fragment is no longer the last line
    assert third.recovery.invalid_line_count == 1
    assert third.close()
    assert path.stat().st_size == size


def ends_per_id_lines(recs: list[dict[str, Any]]) -> dict[str, int]:
    return dict(Counter(r["id"] for r in recs if r["type"] == "request.end"))


def test_close_recovered_twice_does_not_double_close(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "j.jsonl"
    first = open_journal(path, recover=False)
    first.request_start("a", 1.0)
    first.request_start("b", 2.0)
    first.close()
    result = recover(path)
    second = open_journal(path, recover=False)
    assert second.close_recovered(result) == 2
    assert second.close_recovered(result) == 0
    assert second.close_recovered(recover(path)) == 0  # ends may still be queued
    second.close()
    assert ends_per_id(path) == {"a": 1, "b": 1}
    assert recover(path).open_requests == {}


def test_recovery_skips_garbage_lines(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_bytes(
        b'{"type":"request.start","id":"a","arrival":1}\n'
        b"not json\n"
        b"[1, 2]\n"
        b"\n"
        b'{"type":"request.end","id":["odd"]}\n'
        b'{"type":"request.end","id":"zzz"}\n'
    )
    result = recover(path)
    assert result.records_read == 3
    assert result.invalid_line_count == 2
    assert [line.lineno for line in result.invalid_lines] == [2, 3]
    assert not any(line.torn for line in result.invalid_lines)
    assert result.open_ids == ["a"]
    assert result.unmatched_ends == 2


def test_recovery_spans_rotated_files(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    first = open_journal(path, max_bytes=1000, backups=3, recover=False)
    first.request_start("old", 1.0)
    first.request_start("ended", 2.0)
    seq = 0
    while first.stats().rotations < 1:
        first.record("filler", seq=seq, pad="x" * 40)
        assert first.flush()
        seq += 1
    first.request_end("ended", "ok")
    first.close()
    assert b'"id":"old"' in (tmp_path / "j.jsonl.1").read_bytes()
    assert b'"id":"old"' not in path.read_bytes()

    second = open_journal(path, max_bytes=1000, backups=3)
    assert second.recovery is not None
    assert second.recovery.open_ids == ["old"]
    assert [f.name for f in second.recovery.files] == ["j.jsonl.1", "j.jsonl"]
    second.close()
    assert ends_per_id(path) == {"old": 1, "ended": 1}
    assert [r["outcome"] for r in records(path) if r["type"] == "request.end"][-1] == (
        OUTCOME_ROUTER_RESTART
    )
