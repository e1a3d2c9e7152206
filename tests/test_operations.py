"""What an operator relies on: `devd status --prometheus` in the exact text format, `devd doctor` against a real
daemon and a real stopped state directory, the log events a session's lifecycle and a failed answer leave, and
docs/operations.md naming every log event and exit status there is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devd import __version__, cli, errors
from devd.messages import turn
from devd.sqlite_store import MIGRATIONS
from tests.daemon import ROOT, Daemon, log_events

DOC = ROOT / "docs" / "operations.md"


def devd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devd", *args], capture_output=True, text=True, timeout=timeout)


# -- metrics ---------------------------------------------------------------------------------------------------------

STATUS: dict[str, Any] = {
    "server": {"name": "devd", "version": "0.1.0"},
    "uptime_s": 12.5,
    "sessions": {"live": 1, "stored": 2, "ended": 0, "poisoned": 3},
    "connections": 4,
    "steps": 5,
    "durable_writes": 6,
    "errors": {"INTERNAL": 1, "BUSY": 2},
    "deadline_hits": 7,
    "offloaded": 8,
    "rebuilt": 9,
    "hibernated": 10,
    "live_memory_bytes": 1245184,
    "expired": 11,
    "commit_ms_p50": 1.1,
    "commit_ms_p99": 12.25,
    "memory_rss_bytes": 63991808,
}

PROMETHEUS = """\
# HELP devd_build_info The daemon's version, as a label; always 1.
# TYPE devd_build_info gauge
devd_build_info{version="0.1.0"} 1
# HELP devd_uptime_seconds Seconds since the daemon started.
# TYPE devd_uptime_seconds gauge
devd_uptime_seconds 12.5
# HELP devd_sessions Sessions by state: live (in memory), stored (on disk), ended, poisoned.
# TYPE devd_sessions gauge
devd_sessions{state="live"} 1
devd_sessions{state="stored"} 2
devd_sessions{state="ended"} 0
devd_sessions{state="poisoned"} 3
# HELP devd_connections Client connections open now.
# TYPE devd_connections gauge
devd_connections 4
# HELP devd_steps_total Steps answered.
# TYPE devd_steps_total counter
devd_steps_total 5
# HELP devd_durable_writes_total Commits made durable (written and fsync'd); one carries one or more writes.
# TYPE devd_durable_writes_total counter
devd_durable_writes_total 6
# HELP devd_commit_duration_seconds How long a commit took, write and fsync, over the last 1,024 commits.
# TYPE devd_commit_duration_seconds summary
devd_commit_duration_seconds{quantile="0.5"} 0.0011
devd_commit_duration_seconds{quantile="0.99"} 0.01225
# HELP devd_deadline_hits_total Calls stopped by their deadline.
# TYPE devd_deadline_hits_total counter
devd_deadline_hits_total 7
# HELP devd_offloaded_calls_total Calls run on a worker thread: past their inline budget, or of a session whose calls grew past it.
# TYPE devd_offloaded_calls_total counter
devd_offloaded_calls_total 8
# HELP devd_sessions_rebuilt_total Sessions rebuilt from their snapshot and journal: woken, recovered, or after an inline call was stopped.
# TYPE devd_sessions_rebuilt_total counter
devd_sessions_rebuilt_total 9
# HELP devd_sessions_hibernated_total Idle sessions whose instance was dropped to stay within --max-live or --live-memory.
# TYPE devd_sessions_hibernated_total counter
devd_sessions_hibernated_total 10
# HELP devd_sessions_expired_total Sessions deleted by --expire-after.
# TYPE devd_sessions_expired_total counter
devd_sessions_expired_total 11
# HELP devd_errors_total Error answers, by kind (the error's data.kind).
# TYPE devd_errors_total counter
devd_errors_total{kind="BUSY"} 2
devd_errors_total{kind="INTERNAL"} 1
# HELP devd_live_memory_bytes The memory of the sessions' instances together.
# TYPE devd_live_memory_bytes gauge
devd_live_memory_bytes 1245184
# HELP process_resident_memory_bytes Resident memory of the daemon's process.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 63991808
"""  # noqa: E501


def test_prometheus_output_is_exactly_the_text_format_with_base_units() -> None:
    assert cli.prometheus(STATUS) == PROMETHEUS


def test_every_prometheus_metric_has_help_and_type_and_counters_end_in_total() -> None:
    lines = cli.prometheus(STATUS).splitlines()
    helped = [line.split()[2] for line in lines if line.startswith("# HELP ")]
    typed = {line.split()[2]: line.split()[3] for line in lines if line.startswith("# TYPE ")}
    sampled = {re.split(r"[{ ]", line)[0] for line in lines if not line.startswith("#")}
    assert (helped == list(typed), sampled == set(typed)) == (True, True)
    assert [name for name, kind in typed.items() if (kind == "counter") != name.endswith("_total")] == []


def test_status_prometheus_against_the_daemon_counts_its_steps(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "x"))
    run = devd("status", "--prometheus", "--connect", str(daemon.socket))
    samples = dict(line.rsplit(" ", 1) for line in run.stdout.splitlines() if not line.startswith("#"))
    assert (run.returncode, samples["devd_steps_total"], samples['devd_sessions{state="live"}']) == (0, "1", "1")
    assert samples[f'devd_build_info{{version="{__version__}"}}'] == "1"


# -- devd doctor -----------------------------------------------------------------------------------------------------


def doctor(d: Daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    return devd("doctor", "--connect", str(d.socket), "--state-dir", str(d.state), *extra)


def files(directory: Path) -> dict[str, tuple[int, int]]:
    """Each file's size and modification time: what a read-only check must leave as it found it."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def not_running(d: Daemon, why: str) -> str:
    return (
        f"FAIL  daemon: no daemon is listening at {d.socket} ({why}); start one with `devd serve` (or `make run` in a "
        "checkout), or point at yours with --connect or DEVD_SOCKET"
    )


