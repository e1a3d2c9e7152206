"""The sessions' public face: what the method handlers call, and what an in-process component (the agent runtime)
calls too, as a second client of the sessions beside the wire. `Registry` is the one implementation."""

from __future__ import annotations

from typing import Protocol

from devd.sessions.entry import Answered, Info
from devd.sessions.watchers import Fanout, Sink, Subscription
from devd.storage.store import Fleet


class SessionPort(Protocol):
    fanout: Fanout  # who watches which session: a component that tells watchers more than steps sends through it
    fleet: Fleet | None  # the store shared with other daemons, when the sessions live in a fleet

    async def new(self, name: str | None, config: bytes) -> str: ...

    async def step(self, name: str, event: bytes, timeout_ms: int | None, key: str | None) -> Answered: ...

    async def pending(self, name: str) -> bytes: ...

    async def transcript(self, name: str, start: int) -> tuple[int, bytes]: ...

    async def snapshot(self, name: str) -> str: ...

    async def fork(self, source: str, at: int | None, name: str | None) -> str: ...

    async def close(self, name: str) -> None: ...

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription: ...

    def unwatch(self, sub: Subscription) -> None: ...

    def info(self, name: str) -> Info: ...

    def page(self, limit: int | None = None, after: str | None = None) -> tuple[list[Info], str | None]: ...
