"""launch_plan.py check and render: the shipped plans pass, and each rule refuses in one line."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tools.deployment import launch_plan

ROOT = Path(__file__).resolve().parents[2]
PROD_PLAN = ROOT / "configs" / "launch" / "kimi-k3-mi355x.yaml"
SIM_PLAN = ROOT / "configs" / "launch" / "local-sim.yaml"
PROD_FLEET = ROOT / "configs" / "fleet" / "kimi-k3-mi355x.example.json"
SIM_FLEET = ROOT / "configs" / "fleet" / "local-sim.json"
# The revision MAD benchmarked, pinned by the shipped launch plan and example fleet alike.
PINNED_REVISION = "9f62e4e9fffbd0a83ddd60e1c209d828994b3569"


def _write(tmp: Path, plan: dict[str, Any], fleet: dict[str, Any]) -> tuple[Path, Path]:
    plan_path, fleet_path = tmp / "plan.yaml", tmp / "fleet.json"
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    fleet_path.write_text(json.dumps(fleet, indent=2))
    return plan_path, fleet_path


@pytest.fixture
def prod() -> tuple[dict[str, Any], dict[str, Any]]:
    plan = yaml.safe_load(PROD_PLAN.read_text())
    fleet = json.loads(PROD_FLEET.read_text())
    return plan, fleet


def _check(capsys: pytest.CaptureFixture[str], plan: Path, fleet: Path) -> tuple[int, list[str]]:
    code = launch_plan.main(["check", str(plan), "--fleet", str(fleet)])
    err = capsys.readouterr().err.splitlines()
    # The last line counts the problems; the others are the problems.
    return code, [line for line in err if not line.endswith(("problem", "problems"))]


def test_shipped_production_plan_passes_against_the_shipped_example_fleet() -> None:
    # The two shipped files, through the real script, as an operator runs it.
    script = ROOT / "tools/deployment/launch_plan.py"
    result = subprocess.run(
        [sys.executable, str(script), "check", str(PROD_PLAN), "--fleet", str(PROD_FLEET)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: kimi-k3-mi355x (4 engines)")


def test_shipped_simulated_plan_passes_against_local_sim_fleet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _check(capsys, SIM_PLAN, SIM_FLEET) == (0, [])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"--bogus-flag": 1}, "unrecognized arguments: --bogus-flag 1"),
        ({"--time-scale": float("nan")}, "--time-scale: must be a finite number (got nan)"),
        ({"--eos-prob": 2}, "--eos-prob: must be less than or equal to 1"),
        ({"-h": True}, "-h/--help is not an engine setting"),
    ],
    ids=["unknown-flag", "nan", "out-of-range", "help"],
)
def test_a_simulated_plan_whose_flags_narwhal_sim_refuses_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: dict[str, Any], says: str
) -> None:
    """The check said ok, and start then failed on every engine."""
    plan = yaml.safe_load(SIM_PLAN.read_text())
    plan["simulated"]["args"].update(args)
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    code, lines = _check(capsys, plan_path, SIM_FLEET)
    assert code == 1
    assert len(lines) == len(plan["engines"])
    first = plan["engines"][0]["id"]
    assert lines[0].startswith(
        f"launch_plan.py: {plan_path}: engines[0] ({first}): narwhal-sim engine refuses its flags: "
    )
    assert says in lines[0], lines[0]


def test_a_fleet_with_a_branch_revision_is_refused(
    tmp_path: Path, prod: tuple[dict[str, Any], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    plan, fleet = prod
    fleet["model"]["revision"] = "main"
    plan_path, fleet_path = _write(tmp_path, plan, fleet)
    code, lines = _check(capsys, plan_path, fleet_path)
    assert code == 1
    assert lines == [
        f"launch_plan.py: {plan_path}: model.revision: '{PINNED_REVISION}' differs from the "
        "fleet's 'main'"
    ]


def _tag(plan: dict[str, Any], fleet: dict[str, Any]) -> None:
    plan["image"] = "docker.io/vllm/vllm-openai-rocm:kimi-k3"


def _arch(plan: dict[str, Any], fleet: dict[str, Any]) -> None:
    fleet["engine"]["gpu_arch"] = "gfx942"


def _env(plan: dict[str, Any], fleet: dict[str, Any]) -> None:
    del plan["env"]["AITER_SITUV2_A8W4"]


def _ports(plan: dict[str, Any], fleet: dict[str, Any]) -> None:
    # The side channel moved onto the HTTP port in the plan (a fleet saying so is refused by
    # the fleet's own validation, before the plan is read): the collision, and the plan no
    # longer agreeing with the fleet.
    plan["engines"][0]["side_channel"]["port"] = 8000


def _tp(plan: dict[str, Any], fleet: dict[str, Any]) -> None:
    fleet["engine"]["tp"] = 4


REFUSALS: list[tuple[str, Callable[[dict[str, Any], dict[str, Any]], None], str]] = [
    (
        "tag-without-digest",
        _tag,
        "image: 'docker.io/vllm/vllm-openai-rocm:kimi-k3' is a tag without a digest; pin it as "
        "NAME@sha256:<64 hex digits> (tags move: the same tag served two digests within one "
        "build session)",
    ),
    (
        "gpu-arch-outside-validated-set",
        _arch,
        "validated_gpu_archs: the fleet's GPU architecture 'gfx942' is outside the validated "
        "set [gfx950]; this recipe was not validated there",
    ),
    (
        "missing-required-env-flag",
        _env,
        "env: required kernel-selection flag AITER_SITUV2_A8W4 is missing (the plan requires "
        "AITER_SITUV2_A8W4=1)",
    ),
    (
        "colliding-ports",
        _ports,
        "engines[0].side_channel.port: port 8000 on 10.20.0.11 collides with engines[0].port (e0)"
        "\nengines[0].side_channel: e0 side channel 10.20.0.11:8000; the fleet says "
        "10.20.0.11:5600",
    ),
    ("tp-differs-from-fleet", _tp, "tp: 8 differs from the fleet's engine.tp (4) in {fleet}"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_check_refuses_in_one_line(
    tmp_path: Path,
    prod: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    mutate: Callable[[dict[str, Any], dict[str, Any]], None],
    expected: str,
) -> None:
    plan, fleet = copy.deepcopy(prod)
    mutate(plan, fleet)
    plan_path, fleet_path = _write(tmp_path, plan, fleet)
    code, lines = _check(capsys, plan_path, fleet_path)
    assert code == 1
    assert lines == [
        f"launch_plan.py: {plan_path}: {line.format(fleet=fleet_path)}"
        for line in expected.split("\n")
    ]


def test_check_reports_every_problem_at_once(
    tmp_path: Path, prod: tuple[dict[str, Any], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    plan, fleet = copy.deepcopy(prod)
    for _, mutate, _ in REFUSALS:
        mutate(plan, fleet)
    plan_path, fleet_path = _write(tmp_path, plan, fleet)
    code, lines = _check(capsys, plan_path, fleet_path)
    assert code == 1
    assert len(lines) == sum(len(expected.split("\n")) for _, _, expected in REFUSALS)


def test_check_refuses_engines_that_disagree_with_the_fleet(
    tmp_path: Path, prod: tuple[dict[str, Any], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    plan, fleet = copy.deepcopy(prod)
    plan["engines"][1]["port"] = 8001
    plan["engines"][2]["side_channel"]["port"] = 5601
    plan["engines"][3]["id"] = "e9"
    plan["engines"][0]["env"] = {"AITER_SITUV2_A8W4": "0", "VLLM_NIXL_SIDE_CHANNEL_PORT": "1"}
    plan["vllm_args"]["--port"] = 9000
    plan["vllm_args"]["--kv-transfer-config"]["kv_role"] = "kv_producer"
    plan_path, fleet_path = _write(tmp_path, plan, fleet)
    code, lines = _check(capsys, plan_path, fleet_path)
    assert code == 1
    reasons = [line.split(f"{plan_path}: ", 1)[1] for line in lines]
    assert reasons == [
        "engines[0].env.VLLM_NIXL_SIDE_CHANNEL_PORT: set from engines[].side_channel; remove it "
        "here",
        "engines[0].env.AITER_SITUV2_A8W4: changes required flag AITER_SITUV2_A8W4 to '0'; the "
        "plan requires '1'",
        "vllm_args.--port: rendered from engines[].port; remove it here",
        "vllm_args.--kv-transfer-config.kv_role: 'kv_producer'; the role controller needs kv_both",
        "vllm_args.--kv-transfer-config.kv_role: 'kv_producer' differs from the fleet's 'kv_both'",
        "engines[1]: e1 serves http://10.20.0.12:8001; the fleet says http://10.20.0.12:8000",
        "engines[2].side_channel: e2 side channel 10.20.0.13:5601; the fleet says 10.20.0.13:5600",
        "engines[3]: engine 'e9' is not in the fleet (its engines: e0, e1, e2, e3)",
    ]


def test_a_plan_file_that_does_not_parse_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("schema: narwhal.launch/v1\nname: a\nname: b\n")
    assert launch_plan.main(["check", str(path), "--fleet", str(SIM_FLEET)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"launch_plan.py: {path}: invalid YAML at line 3 column 1: duplicate key 'name' (line 3)"
    ]
    # A list as a key, and a document nested past Python's recursion: TypeError and
    # RecursionError tracebacks before (a CLI fuzz pass).
    path.write_text("? [a]\n: b\n")
    assert launch_plan.main(["check", str(path), "--fleet", str(SIM_FLEET)]) == 2
    assert "a key must be a plain value" in capsys.readouterr().err
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert launch_plan.main(["check", str(path), "--fleet", str(SIM_FLEET)]) == 2
    assert "nested too deeply" in capsys.readouterr().err
    path.write_text("schema: narwhal.launch/v1\nname: a\nkind: container\ntp: eight\n")
    assert launch_plan.main(["check", str(path), "--fleet", str(SIM_FLEET)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"launch_plan.py: {path}: tp: expected an integer (got 'eight')" in err
    assert f"launch_plan.py: {path}: model: required field is missing" in err
    assert all(line.startswith(f"launch_plan.py: {path}: ") for line in err)


@pytest.mark.parametrize(
    "place, value, line",
    [
        (("tp",), True, "tp: expected an integer (got true)"),
        (("engines", 0, "port"), "18100", "engines[0].port: expected an integer (got '18100')"),
        (("engines", 0, "port"), 18100.0, "engines[0].port: expected an integer (got 18100.0)"),
        (
            ("model", "max_model_len"),
            "16384",
            "model.max_model_len: expected an integer (got '16384')",
        ),
        (("engines", 1, "id"), 7, "engines[1].id: expected a string (got 7)"),
        (("engines", 0, "gpus"), [0, "1"], "engines[0].gpus[1]: expected an integer (got '1')"),
    ],
)
def test_a_plan_value_of_another_type_is_not_coerced(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    place: tuple[Any, ...],
    value: Any,
    line: str,
) -> None:
    """`tp: true` was read as TP 1, `port: "18100"` and `18100.0` as port 18100: strict types,
    as the fleet loader reads a fleet, naming the field and the type it takes."""
    plan = yaml.safe_load(SIM_PLAN.read_text())
    node = plan
    for key in place[:-1]:
        node = node[key]
    node[place[-1]] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    assert launch_plan.main(["check", str(path), "--fleet", str(SIM_FLEET)]) == 2
    assert capsys.readouterr().err == f"launch_plan.py: {path}: {line}\n"


def test_render_prints_a_pinned_container_command_per_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert launch_plan.main(["render", str(PROD_PLAN), "--sidecars"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [shlex.split(line) for line in lines if not line.startswith("#")]
    engines = commands[0::2]
    assert len(engines) == 4
    e0 = engines[0]
    assert e0[:5] == ["docker", "run", "--detach", "--name", "narwhal-e0"]
    image = next(a for a in e0 if a.startswith("docker.io/"))
    assert "@sha256:9eacf87e93ecffcb910802d0d0505ef3c9b753a66fb09bec304d72d8dac1dbc2" in image
    for env in (
        "AITER_SITUV2_A8W4=1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST=10.20.0.11",
        "VLLM_NIXL_SIDE_CHANNEL_PORT=5600",
    ):
        assert e0[e0.index(env) - 1] == "--env"
    serve = e0[e0.index(image) + 1 :]
    assert serve[:3] == ["vllm", "serve", "/models/Kimi-K3"]
    assert serve[serve.index("--tensor-parallel-size") + 1] == "8"
    assert json.loads(serve[serve.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cuda",
    }
    sidecar = commands[1]
    assert sidecar[sidecar.index("--image-digest") + 1].startswith("sha256:9eacf87e")
    # ... and reads the digest the running container reports.
    assert sidecar[sidecar.index("--container") + 1] == "narwhal-e0"
    assert sidecar[sidecar.index("--container-runtime") + 1] == "docker"
    assert "--gpu-arch" not in sidecar  # production reads rocminfo


def test_render_refuses_a_plan_that_breaks_its_rules(
    tmp_path: Path, prod: tuple[dict[str, Any], dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    plan, fleet = copy.deepcopy(prod)
    _tag(plan, fleet)
    plan_path, _ = _write(tmp_path, plan, fleet)
    assert launch_plan.main(["render", str(plan_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "is a tag without a digest" in captured.err


def test_render_simulated_plan_prints_narwhal_sim_commands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert launch_plan.main(["render", str(SIM_PLAN), "--fleet", str(SIM_FLEET)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(lines) == 4
    argv = shlex.split(lines[0])
    assert argv[:2] == ["env", "UCX_NET_DEVICES=lo"]
    sim = argv[argv.index("engine") - 1 :]
    # This venv's simulator by its path, as `start` runs it: a line pasted into a shell where
    # the venv is not active (docs/deployment.md, restarting an engine) runs as it does here.
    assert Path(sim[0]).is_absolute() and Path(sim[0]).name == "narwhal-sim"
    assert Path(sim[0]).exists()
    assert sim[1:4] == ["engine", "--engine-id", "e0"]
    assert sim[sim.index("--nixl-port") + 1] == "18200"
    assert sim[sim.index("--time-scale") + 1] == "10"


def test_render_gives_a_simulated_plans_sidecars_its_accelerator(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The sidecar command lacked --accelerator: the sidecar then attested accelerator null
    beside engines (and a fleet) that say 'simulated'."""
    plan = yaml.safe_load(SIM_PLAN.read_text())
    plan["simulated"]["accelerator"] = "simulated-mi355x"
    plan["engines"][0]["attestation_port"] = 18300
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    assert launch_plan.main(["render", str(path), "--sidecars", "--json"]) == 0
    sidecar = json.loads(capsys.readouterr().out)["engines"][0]["sidecar_argv"]
    assert sidecar[sidecar.index("--accelerator") + 1] == "simulated-mi355x"
    assert sidecar[sidecar.index("--gpu-arch") + 1] == "sim"


