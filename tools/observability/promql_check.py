"""Prove dashboards and alert rules against a real Prometheus, query by query.

    python tools/observability/promql_check.py --prometheus http://127.0.0.1:9090 \\
        --fleet local-sim --engines e0,e1,e2,e3 \\
        --exposition http://127.0.0.1:8000/metrics --exposition http://127.0.0.1:18100/metrics

Every panel query and annotation of every dashboard, every variable query and every rule
expression is evaluated through Prometheus's HTTP API (``/api/v1/query``), with the dashboard
variables substituted. A check fails when:

- an expression names a metric that no exposition given exports (a renamed or removed metric);
- a panel query returns no series (a panel that would silently show "No data");
- an alert, recording rule or annotation returns no series once its comparisons are made
  non-filtering (``x > 0`` evaluated as ``x > bool 0``): as written an alert that is not firing
  returns nothing, which proves nothing, while the ``bool`` form returns one series per input
  series and so proves every input exists and every join matches;
- Prometheus refuses the expression.

With ``require_finite`` (after real traffic) a query must also return at least one finite
value: a histogram quantile that is NaN for every series has never seen an observation.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "PROMETHEUS_GENERATED",
    "Problem",
    "Prometheus",
    "Query",
    "check",
    "coverage_form",
    "dashboard_queries",
    "exported_names",
    "metric_names",
    "query_metric_names",
    "rule_queries",
    "substitute",
    "variable_values",
]

# Series Prometheus makes for every target itself: an expression may name them.
PROMETHEUS_GENERATED = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
    }
)

Kind = Literal["panel", "annotation", "variable", "alert", "record"]


@dataclass(frozen=True)
class Query:
    source: str  # where it comes from, for people: file, panel title, refId or rule name
    expr: str
    kind: Kind


@dataclass(frozen=True)
class Problem:
    query: Query
    message: str

    def __str__(self) -> str:
        return f"{self.query.source}: {self.message}\n    {self.query.expr}"


# --- extraction ----------------------------------------------------------------------------


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        # A collapsed row keeps its panels inside it.
        yield from _panels(panel.get("panels") or [])


def dashboard_queries(doc: Mapping[str, Any], name: str) -> list[Query]:
    """Every panel target, annotation and variable query of one dashboard's JSON."""
    out: list[Query] = []
    for panel in _panels(doc.get("panels") or []):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                source = f"{name}: panel {panel.get('title')!r} {target.get('refId', '')}"
                out.append(Query(source.rstrip(), target["expr"], "panel"))
    for annotation in (doc.get("annotations") or {}).get("list") or []:
        if annotation.get("expr"):
            source = f"{name}: annotation {annotation.get('name')!r}"
            out.append(Query(source, annotation["expr"], "annotation"))
    for variable in (doc.get("templating") or {}).get("list") or []:
        if variable.get("type") == "query":
            query = variable.get("query")
            text = query.get("query") if isinstance(query, dict) else query
            if text:
                out.append(Query(f"{name}: variable {variable['name']!r}", text, "variable"))
    return out


def rule_queries(doc: Mapping[str, Any], name: str) -> list[Query]:
    out: list[Query] = []
    for group in doc.get("groups") or []:
        for rule in group.get("rules") or []:
            if "alert" in rule:
                out.append(Query(f"{name}: alert {rule['alert']}", rule["expr"], "alert"))
            else:
                out.append(Query(f"{name}: record {rule['record']}", rule["expr"], "record"))
    return out


def recorded_names(rule_docs: Iterable[Mapping[str, Any]]) -> set[str]:
    return {
        rule["record"]
        for doc in rule_docs
        for group in doc.get("groups") or []
        for rule in group.get("rules") or []
        if "record" in rule
    }


def exported_names(expositions: Iterable[str]) -> set[str]:
    """Sample names (``x_total``, ``x_bucket``...) of Prometheus text expositions."""
    names: set[str] = set()
    for text in expositions:
        for family in text_string_to_metric_families(text):
            names.update(sample.name for sample in family.samples)
    return names


# --- variables -----------------------------------------------------------------------------


