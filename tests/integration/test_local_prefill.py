"""Local prefill (routing.local_prefill) through narwhal-serve on a live simulated fleet: short
prompts are sent whole to a decode engine, long ones take the P/D path, and the local path keeps
the P/D path's guarantees (failures, deadlines, client disconnects, one journal record)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    MODEL,
    RouterProcess,
    admin,
    metric,
    running_fleet,
    running_router,
    sse_events,
)
from tests.integration.test_profile_v1 import profile, write_limits

pytestmark = pytest.mark.slow

MAX_LOCAL = 512
SHORT = [300 + (i * 7) % 9000 for i in range(100)]
LONG = [300 + (i * 13) % 9000 for i in range(1500)]
ROUTER_ARGS = ("--breaker-open-seconds", "0.3", "--health-interval", "0.2")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimFleet, Path, Path]]:
    """Four engines (e0, e1 prefill; e2, e3 decode), their profile, and a copy of the fleet
    file with local prefill on (same engines, so the same profile store serves both)."""
    directory = tmp_path_factory.mktemp("local-prefill")
    # A loose TPOT budget: the TTFT budget binds, so a short prompt goes local whenever that is
    # predicted faster (when TPOT binds, local must also leave the best handoff's slack: the
    # scheduler's unit tests cover that rule). The prefill engines step 4x slower, so a local
    # prefill is clearly faster than a handoff whatever the HTTP overheads learnt.
    base = {"time_scale": 10.0}
    slow = {"time_scale": 10.0, "slowdown": 4.0}
    with running_fleet(
        directory,
        4,
        sim=[slow, slow, base, base],
        ttft_s=3.0,
        tpot_s=2.0,
        first_token_timeout_s=1.0,
    ) as fleet:
        store = directory / "store.json"
        r = profile(
            fleet.fleet_path,
            write_limits(directory),
            store,
            prefill_lens="64,256,1024,2048",
            decode_lens="64,512",
            # As test_role_flipping: 16 tokens let a loaded host's staggered prefills overlap
            # every decode window, and the profiler refused the measurement.
            decode_tokens="48",
        )
        assert r.returncode == 0, r.stderr
        doc = json.loads(fleet.fleet_path.read_text())
        doc["routing"] = {"local_prefill": {"enabled": True, "max_prompt_tokens": MAX_LOCAL}}
        local_fleet = directory / "fleet-local.json"
        local_fleet.write_text(json.dumps(doc, indent=2))
        yield fleet, store, local_fleet


@pytest.fixture(autouse=True)
def clear_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    fleet, _, _ = request.getfixturevalue("stack")
    for engine in fleet.engines.values():
        if engine.alive:
            admin(engine.url, "DELETE")


def post(router: RouterProcess, prompt: list[int], stream: bool, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    body.update(stream=stream, **extra)
    return httpx.post(router.url + "/v1/completions", json=body, timeout=30)


def end_of(router: RouterProcess, response: httpx.Response) -> dict[str, Any]:
    rid = response.headers["x-request-id"]
    assert wait_until(lambda: rid in router.ends(), 10)
    return router.ends()[rid]


def test_short_prompts_go_local_and_long_ones_use_pd(stack: tuple[SimFleet, Path, Path]) -> None:
    _, store, local_fleet = stack
    directory = local_fleet.parent / "on"
    directory.mkdir()
    with running_router(directory, local_fleet, "--profiles", str(store)) as router:
        local_ids, pd_ids = [], []
        for i in range(6):
            stream = i % 2 == 0
            short = post(router, SHORT[i:] + SHORT[:i], stream)
            long = post(router, LONG[i:] + LONG[:i], stream)
            for response in (short, long):
                assert response.status_code == 200, response.text
                if stream:
                    events = sse_events(response)
                    assert events[-1] == "[DONE]"
                    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
                else:
                    text = response.json()["choices"][0]["text"]
                assert text
            local_ids.append(end_of(router, short))
            pd_ids.append(end_of(router, long))
        metrics = router.metrics()
    for end in local_ids:
        assert end["outcome"] == "ok" and end["mode"] == "local", end
        assert end["decode_engine"] in ("e2", "e3")
        assert end["prefill_engine"] == end["decode_engine"]
        assert end["handoff"] is None and end["handoff_first_token_s"] is None
        assert end["prompt_tokens"] == len(SHORT) and end["completion_tokens"] == 8
        assert [(a["leg"], a["outcome"]) for a in end["attempts"]] == [("local", "first_token")]
        assert end["t_prefill_start"] == end["t_decode_start"]
        assert end["t_prefill_start"] <= end["t_prefill_end"] <= end["t_first_token"]
    for end in pd_ids:
        assert end["outcome"] == "ok" and end["mode"] == "pd", end
        assert end["prefill_engine"] in ("e0", "e1") and end["decode_engine"] in ("e2", "e3")
        assert end["handoff"] == "nixl"
        assert end["prompt_tokens"] == len(LONG)
    locals_counted = sum(
        metric(metrics, "narwhal_local_prefills_total", engine=e) for e in ("e0", "e1", "e2", "e3")
    )
    assert locals_counted == len(local_ids)
    assert metric(metrics, "narwhal_local_prefills_total", engine="e0") == 0
    for e in ("e0", "e1", "e2", "e3"):
        for role in ("prefill", "decode"):
            assert metric(metrics, "narwhal_in_flight", engine=e, role=role) == 0


def test_without_the_option_nothing_goes_local(stack: tuple[SimFleet, Path, Path]) -> None:
    fleet, store, _ = stack
    directory = fleet.fleet_path.parent / "off"
    directory.mkdir()
    with running_router(directory, fleet.fleet_path, "--profiles", str(store)) as router:
        responses = [post(router, SHORT[i:] + SHORT[:i], i % 2 == 0) for i in range(6)]
        assert [r.status_code for r in responses] == [200] * 6
        for r in responses:
            if r.headers["content-type"].startswith("text/event-stream"):
                sse_events(r)
        ends = [end_of(router, r) for r in responses]
        metrics = router.metrics()
    for end in ends:
        assert end["mode"] == "pd" and end["prefill_engine"] in ("e0", "e1"), end
        assert end["handoff"] == "nixl"
    for e in ("e0", "e1", "e2", "e3"):
        assert metric(metrics, "narwhal_local_prefills_total", engine=e) == 0


def test_local_path_failures_deadlines_and_disconnects(
    stack: tuple[SimFleet, Path, Path],
) -> None:
    fleet, store, local_fleet = stack
    directory = local_fleet.parent / "faults"
    directory.mkdir()
    decodes = [fleet.engines[e].url for e in ("e2", "e3")]
    with running_router(directory, local_fleet, "--profiles", str(store), *ROUTER_ARGS) as router:
        # Both decode engines answer the next request with 503: the router tries each once
        # (max_decode_attempts 2), then answers 502 with one record naming both attempts.
        for url in decodes:
            admin(url, body={"fail_next": 1})
        failed = post(router, SHORT, stream=True)
        assert failed.status_code == 502, failed.text
        end = end_of(router, failed)
        assert end["outcome"] == "decode_failed" and end["mode"] == "local"
        assert sorted((a["leg"], a["engine"], a["outcome"]) for a in end["attempts"]) == [
            ("local", "e2", "failed"),
            ("local", "e3", "failed"),
        ]
        # First tokens held back past the deadline on both: 504, deadline_exceeded.
        for url in decodes:
            admin(url, body={"stall_first_token_s": 3.0})
        late = post(router, SHORT, stream=False)
        assert late.status_code == 504, late.text
        end = end_of(router, late)
        assert end["outcome"] == "deadline_exceeded" and end["mode"] == "local"
        assert [a["outcome"] for a in end["attempts"]] == ["deadline_exceeded"] * 2
        assert all(a["leg"] == "local" for a in end["attempts"])
        for url in decodes:
            admin(url, "DELETE")

        def breakers_closed() -> bool:
            return all(e["breaker"] == "closed" for e in router.admin_state()["engines"])

        if not wait_until(breakers_closed, 5):
            for _ in range(4):
                post(router, SHORT, stream=False)
            assert wait_until(breakers_closed, 5)
        # A client that hangs up mid-stream: client_abort, and the decode engine's leg is
        # released.
        body = {
            "model": MODEL,
            "prompt": SHORT,
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", router.url + "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            rid = response.headers["x-request-id"]
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
        assert wait_until(lambda: rid in router.ends(), 10)
        end = router.ends()[rid]
        assert end["outcome"] == "client_abort" and end["mode"] == "local", end

        def released() -> bool:
            text = router.metrics()
            return all(
                metric(text, "narwhal_in_flight", engine=e, role=role) == 0
                for e in ("e0", "e1", "e2", "e3")
                for role in ("prefill", "decode")
            )

        assert wait_until(released, 10)
        # Every request the router saw has exactly one record (ends() asserts no duplicate).
        starts = [r["id"] for r in router.records() if r["type"] == "request.start"]
        assert set(starts) == set(router.ends())
