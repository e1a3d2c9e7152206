"""Where a call runs: inline on the event loop under a short budget, or on a worker thread under its deadline.

Small calls cost microseconds, so they run inline. When one passes the inline budget, wasmtime stops it where it
stood and its instance is gone; what is durable is exactly the state before the call, so the session is rebuilt
from it (its snapshot, then its journal) and the call runs again on a worker thread, where it cannot hold up the
loop. A session whose calls have grown past the budget (a long transcript makes every Model ask slow) then runs its
calls on a worker from the start: it pays for the rebuild once, not at every call. Worker threads for calls are
bounded by limiters of their own, so they never starve the store's commits: one for heavy sessions' calls and
rebuilds, and a quick lane for calls that were expected to fit the budget and missed it (a start, a light session's
call stopped inline: under contention a quick call can miss it), so that slow calls filling every worker never hold
up a fast session's step or a `session/new` behind them.

A rebuild costs what the journal since the snapshot costs: every step is applied without writing its answer
(`Instance.apply`) but one, answered and checked against what was journalled (see `rebuild`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import anyio
import anyio.to_thread

from devd.errors import DeadlineError, HandleError
from devd.host import Core, Instance
from devd.store import Row, Stored, answer_digest

T = TypeVar("T")
_SAVE = b'{"Save":true}'  # the core writes compact JSON, so this cannot occur inside a string


class Runner:
    def __init__(self, core: Core, *, inline_budget_s: float, threads_max: int, quick_threads_max: int = 8) -> None:
        self.core = core
        self.inline_budget_s = inline_budget_s
        self.limiter = anyio.CapacityLimiter(threads_max)
        self.quick_limiter = anyio.CapacityLimiter(quick_threads_max)
        self.offloaded = 0  # calls run on a worker thread: past their inline budget, or of a heavy session

    async def start(self, start: Callable[[float], Instance], deadline: float) -> Instance:
        """A new instance, started inline under the budget; past it, started afresh on a worker thread."""
        try:
            return start(self.inline_budget_s)
        except DeadlineError:
            if deadline - time.monotonic() <= self.inline_budget_s:
                raise
        self.offloaded += 1
        return await self.off_loop(lambda: start(deadline - time.monotonic()), quick=True)

    async def off_loop(self, fn: Callable[[], T], *, quick: bool = False) -> T:
        """fn on a worker thread: of the quick lane for a call expected to be quick, else of the heavy one."""
        limiter = self.quick_limiter if quick else self.limiter
        return await anyio.to_thread.run_sync(fn, abandon_on_cancel=False, limiter=limiter)

    def inline_timeout(self, deadline: float) -> tuple[float, bool]:
        """The timeout for an inline attempt, and whether it is the call's last chance (no time left to offload)."""
        remaining = deadline - time.monotonic()
        final = remaining <= self.inline_budget_s * 2
        return (remaining if final else self.inline_budget_s), final


class Took(NamedTuple):
    """What a step took: its answer and the answer's digest, the snapshot taken after it (if one was due), and the
    action id it ignored (if it answered nothing because it took no notice of a result or a model answer)."""

    actions: bytes
    digest: bytes
    snapshot: bytes | None
    ignored: int | None


def step_and_save(instance: Instance, event: bytes, timeout: float, snapshot_due: Callable[[bytes], bool]) -> Took:
    """One step, and a snapshot after it when `snapshot_due(actions)` says so, both under `timeout` from now. The
    digest is taken here too: an answer can be the whole transcript, and hashing it belongs where the step ran (a
    worker, for a long session), not on the event loop."""
    deadline = time.monotonic() + timeout
    actions = instance.step_raw(event, timeout=timeout)
    ignored = instance.ignored() if actions == b"[]" else None
    snapshot = instance.snapshot(timeout=deadline - time.monotonic()) if snapshot_due(actions) else None
    return Took(actions, answer_digest(actions), snapshot, ignored)


def saved(actions: bytes) -> bool:
    """Whether the core asked to Save: the end of a turn, the point where a snapshot is cheapest to take."""
    return _SAVE in actions


def rebuild(core: Core, stored: Stored, call_timeout_s: float) -> Instance:
    """The session as it is on disk: its snapshot (or its config), then its journal. One step is answered again and
    checked against the journal, a sign that this core is the one that wrote it: the last whose answer is kept whole
    (a byte comparison), else the last (against its digest: a Model ask kept as one is the whole transcript, which
    checking would write once more)."""
    instance = core.resume(stored.snapshot) if stored.snapshot is not None else core.new(stored.config)
    journal = stored.journal
    checked = next((i for i in reversed(range(len(journal))) if journal[i].actions is not None), len(journal) - 1)
    try:
        for i, row in enumerate(journal):
            if i == checked:
                replay(instance, row, call_timeout_s)
            else:
                instance.apply(row.event, timeout=call_timeout_s)
    except BaseException:
        instance.close()
        raise
    return instance


def replay(instance: Instance, row: Row, timeout_s: float) -> bytes:
    """Step a journalled row again and return its answer, checked against the journal's (whole or digest)."""
    actions = instance.step_raw(row.event, timeout=timeout_s)
    if (
        row.actions is not None
        and actions != row.actions
        or row.answer is not None
        and answer_digest(actions) != row.answer
    ):
        raise HandleError(
            f"replaying step {row.seq} gave other actions than were answered; the core is not the one that wrote "
            "this journal"
        )
    return actions


def rebuild_and(
    core: Core, stored: Stored, call_timeout_s: float, timeout_s: float, then: Callable[[Instance, float], T]
) -> tuple[Instance, T]:
    """Rebuild, then run `then(instance, timeout_s)`: the rebuild is not charged to the call that needed it."""
    instance = rebuild(core, stored, call_timeout_s)
    try:
        return instance, then(instance, timeout_s)
    except BaseException:
        if instance.alive:
            instance.close()
        raise
