"""narwhal-serve's settings: everything the command line (and the fleet file) decided, checked,
before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from narwhal.contract import LoadedFleet
from narwhal.engines.transport import EngineTransportName
from narwhal.profiles.store import ProfileStore

__all__ = ["ServeSettings"]


@dataclass(frozen=True)
class ServeSettings:
    fleet: LoadedFleet
    journal_path: Path
    api_key_hashes: tuple[bytes, ...] = ()
    admin_token_hash: bytes | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout_s: float = 60.0  # to read a request's whole body (408 past it)
    health_interval_s: float = 1.0
    scrape_interval_s: float = 1.0
    prefill_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    protect_metrics: bool = False
    protect_health: bool = False
    journal_fsync_interval_s: float = 1.0
    journal_max_bytes: int = 256 * 1024 * 1024
    journal_on_error: Literal["fail_closed", "best_effort"] = "fail_closed"
    profile_sha256: str | None = None
    profiles: ProfileStore | None = None
    # Where the store was read (--profiles, or the fleet's), journaled with router.start: the
    # file a benchmark's evidence copies.
    profile_store_path: str | None = None
    scheduler: Literal["v0", "v1"] = "v0"
    qualification: dict[str, Any] = field(default_factory=dict)
    engine_transport: EngineTransportName = "aiohttp"
    # push: decode events written to the client from the engine connection's data_received;
    # asgi: a task per stream pulls them and sends each piece through ASGI.
    relay: Literal["push", "asgi"] = "push"
    # The command line that started the router (secrets masked), journaled with router.start:
    # the server half of a benchmark's record.
    command: str | None = None
    # etcd members (http://HOST:PORT) shared with the other replicas; empty: this router is alone.
    coordination: tuple[str, ...] = ()
    replica_id: str | None = None
    coordination_lease_ttl_s: int = 5
    # The claim on the journal (journal.claim.claim_journal) while the router runs: the
    # command line takes it before anything reads or writes the journal; None: unclaimed
    # (a router built in a test process).
    journal_claim: BinaryIO | None = field(default=None, compare=False, repr=False)
