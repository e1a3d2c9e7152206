"""`python -m benchmarks.bench long` against the real daemon, kept tiny: the shape of its answer, never its timings."""

from __future__ import annotations

from benchmarks.bench_long import bench_long


def test_long_gives_a_row_per_window_then_the_restart() -> None:
    """Four seed turns in windows of two: two rows of exactly ten steps, each with the daemon's figures, then a
    SIGTERM, a new life on the same state directory, and the woken session's first step and the ten after it."""
    r = bench_long(turns=4, window=2)

    assert r["stopped"] is None
    assert r["errors"] == {}
    assert r["error_log"] == []
    assert [(w["turns"], w["steps"]) for w in r["windows"]] == [("1-2", 10), ("3-4", 10)]
    for w in r["windows"]:
        assert set(w) == {
            "turns",
            "steps",
            "p50_ms",
            "p99_ms",
            "max_ms",
            "mean_ms",
            "disk_bytes_per_step",
            "write_bytes_per_step",
            "state_mib",
            "rss_mib",
            "offloaded",
            "errors",
            "snapshot_bytes",
            "snapshot_ms",
            "sent_bytes",
        }
        assert w["snapshot_bytes"] > 0
        assert w["errors"] == 0
    assert r["windows"][1]["snapshot_bytes"] > r["windows"][0]["snapshot_bytes"]
    assert r["windows"][1]["sent_bytes"] > r["windows"][0]["sent_bytes"]

    restart = r["restart"]
    assert restart["exit"] == 0
    assert restart["turn"] == 5
    assert "stopped" not in restart
    assert isinstance(restart["first_step_ms"], float)
    assert len(restart["next_steps_ms"]) == 10
    assert set(r["ratios"]) == {
        "p50_last_over_first",
        "disk_bytes_per_step_last_over_first",
        "state_dir_over_snapshot_plus_events",
    }
