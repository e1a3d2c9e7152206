"""What an operator relies on: `devd status --prometheus` against the daemon (its text format is tested in
tests/test_metrics.py), `devd doctor` against a real daemon and a real stopped state directory, the log events a
session's lifecycle and a failed answer leave, and docs/operations.md naming every log event, exit status and
variable there is."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from devd import __version__, cli, errors
from devd.messages import turn
from devd.server.metrics import prometheus
from devd.storage.sqlite import MIGRATIONS
from tests.daemon import ROOT, Daemon, log_events
from tests.harness import InProcess
from tests.helpers import STATUS, devd, subcommands

DOC = ROOT / "docs" / "operations.md"


# -- metrics ---------------------------------------------------------------------------------------------------------


def test_status_prometheus_against_the_daemon_counts_its_steps(daemon: InProcess) -> None:
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


def stopped(d: Daemon) -> str:
    return (
        f"skip  daemon: not running: nothing listens at {d.socket}, and no daemon holds {d.state}: as expected while "
        "it is stopped (to restore a backup, or to upgrade), so its database is checked below; start it with `devd "
        "serve` (or its systemd unit) when you are done"
    )


def test_doctor_passes_against_a_running_daemon_and_skips_the_integrity_check_saying_why(
    process_daemon: Daemon,
) -> None:
    with process_daemon.client() as c:
        c.new(session="s")
    run = doctor(process_daemon)
    assert process_daemon.proc is not None
    lines = run.stdout.splitlines()
    assert (run.returncode, len(lines), run.stderr) == (0, 5, "")
    assert lines[0].startswith(f"ok    daemon: answers at {process_daemon.socket} (devd {__version__}, up ")
    assert lines[0].endswith(", 1 sessions)")
    assert lines[1] == f"ok    state dir: {process_daemon.state} is 0700 and yours"
    assert lines[2].startswith(f"ok    database: {process_daemon.state / 'devd.sqlite3'} (")
    assert lines[3] == "ok    core: the packaged core loads and speaks ABI 2"
    assert lines[4] == (
        f"skip  integrity: a daemon holds {process_daemon.state} (pid {process_daemon.proc.pid}, "
        f"socket {process_daemon.socket}) and keeps its database open exclusively; stop the daemon, then run devd "
        "doctor again to check the database"
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
        0,
        stopped(d),  # a killed daemon leaves its socket behind, and no lock held
        f"ok    integrity: {d.state / 'devd.sqlite3'} passes PRAGMA quick_check (format {len(MIGRATIONS)})",
    )
    assert "devd.sqlite3-wal" in before
    assert files(d.state) == before


def test_doctor_during_a_restore_passes_saying_the_daemon_is_stopped(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.new(session="s")
        c.backup("backup.sqlite3")
    assert d.stop() == 0
    for name in ("devd.sqlite3", "devd.sqlite3.id"):  # as docs/operations.md says: aside, and the backup in place
        (d.state / name).rename(tmp_path / name)
    (d.state / "backups" / "backup.sqlite3").rename(d.state / "devd.sqlite3")
    run = doctor(d)
    assert (run.returncode, run.stdout.splitlines()[0]) == (0, stopped(d))


def test_doctor_on_a_stopped_daemons_database_makes_no_write_ahead_log(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.new(session="s")
    assert d.stop() == 0  # a clean stop: the database is in WAL mode, with no log beside it
    before = files(d.state)
    doctor(d)
    assert files(d.state) == before


def test_doctor_fails_a_database_whose_snapshot_file_is_missing_and_names_it(tmp_path: Path) -> None:
    d = InProcess(tmp_path, "--snapshot-floor", "0").start()
    with d.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "x" * (300 << 10)))  # a snapshot of over 256 KiB: kept in a file
    d.stop()
    (snapshot,) = (d.state / "snapshots").iterdir()
    whole = doctor(d).stdout.splitlines()[4]
    snapshot.unlink()
    broken = doctor(d).stdout.splitlines()[4]
    assert (whole, broken) == (
        f"ok    integrity: {d.state / 'devd.sqlite3'} passes PRAGMA quick_check (format {len(MIGRATIONS)}); every "
        f"snapshot file it names (1) is in {d.state / 'snapshots'}",
        f"FAIL  integrity: 1 of the 1 snapshot files devd.sqlite3 names are missing from {d.state / 'snapshots'} "
        f"(such as {snapshot.name}); the sessions that need them cannot be rebuilt: put them back, or restore the "
        "state directory from a backup",
    )


def test_doctor_finds_a_database_that_is_not_one(tmp_path: Path) -> None:
    d = InProcess(tmp_path)
    d.state.mkdir(mode=0o700, parents=True)
    (d.state / "devd.sqlite3").write_bytes(b"this is not a database" * 100)
    run = doctor(d)
    assert (run.returncode, run.stdout.splitlines()[4]) == (
        1,
        f"FAIL  integrity: {d.state / 'devd.sqlite3'} cannot be read: file is not a database; keep it as it is "
        "(copy it aside) and restore a backup",
    )


def test_doctor_fails_a_database_others_can_write_as_the_daemon_refuses_it(tmp_path: Path) -> None:
    d = InProcess(tmp_path)
    d.start().stop()
    (d.state / "devd.sqlite3").chmod(0o666)
    run = doctor(d)
    assert run.stdout.splitlines()[2] == (
        f"FAIL  database: {d.state / 'devd.sqlite3'} is writable by group or others (mode 0666), so the daemon "
        f"refuses it; run `chmod go-w {d.state / 'devd.sqlite3'}`"
    )


def test_doctor_fails_a_state_dir_others_can_read_and_says_to_chmod_it(tmp_path: Path) -> None:
    d = InProcess(tmp_path)
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
    d = InProcess(tmp_path)
    d.state.mkdir(mode=0o700, parents=True)
    os.chown(d.state, 4242, 4242)
    run = doctor(d)
    assert run.stdout.splitlines()[1] == f"ok    state dir: {d.state} is 0700 and uid 4242's"


# -- logs ------------------------------------------------------------------------------------------------------------


def events_after_ready(d: Daemon) -> list[dict[str, object]]:
    logged = log_events(d.log)
    start = next(i for i, e in enumerate(logged) if e["event"] == "daemon.ready")
    return [{k: v for k, v in e.items() if k != "timestamp"} for e in logged[start + 1 :]]


def test_a_sessions_lifecycle_is_logged_at_info_and_its_steps_are_not(process_daemon: Daemon) -> None:
    daemon = process_daemon
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
    sources = list((ROOT / "devd").rglob("*.py"))
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


def test_the_variables_the_operations_doc_sets_are_ones_devd_serve_reads() -> None:
    set_in_doc = set(re.findall(r"Environment=(DEVD_[A-Z_]+)=", DOC.read_text()))
    read = {cli.flag_variable(a) for a in subcommands()["serve"]._actions if a.option_strings and a.dest != "help"}
    assert (sorted(set_in_doc - read), len(set_in_doc) >= 2) == ([], True)


def test_the_operations_doc_names_every_metric_there_is() -> None:
    text = DOC.read_text()
    section = text[text.index("\n## Metrics\n") : text.index("\n## The `devd` command")]
    documented = set(re.findall(r"^\| `([a-z_]+)[{`]", section, re.MULTILINE))
    exposed = {line.split()[2] for line in prometheus(STATUS).splitlines() if line.startswith("# TYPE ")}
    assert (sorted(exposed - documented), sorted(documented - exposed)) == ([], [])


def test_doctor_checks_the_database_the_store_flag_names(tmp_path: Path) -> None:
    db = tmp_path / "elsewhere" / "sessions.sqlite3"
    run = devd(
        "doctor", "--connect", str(tmp_path / "none.sock"), "--state-dir", str(tmp_path), "--store", f"sqlite:{db}"
    )
    assert run.stdout.splitlines()[2] == (
        f"FAIL  database: {db} does not exist; `devd serve` makes it on first start (if this state directory held "
        "sessions, they are gone: restore a backup into it)"
    )
