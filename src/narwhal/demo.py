"""``make demo``: a simulated fleet, narwhal-serve in front of it, and requests through it.

Starts every engine of the fleet file, qualifies the fleet with ``narwhal-check`` (every gate,
with few probes: the qualified path the product is for) and prints its verdict, starts the
router on that check's report, sends a streamed chat request and a completion through it,
prints them, a one-line summary of each from the router's journal, and the KV bytes NIXL moved
with the decode engines' verdict on them. Then it keeps serving until Ctrl-C, or exits at once
with ``DEMO_ONCE=1`` (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from narwhal.asgi import tcp_bind_problem
from narwhal.contract import ContractError, load_fleet
from narwhal.contract.flags import number_type
from narwhal.engines.scrape import metric_sum
from narwhal.serve.cli import serve_command
from narwhal.testing import procs
from narwhal.testing.fleet import SimFleet
from narwhal.testing.routers import router_ready


def _fleet_total(urls: list[str], metric: str) -> float:
    """A metric's sum over the engines at ``urls`` (0 where an engine has none)."""
    return sum(metric_sum(httpx.get(u + "/metrics").content, metric) or 0.0 for u in urls)


def _summary(record: dict[str, Any]) -> str:
    t = record.get("t_first_token")
    ttft = f"{t:.3f}s" if isinstance(t, float) else "-"
    return (
        f"  {record['id'][:12]}  {record['outcome']:<6} {record['endpoint']:<21} "
        f"prefill={record.get('prefill_engine')} decode={record.get('decode_engine')} "
        f"handoff={record.get('handoff')} prompt={record.get('prompt_tokens')} "
        f"completion={record.get('completion_tokens')} ttft={ttft}"
    )


def _qualify(fleet_path: str, work: Path) -> Path | None:
    """narwhal-check on the running fleet, quickly (two probes of each kind): its report, or
    None when the fleet failed a gate (the check's table says which)."""
    report = work / "check-report.json"
    argv = [sys.executable, "-m", "narwhal.check.cli", "--quiet", "--fleet", fleet_path]
    argv += ["--report", str(report), "--pace-repeats", "1", "--kv-probes", "1"]
    print("qualifying the fleet: narwhal-check (every gate) ...", flush=True)
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    print(done.stdout.rstrip(), flush=True)
    if done.returncode != 0:
        print(f"narwhal-check refused the fleet (exit {done.returncode}): {done.stderr.strip()}")
        return None
    print(f"qualified in {time.monotonic() - started:.1f} s; report {report}\n", flush=True)
    return report


def _ports_in_use(fleet_path: str, port: int) -> list[str]:
    """The addresses the demo would listen on that something else holds: the router's, each
    engine's HTTP and NIXL side channel (a fleet already running answers on them, and the demo
    would talk to it instead of its own)."""
    contract = load_fleet(fleet_path).contract
    wanted = [("the router (set DEMO_PORT)", "127.0.0.1", port)]
    for engine in contract.engines:
        url = urlsplit(engine.url)
        wanted.append((f"engine {engine.id}", url.hostname or "127.0.0.1", url.port or 80))
        wanted.append(
            (f"engine {engine.id}'s NIXL side channel", engine.nixl.host, engine.nixl.port)
        )
    return [
        f"{what}: {host}:{number}: {problem}"
        for what, host, number in wanted
        if (problem := tcp_bind_problem(host, number)) is not None
    ]


def run(fleet_path: str, port: int, once: bool) -> int:
    try:
        busy = _ports_in_use(fleet_path, port)
    except ContractError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if busy:
        print(
            "demo: cannot start: these addresses are taken (another demo, a fleet or a router "
            "running?):\n  " + "\n  ".join(busy),
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="narwhal-demo-"))
    journal = work / "journal.jsonl"
    print(f"fleet {fleet_path}; logs and journal in {work}", flush=True)
    with SimFleet(fleet_path, log_dir=work) as fleet:
        print(
            "engines: "
            + ", ".join(
                f"{e.engine_id} {fleet.fleet.engine_by_id(e.engine_id).initial_role} at {e.url}"
                for e in fleet.engines.values()
            ),
            flush=True,
        )
        report = _qualify(fleet_path, work)
        if report is None:
            return 1
        router_log = work / "router.log"
        router = procs.start(
            serve_command(fleet_path, port, journal, "--check-report", str(report)), router_log
        )
        url = f"http://127.0.0.1:{port}"
        try:
            procs.wait_ready(
                lambda: router_ready(url),
                30,
                process=router,
                name="narwhal-serve",
                log=router_log,
            )
            print(f"narwhal-serve ready at {url}\n", flush=True)
            model = fleet.fleet.model.id
            decode_urls = [e.url for e in fleet.fleet.engines if e.initial_role == "decode"]
            before = _fleet_total(decode_urls, "vllm:nixl_bytes_transferred_sum")
            with httpx.Client(timeout=60) as client:
                print("streamed chat through the router:", flush=True)
                body = {
                    "model": model,
                    "stream": True,
                    "max_tokens": 24,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "Why split prefill from decode?"}],
                }
                with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        for choice in chunk["choices"]:
                            print(choice["delta"].get("content", ""), end="", flush=True)
                        if chunk.get("usage"):
                            print(f"\n  usage: {chunk['usage']}", flush=True)
                completion = client.post(
                    url + "/v1/completions",
                    json={
                        "model": model,
                        "prompt": "The KV cache moves over NIXL because",
                        "max_tokens": 16,
                    },
                ).json()
                print(f"completion: {completion['choices'][0]['text']!r}")
                print(f"  usage: {completion['usage']}\n")
            moved = _fleet_total(decode_urls, "vllm:nixl_bytes_transferred_sum")
            failures = _fleet_total(decode_urls, "narwhal_sim:kv_verify_failures_total")
            print(
                f"NIXL moved {int(moved - before):,} bytes of KV between engines; checksum: "
                f"{'every pulled block verified' if failures == 0 else 'FAILED'}"
            )
            ends: list[dict[str, Any]] = []

            def both_ended() -> bool:
                lines = journal.read_text().splitlines()
                ends[:] = [json.loads(x) for x in lines if '"request.end"' in x]
                return len(ends) >= 2

            procs.wait_until(both_ended, 5)
            print("journal (one line per request):")
            for record in ends:
                print(_summary(record))
            ok = failures == 0 and moved > before and all(e["outcome"] == "ok" for e in ends)
            if once:
                return 0 if ok else 1
            print(
                f"\nserving at {url} until Ctrl-C; try:\n  curl -s {url}/v1/completions "
                f'-H \'Content-Type: application/json\' -d \'{{"model": "{model}", '
                '"prompt": "hello", "max_tokens": 8}\'',
                flush=True,
            )
            stop = {"now": False}
            signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
            signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
            while not stop["now"] and router.poll() is None:
                time.sleep(0.2)
            return 0
        finally:
            procs.stop(router, 30)
            print("stopped the router and the fleet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", default="configs/fleet/local-sim.json")
    # DEMO_PORT goes through the flag's own check (a port of letters was a traceback).
    parser.add_argument(
        "--port",
        type=number_type(int, 1, 65535),
        default=os.environ.get("DEMO_PORT", "8000"),
        help="the router's port (default: $DEMO_PORT, else 8000)",
    )
    args = parser.parse_args()
    once = os.environ.get("DEMO_ONCE", "") not in ("", "0")
    try:
        sys.exit(run(args.fleet, args.port, once))
    except (procs.ProcessError, httpx.HTTPError, OSError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
