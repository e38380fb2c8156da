"""One replica's part in a coordinated fleet: the shared roles document, the leader lease and
the replicas' published demand, all under one etcd key prefix per fleet contract.

Keys under ``/narwhal/<fleet name>/<first 16 hex of the fleet's sha256>/``:

- ``roles``: the :class:`SharedRoles` document (every engine's role, the role generation, the
  pin, the last flips). Every change is a transaction conditional on the document's
  ``mod_revision`` as the writer last saw it, so of two concurrent changes exactly one lands.
- ``leader``: the replica id of the one replica that runs the role controller, put under that
  replica's lease only if absent. A leader's flip is conditional on the key's
  ``create_revision`` being the one it created: once its lease lapses the key is gone, and a
  deposed leader's flip fails in etcd, whatever the deposed process believes.
- ``replicas/<id>``: each replica's demand window, under its own lease, so a replica that dies
  drops out of the leader's sum when its lease expires.

Every replica watches the whole prefix and applies a new roles document within one watch round
trip. When etcd cannot be reached the replica is ``down``: it keeps the roles it last saw, no
flip or pin can be written, and it reconnects and rereads everything when etcd returns (reusing
its lease, and so its leadership, when the lease outlived the outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from narwhal.coordination.etcd import (
    Compare,
    EtcdClient,
    EtcdUnavailable,
    KeyValue,
    Operation,
    WatchEvent,
)

__all__ = ["HISTORY_KEPT", "Coordinator", "SharedRoles", "namespace_of", "parse_coordination_url"]

log = logging.getLogger("narwhal.coordination")

HISTORY_KEPT = 100  # flips kept in the shared document (each replica's journal keeps them all)


class SharedRoles(BaseModel):
    """The fleet's roles as every replica applies them (stored as JSON at ``<prefix>roles``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int = Field(ge=0)
    roles: dict[str, Literal["prefill", "decode"]]
    pinned: bool = False
    history: tuple[dict[str, Any], ...] = ()
    written_by: str
    written_at: float  # wall clock of the writer: a reader's watch lag is its clock minus this

    def with_flip(self, entry: dict[str, Any], writer: str, now: float) -> SharedRoles:
        """The next generation: ``entry`` (engine, from_role, to_role, reason, ...) applied."""
        generation = self.generation + 1
        roles = dict(self.roles)
        roles[entry["engine"]] = entry["to_role"]
        recorded = {**entry, "role_generation": generation, "decided_by": writer}
        return SharedRoles(
            generation=generation,
            roles=roles,
            pinned=self.pinned,
            # Entries numbered from this generation on are stale (written back by a replica
            # that had replayed another timeline's): dropped, so etcd cleans itself up.
            history=(
                *(e for e in self.history if e.get("role_generation", 0) < generation),
                recorded,
            )[-HISTORY_KEPT:],
            written_by=writer,
            written_at=now,
        )

    def with_pinned(self, pinned: bool, writer: str, now: float) -> SharedRoles:
        return self.model_copy(update={"pinned": pinned, "written_by": writer, "written_at": now})

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


