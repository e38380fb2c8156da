"""Reading a fleet contract and explaining, in one line, why one is wrong.

``load_fleet`` is the only function in ``narwhal.contract`` that touches a file; it reads the
bytes and hands the parsed document to ``parse_fleet``, which is pure and which tests and
other code call directly with a dict. Every failure is a ``ContractError`` whose ``str`` is a
single line ``<source>: <path>: <reason>`` that a CLI prints before exiting with status 2:
operators read these, so they name the document position and say what was expected instead
of dumping a pydantic report or a traceback.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError

from narwhal.contract.hashing import sha256_hex
from narwhal.contract.models import (
    CONSISTENCY_ERROR,
    CUSTOM_ERROR,
    PAIRS_TYPE_ERROR,
    PAIRS_UNION_TAGS,
    ConsistencyIssue,
    FleetContract,
    Loc,
    format_loc,
)

__all__ = [
    "ContractError",
    "LoadedFleet",
    "load_fleet",
    "parse_fleet",
    "read_json_document",
    "validate_document",
    "validation_reasons",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

_PAIRS_EXPECTED = "expected 'all' or a list of transfer pairs"
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def _one_line(text: str) -> str:
    # Keys and values come from the file; a newline in one must not split the message.
    return _CONTROL_CHARS.sub(lambda m: repr(m.group())[1:-1], text)


class ContractError(Exception):
    """A fleet document that cannot be used; ``str()`` is one line for a CLI to print.

    ``path`` is the document position of the first problem (``""`` for the document as a
    whole); ``reason`` says what is wrong with it and, when there are several problems, ends
    with ``(and N more problems)``. ``problems`` holds every ``(path, reason)`` found.
    """

    def __init__(
        self,
        source: str,
        path: str,
        reason: str,
        problems: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.source = _one_line(source)
        self.path = _one_line(path)
        self.reason = _one_line(reason)
        self.problems: tuple[tuple[str, str], ...] = tuple(
            (_one_line(p), _one_line(r)) for p, r in problems
        ) or ((self.path, self.reason),)
        super().__init__(source, path, reason)

    def __str__(self) -> str:
        if self.path:
            return f"{self.source}: {self.path}: {self.reason}"
        return f"{self.source}: {self.reason}"


ENGINE_API_KEY_FIELD = "engine.api_key_file"


@dataclass(frozen=True)
class LoadedFleet:
    """A validated contract with its identity.

    ``sha256`` is the hash of the canonical form of ``raw``, the document as written, so it
    does not move when the code gains a defaulted field. ``raw`` is a private copy; do not
    mutate it.
    """

    contract: FleetContract
    sha256: str
    path: Path
    raw: dict[str, Any]
    # The engines' API key read from ``engine.api_key_file`` (by ``load_fleet`` only; None
    # when the fleet names no key file). Kept out of repr so a logged LoadedFleet cannot show
    # it.
    engine_api_key: str | None = field(default=None, repr=False, compare=False)

    @property
    def api_key_path(self) -> Path | None:
        """The engines' API key file (``engine.api_key_file``), relative to the fleet file's
        directory; None when the fleet names none."""
        key_file = self.contract.engine.api_key_file
        if key_file is None:
            return None
        try:
            return self.path.parent / Path(key_file).expanduser()
        except RuntimeError:  # ~user of a user this host does not know
            raise ContractError(
                os.fspath(self.path),
                ENGINE_API_KEY_FIELD,
                f"names the home of a user this host does not know (got {key_file!r})",
            ) from None

    @property
    def profile_store_path(self) -> str | None:
        """The store the fleet pins (``profile_store.path``), relative to the fleet file's
        directory as ``engine.api_key_file`` is (a qualified fleet and its store are written
        side by side); None when it pins none."""
        ref = self.contract.profile_store
        if ref is None:
            return None
        try:
            return os.fspath(self.path.parent / Path(ref.path).expanduser())
        except RuntimeError:  # ~user of a user this host does not know
            raise ContractError(
                os.fspath(self.path),
                "profile_store.path",
                f"names the home of a user this host does not know (got {ref.path!r})",
            ) from None


def load_fleet(path: str | os.PathLike[str]) -> LoadedFleet:
    """Read, parse and validate the fleet contract at ``path``, and read the engine API key
    file it names; ContractError on any problem."""
    source = os.fspath(path)
    raw = _parse_json(_read_file(path, source), source)
    loaded = parse_fleet(raw, source, path=Path(path))
    key = _read_api_key(loaded, source)
    return loaded if key is None else replace(loaded, engine_api_key=key)


def _read_api_key(loaded: LoadedFleet, source: str) -> str | None:
    """The key in the fleet's ``engine.api_key_file`` (``api_key_path``), surrounding
    whitespace removed; None when the fleet names no key file. The messages name the fleet as
    ``source`` and the key file, never its content."""
    try:
        resolved = loaded.api_key_path
    except ContractError as exc:  # named as given (``loaded.path`` is ``source`` normalized)
        raise ContractError(source, exc.path, exc.reason) from None
    if resolved is None:
        return None
    try:
        text = resolved.read_text(encoding="utf-8")
    except OSError as exc:
        reason = f"cannot read {str(resolved)!r}: {exc.strerror or type(exc).__name__}"
        raise ContractError(source, ENGINE_API_KEY_FIELD, reason) from None
    except UnicodeDecodeError:
        raise ContractError(
            source, ENGINE_API_KEY_FIELD, f"{str(resolved)!r} is not UTF-8"
        ) from None
    key = text.strip()
    if not key:
        raise ContractError(source, ENGINE_API_KEY_FIELD, f"{str(resolved)!r} is empty")
    if _CONTROL_CHARS.search(key) or not key.isascii():
        # It goes into a header: one line of ASCII, no line break or control byte.
        reason = f"{str(resolved)!r} must hold one key: one line of ASCII"
        raise ContractError(source, ENGINE_API_KEY_FIELD, reason)
    return key


def parse_fleet(raw: object, source: str = "<fleet>", *, path: Path | None = None) -> LoadedFleet:
    """Validate an already-parsed fleet document. Pure.

    ``source`` names the document in error messages; ``path`` (default ``Path(source)``) is
    recorded in the result.
    """
    if not isinstance(raw, dict):
        raise ContractError(source, "", f"top level must be a JSON object (got {_describe(raw)})")
    # Our own copy: the hash must keep describing the document even if the caller's dict
    # changes later.
    raw = copy.deepcopy(raw)
    try:
        contract = FleetContract.model_validate(raw)
    except ValidationError as exc:
        problems = _problems(raw, exc.errors())
        raise _error_from(source, problems) from None
    try:
        digest = sha256_hex(raw)
    except (TypeError, ValueError) as exc:
        # Only reachable from code handing us non-JSON values in places the models ignore.
        raise ContractError(source, "", f"not a JSON document: {exc}") from None
    return LoadedFleet(
        contract=contract,
        sha256=digest,
        path=path if path is not None else Path(source),
        raw=raw,
    )


def read_json_document(path: str | os.PathLike[str]) -> object:
    """Read a JSON file with the fleet loader's strictness (UTF-8, no duplicate keys, no NaN);
    every problem is a one-line ContractError naming the file."""
    source = os.fspath(path)
    return _parse_json(_read_file(path, source), source)


def _read_file(path: str | os.PathLike[str], source: str) -> bytes:
    """A file's bytes, from a regular file or a pipe (a shell's process substitution,
    ``--fleet <(jq ... fleet.json)``); a device such as /dev/zero, which has no end, is
    refused."""
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ContractError(source, "", "cannot read: not a regular file or a pipe")
        return Path(path).read_bytes()
    except OSError as exc:
        raise ContractError(source, "", f"cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL in the path
        raise ContractError(source, "", f"cannot read: {exc}") from None


def validate_document(
    raw: object, model: type[ModelT], source: str, strict: bool | None = None
) -> ModelT:
    """Validate any Narwhal file format against its pydantic model, with one-line errors.
    ``strict``: no coercion (``true`` is no number, ``"5"`` no integer) where the model's own
    configuration allows it."""
    if not isinstance(raw, dict):
        raise ContractError(source, "", f"top level must be a JSON object (got {_describe(raw)})")
    try:
        return model.model_validate(raw, strict=strict)
    except ValidationError as exc:
        raise _error_from(source, _problems(raw, exc.errors())) from None


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _NonFiniteError(Exception):
    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.token = token


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys without a word; in a contract the first
    # would be silently ignored and the hash would not show it, so refuse.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _reject_constant(token: str) -> NoReturn:
    raise _NonFiniteError(token)


def _finite_float(token: str) -> float:
    # 1e999 is valid JSON that Python reads as infinity: as out of range as the spelling
    # Infinity (a budget or a latency of inf disables every check downstream, and no hash of
    # the document can be written).
    value = float(token)
    if not math.isfinite(value):
        raise _NonFiniteError(token)
    return value


def _parse_json(data: bytes, source: str) -> object:
    try:
        # A byte order mark before the document (what some editors save) is read past, as
        # JSON allows and vLLM's reader does; the document's hash is of its content.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ContractError(source, "", f"not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as exc:
        raise ContractError(
            source, "", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except _DuplicateKeyError as exc:
        raise ContractError(source, "", f"invalid JSON: duplicate key {exc.key!r}") from None
    except _NonFiniteError as exc:
        raise ContractError(
            source, "", f"invalid JSON: {exc.token[:40]} is not a finite number"
        ) from None
    except RecursionError:
        raise ContractError(source, "", "invalid JSON: nested too deeply") from None
    except ValueError:
        # Python's bound on the digits of an integer it converts (4,300): no field of any
        # Narwhal file needs a number that long.
        raise ContractError(source, "", "invalid JSON: a number too long to read") from None


def _error_from(source: str, problems: list[tuple[Loc, str]]) -> ContractError:
    formatted = [(format_loc(loc), reason) for loc, reason in problems]
    path, reason = formatted[0]
    more = len(formatted) - 1
    if more:
        reason += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ContractError(source, path, reason, formatted)


def _problems(raw: Mapping[str, Any], errors: Iterable[Mapping[str, Any]]) -> list[tuple[Loc, str]]:
    """Pydantic errors as (document path, reason), in document order."""
    found: list[tuple[Loc, str]] = []
    for err in errors:
        if err["type"] == CONSISTENCY_ERROR:
            issues: Sequence[ConsistencyIssue] = err["ctx"]["issues"]
            found.extend((issue.loc, issue.reason) for issue in issues)
            continue
        loc, tag = _strip_union_tag(tuple(err["loc"]))
        if tag == "all" and err["type"] == "literal_error":
            reason = f"{_PAIRS_EXPECTED} (got {_describe(err.get('input'))})"
        else:
            reason = _reason(err)
        found.append((loc, reason))
    # Python's sort is stable: equal positions keep pydantic's (field definition) order. A
    # wrong or missing schema leads wherever its key stands: a file of another format (a fleet
    # given for a check report) is named so, not by the first of its fields this one lacks.
    return sorted(
        found, key=lambda item: (item[0] != ("schema",), _document_position(raw, item[0]))
    )


def _strip_union_tag(loc: Loc) -> tuple[Loc, str | None]:
    # kv_transfer_pairs is a tagged union; pydantic names the branch in the error path
    # ("kv_transfer_pairs.pairs[0].decode"), which is not a place in the document.
    if len(loc) >= 2 and loc[0] == "kv_transfer_pairs" and loc[1] in PAIRS_UNION_TAGS:
        return (loc[0], *loc[2:]), str(loc[1])
    return loc, None


def _document_position(raw: object, loc: Loc) -> tuple[int, ...]:
    """Sort key placing ``loc`` where it appears in the document.

    Keys absent from the document (missing fields) sort after the keys that are present in
    the same object.
    """
    key: list[int] = []
    node: object = raw
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            key.append(list(node).index(part))
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            key.append(part)
            node = node[part]
        else:
            key.append(len(node) if isinstance(node, dict | list) else 0)
            node = None
    return tuple(key)


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}

_BOUND_WORDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "greater than or equal to"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "less than or equal to"),
}


def validation_reasons(exc: ValidationError) -> list[tuple[Loc, str]]:
    """A pydantic model's errors as (field path, reason), worded as the fleet loader words
    them: for tools that validate values that come from flags rather than a document."""
    return [(tuple(err["loc"]), _reason(err)) for err in exc.errors()]


def _reason(err: Mapping[str, Any]) -> str:
    kind: str = err["type"]
    ctx: Mapping[str, Any] = err.get("ctx") or {}
    got = _describe(err.get("input"))
    if kind == CUSTOM_ERROR:
        return str(ctx.get("message", err["msg"]))
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == PAIRS_TYPE_ERROR:
        return f"{_PAIRS_EXPECTED} (got {got})"
    if kind == "literal_error":
        # ctx["expected"] is pydantic's rendering, e.g. "'prefill' or 'decode'".
        values = re.findall(r"'([^']*)'", str(ctx.get("expected", ""))) or [
            str(ctx.get("expected", "?"))
        ]
        if len(values) == 1:
            return f"must be {values[0]} (got {got})"
        return f"{got} is not one of {', '.join(values)}"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]} (got {got})"
    if kind in _BOUND_WORDS:
        ctx_key, words = _BOUND_WORDS[kind]
        return f"must be {words} {_bound(ctx.get(ctx_key))} (got {got})"
    if kind == "finite_number":
        return f"must be a finite number (got {got})"
    if kind in ("string_too_short", "too_short"):
        minimum = ctx.get("min_length", 1)
        if minimum == 1:
            return "must not be empty"
        return f"must have at least {minimum} items (got {ctx.get('actual_length')})"
    if kind in ("string_too_long", "too_long"):
        return f"must have at most {ctx.get('max_length')} items (got {ctx.get('actual_length')})"
    # Anything not anticipated above: pydantic's own words, minus its "Value error, " prefix.
    msg = str(err.get("msg", kind)).removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def _bound(value: object) -> str:
    # Float fields hand pydantic a float limit; "greater than 0" reads better than "0.0".
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def _describe(value: object) -> str:
    """A short, one-line rendering of a document value for 'got ...'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        text = repr(value)
        # An integer past a float's range (10**400) is hundreds of digits: its size says it.
        return text if len(text) <= 40 else f"an integer of {len(text.lstrip('-'))} digits"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__
