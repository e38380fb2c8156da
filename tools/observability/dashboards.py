"""Narwhal's Grafana dashboards, as code (grafana-foundation-sdk).

    python tools/observability/dashboards.py --out configs/grafana/dashboards
    python tools/observability/dashboards.py --check configs/grafana/dashboards

The committed JSON under configs/grafana/dashboards/ is this script's output and nothing else:
a test regenerates it and fails on any difference, so a hand edit cannot survive. Another test
runs every query below against a real Prometheus scraping a live narwhal-serve and simulated
engines, and fails if one returns no series or names a metric nobody exports.

Label conventions (what ``scrape_config.py`` sets up): every scraped target carries ``fleet``
(the fleet's name); engine targets also carry ``engine`` (the fleet's engine id, the same value
the router uses in its own ``engine`` label), so ``vllm:*`` series and router series line up.

The fleet's budgets are read from the router (``narwhal_fleet_budget``) and attainment from its
count of requests within both (``narwhal_slo_requests_total``). Only the TTFT-alone and TPOT-alone
attainment curves select a histogram bucket by its ``le`` label, which no query can take from a
gauge: their budgets are dashboard variables whose choices are the bucket bounds (spelt as
prometheus_client spells them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.builders import stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

__all__ = ["DASHBOARDS", "build_all", "render", "write_all"]

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
FLEET = 'fleet="$fleet"'
ENGINE = 'engine=~"$engine"'

# Bucket bounds of narwhal_ttft_seconds / narwhal_kv_handoff_seconds (``_LATENCY``) and of
# narwhal_tpot_seconds (``_TPOT``) in src/narwhal/metrics.py, spelt as the exposition spells `le`.
# A test checks every choice against the router's exposition: a bucket change cannot go unnoticed.
LATENCY_BOUNDS = ("1.0", "2.0", "2.5", "5.0", "7.5", "8.5", "10.0", "12.5", "15.0", "20.0", "30.0")
TPOT_BOUNDS = ("0.05", "0.1", "0.15", "0.2", "0.225", "0.25", "0.275", "0.3", "0.35", "0.4", "0.5")
# The packaged fleet's budgets (configs/fleet/local-sim.json and the qualification runs).
DEFAULT_TTFT = "10.0"
DEFAULT_TPOT = "0.3"
# The drift band of narwhal_profile_drift (docs/routing.md): drawn, not queried.
DRIFT_LOW, DRIFT_HIGH = 0.67, 1.5

# Requests the fleet is answerable for: a malformed request or a client that hung up is not a
# miss of the fleet's budgets; every other terminal outcome (rejections included) is.
COUNTED = 'outcome!~"client_error|client_abort"'


def _sel(metric: str, *matchers: str, engine: bool = False) -> str:
    """``metric{fleet="$fleet"[, engine=~"$engine"], matchers...}``."""
    parts = [FLEET, *([ENGINE] if engine else []), *matchers]
    return f"{metric}{{{','.join(parts)}}}"


def _rate(metric: str, *matchers: str, engine: bool = False, fn: str = "rate") -> str:
    return f"{fn}({_sel(metric, *matchers, engine=engine)}[$__rate_interval])"


def _events(by: str, metric: str, engine: bool = False) -> str:
    """Events per rate interval: rare events read better as counts than as a rate per second."""
    return f"sum by ({by}) ({_rate(metric, engine=engine, fn='increase')})"


def _quantile(q: str, metric: str, by: str = "", engine: bool = False) -> str:
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({_rate(metric + '_bucket', engine=engine)}))"


def _q(expr: str, legend: str, ref: str, instant: bool = False) -> prom.Dataquery:
    query = prom.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
    return query.instant() if instant else query.range()


# --- SLO attainment -------------------------------------------------------------------------
# Joint attainment is exact: the router counts each request it answers for once, met or missed
# (narwhal_slo_requests_total). Attainment of one budget alone reads its histogram's bucket.


def _win(metric: str, *matchers: str) -> str:
    return f"sum(increase({_sel(metric, *matchers)}[$slo_window]))"


_COUNTED = _win("narwhal_requests_total", COUNTED)
_OK = _win("narwhal_requests_total", 'outcome="ok"')
_TTFT_MET = _win("narwhal_ttft_seconds_bucket", 'le="$ttft_budget"')
_TPOT_MET = _win("narwhal_tpot_seconds_bucket", 'le="$tpot_budget"')
_TPOT_MISSED = f"({_win('narwhal_tpot_seconds_count')} - {_TPOT_MET})"
_SLO_MET = _win("narwhal_slo_requests_total", 'result="met"')
ATTAINMENT = f"{_SLO_MET} / {_win('narwhal_slo_requests_total')}"


def _budget(name: str) -> str:
    """The fleet's budget ``name`` as the router exports it (every replica exports the same)."""
    matcher = 'budget="' + name + '"'
    return f"max({_sel('narwhal_fleet_budget', matcher)})"


