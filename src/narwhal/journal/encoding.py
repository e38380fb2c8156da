"""Journal records: their types, the keys a caller may not set, the scrubbing of secret-named
keys, and serialisation to one JSON line. Runs in the caller's thread (the event loop).

The journal knows the record *types*, not their fields: callers pass metadata as keyword
arguments. As a defence against a careless caller it drops any key that names request content
or credentials (``prompt``, ``messages``, ``text``, ``content``, ``authorization``,
``api_key``), at any depth, and warns once per key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Final, TypeVar

import orjson

log = logging.getLogger("narwhal.journal")

ROUTER_START: Final = "router.start"
REQUEST_START: Final = "request.start"
REQUEST_END: Final = "request.end"
ROLE_FLIP: Final = "role.flip"
ROUTER_STOP: Final = "router.stop"
RECORD_TYPES: Final = frozenset({ROUTER_START, REQUEST_START, REQUEST_END, ROLE_FLIP, ROUTER_STOP})

#: Keys never written, at any depth (matched case-insensitively, ``-`` read as ``_``; any key
#: ending in ``_api_key``, such as an ``X-Api-Key`` header, counts as ``api_key``).
SECRET_KEYS: Final = frozenset(
    {"prompt", "messages", "text", "content", "authorization", "api_key"}
)

#: Keys the journal sets itself, per record kind; a caller passing one is a bug.
RESERVED: Final = frozenset({"type", "ts"})
REQUEST_RESERVED: Final = RESERVED | {"id"}
END_RESERVED: Final = REQUEST_RESERVED | {"outcome"}

_DUMPS_OPTIONS: Final = orjson.OPT_APPEND_NEWLINE
#: How every record's line begins (``type`` is its first key, the line compact JSON); then
#: comes the type's name and ``","ts":``.
RECORD_HEAD: Final = b'{"type":"'
_AFTER_TYPE: Final = b'","ts":'
# Types written as they are, with nothing inside to scrub (checked by exact type: fast).
_SCALARS: Final = frozenset({str, int, float, bool, type(None)})
# Key -> whether it is secret. Keys repeat (the router sends the same few dozen), so this stays
# small; it is capped in case a caller uses data as keys.
_SECRET_CACHE: dict[str, bool] = {}
_SECRET_CACHE_MAX: Final = 4096

_K = TypeVar("_K")


class RecordEncoder:
    """Builds and serialises one journal's records, counting the secret-named fields it drops
    and warning once per key name (and once per record type with unserialisable fields).

    Not thread-safe: the journal calls it under its lock.
    """

    def __init__(
        self, wall_clock: Callable[[], float], stamp: Mapping[str, object] | None = None
    ) -> None:
        self._wall_clock = wall_clock
        # Fields every record carries after type and ts (a replica's id), scrubbed once here.
        self._stamp = _scrub_mapping(stamp, set()) if stamp else None
        self.secret_fields_dropped = 0
        self._warned: set[str] = set()

    def encode(
        self,
        record_type: str,
        head: Mapping[str, object],
        fields: Mapping[str, object],
        reserved: frozenset[str],
    ) -> bytes:
        """One record as the line to append: ``type``, ``ts`` (wall clock), then the journal's
        own ``head`` fields, then the caller's ``fields``, both scrubbed.

        Raises ``ValueError`` if ``fields`` sets a key in ``reserved`` (a bug in the caller).
        """
        clash = reserved.intersection(fields)
        if clash:
            raise ValueError(f"journal fields {sorted(clash)} are reserved")
        dropped: set[str] = set()
        record: dict[str, object] = {"type": record_type, "ts": self._wall_clock()}
        if self._stamp is not None:
            record.update(self._stamp)
        record.update(_scrub_mapping(head, dropped))
        record.update(_scrub_mapping(fields, dropped))
        if dropped:
            self.secret_fields_dropped += len(dropped)
            for key in sorted(dropped):
                self._warn_once(
                    f"secret:{key}",
                    "journal: dropped field %r from a %s record: the journal never stores "
                    "request content or credentials",
                    key,
                    record_type,
                )
        data, bad = _dumps(record)
        if bad:
            self._warn_once(
                f"unserializable:{record_type}",
                "journal: fields %s of a %s record are not JSON-serialisable; wrote their repr",
                bad,
                record_type,
            )
        return data

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def could_begin_record(fragment: bytes) -> bool:
    """Whether ``fragment`` could be the beginning of a record's line as ``RecordEncoder``
    writes it (``{"type":"NAME","ts":...``), cut off anywhere: what a process killed while
    writing a record leaves. A JSON document written by anything else (a fleet file, a profile
    store) begins otherwise."""
    if len(fragment) <= len(RECORD_HEAD):
        return RECORD_HEAD.startswith(fragment)
    if not fragment.startswith(RECORD_HEAD):
        return False
    name, quote, rest = fragment[len(RECORD_HEAD) :].partition(b'"')
    if not quote:
        return True  # cut inside the type's name
    after = quote + rest
    if not name:
        return False
    if len(after) <= len(_AFTER_TYPE):
        return _AFTER_TYPE.startswith(after)
    return after.startswith(_AFTER_TYPE)


def _is_secret(key: str) -> bool:
    hit = _SECRET_CACHE.get(key)
    if hit is None:
        normal = key.lower().replace("-", "_")
        hit = normal in SECRET_KEYS or normal.endswith("_api_key")
        if len(_SECRET_CACHE) < _SECRET_CACHE_MAX:
            _SECRET_CACHE[key] = hit
    return hit


def _scrub_mapping(value: Mapping[_K, object], dropped: set[str]) -> dict[_K, object]:
    out: dict[_K, object] = {}
    for key, item in value.items():
        name: object = key  # keys may be anything; only exact strings can be secret
        if type(name) is str and _is_secret(name):
            dropped.add(name)
            continue
        out[key] = item if type(item) in _SCALARS else _scrub(item, dropped)
    return out


def _scrub(value: object, dropped: set[str]) -> object:
    """A copy of ``value`` without secret-named keys; the names dropped go to ``dropped``.

    Copying also snapshots the caller's dicts and lists, so a caller that mutates them after
    the call cannot change what is written. Dataclasses and pydantic models are opened up
    here (orjson would otherwise serialise them whole, past the filter). This runs on the
    event loop for every record, hence the exact-type fast paths.
    """
    if type(value) in _SCALARS:
        return value
    if isinstance(value, Mapping):
        return _scrub_mapping(value, dropped)
    if isinstance(value, list | tuple | set | frozenset):
        return [item if type(item) in _SCALARS else _scrub(item, dropped) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _scrub(dataclasses.asdict(value), dropped)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and not isinstance(value, type):
        with contextlib.suppress(Exception):
            return _scrub(model_dump(mode="json"), dropped)
    return value


def _default(obj: object) -> object:
    """orjson fallback: paths as strings, anything else as ``str(obj)``: a record is never
    lost because one field had an unexpected type."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, bytes | bytearray):
        return f"<{len(obj)} bytes>"
    return str(obj)


def _safe_repr(value: object) -> str:
    try:
        return repr(value)[:200]
    except Exception:
        return f"<unrepresentable {type(value).__name__}>"


def _dumps(record: dict[str, object]) -> tuple[bytes, list[str]]:
    """Serialise one record; returns the line and the keys that could not be serialised.

    orjson refuses a few values even with ``default`` (integers beyond 64 bits, non-string
    keys, cycles). Rather than lose the record (an end, say), such fields are replaced by a
    short repr and listed under ``unserializable``.
    """
    try:
        return orjson.dumps(record, default=_default, option=_DUMPS_OPTIONS), []
    except TypeError:
        pass
    bad: list[str] = []
    for key, value in list(record.items()):
        try:
            orjson.dumps(value, default=_default)
        except TypeError:
            record[key] = _safe_repr(value)
            bad.append(key)
    record["unserializable"] = bad
    return orjson.dumps(record, default=_default, option=_DUMPS_OPTIONS), bad
