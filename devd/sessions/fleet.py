"""A fleet's side of the sessions: adopting one made or held elsewhere, holding one before its state is read,
forgetting one another daemon took over (its watchers told where it went), and draining.

What it promises: in a fleet, what this daemon reads of a session is its own (it holds the session first), and a
session another live daemon holds answers MOVED, naming it, and is forgotten here.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import structlog

from devd.errors import DevdError, ExistsError, HandleError, MovedError
from devd.sessions.entry import FROM_HEALTH, Entry, no_such
from devd.sessions.state import Input
from devd.storage.store import Fleet

if TYPE_CHECKING:
    from devd.sessions.registry import Registry

log = structlog.get_logger("devd.sessions.fleet")


class FleetSessions:
    def __init__(self, registry: Registry, fleet: Fleet | None) -> None:
        self.registry = registry
        self.fleet = fleet

    async def hold(self, name: str) -> None:
        """Before a call uses what this daemon keeps of a session: adopt one it does not know (made or held
        elsewhere); take again one whose epoch here is not known current (never taken here, or taken before this
        daemon's lease lapsed, when another daemon may have stepped it), starting from what is durable, and end its
        watchers if steps were made elsewhere meanwhile. MovedError (and it is forgotten) when another live daemon
        holds it."""
        assert self.fleet is not None
        registry = self.registry
        entry = registry.get(name)
        if entry is None:
            await self.adopt(name)
            return
        if entry.busy or self.fleet.current(name):
            return  # busy: the call inside holds it (and entering answers BUSY)
        try:
            with registry.held(entry):
                epoch = await self.fleet.acquire(name)
                stored = await registry.store.load(name) if epoch is not None else None
        except MovedError as e:
            self.moved(entry, e)
            raise
        if stored is None:  # closed elsewhere
            registry.move(entry, Input.CLOSE)
            registry.fanout.end(name, "closed")
            registry.forget(name)
            raise no_such(name)
        registry.retaken(entry, stored.health, stored.reason)
        if stored.seq != entry.seq:
            registry.fanout.end(name, "moved")  # they missed the steps made elsewhere: watch again, with since
            entry.seq = stored.seq
        log.info("session.retaken", session=name, epoch=epoch, seq=stored.seq)

    async def check_holds(self) -> None:
        """Take again (or let go, MOVED) every watched session whose epoch here is no longer known current, so that
        its watchers hear of steps made elsewhere (they are ended) rather than nothing."""
        assert self.fleet is not None
        for name in self.registry.fanout.watched():  # the watched sessions only: a round costs nothing per session
            entry = self.registry.get(name)
            lost = self.fleet.held(name) is not None and not self.fleet.current(name)
            if entry is not None and not entry.busy and lost:
                with contextlib.suppress(DevdError):  # MOVED: its watchers are told; else the next round tries again
                    await self.hold(name)

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
