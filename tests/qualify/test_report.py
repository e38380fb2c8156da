"""The qualification report (narwhal.qualify.report), built from a real small run on simulated
engines and rendered in headless chromium: every plot present with its SVG, no console error.
The harness is shown able to fail: a page with a broken script reports its console error, and a
figure without its SVG is named."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from narwhal.qualify.report import PLOT_IDS, ReportError, write_report
from tests.helpers import admin, running_fleet, running_router
from tests.measurement.support import (
    SIM,
    journal_has,
    load_trial,
    point,
    run_runner,
    runner_cmd,
    when,
    write_plan,
)
from tests.qualify.browser import load_page

REQUESTS = 24


def real_run(work: Path) -> Path:
    """A qualification run directory, as narwhal-qualify lays it out, from a real run: three
    simulated engines, narwhal-check on them, narwhal-serve, a workload, and benchmark_runner
    over two points with an operator's role flip during the first. About 20 s."""
    run = work / "RUN"
    run.mkdir()
    with (
        running_fleet(
            work,
            3,
            sim=SIM,
            initial_roles=["prefill", "prefill", "decode"],
            prefix_caching={"enabled": False},
        ) as fleet,
    ):
        check = subprocess.run(
            [
                *(sys.executable, "-m", "narwhal.check.cli", "--quiet"),
                *("--fleet", str(fleet.fleet_path), "--report", str(run / "check-report.json")),
                *("--pace-repeats", "1", "--kv-probes", "1"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        with running_router(work, fleet.fleet_path) as router:
            wl_dir = work / "workload"
            prep = load_trial(
                "prepare",
                "--base",
                router.url,
                "--input-tokens",
                "2048",
                "--output-tokens",
                "32",
                "--seed",
                "1729",
                "--num-prompts",
                str(REQUESTS),
                "--out",
                str(wl_dir),
                "--tokenize-url",
                fleet.engines["e0"].url,
            )
            assert prep.returncode == 0, prep.stderr
            plan = write_plan(
                work / "plan.json",
                fleet.fleet_path,
                [point("low", 8.0, REQUESTS), point("high", 16.0, REQUESTS)],
                2048,
                32,
                seed=1729,
            )
            flipper = when(
                lambda: journal_has(router.journal, '"client_request_id":"low-', 8),
                lambda: admin(
                    router.url, body={"engine": "e1", "to": "decode"}, path="/admin/roles/flip"
                ),
                timeout=60,
            )
            proc = run_runner(
                runner_cmd(
                    router.url,
                    plan,
                    run / "benchmark",
                    None,
                    wl_dir,
                    "--admin-token-file",
                    str(work / "admin-token"),
                )
            )
            flipper.join(1)
        assert proc.returncode in (0, 1), proc.stderr
        shutil.copyfile(router.journal, run / "router-journal.jsonl")
        shutil.copyfile(fleet.fleet_path, run / "fleet-qualified.json")
    return run


class _Figures(HTMLParser):
    """Each ``figure.plot`` in a DOM (by id) and whether an ``<svg>`` sits inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, bool] = {}
        self._current: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "figure" and "plot" in (a.get("class") or "").split():
            self._current = a.get("id") or f"<figure #{len(self.figures)} without id>"
            self.figures[self._current] = False
        elif tag == "svg" and self._current is not None:
            self.figures[self._current] = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._current = None


def figures(dom: str) -> dict[str, bool]:
    parser = _Figures()
    parser.feed(dom)
    return parser.figures


def problems(dom: str, expected: tuple[str, ...]) -> list[str]:
    """What is wrong with a rendered report's plots: a figure missing or without its SVG."""
    found = figures(dom)
    out = [f"no figure.plot#{i}" for i in expected if i not in found]
    out += [f"figure.plot#{i} has no <svg>" for i in expected if i in found and not found[i]]
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_run(tmp_path_factory.mktemp("qualify-run"))


@pytest.mark.slow
def test_report_renders_every_plot_in_chromium(run_dir: Path) -> None:
    html_path, md_path = write_report(run_dir, title="Qualification: local-sim")
    assert (html_path, md_path) == (run_dir / "report.html", run_dir / "report.md")
    page = load_page(html_path)
    assert page.console_errors == [], page.console
    assert problems(page.dom, PLOT_IDS) == []
    # Nothing outside the page: no script, no external resource.
    assert "<script" not in page.dom
    assert re.findall(r'(?:src|href)="(?!#)[^"]*"', page.dom) == []
    # The reference run's table, as benchmark/report.md has it, one row per point.
    bench_md = (run_dir / "benchmark" / "report.md").read_text()
    table = bench_md.split("## Measured points")[1].split("## Evidence per point")[0]
    rows = [r for r in table.splitlines() if r.startswith(("| low | ", "| high | "))]
    assert len(rows) == 2, bench_md
    for row in rows:
        # Point to Result: the page words its verdict column itself.
        cells = [c.strip() for c in row.strip("|").split("|")][:7]
        assert all(cell in page.dom for cell in cells), (cells, row)
    assert page.dom.count(f"/{REQUESTS} within limits") >= 2
    # Pinned inputs and the qualification gates.
    assert "Fleet SHA-256" in page.dom and "Fleet latency budgets" in page.dom
    assert "kv_transfer" in page.dom and "check-report.json verdict" in page.dom
    # Only the profile store is missing from this run (the harness fleet has none): said so.
    assert "no profile-store.json in the run directory" in page.dom
    assert "Not plotted" not in page.dom
    # The role flip the run made is on the timeline's caption.
    assert "1 role flip(s) journaled" in page.dom
    # The Markdown: the same tables, each plot an SVG file beside it.
    md = md_path.read_text()
    assert "| Point | Offered rate | Completed rate including drain |" in md
    for plot_id in PLOT_IDS:
        assert f"](report-plots/{plot_id}.svg)" in md
        svg = (run_dir / "report-plots" / f"{plot_id}.svg").read_text()
        assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")


@pytest.mark.slow
def test_report_without_optional_inputs_says_so(run_dir: Path, tmp_path: Path) -> None:
    """Only benchmark/report.json: every other input named as missing, no traceback, and the
    page still loads cleanly."""
    bare = tmp_path / "bare"
    (bare / "benchmark").mkdir(parents=True)
    shutil.copyfile(run_dir / "benchmark" / "report.json", bare / "benchmark" / "report.json")
    html_path, md_path = write_report(bare, title="bare")
    page = load_page(html_path)
    assert page.console_errors == [], page.console
    # Attainment needs only report.json's summaries; every other plot says why it is absent.
    assert figures(page.dom) == {plot_id: plot_id == "attainment" for plot_id in PLOT_IDS}
    for missing in (
        "no fleet-qualified.json in the run directory",
        "no check-report.json in the run directory",
        "no router-journal.jsonl in the run directory",
        "point low: no client records",
        "Not plotted: no readable check-report.json",
    ):
        assert missing in page.dom, missing
    # The results table comes from report.json alone.
    assert f"/{REQUESTS} within limits" in page.dom
    assert "Not plotted" in md_path.read_text()
    assert not (bare / "report-plots" / "ttft.svg").exists()


@pytest.mark.slow
def test_role_timeline_from_admin_state_without_a_journal(run_dir: Path, tmp_path: Path) -> None:
    """No journal: the role timeline comes from the points' /admin/state snapshots, the flip
    in the first point's history included."""
    partial = tmp_path / "partial"
    shutil.copytree(run_dir / "benchmark", partial / "benchmark")
    html_path, _ = write_report(partial, title="partial")
    page = load_page(html_path)
    assert page.console_errors == [], page.console
    assert problems(page.dom, PLOT_IDS) == ["figure.plot#kv-probes has no <svg>"]
    assert "from the points' /admin/state snapshots" in page.dom
    assert "no router-journal.jsonl in the run directory" in page.dom


@pytest.mark.slow
def test_a_failing_verdict_says_which_point_failed_and_why(run_dir: Path, tmp_path: Path) -> None:
    """A fleet that missed a point's attainment target: the page says fail, names the point,
    its attainment against its target and how many requests broke which budget."""
    failed = tmp_path / "failed"
    shutil.copytree(run_dir, failed)
    path = failed / "benchmark" / "report.json"
    bench = json.loads(path.read_text())
    high = next(p for p in bench["points"] if p["name"] == "high")
    summary = high["summary"]
    # Held to a TTFT budget at its own median: about half its requests are over it.
    budget = summary["ttft_s"]["p50"]
    summary["budgets"]["ttft_s"] = budget
    summary.update(verdict="fail", attainment=0.5, result=f"12/{REQUESTS} within limits")
    bench.update(overall="fail", overall_reason="a measured point missed its attainment target")
    path.write_text(json.dumps(bench))
    point_dir = failed / "benchmark" / "points" / Path(high["evidence_dir"]).name
    records = point_dir / "client" / "client_records.jsonl"
    over = 0
    for line in records.read_text().splitlines():
        rec = json.loads(line)
        if not rec["warmup"] and rec["outcome"] == "ok":
            over += rec["first_token_s"] - rec["sent_s"] > budget
    assert 0 < over < REQUESTS
    html_path, md_path = write_report(failed, title="failed")
    # (How many ran over the TPOT budget depends on this machine's load: counted, not fixed.)
    why = (
        f"point high: 12/{REQUESTS} within limits, attainment 0.500 below its target 0.95: "
        f"{over} over the TTFT budget of {budget:g} s, "
    )
    md = md_path.read_text()
    assert "Overall: **fail**" in md and "The fleet did not qualify:" in md
    # (Point low is listed too when this loaded machine made it miss its own target.)
    lines = [ln for ln in md.splitlines() if ln.startswith("- point high:")]
    assert len(lines) == 1 and lines[0].startswith(f"- {why}"), lines
    assert re.search(r", \d+ over the TPOT budget of [\d.]+ ms, 0 not completed$", lines[0]), lines
    assert "| FAIL (0.500 < target 0.95) |" in md
    page = load_page(html_path)
    assert page.console_errors == [], page.console
    assert 'class="verdict fail"' in page.dom and why in page.dom


def test_missing_benchmark_report_is_a_report_error(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"benchmark/report\.json"):
        write_report(tmp_path, title="nothing")


def test_harness_reports_a_console_error(tmp_path: Path) -> None:
    """The negative control: a page whose script fails is reported, with the error's text; a
    page without one is clean."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><head><title>bad</title></head><body><p>x</p>"
        "<script>undefinedFunction()</script></body></html>"
    )
    page = load_page(bad)
    assert len(page.console_errors) == 1, page.console
    assert "undefinedFunction is not defined" in page.console_errors[0]
    assert "<p>x</p>" in page.dom
    good = tmp_path / "good.html"
    good.write_text("<!DOCTYPE html><html><head><title>ok</title></head><body>ok</body></html>")
    assert load_page(good).console_errors == []


def test_harness_names_a_figure_without_its_svg() -> None:
    dom = (
        '<figure class="plot" id="ttft"><svg></svg><figcaption>a</figcaption></figure>'
        '<figure class="plot" id="tpot"><p>none</p><figcaption>b</figcaption></figure>'
    )
    assert problems(dom, ("ttft", "tpot", "itl")) == [
        "no figure.plot#itl",
        "figure.plot#tpot has no <svg>",
    ]
