"""Client request validation: what is refused, with which status and param."""

from __future__ import annotations

import json

import pytest

from narwhal.serve.errors import RouterError
from narwhal.serve.validation import parse_client_request

MODEL = "m"


def parse(body: object, chat: bool = False, max_len: int = 100):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_client_request(raw, chat, MODEL, max_len)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{", 400, None),
        ([], 400, None),
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": 3, "prompt": "x"}, 400, "model"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 2**64]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 2.5]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, -2.0]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1.0, 2**64]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, "two"]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, None]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, {"id": 2}]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 65}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "n": "two"}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "n": 2, "temperature": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of"),
        ({"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
        ({"model": MODEL, "prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
        ({"model": MODEL, "prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
        ({"model": MODEL, "prompt": ["a b c", ""]}, 400, "prompt[1]"),
        ({"model": MODEL, "prompt": [[1, 2], [-3]]}, 400, "prompt[1]"),
        # vLLM's and OpenAI's batches are all strings or all token-id lists
        ({"model": MODEL, "prompt": ["a", [1]]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1], "a"]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[1], 2]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "stream": "maybe"}, 400, "stream"),
        (
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        (
            {
                "model": MODEL,
                "prompt": "x",
                "stream": True,
                "stream_options": {"include_usage": "maybe"},
            },
            400,
            "stream_options.include_usage",
        ),
        (
            {
                "model": MODEL,
                "prompt": "x",
                "stream": True,
                "stream_options": {"continuous_usage_stats": [1]},
            },
            400,
            "stream_options.continuous_usage_stats",
        ),
        ({"model": MODEL, "prompt": "x", "kv_transfer_params": None}, 400, "kv_transfer_params"),
        ({"model": MODEL, "prompt": "x", "ec_transfer_params": {}}, 400, "ec_transfer_params"),
        ({"model": MODEL, "prompt": [5] * 100}, 400, "max_tokens"),  # it leaves none
        ({"model": MODEL, "prompt": [5] * 101}, 400, "input_tokens"),
        ({"model": MODEL, "prompt": [5] * 9, "max_tokens": 101}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 101}, 400, "max_tokens"),
        (
            {"model": MODEL, "prompt": [5] * 90, "max_tokens": 20, "min_tokens": 11},
            400,
            None,
        ),
        ({"model": MODEL, "prompt": "y" * 1700}, 400, "input_tokens"),
        ({"model": MODEL, "prompt": "y", "max_tokens": 5, "min_tokens": 6}, 400, None),
    ],
)
def test_refused(body: object, status: int, param: str | None) -> None:
    with pytest.raises(RouterError) as info:
        parse(body)
    assert info.value.status == status
    assert info.value.param == param
    assert info.value.outcome == "client_error"
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"content": "x"}]}, "messages[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "functions": [{}]},
            "functions",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "function_call": "auto",
            },
            "function_call",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 0,
            },
            "max_tokens",  # vLLM 0.32 names the field it maps it to
        ),
    ],
)
def test_chat_refused(body: dict, param: str) -> None:
    with pytest.raises(RouterError) as info:
        parse(body, chat=True)
    assert info.value.status == 400 and info.value.param == param


