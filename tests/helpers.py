"""Shared test helpers: fleets of simulated engines and the router as the tests run them,
metric parsing, request bodies. Processes, ports and waiting are ``narwhal.testing``'s."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from narwhal.journal import journal_files
from narwhal.serve.cli import serve_command
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports

ADMIN_TOKEN = "test-admin-token"
MODEL = "moonshotai/Kimi-K3"
# Fast enough for tests, slow enough that steps are real (0.24 s decode step -> 4.8 ms).
TEST_TIME_SCALE = 50.0
# uvloop (libuv) keeps its timer clock in whole milliseconds, so a timeout armed for T s can fire
# up to a millisecond before T by a finer monotonic clock: compare timed-out durations with this.
TIMER_SLACK_S = 0.005


# A whole answer's top-level and usage keys as vLLM 0.32 answered the interop suite's engines.
_COMMON_ANSWER_KEYS = frozenset(
    [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
)
VLLM_032_ANSWER_KEYS = {
    False: _COMMON_ANSWER_KEYS,
    # A chat answer's prompt fields are top-level (a completion's are in its choices).
    True: _COMMON_ANSWER_KEYS | {"prompt_logprobs", "prompt_token_ids", "prompt_text"},
}
# The usage of vLLM 0.32's whole answer (null details included).
VLLM_032_USAGE_KEYS = {
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
}


def write_fleet(directory: Path, num_engines: int, **kwargs: Any) -> Path:
    kv_events = kwargs.pop("kv_events", False)
    ports = free_ports(4 * num_engines if kv_events else 2 * num_engines)
    if kv_events:
        events = ports[2 * num_engines :]
        kwargs["kv_event_ports"] = list(zip(events[::2], events[1::2], strict=True))
    kwargs.setdefault("sim", {"time_scale": TEST_TIME_SCALE})
    doc = local_fleet_document(ports[:num_engines], ports[num_engines : 2 * num_engines], **kwargs)
    path = directory / "fleet.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


@contextlib.contextmanager
def running_fleet(directory: Path, num_engines: int = 2, **kwargs: Any) -> Iterator[SimFleet]:
    engine_args = kwargs.pop("engine_args", None)
    engine_api_key = kwargs.pop("engine_api_key", None)
    path = write_fleet(directory, num_engines, **kwargs)
    fleet = SimFleet(
        path,
        admin_token=ADMIN_TOKEN,
        log_dir=directory / "logs",
        engine_args=engine_args,
        engine_api_key=engine_api_key,
    )
    try:
        fleet.start(timeout=60)
        yield fleet
    finally:
        fleet.stop()


def _journal_snapshot(journal: Path) -> list[tuple[Path, int]]:
    """The journal's files and their inodes: a rotation renames them."""
    out = []
    for path in journal_files(journal):
        with contextlib.suppress(FileNotFoundError):
            out.append((path, path.stat().st_ino))
    return out


def journal_contents(journal: Path) -> list[tuple[Path, bytes]]:
    """The journal's files (rotated ones first) and their bytes, as one consistent read: a
    rotation while they are read (a file renamed, or not yet there) reads them all again."""
    for _ in range(100):
        files = _journal_snapshot(journal)
        try:
            contents = [(path, path.read_bytes()) for path, _ in files]
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        if files == _journal_snapshot(journal):
            return contents
    raise AssertionError(f"the journal's files kept moving: {journal}")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def admin(
    url: str, method: str = "POST", body: dict[str, Any] | None = None, path: str = "/sim/faults"
) -> httpx.Response:
    return httpx.request(
        method,
        f"{url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


class RouterProcess:
    def __init__(self, url: str, process: Any, journal: Path, log_path: Path, admin_token: str):
        self.url = url
        self.process = process
        self.journal = journal
        self.log_path = log_path
        self.admin_token = admin_token

    def records(self) -> list[dict[str, Any]]:
        """Every record of the journal, its rotated files' first (oldest first)."""
        out = []
        for _, data in journal_contents(self.journal):
            # The writer may be half way through the last line while a test reads the file:
            # only what precedes the last newline is a complete record.
            for line in data.split(b"\n")[:-1]:
                if line.strip():
                    out.append(json.loads(line))
        return out

    def ends(self) -> dict[str, dict[str, Any]]:
        ends: dict[str, dict[str, Any]] = {}
        for rec in self.records():
            if rec["type"] == "request.end":
                assert rec["id"] not in ends, f"two request.end records for {rec['id']}"
                ends[rec["id"]] = rec
        return ends

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def admin_state(self) -> dict[str, Any]:
        return httpx.get(
            self.url + "/admin/state",
            timeout=10,
            headers={"Authorization": f"Bearer {self.admin_token}"},
        ).json()


def router_command(
    fleet_path: Path, port: int, journal: Path, token_file: Path, *extra: str
) -> list[str]:
    """The narwhal-serve command line the tests start a router with."""
    return serve_command(
        fleet_path,
        port,
        journal,
        "--skip-qualification",
        "--admin-token-file",
        str(token_file),
        "--log-level",
        "info",
        *extra,
    )


def api_keys_file(directory: Path, *keys: str) -> Path:
    """A keys file for ``--api-keys-file`` holding ``keys``, private as docs/security.md asks."""
    path = directory / "keys"
    path.write_text("# API keys\n" + "".join(k + "\n" for k in keys))
    path.chmod(0o600)
    return path


def start_router(
    directory: Path,
    fleet_path: Path,
    *extra: str,
    journal: Path | None = None,
    port: int | None = None,
    wait_ready: bool = True,
    **start: Any,
) -> RouterProcess:
    """narwhal-serve on ``fleet_path`` with the tests' admin token, its output in
    ``directory/router-PORT.log``; ``start`` goes to ``narwhal.testing.procs.start``."""
    port = port or free_ports(1)[0]
    journal = journal or directory / "journal.jsonl"
    token_file = directory / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    token_file.chmod(0o600)
    log_path = directory / f"router-{port}.log"
    process = procs.start(
        router_command(fleet_path, port, journal, token_file, *extra), log_path, **start
    )
    router = RouterProcess(f"http://127.0.0.1:{port}", process, journal, log_path, ADMIN_TOKEN)
    if wait_ready:
        try:
            procs.wait_ready(
                lambda: procs.http_ok(router.url + "/ready"),
                30,
                process=process,
                name="router",
                log=log_path,
                interval=0.05,
            )
        except procs.ProcessError as exc:
            procs.stop(process)
            raise AssertionError(str(exc)) from None
    return router


def stop_router(router: RouterProcess, timeout: float = 30) -> int | None:
    return procs.stop(router.process, timeout)


@contextlib.contextmanager
def running_router(
    directory: Path, fleet_path: Path, *extra: str, **kwargs: Any
) -> Iterator[RouterProcess]:
    router = start_router(directory, fleet_path, *extra, **kwargs)
    try:
        yield router
    finally:
        stop_router(router)


@contextlib.contextmanager
def raw_completion(router: RouterProcess, body: dict[str, Any], tag: str) -> Iterator[str]:
    """A completions request sent on a socket of its own, which the block holds and closes
    at its end (the client hanging up whenever the test says, not on a client timer). Yields
    the request's X-Request-Id, unique and prefixed ``tag``: its journal record is the one
    whose ``client_request_id`` it is (an earlier test's request may be journaled late)."""
    client_id = f"{tag}-{uuid.uuid4().hex}"
    payload = json.dumps(body).encode()
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Request-Id: {client_id}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        yield client_id
