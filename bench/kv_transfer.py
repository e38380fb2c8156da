"""NIXL READ throughput between two processes, next to a numpy memcpy of the same size.

A child process owns a registered KV pool and serves its peer info on stdout; this process
pulls 1, 16 and 256 MiB of it over NIXL (UCX on loopback) and verifies every byte, then copies
the same number of bytes with numpy in the same run. Prints `name: value` rows and a ratio.

    .venv/bin/python bench/kv_transfer.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import numpy as np
import orjson

from narwhal.simengine.kv_transfer import KVPeerInfo, KVTransferAgent

BLOCK_BYTES = 256 * 1024
POOL_BLOCKS = 1024  # 256 MiB
SIZES_MIB = (1, 16, 256)

_OWNER = """
import asyncio, sys, numpy as np, orjson
from narwhal.simengine.kv_transfer import KVTransferAgent
async def main():
    pool = np.empty(({n}, {b}), dtype=np.uint8)
    pool[:] = (np.arange(pool.size, dtype=np.uint64) % 251).astype(np.uint8).reshape(pool.shape)
    agent = KVTransferAgent("bench-owner", pool, on_notification=lambda m: None)
    agent.start(asyncio.get_running_loop())
    agent.set_outstanding_holds(1)
    sys.stdout.write(orjson.dumps(agent.peer_info("owner", "g0").to_wire()).decode() + "\\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    agent.close()
asyncio.run(main())
"""


async def run(repeats: int) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER.format(n=POOL_BLOCKS, b=BLOCK_BYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert owner.stdout is not None
        peer = KVPeerInfo.from_wire(orjson.loads(owner.stdout.readline()))
        expected = (np.arange(POOL_BLOCKS * BLOCK_BYTES, dtype=np.uint64) % 251).astype(np.uint8)
        expected = expected.reshape(POOL_BLOCKS, BLOCK_BYTES)
        local = np.zeros((POOL_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        agent = KVTransferAgent("bench-reader", local, on_notification=lambda m: None)
        agent.start(asyncio.get_running_loop())
        # The first READ to a new peer pays connection setup; report it apart.
        first = await agent.read(peer, [0], [0], b"warmup", timeout=30)
        print(f"first_read_setup_ms: {first.seconds * 1e3:.1f}")
        ratios = []
        for mib in SIZES_MIB:
            blocks = mib * 1024 * 1024 // BLOCK_BYTES
            ids = list(range(blocks))
            nixl_s = []
            for _ in range(repeats):
                local[:blocks] = 0
                t0 = time.perf_counter()
                await agent.read(peer, ids, ids, b"x", timeout=60)
                nixl_s.append(time.perf_counter() - t0)
                if not np.array_equal(local[:blocks], expected[:blocks]):
                    raise SystemExit(f"{mib} MiB: pulled bytes differ from the owner's")
            dst = np.empty_like(expected[:blocks])
            copy_s = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                np.copyto(dst, expected[:blocks])
                copy_s.append(time.perf_counter() - t0)
            nixl_gbs = mib / 1024 / statistics.median(nixl_s)
            copy_gbs = mib / 1024 / statistics.median(copy_s)
            ratio = nixl_gbs / copy_gbs
            ratios.append(ratio)
            print(f"nixl_read_{mib}MiB_GiBps: {nixl_gbs:.2f}")
            print(f"numpy_memcpy_{mib}MiB_GiBps: {copy_gbs:.2f}")
            print(f"ratio_nixl_over_memcpy_{mib}MiB: {ratio:.3f}")
        agent.close()
        print(f"ratio_nixl_over_memcpy_geomean: {float(np.exp(np.mean(np.log(ratios)))):.3f}")
    finally:
        if owner.stdin:
            owner.stdin.close()
        try:
            owner.wait(10)
        except subprocess.TimeoutExpired:
            owner.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed READs and copies per size; the median is reported (default %(default)s)",
    )
    args = parser.parse_args()
    asyncio.run(run(args.repeats))


if __name__ == "__main__":
    main()
