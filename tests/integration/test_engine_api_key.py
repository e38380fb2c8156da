"""Engines started with vLLM's ``--api-key``: narwhal-serve sends the key the fleet's
``engine.api_key_file`` names on every engine request, and without it answers a clear 502;
``/tokenize`` and ``/detokenize`` pass through the router to an engine unchanged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.check.collect import Collector
from narwhal.check.evidence import ModelsResult
from narwhal.check.settings import CheckSettings
from narwhal.clock import MonotonicClock
from narwhal.contract import load_fleet
from narwhal.profiler.runner import profile_fleet
from narwhal.profiles.store import ProfilingLimits, ProfilingPlan
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports
from narwhal.testing.procs import http_ok, wait_until
from tests.helpers import (
    MODEL,
    RouterProcess,
    metric,
    running_fleet,
    running_router,
    sse_events,
)

ENGINE_KEY = "engine-key-7f3a9c2e51"
CLIENT_KEY = "client-key-0b1d"
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


@dataclass
class Stack:
    fleet: SimFleet
    keyed: RouterProcess  # its fleet names the key file; clients need CLIENT_KEY
    keyed_fleet_path: Path
    keyless: RouterProcess  # the same engines, a fleet without the key file


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp("engine-api-key")
    with running_fleet(directory, 2, engine_api_key=ENGINE_KEY) as fleet:
        keyed_dir, keyless_dir = directory / "keyed", directory / "keyless"
        keyed_dir.mkdir()
        keyless_dir.mkdir()
        (keyed_dir / "secrets").mkdir()
        (keyed_dir / "secrets" / "engine.key").write_text(ENGINE_KEY + "\n")
        doc = json.loads(fleet.fleet_path.read_text())
        doc["engine"]["api_key_file"] = "secrets/engine.key"  # relative to the fleet file
        keyed_fleet = keyed_dir / "fleet.json"
        keyed_fleet.write_text(json.dumps(doc))
        with (
            running_router(keyed_dir, keyed_fleet, "--api-key", CLIENT_KEY) as keyed,
            running_router(keyless_dir, fleet.fleet_path) as keyless,
        ):
            yield Stack(fleet, keyed, keyed_fleet, keyless)


def _completion(router: RouterProcess, **body: Any) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6, **body},
        headers=CLIENT,
        timeout=30,
    )


def test_the_engines_refuse_a_request_without_the_key(stack: Stack) -> None:
    url = stack.fleet.engines["e0"].url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    # vLLM guards /v1 only: health, metrics and tokenize stay open.
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    auth = {"Authorization": f"Bearer {ENGINE_KEY}"}
    assert httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=10).is_success


def test_requests_through_the_router_carry_the_engine_key(stack: Stack) -> None:
    router = stack.keyed
    whole = _completion(router)
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 6
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 5,
            "stream": True,
        },
        headers=CLIENT,
        timeout=30,
    ) as streamed:
        assert streamed.status_code == 200
        streamed.read()
        events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    assert sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content"))
    assert wait_until(lambda: len(router.ends()) == 2, 10)  # journaled behind the answers
    assert [r["outcome"] for r in router.ends().values()] == ["ok", "ok"]
    # Probes and scrapes work (the router's view): healthy engines, fresh loads, no errors.
    engines = router.admin_state()["engines"]
    text = router.metrics()
    for engine_id in ("e0", "e1"):
        assert metric(text, "narwhal_engine_healthy", engine=engine_id) == 1
        assert metric(text, "narwhal_engine_scrape_errors_total", engine=engine_id) == 0
        scraped = next(e for e in engines if e["id"] == engine_id)["scraped"]
        assert scraped["age_s"] is not None


def test_without_the_key_file_the_router_answers_a_clear_502_and_journals_it(
    stack: Stack,
) -> None:
    router = stack.keyless
    for stream in (False, True):
        answer = _completion(router, stream=stream)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["type"] == "upstream_error" and error["code"] == "engine_unauthorized"
        assert "engine.api_key_file" in error["message"] and "401" in error["message"]
        assert "Traceback" not in answer.text
    # The journal is written behind the answers: wait for both records.
    assert wait_until(lambda: len(router.ends()) == 2, 10)
    ends = list(router.ends().values())
    for end in ends:
        assert end["outcome"] == "internal_error"
        assert "engine.api_key_file" in end["error"]


def test_tokenize_and_detokenize_pass_through_unchanged(stack: Stack) -> None:
    router, engine = stack.keyed.url, stack.fleet.engines["e1"].url
    before = len(stack.keyed.records())
    bodies: dict[str, list[dict[str, Any]]] = {
        "/tokenize": [
            {"model": MODEL, "prompt": PROMPT},
            {"prompt": PROMPT, "return_token_strs": True, "add_special_tokens": False},
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello there"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ],
        "/detokenize": [{"model": MODEL, "tokens": [300, 301, 72, 105]}],
    }
    for path, cases in bodies.items():
        for body in cases:
            direct = httpx.post(engine + path, json=body, timeout=10)
            through = httpx.post(router + path, json=body, headers=CLIENT, timeout=10)
            assert direct.status_code == through.status_code == 200
            assert through.json() == direct.json()
    shape = httpx.post(router + "/tokenize", json=bodies["/tokenize"][1], headers=CLIENT).json()
    assert set(shape) == {"count", "max_model_len", "tokens", "token_strs"}
    assert shape["count"] == len(shape["tokens"]) == len(shape["token_strs"])
    # The engine's own 4xx comes through, status and body.
    for path, bad in (
        ("/tokenize", {"model": MODEL, "prompt": 5}),
        (
            "/tokenize",
            {"messages": [], "add_generation_prompt": True, "continue_final_message": True},
        ),
        ("/detokenize", {"tokens": [-1]}),
        ("/tokenize", {"model": "another-model", "prompt": "x"}),
    ):
        direct = httpx.post(engine + path, json=bad, timeout=10)
        through = httpx.post(router + path, json=bad, headers=CLIENT, timeout=10)
        assert 400 <= direct.status_code < 500
        assert (through.status_code, through.json()) == (direct.status_code, direct.json())
    # Client authentication as on /v1, and nothing journaled: these are not generations.
    refused = httpx.post(router + "/tokenize", json={"prompt": "x"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert len(stack.keyed.records()) == before


def test_the_key_never_reaches_the_journal_or_the_logs(stack: Stack) -> None:
    # After the other tests: every request, both routers, start-up included.
    for router in (stack.keyed, stack.keyless):
        assert router.journal.read_text().count("request.end") >= 1
        assert ENGINE_KEY not in router.journal.read_text()
        assert ENGINE_KEY not in router.log_path.read_text()


def test_tokenize_with_no_engine_answering_is_a_503(tmp_path: Path) -> None:
    ports = free_ports(4)
    doc = local_fleet_document(ports[:2], ports[2:])  # nothing listens on these ports
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(doc))
    with running_router(tmp_path, fleet, wait_ready=False) as router:
        assert wait_until(lambda: http_ok(router.url + "/health"), 20, 0.05)
        answer = httpx.post(router.url + "/tokenize", json={"prompt": "x"}, timeout=20)
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "service_unavailable"
    assert answer.headers["retry-after"] == "1"


def test_narwhal_check_and_narwhal_profile_send_the_key(stack: Stack) -> None:
    keyed = load_fleet(stack.keyed_fleet_path)
    assert keyed.engine_api_key == ENGINE_KEY

    async def models(key: str | None) -> list[ModelsResult]:
        collector = Collector(keyed.contract, CheckSettings(), MonotonicClock(), key)
        try:
            return await collector.models()
        finally:
            await collector.aclose()

    # /v1/models is guarded: it answers only with the key (so the key was sent).
    assert all(r.ids == [MODEL] for r in asyncio.run(models(keyed.engine_api_key)))
    assert all("401" in (r.error or "") for r in asyncio.run(models(None)))

    plan = ProfilingPlan(
        prefill_lens=[32, 64],
        prefill_repeats=1,
        decode_input_lens=[32],
        decode_concurrency=[1, 2],
        decode_tokens=24,
    )
    limits = ProfilingLimits.model_validate(
        {
            "schema": "narwhal.profiling-limits/v1",
            "max_wall_s_per_engine": 30,
            "max_tokens_per_engine": 10_000,
            "probe_timeout_s": 10,
        }
    )

    def profile(key: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        run = profile_fleet(
            keyed.contract, ["e0"], plan, limits, True, lambda _: None, engine_api_key=key
        )
        return asyncio.run(run)

    profiles, failures = profile(keyed.engine_api_key)
    assert list(profiles) == ["e0"] and not failures, failures
    profiles, failures = profile(None)
    assert not profiles and "401" in failures["e0"]
