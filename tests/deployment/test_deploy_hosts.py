"""deploy_hosts.py against a real sshd on 127.0.0.1 (Debian's openssh-server, installed by
`make test-deps`), a local venv and an unreachable host; refusals of dirty trees and wrong
commits; --dry-run."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from narwhal.testing import procs
from narwhal.testing.ports import free_ports
from tests.deployment.sidecars import ROOT, TOOLS

SSHD = Path("/usr/sbin/sshd")
# The real interpreter behind this venv: a venv made from it needs nothing from the network.
BASE_PYTHON = os.path.realpath(sys.executable)


@dataclass
class Sshd:
    port: int
    client_key: Path
    known_hosts: Path
    log: Path


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "narwhal-test", "-f", str(path)],
        check=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if not SSHD.exists():
        pytest.skip("sshd is not installed: `make test-deps` installs Debian's openssh-server")
    if shutil.which("ssh") is None or shutil.which("scp") is None:
        pytest.skip("the ssh client (ssh, scp) is not installed")
    if os.geteuid() != 0:
        pytest.skip("this test runs sshd as root (privilege separation needs /run/sshd)")
    d = tmp_path_factory.mktemp("sshd")
    _keygen(d / "host_key")
    _keygen(d / "client_key")
    authorized = d / "authorized_keys"
    authorized.write_text((d / "client_key.pub").read_text())
    authorized.chmod(0o600)
    (port,) = free_ports(1)
    config = d / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {d / 'host_key'}",
                f"PidFile {d / 'sshd.pid'}",
                f"AuthorizedKeysFile {authorized}",
                f"AllowUsers {getpass.getuser()}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                # The throwaway files live under /tmp, whose mode sshd's StrictModes rejects.
                "StrictModes no",
                "Subsystem sftp internal-sftp",
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    known_hosts = d / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {(d / 'host_key.pub').read_text()}")
    log = d / "sshd.log"

    def banner() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                return s.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    with procs.running(
        [str(SSHD), "-D", "-e", "-f", str(config)],
        log,
        ready=banner,
        ready_timeout=15,
        name="sshd",
        stop_timeout=10,
    ):
        yield Sshd(port, d / "client_key", known_hosts, log)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A clean clone of this repository's HEAD: the tree under test may have local edits."""
    clone = tmp_path_factory.mktemp("checkout") / "narwhal"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    return clone, _git(clone, "rev-parse", "HEAD")


