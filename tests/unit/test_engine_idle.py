"""``check_idle``: whether an engine is idle enough to time, and if not which kind of refusal
(its /metrics unreachable, no vLLM load gauges, requests in flight), as the profiler words
each kind: only an engine that answers is told to be forced. Against a real HTTP server on
127.0.0.1 answering /metrics as told, and a port nothing listens on."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from narwhal.contract import load_fleet
from narwhal.engines.probes import EngineNotIdle, check_idle
from narwhal.profiler.runner import _refusal
from narwhal.testing.ports import free_ports

SIM_FLEET = Path(__file__).resolve().parents[2] / "configs" / "fleet" / "local-sim.json"

IDLE = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
BUSY = b'vllm:num_requests_running{rank="0"} 2\nvllm:num_requests_waiting 1\n'


class _Metrics(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (200, IDLE)

    def do_GET(self) -> None:
        status, body = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


async def _not_idle(url: str) -> EngineNotIdle | None:
    async with httpx.AsyncClient(base_url=url, timeout=5.0, trust_env=False) as client:
        return await check_idle(client)


def _url(server: http.server.ThreadingHTTPServer, status: int, body: bytes) -> str:
    server.answer = (status, body)  # type: ignore[attr-defined]
    return f"http://127.0.0.1:{server.server_address[1]}"


def _nobody() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, IDLE, None),
        (
            200,
            b"# no gauges\n",
            EngineNotIdle("not_vllm", "its /metrics carries no vLLM load gauges"),
        ),
        (401, IDLE, EngineNotIdle("not_vllm", "its /metrics carries no vLLM load gauges")),
        (200, BUSY, EngineNotIdle("busy", "not idle (2 running, 1 waiting)")),
    ],
    ids=["idle", "no-gauges", "error-status", "busy"],
)
async def test_check_idle_says_which_kind_of_not_idle(
    engine: http.server.ThreadingHTTPServer,
    status: int,
    body: bytes,
    expected: EngineNotIdle | None,
) -> None:
    assert await _not_idle(_url(engine, status, body)) == expected


async def test_an_engine_that_does_not_answer_is_unreachable() -> None:
    assert await _not_idle(_nobody()) == EngineNotIdle(
        "unreachable", "/metrics unreachable: ConnectError", "ConnectError"
    )


async def test_the_profiler_tells_only_an_engine_that_answers_to_be_forced(
    engine: http.server.ThreadingHTTPServer,
) -> None:
    spec = load_fleet(SIM_FLEET).contract.engines[0]
    unreachable = await _not_idle(_nobody())
    assert unreachable is not None
    assert _refusal(spec, unreachable) == (
        f"unreachable at {spec.url} (/metrics: ConnectError): check that the engine is running "
        "and that the fleet's url for it is right"
    )
    busy = await _not_idle(_url(engine, 200, BUSY))
    assert busy is not None
    assert _refusal(spec, busy) == (
        "refusing to profile: not idle (2 running, 1 waiting) (use --force)"
    )
