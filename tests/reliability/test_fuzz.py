"""Fuzzed input against a live router: zero 5xx, zero crashes, every request journaled.

1. ``schemathesis`` against the router's own OpenAPI schema (``/openapi.json``). The routes
   read raw requests (the body is parsed once, by the router, not by FastAPI), so the schema
   declares paths and methods but no request bodies or parameters: by itself it only covers
   every route answering arbitrary headers and an empty or random body without a 5xx. The test
   therefore adds a loose OpenAI-shaped body schema to the two generation routes, so
   schemathesis also generates structured bodies (valid ones reach the engines).
2. ``hypothesis`` strategies for what a schema does not describe: wrong types, huge numbers,
   deep nesting, invalid UTF-8 and broken JSON, enormous prompts, token ids out of the
   vocabulary, negative or absurd ``max_tokens``, unknown fields.

Bounded: a fixed number of examples (derandomized, so CI sees the same ones), each request a
few engine steps at most, each with a timeout.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, TEST_TIME_SCALE, RouterProcess, running_fleet, running_router
from tests.reliability.support import ROUTER_ID_RE, count_journal, router_idle

GENERATION = ("/v1/completions", "/v1/chat/completions")
# Every route that journals its requests: the generation routes and the Responses API, which
# runs on the chat route's path.
JOURNALED = (*GENERATION, "/v1/responses")
MAX_MODEL_LEN = 16384
SETTINGS = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, RouterProcess]]:
    directory = tmp_path_factory.mktemp("fuzz")
    with (
        # The model ends a completion by EOS (one token in fifty): a body with max_tokens null
        # or absent is valid and otherwise decodes to the context's end, 16k tokens, past the
        # client's timeout on a busy machine.
        running_fleet(
            directory,
            2,
            first_token_timeout_s=5.0,
            sim={"time_scale": TEST_TIME_SCALE, "eos_prob": 0.02},
        ) as fleet,
        running_router(
            directory, fleet.fleet_path, "--max-body-bytes", str(4 * 1024 * 1024)
        ) as router,
    ):
        yield fleet, router


class Tally:
    """Requests sent to the generation routes, to compare with the journal afterwards."""

    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.sent = 0
        self.statuses: dict[int, int] = {}
        journal = count_journal(router.journal)
        self.starts_before = len(journal.starts)
        self.ends_before = len(journal.ends)

    def check(self, path: str, response: httpx.Response, what: Any) -> None:
        status = response.status_code
        self.statuses[status] = self.statuses.get(status, 0) + 1
        assert status < 500, (status, response.text[:500], repr(what)[:500])
        if path in JOURNALED:
            self.sent += 1
            # Every answer names the router's id for the request: the journal's id.
            assert ROUTER_ID_RE.match(response.headers.get("x-request-id", "")), response.headers
            if status >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}

    def assert_all_journaled(self) -> None:
        assert self.router.process.poll() is None, "the router died"
        assert wait_until(lambda: router_idle(self.router), 10)
        journal = count_journal(self.router.journal)

        def settled() -> bool:
            j = count_journal(self.router.journal)
            return len(j.ends) - self.ends_before == self.sent

        assert wait_until(settled, 10)
        journal = count_journal(self.router.journal)
        assert len(journal.starts) - self.starts_before == self.sent
        assert len(journal.ends) - self.ends_before == self.sent
        assert journal.duplicate_starts == journal.duplicate_ends == 0
        assert not journal.open_ids
        assert not [e for e in journal.ends.values() if e["outcome"] == "internal_error"]
        print(f"\n{self.sent} generation requests, statuses {dict(sorted(self.statuses.items()))}")


# --------------------------------------------------------------------------------------------
# 1. schemathesis on the router's own schema


def _token_ids() -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 300000}}


TOOL = {
    "type": "object",
    "properties": {
        "type": {"enum": ["function", "web_search"]},
        "function": {
            "type": "object",
            "properties": {
                "name": {"enum": ["get_weather", "", "f"]},
                "parameters": {
                    "enum": [
                        {"type": "object", "properties": {"x": {"type": "integer"}}},
                        {"type": "object", "required": ["y"], "properties": {"y": {"enum": [1]}}},
                        {},
                    ]
                },
            },
        },
    },
}
# Loose on purpose: types as OpenAI documents them, values anywhere in their range. Kept short
# (max_tokens <= 8, no max_completion_tokens) so that valid examples cost a few engine steps.
COMPLETION_BODY = {
    "type": "object",
    "required": ["model", "prompt", "max_tokens"],
    "additionalProperties": False,
    "properties": {
        "model": {"enum": [MODEL, "other-model", ""]},
        "prompt": {
            "anyOf": [
                {"type": "string", "maxLength": 200},
                {**_token_ids(), "maxItems": 64},
                {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            ]
        },
        "max_tokens": {"type": "integer", "minimum": -3, "maximum": 8},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "n": {"type": "integer", "minimum": -1, "maximum": 4},
        "seed": {"type": "integer"},
        "logprobs": {
            "anyOf": [{"type": "integer", "minimum": -1, "maximum": 25}, {"type": "boolean"}]
        },
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "ignore_eos": {"type": "boolean"},
        "user": {"type": "string"},
    },
}
CHAT_BODY = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "additionalProperties": False,
    "properties": {
        "model": {"enum": [MODEL, "other-model"]},
        "messages": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["system", "user", "assistant", "tool", "x"]},
                    "content": {
                        "anyOf": [
                            {"type": "string", "maxLength": 200},
                            {
                                "type": "array",
                                "maxItems": 3,
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "type": {"enum": ["text", "image_url"]},
                                        "text": {"type": "string"},
                                    },
                                },
                            },
                            {"type": "null"},
                        ]
                    },
                },
            },
        },
        "max_tokens": {"type": "integer", "minimum": -3, "maximum": 8},
        "stream": {"type": "boolean"},
        "temperature": {"type": "number"},
        "tools": {"type": "array", "maxItems": 2, "items": TOOL},
        "tool_choice": {
            "anyOf": [
                {"enum": ["auto", "none", "required", "other"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["function"]},
                        "function": {"type": "object", "properties": {"name": {"type": "string"}}},
                    },
                },
            ]
        },
        "parallel_tool_calls": {"type": "boolean"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": -1, "maximum": 25},
        "n": {"type": "integer", "minimum": -1, "maximum": 3},
        "response_format": {
            "anyOf": [
                {"type": "object"},
                {"type": "object", "properties": {"type": {"enum": ["json_object", "text"]}}},
                {
                    "type": "object",
                    "required": ["type", "json_schema"],
                    "properties": {
                        "type": {"enum": ["json_schema"]},
                        "json_schema": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                            },
                        },
                    },
                },
            ]
        },
    },
}


def augmented_schema(raw: dict[str, Any]) -> dict[str, Any]:
    schema = copy.deepcopy(raw)
    for path, body in (("/v1/completions", COMPLETION_BODY), ("/v1/chat/completions", CHAT_BODY)):
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return schema


def fuzz_operation(
    client: httpx.Client, operation: Any, examples: int, tally: Tally, deadline: float
) -> None:
    @given(case=operation.as_strategy())
    @settings(SETTINGS, max_examples=examples)
    def call(case: schemathesis.Case) -> None:
        assert time.monotonic() < deadline, "fuzzing ran past its time bound"
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
        headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "host"}
        response = client.request(
            kwargs["method"],
            operation.path,
            headers=headers,
            params=kwargs.get("params"),
            json=kwargs.get("json"),
            content=kwargs.get("data"),
        )
        tally.check(operation.path, response, case)

    call()


def test_schemathesis_against_the_routers_openapi_schema(stack) -> None:
    _, router = stack
    raw = httpx.get(router.url + "/openapi.json", timeout=10).json()
    # The schema as served: every route, no bodies declared (see the module docstring).
    assert set(raw["paths"]) >= {*GENERATION, "/v1/models", "/health", "/ready", "/metrics"}
    assert not any("requestBody" in op for ops in raw["paths"].values() for op in ops.values())
    schema = schemathesis.openapi.from_dict(augmented_schema(raw))
    tally = Tally(router)
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for result in schema.get_all_operations():
            operation = result.ok()
            examples = 60 if operation.path in GENERATION else 10
            fuzz_operation(client, operation, examples, tally, deadline)
    assert tally.statuses.get(200, 0) > 0, "no valid request was ever generated"
    tally.assert_all_journaled()


# --------------------------------------------------------------------------------------------
# 2. hypothesis: what the schema does not cover

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"x": value}
    return value


def _raw_nested(depth: int) -> bytes:
    return (
        b'{"model": "'
        + MODEL.encode()
        + b'", "prompt": "hi", "max_tokens": 2, "x": '
        + (b"[" * depth + b"]" * depth)
        + b"}"
    )


MAX_TOKENS = st.one_of(
    st.integers(min_value=1, max_value=6),  # valid and cheap
    st.integers(max_value=0),
    st.integers(min_value=MAX_MODEL_LEN, max_value=2**63 - 1),
    st.just(2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=300),
    st.lists(st.integers(min_value=0, max_value=20000), min_size=1, max_size=200),
    # out of vocabulary, negative, beyond 64 bits
    st.lists(st.integers(min_value=10**6, max_value=2**63 - 1), min_size=1, max_size=5),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
    st.lists(st.integers(min_value=2**64, max_value=2**70), min_size=1, max_size=2),
    st.lists(JSON_VALUES, max_size=4),
    st.just(""),
    st.just([]),
    JSON_VALUES,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant"]),
                "content": st.text(max_size=80),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    st.lists(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3), max_size=3),
    JSON_VALUES,
)
# The OpenAI surface's fields (issue 20), valid and not: the decode engine gets them.
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SURFACE = st.fixed_dictionaries(
    {},
    optional={
        "tools": st.one_of(st.just([_TOOL]), st.just([]), st.just([{"type": "x"}]), JSON_VALUES),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required", "sometimes"]),
            st.just({"type": "function", "function": {"name": "f"}}),
            st.just({"type": "function", "function": {"name": "missing"}}),
            JSON_VALUES,
        ),
        "logprobs": st.one_of(st.booleans(), st.integers(min_value=-2, max_value=30), JSON_VALUES),
        "top_logprobs": st.one_of(st.integers(min_value=-2, max_value=30), JSON_VALUES),
        "n": st.one_of(st.integers(min_value=-1, max_value=3), st.just(65), JSON_VALUES),
        "response_format": st.one_of(
            st.just({"type": "json_object"}),
            st.just({"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}),
            st.just({"type": "json_schema"}),
            JSON_VALUES,
        ),
        "temperature": st.one_of(st.floats(allow_nan=False), st.just("hot"), JSON_VALUES),
        "seed": st.one_of(st.integers(), JSON_VALUES),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "prompt_logprobs": st.one_of(st.integers(min_value=0, max_value=3), st.none()),
    },
)
UNKNOWN = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(
        lambda k: k not in ("max_completion_tokens", "min_tokens", "min_completion_tokens")
    ),
    JSON_VALUES,
    max_size=3,
)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, raw body). Most are JSON objects with one or more fields wrong; some are not
    JSON at all."""
    chat = draw(st.booleans())
    path = GENERATION[chat]
    kind = draw(
        st.sampled_from(["object", "object", "object", "object", "raw", "deep", "enormous"])
    )
    if kind == "raw":
        raw = draw(
            st.one_of(
                st.binary(max_size=200),  # mostly invalid UTF-8
                st.just(b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe\xc3"}'),
                st.just(b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800"}'),
                st.just(b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1e400}'),
                st.just(b'{"model": "' + MODEL.encode() + b'", "max_tokens": NaN}'),
                st.just(b'\xef\xbb\xbf{"model": "' + MODEL.encode() + b'", "prompt": "x"}'),
                st.just(b'{"model": "a", "model": "' + MODEL.encode() + b'", "prompt": "x"}'),
                st.just(b'{"model": "' + MODEL.encode() + b'", "prompt": [1, 2'),
                st.just(b""),
                st.just(b"null"),
            )
        )
        return path, raw
    if kind == "deep":
        depth = draw(st.sampled_from([50, 200, 254, 255, 256, 300, 600, 1023, 1024, 1025, 5000]))
        return path, _raw_nested(depth)
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, MODEL, MODEL, "x", 7, None]))}
    if kind == "enormous":
        size = draw(st.sampled_from([100_000, 300_000, 1_000_000, 5_000_000]))
        if chat:
            body["messages"] = [{"role": "user", "content": "a" * size}]
        else:
            body["prompt"] = draw(st.sampled_from(["a" * size, list(range(1, size // 50))]))
        body["max_tokens"] = 2
    elif chat:
        body["messages"] = draw(MESSAGES)
        body["max_tokens"] = draw(MAX_TOKENS)
    else:
        body["prompt"] = draw(PROMPTS)
        body["max_tokens"] = draw(MAX_TOKENS)
    if draw(st.booleans()):
        body.update(draw(SURFACE))
    for name, value in draw(UNKNOWN).items():
        body.setdefault(name, value)
    if draw(st.booleans()):
        body["stream"] = draw(st.one_of(st.booleans(), JSON_SCALARS))
    try:
        raw = json.dumps(body).encode()
    except (TypeError, ValueError):
        raw = repr(body).encode()
    return path, raw


def test_hypothesis_bodies_the_schema_does_not_cover(stack) -> None:
    _, router = stack
    tally = Tally(router)
    deadline = time.monotonic() + 150

    with httpx.Client(base_url=router.url, timeout=30) as client:

        @given(example=bodies())
        @settings(SETTINGS, max_examples=250)
        def call(example: tuple[str, bytes]) -> None:
            assert time.monotonic() < deadline, "fuzzing ran past its time bound"
            path, raw = example
            response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            tally.check(path, response, raw[:300])

        call()
        # The cases found by hand, always run: nesting around orjson's limits (dumps refuses
        # depth > 254, loads > 1024), and a body past --max-body-bytes.
        for depth in (254, 255, 256, 1000, 1024, 1025):
            for path in GENERATION:
                response = client.post(
                    path, content=_raw_nested(depth), headers={"Content-Type": "application/json"}
                )
                tally.check(path, response, f"depth {depth}")
        response = client.post(GENERATION[0], content=b"x" * (5 * 1024 * 1024))
        assert response.status_code == 413
        tally.check(GENERATION[0], response, "5 MiB body")
    tally.assert_all_journaled()
