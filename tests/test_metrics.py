"""devd.server.metrics and devd.server.scrape: daemon/status in the exact Prometheus text format; one HTTP exchange
as bytes in and bytes out, with no socket; the listener's bounds in process (a head that never arrives whole, a flood
of connections); and `devd serve --metrics` against the real daemon, scraped with urllib, beside its JSON-RPC
socket."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from anyio.abc import ByteStream
from structlog.testing import capture_logs

from devd import cli
from devd.addresses import TcpListen
from devd.config import Settings
from devd.messages import answer, turn
from devd.server import scrape as listener
from devd.server.metrics import prometheus
from devd.server.scrape import CONTENT_TYPE
from tests.daemon import Daemon, free_port
from tests.helpers import STATUS

# -- the text format -------------------------------------------------------------------------------------------------

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
# HELP devd_store_reopened_total Times the store reopened its database after a write fault (a failed write or fsync) and served again.
# TYPE devd_store_reopened_total counter
devd_store_reopened_total 12
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
    assert prometheus(STATUS) == PROMETHEUS


def test_every_prometheus_metric_has_help_and_type_and_counters_end_in_total() -> None:
    lines = prometheus(STATUS).splitlines()
    helped = [line.split()[2] for line in lines if line.startswith("# HELP ")]
    typed = {line.split()[2]: line.split()[3] for line in lines if line.startswith("# TYPE ")}
    sampled = {re.split(r"[{ ]", line)[0] for line in lines if not line.startswith("#")}
    assert (helped == list(typed), sampled == set(typed)) == (True, True)
    assert [name for name, kind in typed.items() if (kind == "counter") != name.endswith("_total")] == []


# -- one exchange, bytes in and bytes out ----------------------------------------------------------------------------

HEAD_MAX = 8192


def respond(head: bytes, exposition: Callable[[], str] = lambda: "") -> bytes | None:
    return listener.Scrape(HEAD_MAX, exposition).receive(head)


def status_line(head: bytes) -> bytes:
    reply = respond(head, lambda: "devd_steps_total 2\n")
    assert reply is not None
    return reply.split(b"\r\n", 1)[0]


def test_get_metrics_is_answered_with_the_exposition_its_content_type_and_connection_close() -> None:
    reply = respond(b"GET /metrics HTTP/1.1\r\nHost: devd\r\n\r\n", lambda: "devd_steps_total 2\n")
    assert reply == (
        b"HTTP/1.1 200 OK\r\n"
        b"Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        b"Content-Length: 19\r\n"
        b"Connection: close\r\n"
        b"\r\n"
        b"devd_steps_total 2\n"
    )


def test_a_head_still_coming_within_the_bound_is_not_answered_yet() -> None:
    assert respond(b"GET /metrics HTTP/1.1\r\nHost: de") is None


def test_other_paths_methods_and_request_lines_get_their_status_and_a_query_is_ignored() -> None:
    heads = [  # an HTTP/1.1 request names its Host (h11 holds to RFC 9112: one without is 400, tested below)
        b"GET /metrics?name[]=devd_steps_total HTTP/1.1\r\nHost: devd\r\n\r\n",
        b"GET /metrics HTTP/1.0\n\n",
        b"GET / HTTP/1.1\r\nHost: devd\r\n\r\n",
        b"GET /metrics/ HTTP/1.1\r\nHost: devd\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nHost: devd\r\nContent-Length: 2\r\n\r\n",
        b"HEAD /metrics HTTP/1.1\r\nHost: devd\r\n\r\n",
        b"GET /metrics HTTP/2.0\r\nHost: devd\r\n\r\n",
        b"GET /metrics\r\n\r\n",
        b'{"jsonrpc":"2.0","id":1,"method":"daemon/status"}\n\n',
    ]
    assert [status_line(head) for head in heads] == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 405 Method Not Allowed",
        b"HTTP/1.1 405 Method Not Allowed",
        b"HTTP/1.1 400 Bad Request",
        b"HTTP/1.1 400 Bad Request",
        b"HTTP/1.1 400 Bad Request",
    ]


METHOD_NOT_ALLOWED_HEAD = (
    b"HTTP/1.1 405 Method Not Allowed\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 26\r\n"
    b"Connection: close\r\n"
    b"Allow: GET\r\n"
    b"\r\n"
)


def test_a_405_says_which_method_is_allowed() -> None:
    assert respond(b"DELETE /metrics HTTP/1.1\r\nHost: devd\r\n\r\n") == (
        METHOD_NOT_ALLOWED_HEAD + b"/metrics answers GET only\n"
    )


def test_a_head_past_the_bound_is_answered_431_whether_it_ended_or_not() -> None:
    long_header = b"GET /metrics HTTP/1.1\r\nHost: devd\r\nX-Filler: " + b"a" * HEAD_MAX
    assert [status_line(long_header), status_line(long_header + b"\r\n\r\n")] == [
        b"HTTP/1.1 431 Request Header Fields Too Large",
        b"HTTP/1.1 431 Request Header Fields Too Large",
    ]


def test_only_a_get_of_metrics_renders_them() -> None:
    def render() -> str:
        raise AssertionError("rendered")

    heads = [
        b"GET / HTTP/1.1\r\nHost: devd\r\n\r\n",
        b"POST /metrics HTTP/1.1\r\nHost: devd\r\n\r\n",
        b"GET /metrics HTTP/9\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n\r\n",
    ]
    assert [respond(head, render) is not None for head in heads] == [True, True, True, True]


def test_an_http_1_1_request_without_host_is_answered_400_saying_so() -> None:
    reply = respond(b"GET /metrics HTTP/1.1\r\n\r\n")
    assert reply is not None
    assert (reply.split(b"\r\n", 1)[0], reply.rsplit(b"\r\n", 1)[-1]) == (
        b"HTTP/1.1 400 Bad Request",
        b"not an HTTP/1.x request: Missing mandatory Host: header\n",
    )


def test_a_response_to_head_has_no_body() -> None:
    assert respond(b"HEAD /metrics HTTP/1.1\r\nHost: devd\r\n\r\n") == METHOD_NOT_ALLOWED_HEAD


def test_a_head_that_ended_within_the_bound_is_answered_whatever_body_follows() -> None:
    head = b"POST /metrics HTTP/1.1\r\nHost: devd\r\nContent-Length: 9000\r\n\r\n"
    assert status_line(head + b"b" * 9000) == b"HTTP/1.1 405 Method Not Allowed"


# -- the listener, in process ----------------------------------------------------------------------------------------


def test_loopback_is_told_by_address_and_by_the_name_localhost_alone() -> None:
    hosts = ["127.0.0.1", "127.8.9.10", "::1", "localhost", "0.0.0.0", "::", "192.168.1.2", "devd.internal"]
    assert [TcpListen(host, 9464).loopback for host in hosts] == [True, True, True, True, False, False, False, False]


def test_an_address_other_than_loopback_is_bound_with_a_warning_and_loopback_without() -> None:
    with capture_logs() as logs:
        for host in ("127.0.0.1", "0.0.0.0"):
            listener.bind(TcpListen(host, 0)).close()
    assert [(e["event"], e["address"].rsplit(":", 1)[0]) for e in logs] == [("metrics.exposed", "0.0.0.0")]


async def received(stream: ByteStream) -> bytes:
    """Everything the listener sends on the stream, up to its end."""
    data = b""
    while True:
        try:
            data += await stream.receive()
        except anyio.EndOfStream:
            return data


async def test_a_head_that_does_not_arrive_in_time_is_answered_408_and_closed(tmp_path: Path) -> None:
    settings = Settings(tmp_path, None, metrics_timeout_s=0.2)
    sock = listener.bind(TcpListen("127.0.0.1", 0))
    async with anyio.create_task_group() as tg:
        await tg.start(listener.serve, sock, lambda: "", settings)
        async with await anyio.connect_tcp(*sock.getsockname()[:2]) as stream:
            await stream.send(b"GET /metr")
            with anyio.fail_after(10):
                reply = await received(stream)
        tg.cancel_scope.cancel()
    assert reply.split(b"\r\n", 1)[0] == b"HTTP/1.1 408 Request Timeout"


async def test_past_the_connection_bound_a_new_connection_is_closed_and_the_open_ones_still_answered(
    tmp_path: Path,
) -> None:
    settings = Settings(tmp_path, None, metrics_connections_max=1)
    sock = listener.bind(TcpListen("127.0.0.1", 0))
    address = sock.getsockname()[:2]
    async with anyio.create_task_group() as tg:
        await tg.start(listener.serve, sock, lambda: "m 1\n", settings)
        async with await anyio.connect_tcp(*address) as first:
            await anyio.sleep(0.1)  # accepted before the second comes
            async with await anyio.connect_tcp(*address) as second:
                with anyio.fail_after(10):
                    refused = await received(second)
            await first.send(b"GET /metrics HTTP/1.1\r\nHost: devd\r\n\r\n")
            with anyio.fail_after(10):
                served = await received(first)
        tg.cancel_scope.cancel()
    assert (refused, served.rsplit(b"\r\n", 1)[-1]) == (b"", b"m 1\n")


async def test_scrapes_within_the_interval_share_one_rendering(tmp_path: Path) -> None:
    """Anyone who reaches the port may scrape (there is no token): however many do, the daemon renders once a
    second, so scrapers cannot make it walk its sessions on the event loop more often than that."""
    settings = Settings(tmp_path, None, metrics_interval_s=60.0)
    sock = listener.bind(TcpListen("127.0.0.1", 0))
    renders = []

    def render() -> str:
        renders.append(1)
        return f"m {len(renders)}\n"

    async with anyio.create_task_group() as tg:
        await tg.start(listener.serve, sock, render, settings)
        bodies = set()
        for _ in range(16):
            async with await anyio.connect_tcp(*sock.getsockname()[:2]) as stream:
                await stream.send(b"GET /metrics HTTP/1.1\r\nHost: devd\r\n\r\n")
                with anyio.fail_after(10):
                    bodies.add((await received(stream)).rsplit(b"\r\n", 1)[-1])
        tg.cancel_scope.cancel()
    assert (len(renders), bodies) == (1, {b"m 1\n"})


# -- devd serve --metrics --------------------------------------------------------------------------------------------


def scrape(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, str, str, str]:
    """Status, reason, content type and body of one request to the listener, without any proxy of the environment."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, response.reason, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.reason, e.headers["Content-Type"], e.read().decode()


