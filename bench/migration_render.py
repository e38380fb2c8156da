"""What migration costs the relay per streamed request, with nothing else in the way.

The relay's renderer (``serve.relay.EventRenderer``) is given one answer's chunks as the
simulated engine writes them, one read at a time, as the decode leg hands them over: A with a
migration trace (the engine asked for ``return_token_ids``, the prompt's ids cut out of the first
chunk, the trace made per request), B without (the chunks as an engine not asked for ids writes
them). ``bench/router_overhead.py --ab-routing`` measures the whole router; this isolates the
part migration adds per chunk, so that a change to it can be judged in one run.

Two measures:
- default: microseconds per request, the minimum over ``--repeats`` runs of ``--requests``
  requests each (wall time: the machine's load moves it);
- ``--instructions``: the instructions executed per request, each side counted by valgrind's
  callgrind in its own process and the process's start-up (a run of zero requests) taken off.
  Deterministic up to a few thousand instructions a request (``PYTHONHASHSEED`` is fixed; the
  allocator's state still varies): needs valgrind (``make bench-deps-valgrind``).

    .venv/bin/python bench/migration_render.py [--tokens 16] [--prompt-tokens 220]
    .venv/bin/python bench/migration_render.py --instructions --requests 4000
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import orjson

from narwhal.contract import Migration
from narwhal.contract.flags import positive
from narwhal.serve.migration import new_trace
from narwhal.serve.relay import EventRenderer, StreamTally
from narwhal.serve.token_ids import cut_prompt_ids
from narwhal.serve.validation import parse_client_request

MODEL = "moonshotai/Kimi-K3"
MAX_MODEL_LEN = 131072


def stream(tokens: int, prompt: list[int], ids: bool) -> list[bytes]:
    """One completions answer's events, as the simulated engine writes them (vLLM 0.32's
    fields and order; ``ids``: the request asked for ``return_token_ids``)."""
    head = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1733312345}
    events = []
    for i in range(tokens):
        choice = {
            "index": 0,
            "text": f" w{i}",
            "logprobs": None,
            "finish_reason": "length" if i == tokens - 1 else None,
            "stop_reason": None,
            "prompt_token_ids": prompt if (ids and i == 0) else None,
            "token_ids": [1000 + i] if ids else None,
        }
        events.append(orjson.dumps({**head, "model": MODEL, "choices": [choice], "usage": None}))
    usage = {"prompt_tokens": len(prompt), "completion_tokens": tokens}
    usage["total_tokens"] = usage["prompt_tokens"] + tokens
    events.append(orjson.dumps({**head, "model": MODEL, "choices": [], "usage": usage}))
    events.append(b"[DONE]")
    return events


def sides(tokens: int, prompt_tokens: int) -> dict[str, Callable[[], None]]:
    prompt = [300 + (k * 37) % 9000 for k in range(prompt_tokens)]
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = parse_client_request(orjson.dumps(body), False, MODEL, MAX_MODEL_LEN)
    settings = Migration()
    with_ids, without = stream(tokens, prompt, True), stream(tokens, prompt, False)

    def a() -> None:
        trace = new_trace(request, settings, MAX_MODEL_LEN)
        assert trace is not None
        first, raw = cut_prompt_ids(with_ids[0])  # as the decode leg does, once
        if raw is not None:
            trace.keep_prompt_ids(raw)
        renderer = EventRenderer(StreamTally(), True, prompt_tokens, trace)
        renderer.render([first])
        for event in with_ids[1:]:
            renderer.render([event])

    def b() -> None:
        renderer = EventRenderer(StreamTally(), True, prompt_tokens, None)
        for event in without:
            renderer.render([event])

    return {"a": a, "b": b}


def run(side: Callable[[], None], requests: int) -> None:
    for _ in range(requests):
        side()


def instructions(args: argparse.Namespace, side: str, requests: int) -> int:
    """The instructions a process rendering ``requests`` requests of ``side`` executed."""
    with tempfile.TemporaryDirectory() as directory:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={directory}/out",
                sys.executable,
                __file__,
                "--side",
                side,
                "--requests",
                str(requests),
                "--tokens",
                str(args.tokens),
                "--prompt-tokens",
                str(args.prompt_tokens),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
            check=True,
        )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind reported no count: {done.stderr[-500:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive(int), default=16, help="tokens per answer")
    parser.add_argument(
        "--prompt-tokens",
        type=positive(int),
        default=220,
        help="prompt tokens per request, whose ids A's first chunk carries (default %(default)s)",
    )
    parser.add_argument(
        "--requests",
        type=positive(int),
        default=3000,
        help="requests rendered per timed run or callgrind count (default %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=positive(int),
        default=7,
        help="timed runs per side in each of two interleaved passes; the fastest counts "
        "(default %(default)s)",
    )
    parser.add_argument("--instructions", action="store_true", help="count under callgrind")
    parser.add_argument("--side", choices=["a", "b"], help=argparse.SUPPRESS)  # a child's
    args = parser.parse_args()
    functions = sides(args.tokens, args.prompt_tokens)
    if args.side:
        run(functions[args.side], args.requests)
        return 0
    print(f"tokens: {args.tokens}, prompt tokens: {args.prompt_tokens}")
    if args.instructions:
        if not shutil.which("valgrind"):
            print("valgrind is not installed (make bench-deps-valgrind)", file=sys.stderr)
            return 2
        start = instructions(args, "a", 0)
        per = {s: (instructions(args, s, args.requests) - start) / args.requests for s in "ab"}
        print(f"instructions per request, A (migration trace): {per['a']:.0f}")
        print(f"instructions per request, B (none): {per['b']:.0f}")
        print(f"A - B: {per['a'] - per['b']:.0f}; A / B: {per['a'] / per['b']:.3f}")
        return 0
    best = {}
    for side in "abab":  # interleaved: a drift of the machine's load hits both
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run(functions[side], args.requests)
            us = (time.perf_counter() - t0) / args.requests * 1e6
            best[side] = min(best.get(side, us), us)
    print(f"us per request (best of {2 * args.repeats}), A: {best['a']:.2f}, B: {best['b']:.2f}")
    print(f"A - B: {best['a'] - best['b']:.2f} us; A / B: {best['a'] / best['b']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
