"""Where a call runs, the whole policy: inline on the event loop under a short budget, or on a worker thread under
its deadline; and how a session is rebuilt from what is durable (a wake, a restart, a stopped inline call).

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

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import anyio
import anyio.to_thread
import structlog

from devd.errors import DeadlineError, DevdError, DoesNotFitError, HandleError, NullError, OutOfMemoryError, PoisonError
from devd.host import Core, Instance
from devd.sessions.entry import Entry
from devd.sessions.state import TRANSITIONS, Input
from devd.storage.store import Row, Stored, answer_digest

if TYPE_CHECKING:
    from devd.sessions.registry import Registry
    from devd.sessions.residency import Room

log = structlog.get_logger("devd.sessions.calls")
T = TypeVar("T")
HEAVY_MEMORY_BYTES = 8 << 20  # a rebuilt instance this large (a megabytes-long transcript) starts on a worker
WHOLE_STATE_INLINE_BYTES = 4 << 20  # an instance this large is snapshotted on a worker (~1 ms a MB of transcript)
LIGHT_CALLS_TO_RETURN = 16  # quick calls in a row after which a session's calls run inline again
TRANSCRIPT_CAP_FACTOR = 4  # a transcript too large for a session's cap is built under this many times it
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
        left = deadline - time.monotonic()  # counted from when a worker takes it: waiting for one is not its time
        return await self.off_loop(lambda: start(left), quick=True)

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


class Calls:
    """One registry's calls on its instances, by the policy above."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._roomy: Core | None = None  # the core with a larger cap, for transcripts (made on first need)
        self._roomy_lock = anyio.Lock()

    async def call(
        self, entry: Entry, timeout_s: float, call: Callable[[Instance, float], T], *, whole_state: bool = False
    ) -> T:
        """Run call(instance, timeout) inline under the budget; past it, rebuild from disk and run it on a worker.
        A heavy session (a call of it passed the budget, and 16 quick ones in a row have not followed) runs this one
        on a worker from the start, and so does a call that costs the whole state (`whole_state`: a snapshot) of a
        large session. The call has `timeout_s` of its own: a rebuild it needed first is not charged to it."""
        registry, runner = self.registry, self.registry.runner
        if entry.instance is None:
            await self.wake(entry, Input.LOAD)
        assert entry.instance is not None
        deadline = time.monotonic() + timeout_s
        if whole_state and entry.memory >= WHOLE_STATE_INLINE_BYTES and not entry.heavy:
            return await self._off_loop(entry, entry.instance, deadline, call, counted=False)
        if entry.heavy:
            return await self._off_loop(entry, entry.instance, deadline, call)
        timeout, final = runner.inline_timeout(deadline)
        # Heavy by the call's own CPU time, not the wall clock's: on a loaded machine a quick call the scheduler
        # paused is not heavy, and sending its session to a worker (a thread's round trip a call) would only make it
        # slower. A call's CPU time is at most its wall time, so the wall clock (read without a system call) clears
        # almost every call; the CPU clock (a system call each read) times only a session whose last call did not
        # clear it (`cpu_timed`), from its next call on, until one clears it again.
        half = runner.inline_budget_s / 2
        cpu = time.thread_time() if entry.cpu_timed else None
        started = time.perf_counter()
        try:
            result = call(entry.instance, timeout)
            if time.perf_counter() - started > half:
                if cpu is None:
                    entry.cpu_timed = True
                elif time.thread_time() - cpu > half:
                    entry.heavy, entry.light_calls = True, 0
            elif cpu is not None:
                entry.cpu_timed = False
            registry.residency.measure(entry)
            return result
        except OutOfMemoryError:
            registry.move(entry, Input.DROP)
            raise self._does_not_fit(entry) from None
        except DeadlineError as e:
            if final:
                raise await registry.lost(entry, e) from None
        except DevdError as e:
            raise await registry.lost(entry, e) from None
        # The inline attempt was stopped mid-call; its instance is gone. What is durable is exactly the state
        # before this call, so rebuild from it and run the call where it cannot hold up the event loop.
        left = deadline - time.monotonic()  # what the call has left, however long it then waits for room and a worker
        runner.offloaded += 1
        registry.stats.rebuilt += 1
        entry.heavy, entry.light_calls = True, 0
        registry.move(entry, Input.DROP)
        # The rebuild holds room as a wake does: the room the dropped instance left would otherwise go to another
        # wake meanwhile, and this instance be attached beside live sessions all inside calls, past --max-live.
        load = functools.partial(registry.stored, entry.name)
        async with registry.residency.room_for_wake(entry, load, registry.call_timeout_s) as (room, stored):
            try:
                # On the quick lane: this session's calls fitted the budget until now (it may only have missed it for
                # the contention), so it must not wait behind the heavy sessions' calls.
                instance, result = await runner.off_loop(
                    lambda: rebuild_and(registry.core, stored, registry.call_timeout_s, left, call),
                    quick=True,
                )
            except OutOfMemoryError:
                raise self._does_not_fit(entry) from None
            except DevdError as e:
                raise await registry.lost(entry, e) from None
            with room.taken():  # its room is its instance's now, as a wake's
                registry.move(entry, Input.LOAD, instance=instance)
        entry.rebased(stored)
        return result

    async def _off_loop(
        self,
        entry: Entry,
        instance: Instance,
        deadline: float,
        call: Callable[[Instance, float], T],
        *,
        counted: bool = True,
    ) -> T:
        """Run the call on a worker thread under its whole deadline; a quick one brings the session back inline. A
        call sent here for what it is (`counted` False: a snapshot), not for how the session's calls have gone, does
        not count either way."""
        registry, runner = self.registry, self.registry.runner
        runner.offloaded += 1
        # The call's time is counted from when a worker takes it: on a loaded daemon the wait for a worker (or for
        # the GIL to start one) took whole deadlines, and a call that had not begun ended its session as DEADLINE.
        left = deadline - time.monotonic()

        def timed() -> tuple[T, float]:
            started = time.thread_time()  # CPU time, as inline (see `call`)
            return call(instance, left), time.thread_time() - started

        try:
            result, seconds = await runner.off_loop(timed)
        except OutOfMemoryError:
            registry.move(entry, Input.DROP)
            raise self._does_not_fit(entry) from None
        except DevdError as e:
            raise await registry.lost(entry, e) from None
        # A long transcript makes only some calls slow (a Model ask); a run of quick ones is needed before the session
        # is trusted inline again, or each slow one would be stopped inline and rebuilt.
        if counted:
            entry.light_calls = entry.light_calls + 1 if seconds < runner.inline_budget_s / 4 else 0
            entry.heavy = entry.light_calls < LIGHT_CALLS_TO_RETURN
        registry.residency.measure(entry)
        return result

    def _does_not_fit(self, entry: Entry) -> DoesNotFitError:
        """The call ran out of the session's memory cap: its instance is gone, but nothing durable changed, so the
        session goes on from its last step (rebuilt on its next call) rather than being poisoned."""
        return DoesNotFitError(
            f"the call does not fit in session {entry.name!r}'s memory ({self.registry.core.memory_bytes >> 20} MiB); "
            f"nothing changed, the session continues from step {entry.seq}: send a smaller event, or fork or close it"
        )

    async def wake(self, entry: Entry, how: Input) -> None:
        """Bring a stored session back: restore its snapshot and replay its journal, on a worker thread."""
        registry = self.registry
        await registry.fleet_sessions.acquire(entry)  # before its state is read: what is read is then this daemon's
        started = time.perf_counter()
        load = functools.partial(registry.stored, entry.name)
        registry.stats.rebuilt += 1
        async with registry.residency.room_for_wake(entry, load, registry.call_timeout_s) as (room, stored):
            loaded = time.perf_counter()
            await self._rebuild(entry, how, stored, room)
        log.info(
            "session.rebuilt",
            session=entry.name,
            seq=stored.seq,
            snapshot_bytes=len(stored.snapshot or b""),
            replayed_steps=len(stored.journal),
            load_ms=round((loaded - started) * 1000, 1),
            rebuild_ms=round((time.perf_counter() - loaded) * 1000, 1),
        )
        # Nothing is known of its calls' cost after a restart or a wake, but a transcript this long makes every
        # Model ask pass the inline budget: an inline attempt would only be stopped, and the session rebuilt again.
        if entry.memory >= HEAVY_MEMORY_BYTES:
            entry.heavy, entry.light_calls = True, 0

    async def _rebuild(self, entry: Entry, how: Input, stored: Stored, room: Room) -> None:
        registry = self.registry
        try:
            # A small session wakes on the quick lane, not behind the heavy sessions' calls.
            small = len(stored.snapshot or b"") + sum(len(r.event) for r in stored.journal) < HEAVY_MEMORY_BYTES // 4
            instance = await registry.runner.off_loop(
                lambda: rebuild(registry.core, stored, registry.call_timeout_s), quick=small
            )
        except DeadlineError as e:
            # Stopped, not broken: a replayed step ran past its deadline (or the shutdown's grace ended).
            registry.stats.deadline_hits += 1
            if (entry.state, Input.END) in TRANSITIONS:
                registry.move(entry, Input.END, f"rebuilding it ran past its deadline: {e}")
                await registry.set_health(entry)
            raise
        except DevdError as e:
            reason = f"rebuilding it failed: {e}"
            log.error("session.rebuild_failed", session=entry.name, error=str(e))
            registry.move(entry, Input.POISON, reason)
            await registry.set_health(entry)
            raise PoisonError(
                f"session {entry.name!r} could not be rebuilt from its durable state ({e}); "
                "its snapshot and journal are kept, see the daemon's log"
            ) from None
        with room.taken():  # its room is its instance's now, and measured as it is attached
            registry.move(entry, how, instance=instance)
        entry.seq = stored.seq
        entry.rebased(stored)

    async def transcript_outside_cap(self, entry: Entry, start: int) -> bytes:
        """The transcript from an instance rebuilt from what is durable under TRANSCRIPT_CAP_FACTOR times the cap,
        one such instance at a time, dropped once it has answered: a transcript that does not fit beside the
        session's state within its cap (a delta session's tool output can take most of it, and a client recovers
        its conversation from this) is still given whole."""
        registry = self.registry
        if self._roomy is None:
            self._roomy = registry.core.with_memory(registry.core.memory_bytes * TRANSCRIPT_CAP_FACTOR)
        roomy = self._roomy
        stored = await registry.stored(entry.name)

        def build() -> bytes:
            instance = rebuild(roomy, stored, registry.call_timeout_s)
            try:
                return instance.transcript(start, timeout=registry.call_timeout_s)
            finally:
                instance.close()

        async with self._roomy_lock:
            try:
                return await registry.runner.off_loop(build)
            except OutOfMemoryError:
                raise NullError(
                    f"the transcript of {entry.name!r} from message {start} does not fit even in "
                    f"{roomy.memory_bytes >> 20} MiB; ask for it from a later message (`from`), a part at a time"
                ) from None
