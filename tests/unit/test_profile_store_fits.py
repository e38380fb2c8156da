"""A profile store's fits must describe an engine: a prediction that is infinite, not a
number or zero seconds is refused when the store is read, naming the engine and the fit. The
scheduler compares predictions: NaN breaks every comparison, and a 0 s engine draws all work."""

from __future__ import annotations

import copy
import json

import pytest

from narwhal.contract import ContractError
from narwhal.profiles.store import parse_profile_store
from tests.check.support import make_store

CALIBRATION = {"a": 0.02, "b": 1e-4, "c": 1.2e-9, "intercept": 0.24, "slope": 0.0015, "ctx": 1.3e-7}


def _doc() -> dict[str, object]:
    store, _ = make_store({"e0": CALIBRATION})
    return json.loads(json.dumps(store.model_dump(mode="json", by_alias=True)))


def test_the_profilers_own_fits_are_read() -> None:
    store, _ = parse_profile_store(_doc(), "store.json")
    assert store.engines["e0"].prefill_fit.c > 0


@pytest.mark.parametrize(
    ("fit", "changes", "says"),
    [
        ("prefill_fit", {"c": 1e308}, "engines.e0.prefill_fit: .*predicts inf s for a prefill"),
        ("prefill_fit", {"a": 0.0, "b": 0.0, "c": 0.0}, "predicts 0 s for a prefill of 16384"),
        # Finite at max_tokens, infinite where the router extrapolates to (twice as far).
        ("prefill_fit", {"c": 2e300}, "predicts inf s for a prefill of 16384 tokens"),
        ("prefill_fit", {"min_tokens": 9000}, "min_tokens 9000 is above max_tokens 8192"),
        # JSON reads a 400-digit integer; no float holds it (it was an OverflowError traceback).
        ("prefill_fit", {"max_tokens": 10**400}, "max_tokens is too large to be a profiled range"),
        ("decode_fit", {"max_context": 10**400}, "max_context is too large to be a profiled range"),
        ("decode_fit", {"slope": 1e308, "intercept": 1e308}, "predicts inf s for a token"),
        (
            "decode_fit",
            {"intercept": 0.0, "slope": 0.0, "ctx_coef": 0.0},
            "predicts 0 s for a token at batch 8",
        ),
    ],
    ids=[
        "prefill-inf",
        "prefill-zero",
        "prefill-extrapolated-inf",
        "prefill-range",
        "prefill-huge",
        "decode-huge",
        "decode-inf",
        "decode-zero",
    ],
)
def test_a_fit_that_describes_no_engine_is_refused_by_name(
    fit: str, changes: dict[str, float], says: str
) -> None:
    doc = copy.deepcopy(_doc())
    doc["engines"]["e0"][fit].update(changes)  # type: ignore[index]
    with pytest.raises(ContractError, match=says):
        parse_profile_store(doc, "store.json")