def variable_values(doc: Mapping[str, Any], given: Mapping[str, str]) -> dict[str, str]:
    """Each variable's value: ``given`` first, else its current value in the JSON (custom and
    constant variables: the budgets, the window)."""
    values = dict(given)
    for variable in (doc.get("templating") or {}).get("list") or []:
        name = variable["name"]
        if name in values:
            continue
        current = (variable.get("current") or {}).get("value")
        if isinstance(current, list) and len(current) == 1:
            current = current[0]
        # "All" stands for the values Grafana would list from Prometheus: the caller's to give.
        if isinstance(current, str) and current != "$__all":
            values[name] = current
    return values


def multi_value(values: Sequence[str]) -> str:
    """How Grafana interpolates several values of a variable into a PromQL regex."""
    return "(" + "|".join(re.escape(v) for v in values) + ")"


# Grafana's label_values(selector, label) variable query (not PromQL).
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*$", re.S)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace ``$name``, ``${name}``, ``${name:fmt}`` and ``[[name]]``; an unknown variable is
    an error (Grafana would send it to Prometheus literally)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


# --- a small PromQL lexer ------------------------------------------------------------------
# Enough to find metric names and comparison operators: it skips strings, label matchers
# ({...}), ranges ([...]) and label lists after by/without/on/ignoring/group_left/group_right.

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "by", "without"}
    | {"on", "ignoring", "group_left", "group_right"}
)
_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[A-Za-z0-9]*")


@dataclass(frozen=True)
class _Token:
    kind: Literal["ident", "number", "string", "matchers", "range", "op", "paren", "variable"]
    text: str
    end: int


def _closing(expr: str, start: int, close: str) -> int:
    """Index after the bracket closing the one at ``start``, skipping quoted strings."""
    i = start + 1
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _string_end(expr, i)
            continue
        if c == close:
            return i + 1
        i += 1
    raise ValueError(f"unbalanced {expr[start]!r} in {expr!r}")


def _string_end(expr: str, start: int) -> int:
    quote = expr[start]
    i = start + 1
    while i < len(expr):
        if expr[i] == "\\" and quote != "`":
            i += 2
            continue
        if expr[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated string in {expr!r}")


def _tokens(expr: str) -> list[_Token]:
    out: list[_Token] = []
    i = 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c == "#":
            newline = expr.find("\n", i)
            i = len(expr) if newline < 0 else newline
        elif c in "\"'`":
            end = _string_end(expr, i)
            out.append(_Token("string", expr[i:end], end))
            i = end
        elif c == "{":
            end = _closing(expr, i, "}")
            out.append(_Token("matchers", expr[i:end], end))
            i = end
        elif c == "[":
            end = _closing(expr, i, "]")
            out.append(_Token("range", expr[i:end], end))
            i = end
        elif c == "$" and (m := _VARIABLE.match(expr, i)):
            # An unsubstituted dashboard variable: neither a metric nor an operator.
            out.append(_Token("variable", m.group(), m.end()))
            i = m.end()
        elif c in "()":
            out.append(_Token("paren", c, i + 1))
            i += 1
        elif m := _NUMBER.match(expr, i):
            out.append(_Token("number", m.group(), m.end()))
            i = m.end()
        elif m := _IDENT.match(expr, i):
            out.append(_Token("ident", m.group(), m.end()))
            i = m.end()
        else:
            op = next((o for o in _COMPARISONS if expr.startswith(o, i)), c)
            out.append(_Token("op", op, i + len(op)))
            i += len(op)
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, keywords or label names)."""
    tokens = _tokens(expr)
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        opens = following is not None and following.text == "("
        # `sum by (le) (...)`: an aggregation whose modifier comes before its parenthesis.
        modified = following is not None and following.text in ("by", "without")
        if tok.kind == "ident" and tok.text in _LABEL_LISTS and opens:
            depth, i = 0, i + 1
            while i < len(tokens):  # skip the label list
                depth += (
                    {"(": 1, ")": -1}.get(tokens[i].text, 0) if tokens[i].kind == "paren" else 0
                )
                if depth == 0:
                    break
                i += 1
        elif tok.kind == "ident" and tok.text not in _KEYWORDS and not (opens or modified):
            names.add(tok.text)
        i += 1
    return names


def query_metric_names(query: Query) -> set[str]:
    """Metric names of a query; of a ``label_values(selector, label)`` variable, its selector's."""
    if query.kind == "variable" and (m := _LABEL_VALUES.match(query.expr)):
        return metric_names(m.group(1))
    return metric_names(query.expr)


