"""docs/metrics.md lists every exported metric with its real type and labels, and says which
panels and alerts use it exactly as the dashboards and rules do; docs/operations.md has a
runbook section for every alert."""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.observability.support import DASHBOARDS, DOCS, RULES, expositions
from tools.observability.promql_check import dashboard_queries, query_metric_names, rule_queries

SHORT = {"narwhal-router-overview.json": "Overview", "narwhal-fleet-roles.json": "Fleet"}
_SUFFIX = re.compile(r"_(bucket|count|sum)$")


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in (DOCS / "metrics.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"`[\w:]+`", cells[0]):
            assert cells[0] not in rows, f"{cells[0]} listed twice"
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _exported() -> dict[str, tuple[str, set[str]]]:
    """PromQL name -> (type, labels) of every family the router and an engine export."""
    out: dict[str, tuple[str, set[str]]] = {}
    for text in expositions():
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):
                continue  # prometheus_client's creation timestamps
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {k for s in family.samples for k in s.labels} - {"le"}
            out[name] = (family.type, labels)
    return out


def _usage() -> dict[str, tuple[set[str], set[str]]]:
    usage: dict[str, tuple[set[str], set[str]]] = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        for q in dashboard_queries(json.loads(path.read_text()), path.name):
            where, title = re.match(r".*?: (\w+) '(.*?)'", q.source).groups()  # type: ignore[union-attr]
            label = f"{SHORT[path.name]}: {title}" + ("" if where == "panel" else f" ({where})")
            for name in query_metric_names(q):
                usage.setdefault(_SUFFIX.sub("", name), (set(), set()))[0].add(label)
    for q in rule_queries(yaml.safe_load(RULES.read_text()), RULES.name):
        for name in query_metric_names(q):
            usage.setdefault(_SUFFIX.sub("", name), (set(), set()))[1].add(q.source.split()[-1])
    return usage


def _cell(text: str, sep: str) -> set[str]:
    return {part.strip() for part in text.split(sep) if part.strip()}


def test_every_exported_metric_has_a_row_with_its_type_and_labels() -> None:
    rows = _rows()
    exported = _exported()
    assert set(exported) - set(rows) == set(), "metrics missing from docs/metrics.md"
    for name, (kind, labels) in exported.items():
        doc_kind, doc_labels = rows[name][0], rows[name][1]
        assert doc_kind == kind, f"{name}: documented as {doc_kind}, exported as {kind}"
        assert set(re.findall(r"`(\w+)`", doc_labels)) == labels, f"{name}: labels"
    assert set(rows) - set(exported) == {"up"}, "rows for metrics nobody exports"


def test_panels_and_alerts_columns_match_the_dashboards_and_rules() -> None:
    rows = _rows()
    usage = _usage()
    assert set(usage) <= set(rows), f"queried but undocumented: {set(usage) - set(rows)}"
    for name, cells in rows.items():
        panels, alerts = usage.get(name, (set(), set()))
        assert _cell(cells[3], ";") == panels, f"{name}: Panels column"
        assert _cell(cells[4], ",") == alerts, f"{name}: Alerts column"


def test_every_alert_has_a_runbook_section() -> None:
    text = (DOCS / "operations.md").read_text()
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert f"\n### {rule['alert']}\n" in text, rule["alert"]
