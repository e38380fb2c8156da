"""Request migration's pure parts: what a stream's trace keeps, the continuation request it
builds, the rewriting of the continuation's chunks into the client's, and which requests are
not migrated (serve.migration)."""

from __future__ import annotations

from typing import Any

import orjson

from narwhal.contract import Migration
from narwhal.engines.lax import lax_bool
from narwhal.engines.legs import decode_leg_body
from narwhal.serve.migration import MigrationTrace, continuation_request, new_trace
from narwhal.serve.relay import EventRenderer, StreamTally
from narwhal.serve.token_ids import cut_prompt_ids
from narwhal.serve.validation import parse_client_request

MAX_MODEL_LEN = 1000


def _request(body: dict[str, Any], chat: bool = False):
    return parse_client_request(orjson.dumps(body), chat, "m", MAX_MODEL_LEN)


def _trace(body: dict[str, Any], chat: bool = False, **settings: Any) -> MigrationTrace:
    trace = new_trace(_request(body, chat), Migration(**settings), MAX_MODEL_LEN)
    assert trace is not None
    return trace


def _chat_chunk(content: str, ids: list[int], **more: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": content}, "token_ids": ids, **more}
    return {
        "id": "chatcmpl-a",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [choice],
    }


def test_a_stream_is_traced_and_continued_from_its_token_ids() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 0,
        "seed": 3,
        "stop": ["x"],
        "min_tokens": 4,
        "top_k": 5,
    }
    trace = _trace(body, chat=True)
    first = _chat_chunk("", [], prompt_token_ids=[1, 2, 3])
    first["prompt_token_ids"] = [1, 2, 3]
    trace.observe(first)
    trace.observe(_chat_chunk("a b", [10, 11]))
    assert trace.blocked(token_events=1) is None
    cont = continuation_request(_request(body, chat=True), trace)
    assert not cont.chat and cont.stream
    assert cont.body["prompt"] == [1, 2, 3, 10, 11]
    assert cont.body["max_tokens"] == 8 and cont.max_tokens == 8
    assert cont.body["min_tokens"] == 2
    assert cont.body["return_token_ids"] is True
    assert cont.body["stream_options"] == {"include_usage": True}
    for name in ("temperature", "seed", "stop", "top_k", "model"):
        assert cont.body[name] == body[name]
    assert "messages" not in cont.body and "max_completion_tokens" not in cont.body
    assert cont.prompt_tokens_exact == 5
    # Usage in every chunk (vLLM's continuous_usage_stats, only with include_usage) goes on
    # past the splice when the client asked for it.
    for options, continuous in (
        ({"include_usage": True, "continuous_usage_stats": True}, True),
        ({"include_usage": "true", "continuous_usage_stats": "true"}, True),
        ({"include_usage": False, "continuous_usage_stats": True}, False),
        ({"include_usage": "false", "continuous_usage_stats": True}, False),
        ({"include_usage": True}, False),
    ):
        streamed = {**body, "stream": True, "stream_options": options}
        cont = continuation_request(_request(streamed, chat=True), trace)
        assert cont.body["stream_options"] == (
            {"include_usage": True, "continuous_usage_stats": True}
            if continuous
            else {"include_usage": True}
        ), options
        # The first decode leg's options alike: "false" is no request for usage, so none in
        # every chunk (Python's truth read it as one).
        leg = decode_leg_body(streamed, None)["stream_options"]
        assert lax_bool(leg.get("continuous_usage_stats", False)) is continuous, options


