"""The simulated engine's generation is autoregressive: output token ``k`` (and its logprobs)
depends only on the model seed and the context before it (the prompt and the ``k`` tokens
generated), so a request whose prompt is ``P + G[:m]`` (``G``: what the engine answered ``P``)
answers ``G[m:]``, which request migration needs to be tested against the simulator. Also the
``error_after_tokens`` fault and the token ids vLLM puts in stream chunks
(``return_token_ids``), driven through the server's stream and collect paths on an in-process
engine core."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from narwhal.simengine import server
from narwhal.simengine.cli import _resolve_engine
from narwhal.simengine.engine import (
    EngineConfig,
    EngineCore,
    ErrorEvent,
    SimRequest,
    TokenEvent,
)
from narwhal.simengine.faults import FaultSettings, FaultUpdate
from narwhal.simengine.generation import CONTEXT_CHUNK, ContextChain, GenerationModel
from narwhal.simengine.kv_transfer import KVTransferAgent
from narwhal.simengine.metrics import EngineMetrics
from narwhal.simengine.openai_surface import ChoiceState
from narwhal.simengine.protocol import GenerationParams, ResponseBuilder, parse_generation
from narwhal.simengine.side_channel import PeerDirectory
from narwhal.simengine.timing import CALIBRATION
from narwhal.simengine.vocab import Vocabulary

VOCAB = Vocabulary()
MODEL = GenerationModel(VOCAB)
PROMPT = [300 + (i * 53) % 9000 for i in range(37)]  # 2 full chunks of 16 and a tail of 5
SPLITS = [0, 1, 5, 10, 11, 16, 27, 32, 39]  # across chunk boundaries of the whole context
GENERATION_ERROR = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def _keys(model: GenerationModel, prompt: list[int], tokens: list[int]) -> list[bytes]:
    """The context keys ``tokens`` are generated at after ``prompt``."""
    chain = model.context(prompt)
    keys = []
    for token in tokens:
        keys.append(chain.key())
        chain.append(token)
    return keys


# --- the generation model -------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 37, 64])
def test_a_continuation_generates_the_rest(prompt_len: int) -> None:
    prompt = (PROMPT * 2)[:prompt_len]
    answer = MODEL.generate(prompt, 40)
    assert len(answer) == 40 and len(set(answer)) > 30
    for m in SPLITS:
        assert MODEL.generate(prompt + answer[:m], 40 - m) == answer[m:], m


def test_the_context_key_ignores_where_the_prompt_ends() -> None:
    context = PROMPT + MODEL.generate(PROMPT, 40)
    whole = ContextChain(0, context)
    for m in range(len(context) + 1):
        chain = ContextChain(0, context[:m])
        for token in context[m:]:
            chain.append(token)
        assert chain.key() == whole.key() and len(chain) == len(context)
    split = ContextChain(0, context[:3])
    split.extend(context[3:20])
    split.extend(context[20:])
    assert split.key() == whole.key()
    # The key is the context's: one token more, less or different is another key.
    assert ContextChain(0, context[:-1]).key() != whole.key()
    assert ContextChain(0, [*context[:-1], context[-1] + 1]).key() != whole.key()
    assert ContextChain(1, context).key() != whole.key()
    assert CONTEXT_CHUNK == 16


def test_eos_ends_a_continuation_where_it_ended_the_answer() -> None:
    model = GenerationModel(VOCAB, eos_prob=0.05)
    prompt = next(
        p for p in ([i, *PROMPT] for i in range(300, 400)) if 10 < len(model.generate(p, 200)) < 200
    )
    answer = model.generate(prompt, 200)
    assert answer[-1] == VOCAB.eos_id
    for m in (1, 7, len(answer) - 1):
        assert model.generate(prompt + answer[:m], 200) == answer[m:]


def test_logprobs_depend_only_on_the_context_before() -> None:
    answer = MODEL.generate(PROMPT, 40)
    keys = _keys(MODEL, PROMPT, answer)
    whole = [MODEL.logprobs(key, token, 5) for key, token in zip(keys, answer, strict=True)]
    for m in SPLITS:
        rest = answer[m:]
        cont = _keys(MODEL, PROMPT + answer[:m], rest)
        assert cont == keys[m:]
        assert [MODEL.logprobs(k, t, 5) for k, t in zip(cont, rest, strict=True)] == whole[m:]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_logprobs_in_vllm_shape_continue_too(chat: bool) -> None:
    field = {"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3}
    params = _params(chat, 40, **field)
    answer = MODEL.generate(PROMPT, 40)
    keys = _keys(MODEL, PROMPT, answer)
    state = ChoiceState(0, chat, params.surface, VOCAB, MODEL, "x")
    whole = state.logprobs_for(answer, keys, 0)
    m = 13
    rest = state.logprobs_for(answer[m:], _keys(MODEL, PROMPT + answer[:m], answer[m:]), 0)
    if chat:
        assert rest["content"] == whole["content"][m:]
    else:
        assert rest["token_logprobs"] == whole["token_logprobs"][m:]
        assert rest["top_logprobs"] == whole["top_logprobs"][m:]


def test_choice_zero_is_the_single_answer_and_other_choices_differ() -> None:
    single = MODEL.generate(PROMPT, 40)
    assert MODEL.generate(PROMPT, 40, choice=0) == single
    others = [MODEL.generate(PROMPT, 40, choice=j) for j in (1, 2)]
    assert single != others[0] != others[1] != single
    assert MODEL.generate(PROMPT, 40, choice=1) == others[0]  # deterministic


# --- the engine core --------------------------------------------------------------------------


def _core(eos_prob: float = 0.0, faults: FaultSettings | None = None) -> EngineCore:
    config = EngineConfig(
        "e0", "m", num_blocks=256, block_bytes=1024, timing=replace(CALIBRATION, time_scale=1e6)
    )
    pool = np.zeros((config.num_blocks, config.block_bytes), np.uint8)
    agent = KVTransferAgent("a", pool, lambda message: None)
    generation = GenerationModel(VOCAB, config.model_seed, eos_prob)
    return EngineCore(
        config,
        generation,
        EngineMetrics("m", "0"),
        faults or FaultSettings(),
        agent,
        PeerDirectory(),
    )


@pytest.fixture
async def core() -> AsyncIterator[EngineCore]:
    c = _core()
    c.start()
    try:
        yield c
    finally:
        await c.close()


async def _run(core: EngineCore, prompt: list[int], max_tokens: int, **kw: Any) -> list[TokenEvent]:
    request = SimRequest(core.new_request_id("r"), prompt, max_tokens, **kw)
    core.submit(request)
    events: list[TokenEvent] = []
    while True:
        event = await asyncio.wait_for(request.events.get(), 10)
        assert isinstance(event, TokenEvent)
        events.append(event)
        if event.finish_reason is not None:
            return events


async def test_the_engine_continues_its_own_answer(core: EngineCore) -> None:
    first = await _run(core, PROMPT, 40)
    answer = [e.token for e in first]
    assert answer == MODEL.generate(PROMPT, 40)
    assert [e.key for e in first] == _keys(MODEL, PROMPT, answer)
    for m in SPLITS:
        rest = await _run(core, PROMPT + answer[:m], 40 - m)
        assert [e.token for e in rest] == answer[m:], m
        assert [e.key for e in rest] == [e.key for e in first[m:]]  # so are the logprobs
        assert rest[-1].finish_reason == "length"


async def test_masked_eos_continues_too() -> None:
    """ignore_eos and min_tokens mask EOS: the word written instead is the context's too."""
    core = _core(eos_prob=0.3)
    core.start()
    try:
        ignoring = [e.token for e in await _run(core, PROMPT, 40, ignore_eos=True)]
        assert VOCAB.eos_id not in ignoring and len(ignoring) == 40
        floor = [e.token for e in await _run(core, PROMPT, 40, min_tokens=40)]
        assert floor == ignoring
        for m in (3, 17, 30):
            cont = await _run(core, PROMPT + ignoring[:m], 40 - m, ignore_eos=True)
            assert [e.token for e in cont] == ignoring[m:]
            cont = await _run(core, PROMPT + ignoring[:m], 40 - m, min_tokens=40 - m)
            assert [e.token for e in cont] == ignoring[m:]
    finally:
        await core.close()


