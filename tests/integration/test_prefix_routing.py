"""KV-cache-aware routing through narwhal-serve on a live simulated fleet (issue 19): a request
sharing a long prefix with an earlier one goes to the engines holding it, whether the index
learns from the engines' KV events or from the router's own routing history, and an engine
that publishes nothing leaves routing correct. The journal and metrics carry predicted and
engine-reported cached tokens."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports
from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, RouterProcess, admin, metric, running_fleet, running_router
from tests.integration.test_profile_v1 import profile, write_limits

pytestmark = pytest.mark.slow

PREFIX_TOKENS = 2048  # 128 blocks of 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, Path]]:
    """Four engines (e0, e1 prefill; e2, e3 decode) publishing KV events, and their profile."""
    directory = tmp_path_factory.mktemp("prefix-routing")
    sim = {"time_scale": 10.0, "enable_prompt_tokens_details": True}
    # The tests hold prefill legs open (a stalled first token) to steer picks: not hedged.
    routing = {"hedge": {"enabled": False}}
    with running_fleet(directory, 4, sim=sim, kv_events=True, routing=routing) as fleet:
        store = directory / "store.json"
        r = profile(
            fleet.fleet_path,
            write_limits(directory),
            store,
            prefill_lens="256,1024,4096",
            decode_lens="512",
            # As test_role_flipping: 16 tokens let a loaded host's staggered prefills overlap
            # every decode window, and the profiler refused the measurement.
            decode_tokens="48",
        )
        assert r.returncode == 0, r.stderr
        yield fleet, store


def prompt(base: int, tail: int) -> list[int]:
    """A shared prefix (by ``base``) and a tail of its own (by ``tail``)."""
    head = [300 + (base * 7919 + i * 37) % 9000 for i in range(PREFIX_TOKENS)]
    return head + [9400 + (tail * 13 + i) % 500 for i in range(40)]


def post(router: RouterProcess, ids: list[int], stream: bool = False) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert wait_until(lambda: rid in router.ends(), 10)
    return router.ends()[rid]


def _bytes_pulled(fleet: SimFleet) -> float:
    """KV bytes the fleet's engines have pulled over NIXL, by their own metrics."""
    return sum(
        metric(
            httpx.get(engine.url + "/metrics", timeout=10).text,
            "vllm:nixl_bytes_transferred_sum",
        )
        for engine in fleet.engines.values()
    )


def _prefills_in_flight(router: RouterProcess) -> int:
    return sum(e["in_flight"]["prefill"] for e in router.admin_state()["engines"])


def _router_sees_idle(router: RouterProcess) -> bool:
    return all(
        not e["scraped"]["running"]
        and not e["scraped"]["waiting"]
        and e["in_flight"] == {"prefill": 0, "decode": 0}
        for e in router.admin_state()["engines"]
    )