def parse_coordination_url(url: str) -> list[str]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` as the members' ``http://HOST:PORT`` endpoints.
    Raises ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "etcd":
        raise ValueError(f"expected etcd://HOST:PORT[,HOST:PORT...], got {url!r}")
    endpoints = []
    for member in rest.rstrip("/").split(","):
        parts = urlsplit(f"http://{member.strip()}")
        try:
            port = parts.port
        except ValueError:
            # urlsplit refuses a port past 65535 as it refuses one that is not a number
            port = None
            digits = parts.netloc.rpartition(":")[2]
            if parts.hostname and digits.isdigit():
                raise ValueError(f"etcd member {member!r}: port is not 1-65535") from None
        if not parts.hostname or port is None or parts.path:
            raise ValueError(f"etcd member {member!r} is not HOST:PORT")
        if not 1 <= port <= 65535:
            raise ValueError(f"etcd member {member!r}: port is not 1-65535")
        endpoints.append(f"http://{member.strip()}")
    return endpoints


def namespace_of(fleet_name: str, fleet_sha256: str) -> str:
    """Replicas share roles only when they serve the same contract, byte for byte."""
    return f"/narwhal/{fleet_name}/{fleet_sha256[:16]}/"


class Coordinator:
    """``initial()`` gives the document to create when etcd holds none (the replica's roles
    now); ``on_roles(doc)`` is called, on the event loop, with every newer document seen."""

    def __init__(
        self,
        client: EtcdClient,
        namespace: str,
        replica_id: str,
        initial: Callable[[], SharedRoles],
        on_roles: Callable[[SharedRoles], None],
        *,
        lease_ttl_s: int = 5,
        retry_s: float = 1.0,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.replica_id = replica_id
        self.lease_ttl_s = lease_ttl_s
        self.retry_s = retry_s
        self._initial = initial
        self._on_roles = on_roles
        self._wall = wall_clock
        self._mono = monotonic
        self.up = False
        self.view: SharedRoles | None = None
        self.view_revision = 0
        self.leader_id: str | None = None
        self.peers: dict[str, bytes] = {}  # replicas/<id> of the other replicas
        self.watch_lag_s = 0.0  # of the last roles document applied from the watch
        # While a session reads the store: the revision of the roles this replica had applied
        # (0: none yet); a document read then is a change to time only if it differs.
        self._resyncing_from: int | None = None
        self._duplicate_logged = False  # another router publishes under this replica's id
        self.last_error: str | None = None
        self._lease = 0
        self._lease_deadline = 0.0
        self._leader_key_revision = 0  # create_revision of the leader key as last seen
        self._my_leader_revision = 0  # create_revision of the leader key this replica put
        self._revision = 0
        self._campaign = asyncio.Event()
        # Out of the election for good (the replica drains, ``step_down``): it no longer leads
        # or campaigns, but keeps its lease, its view of the roles and its published demand.
        self.retired = False
        # Set once the first session is up, or has failed: a starting replica waits for it
        # so that it serves its first request with the fleet's roles, not its own.
        self.first_attempt = asyncio.Event()

    # --- keys -------------------------------------------------------------------------------

    @property
    def roles_key(self) -> str:
        return self.namespace + "roles"

    @property
    def leader_key(self) -> str:
        return self.namespace + "leader"

    @property
    def replica_key(self) -> str:
        return self.namespace + "replicas/" + self.replica_id

    # --- state ------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this replica holds the leader key and its lease has not run out by its own
        clock (etcd's fence on every flip is what makes this safe, not this guess)."""
        return (
            self.up
            and not self.retired
            and self.leader_id == self.replica_id
            and self._my_leader_revision != 0
            and self._my_leader_revision == self._leader_key_revision
            and self._mono() < self._lease_deadline
        )

    # --- the session ------------------------------------------------------------------------

    async def run(self) -> None:
        """Forever: connect, read everything, keep the lease, watch, campaign; after a failure,
        serve with what was last seen and try again every ``retry_s``."""
        while True:
            try:
                await self._session()
            except EtcdUnavailable as exc:
                message = str(exc)
                if self.up or self.last_error != message:
                    log.warning(
                        "coordination: etcd unavailable (%s): serving with the roles last "
                        "seen; no flips until it returns",
                        message,
                    )
                self.last_error = message
            except Exception as exc:  # an answer this client did not expect: never stop trying
                log.exception("coordination: session failed; starting over")
                self.last_error = f"{type(exc).__name__}: {exc}"
            self.first_attempt.set()
            self._set_down()
            await asyncio.sleep(self.retry_s)

    def _set_down(self) -> None:
        if self.leader_id == self.replica_id:
            log.warning("coordination: %s no longer leads (etcd not reachable)", self.replica_id)
        self.up = False
        self.leader_id = None
        self._leader_key_revision = 0
        self.peers.clear()  # unknown until the next session reads them

    async def _session(self) -> None:
        client = self.client
        await self._ensure_lease()
        await client.txn(
            [Compare(self.roles_key, "CREATE", 0)],
            [Operation(self.roles_key, self._initial().encode())],
        )
        kvs, revision = await client.get_prefix(self.namespace)
        self.peers.clear()
        self.leader_id = None
        self._leader_key_revision = 0
        # Whatever the store holds now wins, even a document older than the last one seen (an
        # etcd restored from a backup): resynchronise, do not compare with the past.
        self._resyncing_from = self.view_revision
        self.view_revision = 0
        try:
            for kv in kvs:
                self._apply(WatchEvent(False, kv))
        finally:
            self._resyncing_from = None
        self._revision = revision
        self.up = True
        if self.last_error is not None:
            log.info("coordination: etcd reachable again; roles resynchronised")
            self.last_error = None
        if self.leader_id is None:
            await self._campaign_once()
        elif self.retired:  # a key it could not give back before etcd went away
            await self._release_leader_key()
        self.first_attempt.set()
        tasks = [
            asyncio.create_task(self._keep_lease()),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._campaigns()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise what ended the session
            raise EtcdUnavailable("coordination session ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _ensure_lease(self) -> None:
        """Reuse the lease if it outlived an outage (so does this replica's leadership)."""
        if self._lease:
            sent = self._mono()
            with contextlib.suppress(EtcdUnavailable):
                ttl = await self.client.keepalive(self._lease)
                if ttl > 0:
                    self._lease_deadline = sent + ttl
                    return
        sent = self._mono()
        self._lease = await self.client.grant(self.lease_ttl_s)
        self._lease_deadline = sent + self.lease_ttl_s
        self._my_leader_revision = 0

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            sent = self._mono()
            try:
                ttl = await self.client.keepalive(self._lease)
            except EtcdUnavailable:
                if self._mono() >= self._lease_deadline:
                    raise
                continue  # the lease holds a while yet: try again at the next beat
            if ttl <= 0:
                self._lease = 0
                raise EtcdUnavailable("this replica's lease expired")
            self._lease_deadline = sent + ttl

    async def _watch(self) -> None:
        async for revision, events in self.client.watch_prefix(self.namespace, self._revision + 1):
            for event in events:
                self._apply(event)
            self._revision = max(self._revision, revision)

    async def _campaigns(self) -> None:
        while True:
            await self._campaign.wait()
            self._campaign.clear()
            await self._campaign_once()

    async def _campaign_once(self) -> None:
        if self.retired:
            return
        won, revision = await self.client.txn(
            [Compare(self.leader_key, "CREATE", 0)],
            [Operation(self.leader_key, self.replica_id.encode(), self._lease)],
        )
        if won:
            # A key put in a transaction is created at the transaction's revision.
            self._my_leader_revision = revision
            self.leader_id = self.replica_id
            self._leader_key_revision = revision
            if self.retired:  # step_down ran while this campaign was in flight
                await self._release_leader_key()
                return
            log.info("coordination: %s leads (lease %x)", self.replica_id, self._lease)

    def _apply(self, event: WatchEvent) -> None:
        kv = event.kv
        name = kv.key[len(self.namespace) :]
        if name == "roles":
            if not event.deleted:
                self._accept(kv, self._wall())
        elif name == "leader":
            self._leader_seen(kv, event.deleted)
        elif name.startswith("replicas/"):
            replica = name[len("replicas/") :]
            if replica == self.replica_id:
                if (
                    not event.deleted
                    and kv.lease not in (0, self._lease)
                    and self._resyncing_from is None  # not a key this id's last run left
                    and not self._duplicate_logged
                ):
                    # Two routers started with one --replica-id: they overwrite each other's
                    # demand, and the leader's id no longer says which of them leads.
                    self._duplicate_logged = True
                    log.error(
                        "coordination: another replica publishes as %r (lease %x, ours %x): "
                        "give each replica its own --replica-id",
                        replica,
                        kv.lease,
                        self._lease,
                    )
                return
            if event.deleted:
                self.peers.pop(replica, None)
            else:
                self.peers[replica] = kv.value

    def _leader_seen(self, kv: KeyValue, deleted: bool) -> None:
        if deleted:
            if self.leader_id == self.replica_id and not self.retired:
                log.warning("coordination: %s no longer leads", self.replica_id)
            self.leader_id = None
            self._leader_key_revision = 0
            self._campaign.set()
            return
        self.leader_id = kv.value.decode(errors="replace")
        self._leader_key_revision = kv.create_revision
        if self.leader_id == self.replica_id and kv.lease == self._lease:
            # Ours from before an outage, under the lease that outlived it.
            self._my_leader_revision = kv.create_revision

    def _accept(self, kv: KeyValue, now: float) -> None:
        if kv.mod_revision <= self.view_revision:
            return  # this replica wrote it, or saw a newer one already
        try:
            document = SharedRoles.model_validate_json(kv.value)
        except ValueError as exc:
            log.error("coordination: the roles document at %s is not valid: %s", kv.key, exc)
            return
        known = self._resyncing_from
        # The roles as they were at start-up, or as this replica had them before an outage,
        # are no change applied late: the lag stays as it was.
        timed = known is None or (known != 0 and kv.mod_revision != known)
        self._adopt(document, kv.mod_revision, now, timed=timed)

    def _adopt(self, document: SharedRoles, revision: int, now: float, *, timed: bool) -> None:
        """``document``, stored at ``revision``, is the roles as this replica sees them now
        (``timed``: a change, whose lag from its write is the watch's)."""
        self.view = document
        self.view_revision = revision
        if timed:
            self.watch_lag_s = max(0.0, now - document.written_at)
        self._on_roles(document)

    # --- writes -----------------------------------------------------------------------------

    async def propose(self, document: SharedRoles, *, as_leader: bool) -> bool:
        """Write ``document`` if the roles are still those this replica last saw (and, for a
        leader's flip, if it still leads). True when it landed, and was applied here."""
        if not self.up:
            raise EtcdUnavailable(self.last_error or "not connected to etcd")
        compares = [Compare(self.roles_key, "MOD", self.view_revision)]
        if as_leader:
            if not self.is_leader:
                return False
            compares.append(Compare(self.leader_key, "CREATE", self._my_leader_revision))
        landed, revision = await self.client.txn(
            compares, [Operation(self.roles_key, document.encode())]
        )
        if landed:
            self._adopt(document, revision, document.written_at, timed=True)
        return landed

    async def publish(self, payload: bytes) -> None:
        """This replica's demand, under its lease (gone when the replica is)."""
        if self.up:
            await self.client.put(self.replica_key, payload, self._lease)

    async def step_down(self) -> None:
        """Leave the election (the replica drains): give back the leader key if this replica
        holds it, so another takes the role controller over now rather than when this one
        exits, and never campaign again. A campaign already in flight, or etcd out of reach,
        gives the key back when it lands or the session resumes."""
        self.retired = True
        await self._release_leader_key()

    async def _release_leader_key(self) -> None:
        """Delete the leader key if it is still the one this replica created (a transaction
        on its create revision). Bounded as resign is: a key not given back lapses with the
        lease at the replica's exit at the latest."""
        revision = self._my_leader_revision
        if revision == 0:
            return
        with contextlib.suppress(EtcdUnavailable, TimeoutError):
            async with asyncio.timeout(self.client.timeout_s):
                deleted, _ = await self.client.txn(
                    [Compare(self.leader_key, "CREATE", revision)], [Operation(self.leader_key)]
                )
            # Given back, or no longer this replica's to give (its lease lapsed meanwhile).
            if self._my_leader_revision == revision:
                self._my_leader_revision = 0
            if self.leader_id == self.replica_id:
                self.leader_id = None
            if deleted:
                log.info("coordination: %s steps down as leader (draining)", self.replica_id)

    async def resign(self) -> None:
        """Give up the lease at once (a clean stop): leadership moves without waiting out the
        TTL, and this replica's demand leaves the sum."""
        if self._lease and self.up:
            # One timeout for all the endpoints: a stop waits at most that for an etcd that
            # went away unnoticed (the lease then lapses at its TTL instead).
            with contextlib.suppress(EtcdUnavailable, TimeoutError):
                async with asyncio.timeout(self.client.timeout_s):
                    await self.client.revoke(self._lease)
        self._lease = 0
        self._set_down()
