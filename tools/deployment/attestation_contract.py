"""Finalize a fleet contract from its running engines' attestations and live facts.

    attestation_contract.py finalize-fleet --fleet FLEET [--out FILE] [--live LIVE.json]

For every engine of the fleet it reads the attestation at ``attestation_url`` (a sidecar, or
a simulated engine's own /attestation) and the engine's live facts (captured now from its URL,
or taken from a ``launch_plan.py capture`` file with --live). It checks that the engines agree
with each other and with the fleet's model identity, then fills what only the running fleet
knows: the model's config and shard-manifest hashes (where null), each engine's generation and
its NIXL side channel. The result is written (default: over --fleet) with ``<out>.sha256``
beside it, holding the fleet's identity: the SHA-256 of its canonical JSON, the hash
``narwhal-serve`` logs and ``narwhal-check`` reports against.

Exit status: 0 written; 1 engines disagree or cannot be read (one line each, nothing
written); 2 bad arguments or an unreadable fleet or live file.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root for `tools` (tools/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from narwhal.contract import ContractError, EngineSpec, FleetContract, load_fleet, parse_fleet
from narwhal.contract.flags import positive
from tools.deployment._files import write_atomic
from tools.deployment._live import Declared, LiveContract, LiveEngine, capture_engine, load_live

__all__ = ["Attestation", "disagreements", "finalize", "main"]

PROG = "attestation_contract.py"


class UsageError(Exception):
    pass


class Attestation(BaseModel):
    """The fields finalize-fleet reads; the sidecar's and the simulator's share these names."""

    model_config = ConfigDict(extra="allow")
    schema_version: str = Field(alias="schema")
    source: str | None = None
    state: str | None = None
    engine_id: str | None = None
    model_id: str | None = None
    model_revision: str | None = None
    config_sha256: str | None = None
    shard_manifest_sha256: str | None = None
    tp: int | None = None
    gpu_arch: str | None = None
    kv_connector: str | None = None
    kv_role: str | None = None
    nixl: dict[str, Any] | None = None
    image_digest: str | None = None
    generation: str | None = None
    pid: int | None = None
    engine_alive: bool | None = None
    drift: list[dict[str, Any]] = Field(default_factory=list)


@dataclass
class EngineFacts:
    spec: EngineSpec
    attestation: Attestation
    live: LiveEngine


def _fetch_attestation(
    client: httpx.Client, spec: EngineSpec
) -> tuple[Attestation | None, str | None]:
    if spec.attestation_url is None:
        return None, f"{spec.id}: the fleet gives no attestation_url"
    try:
        resp = client.get(spec.attestation_url)
    except httpx.HTTPError as exc:
        return None, f"{spec.id}: attestation unreachable at {spec.attestation_url}: {exc}"
    if resp.status_code == 503:
        return (
            None,
            f"{spec.id}: attestation not ready yet at {spec.attestation_url} (still hashing)",
        )
    if resp.status_code != 200:
        return (
            None,
            f"{spec.id}: attestation at {spec.attestation_url} answered HTTP {resp.status_code}",
        )
    try:
        return Attestation.model_validate(resp.json()), None
    except (ValueError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        return (
            None,
            f"{spec.id}: attestation at {spec.attestation_url} is not an attestation: {first}",
        )


def collect(
    fleet: FleetContract, live_doc: LiveContract | None, live_source: str, timeout_s: float
) -> tuple[list[EngineFacts], list[str]]:
    facts: list[EngineFacts] = []
    problems: list[str] = []
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for spec in fleet.engines:
            att, err = _fetch_attestation(client, spec)
            if err:
                problems.append(err)
            if live_doc is not None:
                live = live_doc.engine(spec.id)
                if live is None:
                    problems.append(f"{spec.id}: not in the live contract {live_source}")
                elif live.url.rstrip("/") != spec.url.rstrip("/"):
                    # Captured from another deployment (or a hand-edited file): its facts are
                    # not this engine's.
                    problems.append(
                        f"{spec.id}: the live contract {live_source} captured it at "
                        f"{live.url!r}; the fleet says {spec.url}"
                    )
            else:
                declared = Declared(
                    nixl_host=spec.nixl.host,
                    nixl_port=spec.nixl.port,
                    kv_connector=att.kv_connector if att else None,
                    kv_role=att.kv_role if att else None,
                )
                live, found = capture_engine(client, spec.id, spec.url, declared)
                problems += found
            if att is not None and live is not None:
                facts.append(EngineFacts(spec, att, live))
    return facts, problems


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] + "…" if isinstance(value, str) and len(text) > 16 else text


def disagreements(fleet: FleetContract, facts: list[EngineFacts]) -> list[str]:
    """One line per way an engine disagrees with the fleet or with another engine."""
    out: list[str] = []
    model, eng = fleet.model, fleet.engine
    for f in facts:
        a, live, e = f.attestation, f.live, f.spec.id

        def want(
            what: str, got: Any, expected: Any, source: str = "attestation", e: str = e
        ) -> None:
            if got != expected:
                out.append(f"{e}: {source} {what} is {got!r}; the fleet has {expected!r}")

        if a.state not in (None, "ready"):
            out.append(f"{e}: attestation state is {a.state!r}, not ready")
        if a.engine_id is not None and a.engine_id != e:
            out.append(
                f"{e}: the attestation at {f.spec.attestation_url} is engine {a.engine_id!r}'s"
            )
        want("model_id", a.model_id, model.id)
        want("model_revision", a.model_revision, model.revision)
        for key in ("config_sha256", "shard_manifest_sha256"):
            got = getattr(a, key)
            if got is None:
                out.append(f"{e}: the attestation reports no {key}")
            elif getattr(model, key) is not None:
                want(key, got, getattr(model, key))
        want("tp", a.tp, eng.tp)
        want("gpu_arch", a.gpu_arch, eng.gpu_arch)
        if a.kv_connector is not None:
            want("kv_connector", a.kv_connector, eng.kv_connector)
        if a.kv_role is not None:
            want("kv_role", a.kv_role, eng.kv_role)
        fleet_nixl = {"host": f.spec.nixl.host, "port": f.spec.nixl.port}
        if a.nixl is not None and {k: a.nixl.get(k) for k in fleet_nixl} != fleet_nixl:
            want(
                "NIXL side channel",
                f"{a.nixl.get('host')}:{a.nixl.get('port')}",
                f"{f.spec.nixl.host}:{f.spec.nixl.port}",
            )
        if a.drift:
            d = a.drift[0]
            more = f" (and {len(a.drift) - 1} more)" if len(a.drift) > 1 else ""
            out.append(
                f"{e}: the checkpoint drifted since it was attested: {d.get('path')} "
                f"{d.get('kind')} {_short(d.get('expected'))} -> {_short(d.get('actual'))}{more}"
            )
        if a.generation is None:
            out.append(
                f"{e}: the attestation names no engine generation (give the sidecar "
                "--engine-pid, --engine-pidfile or --generation)"
            )
        if a.engine_alive is False:
            out.append(f"{e}: the sidecar's engine process (pid {a.pid}) is not running")
        # Live facts: what the engine itself serves right now.
        want("served model", live.model_id, model.id, "live")
        if live.max_model_len is not None:
            want("max_model_len", live.max_model_len, model.max_model_len, "live")
        for key in ("tp", "gpu_arch", "kv_connector", "kv_role", "kv_buffer_device"):
            value = getattr(live, key)
            if value is not None:
                want(key, value, getattr(eng, key), "live")
        if live.nixl is not None:
            got = f"{live.nixl.get('host')}:{live.nixl.get('port')}"
            want("NIXL side channel", got, f"{f.spec.nixl.host}:{f.spec.nixl.port}", "live")
            if live.nixl.get("listening") is False:
                out.append(f"{e}: nothing listens on its NIXL side channel {got}")
        if live.kv_cache is None:
            out.append(f"{e}: no KV cache geometry in the live facts")
        if a.pid is not None and live.pid is not None and a.pid != live.pid:
            out.append(
                f"{e}: the attestation describes pid {a.pid} but the engine at {f.spec.url} is "
                f"pid {live.pid} (sidecar watching the wrong process, or a restart)"
            )
    out += _cross_engine(facts)
    return out


def _cross_engine(facts: list[EngineFacts]) -> list[str]:
    """Every engine must match the first engine that reports each value."""
    out: list[str] = []

    def engine_reported(f: EngineFacts, key: str) -> Any:
        # Only when a sidecar attests the files: then the engine's own report (the simulator
        # has one, vLLM has none) is a second, independent witness worth comparing.
        if f.attestation.source != "sidecar" or f.live.engine_attestation is None:
            return None
        return f.live.engine_attestation.get(key)

    def cache(f: EngineFacts, key: str) -> Any:
        return (f.live.kv_cache or {}).get(key)

    checks: list[tuple[str, Any]] = [
        ("config_sha256", lambda f: f.attestation.config_sha256),
        ("shard_manifest_sha256", lambda f: f.attestation.shard_manifest_sha256),
        ("image_digest", lambda f: f.attestation.image_digest),
        ("engine-reported config_sha256", lambda f: engine_reported(f, "config_sha256")),
        (
            "engine-reported shard_manifest_sha256",
            lambda f: engine_reported(f, "shard_manifest_sha256"),
        ),
        ("KV block_size", lambda f: cache(f, "block_size")),
        ("KV block_bytes", lambda f: cache(f, "block_bytes")),
        ("engine version", lambda f: f.live.version),
    ]
    for what, get in checks:
        first: tuple[str, Any] | None = None
        for f in facts:
            value = get(f)
            if value is None:
                continue
            if first is None:
                first = (f.spec.id, value)
            elif value != first[1]:
                out.append(
                    f"{f.spec.id}: {what} {_short(value)} differs from {first[0]}'s "
                    f"{_short(first[1])}"
                )
    return out


def finalize(raw: dict[str, Any], facts: list[EngineFacts]) -> dict[str, Any]:
    """The fleet document with the running fleet's facts filled in."""
    doc = copy.deepcopy(raw)
    first = facts[0].attestation
    for key in ("config_sha256", "shard_manifest_sha256"):
        if doc["model"].get(key) is None:
            doc["model"][key] = getattr(first, key)
    by_id = {f.spec.id: f for f in facts}
    for engine in doc["engines"]:
        f = by_id[engine["id"]]
        engine["generation"] = f.attestation.generation
        if f.live.nixl is not None:
            engine["nixl"] = {"host": f.live.nixl["host"], "port": int(f.live.nixl["port"])}
    return doc