def routed_by_prefix(router: RouterProcess, fleet: SimFleet, base: int) -> list[dict[str, Any]]:
    """Two prefixes sent at once, their prefill legs held open for a moment (so the second
    sees the first's engine busy and takes the other), then a request sharing each prefix, one
    after the other on an idle fleet: a cache-blind pick sends both of these to the same
    engine, whichever its profile reads faster."""
    for engine in ("e0", "e1"):
        admin(fleet.engines[engine].url, body={"stall_first_token_s": 0.5})
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, router, prompt(base, 0))
            # The second is sent while the first's prefill leg is held open (not after a
            # sleep: on a loaded host the first may not have been routed yet).
            assert wait_until(lambda: _prefills_in_flight(router) == 1, 10, interval=0.01)
            second = post(router, prompt(base + 1, 0))
            firsts = [first.result(), second]
    finally:
        for engine in ("e0", "e1"):
            admin(fleet.engines[engine].url, "DELETE")
    assert {e["prefill_engine"] for e in firsts} == {"e0", "e1"}, firsts
    seconds = []
    for b in (base, base + 1):
        # Idle as the router sees it, not only as the engines do: a scrape taken while the
        # previous request decoded shows its engine busy for up to --scrape-interval, and a
        # pick made then weighs that load against the blocks held (seen on a loaded host).
        assert wait_until(lambda: _router_sees_idle(router), 10), router.admin_state()
        seconds.append(post(router, prompt(b, 1), stream=b % 2 == 0))
    engines = [(e["prefill_engine"], e["decode_engine"]) for e in firsts]
    assert [(e["prefill_engine"], e["decode_engine"]) for e in seconds] == engines, seconds
    for second in seconds:
        assert second["outcome"] == "ok", second
        # The engine's own report: the whole prefix came from its cache, as predicted.
        assert second["cached_tokens_reported"] == PREFIX_TOKENS
        assert second["cached_tokens_predicted"] == PREFIX_TOKENS
        # The decode engine held the prefix too: only the tail's blocks move.
        assert second["kv_blocks_predicted"] == -(-(PREFIX_TOKENS + 40) // 16) - 128
    return firsts + seconds


def test_requests_follow_their_prefix_learnt_from_kv_events(stack: tuple[SimFleet, Path]) -> None:
    fleet, store = stack
    directory = fleet.fleet_path.parent / "events"
    directory.mkdir()
    pulled_before = _bytes_pulled(fleet)
    with running_router(directory, fleet.fleet_path, "--profiles", str(store)) as router:
        ends = routed_by_prefix(router, fleet, base=10)
        metrics = router.metrics()
    # What the journal says each handoff moved is what the decode engines' NIXL metrics say
    # they pulled (the sim's block: 16 tokens of 16,384 bytes).
    for end in ends:
        blocks = end.get("kv_blocks_predicted", -(-(PREFIX_TOKENS + 40) // 16))
        assert end["kv_bytes_moved"] == blocks * 16384, end
    moved = sum(end["kv_bytes_moved"] for end in ends)
    assert _bytes_pulled(fleet) - pulled_before == moved
    assert metric(metrics, "narwhal_kv_bytes_moved_total") == moved
    for engine in ("e0", "e1"):
        assert metric(metrics, "narwhal_kv_event_batches_total", engine=engine) > 0
        assert metric(metrics, "narwhal_prefix_index_blocks", engine=engine) >= 128
        assert metric(metrics, "narwhal_kv_event_resets_total", engine=engine) == 0
        # The dashboard's "Prefix index source" and NarwhalKVEventsNotFollowed read these.
        assert metric(metrics, "narwhal_kv_events_configured", engine=engine) == 1
        assert metric(metrics, "narwhal_kv_events_followed", engine=engine) == 1
        reported = metric(
            metrics, "narwhal_prefix_cached_tokens_total", engine=engine, source="reported"
        )
        predicted = metric(
            metrics, "narwhal_prefix_cached_tokens_total", engine=engine, source="predicted"
        )
        assert reported == predicted == PREFIX_TOKENS
        assert metric(metrics, "narwhal_prefix_prompt_tokens_total", engine=engine) == 2 * (
            PREFIX_TOKENS + 40
        )


def test_a_router_started_after_its_engines_knows_what_an_idle_one_holds(
    stack: tuple[SimFleet, Path],
) -> None:
    """The router reads each engine's replay buffer as it subscribes: an engine that cached a
    prompt before the router started and publishes nothing since (idle) was unknown to it
    until its next batch, and the prompt went cold to another engine (a QA pass)."""
    fleet, store = stack
    ids = prompt(base=77, tail=1)
    direct = httpx.post(
        fleet.engines["e1"].url + "/v1/completions",
        json={"model": MODEL, "prompt": ids, "max_tokens": 1},
        timeout=60,
    )
    assert direct.status_code == 200, direct.text
    directory = fleet.fleet_path.parent / "late-router"
    directory.mkdir()
    with running_router(directory, fleet.fleet_path, "--profiles", str(store)) as router:
        assert wait_until(
            lambda: (
                metric(router.metrics(), "narwhal_prefix_index_blocks", engine="e1")
                >= PREFIX_TOKENS // 16
            ),
            10,
        ), router.metrics()
        end = post(router, prompt(base=77, tail=2))
    assert end["prefill_engine"] == "e1", end
    assert end["cached_tokens_predicted"] == PREFIX_TOKENS, end


def _fleet_copy(fleet: SimFleet, directory: Path, events: dict[str, Any] | None) -> Path:
    """The fleet file with the engines' ``kv_events`` replaced (None: removed)."""
    doc = json.loads(fleet.fleet_path.read_text())
    for engine in doc["engines"]:
        engine.pop("kv_events", None)
        if events is not None and engine["id"] in events:
            engine["kv_events"] = events[engine["id"]]
    path = directory / "fleet.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def test_without_events_routing_history_serves(stack: tuple[SimFleet, Path]) -> None:
    fleet, store = stack
    directory = fleet.fleet_path.parent / "history"
    directory.mkdir()
    path = _fleet_copy(fleet, directory, None)
    with running_router(
        directory, path, "--profiles", str(store), "--skip-qualification"
    ) as router:
        routed_by_prefix(router, fleet, base=20)
        metrics = router.metrics()
    assert metric(metrics, "narwhal_kv_event_batches_total") == 0
    assert metric(metrics, "narwhal_kv_events_configured") == 0
    assert metric(metrics, "narwhal_kv_events_followed") == 0
    # What the index holds from history shows (it read 0 without events).
    assert metric(metrics, "narwhal_prefix_index_blocks") > 0


def test_a_chats_predicted_hit_is_what_its_engine_reports(stack: tuple[SimFleet, Path]) -> None:
    """A chat's keys are blocks of its text's bytes, learnt from routing history: what they
    stand for in tokens follows the bytes per token the engines' counts taught (the simulated
    tokenizer takes about one byte a token, where 4 were assumed: a quarter of the hit)."""
    fleet, store = stack
    directory = fleet.fleet_path.parent / "chat"
    directory.mkdir()
    path = _fleet_copy(fleet, directory, None)
    system = " ".join(f"rule{i % 97} applies to case{i}" for i in range(300))
    with running_router(
        directory, path, "--profiles", str(store), "--skip-qualification"
    ) as router:
        ends = []
        for turn in range(2):
            assert wait_until(lambda: _router_sees_idle(router), 10), router.admin_state()
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"turn {turn}"},
                ],
            }
            r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            assert wait_until(lambda rid=rid: rid in router.ends(), 10)
            ends.append(router.ends()[rid])
    second = ends[1]
    assert second["prefill_engine"] == ends[0]["prefill_engine"], ends
    reported, predicted = second["cached_tokens_reported"], second["cached_tokens_predicted"]
    assert reported > 0.8 * second["prompt_tokens"], second
    assert abs(predicted - reported) <= 0.1 * reported, second


