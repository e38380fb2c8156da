"""Several choices' streams merged into the client's one: every chunk as one stream's."""

from __future__ import annotations

import asyncio
import contextlib
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


class _EndlessEvents:
    """An engine stream that always has another batch ready, counting the batches read."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.read = 0

    async def next_batch(self) -> list[bytes]:
        self.read += 1
        await asyncio.sleep(0)
        return [_chunk(self.request_id, 100, "x" * 100)]


class _EndlessStream:
    def __init__(self, request_id: str) -> None:
        self.first_events: list[bytes] = [_chunk(request_id, 100, "x")]
        self.events = _EndlessEvents(request_id)


def test_a_client_that_stops_reading_stops_the_engines_being_read() -> None:
    """``send`` waits while the client's buffer is full (uvicorn's flow control): the choices'
    engine streams must wait too, not be read on into memory (an unbounded queue held every
    choice's whole answer for a client that stopped reading)."""
    n = 4
    records = [RequestRecord(f"abc-{i}", 0.0, 0.0, "/v1/completions") for i in range(n)]
    streams = [_EndlessStream(f"abc-{i}") for i in range(n)]
    choices = ChoiceSet(
        router=None,  # type: ignore[arg-type]
        request=None,  # type: ignore[arg-type]
        records=records,
        streams=streams,  # type: ignore[arg-type]
        tallies=[StreamTally() for _ in range(n)],
    )
    merged = ChoiceStreams(choices, include_usage=False)

    async def scenario() -> int:
        client_reads = asyncio.Event()  # never set: the client stopped reading

        async def send(message: Any) -> None:
            await client_reads.wait()

        task = asyncio.ensure_future(merged.run(send, lambda: None))
        await asyncio.sleep(0.2)  # thousands of loop turns: an unbounded reader runs on
        read = sum(s.events.read for s in streams)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return read

    assert asyncio.run(scenario()) <= 2 * n
