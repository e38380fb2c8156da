"""``steps.json``: what each step of a qualification run consumed and produced, by content hash.

A step is *done* when the ledger holds its key (its command and the SHA-256 of every input)
and every output still hashes as recorded; a later run skips it. A step that measures the fleet
and finished with a failing verdict (the benchmark) is done too: its record keeps the verdict,
so a rerun says the fleet did not qualify without measuring it again. Files hash as their bytes,
directories as the sorted list of their files' relative paths and hashes, so a workload or a
benchmark directory is one hash.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LEDGER_NAME", "Ledger", "StepRecord", "content_sha256", "step_key"]

LEDGER_NAME = "steps.json"
LEDGER_SCHEMA = "narwhal.qualify-steps/v1"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_sha256(path: Path) -> str | None:
    """The SHA-256 of a file, or of a directory's files (relative path and hash each, sorted);
    None when the path does not exist."""
    if path.is_file():
        return _file_sha256(path)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{_file_sha256(f)}\n".encode())
    return h.hexdigest()


def step_key(name: str, argv: list[str], inputs: dict[str, str | None]) -> str:
    body = json.dumps({"step": name, "argv": argv, "inputs": inputs}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass
class StepRecord:
    key: str
    argv: list[str]
    inputs: dict[str, str | None]
    outputs: dict[str, str | None]
    started_at: str
    duration_s: float
    exit_code: int
    # The fleet's failing verdict, one line, when the step finished its measurement and the
    # fleet failed it (exit_code is then the tool's non-zero status); None otherwise.
    failed_verdict: str | None = None


@dataclass
class Ledger:
    path: Path
    steps: dict[str, StepRecord] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def open(cls, run_dir: Path) -> Ledger:
        path = run_dir / LEDGER_NAME
        ledger = cls(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return ledger  # no ledger (or a torn one): every step runs
        if not isinstance(raw, dict) or raw.get("schema") != LEDGER_SCHEMA:
            return ledger
        for name, rec in (raw.get("steps") or {}).items():
            try:
                ledger.steps[name] = StepRecord(**rec)
            except TypeError:
                continue
        ledger.runs = list(raw.get("runs") or [])
        return ledger

    def done(self, name: str, key: str, outputs: dict[str, Path]) -> StepRecord | None:
        """The step's record when it ran with this key and its outputs are as it left them."""
        rec = self.steps.get(name)
        if rec is None or rec.key != key:
            return None
        if rec.exit_code != 0 and rec.failed_verdict is None:
            return None
        for rel, path in outputs.items():
            if rec.outputs.get(rel) is None or content_sha256(path) != rec.outputs[rel]:
                return None
        return rec

    def record(self, name: str, rec: StepRecord) -> None:
        self.steps[name] = rec
        self.save()

    def forget(self, name: str) -> None:
        if self.steps.pop(name, None) is not None:
            self.save()

    def save(self) -> None:
        doc = {
            "schema": LEDGER_SCHEMA,
            "steps": {name: asdict(rec) for name, rec in self.steps.items()},
            "runs": self.runs,
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
