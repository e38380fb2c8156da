"""One workload through both drivers of the routing lifecycle, the router's (``serve/pd.py``,
legs over an engine transport) and the virtual-time simulator's (``fleetsim``): every routing
decision must be the same, in the same order.

The simulator runs the workload first and keeps its trace: when each request arrived, when its
prefill leg's answer, its first token and its last token reached the router, and what each
engine's /metrics said at each scrape. The router then serves the same requests on a virtual
clock, moved from event to event of that trace, against engines that answer exactly then (a
transport whose answers the test releases; the scrapes are written into the fleet state as the
router's scrape loop writes them). Between events the event loop runs until nothing moves, and
the admission queue's rechecks (which sleep on the clock) run when the clock reaches them.
Both lifecycles report every decision to an observer; the two lists must be equal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from narwhal.clock import VirtualClock
from narwhal.contract import FleetContract, parse_fleet
from narwhal.fleetsim.simulator import DesConfig, RequestSpec, _Simulation
from narwhal.fleetsim.workloads import timings_of
from narwhal.metrics import RouterMetrics
from narwhal.routing.admission import Admit, Queue, Reject, Unavailable, Verdict
from narwhal.routing.fleet_state import FleetState
from narwhal.routing.lifecycle import Lifecycle, LifecycleObserver, Ticket
from narwhal.routing.predictor import LatencyPredictor
from narwhal.routing.prefix import chain_keys
from narwhal.routing.roles import DemandTracker
from narwhal.routing.scheduler import NoPair, Pair, SchedulerV1
from narwhal.serve.errors import RouterError
from narwhal.serve.pd import MetricsObserver, PDRouter
from narwhal.serve.record import RequestRecord
from narwhal.serve.validation import parse_client_request
from narwhal.simengine.fleet import local_fleet_document

MODEL = "moonshotai/Kimi-K3"


class DecisionLog(LifecycleObserver):
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.decisions: list[tuple[Any, ...]] = []

    def decided(self, ticket: Ticket, decision: Verdict | Pair | NoPair) -> None:
        if isinstance(decision, Admit):
            what: tuple[Any, ...] = ("admit", *_pair(decision.pair), decision.idle)
        elif isinstance(decision, Pair):
            what = ("retry", *_pair(decision))
        elif isinstance(decision, Queue):
            what = ("queue",)
        elif isinstance(decision, Reject):
            what = ("reject", decision.reason)
        elif isinstance(decision, Unavailable | NoPair):
            what = ("unavailable",)
        self.decisions.append((round(self.clock.now(), 9), ticket.id, *what))


class RouterDecisionLog(MetricsObserver):
    """The router's own observer (metrics, the queue's wake-up), decisions logged too."""

    def __init__(self, metrics: RouterMetrics, capacity: asyncio.Event, log: DecisionLog) -> None:
        super().__init__(metrics, capacity)
        self.log = log

    def decided(self, ticket: Ticket, decision: Verdict | Pair | NoPair) -> None:
        self.log.decided(ticket, decision)


def _pair(pair: Pair) -> tuple[Any, ...]:
    return (pair.prefill, pair.decode, pair.local, pair.predicted_ttft_s, pair.predicted_tpot_s)


def workload_fleet() -> FleetContract:
    """Two prefill and two decode engines at a time scale of 20, budgets tight enough that
    requests queue, time out of the queue, and go local."""
    doc = local_fleet_document(
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        initial_roles=["prefill", "prefill", "decode", "decode"],
        sim={"time_scale": 20.0},
        ttft_s=0.12,
        tpot_s=0.0135,
        first_token_timeout_s=0.1,
        routing={
            "admission": "queue",
            "queue_max": 8,
            "queue_timeout_s": 0.06,
            "local_prefill": {"enabled": True, "max_prompt_tokens": 1024},
        },
        role_control={"enabled": False},
    )
    return parse_fleet(doc, "fleet.json").contract


def workload(n: int = 160) -> list[RequestSpec]:
    """Bursty arrivals (a seeded sequence, no randomness at run time): prompts from 200 to 6,000
    tokens, outputs from 1 to 40."""
    specs, t = [], 0.0
    for i in range(n):
        t += 0.002 if i % 7 else 0.02
        prompt = 200 + (i * 733) % 5800
        # The router keys the prompt it is sent ([7] * prompt) for its prefix index: so must
        # the simulator (every prompt shares its leading blocks with every longer one).
        keys = tuple(chain_keys([7] * prompt, 16))
        specs.append(RequestSpec(t, prompt, 1 + (i * 17) % 40, None, keys))
    return specs


@dataclass
class Run:
    decisions: list[tuple[Any, ...]]
    trace: list[tuple[float, str, Any]] = field(default_factory=list)
    ratios: dict[tuple[str, str], float] = field(default_factory=dict)


def simulate(fleet: FleetContract, specs: list[RequestSpec]) -> Run:
    timings = timings_of(fleet)
    models = {e: m.in_wall_seconds() for e, m in timings.items()}
    config = DesConfig(
        fleet, timings, flipping=False, transfer_s=0.0005, leg_overhead_s=0.0003, seed=3
    )
    sim = _Simulation(config, models)
    log = DecisionLog(sim.clock)
    sim.lifecycle.observer = log
    sim.trace = []
    sim.run(specs)
    ratios = {k: v.value for k, v in sim.predictor.ratios.items()}
    return Run(log.decisions, sim.trace, ratios)


class _Answer:
    """An engine's answer, released by the replay at the simulated time."""

    def __init__(self, body: bytes, chunks: list[bytes]) -> None:
        self.status = 200
        self._body = body
        self._chunks: Iterator[bytes] = iter(chunks)

    async def read(self) -> bytes:
        return self._body

    async def read_chunk(self) -> bytes:
        return next(self._chunks, b"")

    async def aclose(self) -> None:
        pass