def cmd_finalize(args: argparse.Namespace) -> int:
    loaded = load_fleet(args.fleet)
    out = Path(args.out or args.fleet)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out}: a directory; name the file to write")
    live_doc = load_live(args.live, f"--live {args.live}") if args.live else None
    facts, problems = collect(loaded.contract, live_doc, args.live or "", args.timeout)
    if not problems:
        problems = disagreements(loaded.contract, facts)
    if problems:
        for line in problems:
            print(f"{PROG}: {line}", file=sys.stderr)
        print(f"{PROG}: {len(problems)} problem(s); nothing written", file=sys.stderr)
        return 1
    doc = finalize(loaded.raw, facts)
    try:
        final = parse_fleet(doc, str(out), path=out)
    except ContractError as exc:
        # Should not happen: every filled value was checked. Say so rather than write it.
        print(
            f"{PROG}: the finalized fleet does not validate: {exc}; nothing written",
            file=sys.stderr,
        )
        return 1
    write_atomic(out, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    write_atomic(out.with_name(out.name + ".sha256"), final.sha256 + "\n")
    for f in facts:
        nixl = f"{f.spec.nixl.host}:{f.spec.nixl.port}"
        print(f"{f.spec.id}: generation {f.attestation.generation} nixl {nixl}")
    print(f"model: config_sha256 {doc['model']['config_sha256']}")
    print(f"model: shard_manifest_sha256 {doc['model']['shard_manifest_sha256']}")
    print(f"wrote {out} and {out.name}.sha256")
    print(f"sha256 {final.sha256}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("finalize-fleet", help="fill and check a fleet from its running engines")
    f.add_argument("--fleet", required=True, help="fleet contract JSON to finalize")
    f.add_argument("--out", help="where to write the finalized fleet (default: over --fleet)")
    f.add_argument("--live", help="live contract from `launch_plan.py capture` (default: read now)")
    f.add_argument("--timeout", type=positive(float), default=10.0, help="per-request bound (s)")
    f.set_defaults(func=cmd_finalize)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ContractError, UsageError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
