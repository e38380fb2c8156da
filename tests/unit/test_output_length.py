"""The output-length estimate the scheduler foresees decode batches by."""

from __future__ import annotations

from narwhal.routing.output_length import OutputLengthEstimator


def test_max_tokens_until_enough_answers_then_their_high_quantile_capped_by_it() -> None:
    estimate = OutputLengthEstimator(window=100, quantile=0.9, min_samples=10)
    for tokens in range(1, 10):
        estimate.observe(tokens)
    assert estimate.expected(500) == 500  # nine answers: not yet
    estimate.observe(10)
    assert estimate.expected(500) == 9  # the 9th of 10 (nearest rank)
    assert estimate.expected(4) == 4  # never above what the request asks for
    estimate.observe(0)  # nothing generated: not an answer's length
    assert estimate.expected(500) == 9


def test_the_window_forgets_the_oldest_answers() -> None:
    estimate = OutputLengthEstimator(window=10, quantile=0.9, min_samples=10)
    for _ in range(10):
        estimate.observe(1000)
    assert estimate.expected(4096) == 1000
    for _ in range(10):
        estimate.observe(20)
    assert estimate.expected(4096) == 20


def test_the_mean_length_over_the_window_capped_by_max_tokens() -> None:
    estimate = OutputLengthEstimator(window=10, quantile=0.9, min_samples=4)
    for tokens in (10, 10, 10):
        estimate.observe(tokens)
    assert estimate.mean(500) == 500  # three answers: not yet
    estimate.observe(90)
    assert estimate.mean(500) == 30  # (10 + 10 + 10 + 90) / 4: the tail's quantile is 90
    assert estimate.expected(500) == 90
    assert estimate.mean(20) == 20
    for _ in range(10):  # the window forgets the first four
        estimate.observe(4)
    assert estimate.mean(500) == 4


def test_the_simulator_reports_each_requests_outcome_and_the_oracle_switch() -> None:
    """Every request's outcome, in arrival order, adds up to the run's counts; the
    output-length oracle routes on max_tokens itself."""
    from narwhal.fleetsim.simulator import DesConfig, RequestSpec, _Simulation, run_des
    from narwhal.fleetsim.workloads import synthetic_fleet

    fleet, timings = synthetic_fleet(2, 2, {"ttft_s": 2.0, "tpot_s": 0.3})
    specs = [RequestSpec(0.05 * i, 8192, 16 + i % 7, 1024) for i in range(120)]
    result = run_des(DesConfig(fleet, timings, flipping=False), specs)
    assert len(result.outcomes) == result.offered == 120
    assert result.outcomes.count("met") == result.met_slo
    assert result.outcomes.count("rejected") == result.rejected > 0
    assert set(result.outcomes) <= {"met", "rejected", "ttft_late", "tpot_late", "failed"}
    models = {e: t.in_wall_seconds() for e, t in timings.items()}
    oracle = _Simulation(DesConfig(fleet, timings, flipping=False, output_oracle=True), models)
    assert oracle.lifecycle.outputs.expected(1024) == 1024
