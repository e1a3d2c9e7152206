"""The daemon's counters for Prometheus: `daemon/status` in the text exposition format.

What it promises: `prometheus(status)` is the one rendering of the counters: `devd status --prometheus` prints, and
`GET /metrics` (`devd.server.scrape`) answers, the same text for the same `daemon/status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# -- daemon/status in the Prometheus text format ---------------------------------------------------------------------


def _label(value: object) -> str:
    return str(value).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def _seconds(ms: float) -> float:
    return round(ms / 1000, 9)  # 1.1 ms is 0.0011, not 0.0011000000000000001


def prometheus(status: Mapping[str, Any]) -> str:
    """daemon/status (as JSON decodes it) in the Prometheus text format: `# HELP` and `# TYPE` for every metric, base
    units (seconds, bytes), `_total` on counters. Commit latency is a summary of the last 1,024 commits, without
    `_sum` and `_count` (the daemon keeps neither; `devd_durable_writes_total` counts the commits)."""
    s = status
    families: list[tuple[str, str, str, list[tuple[str, float]]]] = [
        (
            "devd_build_info",
            "gauge",
            "The daemon's version, as a label; always 1.",
            [(f'{{version="{_label(s["server"]["version"])}"}}', 1)],
        ),
        ("devd_uptime_seconds", "gauge", "Seconds since the daemon started.", [("", s["uptime_s"])]),
        (
            "devd_sessions",
            "gauge",
            "Sessions by state: live (in memory), stored (on disk), ended, poisoned.",
            [(f'{{state="{_label(state)}"}}', n) for state, n in s["sessions"].items()],
        ),
        ("devd_connections", "gauge", "Client connections open now.", [("", s["connections"])]),
        ("devd_steps_total", "counter", "Steps answered.", [("", s["steps"])]),
        (
            "devd_durable_writes_total",
            "counter",
            "Commits made durable (written and fsync'd); one carries one or more writes.",
            [("", s["durable_writes"])],
        ),
        (
            "devd_commit_duration_seconds",
            "summary",
            "How long a commit took, write and fsync, over the last 1,024 commits.",
            [('{quantile="0.5"}', _seconds(s["commit_ms_p50"])), ('{quantile="0.99"}', _seconds(s["commit_ms_p99"]))],
        ),
        ("devd_deadline_hits_total", "counter", "Calls stopped by their deadline.", [("", s["deadline_hits"])]),
        (
            "devd_offloaded_calls_total",
            "counter",
            "Calls run on a worker thread: past their inline budget, or of a session whose calls grew past it.",
            [("", s["offloaded"])],
        ),
        (
            "devd_sessions_rebuilt_total",
            "counter",
            "Sessions rebuilt from their snapshot and journal: woken, recovered, or after an inline call was stopped.",
            [("", s["rebuilt"])],
        ),
        (
            "devd_sessions_hibernated_total",
            "counter",
            "Idle sessions whose instance was dropped to stay within --max-live or --live-memory.",
            [("", s["hibernated"])],
        ),
        ("devd_sessions_expired_total", "counter", "Sessions deleted by --expire-after.", [("", s["expired"])]),
        (
            "devd_store_reopened_total",
            "counter",
            "Times the store reopened its database after a write fault (a failed write or fsync) and served again.",
            [("", s["store_reopened"])],
        ),
        (
            "devd_errors_total",
            "counter",
            "Error answers, by kind (the error's data.kind).",
            [(f'{{kind="{_label(kind)}"}}', n) for kind, n in sorted(s["errors"].items())],
        ),
        (
            "devd_live_memory_bytes",
            "gauge",
            "The memory of the sessions' instances together.",
            [("", s["live_memory_bytes"])],
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory of the daemon's process.",
            [("", s["memory_rss_bytes"])],
        ),
    ]
    lines = []
    for name, kind, help, samples in families:
        lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
    return "\n".join(lines) + "\n"
