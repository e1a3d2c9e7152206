"""Security and denial-of-service fixes, each with the attack that found it, against the real daemon."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from devd import errors
from devd.client import Client
from devd.server.listeners import TOKEN_CHARS_MIN
from tests.daemon import Daemon, free_port, log_events
from tests.harness import InProcess
from tests.helpers import Wire, until

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="making files of another uid needs root (CI runs as root)")
NOBODY = 65534


def serve(tmp_path: Path, *args: str, state: Path | None = None, sock: Path | None = None) -> tuple[int, str]:
    """`devd serve` that is expected to refuse to start: its exit status and what it said."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "devd",
            "serve",
            "--socket",
            str(sock or tmp_path / "run" / "devd.sock"),
            "--state-dir",
            str(state or tmp_path / "state"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return run.returncode, run.stderr


# -- the token ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["", "short", "x" * (TOKEN_CHARS_MIN - 1), "a" * 20 + " " + "b" * 20])
def test_a_token_file_without_a_usable_token_refuses_to_start(tmp_path: Path, token: str) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "token").write_text(token)
    (state / "token").chmod(0o600)
    status, said = serve(tmp_path, "--listen", f"tcp://127.0.0.1:{free_port()}")
    assert (status, "holds no usable token" in said) == (2, True)


def test_a_new_token_is_written_whole_and_private(tmp_path: Path) -> None:
    port = free_port()
    with InProcess(tmp_path, "--listen", f"tcp://127.0.0.1:{port}") as d:
        token = d.state / "token"
        assert (oct(token.stat().st_mode & 0o777), len(token.read_text().strip()) >= TOKEN_CHARS_MIN) == (
            "0o600",
            True,
        )
        assert sorted(p.name for p in d.state.iterdir() if p.name.startswith(".token")) == []


@needs_root
def test_a_token_file_of_another_user_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "token").write_text("t" * 43)
    (state / "token").chmod(0o600)
    os.chown(state / "token", NOBODY, NOBODY)
    status, said = serve(tmp_path, "--listen", f"tcp://127.0.0.1:{free_port()}")
    assert (status, "not this user's" in said) == (2, True)


# -- directories of other users ------------------------------------------------------------------------------------


@needs_root
def test_a_state_directory_of_another_user_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    status, said = serve(tmp_path, state=state)
    assert (status, f"belongs to uid {NOBODY}" in said) == (2, True)


