"""Build Narwhal at a pinned commit and install it into a venv on every host of a deployment.

    deploy_hosts.py --deployment DEPLOY.yaml --commit SHA [--repo .] [--dry-run]
                    [--work-dir DIR] [--jobs 8] [--step-timeout 600] [--report REPORT.json]

Per host: make the staging directory, copy the wheel, create the venv, install the wheel,
and verify that the venv's narwhal reports the pinned version and commit. Transports: ``ssh``
(the system ssh/scp with the deployment file's user, key and known-hosts file; batch mode,
strict host key checking, no ~/.ssh/config) and ``local``. Every host gets its own line in the
report; one failing host does not stop or hide the others.

Exit status: 0 every host verified; 1 a host failed; 2 bad arguments, an unreadable
deployment file, a dirty tree or a commit that is not HEAD.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run by path: the repository root for `tools` (tools/__init__.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from narwhal.contract.flags import positive
from narwhal.contract.yamlfile import load_yaml
from tools.deployment._deploy_build import (
    Build,
    BuildError,
    build_steps,
    build_wheel,
    planned_version,
    verify_tree,
)
from tools.deployment._files import write_atomic
from tools.deployment._yamlerror import yaml_error_line

__all__ = ["DeploymentFile", "HostSpec", "host_steps", "main"]

PROG = "deploy_hosts.py"
DEPLOYMENT_SCHEMA = "narwhal.deployment/v1"

# Run by the venv's python on the host. It prints what the host actually has installed, so
# the comparison is made here, against the build, not on trust.
VERIFY_SCRIPT = (
    "import hashlib, importlib.metadata as md, json, sys; "
    "import narwhal, narwhal._build_info as b; "
    "{extra}"
    "print(json.dumps({{'version': md.version('narwhal'), 'commit': b.COMMIT, "
    "'module': narwhal.__file__, "
    "'wheel_sha256': hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest()}}))"
)


class UsageError(Exception):
    pass


# A login (domain logins hold "@": ssh splits USER@HOST at the last one), never beginning with
# "-" (an option to ssh) and without blanks or control characters.
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,127}")
# A host name (DNS, or a container service's with "_") or IPv4 address, or an IPv6 address
# (with a zone index), never beginning with "-".
_ADDRESS = re.compile(
    r"(?!-)[A-Za-z0-9._-]{1,253}|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?"
)


class HostSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    transport: Literal["ssh", "local"]
    address: str | None = None
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    identity_file: str | None = None
    known_hosts_file: str | None = None
    connect_timeout_s: int = Field(default=10, ge=1)
    # On the host. Absolute for ssh hosts: a relative remote path depends on the login's home.
    venv: str = Field(min_length=1)
    stage_dir: str = "/tmp/narwhal-deploy"
    python: str = "python3"
    system_site_packages: StrictBool = False
    # False: install only the wheel (--no-deps, --no-index) into a venv that already has the
    # dependencies, e.g. through system_site_packages on a host without index access.
    install_deps: StrictBool = True

    # Both go on ssh's and scp's command lines as USER@ADDRESS: a value beginning with "-" would
    # be read as an option (-oProxyCommand=... runs a command here), and anything but a user
    # name or a host name / IP address is a mistake.
    @field_validator("user")
    @classmethod
    def _user(cls, value: str | None) -> str | None:
        if value is not None and not _USER.fullmatch(value):
            raise ValueError(
                "must be a login name (letters, digits, '_', '.', '@', '-'; not first '-')"
            )
        return value

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not _ADDRESS.fullmatch(value):
            raise ValueError("must be a host name or an IP address")
        return value

    @model_validator(mode="after")
    def _ssh_fields(self) -> HostSpec:
        if self.transport == "ssh":
            missing = [
                k
                for k in ("address", "user", "identity_file", "known_hosts_file")
                if getattr(self, k) is None
            ]
            if missing:
                raise ValueError(f"an ssh host needs {', '.join(missing)}")
            for key in ("venv", "stage_dir"):
                if not getattr(self, key).startswith("/"):
                    raise ValueError(f"{key} must be an absolute path on an ssh host")
        return self


class DeploymentFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal["narwhal.deployment/v1"] = Field(alias="schema")
    hosts: list[HostSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> DeploymentFile:
        first: dict[str, int] = {}
        for i, h in enumerate(self.hosts):
            if h.name in first:
                raise ValueError(
                    f"hosts.{i}.name: duplicate host name {h.name!r} (hosts.{first[h.name]} has "
                    "it too)"
                )
            first[h.name] = i
        return self


def load_deployment(path: Path, missing: list[str] | None = None) -> DeploymentFile:
    """The deployment file, its key files resolved (relative to it) and checked; with
    ``missing`` (a dry run), a key file that does not exist is listed there instead of
    refused."""
    try:
        raw = load_yaml(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: {yaml_error_line(exc)}") from None
    try:
        spec = DeploymentFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        msg = str(err["msg"]).removeprefix("Value error, ")
        # A rule over the whole file (duplicate names) has no field of its own: its message
        # names the place.
        raise UsageError(f"{path}: {where + ': ' if where else ''}{msg}{more}") from None
    # Key files are on this machine, relative to the deployment file like the file's readers
    # expect; check them now rather than let ssh fail the same way on every host.
    hosts = []
    for h in spec.hosts:
        updates: dict[str, Any] = {}
        for key in ("identity_file", "known_hosts_file"):
            value = getattr(h, key)
            if value is not None:
                resolved = (path.parent / Path(value).expanduser()).resolve()
                if not resolved.is_file():
                    problem = f"{path}: host {h.name}: {key} {resolved} does not exist"
                    if missing is None:
                        raise UsageError(problem)
                    missing.append(problem)
                updates[key] = str(resolved)
        if h.transport == "local":
            for key in ("venv", "stage_dir"):
                updates[key] = str((path.parent / getattr(h, key)).resolve())
        hosts.append(h.model_copy(update=updates))
    return spec.model_copy(update={"hosts": hosts})


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]


def _ssh_options(h: HostSpec) -> list[str]:
    assert h.identity_file and h.known_hosts_file
    return [
        "-F", "/dev/null",  # the deployment file is the whole configuration
        "-i", h.identity_file,
        "-o", "IdentitiesOnly=yes",
        "-o", "BatchMode=yes",  # never prompt: a prompt would hang an unattended deploy
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={h.known_hosts_file}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", f"ConnectTimeout={h.connect_timeout_s}",
    ]  # fmt: skip


def _on_host(h: HostSpec, argv: list[str]) -> list[str]:
    if h.transport == "local":
        return argv
    return [
        "ssh",
        *_ssh_options(h),
        "-p",
        str(h.port),
        f"{h.user}@{h.address}",
        "--",
        shlex.join(argv),
    ]


def _copy(h: HostSpec, src: Path, dest_dir: str) -> list[str]:
    if h.transport == "local":
        return ["cp", str(src), dest_dir + "/"]
    address = f"[{h.address}]" if h.address and ":" in h.address else h.address
    return [
        "scp",
        *_ssh_options(h),
        "-P",
        str(h.port),
        "-q",
        str(src),
        f"{h.user}@{address}:{dest_dir}/",
    ]


def host_steps(h: HostSpec, wheel: Path) -> list[Step]:
    staged = f"{h.stage_dir}/{wheel.name}"
    py = f"{h.venv}/bin/python"
    venv = [
        h.python,
        "-m",
        "venv",
        *(["--system-site-packages"] if h.system_site_packages else []),
        h.venv,
    ]
    install = [py, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps"]
    if not h.install_deps:
        install.append("--no-index")  # nothing to fetch: fail rather than reach for an index
    steps = [
        Step("stage", _on_host(h, ["mkdir", "-p", h.stage_dir])),
        Step("copy", _copy(h, wheel, h.stage_dir)),
        Step("venv", _on_host(h, venv)),
        Step("install", _on_host(h, [*install, staged])),
    ]
    if h.install_deps:
        steps.append(Step("dependencies", _on_host(h, [py, "-m", "pip", "install", "-q", staged])))
    extra = "import narwhal.contract; " if h.install_deps else ""
    script = VERIFY_SCRIPT.format(extra=extra)
    # Isolated (-I): what the venv installed, not a narwhal an inherited PYTHONPATH points at.
    steps.append(Step("verify", _on_host(h, [py, "-I", "-c", script, staged])))
    return steps


@dataclass
class HostResult:
    name: str
    target: str
    ok: bool = False
    failed_step: str | None = None
    error: str | None = None
    installed: dict[str, Any] = field(default_factory=dict)


def _target(h: HostSpec) -> str:
    if h.transport == "local":
        return f"local {h.venv}"
    return f"ssh {h.user}@{h.address}:{h.port} {h.venv}"


# ssh's own verdict on a host key, which comes before its generic last word ("Host key
# verification failed.", and scp's "Connection closed" after it) and tells the cases apart.
_KEY_CHANGED = re.compile(r"^Host key for \S+ has changed and you have requested strict checking\.")
_KEY_UNKNOWN = re.compile(
    r"^No \S+ host key is known for \S+ and you have requested strict checking\."
)


def failure_line(stderr: str, returncode: int) -> str:
    """The line of a failed step's stderr that says why: ssh's host key verdict when there is
    one (a changed key flagged as a possible man-in-the-middle), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in lines:
        if _KEY_CHANGED.match(line):
            return (
                f"{line} The host presents a key other than the one known_hosts_file has for "
                "it: it may be a man-in-the-middle attack (or a reinstalled host); verify the "
                "new key out of band before replacing the entry"
            )
    for line in lines:
        if _KEY_UNKNOWN.match(line):
            return f"{line} Add the host's key to known_hosts_file"
    return lines[-1] if lines else f"exit {returncode}"


