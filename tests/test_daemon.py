"""The daemon end to end: a real `devd serve` subprocess, real sockets, a real SQLite file."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from devd import errors
from devd.client import Client
from devd.messages import (
    Action,
    Call,
    Cancel,
    Event,
    Exec,
    Op,
    Output,
    Read,
    answer,
    ask,
    decode_actions,
    done,
    encode,
    turn,
)
from tests import modules
from tests.daemon import Daemon, free_port
from tests.harness import InProcess
from tests.helpers import FIX, Wire, agent, finish, tool, user

TIMER = Event(Timer=True)


# -- the seed's loop through the socket -----------------------------------------------------------------------------


def test_a_turn_runs_to_done_through_the_socket(client: Client) -> None:
    s = client.new()
    build, lib = Call(Exec=Exec(argv=["cargo", "build"])), Call(Read=Read(path="src/lib.rs"))
    assert client.step(s, turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]
    assert client.step(s, answer(1, "Let me look.", [build, lib])) == [
        Action(id=2, op=Op(Exec=build.Exec)),
        Action(id=3, op=Op(Read=lib.Read)),
    ]
    assert client.step(s, Event(Exec=Output(id=2, text="failed", failed=True))) == []
    from devd.messages import Dispatch

    assert client.step(s, Event(File=Output(id=3, text="fn f() {}"))) == [
        Action(
            id=4,
            op=ask(
                user(FIX),
                agent("Let me look.", [Dispatch(id=2, call=build), Dispatch(id=3, call=lib)]),
                tool(2, "failed", failed=True),
                tool(3, "fn f() {}"),
            ),
        )
    ]
    assert client.step(s, answer(4, "done")) == finish(5, 1, "done")


def test_the_actions_cross_as_the_core_wrote_them(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="raw")
    with Wire(daemon.socket) as w:
        w.send(
            b'{"jsonrpc":"2.0","id":7,"method":"session/step",'
            b'"params":{"session":"raw","event":{"Turn":{"id":1,"prompt":"hi"}}}}\n'
        )
        line = w.line()
    assert line == (
        b'{"jsonrpc":"2.0","id":7,"result":{"actions":[{"id":1,"op":{"Model":{"messages":[{"User":"hi"}]}}}]}}\n'
    )


def test_a_malformed_event_is_refused_and_changes_nothing(client: Client) -> None:
    s = client.new()
    with pytest.raises(errors.MalformedError):
        client.step(s, b'{"Turn":{"id":1}}')
    assert client.step(s, turn(1, FIX)) == [Action(id=1, op=ask(user(FIX)))]


# -- durability -----------------------------------------------------------------------------------------------------


def test_sessions_survive_a_restart(tmp_path: Path) -> None:
    d = InProcess(tmp_path).start()
    with d.client() as c:
        c.new(session="keep")
        c.step("keep", turn(1, FIX))
        c.step("keep", turn(2, "queued"))
    assert d.stop() == 0
    assert not d.socket.exists()
    with d.start(), d.client() as c:
        (kept,) = c.call("session/list")["sessions"]
        assert {k: kept[k] for k in ("session", "state", "seq")} == {"session": "keep", "state": "stored", "seq": 2}
        assert c.step("keep", answer(1, "ok")) == [
            *finish(3, 1, "ok"),
            Action(id=6, op=ask(user(FIX), agent("ok"), user("queued"))),
        ]


def test_sessions_survive_sigkill(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.new(session="crash")
        c.step("crash", turn(1, FIX))
        c.step("crash", answer(1, "ok"))  # Save: a snapshot replaces the journal
        c.step("crash", turn(2, "again"))
    d.kill()
    with d.start(), d.client() as c:
        assert c.step("crash", turn(2, "again")) == []
        assert c.step("crash", answer(5, "fine")) == finish(6, 2, "fine")


def test_a_keyed_step_is_answered_once_across_restarts(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    with d.client() as c:
        c.new(session="k")
        first = c.step_result("k", turn(1, FIX), key="turn-1")
    d.kill()
    with d.start(), d.client() as c:
        again = c.step_result("k", turn(1, FIX), key="turn-1")
        assert again == {**first, "replayed": True}
        with pytest.raises(errors.ConflictError):
            c.step("k", turn(9, "another"), key="turn-1")
        assert c.step("k", answer(1, "ok"), key="answer-1") == finish(2, 1, "ok")


def test_keys_outlive_snapshots(client: Client) -> None:
    client.new(session="k")
    first = client.step_result("k", turn(1, FIX), key="first")
    for t in range(2, 302):  # each queued turn and its cancel ask Save: 600 snapshots replace the journal
        client.step("k", turn(t, "queued"), key=f"turn-{t}")
        client.step("k", Event(Cancel=Cancel(turn=t)), key=f"cancel-{t}")
    assert client.step_result("k", turn(1, FIX), key="first") == {**first, "replayed": True}


def test_a_journal_that_replays_otherwise_is_reported_not_accepted(tmp_path: Path) -> None:
    d = InProcess(tmp_path).start()
    with d.client() as c:
        c.new(session="j")
        c.step("j", turn(1, FIX))
    d.stop()
    with contextlib.closing(sqlite3.connect(d.state / "devd.sqlite3")) as db, db:
        db.execute("UPDATE journal SET actions = ? WHERE session = 'j' AND seq = 1", (b"[]",))
    with d.start(), d.client() as c:
        with pytest.raises(errors.PoisonError, match="replaying step 1"):
            c.step("j", answer(1, "ok"))
        assert [(s["state"], "replaying step 1" in s["reason"]) for s in c.call("session/list")["sessions"]] == [
            ("poisoned", True)
        ]


def test_a_closed_session_is_gone_after_a_restart(tmp_path: Path) -> None:
    d = InProcess(tmp_path).start()
    with d.client() as c:
        c.new(session="bye")
        assert c.call("session/close", {"session": "bye"}) == {}
        with pytest.raises(errors.HandleError):
            c.step("bye", TIMER)
    d.stop()
    with d.start(), d.client() as c:
        assert c.call("session/list") == {"sessions": []}


def test_a_snapshot_restores_under_a_new_name(client: Client) -> None:
    client.new(session="orig")
    client.step("orig", turn(1, FIX))
    snap = client.call("session/snapshot", {"session": "orig"})["snapshot"]
    assert client.call("session/restore", {"snapshot": snap, "session": "copy"}) == {"session": "copy"}
    assert client.step("copy", answer(1, "ok")) == finish(2, 1, "ok")
    with pytest.raises(errors.MalformedError):
        client.call("session/restore", {"snapshot": snap[:-4] + "AAAA"})


def test_a_socket_in_a_directory_anyone_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    state = tmp_path / "state"
    run = subprocess.run(
        [sys.executable, "-m", "devd", "serve", "--socket", str(shared / "s.sock"), "--state-dir", str(state)],
        capture_output=True,
        timeout=30,
    )
    assert (run.returncode, b"writable by anyone" in run.stderr) == (2, True)


def test_a_state_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    state.chmod(0o777)
    run = subprocess.run(
        [sys.executable, "-m", "devd", "serve", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(state)],
        capture_output=True,
        timeout=30,
    )
    assert (run.returncode, b"writable by group or others" in run.stderr) == (2, True)


# -- one call at a time, deadlines, recovery -------------------------------------------------------------------------


@pytest.fixture
def spinning(tmp_path: Path) -> Iterator[Daemon]:
    core = tmp_path / "spin.wasm"
    core.write_bytes(modules.SPIN_ON_TIMER)
    with Daemon(tmp_path / "d", "--core", str(core), "--call-timeout", "1") as d:
        yield d


# A slow call that held up the event loop would hold every other client for its whole second or more; a bound well
# under that, and well over what two busy cores can add to one round trip (tens of ms seen under load), tells the two
# apart without failing on scheduler noise.
HELD_UP_S = 0.25


def worst_round_trip_while(slow: Callable[[], object], probe: Callable[[], object]) -> tuple[list[type], float]:
    """Run slow() in a thread; meanwhile run probe() again and again. What slow raised, and probe's worst time."""
    raised: list[type] = []

    def run() -> None:
        try:
            slow()
        except BaseException as e:
            raised.append(type(e))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.2)
    worst = 0.0
    while t.is_alive():
        started = time.perf_counter()
        probe()
        worst = max(worst, time.perf_counter() - started)
    t.join()
    return raised, worst


