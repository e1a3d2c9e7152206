"""What every connection of a daemon shares, whatever its wire protocol: the connections (counted, and refused past
their limits), the shared outbox bound (`devd.server.flow.Outboxes`), and the tasks of every call in flight.

What it promises:
- past `connections_max`, counted for Unix and TCP apart, a new connection is refused; so is a TCP one while
  `unauthenticated_connections_max` TCP peers have yet to present the token, so no TCP peer can lock the Unix
  socket out; every one while the daemon is shutting down;
- every call started runs to its end and `drain` waits for it; a call that fails is logged, and no more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec
import structlog

from devd.addresses import TcpListen, UnixListen
from devd.config import Settings
from devd.server.dispatch import Dispatcher
from devd.server.flow import Outboxes

log = structlog.get_logger("devd.server.hub")


class Member(Protocol):
    """A connection as the hub counts it."""

    @property
    def served(self) -> UnixListen | TcpListen: ...

    @property
    def authenticated(self) -> bool: ...


class Hub(msgspec.Struct):
    """A call's task is a bare asyncio task, held here until it ends and waited for by `drain`: it is a task group
    without per-task cancel scopes. anyio's `start_soon` cost three times what the rest of a request does (measured
    with py-spy on `python -m benchmarks.bench _echo`), and a call is never cancelled anyway (see
    `devd.server.dispatch`).
    """

    settings: Settings
    dispatcher: Dispatcher
    token: str | None
    connections: set[Member] = msgspec.field(default_factory=set)
    outboxes: Outboxes = msgspec.field(default_factory=Outboxes)
    tasks: set[asyncio.Task[None]] = msgspec.field(default_factory=set)
    # The loop the calls run on, found once: on Python 3.11 each `asyncio.get_running_loop()` is a getpid system
    # call (its check against a fork), and a call's start is the step path.
    loop: asyncio.AbstractEventLoop | None = None

    def refusal(self, served: UnixListen | TcpListen) -> str | None:
        """Why a new connection to `served` is refused, or None."""
        s = self.settings
        if self.dispatcher.draining:
            return "the daemon is shutting down"
        kind = served.kind
        same = [c for c in self.connections if c.served.kind == kind]
        if len(same) >= s.connections_max:
            return f"it serves {s.connections_max} {kind} connections, its limit"
        if served.needs_token and sum(1 for c in same if not c.authenticated) >= s.unauthenticated_connections_max:
            return f"{s.unauthenticated_connections_max} TCP connections have yet to present the token"
        return None

    def start(self, call: Coroutine[Any, Any, None]) -> None:
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        task = loop.create_task(call)
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
