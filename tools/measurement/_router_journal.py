"""Where the router under test keeps its journal, when the runner is not told (``--journal``):
the router's own answer to an admin (``GET /admin/state``), or, on the router host, the
``--journal`` argument of the process listening on the router's port (as the reference run
starts it: ``narwhal-serve ... --journal PATH``). Linux ``/proc`` only; nothing is guessed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

__all__ = [
    "JournalNotFound",
    "admin_state",
    "find_router_journal",
    "journal_argument",
    "listening_pids",
]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


class JournalNotFound(Exception):
    """Why the router's journal could not be found (one line)."""


def listening_pids(port: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes (readable to this user) holding a socket that listens on TCP ``port``."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            listening = len(fields) > 9 and fields[3] == _LISTEN
            if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return []
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue  # gone, or another user's
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    pids.append(int(entry.name))
                    break
            except OSError:
                continue
    return sorted(pids)


def journal_argument(argv: Sequence[str], cwd: Path) -> Path | None:
    """The ``--journal`` value of a narwhal-serve command line, resolved against its working
    directory; None when it has none."""
    for i, arg in enumerate(argv):
        if arg == "--journal" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--journal="):
            value = arg.split("=", 1)[1]
        else:
            continue
        path = Path(value)
        return path if path.is_absolute() else cwd / path
    return None


def _is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host in (socket.gethostname(), socket.getfqdn())
    return address.is_loopback or address.is_unspecified


def admin_state(client: httpx.Client, base: str, token_file: Path) -> Any:
    """The router's ``GET /admin/state`` document, or ``{"error": ...}`` saying why not."""
    token = token_file.read_text(encoding="utf-8").strip()
    try:
        r = client.get(base + "/admin/state", headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    return r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}"}


def _from_admin(base: str, token_file: Path) -> Path:
    with httpx.Client(timeout=10.0) as client:
        state = admin_state(client, base, token_file)
    if "error" in state:
        raise JournalNotFound(f"GET {base}/admin/state: {state['error']}")
    try:
        path = Path(state["journal"]["path"])
    except (KeyError, TypeError):
        raise JournalNotFound(f"GET {base}/admin/state has no journal.path") from None
    if not path.is_absolute():
        # A router older than the absolute path: relative to its working directory, which
        # /admin/state does not say (read from here, it could name another run's journal).
        raise JournalNotFound(f"GET {base}/admin/state names a relative journal path ({path})")
    return path


def _from_process(base: str, proc: Path) -> Path:
    parts = urlsplit(base)
    host = parts.hostname or ""
    if not _is_local(host):
        raise JournalNotFound(f"the router ({host}) is not on this host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    pids = listening_pids(port, proc)
    if not pids:
        raise JournalNotFound(f"no process of this user listens on port {port}")
    found: set[Path] = set()
    for pid in pids:
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
            cwd = Path(os.readlink(proc / str(pid) / "cwd"))
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        path = journal_argument(argv, cwd)
        if path is not None:
            found.add(path)
    if len(found) != 1:
        why = "has no --journal argument" if not found else "name different journals"
        raise JournalNotFound(f"the processes listening on port {port} ({pids}) {why}")
    return found.pop()


def find_router_journal(
    base: str, admin_token_file: Path | None, proc: Path = Path("/proc")
) -> tuple[Path, str]:
    """The journal of the router at ``base`` and how it was found; JournalNotFound (one line,
    every way tried) when it cannot be, or when the file is not readable here."""
    tried: list[str] = []
    ways = []
    if admin_token_file is not None:
        ways.append(("the router's /admin/state", lambda: _from_admin(base, admin_token_file)))
    ways.append(("the router process's --journal", lambda: _from_process(base, proc)))
    for how, way in ways:
        try:
            path = way()
        except JournalNotFound as exc:
            tried.append(f"{how}: {exc}")
            continue
        if not (path.is_file() or path.parent.is_dir()):
            tried.append(f"{how}: {path} is not readable on this host")
            continue
        return path, how
    raise JournalNotFound("; ".join(tried))