def test_a_spinning_session_ends_at_its_deadline_and_holds_up_no_one(spinning: Daemon) -> None:
    with spinning.client() as a, spinning.client() as b:
        a.new(session="spin")
        b.new(session="calm")
        raised, worst = worst_round_trip_while(
            lambda: a.step("spin", TIMER, timeout_ms=1500), lambda: b.step("calm", turn(1, "x"))
        )
        assert (raised, worst < HELD_UP_S) == ([errors.DeadlineError], True)


def test_a_step_on_a_busy_session_answers_busy(spinning: Daemon) -> None:
    with spinning.client() as a, spinning.client() as b:
        a.new(session="spin")
        t = threading.Thread(target=lambda: pytest.raises(errors.DeadlineError, a.step, "spin", TIMER, timeout_ms=800))
        t.start()
        time.sleep(0.2)
        with pytest.raises(errors.BusyError):
            b.step("spin", turn(1, "x"))
        t.join()


def test_an_ended_session_answers_handle_until_recovered(spinning: Daemon) -> None:
    with spinning.client() as c:
        c.new(session="spin")
        c.step("spin", turn(1, "x"))
        with pytest.raises(errors.DeadlineError):
            c.step("spin", TIMER, timeout_ms=100)
        with pytest.raises(errors.HandleError):
            c.step("spin", turn(2, "x"))
        assert [(s["session"], s["state"]) for s in c.call("session/list")["sessions"]] == [("spin", "ended")]
        assert c.call("session/recover", {"session": "spin"}) == {"session": "spin"}
        assert c.step("spin", turn(2, "x")) == []
        status = c.call("daemon/status")
        # Offloaded: the spin, and the step after it (its session's last call passed the budget: a worker at once);
        # on a loaded machine a quick call can miss its 2 ms inline budget and be offloaded too (CI saw 3).
        assert (status["deadline_hits"], status["offloaded"] >= 2) == (1, True)


