"""The simulated engine's prefix cache and KV events, against real engine processes: hits
reported as vLLM reports them, the decode side pulling only the blocks it lacks, and the
events a subscriber rebuilds the engines' caches from (replayed after a gap, reset on a
restart)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.contract import load_fleet
from narwhal.engines.kv_events import KVEventSubscriber, ReadEvent, apply_kv_events
from narwhal.engines.legs import prefill_leg_body
from narwhal.routing.prefix import PrefixIndex, chain_keys
from narwhal.testing.fleet import SimFleet
from tests.helpers import MODEL, TEST_TIME_SCALE, metric, running_fleet

BLOCK = 16
SHARED = [300 + (i * 37) % 9000 for i in range(160)]  # 10 blocks


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    directory = tmp_path_factory.mktemp("prefix")
    with running_fleet(
        directory,
        2,
        kv_events=True,
        sim={"time_scale": TEST_TIME_SCALE, "enable_prompt_tokens_details": True},
    ) as running:
        yield running


def _prompt(tail: int, salt_ids: int = 0) -> list[int]:
    return SHARED + [5000 + salt_ids * 100 + i for i in range(tail)]


def _pd(
    client: httpx.Client, p: str, d: str, prompt: list[int], **extra: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, **extra}
    r = client.post(p + "/v1/completions", json=prefill_leg_body(body, chat=False))
    assert r.status_code == 200, r.text
    first = r.json()
    r = client.post(
        d + "/v1/completions", json={**body, "kv_transfer_params": first["kv_transfer_params"]}
    )
    assert r.status_code == 200, r.text
    return first, r.json()


def _cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_hits_are_reported_and_only_missing_blocks_move(fleet: SimFleet) -> None:
    p, d = fleet.engines["e0"].url, fleet.engines["e1"].url
    with httpx.Client(timeout=30) as client:
        descriptors = metric(client.get(d + "/metrics").text, "vllm:nixl_num_descriptors_sum")
        first_p, first_d = _pd(client, p, d, _prompt(7, 1))
        assert _cached(first_p) == 0 and _cached(first_d) == 0
        pulled = metric(client.get(d + "/metrics").text, "vllm:nixl_num_descriptors_sum")
        assert pulled - descriptors == 11  # 167 tokens: 11 blocks, all pulled
        # Same 160-token prefix (10 blocks), another tail: both engines hold the prefix.
        second_p, second_d = _pd(client, p, d, _prompt(40, 2))
        assert _cached(second_p) == 160
        assert second_p["kv_transfer_params"]["remote_prefill_cached_tokens"] == 160
        # The decode side reports the prefill engine's hits (vLLM), not its own.
        assert _cached(second_d) == 160
        after = metric(client.get(d + "/metrics").text, "vllm:nixl_num_descriptors_sum")
        assert after - pulled == 13 - 10  # 200 tokens: 13 blocks, 10 already on the decode side
        # The same text either way: a hit changes timing, never tokens.
        whole = client.post(
            p + "/v1/completions",
            json={"model": MODEL, "prompt": _prompt(40, 2), "max_tokens": 8, "ignore_eos": True},
        ).json()
        assert whole["choices"][0]["text"] == second_d["choices"][0]["text"]
        assert _cached(whole) == 192  # 12 full blocks cached by now; the last token computed
        text = client.get(p + "/metrics").text
        assert metric(text, "vllm:prefix_cache_hits_total") >= 160 + 192
        assert metric(text, "vllm:prefix_cache_queries_total") >= 167 + 200 + 200
        # A salt keeps a tenant's prompt apart.
        salted, _ = _pd(client, p, d, _prompt(40, 2), cache_salt="tenant-b")
        assert _cached(salted) == 0


def test_events_rebuild_the_engines_caches(fleet: SimFleet) -> None:
    contract = load_fleet(str(fleet.fleet_path)).contract
    p, d = fleet.engines["e0"].url, fleet.engines["e1"].url

    async def run() -> tuple[PrefixIndex, dict[str, KVEventSubscriber]]:
        index = PrefixIndex(BLOCK)
        subscribers: dict[str, KVEventSubscriber] = {}
        for spec in contract.engines:
            assert spec.kv_events is not None
            index.add_engine(spec.id, 4096)
            index.set_precise(spec.id, True)

            def apply(events: list[ReadEvent], engine: str = spec.id) -> None:
                apply_kv_events(index, engine, events)  # as the router applies them

            subscribers[spec.id] = KVEventSubscriber(
                spec.id,
                spec.kv_events.endpoint,
                spec.kv_events.replay_endpoint,
                spec.kv_events.topic,
                apply,
                lambda engine=spec.id: index.clear(engine),
            )
        # Subscribed after the first test's requests: their blocks come from the replay buffer.
        tasks = [asyncio.ensure_future(s.run()) for s in subscribers.values()]
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
                prompt = [7000 + i for i in range(70)]
                r = await client.post(
                    p + "/v1/completions",
                    json=prefill_leg_body({**body, "prompt": prompt}, chat=False),
                )
                params = r.json()["kv_transfer_params"]
                r = await client.post(
                    d + "/v1/completions",
                    json={**body, "prompt": prompt, "kv_transfer_params": params},
                )
                assert r.status_code == 200
                for attempt in range(200):
                    if index.match(chain_keys(prompt, BLOCK), 0.0) == {"e0": 4, "e1": 4}:
                        break
                    if attempt % 20 == 19:
                        # A SUB socket connects asynchronously: a batch published before it
                        # had is lost to it, and the next one seen replays it. On a loaded
                        # host either engine's only batch can be the lost one (the decode
                        # engine's was, under two test workers): each gets a request of its
                        # own, whose batch brings the lost one back.
                        nudge = [8000 + attempt + i for i in range(BLOCK)]
                        await client.post(
                            p + "/v1/completions",
                            json=prefill_leg_body({**body, "prompt": nudge}, chat=False),
                        )
                        await client.post(d + "/v1/completions", json={**body, "prompt": nudge})
                    await asyncio.sleep(0.05)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return index, subscribers

    index, subscribers = asyncio.run(run())
    assert index.match(chain_keys([7000 + i for i in range(70)], BLOCK), 0.0) == {
        "e0": 4,
        "e1": 4,
    }
    # The first test's prompts, published before the subscription, were replayed.
    shared = chain_keys(_prompt(40, 2), BLOCK)
    assert index.match(shared, 0.0)["e0"] >= 12
    assert all(s.resets == 0 and s.bad_payloads == 0 for s in subscribers.values())
