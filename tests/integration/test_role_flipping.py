"""Role flipping on the live simulated fleet: traffic turns from prefill-heavy to
decode-heavy, an engine moves to decode, no request fails, and the journal, the state
timeline and the metrics agree on it."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import pytest

from narwhal.testing.procs import wait_until
from tests.helpers import MODEL, metric, running_fleet, running_router
from tests.integration.test_profile_v1 import profile, write_limits

pytestmark = pytest.mark.slow

SCALE = 10.0


def test_traffic_shift_flips_an_engine_toward_decode(tmp_path: Path) -> None:
    roles = {
        "enabled": True,
        "min_prefill": 1,
        "min_decode": 1,
        "cooldown_s": 1.0,
        "dwell_s": 1.0,
        "tick_s": 0.5,
    }
    with running_fleet(
        tmp_path,
        4,
        sim={"time_scale": SCALE},
        ttft_s=10 / SCALE,
        tpot_s=0.3 / SCALE,
        first_token_timeout_s=8.5 / SCALE,
        role_control=roles,
        # Admission queues rather than rejects: the point is that no request fails.
        routing={"admission": "queue", "queue_max": 64, "queue_timeout_s": 10.0},
    ) as fleet:
        store = tmp_path / "store.json"
        r = profile(
            fleet.fleet_path,
            write_limits(tmp_path),
            store,
            prefill_lens="128,1024,4096",
            decode_lens="128,512",
            # Long enough that the 4 probes decode together for a while however a loaded host
            # staggers their prefills (16 tokens: the profiler found no such window, a flake).
            decode_tokens="48",
        )
        assert r.returncode == 0, r.stderr
        with running_router(tmp_path, fleet.fleet_path, "--profiles", str(store)) as router:
            client = httpx.Client(timeout=60)

            def send(prompt_len: int, max_tokens: int, i: int) -> int:
                prompt = [300 + (i * 31 + k) % 9000 for k in range(prompt_len)]
                return client.post(
                    router.url + "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ).status_code

            statuses: list[int] = []
            with concurrent.futures.ThreadPoolExecutor(24) as pool:
                # Phase 1: code-assistant shape, long prompts and short answers.
                statuses += list(pool.map(lambda i: send(2048, 4, i), range(8)))
                # Phase 2: chat shape, short prompts and long answers, many at once.
                # About 15 s alone; test_replicas' copy of this loop ran at a third of that
                # pace beside other suites in a fresh clone's make test (2026-12-07).
                deadline = time.monotonic() + 90
                flipped = False
                i = 1000
                while time.monotonic() < deadline and not flipped:
                    statuses += list(pool.map(lambda j: send(128, 150, j), range(i, i + 24)))
                    i += 24
                    flipped = any(rec["type"] == "role.flip" for rec in router.records())
            client.close()
            assert flipped, "no flip toward decode within 90 s of decode-heavy traffic"
            # Roles pinned: the controller (ticking every 0.5 s) flips no more, so the state,
            # the metrics and the journal read below describe the same flips.
            pinned = httpx.post(
                router.url + "/admin/roles/pin",
                json={"pinned": True},
                headers={"Authorization": f"Bearer {router.admin_token}"},
                timeout=10,
            )
            assert pinned.status_code == 200 and pinned.json() == {"pinned": True}
            state = router.admin_state()
            metrics = router.metrics()
            n = len(statuses)
            assert wait_until(lambda: len(router.ends()) == n, 10)
            # Each flip's record is written behind it by the journal's thread.
            flipped_n = len(state["roles"]["history"])
            assert wait_until(
                lambda: sum(r["type"] == "role.flip" for r in router.records()) == flipped_n, 10
            )
    assert statuses == [200] * len(statuses)
    ends = router.ends()
    assert all(e["outcome"] == "ok" for e in ends.values())
    flips = [rec for rec in router.records() if rec["type"] == "role.flip"]
    first = flips[0]
    assert (first["from_role"], first["to_role"]) == ("prefill", "decode")
    assert first["pressures"]["decode"] > 0.85 and first["forced"] is False
    assert "decode pressure" in first["reason"]
    # Timeline, journal and metrics agree.
    history = state["roles"]["history"]
    assert [(h["engine"], h["to_role"]) for h in history] == [
        (f["engine"], f["to_role"]) for f in flips
    ]
    roles_now = {e["id"]: e["role"] for e in state["engines"]}
    assert roles_now[first["engine"]] in ("decode", "prefill")
    assert metric(metrics, "narwhal_flips_total", from_role="prefill", to_role="decode") == sum(
        1 for f in flips if f["from_role"] == "prefill"
    )
    assert metric(metrics, "narwhal_role_generation") == state["role_generation"] == len(flips)
    for engine, role in roles_now.items():
        assert metric(metrics, "narwhal_engine_role", engine=engine, role=role) == 1
    json.dumps(state)  # the admin view is plain JSON


def test_operator_can_pin_and_force_a_flip(tmp_path: Path) -> None:
    with (
        running_fleet(tmp_path, 4, sim={"time_scale": 50.0}) as fleet,
        running_router(tmp_path, fleet.fleet_path) as router,
    ):
        headers = {"Authorization": f"Bearer {router.admin_token}"}
        assert (
            httpx.post(
                router.url + "/admin/roles/flip", json={"engine": "e0", "to": "decode"}
            ).status_code
            == 401
        )
        r = httpx.post(router.url + "/admin/roles/pin", json={"pinned": True}, headers=headers)
        assert r.status_code == 200 and r.json() == {"pinned": True}
        r = httpx.post(
            router.url + "/admin/roles/flip", json={"engine": "e0", "to": "decode"}, headers=headers
        )
        assert r.status_code == 200 and r.json()["flipped"] is True
        # e1 is now the only prefill engine: min_prefill 1 forbids moving it.
        r = httpx.post(
            router.url + "/admin/roles/flip", json={"engine": "e1", "to": "decode"}, headers=headers
        )
        assert r.status_code == 409
        r = httpx.post(
            router.url + "/admin/roles/flip", json={"engine": "e9", "to": "decode"}, headers=headers
        )
        assert r.status_code == 404
        ok = httpx.post(
            router.url + "/v1/completions",
            timeout=30,
            json={"model": MODEL, "prompt": "after the flip", "max_tokens": 3},
        )
        assert ok.status_code == 200
        assert wait_until(lambda: any(r["type"] == "role.flip" for r in router.records()), 5)
        records = router.records()
        assert any(r["type"] == "role.pin" and r["pinned"] is True for r in records)
        flip = next(r for r in records if r["type"] == "role.flip")
        assert flip["forced"] is True and flip["engine"] == "e0"
        state = router.admin_state()
        assert state["roles"]["pinned"] is True
        assert {e["id"]: e["role"] for e in state["engines"]}["e0"] == "decode"
