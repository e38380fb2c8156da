"""The simulated engine's OpenAI surface beyond a plain greedy request: vLLM 0.32's validation
of sampling fields, n, logprobs, tool calls and response formats, in its shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal.simengine.generation import ContextChain, GenerationModel
from narwhal.simengine.openai_surface import ChoiceState, minimal_instance
from narwhal.simengine.protocol import GenerationParams, ProtocolError, parse_generation
from narwhal.simengine.vocab import Vocabulary

VOCAB = Vocabulary()
MODEL = GenerationModel(VOCAB)
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "tags": {"type": "array"}},
                    "required": ["lat", "tags"],
                },
                "optional": {"type": "string"},
            },
            "required": ["city", "unit", "days", "where"],
        },
    },
}
WEATHER_ARGS = '{"city": "", "unit": "celsius", "days": 1, "where": {"lat": 0, "tags": []}}'
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}


def parse(body: dict[str, Any], chat: bool = True) -> GenerationParams:
    body = {"messages": MESSAGES, **body} if chat else {"prompt": "x", **body}
    return parse_generation(body, VOCAB, chat, 4096)


def error(body: dict[str, Any], chat: bool = True) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(body, chat)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("body", "chat", "message", "param"),
    [
        ({"temperature": -0.5}, True, "temperature must be non-negative, got -0.5.", "temperature"),
        ({"temperature": 2.5}, False, "temperature must be in [0, 2], got 2.5.", "temperature"),
        ({"top_p": 0}, True, "top_p must be in (0, 1], got 0.0.", "top_p"),
        ({"top_p": 1.5}, False, "top_p must be in (0, 1], got 1.5.", "top_p"),
        ({"top_k": -2}, True, "top_k must be 0 (disable), or at least 1, got -2.", None),
        ({"min_p": 1.5}, True, "min_p must be in [0, 1], got 1.5.", None),
        ({"presence_penalty": 3}, True, "presence_penalty must be in [-2, 2], got 3.0.", None),
        ({"frequency_penalty": -2.5}, False, "frequency_penalty must be in [-2, 2]", None),
        ({"repetition_penalty": 0}, True, "repetition_penalty must be greater than zero", None),
        ({"n": 0}, True, "n must be at least 1, got 0.", None),
        ({"n": 2, "temperature": 0}, True, "n must be 1 when using greedy sampling, got 2.", None),
        ({"stop": [""]}, True, "stop cannot contain an empty string.", None),
        ({"stop_token_ids": [VOCAB.size]}, True, "out-of-vocab token ids", "stop_token_ids"),
        (
            {"logit_bias": {"abc": 1, "5": 2}},
            False,
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['abc']",
            "logit_bias",
        ),
        ({"top_logprobs": 3}, True, "`logprobs` must be set to true", "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -2}, True, "positive value or -1", "top_logprobs"),
        (
            {"logprobs": True, "top_logprobs": 21},
            True,
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
            "logprobs",
        ),
        ({"logprobs": 21}, False, "greater than max allowed: 20", "logprobs"),
        ({"logprobs": -3}, False, "`logprobs` must be a positive value or -1.", "logprobs"),
        ({"logprobs": "five"}, False, "`logprobs` must be an integer.", "logprobs"),
        (
            {"response_format": {"type": "json_schema"}},
            True,
            "the 'json_schema' field must be provided",
            "response_format",
        ),
        ({"tools": []}, True, "`tools` must not be an empty array", "tools"),
        ({"tool_choice": "required"}, True, "`tools` must be set", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "any"}, True, "Invalid value for `tool_choice`", None),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            True,
            "does not match any of the specified `tools`",
            "tool_choice",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
            True,
            "Expected field `name` in `function` in `tool_choice`!",
            "tool_choice.function.name",
        ),
        ({"use_beam_search": True}, True, "not supported by the simulator", "use_beam_search"),
        ({"prompt_logprobs": 1}, False, "not supported by the simulator", "prompt_logprobs"),
        (
            {"n": 2, "kv_transfer_params": {"do_remote_decode": True}},
            False,
            "n > 1 with kv_transfer_params",
            "n",
        ),
    ],
)
def test_vllm_refuses_these(
    body: dict[str, Any], chat: bool, message: str, param: str | None
) -> None:
    err = error(body, chat)
    assert message in err.message
    assert err.type == "BadRequestError"
    if param is not None:
        assert err.param == param
    if err.param is None:
        assert "(parameter=" not in err.message


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, True, "logprobs"),
        ({"logprobs": 50}, False, "logprobs"),
        ({"logit_bias": {str(VOCAB.size + 5): 1}}, True, "logit_bias"),
        ({"stop_token_ids": [VOCAB.size]}, False, "stop_token_ids"),
    ],
)
def test_what_the_engine_refuses_a_stream_gets_in_the_stream(
    body: dict[str, Any], chat: bool, param: str
) -> None:
    # vLLM 0.32's SamplingParams.verify: a whole request's 400, a streamed request's only event.
    whole = error(body, chat)
    assert not whole.in_stream and whole.param == param
    streamed = error({**body, "stream": True}, chat)
    assert streamed.in_stream and streamed.message == whole.message
    # Every check of the HTTP layer comes first: a max_tokens past the context is a 400.
    late = error({**body, "stream": True, "max_tokens": 10**7}, chat)
    assert not late.in_stream and late.param == "max_tokens"


@pytest.mark.parametrize(
    ("body", "param", "msg"),
    [
        ({"temperature": "hot"}, "body.temperature", "unable to parse string as a number"),
        ({"temperature": [1]}, "body.temperature", "Input should be a valid number"),
        ({"seed": 1.5}, "body.seed", "fractional part"),
        ({"stop": 3}, "body.stop", "Input should be a valid string"),
        ({"stop": ["a", 1]}, "body.stop.1", "Input should be a valid string"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "body.stop", "at most 4 items"),
        ({"stop_token_ids": ["a"]}, "body.stop_token_ids.0", "valid integer"),
        ({"logprobs": 1}, "body.logprobs", "valid boolean"),
        ({"parallel_tool_calls": "yes"}, "body.parallel_tool_calls", "valid boolean"),
        ({"tools": [{"type": "function"}]}, "body.tools.0.function", "Field required"),
        ({"response_format": {"type": "xml"}}, "body.response_format.type", "Input should be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "body.response_format.json_schema.name",
            "Field required",
        ),
    ],
)
def test_type_errors_are_pydantic_shaped(body: dict[str, Any], param: str, msg: str) -> None:
    err = error(body)
    assert err.type == "Bad Request"
    assert err.param == param
    assert err.message.startswith("1 validation error:\n  {'type': ")
    assert msg in err.message


def test_valid_sampling_fields_are_accepted() -> None:
    params = parse(
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "seed": 42,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [300, 301],
            "n": 3,
            "logprobs": True,
            "top_logprobs": 5,
            "response_format": {"type": "text"},
            "tools": [WEATHER],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        }
    )
    assert params.surface.n == 3
    assert params.surface.logprobs == 5
    assert params.surface.guided is None  # auto: the simulated model answers text
    assert parse({"temperature": "0.5", "stop": "x"}).surface.n == 1  # pydantic's lax parsing
    assert parse({"logprobs": 0}, chat=False).surface.logprobs == 0
    assert parse({"logprobs": True}).surface.logprobs == 0  # top_logprobs defaults to 0
    assert parse({"logprobs": False, "top_logprobs": 0}).surface.logprobs is None
    assert parse({"tools": [WEATHER], "tool_choice": "none"}).surface.guided is None
    # Completions have no tools: vLLM ignores the fields there.
    assert parse({"tools": [WEATHER], "tool_choice": "required"}, chat=False).surface.guided is None


def test_the_plain_request_is_unchanged() -> None:
    params = parse({})
    assert params.surface.n == 1
    assert params.surface.logprobs is None
    assert params.surface.guided is None
    assert params.surface.forced is None


def test_minimal_instances() -> None:
    assert minimal_instance(None) == {}
    assert minimal_instance({}) == {}
    assert json.dumps(minimal_instance(WEATHER["function"]["parameters"])) == WEATHER_ARGS
    assert minimal_instance({"type": "array", "minItems": 2, "items": {"type": "boolean"}}) == [
        False,
        False,
    ]
    assert minimal_instance({"type": ["null", "integer"], "exclusiveMinimum": 3}) == 4
    assert minimal_instance({"type": "string", "minLength": 3}) == "aaa"
    assert minimal_instance({"const": {"a": 1}}) == {"a": 1}
    assert minimal_instance({"anyOf": [{"type": "null"}, {"type": "string"}]}) is None
    defs = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "$defs": {
            "P": {"type": "object", "properties": {"x": {"enum": [7, 8]}}, "required": ["x"]}
        },
    }
    assert minimal_instance(defs) == {"p": {"x": 7}}


def test_guided_texts() -> None:
    named = parse(
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    ).surface
    assert named.guided is not None
    assert named.guided.text == WEATHER_ARGS
    assert named.guided.tool_mode == "named"
    assert named.forced is not None and VOCAB.decode(named.forced) == WEATHER_ARGS
    required = parse({"tools": [NO_PARAMS, WEATHER], "tool_choice": "required"}).surface
    assert required.guided is not None
    assert required.guided.text == '[{"name": "ping", "parameters": {}}]'
    g = required.guided
    assert g.text[g.args_start : g.args_end] == "{}"
    assert g.text[: g.name_end] == '[{"name": "ping"'
    fmt = parse({"response_format": {"type": "json_object"}}, chat=False).surface
    assert fmt.guided is not None and fmt.guided.text == "{}"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = parse(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    ).surface
    assert fmt.guided is not None and json.loads(fmt.guided.text) == {"ok": False}


def _state(params: GenerationParams, index: int = 0) -> ChoiceState:
    return ChoiceState(index, params.chat, params.surface, VOCAB, MODEL, "chatcmpl-x")


def _keys(tokens: list[int]) -> list[bytes]:
    """The context keys ``tokens`` are generated at, after a fixed prompt."""
    chain = ContextChain(0, [1, 2, 3])
    keys = []
    for token in tokens:
        keys.append(chain.key())
        chain.append(token)
    return keys


def _run(params: GenerationParams, tokens: list[int], finish: str) -> tuple[list[Any], ChoiceState]:
    state = _state(params)
    keys = _keys(tokens)
    steps = [
        state.step(t, finish if i == len(tokens) - 1 else None, keys[i])
        for i, t in enumerate(tokens)
    ]
    return steps, state


WORDS = [VOCAB.first_word_id + i for i in (5, 77, 3000)]


def test_chat_logprobs_shape_and_stream_equals_whole() -> None:
    params = parse({"logprobs": True, "top_logprobs": 3})
    steps, _ = _run(params, WORDS, "length")
    whole = _state(params).logprobs_for(WORDS, _keys(WORDS), 0)
    assert [e for s in steps for e in s.logprobs["content"]] == whole["content"]
    first = whole["content"][0]
    assert list(first) == ["token", "logprob", "bytes", "top_logprobs"]
    assert first["token"] == VOCAB.token_text(WORDS[0])
    assert first["bytes"] == list(first["token"].encode())
    tops = first["top_logprobs"]
    assert len(tops) == 3
    assert tops[0] == {k: first[k] for k in ("token", "logprob", "bytes")}  # sampled is top-1
    values = [t["logprob"] for t in tops]
    assert values == sorted(values, reverse=True) and len(set(values)) == 3
    assert all(v < 0 for v in values)
    assert len({t["token"] for t in tops}) == 3
    # top_logprobs 0: the sampled token's logprob only.
    zero = _state(parse({"logprobs": True})).logprobs_for(WORDS, _keys(WORDS), 0)
    assert all(e["top_logprobs"] == [] for e in zero["content"])
    assert [e["logprob"] for e in zero["content"]] == [e["logprob"] for e in whole["content"]]


def test_completion_logprobs_shape_and_stream_equals_whole() -> None:
    params = parse({"logprobs": 2}, chat=False)
    steps, _ = _run(params, WORDS, "length")
    whole = _state(params).logprobs_for(WORDS, _keys(WORDS), 0)
    assert list(whole) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    texts = [VOCAB.token_text(t) for t in WORDS]
    assert whole["tokens"] == texts
    assert whole["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    for key in whole:
        assert [v for s in steps for v in s.logprobs[key]] == whole[key]
    for lp, top in zip(whole["token_logprobs"], whole["top_logprobs"], strict=True):
        assert len(top) == 2
        assert max(top.values()) == lp == next(iter(top.values()))
    only = _state(parse({"logprobs": 0}, chat=False)).logprobs_for(WORDS, _keys(WORDS), 0)
    assert [len(t) for t in only["top_logprobs"]] == [1, 1, 1]


def _named() -> GenerationParams:
    return parse(
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )


def test_named_tool_call_stream_and_message() -> None:
    params = _named()
    forced = [*params.surface.forced, VOCAB.eos_id]  # type: ignore[misc]
    steps, state = _run(params, forced, "stop")
    calls = [s.delta["tool_calls"][0] for s in steps]
    assert calls[0] == {
        "id": calls[0]["id"],
        "type": "function",
        "index": 0,
        "function": {"name": "get_weather", "arguments": "{"},
    }
    assert calls[0]["id"].startswith("chatcmpl-tool-") and len(calls[0]["id"]) == 14 + 32
    assert all(
        list(c) == ["index", "function"] and list(c["function"]) == ["arguments"] for c in calls[1:]
    )
    assert "".join(c["function"]["arguments"] for c in calls) == WEATHER_ARGS
    assert steps[-1].finish_reason == "stop"  # named: not "tool_calls"
    content, tool_calls, finish = state.message(VOCAB.decode(forced), "stop")
    assert content == ""
    assert finish == "stop"
    assert tool_calls == [
        {
            "id": calls[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": WEATHER_ARGS},
        }
    ]


def test_required_tool_call_stream_and_message() -> None:
    params = parse({"tools": [WEATHER], "tool_choice": "required"})
    guided = params.surface.guided
    assert guided is not None
    forced = [*params.surface.forced, VOCAB.eos_id]  # type: ignore[misc]
    steps, state = _run(params, forced, "stop")
    sent = [s for s in steps if not s.skip]
    calls = [c for s in sent for c in s.delta.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": "{"}
    assert list(calls[0]) == ["id", "type", "index", "function"]
    assert all(c["function"]["name"] is None for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == WEATHER_ARGS
    # Nothing streams before the parameters value starts, nor for the array's closing "}]".
    assert sum(s.skip for s in steps) == guided.args_start + 2  # one token a character
    assert sent[-1].delta == {} and sent[-1].finish_reason == "tool_calls"
    content, tool_calls, finish = state.message(VOCAB.decode(forced), "stop")
    assert (content, finish) == ("", "tool_calls")
    assert tool_calls is not None and tool_calls[0]["function"]["arguments"] == WEATHER_ARGS


def test_truncated_tool_calls() -> None:
    named = _named()
    state = _state(named)
    assert state.message('{"city', "length") == (
        "",
        [
            {
                "id": state._call("x", "")["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city'},
            }
        ],
        "length",
    )
    required = _state(parse({"tools": [WEATHER], "tool_choice": "required"}))
    assert required.message('[{"name": "get_weather", "para', "length") == ("", [], "length")


def test_plain_choice_is_text() -> None:
    params = parse({"tools": [WEATHER]})  # auto
    steps, state = _run(params, WORDS, "length")
    assert [s.text for s in steps] == [VOCAB.token_text(t) for t in WORDS]
    assert all(s.delta is None and s.logprobs is None for s in steps)
    assert state.message("x", "stop") == (None, None, "stop")


def test_choices_have_different_sequences() -> None:
    from narwhal.simengine.generation import choice_digest

    digest = b"d" * 32
    assert choice_digest(digest, 1) != choice_digest(digest, 2) != digest
    assert choice_digest(digest, 1) == choice_digest(digest, 1)
    prompt = [1, 2, 3]
    keys = {ContextChain(0, prompt, choice).key() for choice in range(3)}
    assert len(keys) == 3
    assert ContextChain(0, prompt, 0).key() == ContextChain(0, prompt).key()
    answers = [MODEL.generate(prompt, 20, choice) for choice in range(3)]
    assert answers[0] == MODEL.generate(prompt, 20)
    assert answers[0] != answers[1] != answers[2] != answers[0]
