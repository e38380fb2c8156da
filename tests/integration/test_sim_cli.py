"""``narwhal-sim`` as a user runs it: one-line usage errors, and ``fleet`` starting, serving and
stopping every engine of a fleet file."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.testing import procs
from narwhal.testing.fleet import sim_env
from tests.helpers import write_fleet

MODULE = "narwhal.testing.sim_cli"
SCRIPT = Path(sys.executable).parent / "narwhal-sim"
# The console script as installed, unless it was installed before its entry point moved here
# (an editable install keeps the old entry point until it is reinstalled): then the module.
COMMAND = (
    [str(SCRIPT)]
    if SCRIPT.exists() and MODULE in SCRIPT.read_text(errors="replace")
    else [sys.executable, "-m", MODULE]
)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, timeout=timeout, env=sim_env()
    )


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["model"].update(max_model_len=-3), "model.max_model_len"),
        (lambda d: d["engines"][1]["nixl"].update(port="x"), "engines[1].nixl.port"),
        (lambda d: d.pop("budgets"), "budgets"),
    ],
    ids=["negative-max-model-len", "bad-nixl-port", "missing-budgets"],
)
def test_bad_fleet_file_is_one_line(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], field: str
) -> None:
    path = write_fleet(tmp_path, 2)
    doc = json.loads(path.read_text())
    edit(doc)
    bad = tmp_path / "bad-fleet.json"
    bad.write_text(json.dumps(doc))
    result = run_cli("engine", "--fleet", str(bad), "--engine-id", "e0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"narwhal-sim: {bad}: {field}: ")
    assert result.stdout == ""


@pytest.mark.parametrize(
    "content", ["{", "[]", ""], ids=["truncated-json", "not-an-object", "empty"]
)
def test_unparsable_fleet_file_is_one_line(tmp_path: Path, content: str) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text(content)
    result = run_cli("engine", "--fleet", str(bad), "--engine-id", "e0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and str(bad) in result.stderr


def test_missing_fleet_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    result = run_cli("engine", "--fleet", str(missing), "--engine-id", "e0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and str(missing) in result.stderr


def test_fleet_without_engine_id(tmp_path: Path) -> None:
    path = write_fleet(tmp_path, 2)
    result = run_cli("engine", "--fleet", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--engine-id" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_engine_id(tmp_path: Path) -> None:
    path = write_fleet(tmp_path, 2)
    result = run_cli("engine", "--fleet", str(path), "--engine-id", "e9")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "e9" in result.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--port", "70000"], "argument --port: must be from 1 to 65535, got 70000"),
        (["--nixl-port", "0"], "argument --nixl-port: must be from 1 to 65535, got 0"),
        (["--max-model-len", "0"], "argument --max-model-len: must be at least 1, got 0"),
        (["--time-scale", "0"], "--time-scale: must be greater than 0 (got 0.0)"),
        (["--eos-prob", "2"], "--eos-prob: must be less than or equal to 1 (got 2.0)"),
        (
            ["--num-blocks", "0", "--block-size", "0"],
            "--block-size: must be greater than 0 (got 0); --num-blocks: must be greater than 0",
        ),
        (["--fault-fail-next", "-1"], "--fault-fail-next: must be greater than or equal to 0"),
    ],
    ids=["port", "nixl-port", "max-model-len", "time-scale", "eos-prob", "two-at-once", "fault"],
)
def test_a_bad_engine_flag_is_a_usage_error_naming_it(flags: list[str], says: str) -> None:
    result = run_cli("engine", "--port", "23999", "--nixl-port", "23998", *flags)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    # One line (argparse's own errors follow its usage text).
    assert says in result.stderr.strip().splitlines()[-1]


def _events(**fields: object) -> list[str]:
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, **fields})]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (_events(publisher="kafka"), "unknown publisher 'kafka' (vLLM's: 'zmq', 'null')"),
        (
            _events(replay_endpoint="tcp://*:99999"),
            "replay_endpoint 'tcp://*:99999': the port must be from 0 to 65535 (or *)",
        ),
        (
            _events(endpoint="tcp://*:notaport"),
            "endpoint 'tcp://*:notaport': the port must be from 0 to 65535 (or *)",
        ),
    ],
    ids=["publisher", "port-past-65535", "port-not-a-number"],
)
def test_a_bad_kv_events_config_is_a_usage_error_naming_it(flags: list[str], says: str) -> None:
    """vLLM refuses a publisher it does not know; libzmq would take port 99999 as 34463."""
    result = run_cli("engine", "--port", "23999", "--nixl-port", "23998", *flags)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"narwhal-sim: --kv-events-config: {says}" == result.stderr.strip()


def test_a_kv_events_endpoint_in_use_is_a_usage_error_before_the_engine_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "engine", "--port", "23999", "--nixl-port", "23998",
            *_events(endpoint="tcp://*:23997", replay_endpoint=f"tcp://*:{port}"),
        )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "startup failed" not in result.stderr
    assert result.stderr.strip().startswith(
        f"narwhal-sim: --kv-events-config: replay_endpoint 'tcp://*:{port}' cannot be bound: "
        "Address already in use"
    )


def test_a_nixl_side_channel_that_cannot_bind_is_a_usage_error_before_the_engine_starts() -> None:
    """A side-channel port in use (or a host that does not resolve) was a traceback in the
    engine's startup, exit 3; the HTTP port's clash was already one uvicorn line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = run_cli("engine", "--port", "23999", "--nixl-port", str(port))
    bad_host = run_cli(
        "engine", "--port", "23999", "--nixl-port", "23998", "--nixl-host", "999.1.1.1"
    )
    same = run_cli("engine", "--port", "23999", "--nixl-port", "23999")
    for result, says in (
        (in_use, f"narwhal-sim: --nixl-port: cannot listen on 127.0.0.1:{port}"),
        (bad_host, "narwhal-sim: --nixl-port: '999.1.1.1' does not resolve"),
        (same, "narwhal-sim: --nixl-port: 23999 is the engine's HTTP port too, on 127.0.0.1"),
    ):
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "startup failed" not in result.stderr
        assert result.stderr.strip().startswith(says), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--engines", "nope"], "narwhal-sim: --engines: nope not in the fleet"),
        (["--engines", ","], "narwhal-sim: --engines: no engine id given"),
        (["--log-dir", "README.md"], "narwhal-sim: --log-dir: README.md is not a directory"),
        (["--startup-timeout", "0"], "argument --startup-timeout: must be greater than 0, got 0"),
    ],
    ids=["unknown-engine", "no-engine", "log-dir-a-file", "startup-timeout"],
)
def test_a_bad_fleet_flag_is_a_usage_error_before_any_engine_starts(
    flags: list[str], says: str
) -> None:
    """Each was a traceback (KeyError, FileExistsError) or, the timeout, engines started and
    then a failure with exit 1."""
    fleet = str(Path(__file__).resolve().parents[2] / "configs" / "fleet" / "local-sim.json")
    result = run_cli("fleet", "--fleet", fleet, *flags)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "ready at" not in result.stdout
    assert says in result.stderr.strip().splitlines()[-1]


