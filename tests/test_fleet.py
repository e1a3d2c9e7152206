"""Many daemons, one fleet: real daemons on one real PostgreSQL, each session stepped by one daemon at a time.

Clients may talk to any daemon; a session held by another answers MOVED with its owner, and `devd.client` follows
it there. A daemon that stops gives its sessions back at once; one that is killed or paused loses them when its
lease ends, and a paused one that wakes commits nothing for a session it lost (fencing)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import psycopg
import pytest

from devd import errors
from devd.client import AsyncClient, Client
from devd.driver import Handlers, ToolOutput, run_turn
from devd.messages import Ask, Call, Exec, Reply, answer, turn
from devd.storage import postgres_doctor
from devd.storage.postgres import MIGRATIONS as PG_MIGRATIONS
from tests.daemon import Daemon, free_port
from tests.harness import InProcess
from tests.helpers import Conversation, devd
from tests.postgres import Cluster, postgres, postgres_url  # noqa: F401  (the fixtures)

LEASE_TTL_S = 1.5


def fleet_daemon(root: Path, url: str, node: str, *extra: str) -> InProcess:
    """A daemon of the fleet, in this process: for the tests that neither kill nor pause it."""
    return InProcess(root / node, *fleet_args(url, node, *extra))


def fleet_process(root: Path, url: str, node: str, *extra: str) -> Daemon:
    """A daemon of the fleet as a process of its own, for the tests that kill it or pause it (SIGSTOP)."""
    return Daemon(root / node, *fleet_args(url, node, *extra))


def fleet_args(url: str, node: str, *extra: str) -> tuple[str, ...]:
    return ("--store", url, "--node", node, "--lease-ttl", str(LEASE_TTL_S), *extra)


@pytest.fixture
def two(tmp_path: Path, postgres_url: str) -> Iterator[tuple[InProcess, InProcess]]:  # noqa: F811
    with fleet_daemon(tmp_path, postgres_url, "a") as a, fleet_daemon(tmp_path, postgres_url, "b") as b:
        yield a, b


@pytest.fixture
def two_processes(tmp_path: Path, postgres_url: str) -> Iterator[tuple[Daemon, Daemon]]:  # noqa: F811
    a = fleet_process(tmp_path, postgres_url, "a").start()
    b = fleet_process(tmp_path, postgres_url, "b").start()
    try:
        yield a, b
    finally:
        for d in (a, b):
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
                d.stop()


def journal_epochs(url: str, session: str) -> dict[int, int]:
    """Rows of the session's journal, counted by the epoch that wrote them."""
    with psycopg.connect(url) as db:
        rows = db.execute("SELECT epoch, count(*) FROM journal WHERE session = %s GROUP BY epoch", (session,))
        return {int(epoch): int(n) for epoch, n in rows}


def test_a_session_held_by_another_daemon_answers_moved_naming_it(two: tuple[InProcess, InProcess]) -> None:
    a, b = two
    with a.client() as ca:
        ca.new(session="s")
    with Client.connect(b.socket, follow_moved=False) as cb:
        with pytest.raises(errors.MovedError) as moved:
            cb.step("s", turn(1, "x"))
    assert (moved.value.node, moved.value.address) == ("a", f"unix:{a.socket}")


def test_info_of_a_session_held_by_another_daemon_answers_moved_naming_it(two: tuple[InProcess, InProcess]) -> None:
    a, b = two
    with a.client() as ca:
        ca.new(session="s")
    with Client.connect(b.socket, follow_moved=False) as cb, pytest.raises(errors.MovedError) as moved:
        cb.info("s")
    assert moved.value.node == "a"


def test_a_client_of_any_daemon_is_followed_to_the_one_that_holds_the_session(two: tuple[InProcess, InProcess]) -> None:
    a, b = two
    with a.client() as ca:
        ca.new(session="s")
    with Client.connect(b.socket) as c:
        asked = c.step("s", turn(1, "x"))
        more = c.step("s", answer(asked[0].id, "done"))
    with b.client() as cb:
        answered_by_b = cb.call("daemon/status")["errors"]
    assert ([x.id for x in asked + more], answered_by_b) == ([1, 2, 3, 4], {"MOVED": 1})


