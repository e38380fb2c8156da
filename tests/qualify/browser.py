"""A page loaded in a real browser: Debian's chromium, headless, driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: file descriptors 3 and 4, NUL-terminated JSON
messages; no port, no websocket library).

``load_page`` opens a file, waits for its load event, and returns the DOM as the browser built
it with every console error and uncaught exception the page raised on the way: console calls of
type error or assert (``Runtime.consoleAPICalled``), uncaught exceptions
(``Runtime.exceptionThrown``) and the browser's own error-level log entries (``Log.entryAdded``:
a resource that failed to load, a blocked request). Chromium runs as root in a container here,
so without its sandbox, without a GPU, and with a throwaway profile.

Without chromium the calling test skips, unless ``NARWHAL_BROWSER_REQUIRED=1`` (``make test``),
when it fails: ``make test-deps-chromium`` installs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["BrowserError", "PageLoad", "chromium", "load_page"]

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container: the setuid sandbox cannot start
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--remote-debugging-pipe",
)


class BrowserError(Exception):
    """The browser did not load the page (it died, or did not answer within the timeout)."""


@dataclass
class PageLoad:
    """A loaded page: the DOM after load (``document.documentElement.outerHTML``) and the
    console errors and uncaught exceptions, one line each (``kind: text (where)``)."""

    dom: str
    console_errors: list[str] = field(default_factory=list)
    # Every console message, whatever its level (for a failing test's message).
    console: list[str] = field(default_factory=list)


def chromium() -> str:
    """The chromium executable; skips the test (fails it under NARWHAL_BROWSER_REQUIRED=1)
    when there is none."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    why = "chromium is not installed (make test-deps-chromium installs Debian's chromium)"
    if os.environ.get("NARWHAL_BROWSER_REQUIRED") == "1":
        pytest.fail(f"NARWHAL_BROWSER_REQUIRED=1: {why}")
    pytest.skip(why)


class _Pipe:
    """The DevTools protocol over chromium's pipe: requests out on fd 3, replies and events
    in on fd 4, each message JSON ending with a NUL byte."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float) -> None:
        self._w = write_fd
        self._r = read_fd
        self._deadline = deadline
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("chromium did not answer within the timeout")
            ready, _, _ = select.select([self._r], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise BrowserError("chromium closed its DevTools pipe (it exited)")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        msg: dict[str, Any] = json.loads(raw)
        return msg

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str, session: str) -> None:
        while not any(e["method"] == method and e.get("sessionId") == session for e in self.events):
            reply = self._read_message()
            if "method" in reply:
                self.events.append(reply)


def _where(params: dict[str, Any]) -> str:
    url = params.get("url") or ""
    line = params.get("lineNumber")
    return f" ({url}:{line})" if url or line is not None else ""


def _console(events: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    errors: list[str] = []
    everything: list[str] = []
    for event in events:
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            args = params.get("args", [])
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in args)
            trace = (params.get("stackTrace") or {}).get("callFrames") or [{}]
            line = f"console.{params.get('type')}: {text}{_where(trace[0])}"
            everything.append(line)
            if params.get("type") in ("error", "assert"):
                errors.append(line)
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exc = details.get("exception") or {}
            text = exc.get("description") or details.get("text", "exception")
            line = f"uncaught: {text}{_where(details)}"
            everything.append(line)
            errors.append(line)
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            line = f"log.{entry.get('level')} ({entry.get('source')}): {entry.get('text')}"
            line += _where(entry)
            everything.append(line)
            if entry.get("level") == "error":
                errors.append(line)
    return errors, everything


def load_page(path: Path, timeout: float = 60.0) -> PageLoad:
    """Open ``path`` in headless chromium, wait for its load event (then a short settle for
    late errors), and return the DOM and the console errors. BrowserError past ``timeout``."""
    exe = chromium()
    url = Path(path).resolve().as_uri()
    deadline = time.monotonic() + timeout
    # Our ends: we write to chromium's fd 3 and read from its fd 4.
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    with tempfile.TemporaryDirectory(prefix="narwhal-chromium-") as profile:
        # Chromium reads fd 3 and writes fd 4: move the pipe ends there in the child (through
        # fds above 10 first, so that neither lands on the other before it is copied). dup2
        # leaves 3 and 4 inheritable; every other descriptor of ours is close-on-exec, hence
        # close_fds=False (which would close 3 and 4 after this runs).
        def child_fds() -> None:
            high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        log = Path(profile) / "chromium.log"
        with log.open("wb") as log_fh:
            proc = subprocess.Popen(
                [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=log_fh,
                close_fds=False,
                preexec_fn=child_fds,
            )
        os.close(to_browser_r)
        os.close(from_browser_w)
        pipe = _Pipe(to_browser_w, from_browser_r, deadline)
        try:
            target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
                "sessionId"
            ]
            for domain in ("Page", "Runtime", "Log"):
                pipe.call(f"{domain}.enable", session=session)
            pipe.call("Page.navigate", {"url": url}, session=session)
            pipe.wait_event("Page.loadEventFired", session)
            # Errors raised by load handlers or timers land just after the event.
            time.sleep(0.2)
            dom = pipe.call(
                "Runtime.evaluate",
                {"expression": "document.documentElement.outerHTML", "returnByValue": True},
                session=session,
            )["result"]["value"]
            with contextlib.suppress(BrowserError):  # it may close the pipe before answering
                pipe.call("Browser.close")
        except BrowserError as exc:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise BrowserError(f"{exc}; chromium log tail:\n{tail}") from None
        finally:
            os.close(to_browser_w)
            os.close(from_browser_r)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    events = [e for e in pipe.events if e.get("sessionId") == session]
    errors, everything = _console(events)
    return PageLoad(dom=f"<!DOCTYPE html>\n{dom}", console_errors=errors, console=everything)
