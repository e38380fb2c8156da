"""Load spread over several narwhal-serve replicas, as the replica tests and
``bench/replicas.py`` send it: short completions to each replica in turn from a few threads,
bounded in count and time, with what each replica was sent and how each request ended."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from types import TracebackType

import httpx

__all__ = ["ReplicaLoad"]


class ReplicaLoad:
    """``with ReplicaLoad(urls, model) as load:`` sends until the block ends (or ``limit``
    requests per thread, or ``seconds``). ``exclude``/``include`` take a replica out of the
    rotation and back (one being killed): a request is counted as sent to the replica it went
    to, and as answered or failed there."""

    def __init__(
        self,
        urls: Mapping[str, str],
        model: str,
        *,
        threads: int = 3,
        limit: int = 2000,
        seconds: float = 600.0,
    ) -> None:
        self.urls = dict(urls)
        self.model = model
        self.limit = limit
        self.seconds = seconds
        self.sent: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        self.failed: dict[str, list[str]] = {}
        self._excluded: set[str] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]

    def exclude(self, name: str) -> None:
        with self._lock:
            self._excluded.add(name)

    def include(self, name: str) -> None:
        with self._lock:
            self._excluded.discard(name)

    def failures(self) -> list[str]:
        """Every failure, as ``replica: detail``."""
        with self._lock:
            return [f"{name}: {d}" for name, details in self.failed.items() for d in details]

    def _next(self, names: itertools.cycle[str]) -> str:
        with self._lock:
            name = next(n for n in names if n not in self._excluded)
            self.sent[name] = self.sent.get(name, 0) + 1
            return name

    def _run(self, seed: int) -> None:
        names = itertools.cycle(sorted(self.urls))
        deadline = time.monotonic() + self.seconds
        with httpx.Client(timeout=30, trust_env=False) as client:
            for n in range(self.limit):
                if self._done.is_set() or time.monotonic() > deadline:
                    return
                name = self._next(names)
                body = {
                    "model": self.model,
                    "prompt": f"replicas {seed} {n} " * 16,
                    "max_tokens": 8,
                }
                try:
                    response = client.post(self.urls[name] + "/v1/completions", json=body)
                    ok = response.status_code == 200
                    detail = f"{response.status_code} {response.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, detail = False, repr(exc)
                with self._lock:
                    if ok:
                        self.answered[name] = self.answered.get(name, 0) + 1
                    else:
                        self.failed.setdefault(name, []).append(detail)

    def __enter__(self) -> ReplicaLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join(60)
