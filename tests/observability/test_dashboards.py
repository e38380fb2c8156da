"""The dashboards as code: the committed JSON is the generator's output, valid for the Grafana
schema the SDK targets, every panel described and with a unit, and every metric a query names
is one the router or the engines export. Fast: no Prometheus needed."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families

from tests.observability.support import (
    DASHBOARDS,
    PROVISIONING,
    ROOT,
    RULES,
    SCRAPE_CONFIG,
    expositions,
)
from tools.observability import dashboards, scrape_config
from tools.observability.promql_check import (
    PROMETHEUS_GENERATED,
    coverage_form,
    dashboard_queries,
    exported_names,
    metric_names,
    multi_value,
    query_metric_names,
    rule_queries,
    substitute,
    variable_values,
)


def _docs() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def test_committed_dashboards_are_exactly_the_generators_output() -> None:
    # No hand edits: regenerate with `python tools/observability/dashboards.py --out ...`.
    assert dashboards.stale(DASHBOARDS) == []
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(dashboards.DASHBOARDS)
    assert dashboards.main(["--check", str(DASHBOARDS)]) == 0


def test_check_mode_reports_a_hand_edit(tmp_path: Path) -> None:
    dashboards.write_all(tmp_path)
    path = tmp_path / "narwhal-fleet-roles.json"
    path.write_text(path.read_text().replace("Role per engine", "Roles (edited by hand)"))
    assert dashboards.stale(tmp_path) == ["narwhal-fleet-roles.json"]
    assert dashboards.main(["--check", str(tmp_path)]) == 1


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_json_is_valid_for_the_sdk_schema(name: str) -> None:
    # Decoding into the SDK's typed models and encoding again loses nothing: every field is
    # one the schema knows, with a type it accepts.
    doc = _docs()[name]
    again = json.loads(json.dumps(Dashboard.from_json(doc), cls=JSONEncoder))
    assert again == doc
    assert doc["schemaVersion"] == 41  # Grafana 11.6, the SDK build pinned in pyproject.toml
    assert doc["uid"] and doc["title"].startswith("Narwhal / ")


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_panel_has_a_description_a_unit_and_queries(name: str) -> None:
    doc = _docs()[name]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _panels(doc):
        title = panel["title"]
        assert len(panel.get("description", "")) > 20, f"{title}: no description"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), f"{title}: targets {refs}"
        assert all(t["expr"] for t in panel["targets"]), title


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_fleet_and_engine_variables_scope_every_query(name: str) -> None:
    doc = _docs()[name]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["fleet"]["query"] == "label_values(narwhal_fleet_info, fleet)"
    assert variables["engine"]["multi"] and variables["engine"]["includeAll"]
    for query in dashboard_queries(doc, name):
        selectors = re.findall(r"([A-Za-z_:][\w:]*)\{([^}]*)\}", query.expr)
        names = metric_names(query.expr) - {"narwhal_fleet_info"}
        if query.kind == "variable" or not names:
            continue  # the fleet variable itself; vector($budget) lines
        assert selectors, query
        for metric, matchers in selectors:
            assert 'fleet="$fleet"' in matchers, f"{query.source}: {metric} not scoped to $fleet"


def _le_values(metric: str) -> set[str]:
    bounds: set[str] = set()
    for text in expositions():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metric + "_bucket":
                    bounds.add(sample.labels["le"])
    return bounds


def test_budget_choices_are_bucket_bounds_spelt_as_exported() -> None:
    # The attainment queries select le="$ttft_budget" / le="$tpot_budget": a choice that is
    # not a bucket bound (or is spelt "10" where /metrics says "10.0") selects nothing.
    assert set(dashboards.LATENCY_BOUNDS) <= _le_values("narwhal_ttft_seconds")
    assert set(dashboards.TPOT_BOUNDS) <= _le_values("narwhal_tpot_seconds")
    overview = _docs()["narwhal-router-overview.json"]
    current = {v["name"]: v.get("current", {}).get("value") for v in overview["templating"]["list"]}
    assert current["ttft_budget"] == "10.0" and current["tpot_budget"] == "0.3"
    # The rules carry no fleet's budget: they read the router's narwhal_fleet_budget and its
    # count of requests within both budgets, so a fleet with other budgets needs no edit.
    rules = RULES.read_text()
    assert "le=" not in rules and 'narwhal_fleet_budget{budget="attainment"}' in rules


def _all_queries() -> list[Any]:
    queries = []
    for name, doc in _docs().items():
        queries += dashboard_queries(doc, name)
    queries += rule_queries(yaml.safe_load(RULES.read_text()), RULES.name)
    return queries


def test_every_metric_named_is_exported_by_the_router_or_an_engine() -> None:
    exported = exported_names(expositions()) | PROMETHEUS_GENERATED
    unknown = {
        q.source: sorted(query_metric_names(q) - exported)
        for q in _all_queries()
        if query_metric_names(q) - exported
    }
    assert unknown == {}


def test_dashboards_cover_what_the_issue_lists() -> None:
    used: dict[str, set[str]] = {}
    for name, doc in _docs().items():
        used[name] = set().union(*(query_metric_names(q) for q in dashboard_queries(doc, name)))
    assert {
        "narwhal_requests_total",
        "narwhal_admission_rejections_total",
        "narwhal_ttft_seconds_bucket",
        "narwhal_tpot_seconds_bucket",
        "narwhal_in_flight",
        "narwhal_first_token_deadline_exceeded_total",
        "narwhal_stranded_handoffs_total",
        "narwhal_kv_handoff_seconds_bucket",
        "narwhal_journal_backlog",
    } <= used["narwhal-router-overview.json"]
    assert {
        "narwhal_engine_role",
        "narwhal_flips_total",
        "narwhal_in_flight",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "narwhal_engine_healthy",
        "narwhal_engine_breaker_state",
        "narwhal_latency_ratio",
        "narwhal_coordination_up",
        "narwhal_role_leader",
        "narwhal_coordination_replicas",
        "narwhal_coordination_watch_lag_seconds",
    } <= used["narwhal-fleet-roles.json"]
    types = {p["title"]: p["type"] for p in _panels(_docs()["narwhal-fleet-roles.json"])}
    assert types["Role per engine"] == "state-timeline"


def test_the_static_check_catches_a_renamed_metric() -> None:
    # The live test shows the same against Prometheus; here only the names are compared.
    doc = copy.deepcopy(_docs()["narwhal-router-overview.json"])
    text = json.dumps(doc).replace("narwhal_stranded_handoffs_total", "narwhal_stranded_total")
    queries = dashboard_queries(json.loads(text), "broken.json")
    exported = exported_names(expositions())
    missing = {name for q in queries for name in query_metric_names(q) - exported}
    assert missing == {"narwhal_stranded_total"}


# --- the PromQL helpers the checker relies on ----------------------------------------------


def test_metric_names_skips_functions_labels_strings_and_keywords() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (engine, le) (rate(a_bucket{x="b > c"}[5m]))) '
        "/ on (instance, engine) group_left (role) b_total offset 5m "
        '> bool 1e+3 and c unless label_replace(d, "dst", "$1", "src", "e(.*)") # f g'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
    assert metric_names("vllm:kv_cache_usage_perc{engine=~'e0|e1'}") == {"vllm:kv_cache_usage_perc"}
    assert metric_names("vector($ttft_budget)") == set()


def test_coverage_form_makes_every_comparison_non_filtering() -> None:
    assert coverage_form('x{a!="b",c=~"d"} > 0.5') == 'x{a!="b",c=~"d"} > bool 0.5'
    assert coverage_form("a >= 1 and b == bool 2") == "a >= bool 1 and b == bool 2"
    assert coverage_form("(a < bool 2) != 0") == "(a < bool 2) != bool 0"
    assert coverage_form("rate(x[5m])") == "rate(x[5m])"


def test_substitute_fills_every_variable_form_and_refuses_unknown_ones() -> None:
    values = {"fleet": "f", "engine": multi_value(["e0", "e1"]), "__rate_interval": "1m"}
    assert (
        substitute('x{fleet="$fleet",engine=~"${engine}"}[$__rate_interval] [[fleet]]', values)
        == 'x{fleet="f",engine=~"(e0|e1)"}[1m] f'
    )
    with pytest.raises(KeyError, match=r"\$nope"):
        substitute('x{a="$nope"}', values)


def test_variable_values_take_the_committed_defaults() -> None:
    doc = _docs()["narwhal-router-overview.json"]
    values = variable_values(doc, {"fleet": "f"})
    assert values["fleet"] == "f"
    assert values["ttft_budget"] == "10.0" and values["slo_window"] == "30m"
    assert "engine" not in values  # "All" must be given: it is the engines Grafana would list


# --- Prometheus and Grafana configuration --------------------------------------------------


def test_committed_scrape_config_is_the_generators_output() -> None:
    fleet = ROOT / "configs" / "fleet" / "local-sim.json"
    config = scrape_config.scrape_config(json.loads(fleet.read_text()), ["127.0.0.1:8000"])
    expected = scrape_config.render(config, "configs/fleet/local-sim.json")
    assert SCRAPE_CONFIG.read_text() == expected
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    engines = jobs[scrape_config.ENGINE_JOB]["static_configs"]
    assert [s["labels"] for s in engines] == [
        {"fleet": "local-sim", "engine": f"e{i}"} for i in range(4)
    ]


def test_grafana_provisioning_points_at_the_dashboards_and_a_prometheus() -> None:
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "narwhal.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    assert provider["options"]["path"].endswith("/narwhal")
    sources = yaml.safe_load((PROVISIONING / "datasources" / "narwhal.yaml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http://127.0.0.1:")