def deploy_host(h: HostSpec, build: Build, timeout_s: float) -> HostResult:
    result = HostResult(h.name, _target(h))
    for step in host_steps(h, build.wheel):
        try:
            proc = subprocess.run(
                step.argv,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            result.failed_step, result.error = step.name, f"timed out after {timeout_s:g} s"
            return result
        except OSError as exc:
            result.failed_step, result.error = step.name, f"{step.argv[0]}: {exc.strerror}"
            return result
        if proc.returncode != 0:
            result.failed_step, result.error = step.name, failure_line(proc.stderr, proc.returncode)
            return result
        if step.name == "verify":
            return _check_installed(result, proc.stdout, build)
    return result


def _check_installed(result: HostResult, stdout: str, build: Build) -> HostResult:
    try:
        result.installed = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result.failed_step, result.error = "verify", f"unreadable answer: {stdout.strip()[:200]!r}"
        return result
    wrong = [
        f"{key} {result.installed.get(key)!r} (expected {want!r})"
        for key, want in (
            ("version", build.version),
            ("commit", build.commit),
            ("wheel_sha256", build.sha256),
        )
        if result.installed.get(key) != want
    ]
    if wrong:
        result.failed_step, result.error = "verify", "installed " + "; ".join(wrong)
    else:
        result.ok = True
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--deployment", required=True, help="YAML or JSON file listing the hosts")
    p.add_argument("--commit", required=True, help="the commit to deploy (must be HEAD)")
    p.add_argument("--repo", default=".", help="the git checkout to build from (default .)")
    p.add_argument("--dry-run", action="store_true", help="print every step, run none")
    p.add_argument("--work-dir", help="build directory (default: a temporary one)")
    p.add_argument(
        "--jobs", type=positive(int), default=8, help="hosts deployed at once (default %(default)s)"
    )
    p.add_argument(
        "--step-timeout",
        type=positive(float),
        default=600.0,
        help="bound on each step and on the build, in seconds (default %(default)g)",
    )
    p.add_argument("--report", help="also write the per-host report as JSON here")
    return p


def _report_path(value: str | None) -> Path | None:
    """--report, checked before anything is built or deployed: a path that cannot be written
    found out after every host was deployed lost the report (and said so with a traceback)."""
    if value is None:
        return None
    report = Path(value)
    if report.is_dir():
        raise UsageError(f"--report {report}: a directory; name the file to write")
    if not report.parent.is_dir():
        raise UsageError(f"--report {report}: directory {report.parent} does not exist")
    if report.exists() and not report.is_file():
        raise UsageError(f"--report {report}: not a regular file; name the file to write")
    try:
        with tempfile.NamedTemporaryFile(dir=report.parent, prefix=".narwhal-"):
            pass
    except OSError as exc:
        raise UsageError(
            f"--report {report}: cannot write in {report.parent}: {exc.strerror or exc}"
        ) from None
    return report


def run(args: argparse.Namespace) -> int:
    report = _report_path(args.report)
    missing: list[str] = []
    deployment = load_deployment(Path(args.deployment), missing if args.dry_run else None)
    for problem in missing:  # a dry run shows the steps anyway: the keys may come later
        print(f"{PROG}: dry run: {problem}", file=sys.stderr)
    repo = Path(args.repo).resolve()
    try:
        commit = verify_tree(repo, args.commit)
    except BuildError as exc:
        raise UsageError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="narwhal-deploy-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        if args.dry_run:
            try:
                steps, version = build_steps(repo, commit, work), planned_version(repo, commit)
            except BuildError as exc:
                raise UsageError(str(exc)) from None
            for line in steps:
                print(f"[build] {line}")
            wheel = work / "dist" / f"narwhal-{version}-py3-none-any.whl"
            for h in deployment.hosts:
                for step in host_steps(h, wheel):
                    print(f"[{h.name}] {step.name}: {shlex.join(step.argv)}")
            return 0
        try:
            build = build_wheel(repo, commit, work / "build", timeout_s=args.step_timeout)
        except BuildError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 1
        print(f"built {build.wheel.name} sha256 {build.sha256} ({build.how})")
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(
                pool.map(lambda h: deploy_host(h, build, args.step_timeout), deployment.hosts)
            )
    for r in results:
        if r.ok:
            got = r.installed
            print(f"{r.name} ({r.target}): ok narwhal {got['version']} commit {got['commit']}")
        else:
            print(f"{r.name} ({r.target}): FAILED at {r.failed_step}: {r.error}")
    failed = [r.name for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} hosts verified at {commit}")
    if report is not None:
        doc = {
            "schema": "narwhal.deployment-report/v1",
            "commit": commit,
            "version": build.version,
            "wheel": build.wheel.name,
            "wheel_sha256": build.sha256,
            "hosts": [asdict(r) for r in results],
        }
        try:
            write_atomic(report, json.dumps(doc, indent=2) + "\n")
        except OSError as exc:
            print(
                f"{PROG}: --report {report}: cannot write: {exc.strerror or exc}", file=sys.stderr
            )
            return 1
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
