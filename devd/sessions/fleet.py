"""A fleet's side of the sessions: adopting one made or held elsewhere, holding one before its state is read,
forgetting one another daemon took over (its watchers told where it went), and draining.

What it promises: in a fleet, what this daemon reads of a session is its own (it holds the session first), and a
session another live daemon holds answers MOVED, naming it, and is forgotten here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from devd.errors import ExistsError, HandleError, MovedError
from devd.sessions.entry import FROM_HEALTH, Entry, no_such
from devd.sessions.state import Input
from devd.storage.store import Fleet

if TYPE_CHECKING:
    from devd.sessions.registry import Registry

log = structlog.get_logger("devd.sessions.registry")


class FleetSessions:
    def __init__(self, registry: Registry, fleet: Fleet | None) -> None:
        self.registry = registry
        self.fleet = fleet

    async def adopt(self, name: str) -> None:
        """Take a session of the fleet for this daemon: MovedError if another live daemon holds it."""
        assert self.fleet is not None
        epoch = await self.fleet.acquire(name)
        stored = await self.registry.store.load(name) if epoch is not None else None
        if stored is None:
            raise no_such(name)
        if self.registry.get(name) is not None:
            return  # adopted meanwhile, by another call
        now = time.time()
        self.registry.add(
            Entry(name, FROM_HEALTH[stored.health], stored.seq, stored.reason, created=now, last_used=now)
        )
        log.info("session.adopted", session=name, epoch=epoch, seq=stored.seq)

    async def acquire(self, entry: Entry) -> None:
        """In a fleet, hold the session before reading its state; MovedError (and it is forgotten here) when another
        live daemon holds it."""
        if self.fleet is None or self.fleet.held(entry.name) is not None:
            return
        try:
            await self.fleet.acquire(entry.name)
        except MovedError as e:
            self.moved(entry, e)
            raise

    async def refuse_if_in_fleet(self, name: str | None) -> None:
        """A new session may not take the name of one that lives elsewhere in the fleet."""
        if self.fleet is None or name is None or self.registry.get(name) is not None:
            return
        try:
            await self.adopt(name)
        except HandleError:
            return  # no such session: the name is free
        except MovedError:
            pass
        raise ExistsError(f"a session named {name!r} exists in the fleet; choose another name or close it first")

    def moved(self, entry: Entry, error: MovedError) -> None:
        """Another daemon holds the session now: forget it here, and tell its watchers where it went."""
        log.info("session.moved", session=entry.name, node=error.node, address=error.address)
        self.registry.move(entry, Input.CLOSE)
        owner = (error.node, error.address or "") if error.node is not None else None
        self.registry.fanout.end(entry.name, "moved", owner)
        self.registry.forget(entry.name)

    async def drain(self) -> int:
        """Give every session this daemon holds and no call is inside back to the fleet (a call in flight keeps its
        session until it answers); how many were let go. Another daemon takes each at its next call, at once rather
        than after this one's lease."""
        assert self.fleet is not None
        idle = [e for e in self.registry.entries() if not e.busy]
        held = [e.name for e in idle if self.fleet.held(e.name) is not None]
        for entry in idle:
            self.moved(entry, MovedError("drained"))
        await self.fleet.release(held)
        log.info("fleet.drained", sessions=len(held))
        return len(held)
