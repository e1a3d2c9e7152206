"""What the registry knows of each session (`Entry`), and the values it hands out: a list entry (`Info`), a step's
answer (`Answered`) and its counters (`Statistics`, frozen, as `Registry.statistics()` returns them)."""

from __future__ import annotations

import time
from typing import NamedTuple

import anyio
import msgspec

from devd.errors import HandleError
from devd.host import Instance
from devd.sessions.state import State
from devd.storage.store import Health, Stored

STEP_BYTES = 2048  # what a step costs a replay beyond its event's bytes (~45 us here), in bytes of events


class Entry(msgspec.Struct):
    name: str
    state: State
    seq: int
    reason: str | None = None
    instance: Instance | None = None
    busy: bool = False  # inside a call or a job of the daemon: set by `Registry.held`, `_enter` and `claimed` alone
    freed: anyio.Event | None = None  # set when `busy` is cleared, made by the first `Registry.wait_free` meanwhile
    created: float = 0.0  # wall-clock seconds
    last_used: float = 0.0  # wall-clock seconds of the last call on it (shown; never used to decide expiry)
    used_at: float = msgspec.field(default_factory=time.monotonic)  # the same on the monotonic clock: what expiry reads
    memory: int = 0  # bytes of its instance's memory when last measured (0: no instance)
    heavy: bool = False  # a call did not fit the inline budget, or its instance is large: calls run on a worker
    light_calls: int = 0  # calls in a row, since, that would have fitted it easily (enough of them end `heavy`)
    cpu_timed: bool = False  # its last inline call took over half the budget by the wall clock: the next is CPU-timed
    snapshot_bytes: int = 0  # of its latest durable snapshot (0: its config is the start)
    since_bytes: int = 0  # of the journal since that snapshot, as a replay costs it (events, and a bit a step)

    def rebased(self, stored: Stored) -> None:
        """Count the replay cost from what is on disk."""
        self.snapshot_bytes = len(stored.snapshot or b"")
        self.since_bytes = sum(len(row.event) + STEP_BYTES for row in stored.journal)

    def free(self) -> None:
        """The call holding the session is over: whoever waits for it to be free is woken."""
        self.busy = False
        if self.freed is not None:
            self.freed.set()
            self.freed = None


class Counters(msgspec.Struct):
    """The registry's own counters, counted as they happen (`Statistics` is their frozen reading)."""

    steps: int = 0
    replayed: int = 0
    deadline_hits: int = 0
    rebuilt: int = 0  # instances rebuilt from disk (woken, recovered, or after an inline call was stopped)
    expired: int = 0  # sessions deleted for going unused longer than the daemon keeps them


class Statistics(msgspec.Struct, frozen=True):
    steps: int
    replayed: int
    deadline_hits: int
    rebuilt: int
    hibernated: int  # idle instances dropped to make room (their sessions stay, stored)
    expired: int
    offloaded: int  # calls run on a worker thread: past their inline budget, or of a heavy session
    live: int  # sessions with an instance in memory
    live_memory_bytes: int  # their instances' memory together, as last measured


class Answered(NamedTuple):
    """A step's answer: its actions, whether a keyed retry was answered from the journal, and the action id the step
    ignored (a result or a Model answer for an action the session did not dispatch, or already had the answer of)."""

    actions: bytes
    replayed: bool
    ignored: int | None = None


class Info(msgspec.Struct, frozen=True):
    name: str
    state: State
    seq: int
    watchers: int
    reason: str | None
    created: float
    last_used: float
    held: bool | None = None  # in a fleet, whether this daemon holds it (else its state here may be behind)


HEALTH = {State.ENDED: Health.ENDED, State.POISONED: Health.POISONED}
FROM_HEALTH = {Health.OK: State.STORED, Health.ENDED: State.ENDED, Health.POISONED: State.POISONED}


def no_such(name: str) -> HandleError:
    return HandleError(f"no session is named {name!r}; `session/list` shows the sessions there are")


class Family(msgspec.Struct, frozen=True):
    """A session's parent (None: it is no child, a delegated run) and its children, in the order they were made."""

    parent: str | None = None
    children: list[str] = msgspec.field(default_factory=list)
