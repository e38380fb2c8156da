"""narwhal-qualify: the reference qualification run as one command.

    narwhal-qualify RUN.yaml [--run-dir DIR] [--keep-running] [--checkout DIR]

Checks RUN.yaml (one line per problem, nothing started), then runs the chain in order:
plan-check, deploy, capture, finalize, profile, pin, plan, check, workload, benchmark, report,
bundle (see ``narwhal.qualify.steps``). A step whose outputs exist with the hashes its last run
recorded in RUN_DIR/steps.json, from the same inputs, is skipped; the engines and the router
come up only when a step that must run needs them. A failed gate stops the chain with the
gate's own explanation. At the end: the results table, the role timeline, the report and the
evidence bundle with its SHA-256.

A benchmark that ran every point through its gates and found a point below its attainment
target is a finished measurement: the report (saying which point failed and why) and the bundle
are still written, and the command then says the fleet did not qualify (exit 1). A rerun
reuses that measurement.

Exit status: 0 every step done (or already done) and the fleet qualified; 1 the chain stopped
at a step, or it finished and the fleet did not qualify; 2 the run file, the run directory or
the command line is wrong (nothing started).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from narwhal.qualify.bundle import BUNDLE_NAME
from narwhal.qualify.chain import ChainFailed, RunDirUnusable, run_chain
from narwhal.qualify.layout import BENCHMARK
from narwhal.qualify.runfile import RunFileError, load_run_file
from narwhal.qualify.steps import chain_steps, console_script

PROG = "narwhal-qualify"
# The console scripts the chain runs, as the reference run does (.venv/bin/narwhal-...).
SCRIPTS = ("narwhal-profile", "narwhal-check", "narwhal-serve")
MARKER = Path("tools") / "measurement" / "benchmark_runner.py"


def find_checkout(run_file: Path, given: str | None) -> Path | None:
    """The checkout whose tools/ the chain runs: --checkout, else the first directory holding
    tools/measurement/benchmark_runner.py above the run file, then above the working
    directory, then the checkout this package is installed from (``pip install -e``)."""
    if given:
        path = Path(given).resolve()
        return path if (path / MARKER).is_file() else None
    here = Path(__file__).resolve().parents[3]
    for start in (run_file.resolve().parent, Path.cwd().resolve(), here):
        for candidate in (start, *start.parents):
            if (candidate / MARKER).is_file():
                return candidate
    return None


def _section(markdown: Path, title: str) -> list[str]:
    """The lines of one ``## title`` section of a Markdown file (empty if absent)."""
    try:
        lines = markdown.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("## "):
            inside = line[3:].strip() == title
            continue
        if inside:
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    while out and not out[0].strip():
        out.pop(0)
    return out


def _render_report(run_dir: Path, title: str) -> str:
    # Imported here: the plots' library is only needed when the report step runs.
    from narwhal.qualify.report import write_report

    html, md = write_report(run_dir, title=title)
    return f"{html.name} and {md.name}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("run_file", metavar="RUN.yaml")
    p.add_argument("--run-dir", help="where the run's files go (default: the file's run_dir)")
    p.add_argument("--checkout", help="the Narwhal checkout whose tools/ run the steps")
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the router and the engines the chain started running at the end",
    )
    args = p.parse_args(argv)
    run_file = Path(args.run_file)
    checkout = find_checkout(run_file, args.checkout)
    if checkout is None:
        if args.checkout:
            why = f"--checkout {args.checkout}: not a Narwhal checkout (no {MARKER} in it)"
        else:
            why = "no Narwhal checkout (tools/ beside src/) found: use --checkout"
        print(f"{PROG}: {why}", file=sys.stderr)
        sys.exit(2)
    # --run-dir is the operator's path (relative to where they are); the file's run_dir is
    # relative to the checkout, like every path in it.
    run_dir = str(Path(args.run_dir).resolve()) if args.run_dir else None
    missing = [s for s in SCRIPTS if not Path(console_script(s)).is_file()]
    if missing:
        print(
            f"{PROG}: {', '.join(missing)} not beside {sys.executable}: install Narwhal into "
            "this environment (make install)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        loaded = load_run_file(run_file, checkout, run_dir)
    except RunFileError as exc:
        for line in exc.problems:
            print(f"{PROG}: {line}", file=sys.stderr)
        print(f"{PROG}: nothing started", file=sys.stderr)
        sys.exit(2)
    steps = chain_steps(loaded, _render_report)
    print(f"{PROG}: {loaded.run.name}: {len(steps)} steps into {loaded.run_dir}", flush=True)
    # SIGTERM (a supervisor, `kill`) and SIGHUP (a closed terminal) unwind like Ctrl-C: the
    # chain stops what it started.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        result = run_chain(loaded, steps, keep_running=args.keep_running)
    except RunDirUnusable as exc:
        # As the run file's other run_dir problems: nothing ran, so nothing to resume.
        print(f"{PROG}: run_dir: {exc}", file=sys.stderr)
        print(f"{PROG}: nothing started", file=sys.stderr)
        sys.exit(2)
    except ChainFailed as exc:
        print(f"{PROG}: stopped at {exc.step}: {exc}", flush=True)
        print(f"{PROG}: logs in {loaded.run_dir / 'logs'}; rerun resumes after the last done step")
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; rerun resumes after the last done step", file=sys.stderr)
        sys.exit(130)
    rd = loaded.run_dir
    not_declared = len(steps) - len(result.ran) - len(result.skipped)
    print(
        f"\n{PROG}: ran {len(result.ran)} step(s), skipped {len(result.skipped)}"
        + (f", {not_declared} not declared in the run file" if not_declared else "")
    )
    for title in ("Measured points", "State timeline"):
        lines = _section(rd / BENCHMARK / "report.md", title)
        if lines:
            print(f"\n{title}:\n" + "\n".join(lines))
    print(f"\nreport {rd / 'report.html'} (and report.md)")
    try:
        digest = (rd / (BUNDLE_NAME + ".sha256")).read_text().split()[0]
    except (OSError, IndexError):  # the bundle step checked it; it went since
        digest = "unknown (its .sha256 is gone)"
    print(f"evidence {rd / BUNDLE_NAME} sha256 {digest}")
    if result.failed_verdicts:
        why = "; ".join(f"{step}: {reason}" for step, reason in result.failed_verdicts)
        print(f"{PROG}: the fleet did not qualify: {why}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
