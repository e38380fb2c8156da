"""Only a journal is taken as one: a file whose one line has no newline is a journal's first
record torn by a crash only if it begins as a record does (``journal_problem``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.journal.claim import journal_problem
from narwhal.journal.encoding import could_begin_record
from tests.unit.journal.support import OpenJournal


def _first_line(tmp_path: Path, open_journal: OpenJournal, **kwargs: object) -> bytes:
    """The first record's line as the journal writes it."""
    path = tmp_path / "written.jsonl"
    journal = open_journal(path, recover=False, **kwargs)
    journal.record("router.start", pid=1234, version="0.1.0", command="narwhal-serve --x")
    journal.close()
    return path.read_bytes().splitlines(keepends=True)[0]


@pytest.mark.parametrize("stamp", [None, {"replica": "r-1"}])
def test_a_first_record_torn_anywhere_is_a_journal(
    tmp_path: Path, open_journal: OpenJournal, stamp: dict[str, str] | None
) -> None:
    """A router killed while writing its very first record leaves a prefix of that line: the
    next router takes the file and its recovery reports the torn tail."""
    line = _first_line(tmp_path, open_journal, stamp=stamp)
    path = tmp_path / "torn.jsonl"
    for cut in range(1, len(line)):
        path.write_bytes(line[:cut])
        assert journal_problem(path) is None, line[:cut]
    path.write_bytes(line[: len(line) // 2])
    journal = open_journal(path)
    assert journal.recovery is not None and journal.recovery.torn_tail


def test_a_torn_first_record_ended_by_the_next_router_is_still_a_journal(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    """The router that took a journal whose first record was torn ends that line with a
    newline and writes on: the journal it is was refused at the router after it ("its first
    line is not JSON"), until an operator edited it (a review)."""
    line = _first_line(tmp_path, open_journal)
    path = tmp_path / "torn.jsonl"
    path.write_bytes(line[: len(line) // 2])
    second = open_journal(path)  # the second router: recovers, writes on
    second.record("router.start", pid=2, version="0.1.0", command="narwhal-serve --x")
    second.close()
    assert path.read_bytes().count(b"\n") >= 2
    assert journal_problem(path) is None
    open_journal(path).close()  # the third
    # A first line that is no record at all is still refused.
    path.write_bytes(b'{"schema":"narwhal.fleet/v1",\n"name":"x"}\n')
    assert journal_problem(path) == "its first line is not JSON"
    # Nor is a document whose first line, "{", could begin anything: no record follows it.
    path.write_bytes(b'{\n  "schema": "narwhal.fleet/v1"\n}\n')
    assert journal_problem(path) == "its first line is not JSON"


@pytest.mark.parametrize(
    "content",
    [
        # narwhal-profile's store and a fleet file, both without a final newline.
        b'{"complete":true,"created_at":"2026-12-07T19:51:40+00:00","engines":{}}',
        json.dumps({"schema": "narwhal.fleet/v1", "name": "qa2"}).encode(),
        json.dumps({"type": "router.start", "ts": 1.5}).encode(),  # not as the journal writes
        b'{"type":"something","x":1}',  # a type, and then no ts
        b'{"type":"","ts":1}',
        b"important notes, no newline",
        b"\x00" * 64,
        b"[1, 2, 3]",
    ],
    ids=["store", "fleet", "spaced", "no-ts", "empty-type", "text", "zeros", "array"],
)
def test_one_line_without_a_newline_that_no_record_begins_with_is_not_a_journal(
    tmp_path: Path, content: bytes
) -> None:
    """A store written without a final newline, given as --journal, was taken for a torn
    journal: appended to, its mode changed to 0600, its line counted as a torn tail."""
    path = tmp_path / "store.json"
    path.write_bytes(content)
    problem = journal_problem(path)
    assert problem is not None and "does not begin as a journal record does" in problem
    assert path.read_bytes() == content


def test_what_may_begin_a_record() -> None:
    assert could_begin_record(b"{")
    assert could_begin_record(b'{"type":"role.fl')
    assert could_begin_record(b'{"type":"role.flip"')
    assert could_begin_record(b'{"type":"role.flip","t')
    assert could_begin_record(b'{"type":"role.flip","ts":17')
    assert not could_begin_record(b'{"typ":')
    assert could_begin_record(b'{"type":"role.flip",')
    assert not could_begin_record(b'{"type":"role.flip","x')
    assert not could_begin_record(b' {"type":"x","ts":1')


def test_a_journal_empty_or_missing_or_with_whole_lines_is_still_judged_as_before(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.jsonl"
    assert journal_problem(path) is None
    path.write_bytes(b"")
    assert journal_problem(path) is None
    path.write_bytes(b'{"type":"router.start","ts":1.5}\n{"type":"router.st')
    assert journal_problem(path) is None
    path.write_bytes(b'{"complete":true}\n')
    assert journal_problem(path) == (
        "its first line is not a journal record (a JSON object with type and ts)"
    )
