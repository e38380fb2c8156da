"""Admission control: what to do with a request when the scheduler's answer is not a pair.

Pure; called by ``narwhal.routing.lifecycle``, which owns the admission queue: the router turns
a ``Queue`` verdict into a bounded, time-limited wait, the simulator into a virtual one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from narwhal.contract import RoutingPolicy
from narwhal.routing.scheduler import NoPair, Pair

__all__ = ["Admit", "Queue", "Reject", "Unavailable", "Verdict", "admit"]


@dataclass(frozen=True)
class Admit:
    pair: Pair
    # Admitted over budget because nothing at all runs on the pair (the lifecycle's idle
    # override): it delays no one, and what it measures corrects the predictions.
    idle: bool = False


@dataclass(frozen=True)
class Reject:
    reason: Literal["over_budget", "queue_full", "queue_timeout"]
    message: str


@dataclass(frozen=True)
class Queue:
    message: str


@dataclass(frozen=True)
class Unavailable:
    message: str


Verdict = Admit | Reject | Queue | Unavailable


def admit(
    pick: Pair | NoPair,
    policy: RoutingPolicy,
    queued: int,
    waited_s: float = 0.0,
    in_queue: bool = False,
) -> Verdict:
    """Admit a pair, or reject / queue / give up on a request no pair is predicted to serve.

    ``queued`` is how many requests wait now (this one included when ``in_queue``);
    ``waited_s`` how long this one has waited.
    """
    if isinstance(pick, Pair):
        return Admit(pick)
    if pick.over_budget is None:
        return Unavailable(pick.reason)
    if policy.admission == "reject" or policy.queue_max == 0:
        return Reject("over_budget", pick.reason)
    if in_queue:
        if waited_s >= policy.queue_timeout_s:
            return Reject(
                "queue_timeout",
                f"no capacity within the admission queue's {policy.queue_timeout_s:g} s "
                f"(waited {waited_s:.3g} s; the TTFT below counts from now, after the wait): "
                f"{pick.reason}",
            )
        return Queue(pick.reason)
    if queued >= policy.queue_max:
        return Reject("queue_full", f"admission queue full ({policy.queue_max})")
    return Queue(pick.reason)