def test_an_engine_that_publishes_nothing_leaves_routing_correct(
    stack: tuple[SimFleet, Path],
) -> None:
    """e0's events go to a port nobody publishes on: its entries come from routing history;
    e1's from its events. Both prefixes still find their engines, nothing fails."""
    fleet, store = stack
    directory = fleet.fleet_path.parent / "silent"
    directory.mkdir()
    original = json.loads(fleet.fleet_path.read_text())
    events = {e["id"]: e["kv_events"] for e in original["engines"]}
    dead, dead_replay = free_ports(2)
    events["e0"] = {
        "endpoint": f"tcp://127.0.0.1:{dead}",
        "replay_endpoint": f"tcp://127.0.0.1:{dead_replay}",
    }
    path = _fleet_copy(fleet, directory, events)
    with running_router(
        directory, path, "--profiles", str(store), "--skip-qualification"
    ) as router:
        ends = routed_by_prefix(router, fleet, base=30)
        metrics = router.metrics()
    assert all(e["outcome"] == "ok" for e in ends)
    assert metric(metrics, "narwhal_kv_event_batches_total", engine="e0") == 0
    assert metric(metrics, "narwhal_kv_event_batches_total", engine="e1") > 0
    # What NarwhalKVEventsNotFollowed reads: e0 is meant to publish, is not followed, and
    # prefilled prompts (its condition, the 10 minutes aside); e1 is followed.
    assert metric(metrics, "narwhal_kv_events_configured", engine="e0") == 1
    assert metric(metrics, "narwhal_kv_events_followed", engine="e0") == 0
    assert metric(metrics, "narwhal_prefix_prompt_tokens_total", engine="e0") > 0
    assert metric(metrics, "narwhal_kv_events_followed", engine="e1") == 1