async def test_choices_and_forced_output(core: EngineCore) -> None:
    single = [e.token for e in await _run(core, PROMPT, 30)]
    assert [e.token for e in await _run(core, PROMPT, 30, choice=0)] == single
    other = [e.token for e in await _run(core, PROMPT, 30, choice=1)]
    assert other != single and other == MODEL.generate(PROMPT, 30, choice=1)
    forced = VOCAB.encode('{"ok": false}')
    events = await _run(core, PROMPT, 30, forced=list(forced))
    assert [e.token for e in events] == [*forced, VOCAB.eos_id]
    assert events[-1].finish_reason == "stop"
    assert [e.key for e in events] == _keys(MODEL, PROMPT, [e.token for e in events])


# --- the server's stream and collect paths ------------------------------------------------------


def _params(chat: bool, max_tokens: int, **body: Any) -> GenerationParams:
    request: dict[str, Any] = {"max_tokens": max_tokens, **body}
    if chat:
        request["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        request["prompt"] = PROMPT
    return parse_generation(request, VOCAB, chat, 16384)


def _start(
    core: EngineCore, params: GenerationParams
) -> tuple[list[SimRequest], ResponseBuilder, list[ChoiceState]]:
    requests = [
        server._new_request(core, params, "rid", core.metrics, choice)
        for choice in range(params.surface.n)
    ]
    builder = ResponseBuilder(params, "rid", "m")
    for request in requests:
        core.submit(request)
    return requests, builder, server._choice_states(params, requests, builder, VOCAB, core)


def _sse(raw: list[bytes]) -> Iterator[Any]:
    for piece in raw:
        for line in piece.decode().split("\n"):
            if line.startswith("data: "):
                data = line[len("data: ") :]
                yield data if data == "[DONE]" else json.loads(data)


async def _stream(core: EngineCore, params: GenerationParams) -> list[Any]:
    requests, builder, choices = _start(core, params)
    raw = [b async for b in server._stream(core, requests, builder, choices, core.faults)]
    return list(_sse(raw))


async def _collect(core: EngineCore, params: GenerationParams) -> tuple[int, Any]:
    requests, builder, choices = _start(core, params)
    response = await server._collect(core, requests, builder, choices, VOCAB, core.faults)
    for request in requests:
        core.abort(request)  # as the route does
    return response.status_code, json.loads(bytes(response.body))


async def _idle(core: EngineCore) -> None:
    for _ in range(100):
        if core.num_running == 0 and core.num_waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests left running")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_error_after_tokens_in_a_stream(core: EngineCore, chat: bool) -> None:
    core.faults.error_after_tokens = 3
    events = await _stream(core, _params(chat, 20, stream=True))
    assert events[-2:] == [GENERATION_ERROR, "[DONE]"]
    chunks = events[:-2]
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
    assert len(chunks) == 3
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    await _idle(core)  # the engine stopped generating the rest


async def test_error_after_zero_tokens_comes_before_any_chunk(core: EngineCore) -> None:
    core.faults.error_after_tokens = 0
    assert await _stream(core, _params(True, 20, stream=True)) == [GENERATION_ERROR, "[DONE]"]
    await _idle(core)


async def test_error_after_tokens_spares_a_response_that_fits(core: EngineCore) -> None:
    core.faults.error_after_tokens = 4
    events = await _stream(core, _params(False, 4, stream=True))
    assert events[-1] == "[DONE]" and "error" not in events[-2]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    status, body = await _collect(core, _params(False, 4))
    assert status == 200 and body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_error_after_tokens_fails_a_whole_response(core: EngineCore, chat: bool) -> None:
    core.faults.error_after_tokens = 4
    status, body = await _collect(core, _params(chat, 5))
    assert (status, body) == (500, GENERATION_ERROR)
    await _idle(core)
    # Counted over the choices of an n > 1 request, as the other token faults.
    status, body = await _collect(core, _params(chat, 2, n=2))
    assert status == 200
    status, body = await _collect(core, _params(chat, 3, n=2))
    assert (status, body) == (500, GENERATION_ERROR)
    await _idle(core)
    core.faults.error_after_tokens = None
    status, body = await _collect(core, _params(chat, 5))
    assert status == 200


def test_error_after_tokens_settings_and_flag() -> None:
    faults = FaultSettings()
    assert faults.error_after_tokens is None
    FaultUpdate(error_after_tokens=2).apply(faults)
    assert faults.error_after_tokens == 2
    FaultUpdate(slowdown=2).apply(faults)
    assert faults.error_after_tokens == 2  # left out: kept
    with pytest.raises(ValueError):
        FaultUpdate(error_after_tokens=-1)
    import argparse

    from narwhal.simengine.cli import add_engine_parser

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["engine", "--port", "8100", "--nixl-port", "8200", "--fault-error-after-tokens", "7"]
    )
    settings, _, _ = _resolve_engine(args)
    assert settings.faults.error_after_tokens == 7


