"""The simulated engine's P/D contract, against two real engine processes on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.engines.lax import NOT_JSON
from narwhal.engines.legs import prefill_leg_body
from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, admin, metric, running_fleet, sse_events

LONG_TEXT = " ".join(f"word{i} about disaggregated serving" for i in range(60))
TOKEN_PROMPT = [300 + (i * 37) % 9000 for i in range(333)]  # 333 ids: 21 blocks of 16


@pytest.fixture(scope="module")
def pd_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with running_fleet(tmp_path_factory.mktemp("pd"), 2) as fleet:
        yield fleet


def urls(fleet: SimFleet) -> tuple[str, str]:
    return fleet.engines["e0"].url, fleet.engines["e1"].url


def run_request(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    chat: bool,
    headers: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, Any], str]:
    """Send one request; return (text pieces, usage, finish reason)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        r = client.post(url + path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return [text], data["usage"], choice["finish_reason"]
    with client.stream("POST", url + path, json=body, headers=headers) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    pieces, usage, finish = [], None, None
    for event in events[:-1]:
        assert "error" not in event, event
        if event.get("usage") and not event["choices"]:
            usage = event["usage"]
            continue
        for choice in event["choices"]:
            piece = choice["delta"].get("content") if chat else choice["text"]
            if piece:
                pieces.append(piece)
            finish = choice.get("finish_reason") or finish
    assert usage is not None
    return pieces, usage, finish


CASES = [
    pytest.param(False, False, "text", id="completion-text"),
    pytest.param(False, True, "text", id="completion-text-stream"),
    pytest.param(False, False, "ids", id="completion-ids"),
    pytest.param(False, True, "ids", id="completion-ids-stream"),
    pytest.param(True, False, "text", id="chat"),
    pytest.param(True, True, "text", id="chat-stream"),
]


@pytest.mark.parametrize(("chat", "stream", "prompt_kind"), CASES)
def test_split_equals_whole(pd_fleet: SimFleet, chat: bool, stream: bool, prompt_kind: str) -> None:
    prefill_url, decode_url = urls(pd_fleet)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "ignore_eos": True}
    if chat:
        body["messages"] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": LONG_TEXT},
        ]
    else:
        body["prompt"] = LONG_TEXT if prompt_kind == "text" else TOKEN_PROMPT
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=30) as client:
        whole = run_request(client, decode_url, body, chat)
        rid = f"split-{chat}-{stream}-{prompt_kind}"
        first = client.post(
            prefill_url + ("/v1/chat/completions" if chat else "/v1/completions"),
            json=prefill_leg_body(body, chat),
            headers={"X-Request-Id": rid},
        )
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "e0"
        split = run_request(
            client,
            decode_url,
            {**body, "kv_transfer_params": params},
            chat,
            headers={"X-Request-Id": rid},
        )
    assert split[0] == whole[0]
    assert split[1] == whole[1]
    assert split[2] == whole[2] == "length"
    assert split[1]["completion_tokens"] == 20
    prompt_len = len(TOKEN_PROMPT) if prompt_kind == "ids" else None
    if prompt_len:
        assert split[1]["prompt_tokens"] == prompt_len
    assert split[1]["total_tokens"] == split[1]["prompt_tokens"] + 20


