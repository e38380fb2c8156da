"""narwhal-profile reads each engine's generation from its attestation sidecar, which answers
503 "hashing" until it has hashed the engine's files: a profile run started with the fleet's
launch waits for it (a bounded time) instead of failing. Against a real HTTP server on
127.0.0.1 that answers as the sidecar does."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from narwhal.contract.models import EngineSpec
from narwhal.profiler.runner import EngineProfilingError, _generation

HASHING = (503, {"schema": 1, "state": "hashing", "hashed_bytes": 250, "total_bytes": 1000})
READY = (200, {"schema": 1, "state": "ready", "generation": "gen-7"})


@contextmanager
def sidecar(answers: list[tuple[int, object]]) -> Iterator[tuple[str, list[int]]]:
    """Serves ``answers`` in turn on /attestation (the last one again once they run out)."""
    served: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, doc = answers[min(len(served), len(answers) - 1)]
            served.append(status)
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/attestation", served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def spec(url: str) -> EngineSpec:
    return EngineSpec.model_validate(
        {
            "id": "p0",
            "url": "http://127.0.0.1:9",
            "roles": ["prefill"],
            "initial_role": "prefill",
            "nixl": {"host": "127.0.0.1", "port": 5600},
            "attestation_url": url,
        }
    )


def test_a_sidecar_still_hashing_is_waited_for() -> None:
    said: list[str] = []
    with sidecar([HASHING, HASHING, READY]) as (url, served):
        generation = asyncio.run(_generation(spec(url), said.append, wait_s=30, poll_s=0.01))
    assert generation == "gen-7"
    assert served == [503, 503, 200]
    # Said once, with how far it got, not once a poll.
    assert said == [
        "p0: waiting for its attestation sidecar to hash its files (25% of 1,000 bytes)"
    ]


def test_a_sidecar_hashing_past_the_wait_fails_with_how_far_it_got() -> None:
    with sidecar([HASHING]) as (url, served), pytest.raises(EngineProfilingError) as caught:
        asyncio.run(_generation(spec(url), lambda _: None, wait_s=0.2, poll_s=0.02))
    assert str(caught.value) == (
        f"attestation at {url} still hashing the engine's files after 0.2 s (25% of 1,000"
        " bytes): profile it once the sidecar answers ready"
    )
    assert len(served) > 1


@pytest.mark.parametrize(
    "answer",
    [
        (503, {"state": "failed"}),  # not hashing: no wait
        (500, {"schema": 1, "state": "failed", "error": "disk"}),
        (200, ["not", "a", "document"]),
        (200, {"state": "ready"}),  # no generation
    ],
)
def test_other_answers_fail_at_once(answer: tuple[int, object]) -> None:
    failed = pytest.raises(EngineProfilingError, match="attestation unreachable")
    with sidecar([answer]) as (url, served), failed:
        asyncio.run(_generation(spec(url), lambda _: None, wait_s=30, poll_s=0.01))
    assert len(served) == 1
