"""The OpenAI surface agentic clients use, through narwhal-serve on a live simulated fleet, with
the ``openai`` SDK: several choices (``n``, batched prompts), tool calls, logprobs; each answer
as the decode engine alone would give it, each request one journal record."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, running_fleet, running_router


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("openai-surface")
    with (
        running_fleet(directory, 4) as fleet,
        running_router(directory, fleet.fleet_path) as router,
    ):
        yield fleet, router


@pytest.fixture
def clients() -> Iterator[Callable[[str], openai.OpenAI]]:
    """SDK clients, closed at the end of the test (an unclosed one warns)."""
    made: list[openai.OpenAI] = []

    def make(url: str) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _end(router: RouterProcess, rid: str) -> dict[str, Any]:
    assert wait_until(lambda: rid in router.ends(), 5), f"no request.end for {rid}"
    return router.ends()[rid]


def test_n_choices_are_fanned_out_and_numbered(stack, clients) -> None:
    fleet, router = stack
    engine = clients(fleet.engines["e2"].url)
    one = engine.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6
    )
    raw = clients(router.url).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, n=3
    )
    got = raw.parse()
    assert [c.index for c in got.choices] == [0, 1, 2]
    # The simulated model is deterministic: each choice is the lone answer.
    assert {c.message.content for c in got.choices} == {one.choices[0].message.content}
    assert got.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert got.usage.completion_tokens == 3 * one.usage.completion_tokens
    end = _end(router, raw.headers["x-request-id"])
    assert end["outcome"] == "ok" and end["choices"] == 3
    assert end["completion_tokens"] == 3 * one.usage.completion_tokens
    assert {a["choice"] for a in end["attempts"]} == {0, 1, 2}


def test_batched_prompts_with_n_stream_as_one(stack, clients) -> None:
    fleet, router = stack
    engine = clients(fleet.engines["e2"].url)
    prompts = ["the first prompt of a batch", "a second, different prompt"]
    lone = [engine.completions.create(model=MODEL, prompt=p, max_tokens=5) for p in prompts]
    stream = clients(router.url).completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    ids, usage, finishes = set(), None, {}
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert len(ids) == 1
    # prompt i's choice j is index i * n + j, as vLLM numbers them
    assert texts == {
        0: lone[0].choices[0].text,
        1: lone[0].choices[0].text,
        2: lone[1].choices[0].text,
        3: lone[1].choices[0].text,
    }
    assert finishes == {i: "length" for i in range(4)}
    assert usage is not None
    assert usage.prompt_tokens == lone[0].usage.prompt_tokens + lone[1].usage.prompt_tokens
    assert usage.completion_tokens == 4 * 5


def test_a_bad_prompt_in_a_batch_is_named(stack) -> None:
    _, router = stack
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": ["fine", ""], "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt[1]"
    assert _end(router, r.headers["x-request-id"])["outcome"] == "client_error"
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "n": 65, "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