ATTAINMENT_TTFT = f"{_TTFT_MET} / {_COUNTED}"
ATTAINMENT_TPOT = f"clamp_min({_OK} - {_TPOT_MISSED}, 0) / {_COUNTED}"


# --- panel helpers -------------------------------------------------------------------------


@dataclass
class PanelIds:
    """Sequential panel ids: stable JSON, and ids Grafana would otherwise invent on load."""

    next_id: int = 1

    def take(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _dashed(color: str) -> list[dm.DynamicConfigValue]:
    return [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
        dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color}),
    ]


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=v, color=c) for v, c in steps])
    )


def _legend() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .display_mode(cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def _tooltip() -> cb.VizTooltipOptions:
    return cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)


def graph(
    ids: PanelIds,
    title: str,
    description: str,
    unit: str,
    targets: Sequence[prom.Dataquery],
    *,
    width: int = 12,
    height: int = 8,
    bars: bool = False,
    budget_refs: Sequence[str] = (),
    minimum: float | None = None,
    maximum: float | None = None,
    thresholds: db.ThresholdsConfig | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(ids.take())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .targets(list(targets))
        .legend(_legend())
        .tooltip(_tooltip())
        .line_width(1)
        .fill_opacity(10)
    )
    if bars:
        # Counts per interval read as events, not as a continuous level.
        panel = panel.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(80)
    for ref in budget_refs:
        # Budget lines: dashed red, whatever the palette gives the other series.
        panel = panel.override_by_query(ref, _dashed("red"))
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    return panel


def timeline(
    ids: PanelIds,
    title: str,
    description: str,
    targets: Sequence[prom.Dataquery],
    states: dict[str, tuple[str, str]],
    *,
    width: int = 12,
    height: int = 8,
) -> statetimeline.Panel:
    """A state timeline whose numeric values map to named, coloured states."""
    options = {
        value: dm.ValueMappingResult(text=text, color=color, index=i)
        for i, (value, (text, color)) in enumerate(states.items())
    }
    return (
        statetimeline.Panel()
        .id(ids.take())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit("none")
        .span(width)
        .height(height)
        .targets(list(targets))
        .mappings([dm.ValueMap(options=options)])
        .show_value(cm.VisibilityMode.NEVER)
        .merge_values(True)
        .legend(_legend())
    )


# --- variables -----------------------------------------------------------------------------


def _custom(
    name: str, label: str, description: str, values: Sequence[str], default: str
) -> db.CustomVariable:
    assert default in values, (name, default)
    return (
        db.CustomVariable(name)
        .label(label)
        .description(description)
        .values(",".join(values))
        .current(dm.VariableOption(selected=True, text=default, value=default))
        .options([dm.VariableOption(selected=v == default, text=v, value=v) for v in values])
    )


def common_variables() -> list[Builder[dm.VariableModel]]:
    return [
        db.DatasourceVariable("datasource")
        .label("Data source")
        .description("The Prometheus that scrapes the router and the engines.")
        .type("prometheus"),
        db.QueryVariable("fleet")
        .label("Fleet")
        .description("A fleet by name: the `fleet` label every scrape target of it carries.")
        .datasource(DATASOURCE)
        .query("label_values(narwhal_fleet_info, fleet)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC),
        db.QueryVariable("engine")
        .label("Engine")
        .description("Engines of the fleet by id (the fleet file's engines[].id).")
        .datasource(DATASOURCE)
        .query(f"label_values(narwhal_engine_role{{{FLEET}}}, engine)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"])),
    ]


def budget_variables() -> list[Builder[dm.VariableModel]]:
    why = (
        " For the attainment of this budget alone: a query selects the histogram's bucket by"
        " it, so the choices are the bucket bounds (the dashed budget line reads the router's"
        " narwhal_fleet_budget)."
    )
    return [
        _custom(
            "ttft_budget",
            "TTFT budget (s)",
            "The fleet's TTFT budget (fleet file budgets.ttft_s)." + why,
            LATENCY_BOUNDS,
            DEFAULT_TTFT,
        ),
        _custom(
            "tpot_budget",
            "TPOT budget (s)",
            "The fleet's TPOT budget (fleet file budgets.tpot_s)." + why,
            TPOT_BOUNDS,
            DEFAULT_TPOT,
        ),
        _custom(
            "slo_window",
            "SLO window",
            "The window SLO attainment is computed over.",
            ("5m", "15m", "30m", "1h", "6h", "1d"),
            "30m",
        ),
    ]


