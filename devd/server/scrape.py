"""The small HTTP listener of `devd serve --metrics tcp://HOST:PORT`, which serves `devd.server.metrics`' text.

What it promises:
- the listener answers `GET /metrics` (200), another path (404), another method on `/metrics` (405), a request
  that is not HTTP/1.x as h11 reads it (400: an HTTP/1.1 one without Host included), a head longer than
  `metrics_head_bytes_max` (431), and one that is not whole within `metrics_timeout_s` (408); each connection is
  closed after its one answer;
- it is bounded and kept apart from the JSON-RPC listeners: at most `metrics_connections_max` connections, each
  aborted `metrics_timeout_s` after it was accepted whatever it is doing, answered from asyncio's callbacks (no
  task, nothing queued), and what happens in one is logged and goes no further;
- the text is rendered at most once per `metrics_interval_s` (1 s), whoever scrapes and however often;
- an address that is not loopback is served, since it was given explicitly, and logged as `metrics.exposed`.

The request handling is `Scrape`, bytes in and its response out, on h11 (a well-kept sans-I/O HTTP/1.1 parser);
`Exchange` is the I/O around it. A daemon imports this module only when it serves metrics: h11 costs a start
tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import cast

import anyio
import h11
import structlog
from anyio.abc import TaskStatus

from devd.addresses import TcpListen
from devd.config import Settings
from devd.server.listeners import listen_tcp

log = structlog.get_logger("devd.server.scrape")

PATH = b"/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text exposition format, as Prometheus asks for it


# -- one HTTP exchange, without I/O ----------------------------------------------------------------------------------


class Scrape:
    """One connection's HTTP/1.1, without I/O: bytes in, its one response out. h11 parses the request and frames the
    response; what is answered is decided here. The head is read whole before answering (a client cut off mid-send
    may not see the answer); a body is never read. `exposition` is called only for `GET /metrics`."""

    def __init__(self, head_bytes_max: int, exposition: Callable[[], str]) -> None:
        # h11 refuses an unfinished head past the bound (431); a finished one is measured in `_answer`.
        self._http = h11.Connection(h11.SERVER, max_incomplete_event_size=head_bytes_max)
        self._head_bytes_max = head_bytes_max
        self._exposition = exposition
        self._received = 0
        self._head_only = False  # a HEAD request: its response has no body

    def receive(self, data: bytes) -> bytes | None:
        """None while the head is still coming and within the bound, else the one response the connection gets."""
        self._received += len(data)
        self._http.receive_data(data)
        try:
            event = self._http.next_event()
        except h11.RemoteProtocolError as e:
            if e.error_status_hint == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
                return self._too_large()
            return self._respond(HTTPStatus(e.error_status_hint), f"not an HTTP/1.x request: {e}\n")
        if event is h11.NEED_DATA:
            return None
        assert isinstance(event, h11.Request)  # the first event of a server's connection, short of an error
        return self._answer(event)

    def timed_out(self) -> bytes:
        """The response to a connection whose request did not arrive whole in time."""
        return self._respond(HTTPStatus.REQUEST_TIMEOUT, "the request did not arrive in time\n")

    def failed(self) -> bytes | None:
        """The response when answering failed, or None when the response has already begun."""
        if self._http.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return None
        return self._respond(HTTPStatus.INTERNAL_SERVER_ERROR, "the daemon failed to render its metrics; see its log\n")

    def _answer(self, request: h11.Request) -> bytes:
        self._head_only = request.method == b"HEAD"
        if self._received - len(self._http.trailing_data[0]) > self._head_bytes_max:
            return self._too_large()
        if request.http_version not in (b"1.0", b"1.1"):
            return self._respond(HTTPStatus.BAD_REQUEST, "not an HTTP/1.x request line\n")
        if request.target.split(b"?", 1)[0] != PATH:
            return self._respond(HTTPStatus.NOT_FOUND, "devd serves GET /metrics only\n")
        if request.method != b"GET":
            return self._respond(HTTPStatus.METHOD_NOT_ALLOWED, "/metrics answers GET only\n", ("Allow", "GET"))
        return self._respond(HTTPStatus.OK, self._exposition(), content_type=CONTENT_TYPE)

    def _too_large(self) -> bytes:
        return self._respond(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"a request's head is {self._head_bytes_max} bytes at most\n"
        )

    def _respond(
        self, status: HTTPStatus, body: str, *headers: tuple[str, str], content_type: str = "text/plain; charset=utf-8"
    ) -> bytes:
        """A whole response that tells the client the connection closes after it."""
        data = body.encode()
        head = [("Content-Type", content_type), ("Content-Length", str(len(data))), ("Connection", "close"), *headers]
        events: list[h11.Event] = [h11.Response(status_code=status.value, reason=status.phrase, headers=head)]
        if data and not self._head_only:
            events.append(h11.Data(data=data))
        events.append(h11.EndOfMessage())
        return b"".join(self._http.send(event) or b"" for event in events)


# -- the listener ----------------------------------------------------------------------------------------------------


def bind(where: TcpListen) -> socket.socket:
    """The metrics listener's socket, bound where it was told: an address other than loopback is served (it was
    given explicitly), with a warning, since anyone who reaches it reads the counters."""
    if not where.loopback:
        log.warning(
            "metrics.exposed",
            address=f"{where.host}:{where.port}",
            note="anyone who reaches this address reads the daemon's counters; listen on loopback unless that is meant",
        )
    return listen_tcp(where.host, where.port, backlog=64)


class Exchange(asyncio.Protocol):
    """One connection: its head read (bounded, timed), answered once, then closed once the client has its answer."""

    def __init__(self, settings: Settings, exposition: Callable[[], str], exchanges: set[Exchange]) -> None:
        self.settings = settings
        self.exchanges = exchanges
        self.scrape = Scrape(settings.metrics_head_bytes_max, exposition)
        self.answered = False
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        if len(self.exchanges) >= self.settings.metrics_connections_max:
            self.transport.abort()  # a flood of scrapes must not take the descriptors the JSON-RPC listeners need
            return
        self.exchanges.add(self)
        # A bound on the connection's whole life, not only its reading: it also ends one that never takes its answer.
        self.timer = asyncio.get_running_loop().call_later(self.settings.metrics_timeout_s, self._timed_out)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # a body, or more requests: read and dropped until the client closes (see _send)
        try:
            reply = self.scrape.receive(data)
        except Exception as e:  # the connection's boundary: whatever failed, this scrape alone fails
            log.error("metrics.failed", error=f"{type(e).__name__}: {e}"[:500])
            reply = self.scrape.failed()
            if reply is None:
                assert self.transport is not None
                self.transport.abort()
                return
        if reply is not None:
            self._send(reply)

    def eof_received(self) -> bool:
        return False  # the client is done (or gave up): close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.exchanges.discard(self)
        if self.timer is not None:
            self.timer.cancel()

    def _send(self, reply: bytes) -> None:
        """Send the answer and end our side; keep reading (and dropping) until the client closes, since closing with
        its bytes unread would reset the connection, and the answer with it."""
        assert self.transport is not None
        self.answered = True
        self.transport.write(reply)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()

    def _timed_out(self) -> None:
        """Time is up: say so if the request never came whole, and cut the connection off. Abort drops only what
        asyncio still holds, which a client too slow to take a few hundred bytes has not earned."""
        assert self.transport is not None
        if not self.answered:
            self.transport.write(self.scrape.timed_out())
        self.transport.abort()


class OncePer:
    """A rendering made at most once per interval: every scrape within it is answered the same text, so scrapers
    (anyone who can reach the port: there is no token) cannot make the daemon render more often than that."""

    def __init__(self, render: Callable[[], str], interval_s: float) -> None:
        self._render = render
        self._interval_s = interval_s
        self._text = ""
        self._at = float("-inf")
        self.renders = 0

    def __call__(self) -> str:
        now = time.monotonic()
        if now - self._at >= self._interval_s:
            self._text, self._at = self._render(), now
            self.renders += 1
        return self._text


async def serve(
    sock: socket.socket,
    exposition: Callable[[], str],
    settings: Settings,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `GET /metrics` on sock until cancelled (it is started with the task group's `start`, so it accepts
    before the daemon says it is ready); then stop accepting and cut off the connections still open."""
    exchanges: set[Exchange] = set()
    exposition = OncePer(exposition, settings.metrics_interval_s)
    loop = asyncio.get_running_loop()
    # asyncio's accept loop backs off when out of descriptors instead of failing, as the JSON-RPC listeners' does.
    server = await loop.create_server(lambda: Exchange(settings, exposition, exchanges), sock=sock, backlog=64)
    try:
        task_status.started()
        await anyio.sleep_forever()
    finally:
        server.close()
        for exchange in list(exchanges):
            if exchange.transport is not None:
                exchange.transport.abort()
