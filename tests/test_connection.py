"""A connection's rules (devd.server.connection), pure: bytes and times in, Line/Send/Close out (no sockets)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from devd.config import Settings
from devd.server.connection import Close, Event, Line, Rules, Send

TOKEN = "sekrit"
SETTINGS = Settings(
    state_dir=Path("/nonexistent"),
    socket_path=None,
    line_bytes_max=256,
    auth_line_bytes_max=96,
    auth_timeout_s=5.0,
    line_timeout_s=30.0,
)
HELLO = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"token":"sekrit"}}'
LIST = b'{"jsonrpc":"2.0","id":2,"method":"session/list"}'
TOO_LARGE = (
    b'{"jsonrpc":"2.0","id":null,"error":{"code":-32009,"message":"the line is longer than 256 bytes; it was '
    b'discarded, send a shorter one","data":{"kind":"TOO_LARGE"}}}\n'
)


def unauthorized(id: bytes) -> Close:
    return Close(
        "unauthorized",
        b'{"jsonrpc":"2.0","id":' + id + b',"error":{"code":-32010,"message":"this connection must first call '
        b'initialize with the token from the daemon\'s state directory (file `token`)","data":{"kind":'
        b'"UNAUTHORIZED"}}}\n',
    )


def unix(now: float = 0.0) -> Rules:
    return Rules(SETTINGS, authenticated=True, token=None, now=now)


def tcp(now: float = 0.0) -> Rules:
    return Rules(SETTINGS, authenticated=False, token=TOKEN, now=now)


def feed(rules: Rules, *chunks: bytes, now: float = 0.0) -> list[Event]:
    return [event for chunk in chunks for event in rules.receive(chunk, now)]


# -- an authenticated (Unix) connection ------------------------------------------------------------------------------


def test_lines_split_across_chunks_come_out_whole() -> None:
    assert feed(unix(), b'{"a":', b'1}\n{"b"', b":2}\n") == [Line(b'{"a":1}'), Line(b'{"b":2}')]


def test_blank_lines_are_skipped() -> None:
    assert feed(unix(), b'\n  \n{"a":1}\n\r\n\t\n') == [Line(b'{"a":1}')]


def test_an_over_long_line_is_answered_too_large_once_and_the_next_line_survives() -> None:
    assert feed(unix(), b"x" * 200, b"x" * 200, b"x" * 200 + b'\n{"a":1}\n') == [Send(TOO_LARGE), Line(b'{"a":1}')]


def test_each_over_long_line_is_answered_once() -> None:
    assert feed(unix(), b"x" * 300 + b"\n" + b"y" * 300 + b'\n{"a":1}\n') == [
        Send(TOO_LARGE),
        Send(TOO_LARGE),
        Line(b'{"a":1}'),
    ]


@pytest.mark.parametrize("rules", [unix, tcp])
def test_an_http_request_as_the_first_bytes_closes_without_an_answer(rules: type[Rules]) -> None:
    assert feed(rules(), b"POST / HTTP/1.1\r\nHost: x\r\n\r\n" + LIST + b"\n") == [
        Close("an HTTP request on the JSON-RPC socket")
    ]


def test_nothing_more_comes_out_of_a_closed_connection() -> None:
    connection = unix()
    feed(connection, b"GET / HTTP/1.1\r\n")
    assert feed(connection, LIST + b"\n") == []


# -- TCP: the token first ----------------------------------------------------------------------------------------------


def test_tcp_initialize_with_the_token_is_the_first_line_and_authenticates() -> None:
    connection = tcp()
    assert (feed(connection, HELLO + b"\n" + LIST + b"\n"), connection.authenticated) == (
        [Line(HELLO), Line(LIST)],
        True,
    )


def test_tcp_a_wrong_token_closes_with_the_unauthorized_reply_under_the_request_id() -> None:
    line = b'{"jsonrpc":"2.0","id":"x7","method":"initialize","params":{"token":"guess"}}\n'
    assert feed(tcp(), line + LIST + b"\n") == [unauthorized(b'"x7"')]


def test_tcp_a_request_before_initialize_is_refused_under_its_id() -> None:
    assert feed(tcp(), LIST + b"\n") == [unauthorized(b"2")]


def test_tcp_a_notification_with_a_wrong_token_closes_with_no_bytes() -> None:
    line = b'{"jsonrpc":"2.0","method":"initialize","params":{"token":"guess"}}\n'
    assert feed(tcp(), line) == [Close("unauthorized")]


def test_tcp_a_line_that_is_not_a_request_closes_with_no_bytes() -> None:
    assert feed(tcp(), b"hello\n") == [Close("unauthorized")]


def test_tcp_an_over_long_line_before_initialize_closes() -> None:
    assert feed(tcp(), b"{" * 60, b"{" * 60) == [Close("an over-long line before initialize")]


def test_tcp_lines_after_initialize_may_be_as_long_as_any() -> None:
    long = b'{"jsonrpc":"2.0","id":3,"method":"x","params":{"pad":"' + b"x" * 150 + b'"}}'
    assert feed(tcp(), HELLO + b"\n", long + b"\n") == [Line(HELLO), Line(long)]


def test_tcp_a_long_line_in_the_same_chunk_as_initialize_is_read_under_the_longer_limit() -> None:
    long = b'{"jsonrpc":"2.0","id":3,"method":"x","params":{"pad":"' + b"x" * 150 + b'"}}'
    assert feed(tcp(), HELLO + b"\n" + long + b"\n") == [Line(HELLO), Line(long)]


# -- deadlines ---------------------------------------------------------------------------------------------------------


def test_an_unauthenticated_connection_has_one_deadline_whatever_arrives() -> None:
    connection = tcp(now=100.0)
    deadlines = [connection.deadline()]
    for now, chunk in ((101.0, b'{"jsonrpc":'), (103.0, b'"2.0",'), (104.5, b'"id":1,')):
        connection.receive(chunk, now)
        deadlines.append(connection.deadline())
    assert deadlines == [105.0, 105.0, 105.0, 105.0]


def test_an_idle_authenticated_connection_has_no_deadline() -> None:
    connection = unix(now=100.0)
    deadlines = [connection.deadline()]
    connection.receive(LIST + b"\n", 200.0)
    deadlines.append(connection.deadline())
    assert deadlines == [math.inf, math.inf]


def test_a_partial_line_must_end_within_the_line_timeout_of_its_first_byte() -> None:
    connection = unix()
    deadlines = []
    for now, chunk in ((10.0, b'{"a":'), (20.0, b"1"), (25.0, b'}\n{"b"'), (26.0, b":2}\n")):
        connection.receive(chunk, now)
        deadlines.append(connection.deadline())
    assert deadlines == [40.0, 40.0, 55.0, math.inf]


def test_after_authenticating_a_partial_line_has_the_line_timeout() -> None:
    connection = tcp(now=0.0)
    connection.receive(HELLO + b'\n{"a":', 2.0)
    assert connection.deadline() == 32.0


def test_a_timed_out_connection_closes_saying_why() -> None:
    assert (tcp().timed_out(), unix().timed_out()) == (
        Close("unauthenticated too long"),
        Close("a line did not arrive whole in time"),
    )
