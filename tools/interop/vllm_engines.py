"""Start and stop real vLLM engines (the CPU build) as a P/D pair, with the settings verified in
issue 12, and write the fleet file that puts Narwhal in front of them.

    python tools/interop/vllm_engines.py --model build/interop/tiny-llama --dir runs/interop \\
        [--vllm-python .venv-vllm/bin/python] [--port 18300 --port 18301]

runs a prefill engine ``p0`` and a decode engine ``d0`` until Ctrl-C or SIGTERM, and writes
``DIR/fleet.json`` for ``narwhal-serve``. The interop suite (``tests/interop``) imports the same
functions. It runs under Narwhal's own environment (the engines under vLLM's): processes, ports
and /proc readings are ``narwhal.testing``'s.

Every engine runs in its own session (process group), so stopping it ends its EngineCore child
too; stopping signals that group by the id this module started it with, never by name.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from narwhal.testing import procs
from narwhal.testing.ports import free_ports
from narwhal.testing.procfs import busy_threads

__all__ = [
    "ENGINE_READY_TIMEOUT_S",
    "MODEL_NAME",
    "EngineProcess",
    "EngineStartError",
    "default_model_dir",
    "default_vllm_python",
    "engine_command",
    "engine_env",
    "fleet_document",
    "kill_engine",
    "quiet_busy_threads",
    "start_engine",
    "stop_engine",
    "wait_healthy",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "narwhal/tiny-llama"
MAX_MODEL_LEN = 2048
# A cold start on a busy 2-core machine (import torch, load, profile the KV cache) can take
# a couple of minutes; two engines start at once.
ENGINE_READY_TIMEOUT_S = 600.0
KV_TRANSFER_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
}

# A named or "required" tool_choice needs a tool parser in vLLM 0.32 (without one the engine
# answers 400, on the prefill leg too: both engines need it). "pythonic" constrains a named
# call with the function's own JSON schema and answers the JSON as the call's arguments; the
# structural-tag parsers (hermes, llama3_json) leave the arguments' whitespace free, where a
# random-weight model emits spaces until its length cap. The tiny model's template ignores
# tools either way.
TOOL_CALL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
# Compact JSON under guided decoding (xgrammar honours this only as an engine setting, and
# only with the backend named): otherwise the same endless whitespace.
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}


class EngineStartError(Exception):
    pass


def default_vllm_python() -> Path:
    """The vLLM venv's interpreter (``NARWHAL_VLLM_VENV``, default ``.venv-vllm``), as an
    absolute path that is not resolved: the venv's ``bin/python`` symlink is what makes it
    the venv's."""
    venv = os.environ.get("NARWHAL_VLLM_VENV") or str(ROOT / ".venv-vllm")
    return Path(os.path.abspath(Path(venv) / "bin" / "python"))


def default_model_dir() -> Path:
    model = os.environ.get("NARWHAL_TINY_MODEL") or str(ROOT / "build" / "interop" / "tiny-llama")
    return Path(os.path.abspath(model))


@dataclass
class EngineProcess:
    name: str
    port: int
    side_channel_port: int
    cpu_bind: str
    process: subprocess.Popen[bytes]
    log_path: Path
    # Threads lowered to nice 19 once the engine was healthy (quiet_busy_threads).
    quieted_threads: list[int] = field(default_factory=list)
    # Where it publishes KV cache events (the fleet's ``kv_events``), when it does.
    kv_events: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def engine_command(
    python: Path | str,
    model_dir: Path | str,
    port: int,
    served_name: str = MODEL_NAME,
    max_model_len: int = MAX_MODEL_LEN,
    max_num_seqs: int = 8,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The verified command line: float16 (bfloat16 crashes the decode worker's AMX attention
    kernel here), no torch.compile, NixlConnector with a CPU KV buffer, a tool parser and
    compact guided JSON (``TOOL_CALL_ARGS``, ``STRUCTURED_OUTPUTS_CONFIG``); ``extra_args``
    after."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float16",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        "--compilation-config",
        json.dumps({"mode": 0}),
        "--kv-transfer-config",
        json.dumps(KV_TRANSFER_CONFIG),
        *TOOL_CALL_ARGS,
        "--structured-outputs-config",
        json.dumps(STRUCTURED_OUTPUTS_CONFIG),
        *extra_args,
    ]


