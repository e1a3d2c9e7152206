"""One connection's I/O, on asyncio's protocol layer: bytes into `Rules`, requests to the dispatcher, answers out.

The request path is the daemon's hot path, so it is written on `asyncio.Protocol` (uvloop's when present) rather
than on stream objects: bytes arrive by callback, answers are written straight to the transport, and each request
costs one task (see `Hub`) and nothing else. Everything above this module is anyio.

What it promises:
- requests on one connection run concurrently, up to `requests_in_flight_max`; past that, the connection is not
  read until one answers;
- a client whose unsent bytes pass `outbox_bytes_soft` is not read from until it takes them, and is cut off if it
  takes nothing for `send_timeout_s`; a watcher is dropped rather than queue a notice past that bound, or past
  `outboxes_bytes_max` for every connection together (a notice of any size still goes to a connection with nothing
  queued);
- a call runs to its end even if its client goes (stopping it between the core and the journal would leave the two
  apart); at the peer's EOF, or when a rule closes the connection, what it asked before is still answered, then
  the connection closes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from devd.config import Settings
from devd.errors import FullError
from devd.server.connection import Close, Line, Rules, Send
from devd.server.dispatch import Dispatcher
from devd.server.listeners import peer_uid
from devd.server.methods import Peer
from devd.server.rpc import error_response

log = structlog.get_logger("devd.server.transport")


@dataclass
class Hub:
    """What every connection of a daemon shares, and the tasks of every call in flight.

    A call's task is a bare asyncio task, held here until it ends and waited for by `drain`: it is a task group
    without per-task cancel scopes. anyio's `start_soon` cost three times what the rest of a request does (measured
    with py-spy on `python -m benchmarks.bench _echo`), and a call is never cancelled anyway (see
    `devd.server.dispatch`).
    """

    settings: Settings
    dispatcher: Dispatcher
    token: str | None
    connections: set[Connection] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _unsent: int = 0
    _unsent_at: float = 0.0

    def unsent_bytes(self) -> int:
        """Bytes queued on every connection together: summed at most once a millisecond (it is O(connections)),
        and counted up by what is queued meanwhile."""
        now = time.monotonic()
        if now - self._unsent_at > 0.001:
            self._unsent = sum(c.unsent_bytes for c in self.connections)
            self._unsent_at = now
        return self._unsent

    def queued(self, n: int) -> None:
        self._unsent += n

    def refusal(self, kind: str) -> str | None:
        """Why a new connection of this kind is refused, or None. Unix and TCP are counted apart, and TCP peers that
        have not authenticated yet have a smaller budget of their own, so no TCP peer can lock the Unix socket out."""
        s = self.settings
        if self.dispatcher.draining:
            return "the daemon is shutting down"
        same = [c for c in self.connections if c.kind == kind]
        if len(same) >= s.connections_max:
            return f"it serves {s.connections_max} {kind} connections, its limit"
        if kind == "tcp" and sum(1 for c in same if not c.authenticated) >= s.unauthenticated_connections_max:
            return f"{s.unauthenticated_connections_max} TCP connections have yet to present the token"
        return None

    def start(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self.tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("call.failed", error=f"{type(e).__name__}: {e}"[:500])

    @property
    def running(self) -> list[asyncio.Task[None]]:
        """The calls not yet ended (an ended one leaves `tasks` a turn of the loop later)."""
        return [t for t in self.tasks if not t.done()]

    async def drain(self) -> None:
        """Return once every call has ended and its answer been handed to its connection."""
        while running := self.running:
            await asyncio.wait(running)


class Connection(asyncio.Protocol):
    def __init__(self, hub: Hub, kind: str) -> None:
        self.hub = hub
        self.kind = kind
        self.settings = hub.settings
        self.transport: asyncio.Transport | None = None
        self.rules: Rules | None = None
        self.peer = Peer(kind, self)
        self.in_flight = 0
        self.closing = False  # no more requests are read; close once every answer is written
        self.lost = False
        self._paused = {"in_flight": False, "writing": False}
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_at = float("inf")
        self._send_timer: asyncio.TimerHandle | None = None

    # -- asyncio's callbacks ----------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        sock: socket.socket = transport.get_extra_info("socket")
        transport = self.transport
        hub, settings = self.hub, self.settings
        if self.kind == "unix":
            uid = peer_uid(sock)
            if uid not in (os.getuid(), 0):  # root can read the state directory anyway
                log.warning("connection.refused", reason="peer of another uid", uid=uid)
                self.lost = True
                transport.abort()
                return
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reason = hub.refusal(self.kind)
        if reason is not None:
            transport.write(error_response(None, FullError(f"connection refused: {reason}; try again later")))
            self.lost = True
            transport.close()
            return
        hub.connections.add(self)
        # Past half the watcher bound, stop reading and start the send timer: a client that takes nothing for
        # send_timeout_s is cut off, a watch-only one included (its notices stop at the bound, but it stays paused).
        transport.set_write_buffer_limits(high=settings.outbox_bytes_soft // 2, low=settings.outbox_bytes_soft // 8)
        self.rules = Rules(settings, authenticated=self.kind == "unix", token=hub.token, now=time.monotonic())
        self._arm()

    def data_received(self, data: bytes) -> None:
        rules = self.rules
        if rules is None or self.closing:
            return
        for event in rules.receive(data, time.monotonic()):
            if isinstance(event, Line):
                self._start(event.data)
            elif isinstance(event, Send):
                self.write(event.data)
            else:
                self._refuse(event)
                return
        self._arm()

    def eof_received(self) -> bool:
        self._close_when_answered()
        return True  # keep our side open: answers to what was asked before the EOF are still owed

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.closing = True
        for timer in (self._deadline, self._send_timer):
            if timer is not None:
                timer.cancel()
        self.hub.connections.discard(self)
        self._unwatch_all()

    def pause_writing(self) -> None:
        self._pause("writing")
        self._send_timer = asyncio.get_running_loop().call_later(self.settings.send_timeout_s, self._too_slow)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self._resume("writing")

    # -- requests ---------------------------------------------------------------------------------------------------

    def _start(self, line: bytes) -> None:
        self.in_flight += 1
        if self.in_flight >= self.settings.requests_in_flight_max:
            self._pause("in_flight")
        self.hub.start(self._call(line))

    async def _call(self, line: bytes) -> None:
        try:
            await self.hub.dispatcher.serve(self.peer, line, self._send)
        finally:
            self.in_flight -= 1
            self._resume("in_flight")
            if self.closing and not self.in_flight and not self.lost:
                assert self.transport is not None
                self.transport.close()  # asyncio sends what is buffered first

    async def _send(self, data: bytes) -> None:
        self.write(data)

    # -- the Sink a watcher writes to ---------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.lost:
            assert self.transport is not None
            self.transport.write(data)

    def offer(self, data: bytes) -> bool:
        if self.lost:
            return True  # the subscription ends with the connection
        assert self.transport is not None
        queued = self.transport.get_write_buffer_size()
        if queued and (
            queued + len(data) > self.settings.outbox_bytes_soft
            or self.hub.unsent_bytes() + len(data) > self.settings.outboxes_bytes_max
        ):
            return False
        self.transport.write(data)
        self.hub.queued(len(data))
        return True

    def force(self, data: bytes) -> None:
        self.write(data)

    @property
    def authenticated(self) -> bool:
        return self.rules is not None and self.rules.authenticated

    @property
    def unsent_bytes(self) -> int:
        return 0 if self.lost or self.transport is None else self.transport.get_write_buffer_size()

    # -- closing ----------------------------------------------------------------------------------------------------

    def _refuse(self, event: Close) -> None:
        log.warning("connection.refused", reason=event.reason)
        if event.data:
            self.write(event.data)
        self._close_when_answered()

    def _close_when_answered(self) -> None:
        if self.closing:
            return
        self.closing = True
        self._unwatch_all()
        if self._deadline is not None:
            self._deadline.cancel()
        assert self.transport is not None
        if self.transport.is_reading():
            self.transport.pause_reading()
        if not self.in_flight:
            self.transport.close()

    def _too_slow(self) -> None:
        log.warning("connection.dropped", reason="the client stopped reading")
        assert self.transport is not None
        self.transport.abort()

    def _arm(self) -> None:
        """A timer for the rules' deadline (none while idle between lines: a timer per read would cost ~5%)."""
        assert self.rules is not None
        deadline = self.rules.deadline()
        if deadline == self._deadline_at:
            return
        self._deadline_at = deadline
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if deadline != float("inf"):
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_at(loop.time() + deadline - time.monotonic(), self._on_deadline, deadline)

    def _on_deadline(self, deadline: float) -> None:
        self._deadline = None
        if self.closing or self.rules is None or self.rules.deadline() != deadline:
            return
        log.warning("connection.dropped", reason=self.rules.timed_out().reason)
        self._close_when_answered()

    def _unwatch_all(self) -> None:
        self.peer.closed = True
        registry = self.hub.dispatcher.app.registry
        for sub in self.peer.watches.values():
            registry.unwatch(sub)
        self.peer.watches.clear()

    def _pause(self, why: str) -> None:
        if not self._paused[why] and not self.lost:
            self._paused[why] = True
            assert self.transport is not None
            if self.transport.is_reading():
                self.transport.pause_reading()

    def _resume(self, why: str) -> None:
        if self._paused[why]:
            self._paused[why] = False
            if not any(self._paused.values()) and not self.closing and not self.lost:
                assert self.transport is not None
                self.transport.resume_reading()
