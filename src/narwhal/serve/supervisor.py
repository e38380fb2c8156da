"""Background loops that outlive their own faults.

The router's loops (health probes, engine scrapes, the role controller, etcd coordination,
each engine's KV event subscription) run for the router's whole life. A task that raised would
otherwise end silently: the router would serve on with engines' health, load, roles or prefix
entries frozen at the moment of the fault, and nothing on /metrics would say so. Each loop
runs under ``supervise``: a fault is logged with its traceback, counted in
``narwhal_background_task_restarts_total{task}``, and the loop started again after a backoff
that grows while it keeps failing at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from narwhal.metrics import RouterMetrics

__all__ = ["RESTART_BACKOFF_MAX_S", "RESTART_BACKOFF_S", "supervise"]

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
# A loop that ran this long before its fault starts again after the shortest backoff: a fault
# now and then is not a loop failing at once on every start.
HEALTHY_RUN_S = 60.0


async def supervise(
    task: str,
    start: Callable[[], Awaitable[None]],
    metrics: RouterMetrics,
    *,
    backoff_s: float = RESTART_BACKOFF_S,
    max_backoff_s: float = RESTART_BACKOFF_MAX_S,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Run ``start()`` until cancelled, starting it again after each fault (or return: the
    loops run forever, so a return is a fault too)."""
    delay = backoff_s
    restarts = metrics.background_task_restarts.labels(task)
    this = asyncio.current_task()
    while True:
        began = time.monotonic()
        error: BaseException | None = None
        try:
            await start()
        except asyncio.CancelledError as exc:
            if this is None or this.cancelling():
                raise
            error = exc  # a cancellation this task was not asked for (a subtask's): a fault
        except Exception as exc:
            error = exc
        if this is not None and this.cancelling():
            raise asyncio.CancelledError  # the loop swallowed this task's cancellation
        if time.monotonic() - began >= HEALTHY_RUN_S:
            delay = backoff_s
        if error is not None:
            log.error(
                "background task %s failed; starting it again in %.0f s",
                task,
                delay,
                exc_info=error,
            )
        else:
            log.error("background task %s ended; starting it again in %.0f s", task, delay)
        restarts.inc()
        await sleep(delay)
        delay = min(delay * 2, max_backoff_s)
