"""Security properties of the router, checked on a live fleet (threat model: docs/security.md).

- No secret leaves through an observable surface: a planted API key, Authorization header
  and prompt marker (and the completion text) never appear in the router's log, its journal
  (rotated files included), /metrics or /admin/state.
- Client request ids are sanitised before they reach headers, logs or the journal, and never
  reach an engine.
- The journal and its rotated files are private (0600, directory 0700).
- /metrics, /health and /ready are public by default and protected on request; the admin
  token and the API keys are separate secrets.
- No request field or header makes the router contact anything outside the fleet.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.journal import journal_files
from narwhal.testing.fleet import SimFleet
from narwhal.testing.procs import wait_until
from tests.helpers import (
    ADMIN_TOKEN,
    MODEL,
    RouterProcess,
    admin,
    api_keys_file,
    running_fleet,
    running_router,
)
from tests.reliability.support import (
    ROUTER_ID_RE,
    body,
    count_journal,
    end_of,
    engine_metric,
    journal_contents,
    journal_records,
    router_idle,
    sim_state,
)

KEY = "sk-narwhal-PLANTED-KEY-7f3a9c"
OTHER_KEY = "sk-narwhal-PLANTED-KEY-2-b81d"
WRONG_KEY = "sk-narwhal-PLANTED-WRONG-55e0"
MARKER = "PLANTEDPROMPTMARKER"
CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with running_fleet(tmp_path_factory.mktemp("security-fleet"), 2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def keyed(fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A router with API keys, a small journal (it rotates), logging at debug."""
    directory = tmp_path_factory.mktemp("security")
    with running_router(
        directory,
        fleet.fleet_path,
        "--api-keys-file",
        str(api_keys_file(directory, KEY, OTHER_KEY)),
        "--journal-max-bytes",
        "4096",
        "--log-level",
        "debug",
        journal=directory / "journal" / "router.jsonl",
    ) as router:
        yield router


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def surfaces(router: RouterProcess) -> dict[str, str]:
    """Everything an operator or a scraper can read from the router."""
    out = {"log": router.log_path.read_text(errors="replace")}
    for f, data in journal_contents(router.journal):
        out[f"journal:{f.name}"] = data.decode(errors="replace")
    out["metrics"] = httpx.get(router.url + "/metrics", timeout=5).text
    out["admin_state"] = json.dumps(router.admin_state())
    return out


# --------------------------------------------------------------------------------------------
# Planted secrets


def test_planted_secrets_never_reach_logs_journal_or_metrics(keyed: RouterProcess) -> None:
    router = keyed
    completions: list[str] = []
    text_prompt = f"tell me about {MARKER} and more words " * 8
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for stream in (False, True):
            r = client.post(
                "/v1/completions",
                headers=auth(),
                json={**body(12, stream=stream, prompt=text_prompt), "user": MARKER},
            )
            assert r.status_code == 200, r.text
            if not stream:
                completions.append(r.json()["choices"][0]["text"])
            r = client.post(
                "/v1/chat/completions",
                headers={**auth(OTHER_KEY), "X-Api-Key": KEY},
                json={
                    "model": MODEL,
                    "max_tokens": 12,
                    "stream": stream,
                    "stop": [MARKER],
                    "messages": [{"role": "user", "content": f"secret {MARKER} inside"}],
                },
            )
            assert r.status_code == 200, r.text
            if not stream:
                completions.append(r.json()["choices"][0]["message"]["content"])
        # Refused: a wrong key, the key in a query string, the key with another scheme.
        refused = [
            client.post("/v1/completions", headers=auth(WRONG_KEY), json=body(2)),
            client.post(f"/v1/completions?api_key={KEY}", json=body(2)),
            client.post("/v1/completions", headers={"Authorization": f"Basic {KEY}"}, json=body(2)),
            client.get("/v1/models", headers=auth(WRONG_KEY)),
        ]
        assert [r.status_code for r in refused] == [401] * 4
        assert all(r.headers.get("www-authenticate") == "Bearer" for r in refused[:3])
        # A prompt the engines refuse (their error goes back to the client and the journal).
        r = client.post(
            "/v1/completions",
            headers=auth(),
            json=body(16000, prompt=f"{MARKER} " * 300, min_tokens=16000),
        )
        assert r.status_code == 400
        # Many requests, to rotate the journal (4 KiB files).
        for _ in range(12):
            assert client.post("/v1/completions", headers=auth(), json=body(2)).status_code == 200
    assert wait_until(lambda: router_idle(router), 5)
    assert len(journal_files(router.journal)) >= 3  # rotated, so rotated files are checked
    completions = [c for c in completions if len(c) >= 20]
    assert completions
    secrets = {
        "API key": KEY,
        "second API key": OTHER_KEY,
        "refused key": WRONG_KEY,
        "key body": KEY.removeprefix("sk-"),
        "prompt marker": MARKER,
        "admin token": ADMIN_TOKEN,
        "Bearer header": "Bearer ",
        **{f"completion {i}": text for i, text in enumerate(completions)},
    }
    leaks = [
        f"{what} in {where}"
        for where, text in surfaces(router).items()
        for what, secret in secrets.items()
        if secret in text
    ]
    assert not leaks, leaks
    # The journal did record these requests: it is the content that is kept out, not the
    # requests.
    ends = count_journal(router.journal).ends
    assert sum(e["outcome"] == "ok" for e in ends.values()) >= 16