# --- return_token_ids in streams --------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_streamed_token_ids(core: EngineCore, chat: bool) -> None:
    """As vLLM 0.32: each chunk's own ids in ``token_ids``, the prompt's ids on the first chunk
    (chat: top level of the role chunk; completions: in the choice of its first chunk), and
    without ``return_token_ids`` the same keys, null."""
    params = _params(chat, 6, stream=True, return_token_ids=True)
    events = await _stream(core, params)
    chunks = [c for c in events if c != "[DONE]"]
    if chat:
        role, *tokens = chunks
        assert role["prompt_token_ids"] == params.prompt and role["prompt_text"] is None
        assert "token_ids" not in role["choices"][0]
        assert all("prompt_token_ids" not in c for c in tokens)
    else:
        tokens = chunks
        firsts = [c["choices"][0]["prompt_token_ids"] for c in tokens]
        assert firsts == [params.prompt] + [None] * 5
    ids = [c["choices"][0]["token_ids"] for c in tokens]
    assert all(len(i) == 1 for i in ids)
    assert [i[0] for i in ids] == MODEL.generate(params.prompt, 6)
    _, whole = await _collect(core, replace(params, stream=False))
    assert whole["choices"][0]["token_ids"] == [i[0] for i in ids]

    plain = [
        c for c in await _stream(core, replace(params, return_token_ids=False)) if c != "[DONE]"
    ]
    if chat:
        assert plain[0]["prompt_token_ids"] is None and plain[0]["prompt_text"] is None
        plain = plain[1:]
    else:
        assert all(c["choices"][0]["prompt_token_ids"] is None for c in plain)
    assert all("token_ids" in c["choices"][0] for c in plain)
    assert all(c["choices"][0]["token_ids"] is None for c in plain)


