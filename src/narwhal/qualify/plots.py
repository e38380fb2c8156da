"""The qualification report's plots: matplotlib figures (no pyplot state, the Agg canvas) rendered
to SVG text that the page inlines and the Markdown links to.

Each function takes plain data and returns one SVG document. Text stays text
(``svg.fonttype: none``: no glyph definitions whose ids would repeat across inlined figures),
and each figure salts its element ids with its own name, so ids are stable between runs and
distinct between figures.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = [
    "RoleSpan",
    "Series",
    "attainment_svg",
    "distribution_svg",
    "probes_svg",
    "roles_svg",
]

_SIZE = (7.5, 3.6)
_ROLE_COLOURS = {"prefill": "#4c72b0", "decode": "#dd8452", "both": "#55a868"}
_PASS, _FAIL = "#55a868", "#c44e52"


@dataclass(frozen=True)
class Series:
    """One point's values (seconds) and the budget they are judged against (None: none)."""

    label: str
    values: Sequence[float]
    budget: float | None = None


@dataclass(frozen=True)
class RoleSpan:
    """One engine holding one role from ``start_s`` to ``end_s`` (seconds from the start)."""

    engine: str
    role: str
    start_s: float
    end_s: float


def _figure() -> Figure:
    fig = Figure(figsize=_SIZE, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _svg(fig: Figure, name: str) -> str:
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    # Inline SVG: the XML declaration and DOCTYPE belong to a standalone file only.
    return text[text.index("<svg") :]


def _colour(i: int) -> str:
    return f"C{i % 10}"


def distribution_svg(
    name: str, series: Sequence[Series], *, xlabel: str, scale: float = 1.0
) -> str:
    """Empirical CDFs, one line per point, values multiplied by ``scale`` (into the unit
    ``xlabel`` names); each point's budget a dashed vertical line in its colour (one black line
    when they agree)."""
    fig = _figure()
    ax = fig.add_subplot()
    budgets = {s.budget for s in series if s.budget is not None}
    for i, s in enumerate(series):
        if not s.values:
            continue
        xs = np.sort(np.asarray(s.values, dtype=float)) * scale
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(xs, ys, where="post", color=_colour(i), label=f"{s.label} (n={len(xs)})")
        if s.budget is not None and len(budgets) > 1:
            ax.axvline(s.budget * scale, color=_colour(i), linestyle="--", linewidth=1)
    if len(budgets) == 1:
        (budget,) = budgets
        ax.axvline(budget * scale, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests ≤ x")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _svg(fig, name)


def attainment_svg(
    name: str, labels: Sequence[str], attainment: Sequence[float], targets: Sequence[float]
) -> str:
    """One bar per point (share of its requests within limits), its target a dashed line over
    the bar; green when the point met its target, red when it did not."""
    fig = _figure()
    ax = fig.add_subplot()
    xs = np.arange(len(labels))
    colours = [_PASS if a >= t else _FAIL for a, t in zip(attainment, targets, strict=True)]
    bars = ax.bar(xs, attainment, color=colours, width=0.6)
    ax.bar_label(bars, labels=[f"{a:.1%}" for a in attainment], padding=2, fontsize="small")
    for x, target in zip(xs, targets, strict=True):
        ax.hlines(target, x - 0.4, x + 0.4, colors="black", linestyles="--", linewidth=1)
    ax.plot([], [], color="black", linestyle="--", linewidth=1, label="attainment target")
    ax.set_xticks(xs, labels)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("requests within limits")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _svg(fig, name)


def probes_svg(
    name: str,
    probes: Mapping[str, Sequence[float]],
    deadline_s: float,
    recommended_s: float | None = None,
) -> str:
    """The KV gate's handoff probes: each probe's first-token latency, one column per
    (prefill -> decode) pair, against the fleet's first-token deadline."""
    fig = _figure()
    ax = fig.add_subplot()
    pairs = list(probes)
    for i, pair in enumerate(pairs):
        ys = list(probes[pair])
        ax.scatter([i] * len(ys), ys, color=_colour(0), zorder=3, s=24)
    ax.axhline(deadline_s, color=_FAIL, linestyle="--", linewidth=1.2, label="first-token deadline")
    if recommended_s is not None:
        ax.axhline(
            recommended_s,
            color="grey",
            linestyle=":",
            linewidth=1.2,
            label="recommended deadline",
        )
    ax.set_xticks(range(len(pairs)), pairs, rotation=30 if len(pairs) > 6 else 0)
    ax.set_xlim(-0.5, max(len(pairs), 1) - 0.5)
    ax.set_ylabel("first token after handoff (s)")
    ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(loc="upper right", fontsize="small")
    return _svg(fig, name)


def roles_svg(
    name: str,
    spans: Sequence[RoleSpan],
    windows: Sequence[tuple[str, float, float]] = (),
    *,
    xlabel: str = "seconds since the router started",
) -> str:
    """Which engine held which role over time: one lane per engine, one coloured bar per role
    held, the benchmark points' windows shaded and named above."""
    fig = _figure()
    ax = fig.add_subplot()
    engines = sorted({s.engine for s in spans})
    lane = {e: i for i, e in enumerate(engines)}
    for label, start, end in windows:
        ax.axvspan(start, end, color="grey", alpha=0.12, linewidth=0)
        ax.text((start + end) / 2, -0.65, label, ha="center", va="center", fontsize="small")
    seen: set[str] = set()
    for s in spans:
        colour = _ROLE_COLOURS.get(s.role, "#8172b3")
        ax.broken_barh(
            [(s.start_s, max(s.end_s - s.start_s, 1e-6))],
            (lane[s.engine] - 0.3, 0.6),
            facecolors=colour,
            label=None if s.role in seen else s.role,
        )
        seen.add(s.role)
    ax.set_yticks(range(len(engines)), engines)
    # Top to bottom, engines in order, the points' names in the band above the first lane.
    ax.set_ylim(len(engines) - 0.4, -0.9)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize="small")
    return _svg(fig, name)