def test_accepted_requests() -> None:
    r = parse(
        {
            "model": MODEL,
            "prompt": [1, 2, 3],
            "max_tokens": 5,
            "best_of": 1,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert r.prompt_tokens_exact == 3 and r.max_tokens == 5 and r.stream and r.include_usage
    r = parse({"model": MODEL, "prompt": "hello world", "temperature": 0.2, "seed": 7})
    assert r.prompt_tokens_exact is None and r.prompt_bytes == len("hello world")
    assert r.body["temperature"] == 0.2  # passed through
    r = parse(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9,
            "max_completion_tokens": 4,
            "tool_choice": "none",
        },
        chat=True,
    )
    assert r.max_tokens == 4 and r.chat
    # JSON's true and false among token ids: vLLM 0.32's lax list[int] reads 1 and 0.
    r = parse({"model": MODEL, "prompt": [1, True, False]})
    assert r.prompt_tokens_exact == 3
    # And 2.0 and "3" as 2 and 3 (vLLM 0.32 serves [10.0, "11"] as [10, 11]): rewritten as
    # integers for the engines, the prefix index and the lifecycle.
    # A first id given as a string too (["1", 2.0, ...]: vLLM's union takes a list that is not
    # all strings as ids, a list of strings only as a batch of text prompts).
    for prompt in ([1, 2.0, "3", True], [[1, 2.0, "3", True]], ["1", 2.0, "3", True]):
        r = parse({"model": MODEL, "prompt": prompt})
        ids = r.body["prompt"] if not isinstance(prompt[0], list) else r.body["prompt"][0]
        assert ids == [1, 2, 3, 1] and all(type(t) is int for t in ids)
        assert r.prompt_tokens_exact == 4
    assert len(parse({"model": MODEL, "prompt": ["1", "2"]}).choices) == 2  # two text prompts


def test_a_max_tokens_past_what_the_prompt_leaves_is_cut_as_vllm_cuts_it() -> None:
    # vLLM 0.32 serves prompt + max_tokens past the context with max_tokens cut to fit (only a
    # max_tokens past the context itself is refused): the router plans with the cut value and
    # sends the body as it is.
    r = parse({"model": MODEL, "prompt": [5] * 90, "max_tokens": 20, "min_tokens": 10})
    assert r.max_tokens == 10 and r.body["max_tokens"] == 20
    r = parse({"model": MODEL, "prompt": [5] * 99, "max_tokens": 100})
    assert r.max_tokens == 1
    # In vLLM 0.32's words (the same error from the router or an engine).
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": "x", "max_tokens": 101})
    assert info.value.message == (
        "max_tokens=101 cannot be greater than max_model_len=100. Please request fewer output"
        " tokens. (parameter=max_tokens, value=101)"
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(RouterError) as info:
        parse({**chat, "max_tokens": 5, "max_completion_tokens": 101}, chat=True)
    assert info.value.param == "max_completion_tokens"
    assert info.value.message.startswith("max_completion_tokens=101 cannot be greater")
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": [5] * 101})
    assert "your prompt contains at least 101 input tokens" in info.value.message
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": [5] * 150})
    assert "your prompt contains 150 input tokens" in info.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": True, "top_logprobs": 3},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
        },
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"choice": ["a", "b"]}},
        {"stop": ["x"], "stop_token_ids": [3], "seed": 5, "reasoning_effort": "low"},
    ],
)
def test_the_decode_engines_fields_pass_through(fields: dict) -> None:
    """The router checks none of these: the engines do (their 400s reach the client)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = parse(body, chat=True)
    assert r.body == body
    r = parse({"model": MODEL, "prompt": "hi", **fields, "logprobs": 2})
    assert r.body["logprobs"] == 2


def test_a_seed_at_int64s_edge_seeds_its_choices_within_vllms_range() -> None:
    """Choice j's seed is seed + j as vLLM's; past int64 (which vLLM refuses) it wraps, still
    distinct; a seed already out of range is left for the engine to refuse as sent."""
    top = 2**63 - 1
    r = parse({"model": MODEL, "prompt": "x", "n": 3, "seed": top})
    assert [c.body["seed"] for c in r.choices] == [top, -(2**63), -(2**63) + 1]
    r = parse({"model": MODEL, "prompt": "x", "n": 2, "seed": 2**63})
    assert [c.body["seed"] for c in r.choices] == [2**63, 2**63 + 1]


def test_n_and_batches_fan_out_one_request_per_choice() -> None:
    r = parse({"model": MODEL, "prompt": [[1, 2], [5, 6, 7]], "n": 2, "max_tokens": 3, "seed": 9})
    assert r.choices_per_prompt == 2 and len(r.choices) == 4
    assert [c.body["prompt"] for c in r.choices] == [[1, 2], [1, 2], [5, 6, 7], [5, 6, 7]]
    assert all("n" not in c.body for c in r.choices)
    # vLLM's seeds for a seeded request's choices: seed + j
    assert [c.body["seed"] for c in r.choices] == [9, 10, 9, 10]
    assert r.choices[2].prompt_tokens_exact == 3
    r = parse({"model": MODEL, "prompt": "x", "n": 3, "request_id": "abc"})
    assert [c.body["request_id"] for c in r.choices] == ["abc-0", "abc-1", "abc-2"]
    r = parse({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}, chat=True)
    assert len(r.choices) == 3 and r.choices[0].chat
    assert not parse({"model": MODEL, "prompt": "x", "n": 1}).choices
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": [[1], [1, -1]]})
    assert info.value.param == "prompt[1]"
    r = parse({"model": MODEL, "prompt": ["a b", "c"], "n": 2})
    assert [c.body["prompt"] for c in r.choices] == ["a b", "a b", "c", "c"]
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": "x", "n": 0})
    assert info.value.param is None  # vLLM 0.32: "n must be at least 1, got 0.", no param
    assert str(info.value) == "n must be at least 1, got 0."


@pytest.mark.parametrize("temperature", [0, 0.0, "0", "0.0", False])
def test_n_above_one_at_greedy_temperature_is_refused_however_zero_is_written(
    temperature: object,
) -> None:
    # vLLM reads "0" (and false) as 0.0 and refuses n greedy choices; the router did only 0.
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": "x", "n": 2, "temperature": temperature})
    assert str(info.value) == "n must be 1 when using greedy sampling, got 2."
    assert len(parse({"model": MODEL, "prompt": "x", "n": 2, "temperature": "0.5"}).choices) == 2


@pytest.mark.parametrize("body", [{"prompt": "x"}, {"model": None, "prompt": "x"}, {"model": ""}])
def test_a_request_without_a_model_is_for_the_served_model(body: dict[str, object]) -> None:
    # vLLM's _is_model_supported: no model, or an empty one, is the base model.
    request = parse({"prompt": "x", **body})
    assert request.model == MODEL and request.body["model"] == MODEL


@pytest.mark.parametrize(
    "fields",
    [
        {"echo": 0},
        {"echo": "false"},
        {"use_beam_search": "off"},
        {"best_of": "1"},
        {"best_of": 1.0},
    ],
)
def test_an_unsupported_field_set_off_as_vllm_reads_it_is_accepted(
    fields: dict[str, object],
) -> None:
    assert parse({"model": MODEL, "prompt": "x", **fields}).model == MODEL


@pytest.mark.parametrize("name", ["kv_transfer_params", "ec_transfer_params"])
def test_transfer_params_inside_vllm_xargs_are_refused(name: str) -> None:
    # vLLM takes vllm_xargs as its extra args, where it reads the transfer parameters the
    # router did not set (a local leg; the encoder cache): a client's would reach the engine.
    with pytest.raises(RouterError) as info:
        parse({"model": MODEL, "prompt": "x", "vllm_xargs": {name: "10.9.9.9"}})
    assert info.value.param == f"vllm_xargs.{name}"
    assert parse({"model": MODEL, "prompt": "x", "vllm_xargs": {"k": 1}}).model == MODEL


def test_a_body_after_a_utf8_byte_order_mark_is_read_as_vllm_reads_it() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_client_request(b"\xef\xbb\xbf" + json.dumps(body).encode(), True, "m", 4096)
    assert req.body["messages"] == body["messages"]
    with pytest.raises(RouterError) as refused:  # the mark alone is no JSON object
        parse_client_request(b"\xef\xbb\xbf", True, "m", 4096)
    assert refused.value.status == 400


def test_fields_vllm_reads_leniently_are_read_so_here() -> None:
    """From an agentic client's QA: ``include_usage: "false"`` got a usage chunk (read as
    Python's truth), a seed of ``"5"`` gave every choice of n the same seed, empty
    ``stream_options`` on a request that does not stream and ``max_tokens: 0`` beside a
    ``max_completion_tokens`` (which vLLM uses instead) were refused: vLLM serves each."""
    for off in ("false", "0", "off", 0, None):
        r = parse(
            {
                "model": MODEL,
                "prompt": "x",
                "stream": True,
                "stream_options": {"include_usage": off},
            }
        )
        assert r.include_usage is False
    r = parse(
        {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": "on"}}
    )
    assert r.include_usage is True
    assert not parse({"model": MODEL, "prompt": "x", "stream_options": {}}).include_usage
    for seed in ("5", 5.0, 5):
        r = parse({"model": MODEL, "prompt": "x", "n": 3, "seed": seed})
        assert [c.body["seed"] for c in r.choices][1:] == [6, 7]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    r = parse({**chat, "max_completion_tokens": 1, "max_tokens": 0}, chat=True)
    assert r.max_tokens == 1
    with pytest.raises(RouterError) as info:
        parse({**chat, "max_completion_tokens": 1, "max_tokens": 2.5}, chat=True)
    assert info.value.param == "max_tokens"  # still read as an integer, as vLLM's pydantic


def test_a_suffix_goes_to_the_engines_and_its_prompt_is_not_keyed() -> None:
    """vLLM 0.32 serves ``suffix`` for models whose renderer does fill-in-the-middle and
    refuses it for the rest: the engines say which (the router refused it as "not supported
    by vLLM"). The engine renders prompt and suffix into one prompt, which the prompt's own
    keys do not stand for."""
    from narwhal.routing.prefix import prompt_keys

    body = {"model": MODEL, "prompt": "def f(x):" * 40, "suffix": "return y"}
    assert parse(body).body["suffix"] == "return y"
    assert prompt_keys(body, False, 16) == ()
    assert prompt_keys({k: v for k, v in body.items() if k != "suffix"}, False, 16)
