"""The deployment tools' output files: a directory named as --out is refused before anything is
read from engines, and a write that fails leaves no temporary file behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.deployment import attestation_contract, launch_plan
from tools.deployment._files import write_atomic

ROOT = Path(__file__).resolve().parents[2]


def test_a_directory_as_out_is_refused_before_any_engine_is_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both read every engine first and then failed on 'd.tmp: Is a directory', leaving a
    temporary file named after the directory."""
    plan = str(ROOT / "configs" / "launch" / "local-sim.yaml")
    fleet = str(ROOT / "configs" / "fleet" / "local-sim.json")
    assert launch_plan.main(["capture", plan, "--out", str(tmp_path)]) == 2
    assert (
        attestation_contract.main(["finalize-fleet", "--fleet", fleet, "--out", str(tmp_path)]) == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"launch_plan.py: --out {tmp_path}: a directory; name the file to write",
        f"attestation_contract.py: --out {tmp_path}: a directory; name the file to write",
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")  # a non-empty directory cannot be replaced
    with pytest.raises(OSError):
        write_atomic(tmp_path / "taken", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    write_atomic(tmp_path / "f.json", "{}\n")
    assert (tmp_path / "f.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "taken"]
