"""Several narwhal-serve replicas coordinated through etcd: leader failover, flips after a
leader change, and what coordination costs a request.

A real etcd (Debian's ``etcd-server``) and a simulated fleet of four engines, both on
127.0.0.1, and ``--replicas`` narwhal-serve replicas (``--coordination``, lease TTL
``--ttl``), with a light load spread over the replicas that live throughout. Then:

1. **Failover**, ``--kills`` times: the leader is killed (SIGKILL); the time until another
   replica holds the leader lease, as the survivors' ``/admin/state`` report it (polled every
   20 ms), is the failover time. A forced flip goes through a survivor after each change; the
   killed replica restarts on its own journal, and must converge to the same roles.
2. **Flips applied per replica**: each replica's journal, read at the end, must hold every flip
   made while it ran exactly once (``role.flip`` by generation), and the replicas that ran
   throughout identical lists; a restarted replica adopts the roles of its start in one
   ``role.sync``. The journals' request records must balance (every ``request.start`` ended
   once, a killed replica's open requests closed by its recovery at restart), and no request
   sent to a live replica may fail.
3. **Router CPU per request, coordination on vs off**: ``bench/router_overhead.py``'s A/B mode
   with A a coordinated replica (its own etcd lease, watch and keep-alives) and B the same
   router alone, with its 95% interval (``--cpu-requests``, ``--cpu-rounds``; 0 skips it).

    .venv/bin/python bench/replicas.py [--kills 10] [--ttl 2] [--cpu-requests 2400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from narwhal.serve.cli import serve_command
from narwhal.simengine.fleet import local_fleet_document
from narwhal.testing import procs
from narwhal.testing.etcd import EtcdServer, etcd_binary
from narwhal.testing.fleet import SimFleet
from narwhal.testing.ports import free_ports
from narwhal.testing.replica_load import ReplicaLoad

ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "bench-admin-token"
MODEL = "moonshotai/Kimi-K3"


class Replica:
    def __init__(self, name: str, directory: Path, fleet: Path, etcd: EtcdServer, ttl: int):
        self.name = name
        self.home = directory / name
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "admin-token").write_text(ADMIN_TOKEN + "\n")
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.journal = self.home / "journal.jsonl"
        self.argv = serve_command(
            fleet,
            self.port,
            self.journal,
            "--skip-qualification",
            "--admin-token-file",
            str(self.home / "admin-token"),
            "--coordination",
            etcd.url,
            "--replica-id",
            name,
            "--coordination-lease-ttl",
            str(ttl),
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.home / "router.log"
        self.process = procs.start(self.argv, log)
        procs.wait_ready(
            lambda: procs.http_ok(self.url + "/ready"), 60, process=self.process, log=log
        )

    def kill(self) -> None:
        assert self.process is not None
        procs.kill(self.process)
        self.process = None

    def stop(self) -> None:
        if self.process is not None:
            procs.stop(self.process, 30)
            self.process = None

    def state(self) -> dict[str, Any] | None:
        try:
            return httpx.get(
                self.url + "/admin/state",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=2,
                trust_env=False,
            ).json()  # type: ignore[no-any-return]
        except httpx.HTTPError:
            return None

    def records(self) -> list[dict[str, Any]]:
        raw = self.journal.read_bytes() if self.journal.exists() else b""
        return [json.loads(line) for line in raw.split(b"\n")[:-1] if line.strip()]


def leader_of(replicas: list[Replica]) -> str | None:
    """The replica every one of ``replicas`` names as leader, and which says it leads."""
    names = set()
    leading = []
    for r in replicas:
        state = r.state()
        if state is None or not state["coordination"]["up"]:
            return None
        names.add(state["coordination"]["leader"])
        if state["coordination"]["is_leader"]:
            leading.append(r.name)
    if len(names) == 1 and leading == list(names):
        return leading[0]
    return None


def roles_of(replica: Replica) -> tuple[int, dict[str, str]] | None:
    state = replica.state()
    if state is None:
        return None
    return state["role_generation"], {e["id"]: e["role"] for e in state["engines"]}


def converged(replicas: list[Replica], timeout: float) -> tuple[int, dict[str, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        views = [roles_of(r) for r in replicas]
        if all(v is not None and v == views[0] for v in views):
            assert views[0] is not None
            return views[0]
        time.sleep(0.02)
    raise RuntimeError(f"replicas did not converge: {[roles_of(r) for r in replicas]}")


def failover(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with EtcdServer(directory / "etcd") as etcd:
        ports = free_ports(8)
        doc = local_fleet_document(ports[:4], ports[4:], sim={"time_scale": 50.0})
        doc["roles"] = {"enabled": False, "min_prefill": 1, "min_decode": 1}
        fleet_path = directory / "fleet.json"
        fleet_path.write_text(json.dumps(doc, indent=2))
        fleet = SimFleet(fleet_path, log_dir=directory / "logs")
        fleet.start(timeout=90)
        names = [f"r{i + 1}" for i in range(args.replicas)]
        replicas = {n: Replica(n, directory, fleet_path, etcd, args.ttl) for n in names}
        try:
            for r in replicas.values():
                r.start()
            everyone = list(replicas.values())
            converged(everyone, 20)
            times: list[float] = []
            flips_made: list[int] = []
            killed_when: dict[str, list[int]] = {n: [] for n in names}
            urls = {n: r.url for n, r in replicas.items()}
            with ReplicaLoad(
                urls, MODEL, threads=args.load_threads, limit=10**7, seconds=7200
            ) as load:
                for k in range(args.kills):
                    deadline = time.monotonic() + 30
                    leader = leader_of(everyone)
                    while leader is None and time.monotonic() < deadline:
                        time.sleep(0.05)
                        leader = leader_of(everyone)
                    if leader is None:
                        raise RuntimeError("no leader among the replicas")
                    load.exclude(leader)
                    time.sleep(0.3)  # requests already sent to it finish
                    generation, _ = converged(everyone, 10)
                    killed_when[leader].append(generation)
                    replicas[leader].kill()
                    t0 = time.monotonic()
                    survivors = [r for r in everyone if r.name != leader]
                    new = None
                    while new is None and time.monotonic() - t0 < 4 * args.ttl + 10:
                        time.sleep(0.02)
                        new = leader_of(survivors)
                    if new is None:
                        raise RuntimeError(f"no new leader after killing {leader}")
                    times.append(time.monotonic() - t0)
                    # A flip through a survivor after the change: every replica must apply it.
                    _, roles = converged(survivors, 10)
                    to = "prefill" if k % 2 == 0 else "decode"
                    engine = next(e for e, role in sorted(roles.items()) if role != to)
                    answer = httpx.post(
                        survivors[-1].url + "/admin/roles/flip",
                        json={"engine": engine, "to": to},
                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                        timeout=10,
                        trust_env=False,
                    )
                    if answer.status_code != 200:
                        raise RuntimeError(f"flip after failover: {answer.text}")
                    flips_made.append(answer.json()["role_generation"])
                    replicas[leader].start()
                    converged(everyone, 20)
                    load.include(leader)
                    print(f"kill {k + 1}: {leader} -> {new} in {times[-1]:.3f} s", flush=True)
            time.sleep(1.0)
            final_generation, _ = converged(everyone, 10)
        finally:
            for r in replicas.values():
                r.stop()
            fleet.stop()
    # The journals, whole (every replica stopped cleanly).
    per_replica: dict[str, Any] = {}
    identical_lists = []
    for name, r in replicas.items():
        records = r.records()
        flips = [rec["role_generation"] for rec in records if rec["type"] == "role.flip"]
        starts = [rec["id"] for rec in records if rec["type"] == "request.start"]
        ends = [rec["id"] for rec in records if rec["type"] == "request.end"]
        recovered = sum(
            1
            for rec in records
            if rec["type"] == "request.end" and rec["outcome"] == "router_restart"
        )
        doubled = len(flips) != len(set(flips))
        per_replica[name] = {
            "flips_journaled": len(flips),
            "flip_doubled": doubled,
            "kills": len(killed_when[name]),
            "requests_started": len(starts),
            "requests_ended": len(ends),
            "unbalanced": len(set(starts) ^ set(ends)) + (len(ends) - len(set(ends))),
            "closed_by_recovery": recovered,
            "replica_stamp_ok": all(rec.get("replica") == name for rec in records),
        }
        if not killed_when[name]:
            identical_lists.append(flips)
        # Every flip made while this replica ran is in its journal once.
        missing = [g for g in flips_made if g not in flips and not _was_down(g, killed_when[name])]
        per_replica[name]["flips_missing"] = missing
    out["ttl_s"] = args.ttl
    out["kills"] = len(times)
    out["failover_s_median"] = round(statistics.median(times), 3)
    out["failover_s_max"] = round(max(times), 3)
    out["failover_s_each"] = " ".join(f"{t:.3f}" for t in times)
    out["flips_made_after_leader_changes"] = len(flips_made)
    out["final_role_generation"] = final_generation
    out["flip_lists_identical_on_replicas_never_killed"] = (
        all(f == identical_lists[0] for f in identical_lists) if identical_lists else "n/a"
    )
    out["requests_sent"] = sum(load.sent.values())
    failures = load.failures()
    out["requests_failed"] = len(failures)
    if failures:
        out["first_failures"] = failures[:3]
    for name, info in per_replica.items():
        out[f"replica_{name}"] = json.dumps(info)
    ok = (
        not failures
        and all(not i["flip_doubled"] and not i["flips_missing"] for i in per_replica.values())
        and all(i["unbalanced"] == 0 and i["replica_stamp_ok"] for i in per_replica.values())
        and out["flip_lists_identical_on_replicas_never_killed"] in (True, "n/a")
    )
    out["failover_checks"] = "pass" if ok else "FAIL"
    return out


def _was_down(generation: int, killed_at: list[int]) -> bool:
    """A replica killed when the roles were at ``g`` missed the flip made next (``g + 1``):
    it adopted it at its restart instead."""
    return any(generation == g + 1 for g in killed_at)


def cpu(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    with EtcdServer(directory / "etcd-cpu") as etcd:
        command = [
            sys.executable,
            str(ROOT / "bench" / "router_overhead.py"),
            "--requests",
            str(args.cpu_requests),
            "--rounds",
            str(args.cpu_rounds),
            "--concurrency",
            "16",
            "--ab-routing",
            "{}",
            f"--a-arg=--coordination={etcd.url}",
            "--a-arg=--replica-id=a",
        ]
        print("$ " + " ".join(command[1:]), flush=True)
        result = subprocess.run(command, capture_output=True, text=True, timeout=7200)
    if result.returncode != 0:
        raise RuntimeError(f"router_overhead failed:\n{result.stderr[-3000:]}")
    out: dict[str, Any] = {}
    for line in result.stdout.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith(("ratio_cpu_a_over_b", "ratio_per_round")) or name in (
            "a_args",
            "requests_per_target_and_mode",
            "load_average_at_start",
        ):
            out[f"cpu_{name}"] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--replicas",
        type=int,
        default=3,
        help="narwhal-serve replicas, at least 2 (default %(default)s)",
    )
    parser.add_argument(
        "--kills",
        type=int,
        default=10,
        help="times the leader is killed and failover timed (default %(default)s)",
    )
    parser.add_argument("--ttl", type=int, default=2, help="the replicas' lease TTL, seconds")
    parser.add_argument(
        "--load-threads",
        type=int,
        default=3,
        help="client threads sending the light load over the replicas (default %(default)s)",
    )
    parser.add_argument(
        "--cpu-requests",
        type=int,
        default=2400,
        help="router_overhead.py --requests for the CPU A/B; 0 skips it (default %(default)s)",
    )
    parser.add_argument(
        "--cpu-rounds",
        type=int,
        default=8,
        help="router_overhead.py --rounds for the CPU A/B (default %(default)s)",
    )
    args = parser.parse_args()
    if args.replicas < 2 or args.kills < 1 or args.ttl < 2:
        parser.error("--replicas at least 2, --kills at least 1, --ttl at least 2")
    if etcd_binary() is None:
        print("etcd is not installed (make test-deps installs etcd-server)", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="narwhal-replicas-") as tmp:
        directory = Path(tmp)
        rows = {"command": "bench/replicas.py " + " ".join(sys.argv[1:])}
        rows.update(failover(args, directory))
        if args.cpu_requests > 0:
            rows.update(cpu(args, directory))
    rows["bench_wall_s"] = f"{time.monotonic() - started:.1f}"
    for name, value in rows.items():
        print(f"{name}: {value}")
    return 0 if rows["failover_checks"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
