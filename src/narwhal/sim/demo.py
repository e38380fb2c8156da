"""``make demo``: bring up the local simulated fleet and hand one request's KV from a prefill
engine to a decode engine over NIXL, as a client of vLLM's P/D protocol."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import uuid

import httpx

from narwhal.sim.fleet import SimFleet, SimFleetError

PROMPT = "Explain disaggregated prefill and decode in one paragraph."


def metric_value(text: str, name: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(match.group(1))
    return total


def run(fleet_path: str) -> int:
    log_dir = tempfile.mkdtemp(prefix="narwhal-demo-")
    print(f"starting the simulated fleet from {fleet_path} (engine logs in {log_dir})", flush=True)
    t0 = time.monotonic()
    with SimFleet(fleet_path, log_dir=log_dir) as fleet:
        print(
            f"fleet healthy in {time.monotonic() - t0:.1f} s: "
            + ", ".join(f"{e.engine_id}={e.url}" for e in fleet.engines.values())
        )
        spec = fleet.fleet
        prefill = next(e for e in spec.engines if e.initial_role == "prefill")
        decode = next(e for e in spec.engines if e.initial_role == "decode")
        model = spec.model.id
        body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
        request_id = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        with httpx.Client(timeout=60) as client:
            before = client.get(f"{decode.url}/metrics").text
            prefill_body = {
                **body,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                },
            }
            t1 = time.monotonic()
            first = client.post(f"{prefill.url}/v1/completions", json=prefill_body, headers=headers)
            first.raise_for_status()
            params = first.json()["kv_transfer_params"]
            t2 = time.monotonic()
            print(
                f"prefill leg on {prefill.id}: {len(params['remote_block_ids'])} KV blocks held,"
                f" {t2 - t1:.3f} s"
            )
            second = client.post(
                f"{decode.url}/v1/completions",
                json={**body, "kv_transfer_params": params},
                headers=headers,
            )
            second.raise_for_status()
            t3 = time.monotonic()
            after = client.get(f"{decode.url}/metrics").text
            whole = client.post(f"{decode.url}/v1/completions", json=body).json()
        split_text = second.json()["choices"][0]["text"]
        moved = metric_value(after, "vllm:nixl_bytes_transferred_sum") - metric_value(
            before, "vllm:nixl_bytes_transferred_sum"
        )
        failures = metric_value(after, "narwhal_sim:kv_verify_failures_total")
        expected = len(params["remote_block_ids"]) * (
            spec.engines[0].sim.block_bytes if spec.engines[0].sim else 16384
        )
        print(f"decode leg on {decode.id}: {t3 - t2:.3f} s")
        print(f"completion: {split_text!r}")
        print(f"usage: {second.json()['usage']}")
        print(
            f"NIXL moved {int(moved):,} bytes ({'=' if moved == expected else '!='} {expected:,}"
            " = blocks x bytes per block)"
        )
        verdict = "verified" if failures == 0 else "FAILED"
        same = split_text == whole["choices"][0]["text"]
        print(
            f"checksum: {verdict}; split output {'equals' if same else 'DIFFERS FROM'} whole output"
        )
        ok = same and failures == 0 and moved == expected
    print("fleet stopped")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", default="configs/fleet/local-sim.json")
    args = parser.parse_args()
    try:
        sys.exit(run(args.fleet))
    except (SimFleetError, httpx.HTTPError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