def coverage_form(expr: str) -> str:
    """The expression with every filtering comparison made a ``bool`` comparison."""
    tokens = _tokens(expr)
    out, last = [], 0
    for i, tok in enumerate(tokens):
        if tok.kind == "op" and tok.text in _COMPARISONS:
            following = tokens[i + 1] if i + 1 < len(tokens) else None
            if following is None or following.text != "bool":
                out.append(expr[last : tok.end] + " bool")
                last = tok.end
    out.append(expr[last:])
    return "".join(out)


# --- evaluation ----------------------------------------------------------------------------


class PrometheusError(RuntimeError):
    pass


@dataclass
class Prometheus:
    url: str
    timeout_s: float = 10.0
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=self.timeout_s)

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str, params: Mapping[str, Any]) -> Any:
        response = self.client.get(path, params=params)
        try:
            body = response.json()
        except ValueError as exc:
            raise PrometheusError(f"HTTP {response.status_code}: {response.text[:300]}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[str]:
        """The values of an instant query, one per series (a scalar counts as one)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [data["result"][1]]
        if data["resultType"] == "vector":
            return [sample["value"][1] for sample in data["result"]]
        raise PrometheusError(f"unexpected result type {data['resultType']}")

    def series(self, match: str) -> list[dict[str, str]]:
        """The label sets of the series a selector matches."""
        return list(self._get("/api/v1/series", {"match[]": match}))

    def label_values(self, label: str, match: str) -> list[str]:
        return list(self._get(f"/api/v1/label/{label}/values", {"match[]": match}))

    def rules(self) -> list[dict[str, Any]]:
        data = self._get("/api/v1/rules", {})
        return [rule for group in data["groups"] for rule in group["rules"]]


def _finite(values: Sequence[str]) -> bool:
    return any(math.isfinite(float(v)) for v in values)


def check(
    queries: Sequence[Query],
    prometheus: Prometheus,
    values: Mapping[str, Mapping[str, str]] | None = None,
    *,
    exported: set[str] | None = None,
    recorded: Iterable[str] = (),
    at: float | None = None,
    require_finite: bool = False,
) -> list[Problem]:
    """Evaluate every query; return what is wrong (empty: all good).

    ``values``: variable values for substitution per source file (the part of
    ``Query.source`` before the first colon, e.g. a dashboard's file name).
    ``exported``: every metric name the router and engines export (None: not checked).
    ``recorded``: names recording rules produce (they may be named too).
    """
    problems: list[Problem] = []
    allowed = None if exported is None else exported | PROMETHEUS_GENERATED | set(recorded)
    for query in queries:
        file = query.source.split(":", 1)[0]
        try:
            expr = substitute(query.expr, (values or {}).get(file, {}))
        except KeyError as exc:
            problems.append(Problem(query, str(exc.args[0])))
            continue
        label_values = _LABEL_VALUES.match(expr) if query.kind == "variable" else None
        selector = label_values.group(1) if label_values else expr
        if allowed is not None:
            for name in sorted(metric_names(selector) - allowed):
                problems.append(Problem(query, f"names {name}, which nothing exports"))
        try:
            if label_values:
                found = prometheus.label_values(label_values.group(2), selector)
                if not found:
                    problems.append(Problem(query, "the variable has no values"))
                continue
            as_written = prometheus.query(expr, at)
            if query.kind == "panel":
                result, form = as_written, "as written"
            else:
                result, form = prometheus.query(coverage_form(expr), at), "in bool form"
        except PrometheusError as exc:
            problems.append(Problem(query, f"Prometheus refused it: {exc}"))
            continue
        if not result:
            problems.append(Problem(query, f"no series ({form})"))
        elif require_finite and not _finite(result):
            problems.append(Problem(query, f"no finite value in {len(result)} series ({form})"))
    return problems


def load_queries(
    dashboards: Iterable[Path], rules: Iterable[Path]
) -> tuple[list[Query], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Queries of dashboard JSON files and rule files, plus the parsed documents."""
    queries: list[Query] = []
    dashboard_docs: dict[str, dict[str, Any]] = {}
    rule_docs: list[dict[str, Any]] = []
    for path in dashboards:
        doc = json.loads(path.read_text())
        dashboard_docs[path.name] = doc
        queries += dashboard_queries(doc, path.name)
    for path in rules:
        doc = yaml.safe_load(path.read_text())
        rule_docs.append(doc)
        queries += rule_queries(doc, path.name)
    return queries, dashboard_docs, rule_docs


def main(argv: Sequence[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus")
    parser.add_argument("--fleet", required=True, help="value for the dashboards' $fleet")
    parser.add_argument("--engines", required=True, help="comma-separated ids for $engine")
    parser.add_argument("--rate-interval", default="5m", help="value for $__rate_interval")
    parser.add_argument(
        "--exposition",
        action="append",
        default=[],
        help="a /metrics URL of the router or an engine, or file://PATH of a saved page "
        "(repeat); names are checked against their union (not checked without any)",
    )
    parser.add_argument(
        "--dashboards", type=Path, nargs="*", default=None, help="dashboard JSON files"
    )
    parser.add_argument("--rules", type=Path, nargs="*", default=None, help="rule files")
    parser.add_argument(
        "--require-finite",
        action="store_true",
        help="a query must also return at least one finite value (use after real traffic)",
    )
    args = parser.parse_args(argv)
    dashboards = args.dashboards
    if dashboards is None:
        dashboards = sorted((root / "configs/grafana/dashboards").glob("*.json"))
    rules = args.rules
    if rules is None:
        rules = sorted((root / "configs/prometheus/rules").glob("*.yml"))
    queries, docs, rule_docs = load_queries(dashboards, rules)
    given = {
        "fleet": args.fleet,
        "engine": multi_value(args.engines.split(",")),
        "__rate_interval": args.rate_interval,
        "__interval": args.rate_interval,
    }
    values = {name: variable_values(doc, given) for name, doc in docs.items()}
    exported = None
    if args.exposition:
        texts = []
        for url in args.exposition:
            if url.startswith("file://"):
                try:
                    texts.append(Path(url.removeprefix("file://")).read_text())
                except OSError as exc:
                    parser.error(f"--exposition {url}: {exc.strerror or exc}")
                continue
            # A page that is not an exposition (a router's /metrics behind --protect-metrics
            # answers 401 JSON) would read as unparseable labels: say which and why.
            try:
                page = httpx.get(url, timeout=10)
            except httpx.HTTPError as exc:
                parser.error(f"--exposition {url}: {type(exc).__name__}: {exc}")
            if page.status_code != 200:
                parser.error(
                    f"--exposition {url}: HTTP {page.status_code} (a router started with "
                    "--protect-metrics needs its page fetched with a key: save it to a file "
                    "and pass file://PATH)"
                    if page.status_code in (401, 403)
                    else f"--exposition {url}: HTTP {page.status_code}"
                )
            texts.append(page.text)
        exported = exported_names(texts)
    try:
        prometheus = Prometheus(args.prometheus)
    except httpx.HTTPError as exc:  # a URL httpx cannot use (no scheme, an unknown one)
        parser.error(f"--prometheus {args.prometheus}: {type(exc).__name__}: {exc}")
    try:
        problems = check(
            queries,
            prometheus,
            values,
            exported=exported,
            recorded=recorded_names(rule_docs),
            require_finite=args.require_finite,
        )
    except httpx.HTTPError as exc:
        # Not a problem of a query: Prometheus itself cannot be asked (down, or not there).
        print(f"promql_check.py: --prometheus {args.prometheus}: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    finally:
        prometheus.close()
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(queries)} queries, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