def test_fleet_command_runs_and_stops_on_sigterm(tmp_path: Path) -> None:
    path = write_fleet(tmp_path, 2)
    doc = json.loads(path.read_text())
    engines = {e["id"]: e for e in doc["engines"]}
    http_ports = {eid: int(e["url"].rsplit(":", 1)[1]) for eid, e in engines.items()}
    nixl_ports = {eid: e["nixl"]["port"] for eid, e in engines.items()}
    proc = subprocess.Popen(
        [*COMMAND, "fleet", "--fleet", str(path), "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sim_env(),
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    pids: dict[str, int] = {}
    output: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < len(engines) and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            output.append(line)
            match = re.fullmatch(r"(\S+) ready at (\S+) \(pid (\d+)\)", line)
            if match:
                eid, url, pid = match.groups()
                assert url == engines[eid]["url"]
                pids[eid] = int(pid)
        assert set(pids) == set(engines), (output, proc.poll())
        for eid in engines:
            r = httpx.get(engines[eid]["url"] + "/health", timeout=5)
            assert r.status_code == 200
            assert port_open(nixl_ports[eid])
        # The fleet runs without an admin token: the fault endpoint is off.
        assert httpx.get(engines["e0"]["url"] + "/sim/faults", timeout=5).status_code == 403

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _, stderr = proc.communicate(timeout=10)
        while (line := lines.get(timeout=10)) is not None:
            output.append(line)
        assert output[-1] == "fleet stopped", output
        assert "Traceback" not in stderr
        for eid in engines:
            assert not port_open(http_ports[eid]), f"{eid} still listens on HTTP"
            assert not port_open(nixl_ports[eid]), f"{eid} still listens on NIXL"
            with pytest.raises(ProcessLookupError):
                os.kill(pids[eid], 0)
    finally:
        procs.stop(proc)
        # Engines run in sessions of their own: never leave one behind.
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_side_channel_and_http_ports_clash_only_where_their_addresses_do() -> None:
    """Compared by address, not by name: localhost is 127.0.0.1; two loopback addresses on
    one port, or a family's wildcard beside the other family, do not clash."""
    from narwhal.simengine.cli import _overlap

    assert _overlap("localhost", "127.0.0.1", 23999)
    assert _overlap("0.0.0.0", "127.0.0.1", 23999)
    assert not _overlap("127.0.0.1", "127.0.0.2", 23999)
    assert not _overlap("::", "0.0.0.0", 23999)