def _base(uid: str, title: str, description: str) -> db.Dashboard:
    return (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["narwhal"])
        .editable()
        .time("now-1h", "now")
        .refresh("10s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink("Narwhal")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["narwhal"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .annotation(
            db.AnnotationQuery()
            .name("Role flips")
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color("purple")
            .expr(
                "sum by (from_role, to_role) "
                f"(increase({_sel('narwhal_flips_total')}[$__interval])) > 0"
            )
        )
    )


# --- Router overview ------------------------------------------------------------------------


def router_overview() -> db.Dashboard:
    ids = PanelIds()
    d = _base(
        "narwhal-router-overview",
        "Narwhal / Router overview",
        "Traffic, latency against the fleet's budgets, SLO attainment, KV handoffs and the "
        "journal of one fleet's narwhal-serve.",
    )
    for v in [*common_variables(), *budget_variables()]:
        d = d.with_variable(v)

    d = d.with_row(db.Row("Traffic").id(ids.take()))
    d = d.with_panel(
        graph(
            ids,
            "Requests by outcome",
            "Terminal requests per second by outcome (narwhal_requests_total). Anything but "
            "`ok` is a request the fleet did not answer; `rejected` is admission control, "
            "`unavailable` means no prefill/decode pair was usable.",
            "reqps",
            [_q(f"sum by (outcome) ({_rate('narwhal_requests_total')})", "{{outcome}}", "A")],
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Admission rejections",
            "Requests refused at admission per second, by reason "
            "(narwhal_admission_rejections_total): `over_budget` (no pair predicted to meet the "
            "budgets), `queue_full`, `queue_timeout`, `journal_unavailable`, `draining`.",
            "reqps",
            [
                _q(
                    f"sum by (reason) ({_rate('narwhal_admission_rejections_total')})",
                    "{{reason}}",
                    "A",
                )
            ],
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "In flight and queued",
            "Engine legs the router has in flight, by role (narwhal_in_flight), and requests "
            "held in the admission queue (narwhal_admission_queue, `queue` admission only).",
            "short",
            [
                _q(f"sum by (role) ({_sel('narwhal_in_flight')})", "{{role}} legs", "A"),
                _q(f"sum({_sel('narwhal_admission_queue')})", "admission queue", "B"),
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Retries and failed legs",
            "Legs retried on another engine (narwhal_retries_total) per second, by leg, and "
            "failed engine legs (narwhal_leg_failures_total) per second, by engine and leg: "
            "the engine failing is the one to look at. Failures that are retried cost "
            "latency, not requests.",
            "ops",
            [
                _q(f"sum by (leg) ({_rate('narwhal_retries_total')})", "retried {{leg}}", "A"),
                _q(
                    f"sum by (engine, leg) ({_rate('narwhal_leg_failures_total', engine=True)})",
                    "failed {{leg}} on {{engine}}",
                    "B",
                ),
            ],
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Migrations and hedges",
            "Streams continued on another pair after their decode engine broke them "
            "mid-answer (narwhal_migrations_total), by engine and reason, and prefill legs "
            "hedged on another engine after running past their predicted time "
            "(narwhal_hedges_total), by which leg answered first. Clients see neither; a "
            "steady rate off one engine says it is failing (alert NarwhalMigrationsRising).",
            "ops",
            [
                _q(
                    f"sum by (engine, reason) ({_rate('narwhal_migrations_total', engine=True)})",
                    "migrated off {{engine}} ({{reason}})",
                    "A",
                ),
                _q(
                    f"sum by (leg, outcome) ({_rate('narwhal_hedges_total')})",
                    "{{leg}} hedge: {{outcome}}",
                    "B",
                ),
            ],
        )
    )

    d = d.with_row(db.Row("Latency against the budgets").id(ids.take()))
    d = d.with_panel(
        graph(
            ids,
            "TTFT p50 / p95 / p99",
            "Time to first token as the client saw it, successful requests only "
            "(narwhal_ttft_seconds), against the fleet's TTFT budget (dashed, "
            "narwhal_fleet_budget).",
            "s",
            [
                *[
                    _q(_quantile(q, "narwhal_ttft_seconds"), f"p{p}", r)
                    for q, p, r in (("0.5", "50", "A"), ("0.95", "95", "B"), ("0.99", "99", "C"))
                ],
                _q(_budget("ttft_seconds"), "budget", "D"),
            ],
            budget_refs=["D"],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "TPOT p50 / p95 / p99",
            "Time per output token after the first, each successful request's mean "
            "(narwhal_tpot_seconds), against the fleet's TPOT budget (dashed, "
            "narwhal_fleet_budget).",
            "s",
            [
                *[
                    _q(_quantile(q, "narwhal_tpot_seconds"), f"p{p}", r)
                    for q, p, r in (("0.5", "50", "A"), ("0.95", "95", "B"), ("0.99", "99", "C"))
                ],
                _q(_budget("tpot_seconds"), "budget", "D"),
            ],
            budget_refs=["D"],
            minimum=0,
        )
    )
    d = d.with_panel(
        stat.Panel()
        .id(ids.take())
        .title("SLO attainment, last $slo_window")
        .description(
            "Share of the requests the fleet is answerable for (all but client_error and "
            "client_abort) that met both the TTFT and the TPOT budget over `slo_window`, as "
            "the router counts them (narwhal_slo_requests_total). Red below 0.95 (the packaged "
            "target; the fleet's own is drawn on the graph beside)."
        )
        .datasource(DATASOURCE)
        .unit("percentunit")
        .decimals(2)
        .span(6)
        .height(8)
        .with_target(_q(ATTAINMENT, "attainment", "A", instant=True))
        .thresholds(_thresholds((None, "red"), (0.95, "green")))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.NONE)
    )
    d = d.with_panel(
        graph(
            ids,
            "SLO attainment over time",
            "Attainment over a sliding `slo_window`: both budgets (narwhal_slo_requests_total), "
            "the TTFT budget alone and the TPOT budget alone (from the histograms, at the "
            "variables `ttft_budget` and `tpot_budget`: set them to the fleet's), and the "
            "fleet's target (dashed, narwhal_fleet_budget). Failed and rejected requests count "
            "as misses.",
            "percentunit",
            [
                _q(ATTAINMENT, "both budgets", "A"),
                _q(ATTAINMENT_TTFT, "TTFT budget", "B"),
                _q(ATTAINMENT_TPOT, "TPOT budget", "C"),
                _q(_budget("attainment"), "target", "D"),
            ],
            width=18,
            budget_refs=["D"],
            maximum=1,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "End-to-end latency p50 / p95 / p99",
            "Arrival to last byte of successful requests (narwhal_e2e_seconds).",
            "s",
            [
                _q(_quantile(q, "narwhal_e2e_seconds"), f"p{p}", r)
                for q, p, r in (("0.5", "50", "A"), ("0.95", "95", "B"), ("0.99", "99", "C"))
            ],
            width=24,
            minimum=0,
        )
    )

    d = d.with_row(db.Row("Prefill and KV handoff").id(ids.take()))
    d = d.with_panel(
        graph(
            ids,
            "KV handoff latency",
            "Decode leg start to its first token: the KV pull plus the first decode step, the "
            "span the first-token deadline bounds (narwhal_kv_handoff_seconds, by decode "
            "engine). p95 per engine, p99 over the fleet, and the deadline (dashed, "
            "narwhal_fleet_budget).",
            "s",
            [
                _q(
                    _quantile("0.95", "narwhal_kv_handoff_seconds", by="engine", engine=True),
                    "p95 {{engine}}",
                    "A",
                ),
                _q(_quantile("0.99", "narwhal_kv_handoff_seconds", engine=True), "p99", "B"),
                _q(_budget("first_token_timeout_seconds"), "deadline", "C"),
            ],
            budget_refs=["C"],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Prefill leg p95",
            "Duration of the prefill leg (narwhal_prefill_seconds), p95 per prefill engine.",
            "s",
            [
                _q(
                    _quantile("0.95", "narwhal_prefill_seconds", by="engine", engine=True),
                    "{{engine}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "First-token deadlines exceeded",
            "Decode legs closed because their first token missed first_token_timeout_s, per "
            "rate interval, by decode engine (narwhal_first_token_deadline_exceeded_total). "
            "Each one is retried or becomes a `deadline_exceeded` request, and strands the KV "
            "its prefill produced.",
            "short",
            [
                _q(
                    _events("engine", "narwhal_first_token_deadline_exceeded_total", engine=True),
                    "{{engine}}",
                    "A",
                )
            ],
            bars=True,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Stranded handoffs",
            "Prefills whose KV was handed out but whose decode leg produced no token, per rate "
            "interval, by the prefill engine holding the KV and by reason "
            "(narwhal_stranded_handoffs_total). That KV stays held until its lease expires. "
            "Beside them, `released`: KV handed out for a decode leg its engine refused, pulled by "
            "a release leg and freed at once (narwhal_kv_released_total).",
            "short",
            [
                _q(
                    _events("engine, reason", "narwhal_stranded_handoffs_total", engine=True),
                    "{{engine}} {{reason}}",
                    "A",
                ),
                _q(
                    _events("engine", "narwhal_kv_released_total", engine=True),
                    "{{engine}} released",
                    "B",
                ),
            ],
            bars=True,
        )
    )

    d = d.with_row(db.Row("Prefix cache").id(ids.take()))
    prompt = f"sum by (engine) ({_rate('narwhal_prefix_prompt_tokens_total', engine=True)})"
    fleet_prompt = f"sum({_rate('narwhal_prefix_prompt_tokens_total', engine=True)})"

    def cached(source: str, by: str = "engine") -> str:
        rate = _rate("narwhal_prefix_cached_tokens_total", f'source="{source}"', engine=True)
        return f"sum by ({by}) ({rate})" if by else f"sum({rate})"

    d = d.with_panel(
        graph(
            ids,
            "Prefix hit rate",
            "Share of the prompt tokens of finished requests that the prefilling engine found "
            "in its prefix cache: per engine as the engine reported it "
            '(narwhal_prefix_cached_tokens_total{source="reported"} over '
            "narwhal_prefix_prompt_tokens_total), and over the fleet as reported and as the "
            "router's prefix index predicted at each pick. Predicted above reported: the index "
            "claims blocks the engines no longer hold (see NarwhalPrefixHitsOverPredicted). "
            "Engines report it only with --enable-prompt-tokens-details.",
            "percentunit",
            [
                _q(f"{cached('reported')} / {prompt}", "{{engine}}", "A"),
                _q(f"{cached('reported', '')} / {fleet_prompt}", "fleet, reported", "B"),
                _q(f"{cached('predicted', '')} / {fleet_prompt}", "fleet, predicted", "C"),
            ],
            minimum=0,
            maximum=1,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Cached prompt tokens, predicted and reported",
            "Prompt tokens per second found in the prefilling engine's prefix cache, as the "
            "router's prefix index predicted at the pick and as the engine reported "
            "(narwhal_prefix_cached_tokens_total, by engine and source). The two lines of an "
            "engine apart: its index entries are off (lost KV events, a history TTL longer "
            "than the engine keeps blocks, a cache smaller than the fleet file says).",
            "short",
            [
                _q(cached("predicted", "engine"), "{{engine}} predicted", "A"),
                _q(cached("reported", "engine"), "{{engine}} reported", "B"),
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        timeline(
            ids,
            "Prefix index source",
            "Where the router's prefix index takes each engine's entries from "
            "(narwhal_kv_events_followed): the engine's KV events, or the router's own routing "
            "history (an engine that publishes none, one whose stream sent nothing readable "
            "yet, or one reset after lost events or a restart until its next batch); with "
            "several router replicas, history as long as any of them is not following. An "
            "engine the fleet says publishes (narwhal_kv_events_configured) that stays on "
            "history while it serves: see NarwhalKVEventsNotFollowed.",
            [
                _q(
                    f"min by (engine) ({_sel('narwhal_kv_events_followed', engine=True)})",
                    "{{engine}}",
                    "A",
                )
            ],
            _INDEX_SOURCE_STATES,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "KV event batches and index resets",
            "KV event batches applied to the prefix index per second, by publishing engine "
            "(narwhal_kv_event_batches_total); and, per rate interval, the times an engine's "
            "entries were dropped (narwhal_kv_event_resets_total: events lost beyond the "
            "engine's replay buffer, an unreadable batch, an engine restart) and the batches "
            "that could not be read (narwhal_kv_event_unreadable_batches_total).",
            "short",
            [
                _q(
                    f"sum by (engine) ({_rate('narwhal_kv_event_batches_total', engine=True)})",
                    "{{engine}} batches/s",
                    "A",
                ),
                _q(
                    _events("engine", "narwhal_kv_event_resets_total", engine=True),
                    "{{engine}} resets",
                    "B",
                ),
                _q(
                    _events("engine", "narwhal_kv_event_unreadable_batches_total", engine=True),
                    "{{engine}} unreadable",
                    "C",
                ),
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Prefix index blocks",
            "KV blocks the router's prefix index holds per engine (narwhal_prefix_index_blocks; "
            "the largest over the router's replicas, each of which keeps its own index). "
            "Bounded by the engine's KV capacity (engine.prefix_caching.capacity_blocks).",
            "short",
            [
                _q(
                    f"max by (engine) ({_sel('narwhal_prefix_index_blocks', engine=True)})",
                    "{{engine}}",
                    "A",
                )
            ],
            width=24,
            height=6,
            minimum=0,
        )
    )

    d = d.with_row(db.Row("Journal").id(ids.take()))
    d = d.with_panel(
        graph(
            ids,
            "Journal backlog",
            "Journal records queued for the writer thread (narwhal_journal_backlog). Near zero "
            "when the disk keeps up; a growing backlog ends in refused requests (fail_closed) "
            "or dropped records (best_effort).",
            "short",
            [_q(f"sum({_sel('narwhal_journal_backlog')})", "backlog", "A")],
            width=8,
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Journal write errors and drops",
            "Failed journal writes (narwhal_journal_write_errors_total, sticky until restart) "
            "and records dropped under best_effort (narwhal_journal_dropped_total), per rate "
            "interval.",
            "short",
            [
                _q(
                    f"sum({_rate('narwhal_journal_write_errors_total', fn='increase')})",
                    "write errors",
                    "A",
                ),
                _q(f"sum({_rate('narwhal_journal_dropped_total', fn='increase')})", "dropped", "B"),
            ],
            width=8,
            bars=True,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Journal write latency",
            "Time to write and flush one journal record, p50 and p99 "
            "(narwhal_journal_write_seconds).",
            "s",
            [
                _q(_quantile("0.5", "narwhal_journal_write_seconds"), "p50", "A"),
                _q(_quantile("0.99", "narwhal_journal_write_seconds"), "p99", "B"),
            ],
            width=8,
            minimum=0,
        )
    )
    d = d.with_panel(
        table.Panel()
        .id(ids.take())
        .title("Fleet and profile store in service")
        .description(
            "What each router of the fleet serves (narwhal_fleet_info): the SHA-256 of its "
            "fleet file and of its profile store (`none` without one). Routers of one fleet "
            "should agree."
        )
        .datasource(DATASOURCE)
        .unit("none")
        .span(24)
        .height(5)
        .with_target(
            _q(_sel("narwhal_fleet_info"), "", "A", instant=True).format(pm.PromQueryFormat.TABLE)
        )
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "Value": True, "__name__": True},
                    "renameByName": {"exported_fleet": "fleet (router's own name)"},
                },
            )
        )
    )
    return d


# --- Fleet and roles ------------------------------------------------------------------------

_ROLE_STATES = {
    "0": ("no role", "text"),
    "1": ("prefill", "blue"),
    "2": ("decode", "purple"),
    "3": ("both (inconsistent)", "red"),
}
_UP_STATES = {"0": ("down", "red"), "1": ("up", "green")}
_BREAKER_STATES = {"0": ("closed", "green"), "1": ("half-open", "orange"), "2": ("open", "red")}
_DRIFT_STATES = {"0": ("in band", "green"), "1": ("drift", "orange")}
_INDEX_SOURCE_STATES = {"0": ("routing history", "blue"), "1": ("KV events", "green")}


def fleet_and_roles() -> db.Dashboard:
    ids = PanelIds()
    d = _base(
        "narwhal-fleet-roles",
        "Narwhal / Fleet and roles",
        "Each engine's role over time, flips, load scraped from the engines (vllm:*), health "
        "and circuit breakers, and how well the profile models predict latency.",
    )
    for v in common_variables():
        d = d.with_variable(v)

    d = d.with_row(db.Row("Roles").id(ids.take()))
    # One number per engine for the timeline: 1 prefill, 2 decode (0 and 3 would be a bug).
    prefill = _sel("narwhal_engine_role", 'role="prefill"', engine=True)
    decode = _sel("narwhal_engine_role", 'role="decode"', engine=True)
    role = f"max by (engine) ({prefill}) + 2 * max by (engine) ({decode})"
    d = d.with_panel(
        timeline(
            ids,
            "Role per engine",
            "The role each engine serves (narwhal_engine_role): prefill or decode. A flip shows "
            "as a change of colour; `no role` or `both` would be a router bug.",
            [_q(role, "{{engine}}", "A")],
            _ROLE_STATES,
            width=16,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Engines per role",
            "How many engines serve each role (narwhal_engine_role summed over engines).",
            "short",
            [
                _q(
                    f"sum by (role) (max by (engine, role) ({_sel('narwhal_engine_role')}))",
                    "{{role}}",
                    "A",
                )
            ],
            width=8,
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Role flips",
            "Role flips per rate interval by direction (narwhal_flips_total, the most any "
            "replica counted: each counts every flip it applies), forced or decided by the role "
            "controller; the role generation (narwhal_role_generation) counts every flip since "
            "the router started.",
            "short",
            [
                _q(
                    # Every replica counts each flip it applies (its own or one it read from
                    # etcd): the fleet's flips are the most any replica counted, not the sum.
                    f"max by (from_role, to_role) ({_rate('narwhal_flips_total', fn='increase')})",
                    "{{from_role}} → {{to_role}}",
                    "A",
                ),
                _q(f"max({_sel('narwhal_role_generation')})", "role generation", "B"),
            ],
            width=24,
            height=6,
        )
    )
    # Replicas coordinated through etcd (--coordination): one series per router instance.
    # A router that runs alone reports up 1, leader 1, one replica seen and no watch lag.
    d = d.with_panel(
        graph(
            ids,
            "Replica coordination",
            "Per replica (instance): whether it reaches etcd (narwhal_coordination_up; 0: it "
            "serves with the roles last seen and no flip can happen, alert "
            "NarwhalCoordinationDown), whether it runs the role controller "
            "(narwhal_role_leader) and how many replicas it sees publishing demand, itself "
            "included (narwhal_coordination_replicas). Leaders is the fleet's sum of "
            "narwhal_role_leader: anything but 1 means no role controller or several flipping "
            "against each other (alert NarwhalRoleLeaderNotOne).",
            "short",
            [
                _q(
                    f"max by (instance) ({_sel('narwhal_coordination_up')})",
                    "{{instance}} etcd up",
                    "A",
                ),
                _q(
                    f"max by (instance) ({_sel('narwhal_role_leader')})",
                    "{{instance}} leader",
                    "B",
                ),
                _q(
                    f"max by (instance) ({_sel('narwhal_coordination_replicas')})",
                    "{{instance}} replicas seen",
                    "C",
                ),
                _q(f"sum({_sel('narwhal_role_leader')})", "leaders", "D"),
            ],
            height=6,
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Roles watch lag",
            "Per replica (instance), for the last roles change: from its write to etcd by any "
            "replica (by that replica's clock) to this replica applying it "
            "(narwhal_coordination_watch_lag_seconds; it keeps its value until the next "
            "change). A replica whose lag grows applies flips late; while etcd is unreachable "
            "no change arrives at all (alert NarwhalCoordinationDown).",
            "s",
            [
                _q(
                    f"max by (instance) ({_sel('narwhal_coordination_watch_lag_seconds')})",
                    "{{instance}}",
                    "A",
                )
            ],
            height=6,
            minimum=0,
        )
    )

    d = d.with_row(db.Row("Load per engine").id(ids.take()))
    d = d.with_panel(
        graph(
            ids,
            "Router legs in flight per engine",
            "Prefill and decode legs the router has in flight on each engine (narwhal_in_flight).",
            "short",
            [
                _q(
                    f"sum by (engine, role) ({_sel('narwhal_in_flight', engine=True)})",
                    "{{engine}} {{role}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Engine queue",
            "Requests waiting in each engine's scheduler, from the engine itself "
            "(vllm:num_requests_waiting).",
            "short",
            [
                _q(
                    f"sum by (engine) ({_sel('vllm:num_requests_waiting', engine=True)})",
                    "{{engine}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Engine batch",
            "Requests in each engine's running batch (vllm:num_requests_running).",
            "short",
            [
                _q(
                    f"sum by (engine) ({_sel('vllm:num_requests_running', engine=True)})",
                    "{{engine}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "KV cache usage",
            "Share of each engine's KV cache in use (vllm:kv_cache_usage_perc, 1 = full). A "
            "prefill engine holds KV until decode pulls it or its lease expires.",
            "percentunit",
            [
                _q(
                    f"max by (engine) ({_sel('vllm:kv_cache_usage_perc', engine=True)})",
                    "{{engine}}",
                    "A",
                )
            ],
            minimum=0,
            maximum=1,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Engine token throughput",
            "Prompt tokens prefilled and output tokens generated per second by each engine "
            "(vllm:prompt_tokens_total, vllm:generation_tokens_total). A decode engine also "
            "counts the prompt of a request it had to prefill locally.",
            "suffix: tok/s",
            [
                _q(
                    f"sum by (engine) ({_rate('vllm:prompt_tokens_total', engine=True)})",
                    "prompt {{engine}}",
                    "A",
                ),
                _q(
                    f"sum by (engine) ({_rate('vllm:generation_tokens_total', engine=True)})",
                    "output {{engine}}",
                    "B",
                ),
            ],
            width=24,
            height=6,
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "NIXL KV transfer time p95",
            "Duration of the NIXL KV reads each decode engine posted "
            "(vllm:nixl_xfer_time_seconds), p95 per engine.",
            "s",
            [
                _q(
                    _quantile("0.95", "vllm:nixl_xfer_time_seconds", by="engine", engine=True),
                    "{{engine}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "NIXL failed transfers and expired KV",
            "Failed NIXL transfers (vllm:nixl_num_failed_transfers_total) and requests whose "
            "held KV expired before it was pulled (vllm:nixl_num_kv_expired_reqs_total), per "
            "rate interval, by engine.",
            "short",
            [
                _q(
                    _events("engine", "vllm:nixl_num_failed_transfers_total", engine=True),
                    "failed {{engine}}",
                    "A",
                ),
                _q(
                    _events("engine", "vllm:nixl_num_kv_expired_reqs_total", engine=True),
                    "expired {{engine}}",
                    "B",
                ),
            ],
            bars=True,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Engine-side TTFT p95",
            "Time to first token measured inside each engine (vllm:time_to_first_token_seconds): "
            "on a prefill engine its prefill, on a decode engine the KV pull and first step.",
            "s",
            [
                _q(
                    _quantile("0.95", "vllm:time_to_first_token_seconds", by="engine", engine=True),
                    "{{engine}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Load as the router sees it",
            "What the router's own scrape of each engine's /metrics reported "
            "(narwhal_engine_scraped: running, waiting, kv_cache_usage). It should track the "
            "vllm:* panels; a gap means the router schedules on stale or false load.",
            "short",
            [
                _q(
                    f"max by (engine, signal) ({_sel('narwhal_engine_scraped', engine=True)})",
                    "{{engine}} {{signal}}",
                    "A",
                )
            ],
            minimum=0,
        )
    )

    d = d.with_row(db.Row("Health").id(ids.take()))
    d = d.with_panel(
        timeline(
            ids,
            "Engine health",
            "The router's health probe of each engine (narwhal_engine_healthy) and whether "
            "Prometheus can scrape the engine (up).",
            [
                _q(
                    f"min by (engine) ({_sel('narwhal_engine_healthy', engine=True)})",
                    "{{engine}} probe",
                    "A",
                ),
                _q(f"min by (engine) ({_sel('up', engine=True)})", "{{engine}} scrape", "B"),
            ],
            _UP_STATES,
        )
    )
    d = d.with_panel(
        timeline(
            ids,
            "Circuit breakers",
            "Each engine's circuit breaker in the router (narwhal_engine_breaker_state): closed, "
            "half-open (one probe request let through) or open (no traffic).",
            [
                _q(
                    f"max by (engine) ({_sel('narwhal_engine_breaker_state', engine=True)})",
                    "{{engine}}",
                    "A",
                )
            ],
            _BREAKER_STATES,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Router scrape errors",
            "Failed scrapes of engine /metrics by the router, per rate interval "
            "(narwhal_engine_scrape_errors_total). While they last the router schedules on "
            "the last load it read.",
            "short",
            [
                _q(
                    _events("engine", "narwhal_engine_scrape_errors_total", engine=True),
                    "{{engine}}",
                    "A",
                )
            ],
            width=12,
            height=6,
            bars=True,
        )
    )
    d = d.with_panel(
        graph(
            ids,
            "Slow-client pauses",
            "Times a streamed response's decode connection was paused because its client read "
            "slower than the engine wrote, per rate interval (narwhal_slow_client_pauses_total). "
            "A steady rate: clients holding decode slots longer than the engine needs.",
            "short",
            [
                _q(
                    _events("engine", "narwhal_slow_client_pauses_total", engine=True),
                    "{{engine}}",
                    "A",
                )
            ],
            width=12,
            height=6,
            bars=True,
        )
    )

    d = d.with_row(db.Row("Profile models").id(ids.take()))
    d = d.with_panel(
        graph(
            ids,
            "Observed / predicted latency",
            "Per engine and phase, the EWMA of observed over predicted latency the router "
            "corrects its predictions with (narwhal_latency_ratio; 1 = the profile holds). "
            f"Dashed: the drift band [{DRIFT_LOW}, {DRIFT_HIGH}]. Stays 1 without a profile store.",
            "none",
            [
                _q(
                    f"max by (engine, phase) ({_sel('narwhal_latency_ratio', engine=True)})",
                    "{{engine}} {{phase}}",
                    "A",
                )
            ],
            thresholds=_thresholds((None, "red"), (DRIFT_LOW, "green"), (DRIFT_HIGH, "red")),
        )
    )
    d = d.with_panel(
        timeline(
            ids,
            "Profile drift",
            "Whether each engine's ratio has left the drift band (narwhal_profile_drift): an "
            "engine in drift should be re-profiled (narwhal-profile).",
            [
                _q(
                    f"max by (engine, phase) ({_sel('narwhal_profile_drift', engine=True)})",
                    "{{engine}} {{phase}}",
                    "A",
                )
            ],
            _DRIFT_STATES,
        )
    )
    return d


# --- output --------------------------------------------------------------------------------

DASHBOARDS: dict[str, Callable[[], db.Dashboard]] = {
    "narwhal-router-overview.json": router_overview,
    "narwhal-fleet-roles.json": fleet_and_roles,
}


def render(builder: db.Dashboard) -> str:
    """Canonical JSON: sorted keys and a final newline, so regeneration is byte-stable."""
    return json.dumps(builder.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def build_all() -> dict[str, str]:
    return {name: render(make()) for name, make in DASHBOARDS.items()}


def write_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in build_all().items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


def stale(directory: Path) -> list[str]:
    """Names whose file in ``directory`` differs from (or lacks) the generated JSON."""
    return [
        name
        for name, text in build_all().items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="write the dashboards' JSON into this directory")
    group.add_argument("--check", type=Path, help="exit 1 if this directory's JSON is stale")
    args = parser.parse_args(argv)
    if args.check is not None:
        names = stale(args.check)
        for name in names:
            print(f"stale: {args.check / name} (regenerate with --out)", file=sys.stderr)
        return 1 if names else 0
    for path in write_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
