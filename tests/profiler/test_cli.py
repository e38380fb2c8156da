"""narwhal-profile's command line, as a subprocess: input errors refused in one line before any
engine is probed, and the engine-level refusals (no engine of these fleets is a real one)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import profiling
from narwhal.testing.ports import free_ports

# A plan small enough for the fleets' max_model_len.
PLAN = (
    "--prefill-lens", "64,128",
    "--decode-input-lens", "64",
    "--decode-concurrency", "1,2",
    "--decode-tokens", "16",
    "--prefill-repeats", "1",
)  # fmt: skip


def narwhal_profile(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal.profiler.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_fleet(path: Path, http_ports: list[int] | None = None) -> Path:
    """A two-engine fleet; nothing listens on its ports unless ``http_ports`` names a server."""
    ports = free_ports(4)
    path.write_text(json.dumps(local_fleet_document(http_ports or ports[:2], ports[2:])))
    return path


def write_limits(path: Path) -> Path:
    return profiling.write_limits(path, max_tokens_per_engine=100_000, probe_timeout_s=10)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_an_output_that_is_an_input_is_refused(tmp_path: Path) -> None:
    """--out (or its .sha256, or the .partial.json an incomplete run writes) naming an input
    replaced it, however the path is spelled; refused before any engine is probed."""
    fleet = write_fleet(tmp_path / "fleet.json")
    doc = json.loads(fleet.read_text())
    doc["engine"]["api_key_file"] = "engine.key"
    fleet.write_text(json.dumps(doc))
    (tmp_path / "engine.key").write_text("secret\n")
    limits = write_limits(tmp_path / "limits.json")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(fleet)
    (tmp_path / "hard.json").hardlink_to(limits)
    (tmp_path / "x.partial.json").write_text(fleet.read_text())
    (tmp_path / "y.json.sha256").write_text(fleet.read_text())
    (tmp_path / "z.partial.json").write_text(limits.read_text())
    cases = [
        (fleet, limits, fleet, "is the file given with --fleet"),
        (fleet, limits, tmp_path / "sub" / ".." / "fleet.json", "is the file given with --fleet"),
        (fleet, limits, tmp_path / "link.json", "is the file given with --fleet"),
        (fleet, limits, limits, "is the file given with --limits"),
        (fleet, limits, tmp_path / "hard.json", "is the file given with --limits"),
        (fleet, limits, tmp_path / "engine.key", "is the fleet's engine.api_key_file"),
        (
            tmp_path / "y.json.sha256",
            limits,
            tmp_path / "y.json",
            "its y.json.sha256 is the file given with --fleet",
        ),
        (
            tmp_path / "x.partial.json",
            limits,
            tmp_path / "x.json",
            "its x.partial.json is the file given with --fleet",
        ),
        (
            fleet,
            tmp_path / "z.partial.json",
            tmp_path / "z.json",
            "its z.partial.json is the file given with --limits",
        ),
    ]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for fleet_path, limits_path, out, words in cases:
        r = profiling.profile(fleet_path, limits_path, out, *PLAN, timeout=120)
        assert r.returncode == 2, r.stderr
        assert one_line(r) == f"narwhal-profile: --out {out}: {words} (it would be overwritten)"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_bad_arguments_are_one_line_exit_2(tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path / "fleet.json")
    limits = write_limits(tmp_path / "limits.json")
    out = tmp_path / "store.json"
    given = ["--fleet", str(fleet), "--limits", str(limits), "--out", str(out), *PLAN]
    for args, line in (
        # argparse's own errors: its usage block came first.
        (
            [*given, "--decode-tokens", "abc"],
            "argument --decode-tokens: invalid int value: 'abc'",
        ),
        (["--fleet", str(fleet)], "the following arguments are required: --limits"),
        # A list starting with "-" read as an option ("expected one argument").
        (
            [*given, "--prefill-lens", "-5,128"],
            "--prefill-lens: values must be positive integers, got '-5,128'",
        ),
        (
            [*given, "--decode-concurrency", "-1,2"],
            "--decode-concurrency: values must be positive integers, got '-1,2'",
        ),
        # An engine named twice was profiled twice at once: its probes overlapped.
        ([*given, "--engines", "e0,e0"], "--engines: duplicate engine ids e0 in 'e0,e0'"),
        ([*given, "--engines", "e1,e0,e1"], "--engines: duplicate engine ids e1 in 'e1,e0,e1'"),
        # An unset variable in a script.
        ([*given, "--fleet", ""], "--fleet: an empty path"),
        ([*given, "--limits", ""], "--limits: an empty path"),
        ([*given, "--out", ""], "--out: an empty path"),
    ):
        r = narwhal_profile(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert one_line(r) == f"narwhal-profile: {line}", args
    assert not out.exists()


def test_an_engine_that_does_not_answer_is_not_told_to_be_forced(tmp_path: Path) -> None:
    """--force profiles an engine that answers but is busy; one that does not answer fails
    either way, so the refusal says to check it rather than to use --force."""
    fleet = write_fleet(tmp_path / "fleet.json")
    doc = json.loads(fleet.read_text())
    url = doc["engines"][0]["url"]
    out = tmp_path / "store.json"
    r = profiling.profile(
        fleet, write_limits(tmp_path / "limits.json"), out, *PLAN, "--engines", "e0"
    )
    assert r.returncode == 1, r.stderr
    assert (
        f"narwhal-profile: e0: unreachable at {url} (/metrics: ConnectError): check that the "
        "engine is running and that the fleet's url for it is right"
    ) in r.stderr.splitlines()
    assert "--force" not in r.stderr and not out.exists()


class _NoGauges(http.server.BaseHTTPRequestHandler):
    """An engine that answers /metrics without vLLM's load gauges."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_engine_that_answers_but_is_not_known_idle_is_told_to_be_forced(
    tmp_path: Path,
) -> None:
    with serving(_NoGauges) as port:
        fleet = write_fleet(tmp_path / "fleet.json", [port, free_ports(1)[0]])
        r = profiling.profile(
            fleet,
            write_limits(tmp_path / "limits.json"),
            tmp_path / "store.json",
            *PLAN,
            "--engines",
            "e0",
        )
    assert r.returncode == 1, r.stderr
    assert (
        "narwhal-profile: e0: refusing to profile: its /metrics carries no vLLM load gauges "
        "(use --force)"
    ) in r.stderr.splitlines()
