"""Checked launch plans: validate, render, start (simulated), stop, wait for and capture engines.

    launch_plan.py check PLAN [PLAN ...] --fleet FLEET
    launch_plan.py render PLAN [--fleet FLEET] [--sidecars] [--checkpoint DIR] [--json]
    launch_plan.py start PLAN --fleet FLEET --run-dir DIR [--timeout 120]
    launch_plan.py stop --run-dir DIR [--timeout 10]
    launch_plan.py wait PLAN [PLAN ...] [--timeout 900] [--interval 2] [--run-dir DIR]
    launch_plan.py capture PLAN [PLAN ...] --out LIVE.json

Exit status: 0 fine; 1 the plan breaks a rule, an engine failed or could not be read (one
line each on stderr); 2 a file could not be read or parsed, or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root for `tools` (tools/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from narwhal.asgi import tcp_bind_problem
from narwhal.contract import ContractError, LoadedFleet, load_fleet
from narwhal.contract.flags import positive
from narwhal.testing import procs
from tools.deployment._files import write_atomic
from tools.deployment._live import LIVE_SCHEMA, Declared, capture_engine
from tools.deployment._plan import LoadedPlan, PlanError, load_plan
from tools.deployment._plan_check import engine_ports, kv_transfer_config, plans_problems
from tools.deployment._procs import (
    RunRecord,
    RunStateError,
    alive,
    answered_by,
    exited_line,
    holds_its_port,
    load_run,
    save_run,
    start_detached,
    stop_record,
    wait_healthy,
)
from tools.deployment._render import render_engine, render_sidecar, shell_line

__all__ = ["main"]

PROG = "launch_plan.py"


class UsageError(Exception):
    pass


def _err(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr)


def _load(paths: list[str], fleet_path: str | None) -> tuple[list[LoadedPlan], LoadedFleet | None]:
    plans: list[LoadedPlan] = []
    problems: list[str] = []
    for path in paths:
        try:
            plans.append(load_plan(path))
        except PlanError as exc:
            problems += exc.problems
    if problems:
        raise PlanError(problems)
    return plans, load_fleet(fleet_path) if fleet_path else None


def cmd_check(args: argparse.Namespace) -> int:
    plans, fleet = _load(args.plans, args.fleet)
    problems = plans_problems(plans, fleet)
    for line in problems:
        _err(line)
    if problems:
        _err(f"{len(problems)} problem{'s' if len(problems) != 1 else ''}")
        return 1
    names = ", ".join(f"{lp.plan.name} ({len(lp.plan.engines)} engines)" for lp in plans)
    print(f"ok: {names} agree with {args.fleet} (sha256 {fleet.sha256 if fleet else '-'})")
    return 0


def _sim_program() -> list[str]:
    # The console script of the interpreter running this tool, so a plan started from a
    # venv runs that venv's simulator; fall back to the module if the script is absent.
    script = Path(sys.executable).parent / "narwhal-sim"
    return [str(script)] if script.exists() else [sys.executable, "-m", "narwhal.simengine.cli"]


def cmd_render(args: argparse.Namespace) -> int:
    plans, fleet = _load([args.plan], args.fleet)
    problems = plans_problems(plans, fleet)
    if problems:
        for line in problems:
            _err(line)
        _err("not rendering a plan that breaks its rules")
        return 1
    lp = plans[0]
    rendered: list[dict[str, Any]] = []
    for eng in lp.plan.engines:
        cmd = render_engine(lp.plan, eng)
        if lp.plan.kind != "container":
            # The simulator as `start` runs it (this venv's): a line pasted into a shell where
            # the venv is not active runs as it does here.
            cmd = replace(cmd, argv=_sim_program() + cmd.argv[1:])
        item: dict[str, Any] = {
            "engine_id": eng.id,
            "host": eng.host,
            "argv": cmd.argv,
            "env": cmd.env,
        }
        if args.sidecars:
            item["sidecar_argv"] = render_sidecar(
                lp.plan,
                eng,
                checkpoint=args.checkpoint,
                engine_pidfile=(f"{args.run_dir}/engine-{eng.id}.pid" if args.run_dir else None),
            )
        rendered.append(item)
        if not args.json:
            print(f"# {eng.id} on {eng.host}")
            print(shell_line(cmd))
            if args.sidecars:
                sidecar = item["sidecar_argv"]
                print(f"# {eng.id} attestation sidecar")
                print(shell_line(sidecar) if sidecar else "# (no attestation_port in the plan)")
    if args.json:
        print(json.dumps({"plan": lp.plan.name, "engines": rendered}, indent=2))
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    plans, fleet = _load([args.plan], args.fleet)
    lp = plans[0]
    if lp.plan.kind != "simulated":
        raise UsageError(
            "start runs simulated plans; on engine hosts run the commands `render` prints"
        )
    problems = plans_problems(plans, fleet)
    if problems:
        for line in problems:
            _err(line)
        _err("not starting a plan that breaks its rules")
        return 1
    run_dir = Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run-dir {run_dir}: not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # Named by the flag: the bare OSError names whichever path component failed.
        raise UsageError(f"--run-dir {run_dir}: cannot create: {exc.strerror or exc}") from None
    records = load_run(run_dir)
    running = [r.engine_id for r in records.values() if alive(r)]
    if running:
        _err(f"already running from {run_dir}: {', '.join(running)} (stop them first)")
        return 1
    # An engine that cannot bind exits, while whatever holds its port (another run's engine)
    # answers its health check: refuse before starting any rather than start a half plan.
    busy = [
        f"{eng.id}: {problem} (engines[{i}].{what})"
        for i, eng in enumerate(lp.plan.engines)
        for what, host, port in engine_ports(lp.plan, eng)
        if what != "attestation_port"  # the sidecar's, started apart (and possibly first)
        if (problem := _bind_problem(host, port)) is not None
    ]
    if busy:
        for line in busy:
            _err(line)
        _err(f"not starting {lp.plan.name}: a port it needs is taken")
        return 1
    records = {}
    for eng in lp.plan.engines:
        cmd = render_engine(lp.plan, eng)
        argv = _sim_program() + cmd.argv[1:]
        rec = start_detached(eng.id, f"http://{eng.host}:{eng.port}", argv, cmd.env, run_dir)
        records[eng.id] = rec
        save_run(run_dir, records)
    failures = wait_healthy(list(records.values()), args.timeout)
    if failures:
        for line in failures:
            _err(line)
        # A half-started plan is worse than none: stop what did start.
        for rec in records.values():
            stop_record(rec, 10.0)
        _err(f"start failed; stopped every engine of {lp.plan.name}")
        return 1
    for rec in records.values():
        print(f"{rec.engine_id} healthy at {rec.url} (pid {rec.pid}, log {rec.log})")
    return 0


def _bind_problem(host: str, port: int) -> str | None:
    problem = tcp_bind_problem(host, port)
    if problem is not None and problem.endswith("Address already in use"):
        return f"port {port} on {host} is already in use"
    return problem


def cmd_stop(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        # A mistyped directory is not "nothing to stop": the engines may still be running.
        raise UsageError(f"--run-dir {run_dir}: no such directory")
    records = load_run(run_dir)
    if not records:
        print(f"nothing recorded in {run_dir}")
        return 0
    failed = False
    for rec in records.values():
        outcome = stop_record(rec, args.timeout)
        failed = failed or outcome.startswith("still")
        print(f"{rec.engine_id} (pid {rec.pid}): {outcome}")
        Path(rec.pidfile).unlink(missing_ok=True)
    if not failed:
        (run_dir / "run.json").unlink(missing_ok=True)
    return 1 if failed else 0


def _engine_ready(client: httpx.Client, url: str, model: str) -> str | None:
    """Why the engine at ``url`` is not ready to serve ``model`` yet, or None when it is."""
    try:
        health = client.get(url + "/health")
        if health.status_code != 200:
            return f"/health answered {health.status_code}"
        models = client.get(url + "/v1/models")
        served = [m.get("id") for m in models.json().get("data", []) if isinstance(m, dict)]
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (ValueError, AttributeError):
        return "/v1/models did not answer a model list"
    if model not in served:
        return f"serves {served}, not {model}"
    return None


def cmd_wait(args: argparse.Namespace) -> int:
    """Poll every engine of the plans (however they were started: `render`'s commands on the
    engine hosts, or `start`) until it answers /health and serves the plan's model; one line
    per engine as it becomes ready, and one per engine still not ready at the timeout, with
    its last reason. With --run-dir, an engine `start` recorded there counts only while its
    own process runs and holds its port (another process on the port is not the engine)."""
    plans, _ = _load(args.plans, None)
    engines = {
        eng.id: (f"http://{eng.host}:{eng.port}", lp.plan.model.id)
        for lp in plans
        for eng in lp.plan.engines
    }
    records: dict[str, RunRecord] = {}
    if args.run_dir is not None:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise UsageError(f"--run-dir {run_dir}: no such directory")
        # A record of the same id at another URL is another plan's engine, not this one.
        records = {
            k: r for k, r in load_run(run_dir).items() if k in engines and r.url == engines[k][0]
        }
    why: dict[str, str] = {}
    started = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:

        def answers(engine_id: str) -> bool:
            url, model = engines[engine_id]
            reason = _engine_ready(client, url, model)
            rec = records.get(engine_id)
            if reason is None and rec is not None and not holds_its_port(rec):
                # Said here, where the reason is kept; answered_by checks the same again.
                reason = f"answered by a process other than its own (pid {rec.pid})"
            if reason is not None:
                why[engine_id] = reason
            return reason is None

        def ready(engine_id: str) -> bool:
            rec = records.get(engine_id)
            if rec is None:
                return answers(engine_id)
            return answered_by(rec, functools.partial(answers, engine_id))

        def announce(engine_id: str) -> None:
            waited = time.monotonic() - started
            print(f"{engine_id} ready at {engines[engine_id][0]} after {waited:.1f} s", flush=True)

        waited = procs.wait_all(
            {e: functools.partial(ready, e) for e in sorted(engines)},
            args.timeout,
            interval=args.interval,
            alive={e: functools.partial(alive, r) for e, r in records.items()},
            stop_on_exit=False,
            on_ready=announce,
        )
    problems = [exited_line(records[e], "before it was ready") for e in waited.exited]
    problems += [
        f"{engine_id}: not ready within {args.timeout:g} s at {engines[engine_id][0]} "
        f"({why.get(engine_id, 'never answered')})"
        for engine_id in sorted(waited.pending)
    ]
    problems += [
        exited_line(records[e], "after it was ready")
        for e in waited.ready
        if e in records and not alive(records[e])
    ]
    for line in problems:
        _err(line)
    return 1 if problems else 0


def cmd_capture(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise UsageError(f"--out {out}: a directory; name the file to write")
    plans, _ = _load(args.plans, None)
    problems: list[str] = []
    engines: list[dict[str, Any]] = []
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        for lp in plans:
            kv = kv_transfer_config(lp.plan) or {}
            for eng in lp.plan.engines:
                declared = Declared(
                    nixl_host=eng.side_channel.host,
                    nixl_port=eng.side_channel.port,
                    kv_connector=kv.get("kv_connector"),
                    kv_role=kv.get("kv_role"),
                )
                live, found = capture_engine(
                    client, eng.id, f"http://{eng.host}:{eng.port}", declared
                )
                problems += found
                engines.append({"plan": lp.plan.name, **live.model_dump()})
    if problems:
        for line in problems:
            _err(line)
        _err("nothing written")
        return 1
    doc = {
        "schema": LIVE_SCHEMA,
        "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "plans": [
            {"name": lp.plan.name, "path": str(lp.path), "sha256": lp.sha256} for lp in plans
        ],
        "engines": engines,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(doc, indent=2) + "\n")
    for e in engines:
        cache = e.get("kv_cache") or {}
        nixl = e.get("nixl") or {}
        print(
            f"{e['id']}: {e.get('model_id')} block_size {cache.get('block_size')} "
            f"num_blocks {cache.get('num_blocks')} nixl {nixl.get('host')}:{nixl.get('port')}"
        )
    print(f"wrote {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="validate plans against a fleet file")
    c.add_argument("plans", nargs="+", metavar="PLAN")
    c.add_argument("--fleet", required=True, help="fleet contract JSON the plans must match")
    c.set_defaults(func=cmd_check)
    r = sub.add_parser("render", help="print each engine's exact command")
    r.add_argument("plan", metavar="PLAN")
    r.add_argument("--fleet", help="also check the plan against this fleet first")
    r.add_argument("--sidecars", action="store_true", help="also print each sidecar's command")
    r.add_argument("--checkpoint", help="checkpoint directory for the sidecar commands")
    r.add_argument("--run-dir", help="run directory whose pid files the sidecars watch")
    r.add_argument("--json", action="store_true", help="argv lists as JSON")
    r.set_defaults(func=cmd_render)
    s = sub.add_parser("start", help="start a simulated plan's engines, detached")
    s.add_argument("plan", metavar="PLAN")
    s.add_argument("--fleet", required=True, help="the plan is checked against it first")
    s.add_argument("--run-dir", required=True, help="logs, pid files and run.json go here")
    s.add_argument("--timeout", type=positive(float), default=120.0, help="health wait bound (s)")
    s.set_defaults(func=cmd_start)
    t = sub.add_parser("stop", help="stop the engines a start recorded in a run directory")
    t.add_argument("--run-dir", required=True, help="run directory that start wrote")
    t.add_argument(
        "--timeout", type=positive(float), default=10.0, help="SIGTERM grace before SIGKILL"
    )
    t.set_defaults(func=cmd_stop)
    w = sub.add_parser("wait", help="poll the plans' engines until each serves its model")
    w.add_argument("plans", nargs="+", metavar="PLAN")
    w.add_argument("--timeout", type=positive(float), default=900.0, help="bound for the wait (s)")
    w.add_argument("--interval", type=positive(float), default=2.0, help="between polls (s)")
    w.add_argument(
        "--run-dir",
        help="run directory of `start`: its engines count only while their own processes run",
    )
    w.set_defaults(func=cmd_wait)
    k = sub.add_parser("capture", help="read running engines' live facts into a JSON file")
    k.add_argument("plans", nargs="+", metavar="PLAN")
    k.add_argument("--out", required=True, help="where to write the live facts JSON")
    k.add_argument("--timeout", type=positive(float), default=10.0, help="per-request bound (s)")
    k.set_defaults(func=cmd_capture)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except PlanError as exc:
        for line in exc.problems:
            _err(line)
        return 2
    except (ContractError, UsageError, RunStateError) as exc:
        _err(str(exc))
        return 2
    except OSError as exc:
        _err(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
        return 2


if __name__ == "__main__":
    sys.exit(main())
