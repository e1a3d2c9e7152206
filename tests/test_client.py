"""devd.client against the real daemon: every method of the table typed on both clients, watching as iteration,
the default address, reconnecting, and what a client says when no daemon is there."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from devd import errors
from devd.client import (
    METHOD_NAMES,
    NOTICES,
    ActionsNotice,
    AsyncClient,
    Client,
    Notice,
    NotRunningError,
    StepAnswer,
    UnwatchedNotice,
    default_address,
)
from devd.config import default_socket_path
from devd.messages import Action, Call, Config, Event, Message, Op, Output, Tool, ToolCall, answer, ask, turn
from devd.protocol import METHODS, InfoResult, InitializeResult, Limits, Server, StatusResult, Waiting
from devd.server import rpc
from tests.daemon import Daemon, free_port
from tests.harness import InProcess
from tests.helpers import FIX, finish, until, user

ASKED = [Action(id=1, op=ask(user(FIX)))]  # what a fresh session answers the turn "fix the build"
TIMER = Event(Timer=True)
RFC3339_MS_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def untimed(notices: list[Notice]) -> list[Notice]:
    """The notices, each `ActionsNotice`'s time left out (checked on its own), so the rest compares exactly."""
    return [msgspec.structs.replace(n, at="") if isinstance(n, ActionsNotice) else n for n in notices]


# -- the method table ------------------------------------------------------------------------------------------------


def test_every_method_of_the_table_has_a_typed_method_on_both_clients() -> None:
    missing = [
        (cls.__name__, name)
        for cls in (Client, AsyncClient)
        for name in (METHOD_NAMES[m] for m in METHODS)
        if not callable(getattr(cls, name, None))
    ]
    assert (set(METHOD_NAMES) == set(METHODS), missing) == (True, [])


def test_every_notification_of_the_daemon_has_a_typed_notice() -> None:
    assert set(NOTICES) == set(rpc.NOTIFICATIONS)


def test_each_error_kind_the_daemon_answers_is_raised_as_its_most_general_class() -> None:
    from devd.client import _KINDS

    expected = {
        cls.kind: cls
        for cls in (
            errors.HandleError,
            errors.MalformedError,
            errors.PoisonError,
            errors.PanicError,
            errors.NullError,
            errors.BusyError,
            errors.FullError,
            errors.DeadlineError,
            errors.TooLargeError,
            errors.UnauthorizedError,
            errors.ExistsError,
            errors.ConflictError,
            errors.ParseError,
            errors.InvalidRequestError,
            errors.MethodNotFoundError,
            errors.InvalidParamsError,
            errors.InternalError,
        )
    }
    assert {kind: _KINDS[kind] for kind in expected} == expected


# -- the default address ---------------------------------------------------------------------------------------------


def test_the_default_address_is_devd_socket_when_it_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEVD_SOCKET", "/somewhere/d.sock")
    assert default_address() == "/somewhere/d.sock"


def test_the_default_address_is_the_daemons_own_default_socket_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEVD_SOCKET", raising=False)
    assert default_address() == str(default_socket_path())


