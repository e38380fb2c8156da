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


def test_a_profile_store_given_as_the_journal_is_left_untouched(tmp_path: Path) -> None:
    """--profiles and --journal swapped: narwhal-profile writes its store without a final
    newline, and the router took its one line for a torn journal record, appended its records
    to the store and made it 0600."""
    store = tmp_path / "store.json"
    content = b'{"complete":true,"created_at":"2026-12-07T19:51:40+00:00","engines":{}}'
    store.write_bytes(content)
    store.chmod(0o644)
    argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", str(FLEET)]
    argv += ["--journal", str(store), "--skip-qualification", "--port", "28301"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"narwhal-serve: --journal: {store} is not a Narwhal journal (its only line, without a "
        "newline, does not begin as a journal record does)"
    )
    assert store.read_bytes() == content and store.stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "store.json.lock").exists()


def test_a_journal_path_ending_in_a_slash_names_a_directory(tmp_path: Path) -> None:
    """out/newdir/ (newdir missing) became the regular file out/newdir, and the router served."""
    for given in (f"{tmp_path}/newdir/", f"{tmp_path}/newdir/."):
        argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", str(FLEET)]
        argv += ["--journal", given, "--skip-qualification", "--port", "28302"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            f"narwhal-serve: --journal: {given} names a directory (a journal is a file)"
        )
    assert list(tmp_path.iterdir()) == []


def test_an_empty_path_is_refused_naming_its_flag(tmp_path: Path) -> None:
    """--profiles '' (an unset $STORE in a script) started the router without a profile store
    (the v0 scheduler) without a word; so did '' for the other files."""
    for flag in ("--profiles", "--check-report", "--api-keys-file", "--admin-token-file"):
        argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", str(FLEET), flag, ""]
        argv += ["--journal", str(tmp_path / "j.jsonl"), "--port", "28303"]
        if flag != "--check-report":
            argv.append("--skip-qualification")
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == f"narwhal-serve: {flag}: an empty path"
    assert not (tmp_path / "j.jsonl").exists()
    argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", str(FLEET), "--journal", ""]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "narwhal-serve: --journal: an empty path"


def test_a_bad_argument_is_one_line() -> None:
    """argparse printed its 24-line usage block before the error."""
    argv = [sys.executable, "-m", "narwhal.serve.cli", "--fleet", "f.json", "--journal", "j"]
    result = subprocess.run([*argv, "--port", "abc"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "narwhal-serve: argument --port: invalid int value: 'abc'\n"
    result = subprocess.run(argv[:5], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "narwhal-serve: the following arguments are required: --journal\n"
    helped = subprocess.run([*argv[:3], "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: narwhal-serve")
