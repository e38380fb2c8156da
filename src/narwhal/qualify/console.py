"""What narwhal-qualify shows on the console about a step's outputs, read from the files the step
wrote (the step's own console output stays in its log)."""

from __future__ import annotations

from pathlib import Path

from narwhal.contract import ContractError, read_json_document
from narwhal.profiles.store import parse_profile_store
from narwhal.profiles.table import profile_table
from narwhal.qualify.layout import PROFILE_STORE

__all__ = ["profile_lines", "profile_table"]


def profile_lines(run_dir: Path) -> list[str]:
    """The profile step's console lines: its store's table and SHA-256."""
    path = run_dir / PROFILE_STORE
    try:
        raw = read_json_document(path)
        store, digest = parse_profile_store(raw, str(path))
    except ContractError as exc:
        return [f"no profile table: {exc}"]
    return [*profile_table(store), f"profile store: {PROFILE_STORE}  sha256 {digest}"]