# --------------------------------------------------------------------------------------------
# Client request ids


def raw_request(url: str, head: bytes, payload: bytes) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request written by hand (httpx refuses to send malformed headers)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: "
            + f"{host}:{port}".encode()
            + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + b"Authorization: Bearer "
            + KEY.encode()
            + b"\r\n"
            + head
            + b"Content-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    header_block, _, content = rest.partition(b"\r\n\r\n")
    headers: dict[str, str] = {}
    for line in header_block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    return int(status_line.split()[1]), headers, content


def test_client_request_ids_are_sanitised(keyed: RouterProcess, fleet: SimFleet) -> None:
    router = keyed
    payload = json.dumps(body(2)).encode()
    cases: dict[str, bytes] = {
        "crlf": b"X-Request-Id: evil-id\r\nX-Injected-By-Client: yes\r\n",
        "long": b"X-Request-Id: " + b"A" * 10_000 + b"\r\n",
        "unicode": "X-Request-Id: ид-запроса-✓-é\r\n".encode(),
        "path": b"X-Request-Id: ../../etc/passwd\r\n",
        "json": b'X-Request-Id: x"},{"type":"router.stop","clean":true}\r\n',
        "ansi": b"X-Request-Id: \x1b[31mred\x1b[0m\r\n",
        "spaces": b"X-Request-Id: a b\tc\r\n",
        "only-bad": b"X-Request-Id: $$$%%%\r\n",
    }
    seen: dict[str, dict[str, Any]] = {}
    for name, head in cases.items():
        status, headers, _ = raw_request(router.url, head, payload)
        if status >= 400:
            # The HTTP layer may refuse a malformed header outright; never with a 5xx.
            assert status < 500, (name, status)
            continue
        assert status == 200, (name, status)
        # The response carries the router's own id, never the client's.
        assert ROUTER_ID_RE.match(headers["x-request-id"]), (name, headers)
        assert "x-injected-by-client" not in headers
        seen[name] = end_of(router, headers["x-request-id"])
    assert {"crlf", "long", "unicode", "path", "json"} <= set(seen), sorted(seen)
    print(f"\nids the HTTP layer let through: {sorted(seen)}")
    for name, end in seen.items():
        cid = end["client_request_id"]
        assert cid is None or CLIENT_ID_RE.match(cid), (name, cid)
    assert seen["crlf"]["client_request_id"] == "evil-id"
    assert seen["long"]["client_request_id"] == "A" * 128
    assert seen["path"]["client_request_id"] == "....etcpasswd"
    assert seen["json"]["client_request_id"] == "xtype:router.stopclean:true"
    if "only-bad" in seen:
        assert seen["only-bad"]["client_request_id"] is None
    # Nothing unsanitised in the log or the journal.
    log = router.log_path.read_text(errors="replace")
    journal = "".join(data.decode(errors="replace") for _, data in journal_contents(router.journal))
    for raw in ("../../etc", '"type":"router.stop","clean"', "\x1b[31m", "A" * 129, "запроса"):
        assert raw not in log and raw not in journal, raw
    # Every journal line is still one well-formed record.
    assert all(isinstance(r, dict) and "type" in r for r in journal_records(router.journal))

    # The engines get the router's id, not the client's: a stranded hold is named after it (a
    # decode leg refused, and the release leg's READ failing, so that the hold stays).
    head = b"X-Request-Id: client-chosen-id\r\n"
    stranded = json.dumps(body(16000, prompt="word " * 400, min_tokens=16000)).encode()
    admin(fleet.engines["e1"].url, "POST", {"hang_kv_read_s": 3600})
    try:
        status, headers, _ = raw_request(router.url, head, stranded)
    finally:
        admin(fleet.engines["e1"].url, "DELETE")
    assert status == 400
    rid = headers["x-request-id"]
    holds = [h for e in fleet.engines.values() for h in sim_state(e.url)["holds"]]
    assert any(h.startswith(rid) for h in holds), holds
    assert not any("client-chosen-id" in h for h in holds)


