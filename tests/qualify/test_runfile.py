"""RUN.yaml is checked as a whole before anything starts: one line per problem, exit 2."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from narwhal.qualify.runfile import RunFileError, load_run_file

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "qualify" / "local-sim.yaml"
QUALIFY = str(Path(sys.executable).with_name("narwhal-qualify"))


def _write(tmp_path: Path, **over: object) -> Path:
    doc = yaml.safe_load(SHIPPED.read_text())
    doc.update(over)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_shipped_run_file_loads_against_the_checkout() -> None:
    loaded = load_run_file(SHIPPED, ROOT)
    assert loaded.simulated
    assert loaded.fleet_path == ROOT / "configs/fleet/local-sim.json"
    assert loaded.run_dir == ROOT / "runs/qualify-local-sim"
    assert [p.name for p in loaded.run.benchmark.points] == ["r2", "r4"]


def test_every_problem_is_one_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        launch_plans=["configs/launch/nowhere.yaml"],
        budgets={"ttft_s": 20, "tpot_s": 0.3, "attainment": 0.9},
        workload={"input_tokens": 16000, "output_tokens": 1000, "seed": 1},
    )
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    problems = info.value.problems
    assert any("launch_plans[0]: no such file" in p for p in problems), problems
    assert any("budgets.ttft_s: 20 is looser than the fleet's 10" in p for p in problems)
    assert any("budgets.attainment: 0.9 is below the fleet's 0.95" in p for p in problems)
    assert any("exceed the fleet's max_model_len 16384" in p for p in problems)
    assert all("\n" not in p for p in problems) and len(problems) == 4


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"schema": "narwhal.qualify/v9"}, "schema must be 'narwhal.qualify/v1'"),
        ({"profilng": {}}, "profilng: unknown field"),
        ({"benchmark": {"points": [{"name": "a b", "rate": 1, "requests": 2}]}}, "points[0].name"),
        ({"benchmark": {"points": []}}, "benchmark.points"),
        ({"router": {"port": 0}}, "router.port"),
        ({"check": {"pace_tolerance": 0}}, "check.pace_tolerance"),
        # Values of another type are not taken as this one (`true` was 1.0), nor NaN a rate.
        (
            {"budgets": {"ttft_s": 10, "tpot_s": 0.3, "attainment": True}},
            "budgets.attainment: expected a number (got true)",
        ),
        # In the fleet loader's words, not pydantic's ("or instance of Workload").
        ({"workload": 5}, "workload: expected an object (got 5)"),
        ({"benchmark": {"points": [3]}}, "benchmark.points[0]: expected an object (got 3)"),
        (
            {"benchmark": {"points": [{"name": "a", "rate": float("nan"), "requests": 2}]}},
            "points[0].rate",
        ),
    ],
)
def test_schema_problems_name_the_field(tmp_path: Path, over: dict, needle: str) -> None:
    path = _write(tmp_path, **over)
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    assert any(needle in p for p in info.value.problems), info.value.problems


def test_numbers_in_exponent_form_are_numbers(tmp_path: Path) -> None:
    """PyYAML reads 5e-1 and 1e3 as strings (YAML 1.1), which the strict schema refused."""
    text = SHIPPED.read_text()
    doc = yaml.safe_load(text)
    tpot = doc["budgets"]["tpot_s"]
    text = text.replace(f"tpot_s: {tpot}", "tpot_s: 3e-1", 1)
    assert "tpot_s: 3e-1" in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    loaded = load_run_file(path, ROOT)
    assert loaded.run.budgets.tpot_s == 0.3


def test_the_command_refuses_a_bad_run_file_before_starting_anything(tmp_path: Path) -> None:
    path = _write(tmp_path, fleet="configs/fleet/missing.json", run_dir=str(tmp_path / "run"))
    done = subprocess.run(
        [QUALIFY, str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "fleet: no such file" in done.stderr and "nothing started" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("schema: [unclosed\n")
    done = subprocess.run([QUALIFY, str(not_yaml)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not YAML at line" in done.stderr, done.stderr
    done = subprocess.run(
        [QUALIFY, str(SHIPPED), "--checkout", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"narwhal-qualify: --checkout {tmp_path}: not a Narwhal checkout "
        "(no tools/measurement/benchmark_runner.py in it)"
    )


def test_the_run_directory_is_the_runs_alone(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for run_dir, needle in (
        (str(ROOT), "holds the checkout"),
        (str(a_file), "is not a directory"),
        (str(other), "holds other files and no steps.json"),
    ):
        with pytest.raises(RunFileError) as info:
            load_run_file(SHIPPED, ROOT, run_dir)
        assert any(f"run_dir: {run_dir} {needle}" in p for p in info.value.problems), (
            info.value.problems
        )
    # Under a regular file: it could not be made, which the run found only part way.
    with pytest.raises(RunFileError) as info:
        load_run_file(SHIPPED, ROOT, str(a_file / "run"))
    assert any(f"run_dir: {a_file} is not a directory" in p for p in info.value.problems), (
        info.value.problems
    )


def test_a_relative_run_dir_on_the_command_line_is_where_the_operator_is(tmp_path: Path) -> None:
    bad = _write(tmp_path, budgets={"ttft_s": 99, "tpot_s": 0.3, "attainment": 0.95})
    done = subprocess.run(
        [QUALIFY, str(bad), "--run-dir", "here"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "budgets.ttft_s" in done.stderr, done.stderr
    assert not (ROOT / "here").exists() and not (tmp_path / "here").exists()
    loaded = load_run_file(SHIPPED, ROOT, str(tmp_path / "here"))
    assert loaded.run_dir == tmp_path / "here"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # Last one won without a word (launch plans and fleets refuse it).
        ("schema: narwhal.qualify/v1\nname: a\nname: b\n", "duplicate key 'name' (line 3)"),
        ("? [a]\n: b\n", "a key must be a plain value"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),  # a RecursionError
    ],
)
def test_yaml_a_person_could_not_mean_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "RUN.yaml"
    path.write_text(text)
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    assert any(needle in p for p in info.value.problems), info.value.problems


def _profiling(**over: object) -> dict[str, object]:
    doc = yaml.safe_load(SHIPPED.read_text())["profiling"]
    doc.update(over)
    return doc


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        # narwhal-profile's own bounds (ProfilingPlan), not the run file's looser copies.
        ({"decode_tokens": 2}, "profiling.decode_tokens: must be greater than or equal to 4"),
        ({"prefill_lens": [8192]}, "profiling.prefill_lens: must have at least 2 items (got 1)"),
        ({"decode_concurrency": [1]}, "profiling.decode_concurrency: must have at least 2 items"),
        ({"prefill_lens": [256, 256]}, "profiling.prefill_lens: duplicate values"),
        # Probes the fleet's engines cannot take (local-sim.json: max_model_len 16384).
        (
            {"prefill_lens": [256, 20000]},
            "profiling.prefill_lens: a prefill probe of 20000 tokens exceeds the fleet's "
            "max_model_len 16384",
        ),
        (
            {"decode_input_lens": [512, 16380]},
            "profiling.decode_input_lens: a decode probe of 16396 tokens exceeds",
        ),
    ],
)
def test_profiling_the_profiler_would_refuse_is_refused_before_anything_starts(
    tmp_path: Path, over: dict[str, object], needle: str
) -> None:
    path = _write(tmp_path, profiling=_profiling(**over))
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    assert any(needle in p for p in info.value.problems), info.value.problems
    assert all("\n" not in p for p in info.value.problems)


def test_a_limits_file_the_profiler_would_refuse_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "limits.json"
    broken.write_text('{"schema": "narwhal.profiling-limits/v1", "max_wall_s_per_engine": 10,')
    path = _write(tmp_path, profiling=_profiling(limits=str(broken)), run_dir=str(tmp_path / "r"))
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    assert any(f"profiling.limits: {broken}: " in p for p in info.value.problems), (
        info.value.problems
    )
    # Valid JSON, wrong document: the profiler's loader (strict) says which field.
    broken.write_text('{"schema": "narwhal.profiling-limits/v1", "max_wall_s_per_engine": 10}')
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    assert any("max_tokens_per_engine: required field is missing" in p for p in info.value.problems)
    # A limit the plan cannot stay within (narwhal-profile refuses it before any probe).
    broken.write_text(
        '{"schema": "narwhal.profiling-limits/v1", "max_wall_s_per_engine": 10, '
        '"max_tokens_per_engine": 1000, "probe_timeout_s": 5}'
    )
    with pytest.raises(RunFileError) as info:
        load_run_file(path, ROOT)
    assert any("max_tokens_per_engine 1000 is below the" in p for p in info.value.problems)
    # And the command says so up front: exit 2, nothing started.
    done = subprocess.run([QUALIFY, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "nothing started" in done.stderr, done.stderr
    assert "max_tokens_per_engine 1000" in done.stderr and not (tmp_path / "r").exists()


def test_a_run_directory_that_cannot_be_used_is_refused_with_nothing_started(
    tmp_path: Path,
) -> None:
    """Unwritable, or locked by another chain: exit 2 as any other run_dir problem, no
    resume hint (nothing ran), no logs directory promised."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "steps.json").write_text("{}")
    with (run_dir / ".lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = subprocess.run(
            [QUALIFY, str(SHIPPED), "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"narwhal-qualify: run_dir: another narwhal-qualify is running in {run_dir}",
        "narwhal-qualify: nothing started",
    ], done.stderr
    assert "rerun" not in done.stdout + done.stderr
    done = subprocess.run(
        [QUALIFY, str(SHIPPED), "--run-dir", "/proc/narwhal-qualify-test"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[1] == "narwhal-qualify: nothing started", done.stderr
    assert lines[0].startswith(
        "narwhal-qualify: run_dir: cannot use /proc/narwhal-qualify-test: "
    ), done.stderr
    assert "rerun" not in done.stdout + done.stderr and "Traceback" not in done.stderr