def test_continuation_chunks_become_the_clients() -> None:
    trace = _trace({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, chat=True)
    first = _chat_chunk("", [])
    first["prompt_token_ids"] = [1, 2]
    trace.observe(first)
    trace.observe(_chat_chunk("a", [10]))
    trace.begin()
    piece = {
        "id": "cmpl-z",
        "object": "text_completion",
        "created": 9,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": " b",
                "token_ids": [11],
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
                "prompt_token_ids": [1, 2, 10],
            }
        ],
    }
    out = trace.translate(piece)
    assert out["id"] == "chatcmpl-a" and out["object"] == "chat.completion.chunk"
    assert out["created"] == 7
    (choice,) = out["choices"]
    assert choice["delta"] == {"content": " b"} and choice["finish_reason"] == "stop"
    assert choice["token_ids"] is None  # the client did not ask for them
    assert trace.generated == [10, 11] and trace.finished
    usage = trace.translate(
        {
            "id": "cmpl-z",
            "object": "text_completion",
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 1,
                "total_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 3},
            },
        }
    )["usage"]
    # The client's prompt, and every token it received; not the continuation's cache detail.
    assert usage == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_completions_logprobs_offsets_continue_where_the_text_stopped() -> None:
    trace = _trace({"model": "m", "prompt": [1, 2], "max_tokens": 5, "logprobs": 1})
    trace.observe(
        {
            "id": "cmpl-a",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "abc", "token_ids": [5], "prompt_token_ids": [1, 2]}],
        }
    )
    trace.begin()
    out = trace.translate(
        {
            "id": "cmpl-b",
            "choices": [
                {"index": 0, "text": "de", "token_ids": [6], "logprobs": {"text_offset": [0]}}
            ],
        }
    )
    assert out["choices"][0]["logprobs"]["text_offset"] == [3]
    assert out["id"] == "cmpl-a"
    # The engine's offsets run on through the continuation's own text (from 0 at its start):
    # shifted by what the client had at the splice, not by what it has now.
    out = trace.translate(
        {
            "id": "cmpl-b",
            "choices": [
                {
                    "index": 0,
                    "text": "fgh",
                    "token_ids": [7, 8],
                    "logprobs": {"text_offset": [2, 3]},
                }
            ],
        }
    )
    assert out["choices"][0]["logprobs"]["text_offset"] == [5, 6]
    # A second migration: its offsets from 0 again, after everything the client had.
    trace.begin()
    out = trace.translate(
        {"id": "cmpl-c", "choices": [{"index": 0, "text": "i", "logprobs": {"text_offset": [0]}}]}
    )
    assert out["choices"][0]["logprobs"]["text_offset"] == [8]


def test_ids_the_client_did_not_ask_for_are_blanked_as_vllm_sends_them() -> None:
    trace = _trace({"model": "m", "prompt": [1], "max_tokens": 5})
    payload = b'{"choices":[{"index":0,"text":"a","token_ids":[5, 6],"prompt_token_ids":[1]}]}'
    stripped = b'{"choices":[{"index":0,"text":"a","token_ids":null,"prompt_token_ids":null}]}'
    assert trace.strip(payload) == stripped
    asked = _trace({"model": "m", "prompt": [1], "max_tokens": 5, "return_token_ids": True})
    assert asked.strip(payload) == payload
    usual = b'{"choices":[{"index":0,"text":"b","token_ids":[7,8],"prompt_token_ids":null}]}'
    assert trace.strip(usual) == (
        b'{"choices":[{"index":0,"text":"b","token_ids":null,"prompt_token_ids":null}]}'
    )
    # Text that spells the field is escaped inside its string: never touched.
    text = b'{"choices":[{"text":"\\"token_ids\\":[1]","token_ids":null}]}'
    assert trace.strip(text) == text
    spelt = b'{"choices":[{"text":"\\"token_ids\\":[1]","token_ids":[9, 10],"x":1}]}'
    assert trace.strip(spelt) == (
        b'{"choices":[{"text":"\\"token_ids\\":[1]","token_ids":null,"x":1}]}'
    )


def test_after_the_first_chunk_ids_are_kept_as_written_and_parsed_when_asked() -> None:
    """The relay cuts each chunk's ids out of its bytes before the parse (``EventRenderer``):
    kept as the engine wrote them, parsed when a migration asks, null for a client that did not
    ask for them. Text that spells the key is escaped inside its string: never touched."""
    cut = b'{"id":"c","choices":[{"index":0,"text":"a","token_ids":[5],"prompt_token_ids":null}]}'
    whole = cut.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[1]')
    spelt = b'{"choices":[{"text":"\\"token_ids\\":[1]","token_ids":[6,7],"x":1}]}'
    bare = b'{"choices":[{"text":"","token_ids":[],"finish_reason":"length"}]}'
    usage = b'{"choices":[],"usage":{"completion_tokens":3}}'  # no ids: as it is
    for asked in (False, True):
        body = {"model": "m", "prompt": [1], "max_tokens": 5}
        trace = _trace({**body, "return_token_ids": True} if asked else body)
        if not asked:  # the decode leg cut the prompt's ids out of the first chunk
            trace.keep_prompt_ids(b"1")
        renderer = EventRenderer(StreamTally(), False, 1, trace)
        sent = renderer.render([whole if asked else cut]) + renderer.render([spelt, bare, usage])
        events = [event[6:] for event in sent.split(b"\n\n") if event]
        if asked:
            assert events == [whole, spelt, bare]
        else:
            assert events == [
                cut.replace(b"[5]", b"null"),
                b'{"choices":[{"text":"\\"token_ids\\":[1]","token_ids":null,"x":1}]}',
                b'{"choices":[{"text":"","token_ids":null,"finish_reason":"length"}]}',
            ]
        assert trace.prompt_ids == [1] and trace.head is not None
        assert trace.generated == [5, 6, 7] and trace.remaining() == 2
        # What the relay's tally saw of those chunks decides: a finish or a reasoning delta.
        assert trace.blocked(2) is None
        assert trace.blocked(2, finished=True) == "the answer was complete"
        assert trace.blocked(2, non_text=True) == "the engine sent reasoning or tool-call deltas"
        assert renderer.tally.finish_reason == "length"


