"""narwhal-serve's background loops outlive their faults: a loop that raised (or returned) is
logged, counted in ``narwhal_background_task_restarts_total{task}`` and started again after a
backoff that doubles while it keeps failing; cancelling the supervisor stops it. And a KV
event stream's reset leaves the engine routed by history, not by nothing."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from narwhal.engines.kv_events import StoredBlocks
from narwhal.metrics import RouterMetrics
from narwhal.routing.prefix import PrefixIndex, chain_keys
from narwhal.serve.background import _applier, _resetter, run_generation_watch
from narwhal.serve.supervisor import supervise
from tests.helpers import metric


def _metrics() -> RouterMetrics:
    return RouterMetrics(["e0"], "test", "0" * 64, None)


def test_a_failing_loop_is_started_again_with_a_growing_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = _metrics()
    starts: list[int] = []
    delays: list[float] = []
    running = asyncio.Event()

    async def loop() -> None:
        starts.append(len(starts))
        if len(starts) <= 3:
            raise RuntimeError(f"fault {len(starts)}")
        if len(starts) == 4:
            return  # a loop that ends is a fault too: they run forever
        running.set()
        await asyncio.Event().wait()

    async def record(delay: float) -> None:
        delays.append(delay)

    async def body() -> None:
        task = asyncio.create_task(
            supervise(
                "health_probes", loop, metrics, backoff_s=1.0, max_backoff_s=5.0, sleep=record
            )
        )
        await asyncio.wait_for(running.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level("WARNING", logger="narwhal.serve.supervisor"):
        asyncio.run(body())
    assert len(starts) == 5
    assert delays == [1.0, 2.0, 4.0, 5.0]
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "narwhal_background_task_restarts_total", task="health_probes") == 4
    assert metric(text, "narwhal_background_task_restarts_total", task="kv_events/e0") == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("health_probes failed" in m for m in messages) == 3
    assert sum("health_probes ended" in m for m in messages) == 1
    assert all(r.exc_info for r in caplog.records if "failed" in r.getMessage())


def test_every_background_task_is_exported_from_the_start() -> None:
    text = generate_latest(_metrics().registry).decode()
    tasks = ("health_probes", "engine_scrapes", "role_controller", "etcd_coordination")
    for task in (*tasks, "kv_events/e0"):
        assert f'narwhal_background_task_restarts_total{{task="{task}"}} 0.0' in text
    assert 'narwhal_kv_event_unreadable_batches_total{engine="e0"} 0.0' in text


def test_a_kv_event_reset_routes_the_engine_by_history_until_its_next_batch() -> None:
    """narwhal-serve's reset of an engine's entries (a gap beyond replay, a restart, an
    unreadable batch): what it published goes, and it is routed by history meanwhile, as an
    engine that publishes nothing; history is kept when it never sent a readable batch."""
    metrics = _metrics()
    index = PrefixIndex(4)
    index.add_engine("e0", 64)
    reset = _resetter(index, "e0", metrics)
    first = chain_keys(list(range(100, 108)), 4)
    index.record_routed("e0", first, 0.0)
    reset()  # never precise: the history stays
    assert index.match(first, 1.0) == {"e0": 2}
    tokens = list(range(8))
    _applier(index, "e0", metrics)([StoredBlocks([b"h0", b"h1"], None, tokens, 4, None)])
    assert index.match(chain_keys(tokens, 4), 1.0) == {"e0": 2}
    followed = 'narwhal_kv_events_followed{engine="e0"}'
    assert f"{followed} 1.0" in generate_latest(metrics.registry).decode()
    reset()
    assert f"{followed} 0.0" in generate_latest(metrics.registry).decode()
    assert not index.is_precise("e0") and index.match(chain_keys(tokens, 4), 1.0) == {}
    later = chain_keys(list(range(200, 208)), 4)
    index.record_routed("e0", later, 2.0)
    assert index.match(later, 50.0) == {"e0": 2}  # history: a claim in flight lives 10 s
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "narwhal_kv_event_resets_total", engine="e0") == 2


def test_a_loop_that_swallows_its_cancellation_is_not_started_again() -> None:
    metrics = _metrics()
    starts: list[int] = []
    running = asyncio.Event()

    async def stubborn() -> None:
        starts.append(1)
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return  # swallowed

    async def body() -> None:
        task = asyncio.create_task(supervise("role_controller", stubborn, metrics))
        await asyncio.wait_for(running.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(body())
    assert starts == [1]
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "narwhal_background_task_restarts_total", task="role_controller") == 0


def test_a_cancellation_the_task_was_not_asked_for_is_a_fault() -> None:
    """A loop that re-raises a subtask's cancellation (its own task not cancelled) ended by a
    fault: started again, like any other."""
    metrics = _metrics()
    starts: list[int] = []
    running = asyncio.Event()

    async def loop() -> None:
        starts.append(1)
        if len(starts) == 1:
            raise asyncio.CancelledError  # as a cancelled subtask's result() raises it
        running.set()
        await asyncio.Event().wait()

    async def no_wait(delay: float) -> None:
        pass

    async def body() -> None:
        task = asyncio.create_task(supervise("etcd_coordination", loop, metrics, sleep=no_wait))
        await asyncio.wait_for(running.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert len(starts) == 2
    text = generate_latest(metrics.registry).decode()
    assert metric(text, "narwhal_background_task_restarts_total", task="etcd_coordination") == 1


def test_a_hung_attestation_sidecar_does_not_hold_back_the_other_engines() -> None:
    """The generation watch reads every engine's attestation at once: e0's sidecar accepts and
    never answers, and e1, restarted into another generation, is flagged stale while e0's read
    still hangs (read one after the other, e1 waited each round for e0's 5 s timeout)."""

    async def scenario() -> tuple[float, bool]:
        hung: list[asyncio.StreamWriter] = []
        gave_up: list[bool] = []

        async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            hung.append(writer)
            await reader.read()  # until the client gives up and closes
            gave_up.append(True)

        async def attests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"generation": "g2"}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            writer.close()

        silent = await asyncio.start_server(never_answers, "127.0.0.1", 0)
        sidecar = await asyncio.start_server(attests, "127.0.0.1", 0)
        urls = {
            e: f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/attestation"
            for e, s in (("e0", silent), ("e1", sidecar))
        }
        metrics = RouterMetrics(["e0", "e1"], "test", "0" * 64, None)
        watch = asyncio.create_task(
            run_generation_watch(urls, {"e0": "g1", "e1": "g1"}, metrics, 0.01)
        )

        def stale() -> float:
            return metric(
                generate_latest(metrics.registry).decode(),
                "narwhal_engine_profile_stale",
                engine="e1",
            )

        try:
            for _ in range(1000):  # 10 s at most, twice the read timeout
                if stale() == 1 or watch.done():
                    break
                await asyncio.sleep(0.01)
            return stale(), bool(hung) and not gave_up
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            for writer in hung:
                writer.close()
            for server in (silent, sidecar):
                server.close()
                await server.wait_closed()

    flagged, e0_still_hanging = asyncio.run(scenario())
    assert flagged == 1
    assert e0_still_hanging
