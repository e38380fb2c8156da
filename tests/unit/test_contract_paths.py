"""``narwhal.contract.paths.empty_path``: the one refusal of an empty path that narwhal-check,
narwhal-profile, narwhal-serve and narwhal-fleetsim share."""

from __future__ import annotations

from narwhal.contract.paths import empty_path


def test_the_first_empty_path_is_named_and_a_flag_not_given_is_not_empty() -> None:
    assert empty_path([("--fleet", "f.json"), ("--profiles", None)]) is None
    assert empty_path([]) is None
    assert empty_path([("--fleet", "f.json"), ("--plan", " "), ("--report", "")]) == (
        "--plan: an empty path"
    )
    assert empty_path(iter([("--trace", "\t\n")])) == "--trace: an empty path"
