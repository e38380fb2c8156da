"""Journal records as written: fields of any type, reserved keys, secret-named keys scrubbed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.unit.journal.support import OpenJournal, records


def test_extra_fields_of_any_type_are_written(tmp_path: Path, open_journal: OpenJournal) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    j.record("x", where=Path("/a/b"), tags={"b"}, pair=(1, 2), big=2**70, ok=1.5)
    j.close()
    (rec,) = records(path)
    assert rec["where"] == "/a/b"
    assert rec["tags"] == ["b"]
    assert rec["pair"] == [1, 2]
    assert rec["big"] == repr(2**70)  # orjson refuses it: the repr keeps the record
    assert rec["unserializable"] == ["big"]
    assert rec["ok"] == 1.5


def test_reserved_keys_and_request_types_are_refused(
    tmp_path: Path, open_journal: OpenJournal
) -> None:
    j = open_journal(tmp_path / "j.jsonl", recover=False)
    with pytest.raises(ValueError, match="reserved"):
        j.record("x", ts=1.0)
    with pytest.raises(ValueError, match="reserved"):
        j.request_start("r1", 1.0, id="other")
    with pytest.raises(ValueError, match="request_start"):
        j.record("request.end", id="r1")
    with pytest.raises(ValueError, match="request_start"):
        j.submit("request.start", {"id": "r1"})
    with pytest.raises(TypeError):
        j.request_start(17, 1.0)  # type: ignore[arg-type]
    assert j.open_requests() == []


def test_secret_fields_are_never_written(
    tmp_path: Path, open_journal: OpenJournal, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "j.jsonl"
    j = open_journal(path, recover=False)
    with caplog.at_level(logging.WARNING, logger="narwhal.journal"):
        j.request_start("r1", 1.0, prompt="SECRET-PROMPT", model="m")
        j.request_end(
            "r1",
            "ok",
            messages=[{"role": "user", "content": "SECRET-MESSAGE"}],
            headers={"Authorization": "Bearer SECRET-TOKEN", "X-Api-Key": "SECRET-KEY"},
            body={"text": "SECRET-TEXT", "max_tokens": 5, "Api-Key": "SECRET-KEY2"},
            choices=[{"content": "SECRET-CONTENT", "index": 0}],
        )
        j.request_start("r2", 2.0, prompt="SECRET-AGAIN")
    j.close()
    raw = path.read_bytes()
    assert b"SECRET" not in raw
    start1, end, start2 = records(path)
    assert start1["model"] == "m" and "prompt" not in start1
    assert end["headers"] == {}
    assert end["body"] == {"max_tokens": 5}
    assert end["choices"] == [{"index": 0}]
    assert "messages" not in end and "prompt" not in start2
    warned = [r.getMessage() for r in caplog.records if "dropped field" in r.getMessage()]
    # once per key name, not once per record
    assert sum("'prompt'" in m for m in warned) == 1
    assert any("'Authorization'" in m for m in warned)
    assert j.stats().secret_fields_dropped >= 7