def kv_events_args(pub_port: int, replay_port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's flags to publish KV cache events on ``pub_port`` (ZMQ PUB) with a replay socket
    on ``replay_port``, and report cached tokens in usage; and the fleet's ``kv_events``."""
    # vLLM binds its PUB socket only for an endpoint with a wildcard (it connects to any other
    # address, for a subscriber that binds); the replay socket it always binds.
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    flags = ["--kv-events-config", json.dumps(config), "--enable-prompt-tokens-details"]
    endpoints = {
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": config["replay_endpoint"],
    }
    return flags, endpoints


def engine_env(
    workdir: Path, side_channel_port: int, cpu_bind: str, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The engine's environment: offline, loopback only, caches and temp files in ``workdir``."""
    env = dict(os.environ if base is None else base)
    # The engine runs from its own virtual environment, not the caller's.
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(var, None)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
    cache = workdir / "cache"
    tmp = workdir / "tmp"
    cache.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(cache / "hf"),
        VLLM_CACHE_ROOT=str(cache / "vllm"),
        VLLM_CONFIG_ROOT=str(cache / "vllm-config"),
        XDG_CACHE_HOME=str(cache),
        TMPDIR=str(tmp),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE="1",
        # One core per engine; automatic binding on 2 cores drops to about 4.5 tokens/s.
        VLLM_CPU_OMP_THREADS_BIND=cpu_bind,
        UCX_NET_DEVICES="lo",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port),
        NIXL_LOG_LEVEL=env.get("NIXL_LOG_LEVEL", "WARN"),
        NO_PROXY="127.0.0.1,localhost",
    )
    return env


def start_engine(
    name: str,
    workdir: Path,
    model_dir: Path,
    port: int,
    side_channel_port: int,
    cpu_bind: str,
    python: Path | None = None,
    kv_event_ports: tuple[int, int] | None = None,
) -> EngineProcess:
    """Start one engine in its own session; its log goes to ``workdir/NAME/engine.log``. With
    ``kv_event_ports`` (PUB, replay) it publishes KV cache events (``kv_events_args``)."""
    # Absolute paths: the engine runs in its own folder. abspath, not resolve(): resolving the
    # venv's python symlink would leave the venv.
    python = Path(os.path.abspath(python or default_vllm_python()))
    model_dir = Path(os.path.abspath(model_dir))
    home = Path(os.path.abspath(workdir / name))
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "engine.log"
    flags: list[str] = []
    events = None
    if kv_event_ports is not None:
        flags, events = kv_events_args(*kv_event_ports)
    process = procs.start(
        engine_command(python, model_dir, port, extra_args=flags),
        log_path,
        env=engine_env(home, side_channel_port, cpu_bind),
        cwd=home,
        # In the caller's session, so that its busy-polling threads lowered to nice 19
        # (quiet_busy_threads) yield to the router and the tests: see procs.start.
        new_session=False,
        new_group=True,
    )
    return EngineProcess(
        name, port, side_channel_port, cpu_bind, process, log_path, kv_events=events
    )


def wait_healthy(engines: list[EngineProcess], timeout: float = ENGINE_READY_TIMEOUT_S) -> float:
    """Wait until every engine answers /health; raise with the log tail of one that died or
    did not come up. Returns the seconds waited."""
    by_name = {e.name: e for e in engines}

    def quiet(name: str) -> None:
        engine = by_name[name]
        engine.quieted_threads = quiet_busy_threads(engine.process.pid)

    waited = procs.wait_all(
        {e.name: functools.partial(procs.http_ok, e.url + "/health") for e in engines},
        timeout,
        alive={e.name: functools.partial(procs.is_running, e.process) for e in engines},
        interval=1.0,
        on_ready=quiet,
    )
    for name in waited.exited:
        engine = by_name[name]
        raise EngineStartError(
            f"engine {name} exited with {engine.process.returncode} while starting; log tail:\n"
            + engine.log_tail()
        )
    if waited.pending:
        first = by_name[waited.pending[0]]
        raise EngineStartError(
            f"engine(s) {', '.join(waited.pending)} not healthy within {timeout:.0f} s; log tail"
            f" of {first.name}:\n" + first.log_tail()
        )
    return waited.seconds


def quiet_busy_threads(pid: int, sample_s: float = 1.0, busy_share: float = 0.5) -> list[int]:
    """Drop to nice 19 every non-main thread of an idle engine that keeps a core busy; returns
    their ids.

    NIXL's UCX progress thread polls without sleeping (the nixl Python API fixes its delay at 0
    and vLLM has no setting to turn the thread off), so each engine keeps one thread at 100% of
    the core its worker is bound to, idle or not. On a 2-core machine that leaves the engines'
    own compute, their API servers, the router and the test client half the machine: stalls of
    20 to 30 s were measured (a decode leg's connect timed out at 5 s, a chat template render
    at 30 s). At nice 19 the thread still runs whenever its core has nothing else to do, so
    transfers still progress. Main threads (the worker's compute) are never touched.
    """
    quieted: list[int] = []
    for thread in busy_threads(pid, sample_s, busy_share):
        try:
            os.setpriority(os.PRIO_PROCESS, thread, 19)
        except OSError:
            continue
        quieted.append(thread)
    return quieted


def stop_engine(engine: EngineProcess, timeout: float = 30.0) -> int | None:
    """SIGTERM the engine's process group, then SIGKILL it if still there after ``timeout``.
    Children (EngineCore) may outlive the API server; the group is ours either way."""
    return procs.stop(engine.process, timeout, group=True)


def kill_engine(engine: EngineProcess) -> None:
    """SIGKILL the engine's whole process group at once (a crash, for failure tests)."""
    procs.kill(engine.process, group=True)