def test_a_spinning_session_start_holds_up_no_one(tmp_path: Path) -> None:
    core = tmp_path / "spin-new.wasm"
    core.write_bytes(modules.SPIN_NEW)
    with Daemon(tmp_path / "d", "--core", str(core), "--call-timeout", "1") as d, d.client() as a, d.client() as b:
        raised, worst = worst_round_trip_while(a.new, lambda: b.call("daemon/status"))
        assert (raised, worst < HELD_UP_S) == ([errors.DeadlineError], True)


def send_spinning_step(w: Wire, id: int, timeout_ms: int) -> None:
    """A step that spins until its deadline, sent without waiting for its answer."""
    w.call("session/new", {"session": "spin"}, id=id - 1)
    params = {"session": "spin", "event": {"Timer": True}, "timeout_ms": timeout_ms}
    w.send(msgspec.json.encode({"jsonrpc": "2.0", "id": id, "method": "session/step", "params": params}) + b"\n")


def test_a_step_in_flight_at_sigterm_is_answered(spinning: Daemon) -> None:
    with Wire(spinning.socket) as w:
        send_spinning_step(w, 9, 600)
        time.sleep(0.2)
        spinning.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        reply = w.reply()
        assert (reply.id, reply.error["data"]["kind"], spinning.proc.wait(20)) == (9, "DEADLINE", 0)  # type: ignore[index,union-attr]


