"""Run the qualification chain: each step in order, skipped when the ledger says it is done,
with the engines and the router brought up only when a step that must run needs them.

What the chain owns: simulated engines it started (``launch_plan.py start``) and the router
(``narwhal-serve`` as the reference run starts it) are stopped when the chain ends, unless
``keep_running``. Real engines are never started here: the chain polls them to ready
(``launch_plan.py wait``). While a step runs, a watcher polls every engine's attestation and
the router process: an engine that stops answering or comes back with another generation, or a
router that exits, stops the step and the chain with one line saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from narwhal.contract import load_fleet
from narwhal.qualify.layout import FLEET_FINAL, FLEET_QUALIFIED, JOURNAL, ROUTER_PID, STEP_PID
from narwhal.qualify.ledger import Ledger, StepRecord, content_sha256, step_key, utc_now
from narwhal.qualify.runfile import LoadedRun
from narwhal.qualify.steps import Step, console_script

__all__ = ["ChainFailed", "ChainResult", "RunDirUnusable", "run_chain"]

WATCH_INTERVAL_S = 1.0
# The steps whose outputs conclude a run: they never outlive a rerun of what they conclude.
CLAIMS = ("report", "bundle")
WATCH_TIMEOUT_S = 5.0
# An engine that has not answered for this long is gone (a busy one answers within it).
WATCH_GRACE_S = 10.0
_PROBLEM_COUNT = re.compile(r": (\d+) problems?$")


class ChainFailed(Exception):
    """The chain stopped: ``step`` is where, ``str()`` the one-line reason."""

    def __init__(self, step: str, reason: str) -> None:
        super().__init__(reason)
        self.step = step


class RunDirUnusable(Exception):
    """The run directory cannot be made, written or locked: nothing started."""


@dataclass
class ChainResult:
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # (step, one-line verdict) of each step that measured the fleet and found it failing: the
    # chain finished, and the fleet did not qualify.
    failed_verdicts: list[tuple[str, str]] = field(default_factory=list)


def _say(line: str) -> None:
    print(line, flush=True)


class EngineWatch:
    """Polls every engine's attestation (and the router process) in a thread; ``problem``
    holds the first thing found wrong. Generations are compared with ``expected`` (set once
    the fleet is finalized) or, before that, with the first seen.

    A busy engine may answer its attestation late (a simulated engine serves it from the loop
    that serves the load; a sidecar asks the container runtime): only an engine that has not
    answered for ``WATCH_GRACE_S`` is reported. A restart needs no grace: its new generation
    says so at the first answer."""

    def __init__(self, engines: dict[str, str]) -> None:
        self.engines = engines  # id -> attestation url
        self.expected: dict[str, str] = {}
        self.router: subprocess.Popen[bytes] | None = None
        self.problem: str | None = None
        self._failing_since: dict[str, float] = {}
        self._why: dict[str, str] = {}

    def _miss(self, engine_id: str, url: str, why: str) -> str | None:
        since = self._failing_since.setdefault(engine_id, time.monotonic())
        self._why[engine_id] = why
        if time.monotonic() - since >= WATCH_GRACE_S:
            return f"engine {engine_id} stopped answering at {url} for {WATCH_GRACE_S:g} s ({why})"
        return None

    def look(self, client: httpx.Client) -> str | None:
        """One round of polls: the first problem found, or None."""
        if self.router is not None and self.router.poll() is not None:
            return f"narwhal-serve exited (status {self.router.returncode}); see logs/router.log"
        for engine_id, url in self.engines.items():
            try:
                reply = client.get(url)
                if reply.status_code != 200:
                    raise ValueError(f"attestation answered {reply.status_code}")
                doc = reply.json()
                if not isinstance(doc, dict):
                    raise ValueError("attestation is not a JSON object")
            except (httpx.HTTPError, ValueError) as exc:
                found = self._miss(engine_id, url, _describe(exc))
                if found is not None:
                    return found
                continue
            if doc.get("engine_alive") is False:
                return f"engine {engine_id} exited (its attestation sidecar says so)"
            generation = doc.get("generation")
            if not isinstance(generation, str) or not generation:
                # A sidecar between an engine's exit and its pid file's rewrite: not yet known.
                found = self._miss(engine_id, url, "no generation in its attestation")
                if found is not None:
                    return found
                continue
            self._failing_since.pop(engine_id, None)
            before = self.expected.setdefault(engine_id, generation)
            if generation != before:
                return (
                    f"engine {engine_id} restarted: generation {before[:12]} -> "
                    f"{generation[:12]}; the profile and the check no longer describe it"
                )
        return None

    @contextlib.contextmanager
    def watching(self, on_problem: Callable[[], None]) -> Iterator[None]:
        """Watch while the block runs; ``on_problem`` is called once, from the watch thread."""
        self.problem = None
        stop = threading.Event()  # one per watch: a slow thread of the last one stays stopped

        def loop() -> None:
            with httpx.Client(timeout=WATCH_TIMEOUT_S, trust_env=False) as client:
                while not stop.wait(WATCH_INTERVAL_S):
                    found = self.look(client)
                    if found is not None and not stop.is_set():
                        self.problem = found
                        on_problem()
                        return

        thread = threading.Thread(target=loop, name="qualify-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


class Chain:
    def __init__(
        self,
        loaded: LoadedRun,
        steps: list[Step],
        keep_running: bool,
        out: Callable[[str], None] = _say,
    ) -> None:
        self.loaded = loaded
        self.steps = steps
        self.keep_running = keep_running
        self.say = out
        self.rd = loaded.run_dir
        self.logs = self.rd / "logs"
        self.ledger = Ledger.open(self.rd)
        self.fleet_up = False
        self.started_engines: list[Path] = []  # run dirs of simulated plans this chain started
        self.router: subprocess.Popen[bytes] | None = None
        contract = loaded.fleet.contract
        self.watch = EngineWatch(
            {e.id: e.attestation_url or f"{e.url}/attestation" for e in contract.engines}
        )
        self.current: subprocess.Popen[bytes] | None = None
        self.result = ChainResult()

    # -- decisions ------------------------------------------------------------------------

    def _inputs(self, step: Step) -> dict[str, str | None]:
        return {name: content_sha256(path) for name, path in step.inputs.items()}

    def _key(self, step: Step) -> str:
        return step_key(step.name, step.key_args, self._inputs(step))

    def _done(self, step: Step) -> StepRecord | None:
        return self.ledger.done(step.name, self._key(step), step.outputs)

    # -- resources ------------------------------------------------------------------------

    def _tool(self, argv: list[str], log: Path, timeout: float, echo: bool = False) -> int:
        """Run a deployment tool to completion (killed past ``timeout``), its output appended
        to ``log`` and, with ``echo``, shown as it comes (a fleet's wait can take minutes)."""
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(
                argv, cwd=self.rd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            timer = threading.Timer(timeout, proc.kill)
            timer.daemon = True
            timer.start()
            try:
                assert proc.stdout is not None
                with proc.stdout:  # closed once read: one descriptor less per command
                    self._relay(proc.stdout, f, echo)
                return proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def _relay(self, stream: IO[bytes], log: IO[str], echo: bool) -> None:
        """A command's output line by line into its log and, with ``echo``, to the screen."""
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            log.write(line + "\n")
            log.flush()
            if echo and line:
                self.say(f"        {line}")

    def _healthy(self) -> dict[str, bool]:
        out = {}
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            for engine in self.loaded.fleet.contract.engines:
                try:
                    out[engine.id] = client.get(engine.url + "/health").status_code == 200
                except httpx.HTTPError:
                    out[engine.id] = False
        return out

    def _plan_run_dir(self, index: int) -> Path:
        return self.rd / "engines" / (str(index) if index else "")

    def _bring_up_fleet(self) -> None:
        if self.fleet_up:
            return
        tools = self.loaded.checkout / "tools" / "deployment" / "launch_plan.py"
        log = self.logs / "engines.log"
        if self.loaded.simulated:
            healthy = self._healthy()
            if all(healthy.values()):
                ours = [
                    self._plan_run_dir(i)
                    for i in range(len(self.loaded.launch_plans))
                    if (self._plan_run_dir(i) / "run.json").exists()
                ]
                # Engines an earlier chain on this run directory started (and did not stop:
                # --keep-running, or it was killed) are this chain's to stop.
                self.started_engines += ours
                whose = "started by an earlier run here" if ours else "not started by this chain"
                self.say(f"        engines already running ({whose}): used as they are")
            elif any(healthy.values()):
                up = ", ".join(e for e, ok in healthy.items() if ok)
                raise ChainFailed(
                    "engines",
                    f"engines {up} answer but not the others: stop them or start the rest",
                )
            else:
                for i, plan in enumerate(self.loaded.launch_plans):
                    run_dir = self._plan_run_dir(i)
                    argv = [sys.executable, str(tools), "start", str(plan)]
                    argv += ["--fleet", str(self.loaded.fleet_path), "--run-dir", str(run_dir)]
                    self.say(f"        starting the simulated engines of {plan.name}")
                    self.started_engines.append(run_dir)
                    if self._tool(argv, log, 300) != 0:
                        raise ChainFailed("engines", _last_line(log, "launch_plan.py start failed"))
        else:
            argv = [sys.executable, str(tools), "wait", *map(str, self.loaded.launch_plans)]
            self.say("        polling the engines until each serves the model")
            if self._tool(argv, log, 1000, echo=True) != 0:
                raise ChainFailed("engines", _last_line(log, "engines not ready"))
        self.fleet_up = True
        self.watch.expected.clear()  # generations are learnt from this fleet, then finalize

    def _bring_up_router(self) -> None:
        if self.router is not None:
            return
        r = self.loaded.run.router
        url = f"http://{r.host}:{r.port}"
        self._stop_orphan_router()
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url + "/ready", timeout=2.0, trust_env=False)
            raise ChainFailed(
                "router", f"something already answers at {url}: stop it or change router.port"
            )
        # Each router of the run journals afresh: the benchmark reconciles against it and the
        # report's role timeline starts at its router.start. An earlier one is kept in logs/.
        for old in sorted(self.rd.glob(JOURNAL + "*")):
            old.rename(self.logs / f"{utc_now().replace(':', '')}-{old.name}")
        argv = [console_script("narwhal-serve"), "--fleet", FLEET_QUALIFIED]
        argv += ["--host", r.host, "--port", str(r.port), "--journal", JOURNAL]
        log = self.logs / "router.log"
        self.say(f"        starting the router: {' '.join(argv[1:])}")
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            self.router = subprocess.Popen(
                argv, cwd=self.rd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        (self.rd / ROUTER_PID).write_text(f"{self.router.pid}\n")
        deadline = time.monotonic() + r.ready_timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                reason = _last_line(log, f"exited with status {self.router.returncode}")
                self.router = None
                raise ChainFailed("router", f"narwhal-serve did not start: {reason}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2.0, trust_env=False).status_code == 200:
                    self.watch.router = self.router
                    return
            time.sleep(0.2)
        raise ChainFailed("router", f"narwhal-serve not ready within {r.ready_timeout_s:g} s")

    def _release_router(self, position: int) -> None:
        """Stop the router once no step from ``position`` on needs it: its journal is then
        complete (router.stop included) before the report reads it and the bundle packs it."""
        if self.router is None or self.keep_running:
            return
        if any("router" in s.needs for s in self.steps[position:]):
            return
        self._stop_router()
        self.say("        stopped the router: no step after this one needs it")

    def _stop_router(self) -> None:
        assert self.router is not None
        _stop(self.router, 30)
        (self.rd / ROUTER_PID).unlink(missing_ok=True)
        self.router = self.watch.router = None

    def _stop_orphan_router(self) -> None:
        """A router an earlier chain here started and never stopped (it was killed)."""
        try:
            pid = int((self.rd / ROUTER_PID).read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except (OSError, ValueError, IndexError):
            return
        if b"narwhal-serve" in cmdline and Path(cwd) == self.rd.resolve():
            self.say(f"        stopping the router an earlier run here left (pid {pid})")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    def _ensure(self, step: Step) -> None:
        if "fleet" in step.needs or "router" in step.needs:
            self._bring_up_fleet()
        if "router" in step.needs:
            self._bring_up_router()

    def shutdown(self) -> None:
        """Stop what this chain owns; every part is tried, whatever another part did."""
        if self.keep_running:
            if self.router is not None:
                self.say(f"left running: narwhal-serve (pid {self.router.pid})")
            for run_dir in self.started_engines:
                self.say(f"left running: engines (launch_plan.py stop --run-dir {run_dir})")
            return
        if self.router is not None:
            try:
                self._stop_router()
            except (OSError, subprocess.SubprocessError) as exc:
                self.say(f"could not stop narwhal-serve (pid {self.router.pid}): {exc}")
                self.router = self.watch.router = None
        tools = self.loaded.checkout / "tools" / "deployment" / "launch_plan.py"
        for run_dir in self.started_engines:
            argv = [sys.executable, str(tools), "stop", "--run-dir", str(run_dir)]
            try:
                self._tool(argv, self.logs / "engines.log", 120)
            except (OSError, subprocess.SubprocessError) as exc:
                self.say(f"could not stop the engines of {run_dir}: {exc}")
        self.started_engines = []

    # -- steps ----------------------------------------------------------------------------

    def _expect_generations(self) -> None:
        """Once the fleet is finalized, the watcher holds engines to its generations."""
        with contextlib.suppress(Exception):
            for engine in load_fleet(self.rd / FLEET_FINAL).contract.engines:
                if engine.generation:
                    self.watch.expected[engine.id] = engine.generation

    def _run_command(self, step: Step, log: Path) -> int:
        with log.open("w") as f:
            f.write(f"$ {' '.join(step.argv)}\n")
            f.flush()
            self.current = subprocess.Popen(
                step.argv,
                cwd=self.rd,
                stdout=subprocess.PIPE,
                stderr=f,
                start_new_session=True,
            )
            # In a session of its own: a chain killed outright leaves it running, and the
            # next chain here stops it (_stop_orphan_step) by this file.
            (self.rd / STEP_PID).write_text(f"{self.current.pid}\n")
            assert self.current.stdout is not None
            if self.watch.problem is not None:  # found while the step was being started
                self._kill_current()
            with self.current.stdout:
                self._relay(self.current.stdout, f, step.echo)
            code = self.current.wait()
        (self.rd / STEP_PID).unlink(missing_ok=True)
        return code

    def _stop_orphan_step(self) -> None:
        """The step command (and its children: a benchmark's load generator) an earlier chain
        here started and never stopped (it was killed): left running, its load would reach
        this chain's router and its output this chain's evidence."""
        try:
            group = int((self.rd / STEP_PID).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        members = _group_members(group, self.rd.resolve())
        if members:
            self.say(
                f"        stopping the step an earlier run here left running "
                f"(process group {group}: {len(members)} process(es))"
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _group_members(group, self.rd.resolve()) and time.monotonic() < deadline:
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        (self.rd / STEP_PID).unlink(missing_ok=True)

    def _kill_current(self) -> None:
        proc = self.current
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

            def escalate() -> None:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)

            timer = threading.Timer(10.0, escalate)
            timer.daemon = True
            timer.start()

    def run_step(self, index: int, step: Step) -> str:
        for path in step.outputs.values():
            _remove(path)
        log = self.logs / f"{index:02d}-{step.name}.log"
        inputs = self._inputs(step)
        started, t0 = utc_now(), time.monotonic()
        needs_watch = bool(step.needs)
        with self.watch.watching(self._kill_current) if needs_watch else contextlib.nullcontext():
            if step.action is not None:
                try:
                    result = step.action()
                    code = 0
                except Exception as exc:  # an in-process link failed: its own words, one line
                    result, code = _describe(exc).splitlines()[0], 1
            else:
                try:
                    code = self._run_command(step, log)
                except BaseException:
                    # Interrupted (Ctrl-C, SIGTERM): the step runs in a session of its own and
                    # did not see the signal; it must not outlive the chain.
                    self._kill_current()
                    if self.current is not None:
                        _stop(self.current, 10)
                    raise
                result = ""
        self.current = None
        if needs_watch and self.watch.problem is None:
            with httpx.Client(timeout=2.0, trust_env=False) as client:
                self.watch.problem = self.watch.look(client)
        if needs_watch and self.watch.problem is not None:
            raise ChainFailed(step.name, self.watch.problem)
        failed_verdict = None
        if code != 0:
            # A measurement that ran to its end and found the fleet failing is a result, not a
            # broken step: it is recorded, and the report and the bundle still follow.
            failed_verdict = step.verdict(self.rd, code) if step.verdict else None
        if code != 0 and failed_verdict is None:
            why = step.explain(self.rd) if step.explain else None
            if why is None:
                why = result if step.action else _last_line(log, f"exited with status {code}")
            raise ChainFailed(step.name, why)
        if step.outputs.get(FLEET_FINAL) is not None:
            self._expect_generations()
        outputs = {name: content_sha256(path) for name, path in step.outputs.items()}
        missing = [name for name, sha in outputs.items() if sha is None]
        if missing:
            raise ChainFailed(step.name, f"finished without writing {', '.join(missing)}")
        self.ledger.record(
            step.name,
            StepRecord(
                key=step_key(step.name, step.key_args, inputs),
                argv=step.argv,
                inputs=inputs,
                outputs=outputs,
                started_at=started,
                duration_s=round(time.monotonic() - t0, 3),
                exit_code=code,
                failed_verdict=failed_verdict,
            ),
        )
        if failed_verdict is not None:
            self.result.failed_verdicts.append((step.name, failed_verdict))
            return f"measured; the fleet failed: {failed_verdict}"
        return result

    def _discard(self, steps: list[Step], claims_only: bool) -> None:
        """Remove the outputs (and ledger records) of ``steps``; with ``claims_only``, only
        of the steps that conclude the run (report, bundle)."""
        for step in steps:
            if claims_only and step.name not in CLAIMS:
                continue
            for path in step.outputs.values():
                _remove(path)
            self.ledger.forget(step.name)

    def run(self) -> ChainResult:
        result = self.result
        self._stop_orphan_step()
        # Observers (capture, finalize) are looked at only when a step after them must run:
        # their output alone (live.json's capture time) never brings the fleet up.
        steps = [s for s in self.steps if s.not_declared is None and not s.observes]
        first_stale = next((i for i, s in enumerate(steps) if self._done(s) is None), None)
        live = first_stale is not None and any(s.needs for s in steps[first_stale:])
        if first_stale is not None:
            # The run's conclusions (report, bundle) stand only for a run that finished: they
            # go as soon as anything before them must run again.
            self._discard(self.steps[self.steps.index(steps[first_stale]) :], claims_only=True)
        n = len(self.steps)
        for index, step in enumerate(self.steps, 1):
            head = f"[{index:2d}/{n}] {step.name:<10}"
            if step.not_declared is not None:
                self.say(f"{head} not run: {step.not_declared}")
                continue
            if step.observes and not live:
                self.say(f"{head} skipped: nothing after it needs the running fleet")
                result.skipped.append(step.name)
                continue
            record = None if step.observes else self._done(step)
            if record is not None:
                self.say(f"{head} skipped: done at {record.started_at}, outputs unchanged")
                if record.failed_verdict is not None:
                    self.say(f"        measured then; the fleet failed: {record.failed_verdict}")
                    # Nothing it reads changed: say how to measure a mended fleet again.
                    outputs = ", ".join(sorted(record.outputs)) or step.name
                    self.say(f"        to measure again, delete {outputs} from the run directory")
                    result.failed_verdicts.append((step.name, record.failed_verdict))
                result.skipped.append(step.name)
                continue
            self.say(f"{head} {step.what}")
            t0 = time.monotonic()
            try:
                self._release_router(index - 1)
                self._ensure(step)
                line = self.run_step(index, step)
            except BaseException:
                # What follows a failed step was made from what it replaced: not evidence.
                self._discard(self.steps[index:], claims_only=False)
                raise
            result.ran.append(step.name)
            if step.show is not None:
                for shown in step.show(self.rd):
                    self.say(f"        {shown}")
            self.say(
                f"        done in {time.monotonic() - t0:.1f} s" + (f": {line}" if line else "")
            )
        return result


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _last_line(log: Path, default: str) -> str:
    """The last meaningful line a tool wrote: its own one-line reason."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return default
    said = [ln for ln in lines if ln and not ln.startswith("$ ") and not ln.startswith("Traceback")]
    if not said:
        return default
    # A tool that lists its problems ends with their count: the first problem is the reason.
    counted = _PROBLEM_COUNT.search(said[-1])
    if counted and len(said) > 1:
        n = int(counted.group(1))
        first = said[max(0, len(said) - 1 - n)]
        return first[:400] + (f" (and {n - 1} more)" if n > 1 else "")
    return said[-1][:400]


def _group_members(group: int, cwd: Path) -> list[int]:
    """Live processes of process group ``group`` working in ``cwd`` (a recycled group id
    elsewhere is not ours)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The fields after the command's name (in parentheses, which may hold spaces):
            # state, ppid, pgrp.
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != group or fields[0] == "Z":
                continue
            if Path(os.readlink(entry / "cwd")) == cwd:
                members.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return members


def _stop(proc: subprocess.Popen[Any], grace: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def run_chain(
    loaded: LoadedRun,
    steps: list[Step],
    *,
    keep_running: bool = False,
    out: Callable[[str], None] = _say,
) -> ChainResult:
    """Run the chain; ChainFailed names the step and the one-line reason, RunDirUnusable says
    why the run directory cannot be used (before anything started). The ledger (steps.json)
    records every finished step and, for each invocation, what ran."""
    try:
        loaded.run_dir.mkdir(parents=True, exist_ok=True)
        (loaded.run_dir / "logs").mkdir(exist_ok=True)
        lock = (loaded.run_dir / ".lock").open("a")
    except OSError as exc:
        raise RunDirUnusable(f"cannot use {loaded.run_dir}: {exc.strerror or exc}") from None
    try:
        # Two chains on one run directory would delete each other's outputs.
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise RunDirUnusable(f"another narwhal-qualify is running in {loaded.run_dir}") from None
    try:
        return _run_locked(loaded, steps, keep_running, out)
    finally:
        lock.close()


def _run_locked(
    loaded: LoadedRun, steps: list[Step], keep_running: bool, out: Callable[[str], None]
) -> ChainResult:
    chain = Chain(loaded, steps, keep_running, out)
    entry: dict[str, Any] = {"started_at": utc_now(), "run_file": str(loaded.path)}
    try:
        result = chain.run()
        if result.failed_verdicts:
            entry["outcome"] = "not qualified: " + "; ".join(
                f"{step}: {why}" for step, why in result.failed_verdicts
            )
        else:
            entry["outcome"] = "pass"
        return result
    except ChainFailed as exc:
        entry["outcome"] = f"failed at {exc.step}: {exc}"
        raise
    except KeyboardInterrupt:
        entry["outcome"] = "interrupted"
        raise
    finally:
        chain.shutdown()
        entry.update(ran=chain.result.ran, skipped=chain.result.skipped, ended_at=utc_now())
        chain.ledger.runs.append(entry)
        chain.ledger.save()