def test_connect_without_an_address_reaches_the_daemon_at_the_default_address(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVD_SOCKET", str(daemon.socket))
    with Client.connect() as c:
        assert c.new(session="here") == "here"


async def test_without_a_daemon_the_async_client_says_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(NotRunningError, match="start one with `devd serve`"):
        async with AsyncClient.connect(tmp_path / "none.sock"):
            pass


# -- the blocking client, method by method ---------------------------------------------------------------------------


def test_initialize_answers_the_daemons_limits(client: Client) -> None:
    assert client.initialize() == InitializeResult(
        server=Server("devd", "0.1.0"),
        protocol=1,
        abi=2,
        limits=Limits(16777216, 1000000, 1024, 5000, 67108864, 1000),
    )


def test_status_answers_a_status_result_counting_the_steps(client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    status = client.status()
    assert (type(status), status.server.name, status.steps, status.sessions["live"]) == (StatusResult, "devd", 1, 1)


def test_new_answers_the_sessions_name(client: Client) -> None:
    assert client.new(Config(model="small"), session="named") == "named"


def test_step_still_answers_the_list_of_actions(client: Client) -> None:
    client.new(session="s")
    assert client.step("s", turn(1, FIX)) == ASKED


def test_a_reply_of_megabytes_read_in_many_pieces_arrives_whole(client: Client) -> None:
    # The reader splits what it holds only when a read brings a newline (it used to join and split at every read,
    # which made a long reply cost the square of its length: bench long --big-turn measures that).
    client.new(session="big")
    prompt = "x" * (4 << 20)
    assert client.step("big", turn(1, prompt)) == [Action(id=1, op=ask(user(prompt)))]


def test_step_answer_keeps_replayed_for_a_keyed_step_sent_again(client: Client) -> None:
    client.new(session="s")
    first = client.step_answer("s", turn(1, FIX), key="k")
    again = client.step_answer("s", turn(1, FIX), key="k")
    assert (first, again) == (StepAnswer(ASKED, replayed=False), StepAnswer(ASKED, replayed=True))


def test_snapshot_and_restore_answer_a_snapshot_and_the_new_sessions_name(client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    restored = client.restore(client.snapshot("s"), session="copy")
    assert (restored, client.pending("copy")) == ("copy", ASKED)


def test_fork_answers_the_forks_name_and_pending_its_actions(client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    client.step("s", answer(1, "done"))
    assert (client.fork("s", at=1, name="b"), client.pending("b")) == ("b", ASKED)


def test_recover_answers_the_sessions_name(client: Client) -> None:
    client.new(session="s")
    assert client.recover("s") == "s"


def test_close_session_deletes_the_session(client: Client) -> None:
    client.new(session="s")
    client.close_session("s")
    assert client.list().sessions == []


def test_list_answers_pages_of_sessions_after_a_cursor(client: Client) -> None:
    for name in ("a", "b", "c"):
        client.new(session=name)
    first = client.list(limit=2)
    second = client.list(limit=2, cursor=first.next)
    pages = [([s.session for s in page.sessions], page.next) for page in (first, second)]
    assert pages == [(["a", "b"], "b"), (["c"], None)]


def test_watch_yields_typed_notices_and_ends_when_the_session_is_closed(daemon: InProcess, client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    client.step("s", answer(1, "done"))
    with daemon.client() as watcher:
        notices = watcher.watch("s", since=0, timeout=10)
        first = next(notices)
        client.close_session("s")
        assert untimed([first, *notices]) == [
            ActionsNotice("s", 1, turn(1, FIX), ASKED, ""),
            ActionsNotice("s", 2, answer(1, "done"), finish(2, 1, "done"), ""),
            UnwatchedNotice("s", 2, "closed"),
        ]


def test_a_watched_tool_call_arrives_typed_with_its_input_byte_for_byte(daemon: InProcess, client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    search = Call(Tool=ToolCall(name="search", input=msgspec.Raw(b'{"q": [1, 2]}')))
    with daemon.client() as watcher:
        notices = watcher.watch("s", since=1, timeout=10)
        client.step("s", answer(1, calls=[search]))
        assert untimed([next(notices)]) == [
            ActionsNotice("s", 2, answer(1, calls=[search]), [Action(id=2, op=Op(Tool=search.Tool))], "")
        ]


def test_a_tool_action_is_answered_typed_and_a_tool_event_steps_its_result(client: Client) -> None:
    """The blocking client: step and pending decode a Tool action (its input byte for byte), and a Tool event with the
    action's id is taken as its result (none ignored)."""
    client.new(session="s")
    client.step("s", turn(1, FIX))
    search = Call(Tool=ToolCall(name="search", input=msgspec.Raw(b'{"q": [1, 2]}')))
    dispatched = client.step("s", answer(1, calls=[search]))
    owed = client.pending("s")
    result = client.step_answer("s", Event(Tool=Output(id=2, text="2 hits", failed=False)))
    assert (dispatched, owed, result.ignored) == (
        [Action(id=2, op=Op(Tool=search.Tool))],
        [Action(id=2, op=Op(Tool=search.Tool))],
        [],
    )


async def test_the_async_client_steps_a_tool_event_and_the_transcript_holds_its_result(daemon: InProcess) -> None:
    search = Call(Tool=ToolCall(name="search", input=msgspec.Raw(b"{}")))
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        await c.step("s", turn(1, FIX))
        assert await c.step("s", answer(1, calls=[search])) == [Action(id=2, op=Op(Tool=search.Tool))]
        await c.step("s", Event(Tool=Output(id=2, text="no hits", failed=True)))
        transcript = await c.transcript("s")
    assert transcript[-1] == Message(Tool=Tool(id=2, text="no hits", failed=True))


def test_unwatch_ends_the_watch_loop_and_the_subscription(daemon: InProcess, client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    with daemon.client() as watcher:
        seen = []
        for notice in watcher.watch("s", since=0, timeout=10):
            seen.append(notice.seq)
            watcher.unwatch("s")
        assert (seen, client.list().sessions[0].watchers) == ([1], 0)


def test_leaving_a_watch_loop_early_unsubscribes(daemon: InProcess, client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    with daemon.client() as watcher:
        notices = watcher.watch("s", since=0, timeout=10)
        next(notices)
        watching = client.list().sessions[0].watchers
        notices.close()
        # Asked on the watcher's connection: the unwatch is a notification sent as the loop closes, and the daemon
        # takes a connection's lines in order, where another connection's list may be taken before it.
        assert (watching, watcher.list().sessions[0].watchers) == (1, 0)


# -- the async client ------------------------------------------------------------------------------------------------


async def test_the_async_client_answers_each_method_typed(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        results: list[object] = [
            await c.new(session="s"),
            await c.step("s", turn(1, FIX)),
            await c.step_answer("s", turn(1, FIX), key="k"),
            await c.step_answer("s", turn(1, FIX), key="k"),
            await c.pending("s"),
            await c.fork("s", at=1, name="b"),
            await c.restore(await c.snapshot("s"), session="copy"),
            await c.recover("copy"),
            [s.session for s in (await c.list()).sessions],
        ]
        await c.close_session("copy")
        results += [
            [s.session for s in (await c.list()).sessions],
            [s.session for s in (await c.list(limit=1, cursor="a")).sessions],
            (await c.status()).steps,
            (await c.initialize()).protocol,
        ]
    assert results == [
        "s",
        ASKED,
        StepAnswer([], replayed=False),  # turn 1 again, its id not above the highest: ignored
        StepAnswer([], replayed=True),
        ASKED,
        "b",
        "copy",
        "copy",
        ["b", "copy", "s"],
        ["b", "s"],
        ["b"],
        2,
        1,
    ]


async def test_async_watch_yields_typed_notices_and_ends_when_the_session_is_closed(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c, AsyncClient.connect(daemon.socket) as watcher:
        await c.new(session="s")
        await c.step("s", turn(1, FIX))
        seen = []
        async for notice in watcher.watch("s", since=0):
            seen.append(notice)
            if len(seen) == 1:
                await c.close_session("s")
    assert untimed(seen) == [ActionsNotice("s", 1, turn(1, FIX), ASKED, ""), UnwatchedNotice("s", 1, "closed")]


async def test_async_watch_follows_live_steps_made_by_the_same_client_inside_the_loop(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        await c.step("s", TIMER)
        seen = []
        async for notice in c.watch("s", since=0):
            seen.append(notice.seq)
            if len(seen) == 3:
                break
            await c.step("s", TIMER)
    assert seen == [1, 2, 3]


async def test_async_unwatch_ends_the_watch_loop_and_the_subscription(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        await c.step("s", TIMER)
        seen = []
        async for notice in c.watch("s", since=0):
            seen.append(notice.seq)
            await c.unwatch("s")
        assert (seen, (await c.list()).sessions[0].watchers) == ([1], 0)


async def test_an_async_watch_sets_subscribed_once_the_daemon_has_the_subscription(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c, AsyncClient.connect(daemon.socket) as watcher:
        await c.new(session="s")
        subscribed = anyio.Event()
        notices = watcher.watch("s", subscribed=subscribed)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anext, notices)
            await subscribed.wait()
            watchers = (await c.list()).sessions[0].watchers
            tg.cancel_scope.cancel()
        await notices.aclose()
        assert watchers == 1


async def test_leaving_an_async_watch_loop_early_unsubscribes(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c, AsyncClient.connect(daemon.socket) as watcher:
        await c.new(session="s")
        await c.step("s", turn(1, FIX))
        notices = watcher.watch("s", since=0)
        await anext(notices)
        watching = (await c.list()).sessions[0].watchers
        await notices.aclose()
        with anyio.fail_after(10):
            while (await c.list()).sessions[0].watchers:  # the unwatch is a notification: nothing answers it
                await anyio.sleep(0.01)
        assert watching == 1


async def test_a_call_after_a_restart_raises_connection_error_until_reconnect(daemon: InProcess) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        assert daemon.stop() == 0
        daemon.start()
        with pytest.raises(ConnectionError):
            await c.list()
        await c.reconnect()
        assert [s.session for s in (await c.list()).sessions] == ["s"]


def test_a_watch_subscribes_when_its_iteration_starts(client: Client) -> None:
    client.new(session="s")
    notices = client.watch("s")
    assert client.list().sessions[0].watchers == 0
    notices.close()


# -- what the kit promises a new user --------------------------------------------------------------------------------


def test_importing_the_client_loads_no_part_of_the_daemon_nor_wasmtime() -> None:
    code = "import sys, devd.client; print(sorted(m for m in sys.modules if m.startswith(('devd', 'wasmtime'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    shared = ["devd", "devd.addresses", "devd.client", "devd.config", "devd.errors", "devd.messages", "devd.protocol"]
    assert out == f"{shared}\n"


def test_the_protocol_module_loads_no_module_of_devd_but_the_messages_and_the_errors() -> None:
    code = "import sys, devd.protocol; print(sorted(m for m in sys.modules if m.startswith('devd')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "['devd', 'devd.errors', 'devd.messages', 'devd.protocol']\n"


def _server_that_dies_mid_reply(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    return server


def _write_half_a_reply_and_end(server: socket.socket) -> socket.socket:
    """Accept the client, send half of an answer's line, and end the stream (the peer still reads what is sent)."""
    conn, _ = server.accept()
    conn.sendall(b'{"jsonrpc":"2.0","id":1,"result":{"ses')
    conn.shutdown(socket.SHUT_WR)
    return conn


def test_a_reply_cut_mid_line_raises_connection_error_on_the_blocking_client(tmp_path: Path) -> None:
    with _server_that_dies_mid_reply(tmp_path / "s.sock") as server, Client.connect(tmp_path / "s.sock") as c:
        with _write_half_a_reply_and_end(server), pytest.raises(ConnectionError, match="in the middle of a reply"):
            c.new(session="x")


async def test_a_reply_cut_mid_line_raises_connection_error_on_the_async_client(tmp_path: Path) -> None:
    with _server_that_dies_mid_reply(tmp_path / "s.sock") as server:
        async with AsyncClient.connect(tmp_path / "s.sock") as c:
            with _write_half_a_reply_and_end(server), pytest.raises(ConnectionError, match="in the middle of a reply"):
                await c.new(session="x")


async def test_an_error_inside_the_async_clients_context_comes_out_as_itself(daemon: Daemon) -> None:
    with pytest.raises(NotRunningError, match="start one with `devd serve`"):
        async with AsyncClient.connect(daemon.socket) as c:
            assert daemon.stop() == 0
            await c.reconnect()


async def test_a_refused_token_comes_out_of_async_connect_as_unauthorized(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with Daemon(tmp_path, "--listen", address), pytest.raises(errors.UnauthorizedError):
        async with AsyncClient.connect(address, token="x" * 32):
            pass


def test_info_answers_the_sessions_entry_and_what_its_turn_waits_for(client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    info = client.info("s")
    assert (info.session, info.state, info.seq, info.waiting) == ("s", "live", 1, [Waiting(1, "Model")])


def test_info_of_a_finished_turn_waits_for_nothing(client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))
    client.step("s", answer(1, "done"))
    assert client.info("s").waiting == []


def test_info_of_a_session_there_is_not_is_a_handle_error(client: Client) -> None:
    with pytest.raises(errors.HandleError):
        client.info("nobody")


async def test_the_async_client_answers_info_typed(daemon: Daemon) -> None:
    async with AsyncClient.connect(daemon.socket) as c:
        await c.new(session="s")
        assert isinstance(await c.info("s"), InfoResult)


def test_every_actions_notice_carries_when_its_step_was_answered(daemon: Daemon, client: Client) -> None:
    client.new(session="s")
    client.step("s", turn(1, FIX))  # in the history when the watch starts: its time is the journal's
    with daemon.client() as watcher:
        notices = watcher.watch("s", since=0, timeout=10)
        first = next(notices)
        client.step("s", answer(1, "done"))  # live
        second = next(notices)
    assert [bool(RFC3339_MS_UTC.fullmatch(n.at)) for n in (first, second)] == [True, True]  # type: ignore[union-attr]


# -- the blocking client is the async one, driven ----------------------------------------------------------------------


async def test_the_blocking_client_answers_when_called_from_async_code(daemon: InProcess) -> None:
    with Client.connect(daemon.socket) as c:
        assert c.new(session="from-a-notebook") == "from-a-notebook"


def test_a_call_past_the_blocking_clients_timeout_leaves_the_next_call_its_own_answer(tmp_path: Path) -> None:
    from tests import modules

    core = tmp_path / "spin.wasm"
    core.write_bytes(modules.SPIN_ON_TIMER)
    with InProcess(tmp_path, "--core", str(core)) as d, Client.connect(d.socket, timeout=0.2) as c, d.client() as other:
        c.new(session="spin")
        with pytest.raises(TimeoutError):
            c.step("spin", TIMER, timeout_ms=600)  # answered DEADLINE after the client stopped waiting
        until(lambda: other.status().deadline_hits == 1)  # that late answer has been sent
        assert c.list().sessions[0].session == "spin"