def test_a_stopped_daemon_gives_its_sessions_back_and_another_carries_on_at_once(
    two: tuple[InProcess, InProcess],
    postgres_url: str,  # noqa: F811
) -> None:
    a, b = two
    with a.client() as ca:
        ca.new(session="s")
        asked = ca.step("s", turn(1, "x"))
    assert a.stop() == 0
    started = time.monotonic()
    with b.client() as cb:
        done = cb.step("s", answer(asked[0].id, "done"))
        listed = [(x["session"], x["seq"]) for x in cb.call("session/list")["sessions"]]
    # At once: well inside the lease a killed daemon would have held it for.
    assert ([x.id for x in done], listed, time.monotonic() - started < LEASE_TTL_S) == ([2, 3, 4], [("s", 2)], True)


def test_a_drained_daemon_keeps_serving_and_its_sessions_go_to_whoever_calls_them_next(
    two: tuple[InProcess, InProcess],
) -> None:
    a, b = two
    with a.client() as ca, b.client() as cb:
        ca.new(session="s")
        asked = ca.step("s", turn(1, "x"))
        drained = ca.drain()
        done = cb.step("s", answer(asked[0].id, "done"))
        status = ca.call("daemon/status")
    assert (drained, [x.id for x in done], status["errors"]) == (1, [2, 3, 4], {})


def test_a_killed_daemons_sessions_are_taken_over_after_its_lease_with_no_acked_step_lost(
    two_processes: tuple[Daemon, Daemon],
) -> None:
    a, b = two_processes
    with a.client() as ca:
        ca.new(session="s")
        first = ca.step_answer("s", turn(1, "x"), key="t1")
    a.kill()
    with b.client() as cb:
        deadline = time.monotonic() + 10 * LEASE_TTL_S
        while True:
            try:
                again = cb.step_answer("s", turn(1, "x"), key="t1")
                break
            except errors.MovedError:  # the dead daemon's lease has not ended yet
                assert time.monotonic() < deadline
                time.sleep(0.1)
        done = cb.step("s", answer(first.actions[0].id, "done"))
    assert (again.actions, again.replayed, [x.id for x in done]) == (first.actions, True, [2, 3, 4])


def test_a_paused_daemon_that_lost_its_session_commits_nothing_for_it_and_never_acks(
    two_processes: tuple[Daemon, Daemon],
    postgres_url: str,  # noqa: F811
) -> None:
    a, b = two_processes
    with Client.connect(a.socket, follow_moved=False) as ca:  # to see what a answers, rather than follow it
        ca.new(session="s")
        asked = ca.step("s", turn(1, "x"))
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        time.sleep(LEASE_TTL_S * 1.5)
        with b.client() as cb:  # takes the session over: a's lease has ended
            done = cb.step("s", answer(asked[0].id, "done"))
        before = journal_epochs(postgres_url, "s")
        os.kill(a.proc.pid, signal.SIGCONT)
        # Awake, a first refuses for want of a lease (INTERNAL, nothing written), then, renewed, names b (MOVED).
        owner = None
        for _ in range(50):
            try:
                ca.step("s", turn(2, "y"))
                raise AssertionError("the paused daemon acknowledged a step of a session it lost")
            except errors.MovedError as e:
                owner = e.node
                break
            except errors.InternalError:
                time.sleep(0.1)
    assert ([x.id for x in done], owner, journal_epochs(postgres_url, "s")) == ([2, 3, 4], "b", before)


def drive_anywhere(daemons: list[Daemon], conv: Conversation, steps: int, first: int, wrong: list[str]) -> None:
    """Step conv `steps` times under keys, through whichever daemon answers: start at daemons[first], move on to the
    next when one is gone, wait while a dead one's lease holds the session. Every answer must be the model's."""
    at = first
    deadline = time.monotonic() + 60
    while conv.acked < steps and time.monotonic() < deadline:
        try:
            with Client.connect(daemons[at % len(daemons)].socket, timeout=10) as c:
                while conv.acked < steps:
                    key, event, expected = conv.next_step()
                    got = c.step_answer(conv.name, event, key=key)  # type: ignore[arg-type]
                    if got.actions != expected:
                        wrong.append(f"{conv.name} {key}: got {got.actions}, want {expected}")
                        return
                    conv.acknowledged()
        except (OSError, ConnectionError):
            at += 1  # that daemon is gone: another takes the session once its lease ends
        except errors.MovedError:
            time.sleep(0.05)  # held by a daemon that is gone, until its lease ends


