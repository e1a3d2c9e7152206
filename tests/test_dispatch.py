"""Request lines in, reply lines out (devd.server.dispatch): the dispatcher as the daemon builds it, with no
connection."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest
from structlog.testing import capture_logs

from devd import __version__
from devd.agent.wire import AgentPort
from devd.config import Settings
from devd.host import Core
from devd.protocol import Empty, SessionParams
from devd.server.daemon import build
from devd.server.dispatch import Dispatcher
from devd.server.methods import METHODS, Call, Method, Peer
from devd.storage.memory import MemoryStore
from tests.helpers import Sink

PEER = Peer("unix", Sink())
STATUS = b'{"jsonrpc":"2.0","id":9,"method":"daemon/status"}'


@pytest.fixture
def dispatcher(tmp_path: Path, core: Core) -> Iterator[Dispatcher]:
    # A budget no load can make a call miss: the status test counts offloaded calls exactly (under three workers on
    # two cores, a 2 ms budget was missed, and the step counted as offloaded and rebuilt).
    settings = Settings(state_dir=tmp_path, socket_path=None, inline_budget_s=60.0)
    registry, d = build(settings, core, MemoryStore())
    yield d
    registry.close_all()


async def boom(call: Call, params: SessionParams) -> Empty:
    raise RuntimeError("a bug in a handler")


BOOM = Method("boom", SessionParams, Empty, boom, "Fail as a bug would.", False)


def error(id: bytes, code: int, message: bytes, kind: bytes) -> bytes:
    """An error reply line, as the protocol document shows them."""
    return b'{"jsonrpc":"2.0","id":%s,"error":{"code":%d,"message":"%s","data":{"kind":"%s"}}}\n' % (
        id,
        code,
        message,
        kind,
    )


async def test_daemon_status_answers_with_the_counters(dispatcher: Dispatcher) -> None:
    await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":"s"}}')
    await dispatcher.answer(
        PEER, b'{"jsonrpc":"2.0","id":2,"method":"session/step","params":{"session":"s","event":{"Timer":true}}}'
    )
    reply = msgspec.json.decode(await dispatcher.answer(PEER, STATUS))
    moving = ("uptime_s", "memory_rss_bytes", "live_memory_bytes", "commit_ms_p50", "commit_ms_p99")
    assert {**reply, "result": {k: v for k, v in reply["result"].items() if k not in moving}} == {
        "jsonrpc": "2.0",
        "id": 9,
        "result": {
            "server": {"name": "devd", "version": __version__},
            "sessions": {"live": 1, "stored": 0, "ended": 0, "poisoned": 0},
            "connections": 0,
            "steps": 1,
            "durable_writes": 2,
            "errors": {},
            "deadline_hits": 0,
            "offloaded": 0,
            "rebuilt": 0,
            "hibernated": 0,
            "expired": 0,
            "store_reopened": 0,
        },
    }


async def test_an_unknown_method_is_method_not_found_naming_it(dispatcher: Dispatcher) -> None:
    assert await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","id":1,"method":"session/nope"}') == error(
        b"1", -32601, b"there is no method 'session/nope'; see `devd schema` for the methods", b"METHOD_NOT_FOUND"
    )


async def test_an_unknown_params_member_is_invalid_params_naming_it(dispatcher: Dispatcher) -> None:
    line = b'{"jsonrpc":"2.0","id":"s1","method":"session/step","params":{"sesion":"a","event":{}}}'
    assert await dispatcher.answer(PEER, line) == error(
        b'"s1"', -32602, b"bad params for session/step: Object contains unknown field `sesion`", b"INVALID_PARAMS"
    )


async def test_a_bad_session_name_is_answered_as_the_protocol_document_shows(dispatcher: Dispatcher) -> None:
    line = b'{"jsonrpc":"2.0","id":2,"method":"session/new","params":{"session":"no/slashes"}}'
    assert await dispatcher.answer(PEER, line) == (
        b'{"jsonrpc":"2.0","id":2,"error":{"code":-32602,"message":"session names are 1-64 of A-Z a-z 0-9 . _ - and '
        b'not . or ..; \'no/slashes\' is not one","data":{"kind":"INVALID_PARAMS"}}}\n'
    )


async def test_a_notification_is_carried_out_and_answered_with_nothing(dispatcher: Dispatcher) -> None:
    silent = await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","method":"session/new","params":{"session":"n"}}')
    listed = await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","id":1,"method":"session/list"}')
    listed = re.sub(rb'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"', b'"$TIME"', listed)
    assert (silent, listed) == (
        b"",
        b'{"jsonrpc":"2.0","id":1,"result":{"sessions":[{"session":"n","state":"live","seq":0,'
        b'"created":"$TIME","last_used":"$TIME"}]}}\n',
    )


async def test_a_failing_notification_is_answered_with_nothing(dispatcher: Dispatcher) -> None:
    assert [
        await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","method":"session/nope"}'),
        await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","method":"session/step","params":{"session":"x"}}'),
    ] == [b"", b""]


async def test_while_draining_steps_are_busy_and_status_still_answers(dispatcher: Dispatcher) -> None:
    await dispatcher.answer(PEER, b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"session":"s"}}')
    dispatcher.draining = True
    step = b'{"jsonrpc":"2.0","id":2,"method":"session/step","params":{"session":"s","event":{"Timer":true}}}'
    refused = await dispatcher.answer(PEER, step)
    status = msgspec.json.decode(await dispatcher.answer(PEER, STATUS))
    assert (refused, status["result"]["steps"]) == (
        error(b"2", -32006, b"the daemon is shutting down; retry against the next one", b"BUSY"),
        0,
    )


async def test_an_exception_that_is_no_devd_error_is_answered_internal_and_logged(dispatcher: Dispatcher) -> None:
    failing = Dispatcher({"boom": BOOM}, dispatcher.app)
    with capture_logs() as logs:
        reply = await failing.answer(PEER, b'{"jsonrpc":"2.0","id":5,"method":"boom","params":{"session":"s"}}')
    assert (reply, [entry for entry in logs if entry["log_level"] == "error"]) == (
        error(b"5", -32603, b"the daemon failed to answer; see its log", b"INTERNAL"),
        [
            {
                "event": "request.failed",
                "log_level": "error",
                "method": "boom",
                "session": "s",
                "error": "RuntimeError: a bug in a handler",
            }
        ],
    )


async def test_errors_are_counted_by_kind(dispatcher: Dispatcher) -> None:
    both = Dispatcher({**METHODS, "boom": BOOM}, dispatcher.app)
    for line in (
        b'{"jsonrpc":"2.0","id":1,"method":"session/nope"}',
        b'{"jsonrpc":"2.0","method":"session/nope"}',
        b'{"jsonrpc":"2.0","id":2,"method":"session/new","params":{"session":".."}}',
        b'{"jsonrpc":"2.0","id":3,"method":"session/step","params":{"session":"gone","event":{}}}',
        b'{"jsonrpc":"2.0","id":4,"method":"boom","params":{"session":"s"}}',
        b'{"jsonrpc":"2.0","id":5,"method":"boom","params":{"session":"s"}}',
        b"{not json",
        b'{"jsonrpc":"2.0","id":6,"method":"daemon/status"}',
    ):
        await both.answer(PEER, line)
    assert dispatcher.app.errors == {
        "METHOD_NOT_FOUND": 2,
        "INVALID_PARAMS": 1,
        "HANDLE": 1,
        "INTERNAL": 2,
        "PARSE": 1,
    }


# -- the method table and its handlers -------------------------------------------------------------------------------


def test_every_method_of_the_protocol_has_exactly_its_handler_bound() -> None:
    from devd import protocol

    assert {n: (m.params, m.result) for n, m in METHODS.items()} == {
        n: (s.params, s.result) for n, s in protocol.METHODS.items()
    }


def test_a_method_of_the_table_without_a_handler_fails_the_binding_naming_it() -> None:
    from devd import protocol
    from devd.server import methods

    handlers = {n: m.handler for n, m in METHODS.items() if n != "session/info"}
    with pytest.raises(RuntimeError, match=re.escape("methods without a handler: ['session/info']")):
        methods.bind(protocol.METHODS, handlers)


def test_a_handler_for_a_method_the_table_lacks_fails_the_binding_naming_it() -> None:
    from devd import protocol
    from devd.server import methods

    handlers = {**{n: m.handler for n, m in METHODS.items()}, "session/nope": boom}
    with pytest.raises(RuntimeError, match=re.escape("handlers without a method: ['session/nope']")):
        methods.bind(protocol.METHODS, handlers)


def test_a_second_handler_for_a_method_is_refused_at_import() -> None:
    from devd.server import methods

    with pytest.raises(RuntimeError, match="session/step has two handlers"):
        methods.method("session/step")(boom)


async def test_a_long_list_page_lets_other_calls_run_while_it_is_built(tmp_path: Path, core: Core) -> None:
    store = MemoryStore()
    for n in range(5000):
        await store.create(f"s{n:05}", b"{}")
    registry, d = build(Settings(state_dir=tmp_path, socket_path=None), core, store)
    await registry.load()
    turns = 0

    async def other_calls() -> None:
        nonlocal turns
        while True:
            await anyio.lowlevel.checkpoint()
            turns += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_calls)
        await anyio.lowlevel.checkpoint()
        before = turns
        reply = msgspec.json.decode(await d.answer(PEER, b'{"jsonrpc":"2.0","id":1,"method":"session/list"}'))
        during = turns - before
        tg.cancel_scope.cancel()
    registry.close_all()
    assert (len(reply["result"]["sessions"]), during >= 4) == (5000, True)


def test_a_handler_for_a_method_not_in_the_table_is_refused_even_under_python_o() -> None:
    code = "from devd.server import methods; methods.method('session/nope')"
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert done.stderr.splitlines()[-1] == (
        "RuntimeError: 'session/nope' is not in devd.protocol.METHODS: add it there first"
    )


async def test_a_cancel_that_fails_leaves_nothing_kept_of_who_stepped_it(dispatcher: Dispatcher) -> None:
    step = b'{"jsonrpc":"2.0","id":1,"method":"session/step","params":{"session":"ghost%d","event":%s}}'
    for n in range(3):  # no such sessions: each answered HANDLE, none may leave an entry behind
        await dispatcher.answer(PEER, step % (n, b'{"Cancel":{"turn":1}}'))
    port = dispatcher.app.sessions
    assert isinstance(port, AgentPort) and port.runtime.statistics().sessions == 0