def test_a_client_that_leaves_mid_step_leaves_its_session_consistent(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="left")
        for t in range(1, 6):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(daemon.socket))
            s.sendall(
                b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":"left","event":'
                + encode(turn(t, "x"))
                + b"}}\n"
            )
            s.close()
            # Each step runs to its end without its client. The next is sent once it has (one sent while it still
            # runs is answered BUSY, to a client that has left: under load a fixed 50 ms pause lost two of five).
            deadline = time.monotonic() + 20
            while (seq := c.call("session/list")["sessions"][0]["seq"]) < t and time.monotonic() < deadline:
                time.sleep(0.01)
        assert (seq, c.step("left", Event(Cancel=Cancel(turn=5)))) == (
            5,
            [Action(id=6, op=Op(Save=True)), Action(id=7, op=done(5, cancelled=True))],
        )


# -- watchers -------------------------------------------------------------------------------------------------------


def test_a_watcher_sees_every_step_whoever_makes_it(daemon: InProcess) -> None:
    with daemon.client() as stepper, daemon.client() as watcher:
        stepper.new(session="w")
        assert watcher.call("session/watch", {"session": "w"}) == {}
        actions = stepper.step_result("w", turn(1, FIX))["actions"]
        notice = watcher.wait_notification()
        at = notice.params.pop("at")  # when it was answered: tests/test_client.py checks its form
        assert (notice.method, notice.params, type(at)) == (
            "session/actions",
            {"session": "w", "seq": 1, "event": msgspec.json.decode(encode(turn(1, FIX))), "actions": actions},
            str,
        )


def test_a_watcher_that_reconnects_misses_nothing(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="w")
        c.step("w", turn(1, FIX))
        c.step("w", answer(1, "ok"))
        c.step("w", turn(2, "more"))
    with daemon.client() as watcher:
        watcher.call("session/watch", {"session": "w", "since": 1})
        seqs = [watcher.wait_notification().params["seq"] for _ in range(2)]
        assert seqs == [2, 3]


def test_a_watcher_that_stops_reading_is_dropped_and_the_stepper_is_not_slowed(daemon: InProcess) -> None:
    with daemon.client() as stepper:
        stepper.new(session="w")
        lazy = socket.socket(socket.AF_UNIX)
        lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        lazy.connect(str(daemon.socket))
        try:
            lazy.sendall(b'{"jsonrpc":"2.0","id":1,"method":"session/watch","params":{"session":"w"}}\n')
            big = "x" * 100_000
            started = time.perf_counter()
            turn_id = 0
            for _ in range(40):
                turn_id += 1
                stepper.step("w", turn(turn_id, big))
                stepper.step("w", Event(Cancel=Cancel(turn=turn_id)))
            elapsed = time.perf_counter() - started
            watchers = stepper.call("session/list")["sessions"][0].get("watchers", 0)
            assert (watchers, elapsed < 10) == (0, True)
        finally:
            lazy.close()


# -- limits and bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"{not json", -32700),
        (b'{"jsonrpc":"2.0","id":1,"method":"daemon/status","x":"\xff"}', -32700),
        (b"[1,2]", -32600),
        (b"42", -32600),
        (b'{"jsonrpc":"1.0","id":1,"method":"daemon/status"}', -32600),
        (b'{"jsonrpc":"2.0","id":{"a":1},"method":"daemon/status"}', -32600),
        (b'{"jsonrpc":"2.0","id":1,"method":7}', -32600),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/fly"}', -32601),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":5,"event":{}}}', -32602),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":[1]}', -32602),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":"../etc"}}', -32602),
        (b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":".."}}', -32602),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"daemon/status","params":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            -32700,
        ),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":"s","event":{"Timer":true},"key":"\\ud800"}}',
            -32600,  # JSON all the same, but no UTF-8 text can hold a lone surrogate: an invalid request
        ),
    ],
)
def test_bad_input_gets_its_error_and_the_connection_stays_usable(daemon: InProcess, line: bytes, code: int) -> None:
    with Wire(daemon.socket) as w:
        w.send(line + b"\n")
        reply = w.reply()
        assert reply.error is not None and reply.error["code"] == code
        assert msgspec.json.decode(w.call("daemon/status", id=2).result)["server"]["name"] == "devd"


