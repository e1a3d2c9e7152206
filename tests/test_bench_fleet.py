"""`python -m benchmarks.bench fleet` kept tiny, on the real PostgreSQL the bench starts itself: the shape of its
answer,
never its timings."""

from __future__ import annotations

import pytest

from benchmarks import bench
from benchmarks.bench_fleet import bench_fleet, report

ROW_KEYS = {
    "steps_per_s",
    "requests_per_s",
    "p50_ms",
    "p99_ms",
    "generator_cpu_share",
    "generator_cpu_share_max",
    "server_cpu_share",
    "server_cpu_us_per_step",
    "server_loop_cpu_us_per_step",
    "other_cpu_share",
}


def test_fleet_gives_three_rows_their_ratios_and_the_move_of_every_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """One round of 1 s per setup, then 10 sessions made on a, a drained, each moved to b by one step and paired with
    a step on one of b's own: every row measured, every session moved, and all of them b's afterwards."""
    # A short warm-up: the window opens once every generator has connected, and this test reads no timing.
    monkeypatch.setattr(bench, "WARMUP_S", 0.2)
    r = bench_fleet(seconds=1.0, rounds=1, sessions=10)

    assert set(r) == {
        "clients",
        "generators",
        "seconds",
        "rounds",
        "event_loop",
        "cpus",
        "postgres",
        "rows",
        "ratios",
        "ratios_per_round",
        "runs",
        "move",
        "targets",
    }
    assert (r["clients"], r["generators"], r["seconds"], r["rounds"]) == (16, 2, 1.0, 1)
    assert r["postgres"]["version"].startswith("15")
    assert (r["postgres"]["fsync"], r["postgres"]["synchronous_commit"]) == ("on", "on")
    assert list(r["rows"]) == ["sqlite", "fleet-1", "fleet-2"]
    for row in r["rows"].values():
        assert set(row) == ROW_KEYS, row.get("error")
        assert row["steps_per_s"] > 0
    assert set(r["ratios"]) == {"fleet_1_over_sqlite", "fleet_2_over_fleet_1"}
    assert isinstance(r["ratios"]["fleet_1_over_sqlite"], float)
    assert isinstance(r["ratios"]["fleet_2_over_fleet_1"], float)
    assert len(r["ratios_per_round"]) == 1
    assert {name: len(runs) for name, runs in r["runs"].items()} == {"sqlite": 1, "fleet-1": 1, "fleet-2": 1}

    move = r["move"]
    assert set(move) == {
        "sessions",
        "turns",
        "drained",
        "moved",
        "baseline_steps",
        "move",
        "baseline",
        "move_minus_baseline_p50_ms",
        "b_rebuilt",
        "b_errors",
        "owners_after",
    }, move.get("error")
    assert (move["sessions"], move["turns"], move["drained"], move["moved"], move["baseline_steps"]) == (
        10,
        5,
        10,
        10,
        10,
    )
    assert set(move["move"]) == set(move["baseline"]) == {"p50_ms", "p99_ms"}
    # Every moved session was rebuilt on b, none answered MOVED, and all twenty are b's now. At least ten rebuilds:
    # on a loaded machine a step that misses its inline budget is rebuilt too (counted alike), so more is not wrong.
    assert (move["b_rebuilt"] >= 10, move["b_errors"], move["owners_after"]) == (True, {}, {"b": 20})
    assert set(r["targets"]) == {"move_p50_under_10_ms", "two_daemons_serve_more"}
    assert isinstance(r["targets"]["move_p50_under_10_ms"], bool)
    assert isinstance(r["targets"]["two_daemons_serve_more"], bool)

    text = report(r)
    for line in ("sqlite: devd serve", "fleet-1 / sqlite:", "fleet-2 / fleet-1:", "move step", "baseline step"):
        assert line in text
    assert "failed" not in text
