"""All of Narwhal's NIXL use, behind one small interface.

A ``KVTransferAgent`` owns one NIXL agent (UCX backend, progress thread off) and one registered
DRAM pool of KV blocks, and runs every NIXL call on a thread of its own, because a NIXL agent is
not safe to drive from several threads and the event loop must never block on it. The owner of
memory must keep polling notifications for a remote READ of it to progress (with the progress
thread off), so the thread polls hot while anything is outstanding and idles otherwise.

The asyncio side gets three things: ``peer_info()`` (what a side channel hands to readers),
``read()`` (pull remote blocks into local blocks, bounded by a timeout), and a callback for each
notification a reader sends when it has finished pulling.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["KVPeerInfo", "KVReadResult", "KVTransferAgent", "KVTransferError"]

log = logging.getLogger(__name__)

# NIXL logs to stdout and UCX would probe every interface; both must be set before import.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

_HOT_POLL_S = 0.0002
_IDLE_POLL_S = 0.01


class KVTransferError(Exception):
    """A KV READ failed: peer gone, transfer error, or no completion within its bound."""


@dataclass(frozen=True)
class KVPeerInfo:
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    generation: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "base_addr": self.base_addr,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "generation": self.generation,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> KVPeerInfo:
        try:
            return cls(
                engine_id=str(data["engine_id"]),
                agent_name=str(data["agent_name"]),
                agent_metadata=base64.b64decode(data["agent_metadata"]),
                base_addr=int(data["base_addr"]),
                block_bytes=int(data["block_bytes"]),
                num_blocks=int(data["num_blocks"]),
                generation=str(data["generation"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"malformed peer info: {exc}") from exc


@dataclass(frozen=True)
class KVReadResult:
    num_bytes: int
    num_descriptors: int
    seconds: float


@dataclass
class _Read:
    peer: KVPeerInfo
    remote_blocks: list[int]
    local_blocks: list[int]
    notif: bytes
    deadline: float
    future: asyncio.Future[KVReadResult]
    started: float = 0.0
    handle: Any = None
    cancelled: bool = False


@dataclass
class _Notify:
    peer: KVPeerInfo
    notif: bytes
    future: asyncio.Future[None]


@dataclass
class _PeerState:
    agent_name: str
    remote_dlist: Any


@dataclass
class KVTransferAgent:
    """One engine's NIXL agent and the KV pool it exposes to peers."""

    agent_name: str
    pool: np.ndarray
    on_notification: Callable[[bytes], None]
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _commands: queue.Queue[Any] = field(default_factory=queue.Queue, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _ready: threading.Event = field(default_factory=threading.Event, init=False)
    _metadata: bytes = field(default=b"", init=False)
    _start_error: BaseException | None = field(default=None, init=False)
    _holds: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.pool.ndim != 2 or self.pool.dtype != np.uint8 or not self.pool.flags.c_contiguous:
            raise ValueError("pool must be a C-contiguous uint8 array of shape (blocks, bytes)")

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def block_bytes(self) -> int:
        return int(self.pool.shape[1])

    @property
    def base_addr(self) -> int:
        return int(self.pool.ctypes.data)

    def start(self, loop: asyncio.AbstractEventLoop, timeout: float = 30.0) -> None:
        self._loop = loop
        self._thread = threading.Thread(
            target=self._run, name=f"nixl-{self.agent_name}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise KVTransferError(f"NIXL agent {self.agent_name} did not start within {timeout} s")
        if self._start_error is not None:
            raise KVTransferError(f"NIXL agent failed to start: {self._start_error}")

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def peer_info(self, engine_id: str, generation: str) -> KVPeerInfo:
        return KVPeerInfo(
            engine_id=engine_id,
            agent_name=self.agent_name,
            agent_metadata=self._metadata,
            base_addr=self.base_addr,
            block_bytes=self.block_bytes,
            num_blocks=self.num_blocks,
            generation=generation,
        )

    def set_outstanding_holds(self, count: int) -> None:
        """Tell the thread how many of our blocks peers may be reading, so it polls hot."""
        self._holds = count

    async def read(
        self,
        peer: KVPeerInfo,
        remote_blocks: Sequence[int],
        local_blocks: Sequence[int],
        notif: bytes,
        timeout: float,
    ) -> KVReadResult:
        """Pull ``remote_blocks`` of ``peer`` into our ``local_blocks``, then notify the peer."""
        if len(remote_blocks) != len(local_blocks):
            raise KVTransferError(
                f"block count mismatch: {len(remote_blocks)} remote vs {len(local_blocks)} local"
            )
        if peer.block_bytes != self.block_bytes:
            raise KVTransferError(
                f"block size mismatch: peer {peer.block_bytes} B vs local {self.block_bytes} B"
            )
        bad = [b for b in remote_blocks if not 0 <= b < peer.num_blocks]
        if bad:
            raise KVTransferError(f"remote block id {bad[0]} outside the peer's {peer.num_blocks}")
        assert self._loop is not None, "agent not started"
        future: asyncio.Future[KVReadResult] = self._loop.create_future()
        op = _Read(
            peer=peer,
            remote_blocks=list(remote_blocks),
            local_blocks=list(local_blocks),
            notif=notif,
            deadline=time.monotonic() + timeout,
            future=future,
        )
        self._commands.put(op)
        try:
            # The thread enforces the deadline; this outer bound only guards a dead thread.
            return await asyncio.wait_for(asyncio.shield(future), timeout + 5.0)
        except asyncio.CancelledError:
            op.cancelled = True
            raise
        except TimeoutError as exc:
            op.cancelled = True
            raise KVTransferError(
                f"KV read from {peer.engine_id} timed out after {timeout} s"
            ) from exc

    async def notify(self, peer: KVPeerInfo, notif: bytes, timeout: float) -> None:
        """Send ``peer`` the notification a reader sends once it has pulled, without a READ:
        what vLLM's NixlConnector does for a decode request aborted before its pull, so that
        the prefill engine frees the blocks at once instead of when their lease expires."""
        assert self._loop is not None, "agent not started"
        future: asyncio.Future[None] = self._loop.create_future()
        self._commands.put(_Notify(peer=peer, notif=notif, future=future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError as exc:
            raise KVTransferError(
                f"notification to {peer.engine_id} not sent within {timeout} s"
            ) from exc

    # --- the NIXL thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            agent = nixl_agent(self.agent_name, config)
            agent.register_memory([(self.base_addr, self.pool.nbytes, 0, "")], "DRAM")
            local_dlist = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self._descs(self.base_addr), "DRAM"
            )
            self._metadata = agent.get_agent_metadata()
        except BaseException as exc:  # report any start failure to the starting thread
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        peers: dict[str, _PeerState] = {}
        active: list[_Read] = []
        while not self._stop.is_set():
            hot = bool(active) or self._holds > 0
            try:
                command = self._commands.get(timeout=_HOT_POLL_S if hot else _IDLE_POLL_S)
            except queue.Empty:
                command = None
            while command is not None:
                if isinstance(command, _Read):
                    self._post(agent, local_dlist, peers, command, active)
                elif isinstance(command, _Notify):
                    self._send_notif(agent, peers, command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            try:
                notifs = agent.get_new_notifs()
            except Exception as exc:  # keep serving; a broken peer must not stop the engine
                log.warning("NIXL notification poll failed: %s", exc)
                notifs = {}
            for messages in notifs.values():
                for message in messages:
                    self._deliver(self.on_notification, message)
            for op in list(active):
                self._check(agent, peers, op, active)

    def _descs(self, base: int) -> np.ndarray:
        n = self.num_blocks
        descs = np.empty((n, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(self.block_bytes)
        descs[:, 1] = self.block_bytes
        descs[:, 2] = 0
        return descs

    def _peer(self, agent: Any, peers: dict[str, _PeerState], info: KVPeerInfo) -> _PeerState:
        state = peers.get(info.agent_name)
        if state is None:
            name = agent.add_remote_agent(info.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            n = info.num_blocks
            descs = np.empty((n, 3), dtype=np.uint64)
            descs[:, 0] = info.base_addr + np.arange(n, dtype=np.uint64) * np.uint64(
                info.block_bytes
            )
            descs[:, 1] = info.block_bytes
            descs[:, 2] = 0
            state = _PeerState(
                agent_name=name, remote_dlist=agent.prep_xfer_dlist(name, descs, "DRAM")
            )
            peers[info.agent_name] = state
        return state

    def _forget(self, agent: Any, peers: dict[str, _PeerState], info: KVPeerInfo) -> None:
        state = peers.pop(info.agent_name, None)
        if state is None:
            return
        try:
            agent.release_dlist_handle(state.remote_dlist)
            agent.remove_remote_agent(state.agent_name)
        except Exception as exc:
            log.debug("forgetting NIXL peer %s: %s", info.agent_name, exc)

    def _post(
        self,
        agent: Any,
        local_dlist: Any,
        peers: dict[str, _PeerState],
        op: _Read,
        active: list[_Read],
    ) -> None:
        if op.cancelled:
            return
        op.started = time.monotonic()
        try:
            peer = self._peer(agent, peers, op.peer)
            op.handle = agent.make_prepped_xfer(
                "READ",
                local_dlist,
                np.asarray(op.local_blocks, dtype=np.int32),
                peer.remote_dlist,
                np.asarray(op.remote_blocks, dtype=np.int32),
                op.notif,
            )
            state = agent.transfer(op.handle)
        except Exception as exc:
            self._forget(agent, peers, op.peer)
            self._fail(agent, op, f"{type(exc).__name__}: {exc}")
            return
        if state == "DONE":
            self._finish(agent, op)
        elif state == "PROC":
            active.append(op)
        else:
            self._forget(agent, peers, op.peer)
            self._fail(agent, op, "transfer could not be posted")

    def _send_notif(self, agent: Any, peers: dict[str, _PeerState], op: _Notify) -> None:
        try:
            state = self._peer(agent, peers, op.peer)
            agent.send_notif(state.agent_name, op.notif)
        except Exception as exc:
            self._forget(agent, peers, op.peer)
            why = f"notification to {op.peer.engine_id}: {type(exc).__name__}: {exc}"
            self._resolve(op.future, None, KVTransferError(why))
            return
        self._resolve(op.future, None, None)

    def _check(
        self, agent: Any, peers: dict[str, _PeerState], op: _Read, active: list[_Read]
    ) -> None:
        try:
            state = agent.check_xfer_state(op.handle)
        except Exception as exc:
            state = f"ERR ({type(exc).__name__}: {exc})"
        if state == "PROC":
            if op.cancelled or time.monotonic() > op.deadline:
                active.remove(op)
                reason = "cancelled" if op.cancelled else "timed out"
                self._fail(
                    agent, op, f"transfer {reason} after {time.monotonic() - op.started:.3f} s"
                )
            return
        active.remove(op)
        if state == "DONE":
            self._finish(agent, op)
        else:
            self._forget(agent, peers, op.peer)
            self._fail(agent, op, f"transfer failed: {state}")

    def _finish(self, agent: Any, op: _Read) -> None:
        seconds = time.monotonic() - op.started
        self._release(agent, op)
        result = KVReadResult(
            num_bytes=len(op.local_blocks) * self.block_bytes,
            num_descriptors=len(op.local_blocks),
            seconds=seconds,
        )
        self._resolve(op.future, result, None)

    def _fail(self, agent: Any, op: _Read, reason: str) -> None:
        self._release(agent, op)
        self._resolve(
            op.future, None, KVTransferError(f"KV read from {op.peer.engine_id}: {reason}")
        )

    @staticmethod
    def _release(agent: Any, op: _Read) -> None:
        if op.handle is not None:
            try:
                agent.release_xfer_handle(op.handle)
            except Exception as exc:
                log.debug("releasing a NIXL transfer handle: %s", exc)
            op.handle = None

    def _resolve(
        self,
        future: asyncio.Future[Any],
        result: KVReadResult | None,
        error: BaseException | None,
    ) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(settle)

    def _deliver(self, callback: Callable[[bytes], None], message: bytes) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, message)
