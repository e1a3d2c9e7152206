"""Which sessions have an instance in memory: at most `max_live` of them, within the live memory budget, the least
recently used idle one dropped first; and which sessions have gone unused long enough to be deleted.

Dropping an instance writes nothing: a session's durable state is complete after every acknowledged step, so its
next call rebuilds it (see `devd.sessions.calls`). A session inside a call is never dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from devd import failpoints
from devd.errors import BusyError, MovedError
from devd.host import Instance
from devd.sessions.entry import Entry

if TYPE_CHECKING:
    from devd.sessions.registry import Registry

log = structlog.get_logger("devd.sessions.registry")


class Residency:
    def __init__(self, max_live: int, live_memory_bytes: int | None, drop: Callable[[Entry], None]) -> None:
        self.max_live = max_live
        self.live_memory_bytes = live_memory_bytes
        self.memory = 0  # the live instances' memory together, as last measured
        self.hibernated = 0  # idle instances dropped to make room (their sessions stay, stored)
        self._drop = drop  # the registry's mover, for the state edge of a hibernation
        self._live: OrderedDict[str, Entry] = OrderedDict()  # sessions with an instance, least recently used first

    def names(self) -> list[str]:
        return list(self._live)

    def touch(self, entry: Entry) -> None:
        if entry.name in self._live:
            self._live.move_to_end(entry.name)

    def attach(self, entry: Entry, instance: Instance) -> None:
        """Give entry its instance, hibernating the least recently used idle sessions past `max_live` first, and
        past the memory budget after."""
        while len(self._live) >= self.max_live and self._hibernate_one():
            pass
        entry.instance = instance
        self._live[entry.name] = entry
        self.measure(entry)

    def measure(self, entry: Entry) -> None:
        """Count entry's instance memory (it grows with the session, never shrinks) and keep within the budget."""
        if entry.instance is None:
            return
        memory = entry.instance.memory_bytes()
        self.memory += memory - entry.memory
        entry.memory = memory
        if self.live_memory_bytes is not None:
            while self.memory > self.live_memory_bytes and self._hibernate_one():
                pass

    def detach(self, entry: Entry) -> None:
        self._live.pop(entry.name, None)
        self.memory -= entry.memory
        entry.memory = 0
        instance, entry.instance = entry.instance, None
        if instance is not None:
            try:
                instance.close()
            except BusyError:  # pragma: no cover - the entry's busy flag orders every call
                pass

    def _hibernate_one(self) -> bool:
        """Drop the instance of the least recently used session not inside a call. False if every live session is
        inside a call."""
        for name, entry in self._live.items():
            if not entry.busy:
                failpoints.hit("hibernate")
                self._drop(entry)
                self.hibernated += 1
                log.info("session.hibernated", session=name)
                return True
        return False


async def expire(registry: Registry, unused_for_s: float) -> list[str]:
    """Delete the sessions no call has used for `unused_for_s` (none inside a call); their names."""
    cutoff = time.time() - unused_for_s
    expired = []
    for name in [e.name for e in registry.entries() if e.last_used < cutoff]:
        entry = registry.get(name)
        # Checked again at its turn: an earlier delete awaited, and meanwhile a call may have used or closed it.
        if entry is None or entry.busy or entry.last_used >= cutoff:
            continue
        if registry.fleet is not None and registry.fleet.held(name) is None:
            continue  # in a fleet, only the daemon that holds a session knows when it was last used
        entry.busy = True  # nothing may enter it while it is deleted
        try:
            await registry.delete(entry, "expired")
        except MovedError as e:  # another daemon took it over meanwhile: it is theirs to keep
            registry.fleet_sessions.moved(entry, e)
            continue
        registry.stats.expired += 1
        log.info("session.expired", session=name, unused_s=round(time.time() - entry.last_used))
        expired.append(name)
    return expired
