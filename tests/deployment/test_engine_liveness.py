"""An engine counts as healthy (start) or ready (wait --run-dir) only while its own process runs
and holds its port: an answer on the port from another process (an earlier run's engine, while
ours failed to bind and exited) is not the engine's."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from narwhal.testing import procs
from narwhal.testing.ports import free_ports
from narwhal.testing.procfs import start_ticks
from narwhal.testing.procs import wait_until
from tests.deployment.sidecars import ROOT, TOOLS
from tests.helpers import MODEL
from tools.deployment import _procs
from tools.deployment._procs import RunRecord, alive, save_run, wait_healthy

SIM_PLAN = ROOT / "configs" / "launch" / "local-sim.yaml"


class _Answers(BaseHTTPRequestHandler):
    """An impostor engine: healthy, serving the plan's model."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": MODEL}]} if self.path == "/v1/models" else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def impostor(port: int) -> Iterator[None]:
    """Something else answering on ``port``, in this (the test's) process."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _Answers)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def engine_process(run_dir: Path, port: int, seconds: float) -> Iterator[RunRecord]:
    """A recorded 'engine' (as `start` records one) that never listens and exits after
    ``seconds``."""
    argv = [sys.executable, "-c", f"import time; time.sleep({seconds})"]
    log = run_dir / "engine-e0.log"
    proc = procs.start(argv, log)
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        pidfile = run_dir / "engine-e0.pid"
        pidfile.write_text(f"{proc.pid}\n")
        yield RunRecord("e0", proc.pid, ticks, f"http://127.0.0.1:{port}", str(log), str(pidfile))
    finally:
        procs.stop(proc, 5.0, group=True)


def test_start_counts_no_engine_healthy_that_another_process_answers_for(tmp_path: Path) -> None:
    """The health answer came from the impostor; the engine's own process exited without ever
    listening: it failed (it was reported healthy, pid and all)."""
    (port,) = free_ports(1)
    with impostor(port), engine_process(tmp_path, port, 1.0) as rec:
        problems = wait_healthy([rec], 20.0)
        assert not alive(rec)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"e0: exited before it was healthy (log {rec.log}")
    # Alive but never listening: not healthy either, however long the impostor answers.
    with impostor(port), engine_process(tmp_path, port, 30.0) as rec:
        problems = wait_healthy([rec], 1.0)
        assert alive(rec)
    assert problems == [f"e0: not healthy within 1 s at http://127.0.0.1:{port} (log {rec.log})"]


def _one_engine_plan(directory: Path, port: int, nixl: int) -> Path:
    plan = yaml.safe_load(SIM_PLAN.read_text())
    plan["engines"] = [
        {
            "id": "e0",
            "host": "127.0.0.1",
            "port": port,
            "side_channel": {"host": "127.0.0.1", "port": nixl},
        }
    ]
    path = directory / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def _wait(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOLS / "launch_plan.py"), "wait", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_wait_with_the_run_directory_holds_engines_to_their_own_processes(
    tmp_path: Path,
) -> None:
    port, nixl = free_ports(2)
    plan = _one_engine_plan(tmp_path, port, nixl)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with impostor(port):
        # Over HTTP alone the impostor is the engine: ready.
        plain = _wait(str(plan), "--timeout", "5", "--interval", "0.1")
        assert plain.returncode == 0, plain.stderr
        # The recorded engine exited: said so, not ready.
        with engine_process(run_dir, port, 0.2) as rec:
            save_run(run_dir, {"e0": rec})
            assert wait_until(lambda: not alive(rec), 10)
            done = _wait(
                str(plan), "--run-dir", str(run_dir), "--timeout", "5", "--interval", "0.1"
            )
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stdout == ""
        assert done.stderr.startswith(
            f"launch_plan.py: e0: exited before it was ready (log {rec.log}"
        ), done.stderr
        # The recorded engine runs but the port is another's: not ready, and why.
        with engine_process(run_dir, port, 30.0) as rec:
            save_run(run_dir, {"e0": rec})
            done = _wait(
                str(plan), "--run-dir", str(run_dir), "--timeout", "1", "--interval", "0.1"
            )
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.strip() == (
            f"launch_plan.py: e0: not ready within 1 s at http://127.0.0.1:{port} "
            f"(answered by a process other than its own (pid {rec.pid}))"
        )


def test_a_process_whose_descriptors_cannot_be_read_is_not_judged_by_them(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Another user's engine, or /proc mounted hidepid: its sockets cannot be listed, so who
    holds its port cannot be told and liveness alone decides (a review: such an engine was
    never counted healthy). Only the engine's own descriptors are hidden here."""
    (port,) = free_ports(1)
    with engine_process(tmp_path, port, 30) as record:
        assert not _procs.holds_its_port(record)  # readable: it holds nothing
        real_access = os.access

        def hidden(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
            if str(path) == f"/proc/{record.pid}/fd":
                return False
            return real_access(path, mode, *args, **kwargs)

        monkeypatch.setattr(_procs.os, "access", hidden)
        assert _procs.holds_its_port(record)
