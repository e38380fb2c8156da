"""The ``Journal`` API: records round-trip, exactly one end per request, close, configuration,
use from the event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import orjson
import pytest

from narwhal import __version__
from narwhal.journal import Journal
from tests.unit.journal.support import FakeWallClock, OpenJournal, ends_per_id, mode, records


def test_records_round_trip_one_json_object_per_line(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "state" / "journal" / "router.jsonl"
    clock = FakeWallClock()
    j = open_journal(path, wall_clock=clock)
    assert j.router_start(fleet_sha256="f" * 64, profile_sha256="p" * 64, listen="127.0.0.1:8000")
    assert j.request_start("r1", 12.5, model="kimi", stream=True)
    assert j.role_flip(engine="e1", old="prefill", new="decode", generation=3)
    assert j.request_end(
        "r1",
        "ok",
        status=200,
        prompt_tokens=333,
        completion_tokens=16,
        prefill_engine="e0",
        decode_engine="e1",
        role_generation=3,
        t_prefill_start=12.6,
        t_first_token=12.9,
        error=None,
        attempts=1,
    )
    assert j.record("custom.event", detail={"nested": [1, 2]})
    assert j.router_stop(reason="sigterm")
    assert j.close()

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # every record ends its line
    recs = [orjson.loads(line) for line in lines[:-1]]
    assert [r["type"] for r in recs] == [
        "router.start",
        "request.start",
        "role.flip",
        "request.end",
        "custom.event",
        "router.stop",
    ]
    # ts from the injected clock, one tick per record, in file order
    assert [r["ts"] for r in recs] == [1_700_000_001.0 + i for i in range(6)]
    start, req, flip, end, custom, stop = recs
    assert start["pid"] == os.getpid()
    assert start["version"] == __version__
    assert start["fleet_sha256"] == "f" * 64
    assert start["profile_sha256"] == "p" * 64
    assert start["journal"] == str(path)
    assert start["listen"] == "127.0.0.1:8000"
    assert "recovery" in start  # Journal.open recovers by default: the summary is recorded
    assert req == {
        "type": "request.start",
        "ts": 1_700_000_002.0,
        "id": "r1",
        "arrival": 12.5,
        "model": "kimi",
        "stream": True,
    }
    assert flip["engine"] == "e1" and flip["new"] == "decode"
    assert end["id"] == "r1" and end["outcome"] == "ok" and end["status"] == 200
    assert end["arrival"] == 12.5  # filled in from the start
    assert end["prompt_tokens"] == 333 and end["decode_engine"] == "e1"
    assert end["error"] is None and end["attempts"] == 1
    assert custom["detail"] == {"nested": [1, 2]}
    assert stop["reason"] == "sigterm" and stop["open_requests"] == 0

    assert j.records_written == 6 and j.dropped == 0 and j.write_errors == 0
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700


def test_exactly_one_end_per_request(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    assert j.request_start("a", 1.0)
    assert j.request_start("b", 2.0)
    assert not j.request_start("a", 3.0)  # already open: refused, nothing written
    assert j.open_requests() == ["a", "b"]
    assert j.request_end("a", "ok")
    assert not j.request_end("a", "ok")  # double end
    assert not j.request_end("never-started", "ok")
    assert j.open_requests() == ["b"]
    assert j.request_end("b", "error", error="boom")
    assert j.open_requests() == []
    assert j.request_start("a", 4.0)  # an id may be reused once its request has ended
    j.close()
    recs = records(path)
    assert [(r["type"], r["id"]) for r in recs] == [
        ("request.start", "a"),
        ("request.start", "b"),
        ("request.end", "a"),
        ("request.end", "b"),
        ("request.start", "a"),
    ]
    stats = j.stats()
    assert stats.unmatched_ends == 2 and stats.duplicate_starts == 1


def test_concurrent_ends_write_exactly_one(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    ids = [f"r{i}" for i in range(2000)]
    for i, request_id in enumerate(ids):
        assert j.request_start(request_id, float(i))
    wins: list[int] = []

    def ender() -> None:
        wins.append(sum(j.request_end(request_id, "ok") for request_id in ids))

    threads = [threading.Thread(target=ender) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(wins) == len(ids)
    assert j.open_requests() == []
    assert j.close()
    assert set(ends_per_id(path).values()) == {1}
    assert len(ends_per_id(path)) == len(ids)


def test_close_is_idempotent_and_refuses_later_records(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    j.request_start("a", 1.0)
    assert j.close()
    assert j.close()
    assert j.closed and not j.accepting
    assert not j.request_start("b", 2.0)
    assert not j.record("x")
    assert j.request_end("a", "ok")  # closed in memory, record dropped and counted
    assert j.dropped == 3
    assert [r["id"] for r in records(path)] == ["a"]
    assert j.flush()


def test_invalid_configuration(tmp_path: Path) -> None:
    for kwargs in (
        {"on_error": "ignore"},
        {"backups": 0},
        {"max_queue": 1},
        {"max_bytes": -1},
        {"fsync_interval_s": -1.0},
    ):
        with pytest.raises(ValueError):
            Journal.open(tmp_path / "j.jsonl", **kwargs)


async def test_usable_from_the_event_loop(tmp_path: Path) -> None:
    """The router's pattern: record on the loop, flush and close in a thread."""
    path = tmp_path / "j.jsonl"
    j = await asyncio.to_thread(Journal.open, path)
    j.router_start()
    assert j.request_start("r1", 1.0)
    await asyncio.sleep(0)
    assert j.request_end("r1", "ok")
    j.router_stop()
    assert await asyncio.to_thread(j.flush)
    assert await asyncio.to_thread(j.close)
    assert [r["type"] for r in records(path)] == [
        "router.start",
        "request.start",
        "request.end",
        "router.stop",
    ]