# --------------------------------------------------------------------------------------------
# File modes


def test_journal_and_rotated_files_are_private(fleet: SimFleet, tmp_path: Path) -> None:
    journal_dir = tmp_path / "jdir" / "nested"
    journal = journal_dir / "router.jsonl"
    # Files left world-readable by an earlier process, or another tool, are narrowed at start.
    journal_dir.mkdir(parents=True)
    for f in (journal, journal.with_name("router.jsonl.1")):
        f.write_text("")
        f.chmod(0o644)
    with running_router(
        tmp_path, fleet.fleet_path, "--journal-max-bytes", "2048", journal=journal
    ) as router:
        for _ in range(10):
            r = httpx.post(router.url + "/v1/completions", json=body(2), timeout=30)
            assert r.status_code == 200
        assert wait_until(lambda: len(journal_files(journal)) >= 3, 5)
        modes: dict[str, int] = {}
        for _ in range(100):  # bounded: 5 s
            try:
                modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in journal_files(journal)}
                break
            except FileNotFoundError:  # a rotation renamed a file between listing and stat
                time.sleep(0.05)
        assert modes and set(modes.values()) == {0o600}, modes
    # A directory the journal creates itself is 0700 at every level.
    fresh = tmp_path / "fresh" / "a" / "b" / "router.jsonl"
    with running_router(tmp_path, fleet.fleet_path, journal=fresh):
        for d in (tmp_path / "fresh", tmp_path / "fresh" / "a", tmp_path / "fresh" / "a" / "b"):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


# --------------------------------------------------------------------------------------------
# Public and protected endpoints


