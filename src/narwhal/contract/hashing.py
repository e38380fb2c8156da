"""Canonical JSON and its SHA-256: how a fleet (and any other narwhal document) is named.

A fleet's identity is the hash of the canonical form of the parsed JSON document as written,
not of a pydantic dump: adding a defaulted field to the code must never change the hash of a
fleet that was already qualified. Key order and whitespace in the file do not matter; values
do (``10`` and ``10.0`` are different documents, as JSON parsers see them).

Pure: takes values, returns bytes or a hex string. Hashing a file is the loader's job.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["canonical_json", "sha256_hex"]


def canonical_json(obj: object) -> bytes:
    """Sorted keys, compact separators, UTF-8, floats as Python's repr prints them.

    NaN and Infinity are refused: they are not JSON, and a document containing them has no
    canonical form another implementation would agree on.
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256_hex(obj: object) -> str:
    """Lowercase hex SHA-256 of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()
