"""A decode stream the engine cut after the answer's finish reason, before its usage chunk and
[DONE]: a whole answer when that finish reason says the answer ended (stop, length, tool
calls), ended as the engine would have; never after "abort" (vLLM's answer its engine gave up
on), nor after a malformed event. No success on the engine either way."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from narwhal.engines.transport import EngineTransportError
from narwhal.serve.errors import UpstreamFailed
from narwhal.serve.fanout import ChoiceSet
from narwhal.serve.migration import Migrator
from narwhal.serve.pd import PDRouter
from narwhal.serve.record import RequestRecord
from narwhal.serve.relay import EventRenderer, StreamTally, aggregate


def _chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return orjson.dumps({"id": "cmpl-1", "created": 5, "model": "m", "choices": [choice]})


def _relayed(finish: str, error: Exception | None) -> tuple[bytes, StreamTally]:
    tally = StreamTally()
    renderer = EventRenderer(tally, include_usage=True, prefill_prompt_tokens=3)
    out = renderer.render([_chunk("a"), _chunk("b", finish)])
    return out + renderer.ended(error), tally


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls"])
def test_a_stream_cut_after_a_whole_answers_finish_ends_without_an_error(finish: str) -> None:
    out, tally = _relayed(finish, EngineTransportError("connection reset", public="cut"))
    assert out.endswith(b"data: [DONE]\n\n") and b'"error"' not in out
    assert tally.done and tally.cut
    # No ids kept (no migration trace): the usage is not known, so none is made up.
    assert b'"usage"' not in out


@pytest.mark.parametrize(
    ("finish", "error"),
    [
        ("abort", EngineTransportError("connection reset", public="cut")),
        ("abort", None),
        ("length", ValueError("not an SSE event")),
    ],
)
def test_an_aborted_answer_or_a_malformed_end_is_still_a_broken_stream(
    finish: str, error: Exception | None
) -> None:
    out, tally = _relayed(finish, error)
    assert b'"error"' in out and out.endswith(b"data: [DONE]\n\n")
    assert not tally.cut


class _Events:
    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = batches

    async def next_batch(self) -> list[bytes]:
        return self.batches.pop(0) if self.batches else []


def _aggregated(finish: str) -> tuple[dict[str, Any], StreamTally]:
    stream = SimpleNamespace(
        first_events=[_chunk("a")],
        events=_Events([[_chunk("b", finish)]]),  # then closed, no usage, no [DONE]
        prefill_prompt_tokens=3,
    )
    record = RequestRecord(id="r", arrival=0.0, arrival_mono=0.0, endpoint="/v1/completions")
    tally = StreamTally()
    migrator = Migrator(None, None, record, stream, None)  # type: ignore[arg-type]
    return asyncio.run(aggregate(migrator, False, tally, None, {})), tally


def test_an_unstreamed_answer_cut_after_its_finish_is_whole_but_not_after_abort() -> None:
    answer, tally = _aggregated("stop")
    assert answer["choices"][0]["text"] == "ab" and answer["choices"][0]["finish_reason"] == "stop"
    assert tally.cut
    with pytest.raises(UpstreamFailed):
        _aggregated("abort")


def test_a_cut_answer_is_no_success_on_its_engine() -> None:
    seen: dict[str, Any] = {}
    lifecycle = SimpleNamespace(finished=lambda ticket, **kw: seen.update(kw))
    router = SimpleNamespace(lifecycle=lifecycle)
    record = SimpleNamespace(prompt_tokens=None, completion_tokens=5, outcome="ok")
    for cut, answered in ((True, False), (False, True)):
        ticket = SimpleNamespace(phase="streaming", prompt_tokens=None)
        stream = SimpleNamespace(ticket=ticket, broke=False, cut=cut, completion_offset=0)
        PDRouter.finish(router, stream, record)  # type: ignore[arg-type]
        assert seen["answered"] is answered and seen["complete"] is True


def test_several_choices_count_no_completion_when_one_choice_has_no_count() -> None:
    # A partial sum undercounts the answer, and a TPOT from it reads twice as slow.
    choices = SimpleNamespace(
        tallies=[StreamTally(completion_tokens=21, done=True), StreamTally(done=True)]
    )
    assert ChoiceSet.merged_tally(choices).completion_tokens is None  # type: ignore[arg-type]
    choices.tallies[1].completion_tokens = 21
    assert ChoiceSet.merged_tally(choices).completion_tokens == 42  # type: ignore[arg-type]