def test_doctor_passes_against_a_running_daemon_and_skips_the_integrity_check_saying_why(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = doctor(daemon)
    assert daemon.proc is not None
    lines = run.stdout.splitlines()
    assert (run.returncode, len(lines), run.stderr) == (0, 5, "")
    assert lines[0].startswith(f"ok    daemon: answers at {daemon.socket} (devd {__version__}, up ")
    assert lines[0].endswith(", 1 sessions)")
    assert lines[1] == f"ok    state dir: {daemon.state} is 0700 and yours"
    assert lines[2].startswith(f"ok    database: {daemon.state / 'devd.sqlite3'} (")
    assert lines[3] == "ok    core: the packaged core loads and speaks ABI 1"
    assert lines[4] == (
        f"skip  integrity: a daemon holds {daemon.state} (pid {daemon.proc.pid}, socket {daemon.socket}) and keeps "
        "its database open exclusively; stop the daemon, then run devd doctor again to check the database"
    )


def test_doctor_checks_a_killed_daemons_database_read_only_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "x"))
    d.kill()  # the write-ahead log is left beside the database, as after a crash
    before = files(d.state)
    run = doctor(d)
    lines = run.stdout.splitlines()
    assert (run.returncode, lines[0], lines[4]) == (
        1,
        not_running(d, "Connection refused"),  # a killed daemon leaves its socket behind
        f"ok    integrity: {d.state / 'devd.sqlite3'} passes PRAGMA quick_check (format {len(MIGRATIONS)})",
    )
    assert "devd.sqlite3-wal" in before
    assert files(d.state) == before


