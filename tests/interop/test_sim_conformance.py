"""The simulator answers the P/D legs in the shapes real vLLM 0.32 returned to the interop
suite (``test_vllm_pd.py``; the captured responses are in docs/vllm-interop.md).

No vLLM needed: these run against simulated engines, in ``make check`` too, so a simulator
change that drifts from vLLM fails fast.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from narwhal.engines.legs import decode_leg_body, prefill_leg_body
from tests.helpers import MODEL, VLLM_032_ANSWER_KEYS, VLLM_032_USAGE_KEYS, metric, running_fleet

# kv_transfer_params of a vLLM 0.32 prefill leg (NixlConnector, pull mode), field by field.
VLLM_032_KV_TRANSFER_PARAMS: dict[str, type | tuple[type, ...]] = {
    "do_remote_prefill": bool,
    "do_remote_decode": bool,
    "remote_block_ids": list,  # one list of block ids per KV cache group
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_host": str,
    "remote_port": int,
    "tp_size": int,
    "dcp_size": int,
    "pp_size": int,
    "remote_num_tokens": int,
    "remote_blocks_expiry_time": type(None),  # set only on a decode engine's turn-2 export
    "remote_prefill_cached_tokens": int,
    "transfer_mode": str,
}
BLOCK_SIZE = 16  # the simulator's default
PROMPT = " ".join(f"word{i}" for i in range(70))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    with running_fleet(tmp_path_factory.mktemp("conformance"), 2) as f:
        yield f


def _body(chat: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return {**body, **extra}


def _events(response: httpx.Response) -> list[Any]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_prefill_kv_transfer_params_have_vllm_032_shape(fleet, chat: bool) -> None:
    prefill, decode = fleet.engines["e0"].url, fleet.engines["e1"].url
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(chat)
    with httpx.Client(timeout=30) as client:
        answer = client.post(prefill + path, json=prefill_leg_body(body, chat)).json()
        params = answer["kv_transfer_params"]
        assert set(params) == set(VLLM_032_KV_TRANSFER_PARAMS)
        for key, kind in VLLM_032_KV_TRANSFER_PARAMS.items():
            assert isinstance(params[key], kind), (key, params[key])
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert params["remote_num_tokens"] == prompt_tokens
        (group,) = params["remote_block_ids"]
        assert len(group) == math.ceil(prompt_tokens / BLOCK_SIZE)
        assert params["tp_size"] == fleet.fleet.engine.tp  # the fleet's TP (vLLM: its own)
        assert params["dcp_size"] == params["pp_size"] == 1
        assert params["remote_prefill_cached_tokens"] == 0
        assert params["transfer_mode"] == "pull"

        # The decode engine takes the nested shape back and pulls the KV.
        before = client.get(decode + "/metrics").text
        r = client.post(decode + path, json={**body, "kv_transfer_params": params})
        assert r.status_code == 200, r.text
        after = client.get(decode + "/metrics").text
    count = "vllm:nixl_bytes_transferred_count"
    assert metric(after, count) - metric(before, count) == 1
    assert metric(after, "narwhal_sim:local_prefill_fallbacks_total") == metric(
        before, "narwhal_sim:local_prefill_fallbacks_total"
    )


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_chunks_have_vllm_032_shape(fleet, chat: bool, include_usage: bool) -> None:
    """Token chunks carry no ``usage`` key at all (vLLM 0.32 leaves it out, completions and
    chat alike); the usage chunk has ``choices: []`` and the three counts; a chat stream opens
    with the assistant role and empty content."""
    url = fleet.engines["e1"].url
    path = "/v1/chat/completions" if chat else "/v1/completions"
    extra: dict[str, Any] = {"stream": True}
    if include_usage:
        extra["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", url + path, json=_body(chat, **extra), timeout=30) as r:
        assert r.status_code == 200
        events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = [c for c in chunks if not c["choices"]]
    tokens = [c for c in chunks if c["choices"]]
    for chunk in tokens:
        assert "usage" not in chunk, chunk
    if include_usage:
        assert len(usage) == 1
        assert set(usage[0]["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert usage[0]["usage"]["completion_tokens"] == 6
    else:
        assert usage == []
    if chat:
        assert tokens[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"logprobs": 50}, "Requested sample logprobs of 50, which is greater than max allowed"),
        ({"stop_token_ids": [10**8]}, "in stop_token_ids contain out-of-vocab token ids"),
        ({"logit_bias": {"100000000": 1}}, "in logit_bias contain out-of-vocab token ids"),
    ],
    ids=["logprobs", "stop_token_ids", "logit_bias"],
)
def test_engine_side_refusals_come_in_the_stream_as_vllm_032_sends_them(
    fleet, extra: dict[str, Any], message: str
) -> None:
    """vLLM 0.32 checks sampling parameters against the engine (SamplingParams.verify) once the
    request reaches it: a whole request gets a 400, a streamed one a 200 whose only event is
    the 400 error object, then [DONE] (seen on the interop suite's engines); a max_tokens past
    the context is a 400 either way."""
    url = fleet.engines["e1"].url + "/v1/completions"
    with httpx.Client(timeout=30) as client:
        whole = client.post(url, json=_body(False, **extra))
        assert whole.status_code == 400
        error = whole.json()["error"]
        assert message in error["message"] and error["code"] == 400
        with client.stream("POST", url, json=_body(False, stream=True, **extra)) as r:
            assert r.status_code == 200
            events = _events(r)
        assert events == [{"error": error}, "[DONE]"]
        late = client.post(url, json=_body(False, stream=True, max_tokens=10**7, **extra))
        assert late.status_code == 400 and late.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_answer_has_vllm_032_keys(fleet, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    answer = httpx.post(fleet.engines["e1"].url + path, json=_body(chat), timeout=30).json()
    assert set(answer) == VLLM_032_ANSWER_KEYS[chat]
    assert set(answer["usage"]) == VLLM_032_USAGE_KEYS
    choice_keys = {"index", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    choice_keys |= (
        {"message", "routed_experts"}
        if chat
        else {"text", "routed_experts", "prompt_logprobs", "prompt_token_ids"}
    )
    assert set(answer["choices"][0]) == choice_keys


def test_decode_leg_body_round_trips_the_vllm_032_params() -> None:
    """What vLLM 0.32 returned (captured) goes to the decode engine unchanged."""
    captured = {
        "dcp_size": 1,
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "pp_size": 1,
        "remote_block_ids": [[5, 6, 7, 8, 9]],
        "remote_blocks_expiry_time": None,
        "remote_engine_id": "06c0b182-fcb3-4380-9e1e-80260e8af574",
        "remote_host": "127.0.0.1",
        "remote_num_tokens": 616,
        "remote_port": 36109,
        "remote_prefill_cached_tokens": 0,
        "remote_request_id": "cmpl-legs-[21912-2]-0-a08a29bb",
        "tp_size": 1,
        "transfer_mode": "pull",
    }
    assert set(captured) == set(VLLM_032_KV_TRANSFER_PARAMS)
    body = decode_leg_body({"model": MODEL, "prompt": "x", "max_tokens": 4}, captured)
    assert body["kv_transfer_params"] == captured
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
