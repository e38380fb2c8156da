"""What every engine transport shares: its one exception type and its timeouts."""

from __future__ import annotations

__all__ = ["EngineTransportError", "Timeouts", "wrapped_transport_error"]


class EngineTransportError(Exception):
    """The engine could not be reached, or its answer stopped or broke part way.

    ``str()`` is the whole story, for the journal and the log (a socket error names the
    engine's address); ``reason`` is what a client may be told: ``public`` when the message
    wraps a library's error, else the message itself (the transports' own say no address)."""

    def __init__(self, message: str, *, timeout: bool = False, public: str | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.public = public

    @property
    def reason(self) -> str:
        return self.public if self.public is not None else str(self)


def wrapped_transport_error(exc: BaseException, *, timeout: bool) -> EngineTransportError:
    """A library's or the socket's error as an EngineTransportError: its whole text (which
    names the engine's address) for the journal, its kind for clients."""
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    kind = type(exc).__name__
    public = (
        f"the engine timed out ({kind})"
        if timeout
        else f"the connection to the engine failed ({kind})"
    )
    return EngineTransportError(message, timeout=timeout, public=public)


class Timeouts:
    """Connect and per-read timeouts of one engine's client (seconds)."""

    __slots__ = ("connect_s", "read_s")

    def __init__(self, connect_s: float, read_s: float) -> None:
        self.connect_s = connect_s
        self.read_s = read_s
