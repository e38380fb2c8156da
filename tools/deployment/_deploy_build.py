"""Building Narwhal at a pinned commit into a wheel that says which commit it is.

The build never touches the working tree: it refuses a tree whose tracked files differ from
HEAD or a commit other than HEAD (what is deployed must be what was reviewed and what the
checkout shows), exports the commit with ``git archive`` into a scratch directory, stamps the
copy (version ``X.Y.Z+g<12 hex>`` and a generated ``narwhal/_build_info.py``) and builds a wheel
there with pip.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Build", "BuildError", "build_steps", "build_wheel", "verify_tree"]


class BuildError(Exception):
    pass


@dataclass(frozen=True)
class Build:
    commit: str
    version: str
    wheel: Path
    sha256: str
    how: str


def _git(repo: Path, *args: str) -> str:
    try:
        result = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"git {' '.join(args)}: {exc}") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise BuildError(f"git {' '.join(args)}: {last}")
    return result.stdout.strip()


def verify_tree(repo: Path, commit: str) -> str:
    """The full hash of ``commit`` if it is HEAD of a clean tree; BuildError otherwise."""
    if not repo.is_dir():
        raise BuildError(f"--repo {repo}: no such directory")
    try:
        _git(repo, "rev-parse", "--git-dir")
    except BuildError:
        # Said as such: "not a commit in /tmp" sent the reader looking for a wrong --commit.
        raise BuildError(f"--repo {repo}: not a git checkout") from None
    try:
        full = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except BuildError:
        raise BuildError(f"--commit {commit}: not a commit in {repo}") from None
    head = _git(repo, "rev-parse", "HEAD")
    if full != head:
        raise BuildError(
            f"--commit {commit} is {full[:12]} but {repo} has {head[:12]} checked out; "
            "check out the commit to deploy"
        )
    # Untracked files are not in `git archive` and so cannot reach the build; changes to
    # tracked files would make the checkout differ from what is deployed.
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        n = len(dirty.splitlines())
        raise BuildError(
            f"{repo} has uncommitted changes to {n} tracked file{'s' if n != 1 else ''} "
            f"(first: {dirty.splitlines()[0].split(maxsplit=1)[1]}); commit or stash them"
        )
    return full


def _stamped(version: str, commit: str) -> str:
    return f"{version}+g{commit[:12]}"


def _project_version(pyproject_text: str) -> str:
    try:
        project = tomllib.loads(pyproject_text).get("project", {})
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"pyproject.toml does not parse: {exc}") from None
    if "version" not in project:
        raise BuildError("pyproject.toml has no static [project] version to stamp")
    return str(project["version"])


def planned_version(repo: Path, commit: str) -> str:
    """The version ``build_wheel`` stamps into a build of ``commit``, read from the commit's
    pyproject.toml without building (what --dry-run names the wheel by)."""
    return _stamped(_project_version(_git(repo, "show", f"{commit}:pyproject.toml")), commit)


def build_steps(repo: Path, commit: str, work: Path) -> list[str]:
    """What build_wheel does, for --dry-run."""
    version = planned_version(repo, commit)
    return [
        f"git -C {repo} archive --format=tar {commit} > {work}/source.tar; extract to {work}/src",
        f"stamp {work}/src: version {version}, src/narwhal/_build_info.py (COMMIT={commit})",
        f"{sys.executable} -m pip wheel --no-deps [--no-build-isolation] -w {work}/dist {work}/src",
    ]


_VERSION_LINE = re.compile(r'^(version\s*=\s*)"([^"]+)"\s*$', re.M)


def _stamp(src: Path, commit: str, commit_time: str) -> str:
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    version = _stamped(_project_version(text), commit)
    start = text.index("[project]")
    match = _VERSION_LINE.search(text, start)
    if match is None:
        raise BuildError("cannot find the [project] version line in pyproject.toml")
    text = text[: match.start()] + f'{match.group(1)}"{version}"' + text[match.end() :]
    if tomllib.loads(text)["project"]["version"] != version:
        raise BuildError("stamping the version changed something else in pyproject.toml")
    pyproject.write_text(text)
    package = src / "src" / "narwhal"
    if not package.is_dir():
        raise BuildError("the commit has no src/narwhal package")
    (package / "_build_info.py").write_text(
        '"""Written into the build by tools/deployment/deploy_hosts.py; not in git."""\n'
        "\n"
        f"COMMIT = {commit!r}\n"
        f"VERSION = {version!r}\n"
        f"COMMIT_TIME = {int(commit_time)}\n"
    )
    return version


def _pip_wheel(src: Path, dist: Path, isolated: bool, env: dict[str, str], timeout_s: float) -> str:
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)]
    if not isolated:
        argv.insert(5, "--no-build-isolation")
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s"
    if result.returncode == 0:
        return ""
    lines = [ln.strip() for ln in (result.stderr + result.stdout).splitlines() if ln.strip()]
    # pip ends with generic hints; the backend's own complaint is the line that explains.
    named = [ln for ln in lines if ln.startswith(("ValueError", "configuration error", "ERROR"))]
    return (named or lines or [f"exit {result.returncode}"])[0]


def build_wheel(repo: Path, commit: str, work: Path, timeout_s: float = 300.0) -> Build:
    work.mkdir(parents=True, exist_ok=True)
    tar = work / "source.tar"
    _git(repo, "archive", "--format=tar", "-o", str(tar), commit)
    src = work / "src"
    with tarfile.open(tar) as archive:
        archive.extractall(src, filter="data")
    commit_time = _git(repo, "show", "-s", "--format=%ct", commit)
    version = _stamp(src, commit, commit_time)
    dist = work / "dist"
    # Wheel timestamps from the commit, not the clock: the same commit builds the same bytes.
    env = {**os.environ, "SOURCE_DATE_EPOCH": commit_time}
    # Without isolation pip uses this interpreter's setuptools: offline, and enough when it
    # meets pyproject's build requirements. Otherwise pip fetches them into an isolated env.
    how = "pip wheel --no-build-isolation"
    error = _pip_wheel(src, dist, isolated=False, env=env, timeout_s=timeout_s)
    if error:
        how = f"pip wheel with build isolation (without: {error})"
        error = _pip_wheel(src, dist, isolated=True, env=env, timeout_s=timeout_s)
        if error:
            raise BuildError(f"building the wheel failed: {error}")
    wheels = sorted(dist.glob("narwhal-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one narwhal wheel in {dist}, found {len(wheels)}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    return Build(commit, version, wheels[0], digest, how)
