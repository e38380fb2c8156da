"""The simulated engines behind the real ``vllm-router`` (PyPI, 0.1.17) in P/D mode.

The router prefills on e0 and decodes on e1 with the kv_transfer_params it relays: what the
client gets back must be exactly what e1 returns for the same request sent whole, and the KV
must really have moved over NIXL (one READ on the decode engine per routed request).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports
from narwhal.testing.procs import wait_until
from narwhal.testing.routers import peer_router_command, router_ready
from tests.helpers import MODEL, admin, metric, running_fleet, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.interop]

ROUTER = Path(sys.executable).parent / "vllm-router"
LONG_TEXT = " ".join(f"item {i} of the routed prompt" for i in range(40))
COUNT = "vllm:nixl_bytes_transferred_count"


class Routed:
    def __init__(self, fleet: SimFleet, url: str, log: Path) -> None:
        self.fleet = fleet
        self.url = url
        self.log = log
        self.prefill = fleet.engines["e0"].url
        self.decode = fleet.engines["e1"].url


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routed]:
    if not ROUTER.exists():
        pytest.skip("vllm-router is not installed in this environment")
    directory = tmp_path_factory.mktemp("router")
    with running_fleet(directory, 2) as fleet:
        port, prometheus_port = free_ports(2)
        log_path = directory / "router.log"
        url = f"http://127.0.0.1:{port}"
        argv = peer_router_command(
            ROUTER,
            [fleet.engines["e0"].url],
            [fleet.engines["e1"].url],
            port,
            prometheus_port,
            log_level=None,
        )
        with procs.running(
            argv,
            log_path,
            ready=functools.partial(router_ready, url, peer=True),
            name="vllm-router",
            stop_timeout=10,
        ):
            yield Routed(fleet, url, log_path)


def run(
    client: httpx.Client, url: str, body: dict[str, Any], chat: bool
) -> tuple[list[str], dict[str, Any], str]:
    """One request: (text pieces, usage, finish reason)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        r = client.post(url + path, json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        return (
            [choice["message"]["content"] if chat else choice["text"]],
            data["usage"],
            choice["finish_reason"],
        )
    with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events and events[-1] == "[DONE]", events[-3:]
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    finish = ""
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
    assert usage is not None, "no usage chunk"
    return pieces, usage, finish


CASES = [
    pytest.param(False, False, id="completion"),
    pytest.param(False, True, id="completion-stream"),
    pytest.param(True, False, id="chat"),
    pytest.param(True, True, id="chat-stream"),
]


@pytest.mark.parametrize(("chat", "stream"), CASES)
def test_routed_equals_decode_engine_whole(routed: Routed, chat: bool, stream: bool) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "ignore_eos": True}
    if chat:
        body["messages"] = [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": LONG_TEXT},
        ]
    else:
        body["prompt"] = LONG_TEXT
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    # Salted, each case and the reference apart: the engines cache prefixes, and a prompt
    # either engine already holds would be neither prefilled nor pulled in full (a salt
    # changes no token).
    body["cache_salt"] = f"routed-{chat}-{stream}"
    with httpx.Client(timeout=60) as client:
        whole = run(client, routed.decode, {**body, "cache_salt": f"whole-{chat}-{stream}"}, chat)
        decode_before = client.get(routed.decode + "/metrics").text
        prefill_before = client.get(routed.prefill + "/metrics").text
        via_router = run(client, routed.url, body, chat)
        decode_after = client.get(routed.decode + "/metrics").text
        prefill_after = client.get(routed.prefill + "/metrics").text

    def delta(name: str, after: str, before: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert via_router[0] == whole[0]  # chunk by chunk when streamed
    assert via_router[1] == whole[1]
    assert via_router[2] == whole[2] == "length"
    assert whole[1]["completion_tokens"] == 12
    # The KV really moved: one NIXL READ on the decode engine, verified, no local fallback.
    assert delta(COUNT, decode_after, decode_before) == 1
    assert delta("vllm:nixl_num_failed_transfers_total", decode_after, decode_before) == 0
    assert delta("narwhal_sim:kv_verify_failures_total", decode_after, decode_before) == 0
    assert delta("narwhal_sim:local_prefill_fallbacks_total", decode_after, decode_before) == 0
    moved = delta("vllm:nixl_bytes_transferred_sum", decode_after, decode_before)
    assert moved == -(-whole[1]["prompt_tokens"] // 16) * 16384
    # The prompt was computed on the prefill engine, which finished a one-token leg...
    assert (
        delta("vllm:prompt_tokens_total", prefill_after, prefill_before)
        == whole[1]["prompt_tokens"]
    )
    finished = "vllm:request_success_total"
    assert delta(finished, prefill_after, prefill_before, finished_reason="length") == 1
    assert delta("vllm:generation_tokens_total", prefill_after, prefill_before) == 1
    # ...and not on the decode engine.
    assert delta("vllm:prompt_tokens_total", decode_after, decode_before) == 0
    # The decode engine's READ notification released the prefill engine's hold.
    assert wait_until(
        lambda: admin(routed.prefill, "GET", path="/sim/state").json()["holds"] == [], 5
    )


def test_each_routed_request_moves_kv_once(routed: Routed) -> None:
    n = 3
    with httpx.Client(timeout=60) as client:
        before = client.get(routed.decode + "/metrics").text
        texts = []
        for i in range(n):
            body = {"model": MODEL, "prompt": f"{LONG_TEXT} #{i}", "max_tokens": 4}
            r = client.post(routed.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        after = client.get(routed.decode + "/metrics").text
    assert metric(after, COUNT) - metric(before, COUNT) == n
    assert len(set(texts)) == n  # different prompts, different (deterministic) outputs
    for engine in routed.fleet.engines.values():
        assert engine.alive