def test_an_engine_that_publishes_garbage_is_counted_and_routed_by_history(
    stack: tuple[SimFleet, Path],
) -> None:
    """e0's events come from a publisher that sends only unreadable batches, at a step's
    rate: each is counted (``narwhal_kv_event_unreadable_batches_total``) and resets e0's
    entries, the log warns once rather than per batch, and routing stays correct."""
    import threading

    import zmq

    fleet, store = stack
    directory = fleet.fleet_path.parent / "garbage"
    directory.mkdir()
    original = json.loads(fleet.fleet_path.read_text())
    events = {e["id"]: e["kv_events"] for e in original["engines"]}
    (port,) = free_ports(1)
    events["e0"] = {"endpoint": f"tcp://127.0.0.1:{port}"}
    path = _fleet_copy(fleet, directory, events)
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def publish() -> None:
        seq = 0
        while not stop.wait(0.02) and seq < 3000:  # bounded: 60 s at most
            publisher.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
            seq += 1

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        with running_router(
            directory, path, "--profiles", str(store), "--skip-qualification"
        ) as router:
            assert wait_until(
                lambda: (
                    metric(
                        router.metrics(), "narwhal_kv_event_unreadable_batches_total", engine="e0"
                    )
                    >= 20
                ),
                30,
            )
            ends = routed_by_prefix(router, fleet, base=40)
            metrics = router.metrics()
    finally:
        stop.set()
        thread.join(5)
        publisher.close(linger=0)
        context.term()
    assert all(e["outcome"] == "ok" for e in ends)
    unreadable = metric(metrics, "narwhal_kv_event_unreadable_batches_total", engine="e0")
    assert metric(metrics, "narwhal_kv_event_resets_total", engine="e0") >= unreadable >= 20
    assert metric(metrics, "narwhal_kv_event_batches_total", engine="e0") == 0
    assert metric(metrics, "narwhal_kv_events_followed", engine="e0") == 0
    assert metric(metrics, "narwhal_kv_event_unreadable_batches_total", engine="e1") == 0
    assert metric(metrics, "narwhal_background_task_restarts_total") == 0
    warnings = [
        line for line in router.log_path.read_text().splitlines() if "engine e0: KV event" in line
    ]
    assert 1 <= len(warnings) <= 2, warnings


def test_a_restarted_engine_loses_its_entries_when_it_answers_again(tmp_path: Path) -> None:
    """An engine that comes back after nothing listened is a new process, its cache empty: its
    entries go as its health probe passes again, not when its first event batch (which a
    restarted engine sent nothing never publishes) shows its sequence starting over; the other
    engine keeps its own."""
    sim = {"time_scale": 10.0, "enable_prompt_tokens_details": True}
    with (
        running_fleet(tmp_path, 2, sim=sim, kv_events=True) as fleet,
        running_router(
            tmp_path, fleet.fleet_path, "--skip-qualification", "--health-interval", "0.2"
        ) as router,
    ):

        def ready() -> bool:
            return httpx.get(router.url + "/ready", timeout=5).status_code == 200

        assert wait_until(ready, 10)
        post(router, prompt(50, 0))

        def blocks(engine: str) -> float:
            return metric(router.metrics(), "narwhal_prefix_index_blocks", engine=engine)

        assert wait_until(lambda: blocks("e0") > 0 and blocks("e1") > 0, 10)
        held = blocks("e1")
        fleet.restart("e0")
        assert wait_until(lambda: blocks("e0") == 0, 10), blocks("e0")
        assert blocks("e1") == held
        assert "answers again after being unreachable" in router.log_path.read_text()
        # And it serves, its cache refilled by what it is sent.
        assert wait_until(ready, 10)
        assert post(router, prompt(50, 1))["outcome"] == "ok"
