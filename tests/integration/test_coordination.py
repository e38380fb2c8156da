"""narwhal.coordination against a real etcd, in process: the etcd client's operations, one
leader among coordinators, a deposed leader's flip refused by etcd itself, and a coordinator
that rereads everything after etcd comes back."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from narwhal.coordination import Coordinator, EtcdClient, EtcdUnavailable, SharedRoles
from narwhal.coordination.etcd import Compare, Operation
from narwhal.testing.etcd import EtcdServer, etcd_binary
from narwhal.testing.procs import async_wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EtcdServer]:
    if etcd_binary() is None:
        if os.environ.get("NARWHAL_ETCD_REQUIRED"):
            pytest.fail("etcd is not installed; `make test-deps` installs etcd-server")
        pytest.skip("etcd is not installed (make test-deps installs etcd-server)")
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server  # type: ignore[misc]


def document(writer: str = "test") -> SharedRoles:
    return SharedRoles(
        generation=0,
        roles={"e0": "prefill", "e1": "decode", "e2": "decode"},
        written_by=writer,
        written_at=0.0,
    )


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def coordinator(
    etcd: EtcdServer, namespace: str, name: str, seen: list[SharedRoles], ttl: int = 2
) -> Coordinator:
    return Coordinator(
        EtcdClient([f"http://{etcd.endpoint}"]),
        namespace,
        name,
        lambda: document(name),
        seen.append,
        lease_ttl_s=ttl,
        retry_s=0.1,
    )


def test_client_operations(etcd: EtcdServer) -> None:
    async def main() -> None:
        client = EtcdClient(["http://127.0.0.1:1", f"http://{etcd.endpoint}"], timeout_s=1)
        try:
            assert await client.get("/ops/missing") is None
            await client.put("/ops/a", b"one")
            kv = await client.get("/ops/a")
            assert kv is not None and kv.value == b"one" and kv.create_revision > 0
            created, _ = await client.txn(
                [Compare("/ops/a", "CREATE", 0)], [Operation("/ops/a", b"two")]
            )
            assert created is False  # it exists
            swapped, _ = await client.txn(
                [Compare("/ops/a", "MOD", kv.mod_revision)], [Operation("/ops/a", b"two")]
            )
            assert swapped is True
            assert (await client.get("/ops/a")).value == b"two"  # type: ignore[union-attr]
            lease = await client.grant(5)
            await client.put("/ops/leased", b"x", lease)
            assert await client.keepalive(lease) == 5
            kvs, revision = await client.get_prefix("/ops/")
            assert {kv.key for kv in kvs} == {"/ops/a", "/ops/leased"} and revision > 0
            await client.revoke(lease)
            assert await client.get("/ops/leased") is None
            assert await client.keepalive(lease) == 0
            await client.delete("/ops/a")
            assert await client.get("/ops/a") is None
        finally:
            await client.aclose()
        down = EtcdClient(["http://127.0.0.1:1"], timeout_s=0.5)
        with pytest.raises(EtcdUnavailable):
            await down.get("/x")
        await down.aclose()
        # A member that accepts and never answers: the error names the timeout (its message
        # is empty), not "()".
        with socket.create_server(("127.0.0.1", 0)) as silent:
            hung = EtcdClient([f"http://127.0.0.1:{silent.getsockname()[1]}"], timeout_s=0.3)
            with pytest.raises(EtcdUnavailable, match=r"answered \(ReadTimeout\)"):
                await hung.get("/x")
            await hung.aclose()

    asyncio.run(main())


def test_one_leader_and_a_deposed_leader_cannot_flip(etcd: EtcdServer) -> None:
    async def main() -> None:
        seen_a: list[SharedRoles] = []
        seen_b: list[SharedRoles] = []
        a = coordinator(etcd, "/t-fence/", "a", seen_a, ttl=30)
        b = coordinator(etcd, "/t-fence/", "b", seen_b, ttl=30)
        task_a = asyncio.create_task(a.run())
        await until(lambda: a.is_leader)
        task_b = asyncio.create_task(b.run())
        await until(lambda: b.up and b.leader_id == "a")
        assert not b.is_leader
        assert seen_a and seen_b and seen_a[0].roles == seen_b[0].roles

        # a stops hearing from etcd (its loop frozen) and believes it still leads, while its
        # lease is revoked (as a lapse would end it): b takes over.
        task_a.cancel()
        await asyncio.gather(task_a, return_exceptions=True)
        a.up = True  # what a frozen process still believes
        await b.client.revoke(a._lease)
        await until(lambda: b.is_leader)
        assert a.is_leader  # by its own stale reckoning
        stale = a.view
        assert stale is not None
        flip = {"engine": "e1", "from_role": "decode", "to_role": "prefill", "reason": "test"}
        assert await a.propose(stale.with_flip(flip, "a", 1.0), as_leader=True) is False
        view = b.view
        assert view is not None
        assert await b.propose(view.with_flip(flip, "b", 2.0), as_leader=True) is True
        await until(lambda: seen_b[-1].generation == 1)
        task_b.cancel()
        await asyncio.gather(task_b, return_exceptions=True)
        await b.resign()
        for c in (a, b):
            await c.client.aclose()

    asyncio.run(main())


def test_a_draining_leader_steps_down_at_once_and_keeps_following(etcd: EtcdServer) -> None:
    """``step_down`` (a replica's drain begins): another replica leads within moments, not
    when the draining one's lease (30 s here) runs out, and the draining one still applies the
    roles the new leader writes while it finishes its requests; it never campaigns again."""

    async def main() -> None:
        seen_a: list[SharedRoles] = []
        seen_b: list[SharedRoles] = []
        a = coordinator(etcd, "/t-step-down/", "a", seen_a, ttl=30)
        b = coordinator(etcd, "/t-step-down/", "b", seen_b, ttl=30)
        tasks = [asyncio.create_task(a.run())]
        await until(lambda: a.is_leader)
        tasks.append(asyncio.create_task(b.run()))
        await until(lambda: b.up and b.leader_id == "a")
        started = asyncio.get_running_loop().time()
        await a.step_down()
        assert not a.is_leader
        await until(lambda: b.is_leader and a.leader_id == "b", timeout=5)
        assert asyncio.get_running_loop().time() - started < 5  # far inside the lease's 30 s
        assert a.up and not a.is_leader
        view = b.view
        assert view is not None
        flip = {"engine": "e1", "from_role": "decode", "to_role": "prefill", "reason": "test"}
        assert await b.propose(view.with_flip(flip, "b", 1.0), as_leader=True) is True
        await until(lambda: bool(seen_a) and seen_a[-1].generation == 1)
        # b goes too: a, retired, does not take the leadership back.
        await b.step_down()
        # a sees the key go (etcd's watch, however long a loaded host makes it), then stays
        # without a leader: it does not campaign within the half second after.
        await until(lambda: a.leader_id is None, timeout=5)
        assert not await async_wait_until(lambda: a.is_leader or a.leader_id is not None, 0.5)
        assert a.leader_id is None and not a.is_leader
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (a, b):
            await c.resign()
            await c.client.aclose()

    asyncio.run(main())


def test_a_campaign_in_flight_when_the_replica_steps_down_gives_the_key_back(
    etcd: EtcdServer,
) -> None:
    """b's campaign is on its way to etcd (its transaction held here) when b steps down too
    (a scale-down: every replica drains at once): the campaign wins, and b gives the key back
    at once instead of holding, retired, a leadership it will never use for its whole drain."""

    async def main() -> None:
        a = coordinator(etcd, "/t-in-flight/", "a", [], ttl=30)
        b = coordinator(etcd, "/t-in-flight/", "b", [], ttl=30)
        tasks = [asyncio.create_task(a.run())]
        await until(lambda: a.is_leader)
        tasks.append(asyncio.create_task(b.run()))
        await until(lambda: b.up and b.leader_id == "a")
        held = asyncio.Event()
        in_flight = asyncio.Event()
        won: list[bool] = []
        real_txn = b.client.txn

        async def held_txn(*args: object, **kwargs: object) -> tuple[bool, int]:
            in_flight.set()
            await held.wait()
            result = await real_txn(*args, **kwargs)  # type: ignore[arg-type]
            won.append(result[0])
            return result

        b.client.txn = held_txn  # type: ignore[method-assign]
        await a.step_down()  # b sees the key go and campaigns: held
        await asyncio.wait_for(in_flight.wait(), 5)
        b.client.txn = real_txn  # type: ignore[method-assign]
        await b.step_down()  # nothing of b's to give back yet
        held.set()
        await until(lambda: won == [True])  # b's campaign landed: b created the key
        await until(lambda: b._my_leader_revision == 0 and b.leader_id is None)
        assert await a.client.get(a.leader_key) is None  # and gave it back
        assert not a.is_leader and not b.is_leader
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in (a, b):
            await c.resign()
            await c.client.aclose()

    asyncio.run(main())


def test_concurrent_writes_at_one_revision_exactly_one_lands(etcd: EtcdServer) -> None:
    async def main() -> None:
        seen: list[list[SharedRoles]] = [[], [], []]
        coordinators = [
            coordinator(etcd, "/t-race/", name, seen[i]) for i, name in enumerate("xyz")
        ]
        tasks = [asyncio.create_task(c.run()) for c in coordinators]
        await until(lambda: all(c.up and c.view is not None for c in coordinators))
        flips = [
            c.view.with_flip(  # type: ignore[union-attr]
                {"engine": e, "from_role": "decode", "to_role": "prefill", "reason": "race"},
                c.replica_id,
                1.0,
            )
            for c, e in zip(coordinators, ("e1", "e2", "e1"), strict=True)
        ]
        landed = await asyncio.gather(
            *(c.propose(f, as_leader=False) for c, f in zip(coordinators, flips, strict=True))
        )
        assert sorted(landed) == [False, False, True]
        await until(lambda: all(s and s[-1].generation == 1 for s in seen))
        assert len({tuple(sorted(s[-1].roles.items())) for s in seen}) == 1
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in coordinators:
            await c.resign()
            await c.client.aclose()

    asyncio.run(main())


def test_a_coordinator_rereads_everything_when_etcd_returns(tmp_path: Path) -> None:
    if etcd_binary() is None:
        pytest.skip("etcd is not installed")

    async def main(server: EtcdServer) -> None:
        seen: list[SharedRoles] = []
        other: list[SharedRoles] = []
        c = coordinator(server, "/t-outage/", "c", seen, ttl=10)
        d = coordinator(server, "/t-outage/", "d", other, ttl=10)
        tasks = [asyncio.create_task(c.run())]
        await until(lambda: c.is_leader)  # c first: of two started at once, either may lead
        tasks.append(asyncio.create_task(d.run()))
        await until(lambda: d.up and d.leader_id == "c")
        # The roles as they stood when d started are no change it applied late (the document
        # was written at wall time 0: its age would read as decades of lag).
        assert d.watch_lag_s == 0.0
        await asyncio.to_thread(server.stop)
        await until(lambda: not c.up and not d.up)
        assert not c.is_leader
        assert c.view is not None and c.view.generation == 0  # the roles last seen stay
        with pytest.raises(EtcdUnavailable):
            await c.propose(c.view, as_leader=False)
        await asyncio.to_thread(server.start)
        # The lease outlived the outage: c leads again without waiting for it to lapse.
        await until(lambda: c.up and d.up and c.is_leader)
        assert c.watch_lag_s == d.watch_lag_s == 0.0  # the same roles, read again
        view = d.view
        assert view is not None
        flip = {"engine": "e0", "from_role": "prefill", "to_role": "decode", "reason": "back"}
        assert await d.propose(view.with_flip(flip, "d", 3.0), as_leader=False)
        await until(lambda: bool(seen) and seen[-1].generation == 1)
        assert c.watch_lag_s > 0.0  # a change, seen through the watch: timed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for x in (c, d):
            await x.resign()
            await x.client.aclose()

    server = EtcdServer(tmp_path)
    with server:
        asyncio.run(main(server))


def test_two_routers_under_one_replica_id_are_named_once(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two coordinators started with one replica id overwrite each other's published demand:
    the one that sees the other's put says so, once, naming the flag to fix."""

    async def main() -> None:
        twins = [coordinator(etcd, "/t-twins/", "same", []) for _ in range(2)]
        tasks = [asyncio.create_task(t.run()) for t in twins]
        await until(lambda: all(t.up for t in twins))
        for _ in range(3):
            for twin in twins:
                await twin.publish(b"{}")
            await asyncio.sleep(0.05)
        await until(lambda: "give each replica its own --replica-id" in caplog.text)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for twin in twins:
            await twin.resign()
            await twin.client.aclose()

    with caplog.at_level(logging.ERROR, logger="narwhal"):
        asyncio.run(main())
    said = [r for r in caplog.records if "--replica-id" in r.getMessage()]
    assert 1 <= len(said) <= 2  # once for each router that saw the other
