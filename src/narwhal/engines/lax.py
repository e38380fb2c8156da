"""Request fields as vLLM reads them. Its OpenAI request models are pydantic models in lax mode:
an integer field takes ``2.0``, ``"3"`` or ``true`` (not ``2.5``), a boolean field ``"true"``,
``1`` or ``"off"`` (not ``2``). The router's validation and the simulated engine accept what vLLM
accepts and refuse what it refuses (probed on vLLM 0.32 through the router: ``max_tokens: 2.0``
from an agent framework that computes it was a 400 from the router, a 200 from vLLM)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

__all__ = ["NOT_JSON", "is_json", "lax_bool", "lax_float", "lax_int", "lax_token_ids"]

# vLLM 0.32's words for a body that does not say it is JSON (its validate_json_request).
NOT_JSON = "Unsupported Media Type: Only 'application/json' is allowed"

_INT: TypeAdapter[int] = TypeAdapter(int)
_FLOAT: TypeAdapter[float] = TypeAdapter(float)
_BOOL: TypeAdapter[bool] = TypeAdapter(bool)
_TOKEN_IDS: TypeAdapter[list[int]] = TypeAdapter(list[Annotated[int, Field(ge=0)]])


def lax_int(value: object) -> int | None:
    """``value`` as a vLLM integer field reads it; None when vLLM refuses it."""
    if type(value) is int:
        return value
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return None


def lax_float(value: object) -> float | None:
    """``value`` as a vLLM float field reads it (``"0"``, ``true``); None when vLLM refuses it."""
    if type(value) is float:
        return value
    try:
        return _FLOAT.validate_python(value)
    except ValidationError:
        return None


def lax_bool(value: object) -> bool | None:
    """``value`` as a vLLM boolean field reads it; None when vLLM refuses it."""
    if type(value) is bool:
        return value
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return None


def lax_token_ids(value: list[object]) -> list[int] | None:
    """A token-id prompt as vLLM reads it, every id an ``int``; None when vLLM refuses it."""
    try:
        return _TOKEN_IDS.validate_python(value)
    except ValidationError:
        return None


def is_json(content_type: bytes | str | None) -> bool:
    """Whether a request's Content-Type says JSON as vLLM reads it on its JSON routes: the
    media type (before any parameter, case aside) is ``application/json``. A request without
    one is not JSON either: vLLM refuses both with a 400, and so does the router."""
    if not content_type:
        return False
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    return content_type.split(";", 1)[0].strip().lower() == "application/json"
