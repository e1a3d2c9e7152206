"""Which sessions have an instance in memory: at most `max_live` of them, within the live memory budget, the least
recently used idle one dropped first; and which sessions have gone unused long enough to be deleted.

Dropping an instance writes nothing: a session's durable state is complete after every acknowledged step, so its
next call rebuilds it (see `devd.sessions.calls`). A session inside a call is never dropped.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

import anyio
import structlog

from devd import failpoints
from devd.errors import BusyError, MovedError
from devd.host import Instance
from devd.sessions.entry import Entry
from devd.storage.store import Stored

if TYPE_CHECKING:
    from devd.sessions.registry import Registry

log = structlog.get_logger("devd.sessions.residency")
WAKE_BASE_BYTES = 1 << 20  # what a woken instance is reserved beyond its state: an empty one holds ~512 KiB
WAKE_GROWTH = 4  # and per byte of its snapshot and journal (a 4 MiB prompt was seen to hold 15.4 MiB)
ROOM_RECHECK_S = 0.005  # how often a wake waiting for room looks again


class Residency:
    def __init__(self, max_live: int, live_memory_bytes: int | None, drop: Callable[[Entry], None]) -> None:
        self.max_live = max_live
        self.live_memory_bytes = live_memory_bytes
        self.memory = 0  # the live instances' memory together, as last measured
        self.hibernated = 0  # idle instances dropped to make room (their sessions stay, stored)
        self._drop = drop  # the registry's mover, for the state edge of a hibernation
        self._live: OrderedDict[str, Entry] = OrderedDict()  # sessions with an instance, least recently used first
        self.waking = 0  # sessions being rebuilt, counted against max_live before their instance exists
        self._reserved = 0  # and the memory reserved for them against the budget
        self._room: anyio.Event | None = None  # set when an instance is let go or a wake ends: room may be free
        self._loading = anyio.Lock()  # wakes load their state one at a time (see `room_for_wake`)

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
        self._room_freed()
        self._live.pop(entry.name, None)
        self.memory -= entry.memory
        entry.memory = 0
        instance, entry.instance = entry.instance, None
        if instance is not None:
            try:
                instance.close()
            except BusyError:  # pragma: no cover - the entry's busy flag orders every call
                pass

    @contextlib.asynccontextmanager
    async def room_for_wake(
        self, entry: Entry, load: Callable[[], Awaitable[Stored]], timeout_s: float
    ) -> AsyncIterator[tuple[Room, Stored]]:
        """Load what entry is rebuilt from (`load`), wait until one more instance of it fits `max_live` and the memory
        budget, hibernating idle sessions to make room and, when every live one is inside a call, waiting for one to
        end (up to `timeout_s`: BUSY past it), then hold the room for the wake: concurrent wakes so never build more
        instances than the caps hold. Wakes load one at a time, each once the one before holds its room: what waits
        beside the caps is never more than one session's state (32 wakes at once each loaded theirs first, and took a
        daemon under a 32 MiB budget up by 309 MiB). A session larger than the memory budget alone still wakes once
        nothing else is live."""
        held = False
        with anyio.move_on_after(timeout_s):
            async with self._loading:
                stored = await load()
                need = WAKE_BASE_BYTES + WAKE_GROWTH * (
                    len(stored.snapshot or b"") + sum(len(r.event) for r in stored.journal)
                )
                await self._wait_for_room(need)
                # No await from here to the yield: once the room is counted, nothing can cancel the wake before it
                # is held, and so released.
                self.waking += 1
                self._reserved += need
                held = True
        if not held:
            raise BusyError(
                f"session {entry.name!r} cannot be woken: the {len(self._live)} sessions in memory (--max-live "
                f"{self.max_live}, --live-memory) are all inside calls; retry when one has answered"
            )
        try:
            yield Room(self), stored
        finally:
            self.waking -= 1
            self._reserved -= need
            self._room_freed()

    async def _wait_for_room(self, need: int) -> None:
        while True:
            while not self._fits(need) and self._hibernate_one():
                pass
            if self._fits(need) or not (self._live or self.waking):
                return
            if self._room is None or self._room.is_set():
                self._room = anyio.Event()
            # Woken when an instance is let go or a wake ends; a call's end is not signalled, so look again soon.
            with anyio.move_on_after(ROOM_RECHECK_S):
                await self._room.wait()

    def _fits(self, need: int) -> bool:
        if len(self._live) + self.waking >= self.max_live:
            return False
        budget = self.live_memory_bytes
        return budget is None or self.memory + self._reserved + need <= budget

    def _room_freed(self) -> None:
        if self._room is not None:
            self._room.set()

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


class Room:
    """The room a wake holds, until its instance is attached and counted as live instead."""

    def __init__(self, residency: Residency) -> None:
        self._residency = residency

    @contextlib.contextmanager
    def taken(self) -> Iterator[None]:
        self._residency.waking -= 1
        try:
            yield
        finally:
            self._residency.waking += 1


async def expire(registry: Registry, unused_for_s: float, in_use: Callable[[str], bool]) -> list[str]:
    """Delete the sessions no call has used for `unused_for_s` (none inside a call, none `in_use`: a turn the agent
    runtime carries out, which may wait for a model, a command, a child or a person far longer); their names.
    Recency is read on the monotonic clock: a wall clock stepped back and then corrected cannot age a session used a
    moment ago."""
    cutoff = time.monotonic() - unused_for_s
    expired = []
    for name in [e.name for e in registry.entries() if e.used_at < cutoff]:
        entry = registry.get(name)
        # Checked again at its turn: an earlier delete awaited, and meanwhile a call may have used or closed it.
        if entry is None or entry.busy or entry.used_at >= cutoff or in_use(name):
            continue
        if registry.fleet is not None and registry.fleet.held(name) is None:
            continue  # in a fleet, only the daemon that holds a session knows when it was last used
        try:
            with registry.held(entry):  # nothing may enter it while it is deleted
                await registry.delete(entry, "expired")
        except MovedError as e:  # another daemon took it over meanwhile: it is theirs to keep
            registry.fleet_sessions.moved(entry, e)
            continue
        registry.stats.expired += 1
        log.info("session.expired", session=name, unused_s=round(time.monotonic() - entry.used_at))
        expired.append(name)
    return expired
