"""Several choices' streams merged into the client's one: every chunk as one stream's."""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.serve.fanout import ChoiceSet, ChoiceStreams
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import StreamTally


def _chunk(request_id: str, created: int, text: str) -> bytes:
    return orjson.dumps(
        {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": None}],
        }
    )


def test_every_chunk_carries_the_first_chunks_id_and_created() -> None:
    """Each choice's engine stamps its own ``created`` (a second apart across a boundary):
    the client's stream is one response, with one ``id`` and one ``created``, as OpenAI's."""
    records = [RequestRecord(f"abc-{i}", 0.0, 0.0, "/v1/completions") for i in range(2)]
    choices = ChoiceSet(
        router=None,  # type: ignore[arg-type]
        request=None,  # type: ignore[arg-type]
        records=records,
        streams=[],
        tallies=[StreamTally(), StreamTally()],
    )
    merged = ChoiceStreams(choices, include_usage=False)
    seen: list[dict[str, Any]] = []
    for i, created, text in [(0, 100, "a"), (1, 101, "b"), (1, 102, "c"), (0, 103, "d")]:
        out, finished = merged._render(i, [_chunk(f"abc-{i}", created, text)])
        assert not finished
        seen.append(orjson.loads(out.removeprefix(b"data: ").strip()))
    assert {c["created"] for c in seen} == {100}
    assert {c["id"] for c in seen} == {"cmpl-abc"}
    assert [c["choices"][0]["index"] for c in seen] == [0, 1, 1, 0]