def deploy(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOLS / "deploy_hosts.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_deployment(path: Path, hosts: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"schema": "narwhal.deployment/v1", "hosts": hosts}))
    return path


def ssh_host(sshd: Sshd, name: str, remote: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "name": name,
        "transport": "ssh",
        "address": "127.0.0.1",
        "port": sshd.port,
        "user": getpass.getuser(),
        "identity_file": str(sshd.client_key),
        "known_hosts_file": str(sshd.known_hosts),
        "venv": str(remote / "venv"),
        "stage_dir": str(remote / "stage"),
        "python": BASE_PYTHON,
        # Offline: the wheel alone (--no-deps --no-index); `import narwhal` needs nothing else.
        "system_site_packages": True,
        "install_deps": False,
        **overrides,
    }


@pytest.mark.slow
def test_deploys_the_pinned_commit_over_ssh_and_locally(
    sshd: Sshd, checkout: tuple[Path, str], tmp_path: Path
) -> None:
    repo, commit = checkout
    (closed,) = free_ports(1)
    deployment = write_deployment(
        tmp_path / "deploy.yaml",
        [
            ssh_host(sshd, "sshd-loopback", tmp_path / "remote"),
            {
                "name": "local-venv",
                "transport": "local",
                "venv": "local/venv",  # relative to the deployment file
                "stage_dir": "local/stage",
                "python": BASE_PYTHON,
                "install_deps": False,
            },
            # Nothing listens there: this host fails, and must not hide the others.
            ssh_host(sshd, "unreachable", tmp_path / "nowhere", port=closed, connect_timeout_s=3),
        ],
    )
    report = tmp_path / "report.json"
    result = deploy(
        "--deployment", str(deployment), "--commit", commit, "--repo", str(repo),
        "--report", str(report),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    version_suffix = f"+g{commit[:12]}"
    lines = result.stdout.splitlines()
    ok_ssh = next(line for line in lines if line.startswith("sshd-loopback "))
    assert f"ok narwhal 0.1.0{version_suffix} commit {commit}" in ok_ssh
    ok_local = next(line for line in lines if line.startswith("local-venv "))
    assert f"ok narwhal 0.1.0{version_suffix} commit {commit}" in ok_local
    failed = next(line for line in lines if line.startswith("unreachable "))
    assert "FAILED at stage:" in failed and "Connection refused" in failed
    assert lines[-1] == f"2/3 hosts verified at {commit}"

    doc = json.loads(report.read_text())
    assert doc["commit"] == commit and doc["version"] == f"0.1.0{version_suffix}"
    by_name = {h["name"]: h for h in doc["hosts"]}
    assert by_name["sshd-loopback"]["installed"]["wheel_sha256"] == doc["wheel_sha256"]
    # It went through sshd, with the throwaway key.
    assert "Accepted publickey for" in sshd.log.read_text()

    # Ask the installed package directly, outside the tool.
    venv_python = tmp_path / "remote" / "venv" / "bin" / "python"
    installed = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import importlib.metadata as m, narwhal._build_info as b; "
            "print(m.version('narwhal'), b.COMMIT)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=tmp_path,
    ).stdout.split()
    assert installed == [f"0.1.0{version_suffix}", commit]


def test_dry_run_prints_every_step_and_runs_none(
    checkout: tuple[Path, str], tmp_path: Path
) -> None:
    repo, commit = checkout
    # No server is contacted: the key files only have to exist.
    sshd = Sshd(22, tmp_path / "key", tmp_path / "known_hosts", tmp_path / "log")
    sshd.client_key.write_text("not a key\n")
    sshd.known_hosts.write_text("")
    deployment = write_deployment(
        tmp_path / "deploy.yaml", [ssh_host(sshd, "h1", tmp_path / "remote", install_deps=True)]
    )
    result = deploy(
        "--deployment", str(deployment), "--commit", commit, "--repo", str(repo), "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":", 1)[0] for line in lines if line.startswith("[h1]")] == [
        f"[h1] {step}" for step in ("stage", "copy", "venv", "install", "dependencies", "verify")
    ]
    assert sum(line.startswith("[build]") for line in lines) == 3
    copy = next(line for line in lines if line.startswith("[h1] copy:"))
    for option in (
        "BatchMode=yes",
        "StrictHostKeyChecking=yes",
        f"UserKnownHostsFile={sshd.known_hosts}",
    ):
        assert option in copy
    assert copy.split(": ", 1)[1].startswith("scp ")
    # The wheel by the name the build gives it (a placeholder "VERSION" before).
    assert f"/narwhal-0.1.0+g{commit[:12]}-py3-none-any.whl " in copy
    assert "VERSION" not in result.stdout
    assert not (tmp_path / "remote").exists()
    # Before the keys exist (docs/deployment.md has them made later): the steps all the same,
    # the missing key named; a real run refuses it.
    sshd.client_key.unlink()
    result = deploy(
        "--deployment", str(deployment), "--commit", commit, "--repo", str(repo), "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    assert "identity_file" in result.stderr and "does not exist" in result.stderr
    assert sum(line.startswith("[h1]") for line in result.stdout.splitlines()) == 6
    result = deploy("--deployment", str(deployment), "--commit", commit, "--repo", str(repo))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_refuses_a_dirty_tree_and_a_commit_that_is_not_head(
    checkout: tuple[Path, str], tmp_path: Path
) -> None:
    repo, commit = checkout
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True, timeout=120)
    deployment = write_deployment(
        tmp_path / "deploy.yaml",
        [{"name": "l", "transport": "local", "venv": "v", "python": BASE_PYTHON}],
    )
    args = ["--deployment", str(deployment), "--repo", str(clone), "--dry-run"]

    (clone / "README.md").write_text("edited\n")
    result = deploy(*args, "--commit", commit)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"deploy_hosts.py: {clone} has uncommitted changes to 1 tracked file (first: README.md); "
        "commit or stash them"
    )
    _git(clone, "checkout", "--", "README.md")
    (clone / "untracked.txt").write_text("not in git archive, so not in the build\n")
    assert deploy(*args, "--commit", commit).returncode == 0

    _git(
        clone,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@e",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "x",
    )
    result = deploy(*args, "--commit", commit)
    assert result.returncode == 2
    new_head = _git(clone, "rev-parse", "HEAD")
    assert result.stderr.strip() == (
        f"deploy_hosts.py: --commit {commit} is {commit[:12]} but {clone} has {new_head[:12]} "
        "checked out; check out the commit to deploy"
    )
    result = deploy(*args, "--commit", "no-such-ref")
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"deploy_hosts.py: --commit no-such-ref: not a commit in {clone}"
    )
    # Not a checkout at all: said so, not blamed on --commit.
    plain = tmp_path / "plain"
    plain.mkdir()
    result = deploy("--deployment", str(deployment), "--repo", str(plain), "--commit", commit)
    assert result.returncode == 2
    assert result.stderr == f"deploy_hosts.py: --repo {plain}: not a git checkout\n"


