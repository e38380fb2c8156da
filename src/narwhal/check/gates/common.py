"""What several gates share: the outcome every gate returns, the rounding of numbers in
evidence, and the prompt length the budgets are judged at (kv_transfer, slo, the runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from narwhal.check.plan import BenchmarkPlan
from narwhal.profiles.store import ProfileStore

__all__ = ["GateOutcome", "outcome", "planned_prompt_tokens", "rounded"]


@dataclass
class GateOutcome:
    verdict: Literal["pass", "fail"]
    summary: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


def outcome(
    summary: str, failures: list[str], notes: list[str], evidence: dict[str, Any]
) -> GateOutcome:
    """A failing outcome when there are failures (its summary counts them), else a passing
    one with ``summary``."""
    if failures:
        return GateOutcome("fail", f"{len(failures)} problem(s)", failures, notes, evidence)
    return GateOutcome("pass", summary, [], notes, evidence)


def rounded(value: float | None, digits: int = 6) -> float | None:
    """A number as evidence shows it: rounded to ``digits`` places; None stays None."""
    return None if value is None else round(value, digits)


def planned_prompt_tokens(
    store: ProfileStore | None, plan: BenchmarkPlan | None
) -> tuple[int | None, str]:
    """The prompt length the budgets are judged at, and why that one."""
    if plan is not None:
        return plan.workload.input_tokens, "the benchmark plan's workload input_tokens"
    if store is not None:
        return (
            max(store.plan.prefill_lens),
            "the longest prompt the profile store was measured at (no --plan)",
        )
    return None, "no plan and no profile store"