def test_start_refuses_a_container_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = launch_plan.main(
        ["start", str(PROD_PLAN), "--fleet", str(PROD_FLEET), "--run-dir", str(tmp_path)]
    )
    assert code == 2
    assert "start runs simulated plans" in capsys.readouterr().err


def test_a_plan_whose_prefix_caching_disagrees_with_the_fleet_is_refused(tmp_path: Path) -> None:
    """vLLM caches prefixes unless told not to: a plan that leaves the flag out while the
    fleet says caching is off (the router's prefix index would be wrong) is refused by name."""
    plan = yaml.safe_load((ROOT / "configs/launch/local-sim.yaml").read_text())
    del plan["simulated"]["args"]["--no-enable-prefix-caching"]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    done = subprocess.run(
        [
            sys.executable,
            "tools/deployment/launch_plan.py",
            "check",
            str(path),
            "--fleet",
            "configs/fleet/local-sim.json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 5, lines  # one per engine, and the count
    assert "engines[0]: e0 runs with prefix caching on" in lines[0]
    assert "engine.prefix_caching.enabled is false" in lines[0]


def test_stop_names_a_run_directory_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --run-dir said 'nothing recorded' and exited 0 (the engines may run on); a
    corrupt run.json was a JSONDecodeError, TypeError or AttributeError traceback (a CLI fuzz
    pass)."""
    missing = tmp_path / "nowhere"
    assert launch_plan.main(["stop", "--run-dir", str(missing)]) == 2
    assert f"--run-dir {missing}: no such directory" in capsys.readouterr().err
    state = tmp_path / "run.json"
    for content in ("[1, 2", "[1, 2]", '{"e0": {"pid": 1}}'):
        state.write_text(content)
        assert launch_plan.main(["stop", "--run-dir", str(tmp_path)]) == 2
        assert f"{state}: not a launch_plan.py run state" in capsys.readouterr().err
    state.unlink()
    assert launch_plan.main(["stop", "--run-dir", str(tmp_path)]) == 0  # nothing to stop


def test_a_run_state_or_run_directory_that_is_not_one_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run.json record of other fields said 'RunRecord.__init__() missing 5 required
    positional arguments'; a --run-dir that is a file said '.../config.json: File exists'."""
    state = tmp_path / "run.json"
    record = {
        "engine_id": "e0",
        "pid": 1,
        "start_ticks": 1,
        "url": "http://127.0.0.1:1",
        "log": "l",
        "pidfile": "p",
    }
    for content, reason in (
        ({"e0": {"pid": 1}}, "e0: missing engine_id, start_ticks, url, log, pidfile"),
        ({"e0": {**record, "pid": "1"}}, "e0: pid: expected an integer"),
        ({"e0": {**record, "extra": 1}}, "e0: unknown field extra"),
        ({"e0": [1]}, "e0: not a JSON object"),
    ):
        state.write_text(json.dumps(content))
        assert launch_plan.main(["stop", "--run-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err == f"launch_plan.py: {state}: not a launch_plan.py run state: {reason}\n"
    state.unlink()
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    for run_dir, reason in ((a_file, "not a directory"), (a_file / "run", "cannot create: ")):
        argv = ["start", str(SIM_PLAN), "--fleet", str(SIM_FLEET), "--run-dir", str(run_dir)]
        assert launch_plan.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"launch_plan.py: --run-dir {run_dir}: {reason}"), err
        assert len(err.splitlines()) == 1


def _kv_aware(plan: dict[str, Any], fleet: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The production pair with KV-cache-aware routing turned on, as docs/deployment.md says:
    engines that cache prefixes and publish their KV events where the fleet reads them."""
    plan, fleet = copy.deepcopy(plan), copy.deepcopy(fleet)
    # The docs' own snippets, so that what an operator copies is what passes.
    text = (ROOT / "docs" / "deployment.md").read_text()
    section = text[text.index("**KV-cache-aware routing.**") :]
    yaml_part = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    json_part = section.split("```json\n", 1)[1].split("```", 1)[0]
    del plan["vllm_args"]["--no-enable-prefix-caching"]
    plan["vllm_args"].update(yaml.safe_load(yaml_part)["vllm_args"])
    documented = json.loads("{" + json_part + "}")
    fleet["engine"]["prefix_caching"] = documented["engine"]["prefix_caching"]
    pattern = documented["engines"][0]["kv_events"]
    for engine in fleet["engines"]:
        engine["kv_events"] = {
            key: value.replace("10.20.0.11", engine["host"]) for key, value in pattern.items()
        }
    return plan, fleet


def test_a_kv_aware_plan_and_fleet_that_agree_pass(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    prod: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plan, fleet = _kv_aware(*prod)
    assert _check(capsys, *_write(tmp_path, plan, fleet)) == (0, [])
    # Per engine, as engines sharing a host need: e1 binds its own ports.
    plan["engines"][1]["args"] = {
        "--kv-events-config": json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://*:6557",  # the publisher: vLLM binds only a wildcard
                "replay_endpoint": "tcp://0.0.0.0:6558",  # the replay socket: any bindable form
            }
        )
    }
    fleet["engines"][1]["kv_events"] = {
        "endpoint": "tcp://10.20.0.12:6557",
        "replay_endpoint": "tcp://10.20.0.12:6558",
    }
    assert _check(capsys, *_write(tmp_path, plan, fleet)) == (0, [])


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            lambda p, f: p["vllm_args"].pop("--kv-events-config"),
            "engines[0]: e0 publishes no KV events but the fleet reads them at "
            "tcp://10.20.0.11:5557 (engines[0].kv_events)",
        ),
        (
            lambda p, f: p["vllm_args"]["--kv-events-config"].update(publisher="null"),
            "engines[0]: e0 publishes no KV events",
        ),
        (
            lambda p, f: p["vllm_args"]["--kv-events-config"].update(endpoint="tcp://*:5559"),
            "engines[0]: --kv-events-config.endpoint: e0 binds tcp://*:5559 but the fleet reads "
            "tcp://10.20.0.11:5557 (engines[0].kv_events.endpoint)",
        ),
        (
            # vLLM connects, rather than binds, a publisher given a host: nobody listens.
            lambda p, f: p["vllm_args"]["--kv-events-config"].update(endpoint="tcp://0.0.0.0:5557"),
            "engines[0]: --kv-events-config.endpoint: tcp://0.0.0.0:5557 makes vLLM connect its "
            "publisher to that address rather than bind it",
        ),
        (
            # vLLM turns ZMQ's IPv6 on only for tcp://*:0: an IPv6 address fails to bind.
            lambda p, f: p["vllm_args"]["--kv-events-config"].update(endpoint="tcp://[::]:5557"),
            "engines[0]: --kv-events-config.endpoint: tcp://[::]:5557: vLLM binds its KV event "
            "sockets without ZMQ's IPv6",
        ),
        (
            # Its KV events on its own HTTP port: vLLM would fail to bind one of the two. (A
            # fleet that reads them there is refused as it loads: tests/unit/test_contract.py.)
            lambda p, f: p["engines"][1].update(
                args={
                    "--kv-events-config": {
                        "enable_kv_cache_events": True,
                        "endpoint": "tcp://*:8000",
                        "replay_endpoint": "tcp://*:5558",
                    }
                }
            ),
            "engines[1].--kv-events-config.endpoint: port 8000 on 10.20.0.12 collides with "
            "engines[1].port (e1)",
        ),
        (
            lambda p, f: p["vllm_args"]["--kv-events-config"].pop("replay_endpoint"),
            "engines[0]: --kv-events-config.replay_endpoint: e0 binds none but the fleet reads "
            "tcp://10.20.0.11:5558",
        ),
        (
            lambda p, f: p["vllm_args"]["--kv-events-config"].update(topic="kv"),
            "engines[0]: --kv-events-config.topic: 'kv' differs from the fleet's ''",
        ),
        (
            lambda p, f: f["engines"][0].pop("kv_events"),
            "engines[0]: e0 publishes KV events (--kv-events-config) but the fleet names none "
            "for it (engines[0].kv_events)",
        ),
        (
            lambda p, f: p["vllm_args"].update({"--block-size": 64}),
            "engines[0]: e0 runs with --block-size 64 but the fleet's "
            "engine.prefix_caching.block_size is 16",
        ),
        (
            lambda p, f: p["vllm_args"].update({"--kv-events-config": "{not json"}),
            "engines[0]: --kv-events-config: must be a mapping or a JSON object",
        ),
    ],
    ids=[
        "not-published",
        "null-publisher",
        "other-port",
        "connects",
        "ipv6",
        "port-collision",
        "no-replay",
        "topic",
        "unread",
        "block-size",
        "not-json",
    ],
)
def test_kv_events_the_fleet_cannot_read_are_refused_by_name(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    prod: tuple[dict[str, Any], dict[str, Any]],
    change: Callable[[dict[str, Any], dict[str, Any]], object],
    says: str,
) -> None:
    """ZMQ connects without complaint to an address nobody publishes on: a plan and a fleet
    that disagree on where an engine's KV events are would leave the router routing it by
    history, seen only later in NarwhalKVEventsNotFollowed. The check names the mismatch."""
    plan, fleet = _kv_aware(*prod)
    change(plan, fleet)
    code, lines = _check(capsys, *_write(tmp_path, plan, fleet))
    assert code == 1
    assert any(says in line for line in lines), lines
