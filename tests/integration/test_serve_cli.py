"""narwhal-serve's command line as an operator meets it: what cannot run is one line on stderr
and exit 2, before the router opens its journal or starts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

FLEET = Path(__file__).resolve().parents[2] / "configs" / "fleet" / "local-sim.json"


def serve(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", str(FLEET)]
    argv += ["--journal", str(tmp_path / "j.jsonl"), "--skip-qualification", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_port_in_use_or_a_host_that_does_not_resolve_is_one_line(tmp_path: Path) -> None:
    """Both were uvicorn's bare 'ERROR: [Errno 98] ...' line after the journal was opened."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        in_use = serve(tmp_path, "--port", str(port))
    # Keys, so the router does not fall back to 127.0.0.1 on a host that is not loopback.
    unresolved = serve(tmp_path, "--host", "999.1.1.1", "--port", "8000", "--api-key", "k")
    for result, says in (
        (in_use, f"narwhal-serve: --host/--port: cannot listen on 127.0.0.1:{port}: "),
        (unresolved, "narwhal-serve: --host/--port: '999.1.1.1' does not resolve"),
    ):
        assert result.returncode == 2, result.stderr
        # One line: the configuration's warnings (no API keys, unqualified) are not logged yet.
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(says), result.stderr
    assert not (tmp_path / "j.jsonl").exists()


def test_an_empty_fleet_path_names_the_flag(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", "", "--journal", "j.jsonl"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "narwhal-serve: --fleet: an empty path"


def test_the_bind_check_binds_as_the_servers_do() -> None:
    """IPv6 alone beside an IPv4 listener on the same port (IPV6_V6ONLY, as asyncio and uvloop
    bind), '' as every interface, a free port free."""
    from narwhal.asgi import tcp_bind_problem

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert tcp_bind_problem("127.0.0.1", port) is not None
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6) as probe:
                    probe.bind(("::1", 0))
            except OSError:
                pass  # no IPv6 on this host
            else:
                assert tcp_bind_problem("::1", port) is None
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert tcp_bind_problem("127.0.0.1", port) is None
    assert tcp_bind_problem("", port) is None