def test_three_daemons_serve_clients_spread_over_them_and_lose_nothing_when_one_is_killed(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
) -> None:
    daemons = [fleet_process(tmp_path, postgres_url, n).start() for n in ("a", "b", "c")]
    steps = 150
    try:
        convs = [Conversation(f"s{i}") for i in range(6)]
        for i, conv in enumerate(convs):
            with daemons[i % 3].client() as c:
                c.new(session=conv.name)
        wrong: list[str] = []
        threads = [
            threading.Thread(target=drive_anywhere, args=(daemons, conv, steps, i, wrong))
            for i, conv in enumerate(convs)
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)
        acked_at_kill = sum(conv.acked for conv in convs)
        daemons[0].kill()
        for t in threads:
            t.join(90)
        with psycopg.connect(postgres_url) as db:
            rows = dict(db.execute("SELECT session, count(*) FROM journal GROUP BY session").fetchall())
        assert (wrong, acked_at_kill < 6 * steps, rows) == ([], True, {conv.name: steps for conv in convs})
    finally:
        for d in daemons[1:]:
            d.stop()


def drive_through_errors(daemon: Daemon, conv: Conversation, steps: int, wrong: list[str]) -> None:
    """Step conv `steps` times under keys through one daemon, sending a step again (same key) after any error."""
    deadline = time.monotonic() + 60
    with Client.connect(daemon.socket, timeout=10) as c:
        while conv.acked < steps and time.monotonic() < deadline:
            key, event, expected = conv.next_step()
            try:
                got = c.step_answer(conv.name, event, key=key)  # type: ignore[arg-type]
            except errors.DevdError:
                time.sleep(0.05)  # the database is away: nothing was acknowledged, the step goes again
                continue
            if got.actions != expected:
                wrong.append(f"{conv.name} {key}: got {got.actions}, want {expected}")
                return
            conv.acknowledged()


def test_a_database_restarted_under_load_loses_no_acked_step_and_the_daemon_carries_on(
    tmp_path: Path,
    postgres: Cluster,  # noqa: F811
    postgres_url: str,  # noqa: F811
) -> None:
    daemon = fleet_process(tmp_path, postgres_url, "a").start()
    steps = 200
    try:
        convs = [Conversation(f"s{i}") for i in range(3)]
        with daemon.client() as c:
            for conv in convs:
                c.new(session=conv.name)
        wrong: list[str] = []
        threads = [threading.Thread(target=drive_through_errors, args=(daemon, conv, steps, wrong)) for conv in convs]
        for t in threads:
            t.start()
        time.sleep(0.3)
        acked_at_restart = sum(conv.acked for conv in convs)
        postgres.restart()
        for t in threads:
            t.join(90)
        with psycopg.connect(postgres_url) as db:
            rows = dict(db.execute("SELECT session, count(*) FROM journal GROUP BY session").fetchall())
        alive = daemon.proc is not None and daemon.proc.poll() is None
        assert (wrong, acked_at_restart < 3 * steps, alive, rows) == ([], True, True, {c.name: steps for c in convs})
    finally:
        daemon.stop()


def test_a_daemon_expires_only_sessions_it_holds_not_those_it_saw_that_live_on_elsewhere(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
) -> None:
    b = fleet_daemon(tmp_path, postgres_url, "b").start()
    a = None
    try:
        with b.client() as cb:
            cb.new(session="s")
            asked = cb.step("s", turn(1, "x"))
        a = fleet_daemon(tmp_path, postgres_url, "a", "--expire-after", "1s").start()  # knows s from the database
        with b.client() as cb:
            cb.drain()  # nobody holds s now, as after a daemon's lease ends
        time.sleep(2.5)  # a's expiry rounds pass: s looks unused to a, which has never used it
        with b.client() as cb:
            done = cb.step("s", answer(asked[0].id, "done"))
        assert [x.id for x in done] == [2, 3, 4]
    finally:
        for d in (a, b):
            if d is not None:
                d.stop()


@pytest.mark.anyio
async def test_a_client_with_a_watch_loop_running_is_not_moved_away_from_it(two: tuple[InProcess, InProcess]) -> None:
    a, b = two
    with a.client() as ca, b.client() as cb:
        ca.new(session="there")
        cb.new(session="here")
    async with AsyncClient.connect(b.socket) as client:

        async def follow() -> None:
            async for _ in client.watch("here"):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await anyio.sleep(0.2)  # the watch is subscribed: its loop lives on this connection
            with pytest.raises(errors.MovedError) as moved:
                await client.step_answer("there", turn(1, "x"))
            await client.unwatch("here")
    assert moved.value.node == "a"