def test_a_notification_gets_no_answer(daemon: InProcess) -> None:
    with Wire(daemon.socket) as w:
        w.send(b'{"jsonrpc":"2.0","method":"daemon/status"}\n{"jsonrpc":"2.0","method":"nope"}\n')
        w.send(b'{"jsonrpc":"2.0","id":5,"method":"session/list"}\n')
        assert w.line() == b'{"jsonrpc":"2.0","id":5,"result":{"sessions":[]}}\n'


def test_a_line_over_the_limit_is_too_large_and_the_rest_is_discarded(tmp_path: Path) -> None:
    with InProcess(tmp_path, "--max-line-bytes", "1024") as d, Wire(d.socket) as w:
        w.send(b'{"jsonrpc":"2.0","id":1,"method":"daemon/status","pad":"' + b"x" * 200_000 + b'"}\n')
        reply = w.reply()
        assert (reply.id, reply.error["data"]["kind"]) == (None, "TOO_LARGE")  # type: ignore[index]
        assert bytes(w.call("session/list", id=2).result) == b'{"sessions":[]}'


def test_a_line_that_trickles_in_too_slowly_closes_its_connection(tmp_path: Path) -> None:
    with InProcess(tmp_path, "--line-timeout", "0.5") as d, Wire(d.socket) as slow, d.client() as idle:
        slow.send(b'{"jsonrpc":"2.0",')
        time.sleep(0.3)
        slow.send(b'"id":1,')
        time.sleep(0.4)
        with pytest.raises(ConnectionError):
            slow.reply()
        assert idle.call("session/list") == {"sessions": []}


def test_too_many_sessions_is_full(tmp_path: Path) -> None:
    with InProcess(tmp_path, "--max-sessions", "2") as d, d.client() as c:
        c.new()
        c.new()
        with pytest.raises(errors.FullError):
            c.new()


def test_a_taken_name_is_exists(client: Client) -> None:
    client.new(session="mine")
    with pytest.raises(errors.ExistsError):
        client.new(session="mine")


def test_too_many_connections_are_refused_politely(tmp_path: Path) -> None:
    with InProcess(tmp_path, "--max-connections", "1") as d, d.client() as first:
        first.call("session/list")
        with Wire(d.socket) as second:
            reply = second.reply()
            assert reply.error["data"]["kind"] == "FULL"  # type: ignore[index]
        for _ in range(20):  # refused peers that leave at once must not take the daemon with them
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(d.socket))
            s.close()
        time.sleep(0.2)
        assert first.call("session/list") == {"sessions": []}


def test_a_client_that_disconnects_leaves_the_daemon_serving(daemon: InProcess) -> None:
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{}}\n{"jsonrpc":')
        s.close()
    with daemon.client() as c:
        assert c.call("daemon/status")["server"]["name"] == "devd"


# -- who may connect ------------------------------------------------------------------------------------------------


def test_the_socket_is_0600_in_a_0700_directory(daemon: InProcess) -> None:
    assert (oct(daemon.socket.stat().st_mode & 0o777), oct(daemon.socket.parent.stat().st_mode & 0o777)) == (
        "0o600",
        "0o700",
    )


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_peer_of_another_uid_is_refused_even_when_modes_allow_it() -> None:
    root = Path(tempfile.mkdtemp(prefix="devd-peer-"))
    try:
        with InProcess(root) as daemon:
            daemon.socket.chmod(0o666)
            daemon.socket.parent.chmod(0o755)
            root.chmod(0o755)
            assert _as_nobody(daemon.socket) == (0, b"0")
            with daemon.client() as c:
                assert c.call("session/list") == {"sessions": []}
    finally:
        shutil.rmtree(root)


def _as_nobody(path: Path) -> tuple[int, bytes]:
    """Connect as uid 65534 (OpenSSH's agent-getpeereid test) and count the bytes the daemon answers."""
    probe = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.settimeout(5)\n"
        "try:\n"
        '    s.sendall(b\'{"jsonrpc":"2.0","id":1,"method":"session/list"}\\n\')\n'
        "    print(len(s.recv(100)))\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    print(0)\n"
    )
    run = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe, str(path)],
        capture_output=True,
        timeout=30,
    )
    assert run.stderr == b"", run.stderr
    return run.returncode, run.stdout.strip()


