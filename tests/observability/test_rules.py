"""The alert rules: valid for promtool, unit-tested by `promtool test rules` with each alert
shown firing and not firing, and covering every alert the issue asks for."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.observability.support import PROMETHEUS_DIR, RULE_TESTS, RULES, SCRAPE_CONFIG, binary

# The issue's list, each with the alert(s) that answer it.
REQUIRED = {
    "attainment below target": {"NarwhalAttainmentBelowTarget"},
    "deadlines exceeded rising": {"NarwhalFirstTokenDeadlinesRising"},
    "stranded handoffs": {"NarwhalStrandedHandoffs"},
    "an engine down or breaker open": {
        "NarwhalEngineUnhealthy",
        "NarwhalEngineScrapeDown",
        "NarwhalEngineBreakerOpen",
    },
    "profile drift": {"NarwhalProfileDrift"},
    "journal backlog or write errors": {"NarwhalJournalBacklog", "NarwhalJournalWriteErrors"},
    "no engine in a role": {"NarwhalNoEngineInRole"},
    "a migration rate that says an engine is failing": {"NarwhalMigrationsRising"},
    "etcd unreachable": {"NarwhalCoordinationDown"},
    "no role leader, or more than one": {"NarwhalRoleLeaderNotOne"},
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _alerts() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_promtool_check_rules() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


def test_promtool_check_config_of_the_committed_scrape_config() -> None:
    r = _promtool("check", "config", str(SCRAPE_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_test_rules() -> None:
    r = _promtool("test", "rules", str(RULE_TESTS.relative_to(PROMETHEUS_DIR)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rule_tests_show_every_alert_firing_and_not_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    firing: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case.get("alert_rule_test") or []:
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(_alerts()) <= firing, f"never shown firing: {set(_alerts()) - firing}"
    assert set(_alerts()) <= silent, f"never shown silent: {set(_alerts()) - silent}"


def test_rules_answer_every_alert_the_issue_lists() -> None:
    alerts = _alerts()
    for need, names in REQUIRED.items():
        assert names <= set(alerts), f"{need}: missing {names - set(alerts)}"
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["runbook"] == f"docs/operations.md#{name.lower()}", name


def test_scrape_config_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    """A bad fleet file, router address, interval or output path: exit 2 and one line naming
    it (they were tracebacks, or a configuration Prometheus would refuse written silently)."""
    from tools.observability import scrape_config

    fleet = Path(__file__).resolve().parents[2] / "configs" / "fleet" / "local-sim.json"
    duplicate = json.loads(fleet.read_text())
    duplicate["engines"].append(duplicate["engines"][0])
    dup_path = tmp_path / "dup.json"
    dup_path.write_text(json.dumps(duplicate))
    ok = ["--fleet", str(fleet), "--router", "127.0.0.1:9"]
    for argv in (
        ["--fleet", str(tmp_path / "missing.json"), "--router", "127.0.0.1:9"],
        ["--fleet", str(dup_path), "--router", "127.0.0.1:9"],
        ["--fleet", str(fleet), "--router", "notahostport"],
        [*ok, "--interval", "abc"],
        [*ok, "--out", "/proc/narwhal-test/prometheus.yml"],
    ):
        try:
            code = scrape_config.main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        assert code == 2, argv
    out = tmp_path / "prometheus.yml"
    assert scrape_config.main([*ok, "--interval", "1m30s", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["global"]["scrape_interval"] == "1m30s"


def test_scrape_config_reads_its_fleet_once(tmp_path: Path) -> None:
    """The fleet is read once, as narwhal-serve reads it: a file with a byte order mark (read
    past since JSON files may carry one; the second read was Python's own traceback) and a pipe
    (a shell's process substitution, which cannot be read twice) both give the configuration."""
    from tools.observability import scrape_config

    fleet = Path(__file__).resolve().parents[2] / "configs" / "fleet" / "local-sim.json"
    marked = tmp_path / "marked.json"
    marked.write_bytes(b"\xef\xbb\xbf" + fleet.read_bytes())
    plain, bom = tmp_path / "plain.yml", tmp_path / "bom.yml"
    assert (
        scrape_config.main(["--fleet", str(fleet), "--router", "127.0.0.1:9", "--out", str(plain)])
        == 0
    )
    assert (
        scrape_config.main(["--fleet", str(marked), "--router", "127.0.0.1:9", "--out", str(bom)])
        == 0
    )
    assert yaml.safe_load(bom.read_text()) == yaml.safe_load(plain.read_text())
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as writer:
        writer.write(fleet.read_bytes())
    piped = tmp_path / "piped.yml"
    try:
        code = scrape_config.main(
            ["--fleet", f"/dev/fd/{read_fd}", "--router", "127.0.0.1:9", "--out", str(piped)]
        )
    finally:
        os.close(read_fd)
    assert code == 0
    assert (
        yaml.safe_load(piped.read_text())["scrape_configs"]
        == yaml.safe_load(plain.read_text())["scrape_configs"]
    )