def test_a_fork_in_a_fleet_starts_from_the_sessions_latest_step_wherever_it_was_taken(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
) -> None:
    b = fleet_daemon(tmp_path, postgres_url, "b").start()
    a = None
    try:
        with b.client() as cb:
            cb.new(session="s")
        a = fleet_daemon(tmp_path, postgres_url, "a").start()  # knows s, at step 0
        with b.client() as cb:
            asked = cb.step("s", turn(1, "x"))
            cb.step("s", answer(asked[0].id, "done"))
            cb.drain()
        with a.client() as ca:
            fork = ca.fork("s", name="f")
            listed = {x["session"]: x["seq"] for x in ca.call("session/list")["sessions"]}
        assert (fork, listed["f"]) == ("f", 2)
    finally:
        for d in (a, b):
            if d is not None:
                d.stop()


def test_drain_counts_the_sessions_it_gave_back_not_those_it_only_knew_of(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
) -> None:
    b = fleet_daemon(tmp_path, postgres_url, "b").start()
    a = None
    try:
        with b.client() as cb:
            cb.new(session="theirs")
        a = fleet_daemon(tmp_path, postgres_url, "a").start()  # knows "theirs" from the database
        with a.client() as ca:
            ca.new(session="mine")
            drained = ca.drain()
        assert drained == 1
    finally:
        for d in (a, b):
            if d is not None:
                d.stop()


# -- following MOVED extends no trust -------------------------------------------------------------------------------

TOKEN = "fleet-token-" + "t" * 40  # the fleet's daemons share one token, as an operator would set them up


def tcp_fleet_daemon(root: Path, url: str, node: str, port: int, *extra: str) -> InProcess:
    state = root / node / "state"
    state.mkdir(parents=True, mode=0o700)
    (state / "token").write_text(TOKEN)
    (state / "token").chmod(0o600)
    return fleet_daemon(root, url, node, "--listen", f"tcp://127.0.0.1:{port}", *extra)


@pytest.fixture
def rogue() -> Iterator[socket.socket]:
    """A listener where whoever can write the fleet's `nodes` table sends clients: another host, to the client."""
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))
    sock.listen()
    sock.setblocking(False)
    with sock:
        yield sock


def connections_to(sock: socket.socket) -> int:
    count = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.accept()[0].close()
            count += 1
    return count


def test_moved_to_an_address_the_client_was_not_given_is_not_followed(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
    rogue: socket.socket,
) -> None:
    port = free_port()
    a = fleet_daemon(tmp_path, postgres_url, "a", "--advertise", f"tcp://127.0.0.2:{rogue.getsockname()[1]}")
    b = tcp_fleet_daemon(tmp_path, postgres_url, "b", port)
    with a, b:
        with a.client() as ca:
            ca.new(session="s")
        with Client.connect(f"tcp://127.0.0.1:{port}", token=TOKEN) as c, pytest.raises(errors.MovedError) as moved:
            c.step("s", turn(1, "x"))
    assert ("not followed" in str(moved.value), connections_to(rogue)) == (True, 0)


@pytest.mark.anyio
async def test_the_async_client_follows_moved_to_no_address_it_was_not_given(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
    rogue: socket.socket,
) -> None:
    port = free_port()
    a = fleet_daemon(tmp_path, postgres_url, "a", "--advertise", f"tcp://127.0.0.2:{rogue.getsockname()[1]}")
    b = tcp_fleet_daemon(tmp_path, postgres_url, "b", port)
    with a, b:
        with a.client() as ca:
            ca.new(session="s")
        async with AsyncClient.connect(f"tcp://127.0.0.1:{port}", token=TOKEN) as c:
            with pytest.raises(errors.MovedError) as moved:
                await c.step_answer("s", turn(1, "x"))
    assert ("not followed" in str(moved.value), connections_to(rogue)) == (True, 0)


@pytest.fixture
def two_on_tcp(tmp_path: Path, postgres_url: str) -> Iterator[tuple[int, int]]:  # noqa: F811
    pa, pb = free_port(), free_port()
    a = tcp_fleet_daemon(tmp_path, postgres_url, "a", pa, "--advertise", f"tcp://127.0.0.1:{pa}")
    b = tcp_fleet_daemon(tmp_path, postgres_url, "b", pb)
    with a, b:
        with a.client() as ca:
            ca.new(session="s")
        yield pa, pb


def test_moved_to_another_port_of_the_first_host_is_not_followed_with_the_token_by_default(
    two_on_tcp: tuple[int, int],
) -> None:
    pa, pb = two_on_tcp
    with Client.connect(f"tcp://127.0.0.1:{pb}", token=TOKEN) as c, pytest.raises(errors.MovedError) as moved:
        c.step("s", turn(1, "x"))
    assert moved.value.address == f"tcp://127.0.0.1:{pa}"