def test_metrics_and_health_public_or_protected(fleet: SimFleet, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    open_dir, closed_dir = tmp_path / "open", tmp_path / "closed"
    open_dir.mkdir()
    closed_dir.mkdir()
    with running_router(open_dir, fleet.fleet_path, "--api-keys-file", str(keys)) as router:
        for path in ("/metrics", "/health", "/ready", "/ping", "/version"):
            assert httpx.get(router.url + path, timeout=5).status_code == 200, path
        # Serving endpoints need a key, whatever the monitoring ones do.
        assert httpx.get(router.url + "/v1/models", timeout=5).status_code == 401
        assert httpx.post(router.url + "/v1/completions", json=body(2)).status_code == 401
        assert httpx.get(router.url + "/v1/models", headers=auth(), timeout=5).status_code == 200
    with running_router(
        closed_dir,
        fleet.fleet_path,
        "--api-keys-file",
        str(keys),
        "--protect-metrics",
        "--protect-health",
        wait_ready=False,
    ) as router:

        def up() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (
                    httpx.get(router.url + "/ready", headers=auth(), timeout=2).status_code == 200
                )
            return False

        assert wait_until(up, 30)
        for path in ("/metrics", "/health", "/ready", "/ping", "/version"):
            r = httpx.get(router.url + path, timeout=5)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert (
                httpx.get(router.url + path, headers=auth(WRONG_KEY), timeout=5).status_code == 401
            )
            assert httpx.get(router.url + path, headers=auth(), timeout=5).status_code == 200
        # The admin token and the API keys are different secrets: neither opens the other's
        # door.
        assert httpx.get(router.url + "/admin/state", headers=auth(), timeout=5).status_code == 401
        assert (
            httpx.get(router.url + "/admin/state", headers=auth(ADMIN_TOKEN), timeout=5).status_code
            == 200
        )
        r = httpx.post(router.url + "/v1/completions", headers=auth(ADMIN_TOKEN), json=body(2))
        assert r.status_code == 401
        assert httpx.get(router.url + "/metrics", headers=auth(ADMIN_TOKEN)).status_code == 401
        assert (
            httpx.post(
                router.url + "/admin/roles/pin", headers=auth(), json={"pinned": True}
            ).status_code
            == 401
        )


def test_keys_from_the_environment_are_trimmed(
    fleet: SimFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NARWHAL_API_KEYS="a, b": the key after the comma is "b", not " b" (which no client
    could present: the router trims the key it is given), and a blank key is no key."""
    monkeypatch.setenv("NARWHAL_API_KEYS", f"{KEY}, {OTHER_KEY} ,")
    with running_router(tmp_path, fleet.fleet_path) as router:
        for key in (KEY, OTHER_KEY):
            r = httpx.post(router.url + "/v1/completions", headers=auth(key), json=body(2))
            assert r.status_code == 200, (key, r.text)
        r = httpx.post(
            router.url + "/v1/completions", headers={"Authorization": "Bearer"}, json=body(2)
        )
        assert r.status_code == 401


# --------------------------------------------------------------------------------------------
# Nothing outside the fleet is ever contacted


class Canary:
    """A TCP listener on 127.0.0.1 that only counts who connects to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_no_request_field_makes_the_router_contact_outside_the_fleet(
    keyed: RouterProcess, fleet: SimFleet
) -> None:
    router = keyed
    canary = Canary()
    try:
        here = f"127.0.0.1:{canary.port}"
        url = f"http://{here}/v1"
        engine_requests_before = sum(
            engine_metric(e.url, "vllm:request_success_total") for e in fleet.engines.values()
        )
        attempts: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
            (
                "kv_transfer_params",
                {
                    **body(2),
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "remote_host": "127.0.0.1",
                        "remote_port": canary.port,
                        "remote_engine_id": "e0",
                        "remote_block_ids": [0],
                        "remote_request_id": "x",
                    },
                },
                {},
                "/v1/completions",
            ),
            ("model as a URL", {**body(2), "model": url}, {}, "/v1/completions"),
            ("Host", body(2), {"Host": here}, "/v1/completions"),
            (
                "forwarding headers",
                body(2),
                {
                    "X-Forwarded-Host": here,
                    "X-Forwarded-For": "127.0.0.1",
                    "X-Forwarded-Proto": "http",
                    "Forwarded": f"host={here};proto=http",
                    "X-Original-URL": url,
                    "X-Rewrite-URL": url,
                },
                "/v1/completions",
            ),
            (
                "URL-shaped unknown fields",
                {
                    **body(2),
                    "base_url": url,
                    "api_base": url,
                    "remote_host": "127.0.0.1",
                    "remote_port": canary.port,
                    "callback_url": url,
                    "extra_body": {"base_url": url},
                },
                {},
                "/v1/completions",
            ),
            (
                "chat image URL",
                {
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "look"},
                                {"type": "image_url", "image_url": {"url": url + "/cat.png"}},
                            ],
                        }
                    ],
                },
                {},
                "/v1/chat/completions",
            ),
            ("query string", body(2), {}, f"/v1/completions?base_url={url}&host={here}"),
        ]
        statuses = {}
        ok = 0
        for name, payload, headers, path in attempts:
            r = httpx.post(
                router.url + path, json=payload, headers={**auth(), **headers}, timeout=30
            )
            assert r.status_code < 500, (name, r.text)
            statuses[name] = r.status_code
            ok += r.status_code == 200
        # Absolute-form request target, as sent to a forward proxy: served as a path, never
        # fetched.
        host, port = router.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            payload = json.dumps(body(2)).encode()
            s.sendall(
                f"POST http://{here}/v1/completions HTTP/1.1\r\nHost: {here}\r\n".encode()
                + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
                + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        absolute_status = int(reply.split(b" ", 2)[1])
        assert absolute_status < 500
        ok += absolute_status == 200
        assert statuses["kv_transfer_params"] == 400 and statuses["model as a URL"] == 404
        assert wait_until(lambda: router_idle(router), 5)
        # Every request the engines saw was one leg of a request we sent: two per answer.
        engine_requests = sum(
            engine_metric(e.url, "vllm:request_success_total") for e in fleet.engines.values()
        )
        assert engine_requests - engine_requests_before == 2 * ok, (statuses, ok)
    finally:
        canary.close()
    assert canary.connections == 0
