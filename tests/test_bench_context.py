"""`python -m benchmarks.bench_context` kept tiny: its shape, and that no request passed the window."""

from __future__ import annotations

from benchmarks.bench_context import bench_context


def test_a_short_run_compacts_and_never_sends_a_request_past_the_window() -> None:
    r = bench_context(turns=12, window=6, measure_rounds=5)
    assert (
        [w["turns"] for w in r["windows"]],
        r["over_window"],
        sum(w["compactions"] for w in r["windows"]) > 0,
        max(w["with_limit_max"] for w in r["windows"]) <= 8000,
    ) == (["1-6", "7-12"], 0, True, True)