def fleet_document(
    prefill: EngineProcess,
    decode: EngineProcess,
    *,
    name: str = "vllm-interop",
    attestation_urls: dict[str, str] | None = None,
    # Generous: a 2-core machine shared with other work stalls an engine for many seconds at a
    # time (a 30 s first token was seen under a load average of 10), and the interop suite
    # judges results, not speed.
    first_token_timeout_s: float = 60.0,
    fallback: str = "retry",
    block_size: int | None = None,
    block_bytes: int | None = None,
) -> dict[str, Any]:
    """A fleet of one prefill and one decode engine (fixed roles: two engines leave no room to
    flip). No ``sim`` block: these are real engines."""
    urls = attestation_urls or {}

    def spec(engine: EngineProcess, role: str) -> dict[str, Any]:
        return {
            "id": engine.name,
            "url": engine.url,
            "host": "127.0.0.1",
            "roles": [role],
            "initial_role": role,
            "nixl": {"host": "127.0.0.1", "port": engine.side_channel_port},
            "attestation_url": urls.get(engine.name),
            "generation": None,
            **({"kv_events": engine.kv_events} if engine.kv_events else {}),
        }

    return {
        "schema": "narwhal.fleet/v1",
        "name": name,
        "model": {
            "id": MODEL_NAME,
            "revision": "tiny-random",
            "config_sha256": None,
            "shard_manifest_sha256": None,
            "max_model_len": MAX_MODEL_LEN,
        },
        "budgets": {"ttft_s": 120.0, "tpot_s": 2.0, "attainment": 0.9},
        "engine": {
            "first_token_timeout_s": first_token_timeout_s,
            "request_timeout_s": 300.0,
            # Generous for the same reason: a connect times out when the router's own loop is
            # held off the CPU, not when the engine is slow to accept.
            "connect_timeout_s": 15.0,
            "tp": 1,
            "accelerator": "cpu",
            "gpu_arch": "cpu",
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            # The engines' --block-size (vLLM's CPU default is 128), for the prefix index, and
            # a block's bytes, for the journal's kv_bytes_moved.
            "prefix_caching": {
                **({"block_size": block_size} if block_size else {}),
                **({"block_bytes": block_bytes} if block_bytes else {}),
            },
        },
        "engines": [spec(prefill, "prefill"), spec(decode, "decode")],
        "kv_transfer_pairs": [{"prefill": prefill.name, "decode": decode.name}],
        "roles": {"enabled": False, "min_prefill": 1, "min_decode": 1},
        "routing": {
            "fallback": fallback,
            "max_prefill_attempts": 2,
            "max_decode_attempts": 2,
            "admission": "reject",
        },
        "profile_store": None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vllm_engines.py", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    p.add_argument(
        "--model",
        type=Path,
        default=default_model_dir(),
        help="model directory (with config.json) both engines serve (default %(default)s; "
        "NARWHAL_TINY_MODEL sets it)",
    )
    p.add_argument("--dir", type=Path, required=True, help="run folder (logs, caches, fleet)")
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=default_vllm_python(),
        help="the vLLM venv's python, which runs the engines (default %(default)s; "
        "NARWHAL_VLLM_VENV names the venv)",
    )
    p.add_argument("--port", type=int, action="append", help="HTTP ports: prefill, decode")
    p.add_argument(
        "--timeout",
        type=float,
        default=ENGINE_READY_TIMEOUT_S,
        help="seconds to wait for both engines to answer /health (default %(default)s)",
    )
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"vllm_engines.py: no model in {args.model} (make interop-model)", file=sys.stderr)
        return 2
    if not args.vllm_python.exists():
        print(f"vllm_engines.py: {args.vllm_python} missing (make interop-venv)", file=sys.stderr)
        return 2
    ports = args.port or []
    if len(ports) not in (0, 2):
        print("vllm_engines.py: give --port twice (prefill, decode) or not at all", file=sys.stderr)
        return 2
    http = ports or free_ports(2)
    side = free_ports(2)
    args.dir.mkdir(parents=True, exist_ok=True)
    engines: list[EngineProcess] = []
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        engines.append(
            start_engine("p0", args.dir, args.model, http[0], side[0], "0", args.vllm_python)
        )
        engines.append(
            start_engine("d0", args.dir, args.model, http[1], side[1], "1", args.vllm_python)
        )
        waited = wait_healthy(engines, args.timeout)
        fleet = args.dir / "fleet.json"
        fleet.write_text(json.dumps(fleet_document(engines[0], engines[1]), indent=2) + "\n")
        for e in engines:
            print(
                f"{e.name} ready at {e.url} (NIXL side channel {e.side_channel_port}; "
                f"{len(e.quieted_threads)} busy-polling thread(s) lowered to nice 19)"
            )
        print(f"ready after {waited:.1f} s; fleet: {fleet}; Ctrl-C stops", flush=True)
        while not stop and all(e.process.poll() is None for e in engines):
            time.sleep(0.5)
        for e in engines:
            if e.process.poll() is not None:
                print(f"{e.name} exited with {e.process.returncode}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    except EngineStartError as exc:
        print(f"vllm_engines.py: {exc}", file=sys.stderr)
        return 1
    finally:
        for e in engines:
            stop_engine(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
