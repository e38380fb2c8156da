"""vLLM reads request fields with pydantic in lax mode (engines.lax): the values its integer and
boolean fields take and refuse, as vLLM 0.32 answered them through the router's sweep."""

from __future__ import annotations

import pytest

from narwhal.engines.lax import lax_bool, lax_int


@pytest.mark.parametrize(
    ("value", "read"),
    [(3, 3), (2.0, 2), ("3", 3), (True, 1), (2.5, None), ("x", None), ([1], None), ({}, None)],
)
def test_an_integer_field(value: object, read: int | None) -> None:
    assert lax_int(value) == read
    assert lax_int(value) is None or type(lax_int(value)) is int


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (True, True),
        (1, True),
        (0, False),
        ("true", True),
        ("false", False),
        ("off", False),
        (2, None),
        ("maybe", None),
        ([], None),
    ],
)
def test_a_boolean_field(value: object, read: bool | None) -> None:
    assert lax_bool(value) is read