def test_doctor_finds_a_database_that_is_not_one(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.state.mkdir(mode=0o700, parents=True)
    (d.state / "devd.sqlite3").write_bytes(b"this is not a database" * 100)
    run = doctor(d)
    assert (run.returncode, run.stdout.splitlines()[4]) == (
        1,
        f"FAIL  integrity: {d.state / 'devd.sqlite3'} cannot be read: file is not a database; keep it as it is "
        "(copy it aside) and restore a backup",
    )


def test_doctor_fails_a_state_dir_others_can_read_and_says_to_chmod_it(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.state.mkdir(mode=0o700, parents=True)
    d.state.chmod(0o755)
    run = doctor(d)
    assert run.stdout.splitlines()[1:3] == [
        f"FAIL  state dir: {d.state} is mode 0755; run `chmod 700 {d.state}` (its sessions are yours alone, and the "
        "daemon refuses a directory others may write)",
        f"FAIL  database: {d.state / 'devd.sqlite3'} does not exist; `devd serve` makes it on first start (if this "
        "state directory held sessions, they are gone: restore a backup into it)",
    ]


def test_doctor_on_a_missing_state_dir_and_a_broken_core_fails_each_and_skips_integrity(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    broken = tmp_path / "broken.wasm"
    broken.write_bytes(b"\0asm but not really")
    run = doctor(d, "--core", str(broken))
    lines = run.stdout.splitlines()
    assert (run.returncode, [line[:6] for line in lines]) == (1, ["FAIL  ", "FAIL  ", "FAIL  ", "FAIL  ", "skip  "])
    assert lines[1] == (
        f"FAIL  state dir: {d.state} does not exist; `devd serve` makes it on first start (for a daemon run with "
        "--state-dir DIR, pass the same here)"
    )
    assert (lines[0], lines[3].startswith(f"FAIL  core: {broken} does not load: the module does not compile: ")) == (
        not_running(d, "No such file or directory"),
        True,
    )
    assert lines[4] == f"skip  integrity: there is no {d.state / 'devd.sqlite3'} to check"


@pytest.mark.skipif(os.getuid() != 0, reason="root may check another user's state directory")
def test_doctor_as_root_names_the_owner_of_another_users_state_dir(tmp_path: Path) -> None:
    d = Daemon(tmp_path)
    d.state.mkdir(mode=0o700, parents=True)
    os.chown(d.state, 4242, 4242)
    run = doctor(d)
    assert run.stdout.splitlines()[1] == f"ok    state dir: {d.state} is 0700 and uid 4242's"


# -- logs ------------------------------------------------------------------------------------------------------------


def events_after_ready(d: Daemon) -> list[dict[str, object]]:
    logged = log_events(d.log)
    start = next(i for i, e in enumerate(logged) if e["event"] == "daemon.ready")
    return [{k: v for k, v in e.items() if k != "timestamp"} for e in logged[start + 1 :]]


def test_a_sessions_lifecycle_is_logged_at_info_and_its_steps_are_not(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="a")
        for t in range(1, 4):
            c.step("a", turn(t, "x"))
        c.fork("a", at=2, name="b")
        c.restore(c.snapshot("a"), session="c")
        c.recover("a")
        c.close_session("b")
        c.status()
        c.list()
    assert events_after_ready(daemon) == [
        {"event": "session.created", "level": "info", "session": "a"},
        {"event": "session.forked", "level": "info", "session": "b", "source": "a", "at": 2},
        {"event": "session.restored", "level": "info", "session": "c"},
        {"event": "session.recovered", "level": "info", "session": "a"},
        {"event": "session.closed", "level": "info", "session": "b"},
    ]


def test_an_internal_answer_is_logged_at_error_with_its_method_session_and_type(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@2"}) as d, d.client() as c:
        c.new(session="a")
        with pytest.raises(errors.InternalError):
            c.new(session="b")
        failed = [e for e in events_after_ready(d) if e["level"] == "error"]
    assert [(e["event"], e.get("method"), e.get("session"), e.get("error_type")) for e in failed] == [
        ("store.broken", None, None, None),
        ("request.failed", "session/new", "b", "StoreError"),
    ]


# -- docs/operations.md ----------------------------------------------------------------------------------------------

LOG_CALL = re.compile(r"\b(?:log|logger)\.(?:debug|info|warning|error|exception|critical)\(\s*\"([a-z_.]+)\"")


def logged_events() -> set[str]:
    """Every event name the daemon's code logs."""
    sources = [p for p in (ROOT / "devd").glob("*.py") if not p.name.startswith("bench")]
    return {name for p in sources for name in LOG_CALL.findall(p.read_text())}


def documented_events() -> set[str]:
    """The first column of the tables in the document's Logs section."""
    text = DOC.read_text()
    logs = text[text.index("\n## Logs\n") : text.index("\n## Metrics\n")]
    return set(re.findall(r"^\| `([a-z_.]+)` \|", logs, re.MULTILINE))


def test_the_operations_doc_explains_every_log_event_and_no_other() -> None:
    logged, documented = logged_events(), documented_events()
    assert (sorted(logged - documented), sorted(documented - logged)) == ([], [])


def test_the_operations_doc_lists_the_exit_codes_the_command_has() -> None:
    text = DOC.read_text()
    section = text[text.index("\n## The `devd` command") :]
    documented = [int(code) for code in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)]
    codes = [cli.EXIT_OK, cli.EXIT_ANSWERED_ERROR, cli.EXIT_LOCAL, cli.EXIT_UNREACHABLE, cli.EXIT_INTERRUPTED]
    assert (documented, "DEVD_SOCKET" in section) == (codes, True)


def test_the_units_the_operations_doc_installs_exist() -> None:
    named = set(re.findall(r"systemd/(?:user/)?devd\.(?:service|socket)", DOC.read_text()))
    assert sorted(n for n in named if not (ROOT / n).is_file()) == []
    assert len(named) == 4