def test_devd_serve_metrics_answers_get_metrics_with_the_daemons_counters(tmp_path: Path) -> None:
    port = free_port()
    with Daemon(tmp_path, "--metrics", f"tcp://127.0.0.1:{port}") as d, d.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "x"))
        c.step("s", answer(1, "done"))
        status, reason, content_type, body = scrape(port)
    samples = dict(line.rsplit(" ", 1) for line in body.splitlines() if not line.startswith("#"))
    assert (status, reason, content_type, samples["devd_steps_total"]) == (200, "OK", CONTENT_TYPE, "2")


def test_devd_serve_metrics_and_devd_status_prometheus_give_the_same_metrics(tmp_path: Path) -> None:
    port = free_port()
    with Daemon(tmp_path, "--metrics", f"tcp://127.0.0.1:{port}") as d:
        served = scrape(port)[3]
        printed = subprocess.run(
            [sys.executable, "-m", "devd", "status", "--prometheus", "--connect", str(d.socket)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    def described(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#")]

    assert described(served) == described(printed)


def test_devd_serve_metrics_answers_other_paths_404_and_other_methods_405(tmp_path: Path) -> None:
    port = free_port()
    with Daemon(tmp_path, "--metrics", f"tcp://127.0.0.1:{port}"):
        answers = [scrape(port, "/")[:2], scrape(port, "/metrics", "POST")[:2]]
    assert answers == [(404, "Not Found"), (405, "Method Not Allowed")]


def test_idle_scrapers_past_the_bound_do_not_hold_up_the_json_rpc_socket(tmp_path: Path) -> None:
    port = free_port()
    with Daemon(tmp_path, "--metrics", f"tcp://127.0.0.1:{port}") as d, d.client() as c:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        try:
            started = time.monotonic()
            steps = c.status().steps
            answered_in_s = time.monotonic() - started
        finally:
            for s in idle:
                s.close()
    assert (steps, answered_in_s < 2.0) == (0, True)


def test_a_metrics_flag_that_is_not_a_tcp_address_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(["serve", "--metrics", "localhost:9464"], {})
    said = capsys.readouterr().err.splitlines()[-1]
    assert (exit.value.code, said) == (
        2,
        "devd serve: error: argument --metrics: --metrics takes tcp://HOST:PORT (e.g. tcp://127.0.0.1:9464), not "
        "'localhost:9464'",
    )


def test_a_daemon_without_metrics_does_not_load_h11() -> None:
    code = "import sys, devd.cli, devd.cli.serve, devd.server.daemon; print('h11' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False\n"