def test_moved_is_followed_with_the_token_to_a_peer_the_client_was_configured_with(
    two_on_tcp: tuple[int, int],
) -> None:
    pa, pb = two_on_tcp
    with Client.connect(f"tcp://127.0.0.1:{pb}", token=TOKEN, peers=[f"tcp://127.0.0.1:{pa}"]) as c:
        assert [x.id for x in c.step("s", turn(1, "x"))] == [1]


@pytest.mark.anyio
async def test_the_async_client_follows_moved_to_the_first_host_when_told_to_share_its_token(
    two_on_tcp: tuple[int, int],
) -> None:
    pa, pb = two_on_tcp
    async with AsyncClient.connect(f"tcp://127.0.0.1:{pb}", token=TOKEN, share_token=True) as c:
        assert [x.id for x in (await c.step_answer("s", turn(1, "x"))).actions] == [1]


# -- a daemon that does not hold a session answers nothing from what it kept of it ---------------------------------


def lose_to_b(a: Daemon, b: Daemon, ca: Client) -> list[int]:
    """s, made and stepped on a, is taken over and stepped by b while a is paused past its lease; a is woken. The
    ids of b's answer."""
    ca.new(session="s")
    asked = ca.step("s", turn(1, "x"))
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    time.sleep(LEASE_TTL_S * 1.5)
    with b.client() as cb:  # takes the session over: a's lease has ended
        done = cb.step("s", answer(asked[0].id, "done"))
    os.kill(a.proc.pid, signal.SIGCONT)
    return [x.id for x in done]


def answered_after_renewal(call: Callable[[], object]) -> object:
    """What a woken daemon answers once it has its lease again (until then it refuses: INTERNAL, nothing done)."""
    deadline = time.monotonic() + 10 * LEASE_TTL_S
    while True:
        try:
            return call()
        except errors.InternalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        except errors.DevdError as e:
            return type(e).__name__, getattr(e, "node", None)


def test_a_daemon_that_lost_a_session_answers_reads_of_it_moved_not_from_its_old_instance(
    two_processes: tuple[Daemon, Daemon],
) -> None:
    a, b = two_processes
    with Client.connect(a.socket, follow_moved=False) as ca:
        lose_to_b(a, b, ca)
        answers = [
            answered_after_renewal(lambda: ca.pending("s")),
            answered_after_renewal(lambda: ca.call("session/transcript", {"session": "s"})),
            answered_after_renewal(lambda: ca.snapshot("s")),
        ]
    assert answers == [("MovedError", "b")] * 3


def test_a_daemon_lists_a_session_it_lost_as_not_held(two_processes: tuple[Daemon, Daemon]) -> None:
    a, b = two_processes
    with Client.connect(a.socket, follow_moved=False) as ca:
        lose_to_b(a, b, ca)
        answered_after_renewal(lambda: ca.pending("s"))
        listed = [(x["session"], x.get("held")) for x in ca.call("session/list")["sessions"]]
    assert listed == []  # MOVED: forgotten here


def test_a_session_seen_at_start_but_held_elsewhere_is_listed_as_not_held(tmp_path: Path, postgres_url: str) -> None:  # noqa: F811
    a = fleet_daemon(tmp_path, postgres_url, "a")
    b = fleet_daemon(tmp_path, postgres_url, "b")
    with a:
        with a.client() as ca:
            ca.new(session="s")
        with b, b.client() as cb:
            assert [(x["session"], x["held"]) for x in cb.call("session/list")["sessions"]] == [("s", False)]


def test_the_watchers_of_a_session_a_paused_daemon_lost_are_told_it_moved(
    two_processes: tuple[Daemon, Daemon],
) -> None:
    a, b = two_processes
    with Client.connect(a.socket, follow_moved=False) as ca, Client.connect(a.socket) as watcher:
        ca.new(session="w")
        watcher.call("session/watch", {"session": "w"})
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        time.sleep(LEASE_TTL_S * 1.5)
        with b.client() as cb:
            cb.step("w", turn(1, "x"))
        os.kill(a.proc.pid, signal.SIGCONT)
        notice = watcher.wait_notification(30)
    assert (notice.method, notice.params["reason"], notice.params["owner"]["node"]) == (
        "session/unwatched",
        "moved",
        "b",
    )