class ReplayEngines:
    """Every engine of the fleet as one transport: a leg waits until the replay releases its
    answer (``X-Request-Id`` says whose)."""

    def __init__(self) -> None:
        self.prefilled: dict[str, asyncio.Future[None]] = {}
        self.first_token: dict[str, asyncio.Future[None]] = {}

    def _gate(
        self, gates: dict[str, asyncio.Future[None]], request_id: str
    ) -> asyncio.Future[None]:
        if request_id not in gates:
            gates[request_id] = asyncio.get_running_loop().create_future()
        return gates[request_id]

    def client(self, engine_id: str) -> ReplayEngines:
        return self

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], on_orphan: object = None
    ) -> _Answer:
        request_id = headers["X-Request-Id"]
        await self._gate(self.prefilled, request_id)
        prompt = orjson.loads(body)["prompt"]
        answer = {
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1},
            "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": request_id},
        }
        return _Answer(orjson.dumps(answer), [])

    async def stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> _Answer:
        if on_send is not None:
            on_send()
        await self._gate(self.first_token, headers["X-Request-Id"])
        return _Answer(b"", [b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'])

    def release(self, gates: dict[str, asyncio.Future[None]], request_id: str) -> None:
        self._gate(gates, request_id).set_result(None)


async def settle() -> None:
    """Let every task that can move move (bounded in event-loop turns, not time)."""
    for _ in range(40):
        await asyncio.sleep(0)


def _without_wall_clock_guards(fleet: FleetContract) -> FleetContract:
    """The fleet as the replay's router sees it: its first-token deadline and prefill hedge
    never fire. Both are timers on the event loop's clock, which runs in wall time here, not
    on the replay's virtual one; on a loaded machine the wall time between two replayed events
    reached the 0.1 s deadline and the router cancelled a leg the simulator let finish (CI:
    "KV prefilled on e0 stranded (deadline_exceeded)"). The simulator never aborts a leg on
    either, so the replay compares decisions without them. The scheduler still reads the
    deadline from the fleet state's contract, unchanged."""
    routing = fleet.routing.model_copy(
        update={"hedge": fleet.routing.hedge.model_copy(update={"enabled": False})}
    )
    engine = fleet.engine.model_copy(update={"first_token_timeout_s": 1e9})
    return fleet.model_copy(update={"routing": routing, "engine": engine})


async def replay_through_router(
    fleet: FleetContract, specs: list[RequestSpec], simulated: Run
) -> Run:
    clock = VirtualClock(0.0)
    state = FleetState(fleet, clock)
    for engine in state.engines.values():
        engine.healthy = True  # as the simulator's engines are
    models = {e: m.in_wall_seconds() for e, m in timings_of(fleet).items()}
    predictor = LatencyPredictor(models)
    import random

    scheduler = SchedulerV1(predictor, fleet.budgets, 32, random.Random(3))
    metrics = RouterMetrics([e.id for e in fleet.engines], fleet.name, "0" * 64, None)
    capacity = asyncio.Event()
    log = DecisionLog(clock)
    lifecycle = Lifecycle(
        state,
        scheduler,
        predictor=predictor,
        demand=DemandTracker(clock, window_s=max(10.0, 6 * fleet.roles.tick_s)),
        observer=RouterDecisionLog(metrics, capacity, log),
    )
    engines = ReplayEngines()
    router = PDRouter(
        _without_wall_clock_guards(fleet),
        lifecycle,
        engines,  # type: ignore[arg-type]
        metrics,
        1e9,
        capacity,
    )
    finished: dict[str, asyncio.Event] = {}

    async def serve(index: int, spec: RequestSpec) -> None:
        body = {"model": MODEL, "prompt": [7] * spec.prompt_tokens}
        body["max_tokens"] = spec.output_tokens
        creq = parse_client_request(orjson.dumps(body), False, MODEL, fleet.model.max_model_len)
        record = RequestRecord(str(index), 0.0, spec.arrival, "/v1/completions")
        done = finished[record.id] = asyncio.Event()
        try:
            stream = await router.open(creq, record)
        except RouterError:
            return
        await done.wait()
        record.outcome, record.completion_tokens = "ok", spec.output_tokens
        router.finish(stream, record)
        await stream.aclose()

    tasks: list[asyncio.Task[None]] = []
    arrivals = iter(enumerate(specs))
    for t, kind, payload in simulated.trace:
        # Queue rechecks due before this event happen first, each at its own time.
        while (due := clock.next_deadline()) is not None and due < t:
            clock.set(due)
            await settle()
        clock.set(t)
        if kind == "arrive":
            index, spec = next(arrivals)
            tasks.append(asyncio.create_task(serve(index, spec)))
        elif kind == "prefill_done":
            engines.release(engines.prefilled, str(payload))
        elif kind == "first_token":
            engines.release(engines.first_token, str(payload))
        elif kind == "finished":
            finished[str(payload)].set()
        elif kind == "scrape":
            for engine_id, (running, waiting) in payload.items():
                scraped = state.engines[engine_id].scraped
                scraped.running, scraped.waiting, scraped.at = running, waiting, t
        await settle()
    await settle()
    # A request the simulator served but the router did not route alike waits for an answer
    # that never comes: the decisions below say where they parted.
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ratios = {k: v.value for k, v in predictor.ratios.items()}
    return Run(log.decisions, ratios=ratios)


@pytest.fixture(scope="module")
def runs() -> tuple[Run, Run]:
    fleet = workload_fleet()
    specs = workload()
    simulated = simulate(fleet, specs)
    routed = asyncio.run(replay_through_router(fleet, specs, simulated))
    return simulated, routed


def test_the_workload_exercises_every_kind_of_decision(runs: tuple[Run, Run]) -> None:
    simulated, _ = runs
    kinds = {d[2] for d in simulated.decisions}
    assert {"admit", "queue", "reject"} <= kinds
    assert any(d[2] == "admit" and d[5] for d in simulated.decisions)  # local legs
    assert any(d[2] == "admit" and not d[5] for d in simulated.decisions)  # P/D handoffs
    assert len({d[1] for d in simulated.decisions}) == len(workload())


def test_the_router_and_the_simulator_make_every_decision_alike(runs: tuple[Run, Run]) -> None:
    simulated, routed = runs
    for i, (a, b) in enumerate(zip(simulated.decisions, routed.decisions, strict=False)):
        assert a == b, f"decision {i} differs: simulator {a}, router {b}"
    assert len(routed.decisions) == len(simulated.decisions)
    # And they learnt the same corrections from what they observed.
    assert routed.ratios == simulated.ratios