@needs_root
def test_a_store_database_in_a_directory_of_another_user_refuses_to_start(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    status, said = serve(tmp_path, "--store", f"sqlite:{theirs / 'devd.sqlite3'}")
    assert (status, f"the directory of the database {theirs} belongs to uid {NOBODY}" in said) == (2, True)


def test_a_store_database_in_a_directory_anyone_may_write_refuses_to_start_saying_how_to_fix(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    status, said = serve(tmp_path, "--store", f"sqlite:{shared / 'devd.sqlite3'}")
    assert (status, said.strip()) == (
        2,
        f"devd: cannot start: the directory of the database {shared} is writable by group or others (mode 0777); "
        f"run `chmod go-w {shared}` (0700 is best) and start again",
    )


def test_a_store_database_anyone_may_write_refuses_to_start_saying_how_to_fix(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    db = mine / "devd.sqlite3"
    with InProcess(tmp_path / "d", "--store", f"sqlite:{db}"):
        pass
    db.chmod(0o666)
    status, said = serve(tmp_path, "--store", f"sqlite:{db}")
    assert (status, said.strip()) == (
        2,
        f"devd: cannot start: the database file {db} is writable by group or others (mode 0666): anyone could "
        f"change the sessions in it; run `chmod 600 {db}` and start again",
    )


@needs_root
def test_a_socket_directory_of_another_user_refuses_to_start(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chown(run, NOBODY, NOBODY)
    status, said = serve(tmp_path)
    assert (status, f"the socket directory {run} belongs to uid {NOBODY}" in said) == (2, True)


def test_a_socket_path_that_is_a_regular_file_is_kept_and_refused(tmp_path: Path) -> None:
    precious = tmp_path / "run" / "devd.sock"
    precious.parent.mkdir(mode=0o700)
    precious.write_text("my notes")
    status, said = serve(tmp_path)
    assert (status, "is not a socket" in said, precious.read_text()) == (2, True, "my notes")


def test_a_socket_replaced_while_running_is_left_alone_at_shutdown(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d:
        d.socket.unlink()
        d.socket.write_text("someone else's")
        assert d.stop() == 0
    assert d.socket.read_text() == "someone else's"


@needs_root
def test_the_client_refuses_a_socket_served_by_another_user(tmp_path: Path) -> None:
    """A planted daemon: another uid listens where ours should; the client sends it nothing."""
    root = Path(tempfile.mkdtemp(prefix="devd-planted-"))
    root.chmod(0o755)
    sock = root / "devd.sock"
    listener = (
        "import socket,sys,time\n"
        "s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); print('up', flush=True)\n"
        "c,_=s.accept(); c.settimeout(3)\n"
        "try:\n"
        "    print(len(c.recv(100)), flush=True)\n"
        "except OSError:\n"
        "    print(0, flush=True)\n"
    )
    os.chown(root, NOBODY, NOBODY)
    planted = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            listener,
            str(sock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert planted.stdout is not None and planted.stdout.readline() == "up\n"
        with pytest.raises(PermissionError, match=f"served by uid {NOBODY}"):
            Client.connect(sock)
        assert planted.stdout.readline() == "0\n"  # it received nothing
    finally:
        planted.kill()
        planted.wait()
        assert planted.stdout is not None
        planted.stdout.close()
        shutil.rmtree(root)


# -- one daemon per state directory --------------------------------------------------------------------------------


def test_a_second_daemon_on_the_same_state_directory_refuses_to_start(tmp_path: Path) -> None:
    with Daemon(tmp_path) as d:
        status, said = serve(tmp_path / "other", state=d.state)
        assert (status, f"another daemon holds the state directory {d.state} (pid {d.proc.pid}" in said) == (2, True)


def test_the_state_directory_is_free_again_after_sigkill(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.new(session="kept")
    d.kill()
    d.start()
    with d.client() as c:
        assert [s["session"] for s in c.call("session/list")["sessions"]] == ["kept"]
    d.kill()


# -- failure points -------------------------------------------------------------------------------------------------


def test_failure_points_are_obeyed_only_in_a_test_and_the_log_says_they_were_ignored(tmp_path: Path) -> None:
    production = {"DEVD_TESTING": "0", "DEVD_FAILPOINTS": "commit.after=kill@1"}
    with Daemon(tmp_path, env=production) as d, d.client() as c:
        c.new(session="s")  # its commit would have killed the daemon
        events = log_events(d.log)
    assert [(e["event"], e["level"]) for e in events if str(e["event"]).startswith("failpoints.")] == [
        ("failpoints.ignored", "warning")
    ]


def test_armed_failure_points_are_said_at_warning_when_the_daemon_starts(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@1000"}) as d:
        armed = [e for e in log_events(d.log) if e["event"] == "failpoints.armed"]
    assert [(e["level"], e["points"]) for e in armed] == [("warning", "commit.before=eio@1000")]


@pytest.mark.parametrize("spec", ["commit.after=boom", "commit.after=kill@x", "=eio"])
def test_a_malformed_failure_point_is_a_clear_error_not_a_traceback(tmp_path: Path, spec: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "devd", "serve", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DEVD_TESTING": "1", "DEVD_FAILPOINTS": spec},
    )
    assert (run.returncode, run.stderr.startswith(f"devd: cannot start: DEVD_FAILPOINTS holds {spec!r}")) == (2, True)


# -- TCP exposure ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "0", "0.0", "[::0]", "[::]"])
def test_listening_on_every_address_warns_that_the_token_crosses_in_clear(tmp_path: Path, host: str) -> None:
    with Daemon(tmp_path, "--listen", f"tcp://{host}:{free_port()}") as d:
        events = [msgspec.json.decode(line) for line in d.log.read_bytes().splitlines() if line.startswith(b"{")]
        assert [e["event"] for e in events if e["level"] == "warning"] == ["tcp.exposed"]


@pytest.fixture
def tcp(tmp_path: Path) -> Iterator[tuple[InProcess, int]]:
    port = free_port()
    with InProcess(tmp_path, "--listen", f"tcp://127.0.0.1:{port}") as d:
        yield d, port


AUTH_TIMEOUT_S = 0.5  # the authentication deadline of the dribbling test's daemon (5 s in production)


def test_an_unauthenticated_peer_that_dribbles_bytes_is_closed_at_the_auth_deadline(tmp_path: Path) -> None:
    port = free_port()
    listen = ("--listen", f"tcp://127.0.0.1:{port}")
    with InProcess(tmp_path, *listen, settings={"auth_timeout_s": AUTH_TIMEOUT_S}):
        with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
            closed = False
            for _ in range(80):  # a byte every AUTH/5, never a whole line, for 8 deadlines: each read alone in time
                try:
                    s.sendall(b"{")
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                time.sleep(AUTH_TIMEOUT_S / 5)
    assert closed


def test_tcp_peers_without_a_token_cannot_lock_out_the_unix_socket(tcp: tuple[InProcess, int]) -> None:
    d, port = tcp
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(70)]
    try:
        with d.client() as c:
            assert c.call("session/list") == {"sessions": []}
    finally:
        for s in idle:
            s.close()


def test_a_client_deadline_is_cut_to_the_daemons_maximum(tmp_path: Path) -> None:
    from tests import modules

    core = tmp_path / "spin.wasm"
    core.write_bytes(modules.SPIN_ON_TIMER)
    with InProcess(tmp_path, "--core", str(core), "--max-call-timeout", "0.5") as d, d.client() as c:
        c.new(session="s")
        started = time.monotonic()
        with pytest.raises(errors.DeadlineError):
            c.call("session/step", {"session": "s", "event": {"Timer": True}, "timeout_ms": 3_600_000})
        assert time.monotonic() - started < 3


GRACE_S = 0.5  # the shutdown grace of the daemon below (10 s in production)


def test_sigterm_ends_a_call_that_outlives_the_grace_as_deadline(tmp_path: Path) -> None:
    from tests import modules

    core = tmp_path / "spin.wasm"
    core.write_bytes(modules.SPIN_ON_TIMER)
    d = InProcess(tmp_path, "--core", str(core), "--max-call-timeout", "600", settings={"shutdown_grace_s": GRACE_S})
    with d:
        w = Wire(d.socket)
        w.call("session/new", {"session": "s"})
        w.send(
            b'{"jsonrpc":"2.0","id":9,"method":"session/step","params":'
            b'{"session":"s","event":{"Timer":true},"timeout_ms":600000}}\n'
        )
        time.sleep(0.2)
        started = time.monotonic()
        d.signal(15)
        reply = w.reply()
        assert (reply.error or {}).get("data") == {"kind": "DEADLINE"}
        assert d.wait(30) == 0 and time.monotonic() - started < 20
        w.close()
        d.start()
        with d.client() as again:
            assert [(s["session"], s["state"]) for s in again.call("session/list")["sessions"]] == [("s", "ended")]


# -- data loss -------------------------------------------------------------------------------------------------------


def test_a_database_deleted_while_running_stops_acknowledging(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(session="s")
        (d.state / "devd.sqlite3").unlink()
        with pytest.raises(errors.InternalError, match="deleted or replaced while the daemon ran"):
            c.new(session="t")
        with pytest.raises(errors.InternalError, match="no more writes until it has reopened the database"):
            c.new(session="u")  # and a deleted file is never made again by the reopen


def test_a_stray_write_ahead_log_from_another_state_directory_is_refused(tmp_path: Path) -> None:
    mine, theirs = Daemon(tmp_path / "mine").start(), Daemon(tmp_path / "theirs").start()
    with mine.client() as c:
        c.new(session="mine")
    with theirs.client() as c:
        c.new(session="theirs")
    mine.stop()
    theirs.kill()  # its log is left un-checkpointed
    shutil.copy(theirs.state / "devd.sqlite3-wal", mine.state / "devd.sqlite3-wal")
    status, said = serve(tmp_path / "mine", state=mine.state)
    assert (status, "belongs to another database" in said) == (2, True)
    (mine.state / "devd.sqlite3-wal").unlink()
    with mine.start() as d, d.client() as c:
        assert [s["session"] for s in c.call("session/list")["sessions"]] == ["mine"]


def test_a_second_daemon_on_a_running_daemons_store_is_told_it_is_in_use_not_that_its_log_is_foreign(
    tmp_path: Path,
) -> None:
    db = tmp_path / "shared" / "devd.sqlite3"
    db.parent.mkdir(mode=0o700)
    with InProcess(tmp_path / "first", "--store", f"sqlite:{db}") as first, first.client() as c:
        c.new(session="s")  # its write-ahead log is there, beside the database it holds
        started = time.monotonic()
        status, said = serve(tmp_path / "second", "--store", f"sqlite:{db}")
        waited = time.monotonic() - started
    # Told at once, not after a lock wait (it was sqlite3's 5 s default): the first daemon holds the file for its life.
    told = (status, "belongs to another database" in said, "another process has it open" in said, waited < 4)
    assert told == (2, False, True, True)


def test_a_log_that_cannot_be_read_is_reported_as_it_is_and_never_called_foreign(tmp_path: Path) -> None:
    """After a crash on a full disk the check cannot read the database with its log: that is said, and the log is
    not called another database's (moving it away, as that advice says, would lose every step in it)."""
    d = Daemon(tmp_path)
    with d, d.client() as c:
        c.new(session="s")
        d.kill()  # the log is left un-checkpointed
    (d.state / "devd.sqlite3").write_bytes(b"not a database, as a torn write would leave it")
    with open(d.state / "devd.sqlite3-wal", "r+b") as wal:
        wal.write(b"\0" * 32)  # nor a log header SQLite takes: the check reads a file that is no database
    status, said = serve(tmp_path, state=d.state)
    assert (status, "belongs to another database" in said, "could not be read to check" in said) == (2, False, True)


def test_a_damaged_database_refuses_to_start_with_what_to_do(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "devd.sqlite3").write_bytes(b"this is not a database" * 100)
    status, said = serve(tmp_path)
    assert (status, said.startswith("devd: cannot start: the database"), "left as it is" in said) == (2, True, True)


def test_after_a_failed_fsync_the_store_reopens_itself_and_acknowledges_again(tmp_path: Path) -> None:
    d = Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@3"}).start()
    with d.client() as c:
        c.new(session="a")  # commit 1
        c.new(session="b")  # commit 2
        with pytest.raises(errors.InternalError, match=r"may or may not be on disk \(\[Errno 5\] Input/output error"):
            c.new(session="c")  # commit 3 fails like a failed fsync: nothing of it is acknowledged
        c.new(session="d")  # the store reopened itself: acknowledged again, without a restart
    d.env = {}
    d.stop()
    with d.start(), d.client() as c:
        assert [s["session"] for s in c.call("session/list")["sessions"]] == ["a", "b", "d"]


# -- watchers -------------------------------------------------------------------------------------------------------


def _read_for(sock: socket.socket, seconds: float) -> list[dict]:
    """Every JSON line sock receives within `seconds`."""
    sock.settimeout(0.2)
    data, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            continue
        if not chunk:
            break
        data += chunk
    return [msgspec.json.decode(line) for line in data.splitlines()]


def test_a_step_notice_larger_than_the_outbox_bound_still_reaches_a_watcher(tmp_path: Path) -> None:
    from devd.messages import turn

    with InProcess(tmp_path) as d, d.client() as stepper, d.client() as watcher:
        stepper.new(session="big")
        watcher.call("session/watch", {"session": "big"})
        stepper.step("big", turn(1, "x" * (1 << 20)))
        notice = watcher.wait_notification()
        assert (notice.method, notice.params["seq"]) == ("session/actions", 1)


def test_catching_up_past_the_outbox_bound_ends_with_exactly_one_unwatched(tmp_path: Path) -> None:
    from devd.messages import turn

    with InProcess(tmp_path) as d, d.client() as stepper:
        stepper.new(session="long")
        for t in range(1, 13):  # 12 steps of about 300 KB each: a backlog far past the 1 MiB bound
            stepper.step("long", turn(t, str(t) * 300_000))
        with socket.socket(socket.AF_UNIX) as watcher:
            watcher.connect(str(d.socket))
            watcher.sendall(
                b'{"jsonrpc":"2.0","id":1,"method":"session/watch","params":{"session":"long","since":0}}\n'
            )
            time.sleep(1.0)  # not reading while the daemon catches up
            for t in range(13, 16):
                stepper.step("long", turn(t, "later"))
            lines = _read_for(watcher, 3.0)
    notices = [(m["method"], m["params"]["seq"]) for m in lines if "method" in m]
    delivered = [seq for method, seq in notices if method == "session/actions"]
    assert delivered == list(range(1, len(delivered) + 1)) and len(delivered) < 12
    assert notices[len(delivered) :] == [("session/unwatched", len(delivered))]


def test_an_internal_error_is_logged_without_the_request_payload(tmp_path: Path) -> None:
    from devd.messages import turn

    secret = "hunter2-the-prompt-nobody-should-read"
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=enospc@2"}) as d, d.client() as c:
        c.new(session="s")
        with pytest.raises(errors.InternalError):
            c.step("s", turn(1, secret))
        logged = d.log.read_text()
    assert ("request.failed" in logged, secret in logged) == (True, False)


def test_a_since_past_what_a_step_number_holds_is_invalid_params(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(session="s")
        with pytest.raises(errors.InvalidParamsError, match="since must be a step number"):
            c.call("session/watch", {"session": "s", "since": 1 << 63})
        with pytest.raises(errors.InvalidParamsError, match="has answered 0 steps; watch since 0 or earlier"):
            c.call("session/watch", {"session": "s", "since": (1 << 63) - 1})


def test_the_database_keeps_no_shared_memory_file_whose_fault_would_kill_the_daemon(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(session="s")
        assert sorted(p.name for p in d.state.iterdir() if p.name.startswith("devd.sqlite3")) == [
            "devd.sqlite3",
            "devd.sqlite3-wal",
            "devd.sqlite3.id",
        ]


def test_two_watches_of_one_session_pipelined_on_one_connection_leave_one_subscription(tmp_path: Path) -> None:
    from devd.messages import turn

    with InProcess(tmp_path) as d, d.client() as stepper:
        stepper.new(session="w")
        for t in range(1, 4):
            stepper.step("w", turn(t, "x"))
        with socket.socket(socket.AF_UNIX) as watcher:
            watcher.connect(str(d.socket))
            watch = b'{"jsonrpc":"2.0","id":%d,"method":"session/watch","params":{"session":"w","since":0}}\n'
            watcher.sendall(watch % 1 + watch % 2)
            time.sleep(0.3)
            stepper.step("w", turn(4, "live"))
            lines = _read_for(watcher, 1.0)
            live = [
                m["params"]["seq"] for m in lines if m.get("method") == "session/actions" and m["params"]["seq"] == 4
            ]
            watching = stepper.call("session/list")["sessions"][0]["watchers"]
        time.sleep(0.3)
        assert (live, watching, stepper.call("session/list")["sessions"][0].get("watchers", 0)) == ([4], 1, 0)


def _watch_and_never_read(d: Daemon, stepper: Client) -> socket.socket:
    """A connection that watches a session with large steps and then reads nothing."""
    from devd.messages import turn

    lazy = socket.socket(socket.AF_UNIX)
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lazy.connect(str(d.socket))
    lazy.sendall(b'{"jsonrpc":"2.0","id":1,"method":"session/watch","params":{"session":"w"}}\n')
    time.sleep(0.2)
    for t in range(1, 9):
        stepper.step("w", turn(t, "x" * 300_000))
    return lazy


def test_a_watcher_that_never_reads_is_disconnected_after_the_send_timeout(tmp_path: Path) -> None:
    with InProcess(tmp_path, "--send-timeout", "0.5") as d, d.client() as stepper:
        stepper.new(session="w")
        lazy = _watch_and_never_read(d, stepper)
        try:
            # The stepper alone, once the lazy one is cut off: well within 2.5 s of its last step.
            until(lambda: stepper.call("daemon/status")["connections"] == 1, timeout_s=2.5)
        finally:
            lazy.close()


def test_a_watcher_that_never_reads_does_not_hold_up_a_graceful_stop(tmp_path: Path) -> None:
    with Daemon(tmp_path) as d:
        with d.client() as stepper:
            stepper.new(session="w")
            lazy = _watch_and_never_read(d, stepper)
        try:
            started = time.monotonic()
            status = d.stop()
            took = time.monotonic() - started
        finally:
            lazy.close()
        logged = d.log.read_text()
    assert (status, took < 4, "daemon.interrupting" in logged) == (0, True, False)