def test_deployment_file_errors_are_one_line(tmp_path: Path, checkout: tuple[Path, str]) -> None:
    repo, commit = checkout
    bad = write_deployment(
        tmp_path / "deploy.yaml",
        [{"name": "h", "transport": "ssh", "address": "127.0.0.1", "venv": "/v"}],
    )
    result = deploy("--deployment", str(bad), "--commit", commit, "--repo", str(repo), "--dry-run")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"deploy_hosts.py: {bad}: hosts.0: an ssh host needs user, identity_file, known_hosts_file"
    )


LOCAL_HOST = "{name: h, transport: local, venv: v}"


@pytest.mark.parametrize(
    "name, text, reason",
    [
        # Where and what, as launch_plan.py says it ("invalid YAML: while parsing a flow node").
        (
            "flow.yaml",
            "schema: narwhal.deployment/v1\nhosts: [\n",
            "invalid YAML at line 3 column 1: expected the node content, but found '<stream end>'",
        ),
        (
            "truncated.json",
            '{"schema": "narwhal.deployment/v1", "hosts": [',
            "invalid YAML at line 1 column 47: expected the node content, but found '<stream end>'",
        ),
        (
            "indent.yaml",
            "schema: narwhal.deployment/v1\nhosts:\n  - name: a\n    venv: v\n  bad: 1\n",
            "invalid YAML at line 5 column 3: expected <block end>, but found '?'",
        ),
        # A rule over the whole file named no field (": : duplicate host names: h").
        (
            "dup.yaml",
            f"schema: narwhal.deployment/v1\nhosts: [{LOCAL_HOST}, {LOCAL_HOST}]\n",
            "hosts.1.name: duplicate host name 'h' (hosts.0 has it too)",
        ),
    ],
)
def test_a_deployment_file_that_does_not_parse_says_where(
    tmp_path: Path, checkout: tuple[Path, str], name: str, text: str, reason: str
) -> None:
    repo, commit = checkout
    bad = tmp_path / name
    bad.write_text(text)
    result = deploy("--deployment", str(bad), "--commit", commit, "--repo", str(repo), "--dry-run")
    assert result.returncode == 2
    assert result.stderr == f"deploy_hosts.py: {bad}: {reason}\n"