def test_a_collected_stream_keeps_only_the_ids_after_its_first_chunk() -> None:
    trace = _trace({"model": "m", "prompt": [1], "max_tokens": 5})
    trace.note({"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2]}]})
    trace.note({"id": "c", "choices": [{"index": 0, "text": "b", "token_ids": [8, 9]}]})
    trace.note({"id": "c", "choices": [{"index": 0, "text": "", "token_ids": []}]})
    assert trace.prompt_ids == [1, 2] and trace.generated == [8, 9]
    assert trace.blocked(2) is None


def test_completions_with_logprobs_are_observed_the_whole_way() -> None:
    """Their text offsets continue across a migration: every chunk is parsed and observed."""
    trace = _trace({"model": "m", "prompt": [1], "max_tokens": 5, "logprobs": 1})
    first = b'{"id":"c","choices":[{"index":0,"text":"ab","token_ids":[5],"prompt_token_ids":[1]}]}'
    trace.take(first, orjson.loads(first))
    usual = b'{"choices":[{"index":0,"text":"cde","token_ids":[6]}]}'
    assert trace.take(usual, orjson.loads(usual)) == (
        b'{"choices":[{"index":0,"text":"cde","token_ids":null}]}'
    )
    assert trace.generated == [5, 6] and trace.text_chars == 5 and trace.prompt_ids == [1]


def test_what_cannot_be_continued_exactly_is_not_migrated() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    settings = Migration()
    assert new_trace(_request({**chat, "tools": [tool]}, True), settings, MAX_MODEL_LEN) is None
    none_chosen = {**chat, "tools": [tool], "tool_choice": "none"}
    assert new_trace(_request(none_chosen, True), settings, MAX_MODEL_LEN) is not None
    assert new_trace(_request({**chat, "logprobs": True}, True), settings, MAX_MODEL_LEN) is None
    fmt = {**chat, "response_format": {"type": "json_object"}}
    assert new_trace(_request(fmt, True), settings, MAX_MODEL_LEN) is None
    assert new_trace(_request({**chat, "n": 2}, True), settings, MAX_MODEL_LEN) is None
    assert new_trace(_request(chat, True), Migration(limit=0), MAX_MODEL_LEN) is None


def test_a_trace_says_why_it_cannot_continue() -> None:
    trace = _trace(
        {"model": "m", "prompt": [1, 2], "max_tokens": 4}, limit=1, max_sequence_tokens=5
    )
    assert "prompt's token ids" in (trace.blocked(0) or "")
    trace.observe(
        {
            "id": "c",
            "choices": [{"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2]}],
        }
    )
    assert trace.blocked(1) is None
    trace.observe({"id": "c", "choices": [{"index": 0, "text": "b", "token_ids": [8, 9]}]})
    assert "bound" in (trace.blocked(2) or "")  # 2 + 3 tokens reach max_sequence_tokens
    trace = _trace({"model": "m", "prompt": [1, 2], "max_tokens": 4}, limit=1)
    trace.observe(
        {
            "id": "c",
            "choices": [{"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2]}],
        }
    )
    trace.begin()
    assert "limit" in (trace.blocked(1) or "")
    reasoning = _trace({"model": "m", "messages": [{"role": "user", "content": "x"}]}, chat=True)
    reasoning.observe(
        {
            "id": "c",
            "prompt_token_ids": [1],
            "choices": [{"index": 0, "delta": {"reasoning": "hm"}, "token_ids": [4]}],
        }
    )
    assert "reasoning" in (reasoning.blocked(1) or "")
    blind = _trace({"model": "m", "prompt": [1, 2], "max_tokens": 4})
    blind.observe({"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2]}]})
    assert "generated token ids" in (blind.blocked(1) or "")
    done = _trace({"model": "m", "prompt": [1, 2], "max_tokens": 4})
    done.observe(
        {
            "id": "c",
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "token_ids": [3],
                    "prompt_token_ids": [1, 2],
                    "finish_reason": "stop",
                }
            ],
        }
    )
    assert "complete" in (done.blocked(1) or "")


def test_a_first_chunks_prompt_ids_are_cut_before_the_parse_and_parsed_when_asked() -> None:
    """The prompt's ids (thousands for a long prompt) are kept as the engine wrote them and
    left out of the healthy path's parse; a migration parses them; a client that asked for
    ids gets them as written."""
    completions = (
        b'{"id":"c","choices":[{"index":0,"text":"a","token_ids":[5],'
        b'"prompt_token_ids":[11,12,13]}]}'
    )
    chat = (
        b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
        b'{"role":"assistant","content":""},"token_ids":[]}],"prompt_token_ids":[21,22]}'
    )
    for payload, chat_route, ids in ((completions, False, [11, 12, 13]), (chat, True, [21, 22])):
        body: dict[str, Any] = {"model": "m", "max_tokens": 5}
        body |= {"messages": [{"role": "user", "content": "x"}]} if chat_route else {"prompt": [1]}
        trace = _trace(body, chat_route)
        cut, raw = cut_prompt_ids(payload)
        assert b'prompt_token_ids":null' in cut and b"21" not in cut and b"11," not in cut
        assert raw is not None
        trace.keep_prompt_ids(raw)
        obj = orjson.loads(cut)
        sent = trace.take(cut, obj)
        assert orjson.loads(sent) == orjson.loads(trace.strip(payload))
        assert trace.prompt_ids == ids
    # No list to cut (the engine left the ids out, or spelt them otherwise): unchanged.
    bare = b'{"choices":[{"index":0,"text":"a","prompt_token_ids":null}]}'
    trace = _trace({"model": "m", "prompt": [1], "max_tokens": 5})
    assert cut_prompt_ids(bare) == (bare, None)
    trace.take(bare, orjson.loads(bare))
    assert trace.prompt_ids is None
    assert trace.blocked(1) == "the engine did not return the prompt's token ids"


def _sse(*payloads: bytes) -> list[dict[str, Any]]:
    """The chunks of rendered SSE bytes, parsed ([DONE] left out)."""
    return [
        orjson.loads(line[6:])
        for line in b"".join(payloads).split(b"\n\n")
        if line.startswith(b"data: {")
    ]


def test_the_relay_keeps_each_chunks_ids_unparsed_and_blanks_them_for_the_client() -> None:
    """What the relay renders for a migratable stream, as the decode leg hands it over (the
    prompt's ids cut out of the first chunk): the client's chunks carry no ids unless it asked,
    and the trace holds every generated id, the prompt's and the head."""
    first = (
        b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
        b'"text":"a","logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":[11,12],"token_ids":[5]}],"usage":null}'
    )
    rest = [
        b'{"id":"c","choices":[{"index":0,"text":"b","token_ids":[6,7]}],"usage":null}',
        b'{"id":"c","choices":[{"index":0,"text":"","finish_reason":"length","token_ids":[]}]}',
        b'{"id":"c","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}',
        b"[DONE]",
    ]
    for asked in (False, True):
        body = {"model": "m", "prompt": [11, 12], "max_tokens": 5, "stream": True}
        trace = _trace({**body, "return_token_ids": True} if asked else body)
        cut, raw = cut_prompt_ids(first)
        assert raw is not None
        if not asked:  # the decode leg cuts the prompt's ids for a client that did not ask
            trace.keep_prompt_ids(raw)
        renderer = EventRenderer(StreamTally(), True, 2, trace)
        out = [renderer.render([first if asked else cut]), renderer.render(rest[:2])]
        out.append(renderer.render(rest[2:]))
        chunks = _sse(*out)
        assert renderer.finished and renderer.tally.token_events == 3
        ids = [c.get("token_ids") for chunk in chunks for c in chunk["choices"]]
        prompt = chunks[0]["choices"][0]["prompt_token_ids"]
        if asked:
            assert ids == [[5], [6, 7], []] and prompt == [11, 12]
        else:
            assert ids == [None, None, None] and prompt is None
        assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == "ab"
        assert trace.prompt_ids == [11, 12] and trace.generated == [5, 6, 7]
        assert trace.head == {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
        assert trace.blocked(renderer.tally.token_events, True) == "the answer was complete"


def test_ids_spelled_with_spaces_are_kept_by_a_parse_and_blanked_all_the_same() -> None:
    """An engine whose JSON is not compact (``"token_ids": [6, 7]``): the cut finds nothing,
    so the chunk is parsed instead; the trace still holds every generated id, and a client that
    did not ask still gets null (a trace short of ids would continue from the wrong token)."""
    first = b'{"id":"c","choices":[{"index":0,"text":"a","token_ids":[5]}]}'
    spaced = b'{"id": "c", "choices": [{"index": 0, "text": "b", "token_ids": [6, 7]}]}'
    for asked in (False, True):
        body = {"model": "m", "prompt": [1], "max_tokens": 5}
        trace = _trace({**body, "return_token_ids": True} if asked else body)
        trace.keep_prompt_ids(b"1")
        renderer = EventRenderer(StreamTally(), False, 1, trace)
        sent = renderer.render([first]) + renderer.render([spaced])
        events = [orjson.loads(event[6:]) for event in sent.split(b"\n\n") if event]
        ids = [c["token_ids"] for e in events for c in e["choices"]]
        assert ids == ([[5], [6, 7]] if asked else [None, None])
        assert "".join(c["text"] for e in events for c in e["choices"]) == "ab"
        assert trace.generated == [5, 6, 7] and trace.remaining() == 2


def test_held_back_text_is_taken_only_from_a_decoding_that_begins_as_the_client_received() -> None:
    """With stop strings the engine held back text whose ids went out; the router recovers it
    from a detokenized text, but only one that begins with exactly what the client received
    (a tokenizer that decodes the ids alone without their leading space would shift it)."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "stop": ["@@@@"],  # 3 characters held back
    }
    trace = _trace(body, chat=True)
    assert trace.holdback == 3 and trace.observes_text
    trace.observe(_chat_chunk(" Hel", [1, 2]))
    trace.observe(_chat_chunk("lo w", [3, 4]))  # the client has " Hello w"
    assert trace.text_chars == 8 and trace.sent_tail == " Hello w"
    assert trace.held_back(" Hello world") == "orld"
    assert trace.held_back("Hello world") is None  # its leading space dropped: misaligned
    assert trace.held_back(" Hello") is None  # shorter than what was received
    # Without stop strings nothing is held back, and nothing is recovered.
    plain = _trace({k: v for k, v in body.items() if k != "stop"}, chat=True)
    assert plain.holdback == 0 and not plain.observes_text


def test_an_error_event_is_the_engines_fault_unless_it_refuses_the_request() -> None:
    """vLLM 0.32 refuses some fields mid-stream (logprobs past 20: a 400 error event): that
    is the request's fault, and must not count against the engine's breaker, or a client
    could open every engine's by asking for it."""
    from narwhal.serve.relay import engine_fault

    assert engine_fault({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
    assert engine_fault({"error": {"message": "boom"}})
    assert engine_fault({"error": None})
    assert not engine_fault(
        {"error": {"message": "logprobs", "type": "BadRequestError", "code": 400}}
    )
    assert not engine_fault({"error": {"message": "gone", "code": 404}})


def test_a_refusal_mid_stream_is_passed_on_and_a_server_error_continued() -> None:
    """A 4xx error event refuses the request (vLLM 0.32 sends some refusals in the stream): a
    migratable stream was continued elsewhere on it, each migration a failure on an engine
    that did no wrong, and the client got the router's 502 in the end. It is passed on as the
    engine wrote it; a server error is still continued."""
    body = {"model": "m", "prompt": [1], "max_tokens": 5}
    first = b'{"id":"c","choices":[{"index":0,"text":"a","token_ids":[5]}]}'
    refusal = b'{"error":{"message":"logprobs","type":"BadRequestError","code":400}}'

    def migratable() -> MigrationTrace:
        trace = _trace(body)
        trace.keep_prompt_ids(b"1")
        return trace

    renderer = EventRenderer(StreamTally(), False, 1, migratable())
    sent = renderer.render([first, refusal])
    assert renderer.interrupted is None and renderer.finished and not renderer.fault
    assert refusal in sent and sent.endswith(b"data: [DONE]\n\n")
    crash = b'{"error":{"message":"boom","type":"InternalServerError","code":500}}'
    renderer = EventRenderer(StreamTally(), False, 1, migratable())
    renderer.render([first, crash])
    assert renderer.interrupted == ("engine_error", "boom")
