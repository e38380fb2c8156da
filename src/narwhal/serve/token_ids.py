"""Token-id lists in a vLLM stream's chunks, as bytes (``serve.migration``): the router asks the
decode engine for ``return_token_ids`` so that a broken stream can be continued, and the ids must
neither reach a client that did not ask for them nor cost the healthy path a parse.

vLLM writes its chunks as compact JSON (a chunk spelled otherwise takes a parse:
:func:`keep_ids_parsed`). A key's spelling with its closing quote and colon cannot
occur inside a JSON string, where a quote is escaped, and a list of ids holds no bracket: searches
and splices, no regex (a regex that tries every position of a first chunk's prompt ids costs
several microseconds) and no parse.
"""

from __future__ import annotations

import orjson

__all__ = [
    "IDS_KEY",
    "NULL_IDS",
    "blank_token_ids",
    "cut_prompt_ids",
    "keep_ids_parsed",
    "parse_ids",
]

_PROMPT_IDS = b'"prompt_token_ids":['
# A choice's list of ids, and what replaces it for a client that did not ask for ids.
IDS_KEY = b'"token_ids":['
NULL_IDS = b'"token_ids":null'


def blank_token_ids(payload: bytes) -> bytes:
    """``payload`` (an engine's chunk) with its ``token_ids`` and ``prompt_token_ids`` lists
    replaced by null, as vLLM sends a chunk to a client that did not ask for them."""
    start = payload.find(b'token_ids":[')
    if start < 0:
        return payload
    out: list[bytes] = []
    pos = 0
    while start >= 0:
        end = payload.find(b"]", start)
        if end < 0:
            break
        out += (payload[pos : start + 11], b"null")
        pos = end + 1
        start = payload.find(b'token_ids":[', pos)
    out.append(payload[pos:])
    return b"".join(out)


def cut_prompt_ids(payload: bytes) -> tuple[bytes, bytes | None]:
    """``payload`` with its ``prompt_token_ids`` list replaced by null, and the list's inside as
    the engine wrote it (None when the chunk has no such list). A first chunk carries the whole
    prompt's ids, thousands for a long prompt: parsing them into ints on every request would
    cost more than the rest of the chunk, and only a migration needs them (``parse_ids``)."""
    before, key, rest = payload.partition(_PROMPT_IDS)
    if not key:
        return payload, None
    ids, bracket, after = rest.partition(b"]")
    if not bracket:
        return payload, None
    return b"".join((before, b'"prompt_token_ids":null', after)), ids


def keep_ids_parsed(payload: bytes, kept: list[bytes], blank: bool) -> bytes:
    """The slow way for a chunk whose ids the compact spelling did not find (an engine that
    writes ``"token_ids": [`` with a space): parsed, its choice's ids appended to ``kept`` as the
    cut keeps them, and the chunk given back with them null when ``blank``. Without it such a
    stream's kept ids would fall short and a migration continue from the wrong token."""
    try:
        obj = orjson.loads(payload)
        choice = obj["choices"][0]
        ids = choice["token_ids"]
    except (ValueError, TypeError, KeyError, IndexError):
        return payload  # no choice with ids: nothing to keep (a malformed chunk fails later)
    if not isinstance(ids, list):
        return payload
    kept.append(b",".join(b"%d" % i for i in ids))
    if not blank:
        return payload
    choice["token_ids"] = None
    return orjson.dumps(obj)


def parse_ids(raw: bytes) -> list[int]:
    """The inside of a JSON list of ids, as :func:`cut_prompt_ids` keeps it, parsed."""
    return [int(x) for x in raw.split(b",")] if raw.strip() else []
