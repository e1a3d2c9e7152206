"""The NDJSON wire protocol's connection, on asyncio's protocol layer: bytes into `Rules`, requests to the
dispatcher, answers out through its `Flow`.

The request path is the daemon's hot path, so it is written on `asyncio.Protocol` (uvloop's when present) rather
than on stream objects: bytes arrive by callback, answers are written straight to the transport, and each request
costs one task (see `devd.server.hub.Hub`) and nothing else. Everything above this module is anyio.

What is not NDJSON's is not here, so that another wire protocol is one module beside this one: whom a listener lets
in (`devd.server.listeners`), the HTTP sniff, the token and the deadlines (`devd.server.admission`), the in-flight
cap, back-pressure and the send timer (`devd.server.flow`), the connection limits and the calls' tasks (`Hub`).

What it promises:
- requests on one connection run concurrently, as `devd.server.flow` bounds them;
- a call runs to its end even if its client goes (stopping it between the core and the journal would leave the two
  apart); at the peer's EOF, or when a rule closes the connection, what it asked before is still answered, then
  the connection closes;
- a watcher is dropped rather than queue a notice past the outbox bounds (`Flow.offer`), and its subscriptions end
  with the connection.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import cast

import structlog

from devd.addresses import TcpListen, UnixListen
from devd.errors import FullError
from devd.server.connection import Close, Line, Rules, Send
from devd.server.flow import Flow
from devd.server.hub import Hub
from devd.server.listeners import accepted, origin
from devd.server.methods import Peer
from devd.server.rpc import error_response

log = structlog.get_logger("devd.server.ndjson")


class Connection(asyncio.Protocol):
    def __init__(self, hub: Hub, served: UnixListen | TcpListen) -> None:
        self.hub = hub
        self.served = served
        self.settings = hub.settings
        self.flow: Flow | None = None  # once admitted
        self.rules: Rules | None = None
        self.peer = Peer(served.kind, self)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_at = float("inf")

    # -- asyncio's callbacks ----------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        sock: socket.socket = transport.get_extra_info("socket")
        hub, served = self.hub, self.served
        uid = accepted(served, sock)
        if uid is not None:
            log.warning("connection.refused", reason="peer of another uid", uid=uid)
            transport.abort()
            return
        reason = hub.refusal(served)
        if reason is not None:
            transport.write(error_response(None, FullError(f"connection refused: {reason}; try again later")))
            transport.close()
            return
        self.peer.origin = origin(sock)
        hub.connections.add(self)
        self.flow = Flow(transport, self.settings, hub.outboxes)
        self.rules = Rules(self.settings, authenticated=not served.needs_token, token=hub.token, now=time.monotonic())
        self._arm()

    def data_received(self, data: bytes) -> None:
        rules, flow = self.rules, self.flow
        if rules is None or flow is None or flow.closing:
            return
        for event in rules.receive(data, time.monotonic()):
            if isinstance(event, Line):
                flow.started()
                self.hub.start(self._call(event.data))
            elif isinstance(event, Send):
                flow.write(event.data)
            else:
                self._refuse(event)
                return
        self._arm()

    def eof_received(self) -> bool:
        self._close_when_answered()
        return True  # keep our side open: answers to what was asked before the EOF are still owed

    def connection_lost(self, exc: Exception | None) -> None:
        if self.flow is None:
            return  # turned away in connection_made: never counted, nothing to end
        self.flow.connection_lost()
        if self._deadline is not None:
            self._deadline.cancel()
        self.hub.connections.discard(self)
        self._unwatch_all()

    def pause_writing(self) -> None:
        assert self.flow is not None
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        assert self.flow is not None
        self.flow.resume_writing()

    # -- requests ---------------------------------------------------------------------------------------------------

    async def _call(self, line: bytes) -> None:
        flow = self.flow
        assert flow is not None
        try:
            await self.hub.dispatcher.serve(self.peer, line, self._send)
        finally:
            flow.ended()

    async def _send(self, data: bytes) -> None:
        assert self.flow is not None
        self.flow.write(data)

    # -- the Sink a watcher writes to ---------------------------------------------------------------------------------

    def offer(self, data: bytes) -> bool:
        assert self.flow is not None
        return self.flow.offer(data)

    def force(self, data: bytes) -> None:
        assert self.flow is not None
        self.flow.write(data)

    @property
    def authenticated(self) -> bool:
        return self.rules is not None and self.rules.authenticated

    # -- closing ----------------------------------------------------------------------------------------------------

    def _refuse(self, event: Close) -> None:
        log.warning("connection.refused", reason=event.reason)
        if event.data:
            assert self.flow is not None
            self.flow.write(event.data)
        self._close_when_answered()

    def _close_when_answered(self) -> None:
        flow = self.flow
        if flow is None or flow.closing:
            return
        self._unwatch_all()
        if self._deadline is not None:
            self._deadline.cancel()
        flow.close_when_answered()

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
        if self.flow is None or self.flow.closing or self.rules is None or self.rules.deadline() != deadline:
            return
        log.warning("connection.dropped", reason=self.rules.timed_out().reason)
        self._close_when_answered()

    def _unwatch_all(self) -> None:
        self.peer.closed = True
        sessions = self.hub.dispatcher.app.sessions
        for sub in self.peer.watches.values():
            sessions.unwatch(sub)
        self.peer.watches.clear()