@pytest.fixture
def tcp(tmp_path: Path) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    with Daemon(tmp_path, "--listen", f"tcp://127.0.0.1:{port}") as d:
        yield d, port


def _tcp_exchange(port: int, data: bytes) -> bytes:
    """Send data, close our side, and return everything the daemon sends until it closes its own."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_tcp_answers_nothing_before_the_token(tcp: tuple[Daemon, int]) -> None:
    d, port = tcp
    answer_ = _tcp_exchange(port, b'{"jsonrpc":"2.0","id":1,"method":"session/list"}\n')
    assert msgspec.json.decode(answer_)["error"]["data"]["kind"] == "UNAUTHORIZED"


@pytest.mark.parametrize("token", ["", "wrong", "x" * 5000, "é"])
def test_tcp_refuses_a_wrong_token(tcp: tuple[Daemon, int], token: str) -> None:
    d, port = tcp
    with pytest.raises((errors.UnauthorizedError, ConnectionError)):
        Client.connect(f"tcp://127.0.0.1:{port}", token=token)


def test_tcp_initialize_as_a_notification_authenticates_without_an_answer(tcp: tuple[Daemon, int]) -> None:
    d, port = tcp
    token = (d.state / "token").read_text().strip()
    hello = msgspec.json.encode({"jsonrpc": "2.0", "method": "initialize", "params": {"token": token}})
    answer_ = _tcp_exchange(port, hello + b"\n" + b'{"jsonrpc":"2.0","id":2,"method":"session/list"}\n')
    assert [msgspec.json.decode(line)["id"] for line in answer_.splitlines()] == [2]


def test_tcp_serves_a_client_with_the_token(tcp: tuple[Daemon, int]) -> None:
    d, port = tcp
    token = (d.state / "token").read_text().strip()
    assert oct((d.state / "token").stat().st_mode & 0o777) == "0o600"
    with Client.connect(f"tcp://127.0.0.1:{port}", token=token) as c:
        assert c.call("session/list") == {"sessions": []}


def test_tcp_closes_an_http_request_without_acting(tcp: tuple[Daemon, int]) -> None:
    d, port = tcp
    body = b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":"csrf"}}\n'
    request = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n\r\n" + body
    assert _tcp_exchange(port, request) == b""
    with d.client() as c:
        assert c.call("session/list") == {"sessions": []}


def test_a_second_sigterm_during_shutdown_changes_nothing(spinning: Daemon) -> None:
    with Wire(spinning.socket) as w:
        send_spinning_step(w, 3, 500)
        time.sleep(0.1)
        for _ in range(3):
            spinning.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            time.sleep(0.05)
        assert (w.reply().id, spinning.proc.wait(20)) == (3, 0)  # type: ignore[union-attr]


def test_sigterm_finishes_and_exits_zero(tmp_path: Path) -> None:
    d = InProcess(tmp_path).start()
    with d.client() as c:
        c.new(session="s")
        c.step("s", turn(1, FIX))
    assert (d.stop(signal.SIGTERM), d.socket.exists()) == (0, False)


def test_status_counts_what_it_served(client: Client) -> None:
    s = client.new()
    client.step(s, turn(1, FIX))
    status = client.call("daemon/status")
    assert (status["sessions"], status["steps"], status["connections"]) == (
        {"live": 1, "stored": 0, "ended": 0, "poisoned": 0},
        1,
        1,
    )


def test_decode_actions_is_what_the_client_returns(client: Client) -> None:
    s = client.new()
    raw = client.call_raw("session/step", {"session": s, "event": msgspec.Raw(encode(turn(1, "x")))})
    assert decode_actions(msgspec.json.encode(msgspec.json.decode(raw)["actions"])) == [Action(id=1, op=ask(user("x")))]


def test_a_step_the_session_ignores_says_which_action_id_it_ignored(client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, "x"))
    stray = client.call("session/step", {"session": "s", "event": {"Model": {"id": 41, "reply": {"text": "?"}}}})
    assert stray == {"actions": [], "ignored": [41]}