def test_nixl_read_moves_exactly_the_prompt_blocks(pd_fleet: SimFleet) -> None:
    prefill_url, decode_url = urls(pd_fleet)
    # A salt of its own: the other tests' requests left this prompt in the decode engine's
    # prefix cache, and cached blocks are not pulled again (test_sim_prefix_cache.py).
    body = {"model": MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 4, "cache_salt": "exact"}
    with httpx.Client(timeout=30) as client:
        before = client.get(decode_url + "/metrics").text
        params = client.post(
            prefill_url + "/v1/completions", json=prefill_leg_body(body, False)
        ).json()["kv_transfer_params"]
        (group,) = params["remote_block_ids"]  # one list per KV cache group, as vLLM 0.32
        blocks = len(group)
        assert blocks == -(-len(TOKEN_PROMPT) // 16) == 21
        assert params["remote_num_tokens"] == len(TOKEN_PROMPT)
        r = client.post(decode_url + "/v1/completions", json={**body, "kv_transfer_params": params})
        assert r.status_code == 200
        after = client.get(decode_url + "/metrics").text
        holds = admin(prefill_url, "GET", path="/sim/state").json()["holds"]
    moved = metric(after, "vllm:nixl_bytes_transferred_sum") - metric(
        before, "vllm:nixl_bytes_transferred_sum"
    )
    assert moved == blocks * 16384
    assert (
        metric(after, "vllm:nixl_bytes_transferred_count")
        - metric(before, "vllm:nixl_bytes_transferred_count")
        == 1
    )
    assert metric(after, "narwhal_sim:kv_verify_failures_total") == 0
    assert metric(after, "vllm:nixl_num_failed_transfers_total") == metric(
        before, "vllm:nixl_num_failed_transfers_total"
    )
    # The reader's notification freed the hold on the prefill engine.
    assert params["remote_request_id"] not in holds


def test_a_restarted_prefill_engine_is_met_anew_by_its_decode_engine(tmp_path) -> None:
    """vLLM gives every engine process a NIXL engine id of its own, so a decode engine
    handshakes anew with a restarted prefill engine. The simulated engines keep their fleet
    ids: a decode engine whose read from the old process's agent fails looks the prefill
    engine up again and reads from the new one, instead of failing the request (the first
    request after every prefill restart failed, and a router counted it against the decode
    engine)."""
    with running_fleet(tmp_path, 2) as fleet, httpx.Client(timeout=30) as client:
        prefill_url, decode_url = urls(fleet)

        def handoff(salt: str) -> httpx.Response:
            body = {"model": MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 4, "cache_salt": salt}
            first = client.post(prefill_url + "/v1/completions", json=prefill_leg_body(body, False))
            assert first.status_code == 200, first.text
            params = first.json()["kv_transfer_params"]
            return client.post(
                decode_url + "/v1/completions", json={**body, "kv_transfer_params": params}
            )

        whole = handoff("before")
        assert whole.status_code == 200, whole.text
        fleet.restart("e0")
        prefill_url = fleet.engines["e0"].url
        again = handoff("after")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
        metrics = client.get(decode_url + "/metrics").text
    # No failed transfer counted (the request did not fail); both reads moved verified data.
    assert metric(metrics, "vllm:nixl_num_failed_transfers_total") == 0
    assert metric(metrics, "vllm:nixl_bytes_transferred_count") == 2
    assert metric(metrics, "narwhal_sim:kv_verify_failures_total") == 0


def test_a_body_not_sent_as_json_is_refused_in_vllm_words(pd_fleet: SimFleet) -> None:
    """As vLLM 0.32's validate_json_request and its RequestValidationError handler answer
    (tests/interop/test_vllm_pd.py pins the words on the real engine)."""
    _, decode_url = urls(pd_fleet)
    raw = b'{"model": "%s", "prompt": "x", "max_tokens": 1}' % MODEL.encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for headers in ({}, {"Content-Type": "text/plain"}):
            r = httpx.post(decode_url + path, content=raw, headers=headers, timeout=30)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"] == {
                "message": f"1 validation error:\n  {NOT_JSON}",
                "type": "Bad Request",
                "param": None,
                "code": 400,
            }
    headers = {"Content-Type": "application/json; charset=utf-8"}
    r = httpx.post(decode_url + "/v1/completions", content=raw, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


def test_missing_or_invalid_params_prefill_locally(pd_fleet: SimFleet) -> None:
    _, decode_url = urls(pd_fleet)
    body = {"model": MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 6}
    with httpx.Client(timeout=30) as client:
        whole = client.post(decode_url + "/v1/completions", json=body).json()
        before = client.get(decode_url + "/metrics").text
        bad = {"do_remote_prefill": True, "remote_engine_id": "e0"}  # no blocks, host or port
        r = client.post(decode_url + "/v1/completions", json={**body, "kv_transfer_params": bad})
        none = client.post(
            decode_url + "/v1/completions", json={**body, "kv_transfer_params": None}
        )
        after = client.get(decode_url + "/metrics").text
    assert r.status_code == 200 and none.status_code == 200
    assert r.json()["choices"][0]["text"] == whole["choices"][0]["text"]
    assert none.json()["choices"][0]["text"] == whole["choices"][0]["text"]
    assert (
        metric(after, "narwhal_sim:local_prefill_fallbacks_total")
        - metric(before, "narwhal_sim:local_prefill_fallbacks_total")
        == 1
    )


def test_eos_and_min_tokens(tmp_path) -> None:
    with running_fleet(tmp_path, 2, sim={"time_scale": 50.0, "eos_prob": 0.2}) as fleet:
        url = fleet.engines["e0"].url
        with httpx.Client(timeout=30) as client:
            stopped = free = None
            for i in range(20):
                body = {"model": MODEL, "prompt": f"prompt number {i}", "max_tokens": 30}
                r = client.post(url + "/v1/completions", json=body).json()
                if r["choices"][0]["finish_reason"] == "stop":
                    stopped, free = body, r
                    break
            assert stopped is not None, "no request hit EOS at eos_prob 0.2"
            n = free["usage"]["completion_tokens"]
            assert n < 30
            forced = client.post(
                url + "/v1/completions", json={**stopped, "min_tokens": n + 1}
            ).json()
            assert forced["usage"]["completion_tokens"] >= n + 1
            ignored = client.post(
                url + "/v1/completions", json={**stopped, "ignore_eos": True}
            ).json()
            assert ignored["usage"]["completion_tokens"] == 30
            assert ignored["choices"][0]["finish_reason"] == "length"


def test_kill_prefill_before_pull_fails_decode_fast(tmp_path) -> None:
    with running_fleet(tmp_path, 2, sim={"time_scale": 50.0, "kv_read_timeout_s": 5.0}) as fleet:
        prefill_url, decode_url = urls(fleet)
        body = {"model": MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 8}
        with httpx.Client(timeout=30) as client:
            params = client.post(
                prefill_url + "/v1/completions", json=prefill_leg_body(body, False)
            ).json()["kv_transfer_params"]
            fleet.kill("e0")
            t0 = time.monotonic()
            r = client.post(
                decode_url + "/v1/completions", json={**body, "kv_transfer_params": params}
            )
            elapsed = time.monotonic() - t0
            metrics = client.get(decode_url + "/metrics").text
            state = admin(decode_url, "GET", path="/sim/state").json()
    assert r.status_code == 500
    assert "KV transfer failed" in r.json()["error"]["message"]
    assert elapsed < 5.0 + 2.0  # bounded by the KV read timeout, never a hang
    assert metric(metrics, "vllm:nixl_num_failed_transfers_total") == 1
    assert state["free_blocks"] == state["num_blocks"]  # nothing leaked on the decode side


def test_unpulled_hold_expires_at_its_lease(tmp_path) -> None:
    lease = 1.5
    with running_fleet(tmp_path, 2, sim={"time_scale": 50.0, "kv_lease_s": lease}) as fleet:
        prefill_url, decode_url = urls(fleet)
        body = {"model": MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 8}
        with httpx.Client(timeout=30) as client:
            t0 = time.monotonic()
            params = client.post(
                prefill_url + "/v1/completions", json=prefill_leg_body(body, False)
            ).json()["kv_transfer_params"]
            state = admin(prefill_url, "GET", path="/sim/state").json()
            if time.monotonic() - t0 < lease * 0.8:
                assert params["remote_request_id"] in state["holds"]
                (group,) = params["remote_block_ids"]
                assert state["free_blocks"] == state["num_blocks"] - len(group)
            deadline = time.monotonic() + lease + 5
            expired = 0.0
            while time.monotonic() < deadline:
                expired = metric(
                    client.get(prefill_url + "/metrics").text, "vllm:nixl_num_kv_expired_reqs_total"
                )
                if expired:
                    break
                time.sleep(0.1)
            assert expired == 1
            assert time.monotonic() - t0 >= lease * 0.9
            state = admin(prefill_url, "GET", path="/sim/state").json()
            assert state["holds"] == [] and state["free_blocks"] == state["num_blocks"]
            # A decode that comes after the lease must fail, never decode from freed blocks.
            late = client.post(
                decode_url + "/v1/completions", json={**body, "kv_transfer_params": params}
            )
            metrics = client.get(decode_url + "/metrics").text
    assert late.status_code == 500
    assert "does not match the prompt" in late.json()["error"]["message"]
    assert metric(metrics, "narwhal_sim:kv_verify_failures_total") == 1


def test_answer_blocks_cached_after_a_twin_hold_the_right_kv(pd_fleet: SimFleet) -> None:
    """The decode engine caches the full blocks an answer completed. Two answers to one prompt
    (a 40-token prompt: its third block partial at the pull): the shorter caches the third
    block, the longer then only the fourth, extended from its own third block. That block was
    partial when pulled; the fourth must still hold the KV a continuation of prompt + answer
    expects, or a request that hits it (request migration's continuation) fails verification."""
    prefill_url, decode_url = urls(pd_fleet)
    prompt = [300 + (i * 61) % 9000 for i in range(40)]

    def pd(client: httpx.Client, ids: list[int], max_tokens: int) -> list[int]:
        body = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        leg = client.post(prefill_url + "/v1/completions", json=prefill_leg_body(body, False))
        assert leg.status_code == 200, leg.text
        body["kv_transfer_params"] = leg.json()["kv_transfer_params"]
        answer = client.post(decode_url + "/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["token_ids"]

    with httpx.Client(timeout=30) as client:
        short = pd(client, prompt, 10)  # caches blocks 0-2 (prompt + 9 answer tokens: 49)
        long = pd(client, prompt, 40)  # blocks 0-2 cached already: caches block 3 alone
        assert long[:10] == short
        # Prompt + 30 answer tokens: 70 tokens, blocks 0-3 hit on the decode engine.
        assert pd(client, prompt + long[:30], 10) == long[30:40]


def test_a_decode_leg_aborted_before_its_pull_frees_the_prefill_hold(tmp_path) -> None:
    """As vLLM 0.32 (probed on the interop suite's engines): a decode leg whose client leaves
    before it pulled the KV (here queued behind a running request) sends the prefill engine the
    notification a pull would send, without the pull; the prefill engine frees the blocks at
    once, not when their lease expires."""
    lease = 30.0
    sim = {"max_num_seqs": 1, "kv_lease_s": lease}
    with running_fleet(tmp_path, 2, sim=sim) as fleet, httpx.Client(timeout=30) as client:
        prefill_url, decode_url = urls(fleet)
        # The decode engine's one sequence slot, taken by a long request of its own.
        admin(decode_url, "POST", {"slowdown": 20})
        long = {"model": MODEL, "prompt": "a", "max_tokens": 2000, "ignore_eos": True}
        with client.stream("POST", decode_url + "/v1/completions", json={**long, "stream": True}):
            body = {"model": MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 8}
            held = client.post(prefill_url + "/v1/completions", json=prefill_leg_body(body, False))
            params = held.json()["kv_transfer_params"]
            hold = params["remote_request_id"]
            assert hold in admin(prefill_url, "GET", path="/sim/state").json()["holds"]
            leg = {**body, "kv_transfer_params": params, "stream": True}
            with client.stream("POST", decode_url + "/v1/completions", json=leg) as queued:
                assert queued.status_code == 200
                assert wait_until(
                    lambda: admin(decode_url, "GET", path="/sim/state").json()["waiting"] == 1, 10
                )
            t0 = time.monotonic()  # the client has left (the stream closed)
            assert wait_until(
                lambda: hold not in admin(prefill_url, "GET", path="/sim/state").json()["holds"],
                10,
                interval=0.05,
            ), "the prefill engine still holds the KV"
            assert time.monotonic() - t0 < lease / 3
            decode_metrics = client.get(decode_url + "/metrics").text
            prefill_metrics = client.get(prefill_url + "/metrics").text
    assert metric(decode_metrics, "vllm:nixl_xfer_time_seconds_count") == 0  # nothing pulled
    assert metric(prefill_metrics, "vllm:nixl_num_kv_expired_reqs_total") == 0
