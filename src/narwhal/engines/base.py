"""What every engine transport shares: its one exception type and its timeouts."""

from __future__ import annotations

__all__ = ["EngineTransportError", "Timeouts"]


class EngineTransportError(Exception):
    """The engine could not be reached, or its answer stopped or broke part way."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class Timeouts:
    """Connect and per-read timeouts of one engine's client (seconds)."""

    __slots__ = ("connect_s", "read_s")

    def __init__(self, connect_s: float, read_s: float) -> None:
        self.connect_s = connect_s
        self.read_s = read_s