async def test_streamed_token_ids_of_a_required_tool_call_miss_none(core: EngineCore) -> None:
    """A tool-call token the parser holds back still gets a chunk (an empty delta) when the ids
    are asked for, as vLLM sends it: every generated id reaches the client."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"stream": True, "tools": [tool], "tool_choice": "required"}
    params = _params(True, 50, **body)
    forced = list(params.surface.forced or ())
    events = await _stream(core, replace(params, return_token_ids=True))
    tokens = [c for c in events[1:] if c != "[DONE]"]
    assert [c["choices"][0]["token_ids"][0] for c in tokens] == [*forced, VOCAB.eos_id]
    assert tokens[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Without them the held-back tokens send nothing, as before.
    fewer = [c for c in (await _stream(core, params))[1:] if c != "[DONE]"]
    assert len(fewer) < len(tokens)


async def test_an_engine_error_event_is_vllms_error_shape(core: EngineCore) -> None:
    """The path error_after_tokens shares with a failed KV transfer (an ErrorEvent)."""
    params = _params(False, 5, stream=True)
    requests, builder, choices = _start(core, params)
    core.abort(requests[0])
    await asyncio.sleep(0)
    requests[0].events.put_nowait(ErrorEvent("KV transfer failed: gone"))
    raw = [b async for b in server._stream(core, requests, builder, choices, core.faults)]
    error = {"message": "KV transfer failed: gone", "type": "InternalServerError", "param": None}
    assert list(_sse(raw)) == [{"error": {**error, "code": 500}}, "[DONE]"]