def test_the_report_path_is_checked_before_any_host_is_deployed(
    tmp_path: Path, checkout: tuple[Path, str]
) -> None:
    """A --report in a directory that does not exist was found out after every host was
    deployed, as a FileNotFoundError traceback."""
    repo, commit = checkout
    deployment = write_deployment(
        tmp_path / "deploy.yaml",
        [{"name": "l", "transport": "local", "venv": "v", "python": BASE_PYTHON}],
    )
    args = ["--deployment", str(deployment), "--commit", commit, "--repo", str(repo)]
    missing = tmp_path / "missing" / "report.json"
    unwritable = Path("/proc/self/report.json")  # a directory nobody may create files in
    for report, reason in (
        (missing, f"directory {missing.parent} does not exist"),
        (tmp_path, "a directory; name the file to write"),
        (Path("/dev/null"), "not a regular file; name the file to write"),
    ):
        result = deploy(*args, "--report", str(report), timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr == f"deploy_hosts.py: --report {report}: {reason}\n"
        assert result.stdout == ""
        assert not (tmp_path / "v").exists()
    result = deploy(*args, "--report", str(unwritable), timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"deploy_hosts.py: --report {unwritable}: cannot write in")
    assert not (tmp_path / "v").exists()


def test_help_shows_the_defaults() -> None:
    result = deploy("--help", timeout=60)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "hosts deployed at once (default 8)" in text
    assert "in seconds (default 600)" in text


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("user", "-oProxyCommand=touch /tmp/pwned", "must be a login name"),
        ("user", "bad user", "must be a login name"),
        ("address", "-oProxyCommand=x", "must be a host name or an IP address"),
        ("address", "; rm -rf /", "must be a host name or an IP address"),
        ("install_deps", "yes", "Input should be a valid boolean"),
    ],
)
def test_host_fields_that_ssh_would_misread_are_refused(
    tmp_path: Path, checkout: tuple[Path, str], field: str, value: str, reason: str
) -> None:
    """USER@ADDRESS goes on ssh's command line: a value that begins with '-' is an option
    (-oProxyCommand runs a command on the deploying machine)."""
    repo, commit = checkout
    host = {
        "name": "h",
        "transport": "ssh",
        "address": "10.0.0.5",
        "user": "deploy",
        "identity_file": "id",
        "known_hosts_file": "known",
        "venv": "/v",
        field: value,
    }
    bad = write_deployment(tmp_path / "deploy.yaml", [host])
    result = deploy("--deployment", str(bad), "--commit", commit, "--repo", str(repo), "--dry-run")
    assert result.returncode == 2, result.stdout
    assert f"hosts.0.{field}" in result.stderr and reason in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "ssh" not in result.stdout


def test_good_host_names_and_addresses_pass(tmp_path: Path, checkout: tuple[Path, str]) -> None:
    repo, commit = checkout
    hosts = [
        {
            "name": f"h{i}",
            "transport": "ssh",
            "address": address,
            "user": user,
            "identity_file": "id",
            "known_hosts_file": "known",
            "venv": "/v",
        }
        for i, (address, user) in enumerate(
            [
                ("10.0.0.5", "deploy"),
                ("node-7.example.com", "ci_user"),
                ("fe80::1%eth0", "a.b"),
                ("engine_host_3", "alice@corp.example"),
            ]
        )
    ]
    (tmp_path / "id").write_text("key\n")
    (tmp_path / "known").write_text("")
    good = write_deployment(tmp_path / "deploy.yaml", hosts)
    result = deploy("--deployment", str(good), "--commit", commit, "--repo", str(repo), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "ci_user@node-7.example.com" in result.stdout


@pytest.mark.slow
def test_a_changed_host_key_and_an_unknown_one_say_which(
    sshd: Sshd, checkout: tuple[Path, str], tmp_path: Path
) -> None:
    """Both read "FAILED at stage: Host key verification failed.": ssh's deciding line says
    which, and a changed key may be a man-in-the-middle."""
    repo, commit = checkout
    _keygen(tmp_path / "impostor")
    changed = tmp_path / "known_hosts_changed"
    changed.write_text(f"[127.0.0.1]:{sshd.port} {(tmp_path / 'impostor.pub').read_text()}")
    unknown = tmp_path / "known_hosts_empty"
    unknown.write_text("")
    deployment = write_deployment(
        tmp_path / "deploy.yaml",
        [
            ssh_host(sshd, "changed", tmp_path / "r1", known_hosts_file=str(changed)),
            ssh_host(sshd, "unknown", tmp_path / "r2", known_hosts_file=str(unknown)),
        ],
    )
    report = tmp_path / "report.json"
    result = deploy(
        "--deployment", str(deployment), "--commit", commit, "--repo", str(repo),
        "--report", str(report),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    where = f"[127.0.0.1]:{sshd.port}"
    errors = {h["name"]: h["error"] for h in json.loads(report.read_text())["hosts"]}
    assert errors["changed"].startswith(
        f"Host key for {where} has changed and you have requested strict checking. "
    )
    assert "man-in-the-middle" in errors["changed"]
    assert errors["unknown"].startswith(f"No ED25519 host key is known for {where} and ")
    assert "man-in-the-middle" not in errors["unknown"]
    lines = result.stdout.splitlines()
    for name in ("changed", "unknown"):
        line = next(line for line in lines if line.startswith(f"{name} "))
        assert line.endswith(f": FAILED at stage: {errors[name]}")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