def test_a_watch_through_a_daemon_that_does_not_hold_the_session_answers_moved(
    two: tuple[InProcess, InProcess],
) -> None:
    a, b = two
    with a.client() as ca:
        ca.new(session="s")  # after b started: b has never heard of it
    with Client.connect(b.socket, follow_moved=False) as cb, pytest.raises(errors.MovedError) as moved:
        cb.call("session/watch", {"session": "s"})
    assert moved.value.node == "a"


class Tools:
    """A model that runs `make` once and then answers, and an exec handler that counts what it ran."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    def model(self, ask: Ask) -> Reply:
        done_making = ask.messages[-1].Tool is not None
        return Reply(text="built") if done_making else Reply(calls=[Call(Exec=Exec(argv=["make"]))])

    def exec(self, op: Exec) -> ToolOutput:
        self.ran.append(op.argv)
        return ToolOutput("ok")


@pytest.mark.anyio
async def test_run_turn_through_a_daemon_that_does_not_hold_the_session_runs_each_exec_once(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
) -> None:
    a = fleet_daemon(tmp_path, postgres_url, "a")
    b = fleet_daemon(tmp_path, postgres_url, "b")
    tools = Tools()
    with a:
        with a.client() as ca:
            ca.new(session="s")
        with b:  # b sees s at step 0, then a runs a turn of it
            async with AsyncClient.connect(a.socket) as c:
                await run_turn(c, "s", "build", Handlers(model=tools.model, exec=tools.exec))
            async with AsyncClient.connect(b.socket) as c:
                done = await run_turn(c, "s", "build again", Handlers(model=tools.model, exec=tools.exec))
    assert (done.turn, tools.ran) == (5, [["make"], ["make"]])


@pytest.mark.anyio
async def test_run_turn_through_a_daemon_started_before_the_session_was_made_finds_it(
    two: tuple[InProcess, InProcess],
) -> None:
    a, b = two
    tools = Tools()
    with a.client() as ca:
        ca.new(session="late")
    async with AsyncClient.connect(b.socket) as c:
        done = await run_turn(c, "late", "build", Handlers(model=tools.model, exec=tools.exec))
    assert (done.turn, tools.ran) == (1, [["make"]])


@pytest.mark.parametrize(("peer", "status"), [([], 1), (["--peer", "tcp://127.0.0.1:{pa}"], 0)])
def test_the_cli_follows_moved_over_tcp_only_to_a_peer_it_was_given(
    two_on_tcp: tuple[int, int], peer: list[str], status: int
) -> None:
    pa, pb = two_on_tcp
    run = subprocess.run(
        [sys.executable, "-m", "devd", "step", "--connect", f"tcp://127.0.0.1:{pb}", "--token", TOKEN]
        + [p.format(pa=pa) for p in peer]
        + ["s", '{"Turn":{"id":1,"prompt":"x"}}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (run.returncode, "not followed" in run.stderr) == (status, status == 1)


# -- devd doctor on a fleet's database --------------------------------------------------------------------------------


def test_doctor_checks_a_fleets_database_its_format_and_the_daemons_holding_a_lease(
    tmp_path: Path,
    postgres_url: str,  # noqa: F811
) -> None:
    where = postgres_doctor.shown(postgres_url)
    with fleet_daemon(tmp_path, postgres_url, "a") as a:
        with a.client() as c:
            c.new(session="s")
        run = devd("doctor", "--connect", str(a.socket), "--state-dir", str(a.state), "--store", postgres_url)
    lines = run.stdout.splitlines()
    assert (run.returncode, lines[2].startswith(f"ok    database: {where} answers (PostgreSQL "), lines[4:]) == (
        0,
        True,
        [
            f"ok    format: {where} is format {len(PG_MIGRATIONS)}",
            f"ok    fleet: 1 of 1 daemons hold a live lease (a at unix:{a.socket}); 1 sessions have an owner",
        ],
    )


def test_doctor_says_what_to_do_when_the_fleets_database_does_not_answer_and_never_shows_its_password(
    tmp_path: Path,
) -> None:
    url = f"postgresql://devd:hunter2@127.0.0.1:{free_port()}/fleet"
    run = devd("doctor", "--connect", str(tmp_path / "none.sock"), "--state-dir", str(tmp_path), "--store", url)
    (database,) = [line for line in run.stdout.splitlines() if "database:" in line]
    shown = database.startswith("FAIL  database: cannot connect to devd@127.0.0.1:")
    assert (run.returncode, shown, "hunter2" in run.stdout + run.stderr) == (1, True, False)
