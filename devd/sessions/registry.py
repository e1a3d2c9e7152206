"""The session registry: names, capacity and pages, one call at a time on a session, durability before answers, and
the one mover of a session's state.

What it promises:
- a step's answer is returned only after the step is durable;
- a call on a session that is inside another call answers BUSY (nothing is queued); `entered` is the only way in;
- one slow session never holds up the others (the policy is `devd.sessions.calls`);
- a session that ended (deadline, lost answer) or trapped keeps that state on disk until `recover`;
- a fork is built from the source's durable state and never touches the source.

The registry's other jobs have modules of their own: `calls` (inline or on a worker, rebuilds), `history` (keyed
replay, derived answers, watchers catching up), `compaction` (what is journalled, when a snapshot is due, the
snapshots of a clean stop), `residency` (hibernation, the memory budget, expiry) and `fleet` (adopt, hold, moved,
drain). States change only through `move`, by the table in `devd.sessions.state`, and the instance is attached or
detached with the edge.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import structlog

from devd.errors import (
    BusyError,
    DeadlineError,
    DevdError,
    DoesNotFitError,
    ExistsError,
    FullError,
    HandleError,
    InvalidParamsError,
    MovedError,
    PanicError,
    PoisonError,
    StoreError,
)
from devd.host import Core, Instance
from devd.sessions import compaction, residency, summaries
from devd.sessions.calls import Calls, Runner, Took, rebuild_and, step_and_save
from devd.sessions.compaction import journalled, kept_answer, snapshot_due
from devd.sessions.entry import (
    FROM_HEALTH,
    HEALTH,
    STEP_BYTES,
    Answered,
    Counters,
    Entry,
    Info,
    Statistics,
    no_such,
)
from devd.sessions.fleet import FleetSessions
from devd.sessions.history import History, digest
from devd.sessions.residency import Residency
from devd.sessions.state import CALLABLE, Input, State, next_state
from devd.sessions.watchers import Fanout, Sink, Stepped, Subscription
from devd.storage.store import Fleet, Health, Record, Step, Store, Stored

log = structlog.get_logger("devd.sessions.registry")


def made_up_name() -> str:
    """A name for a session made without one: 128 random bits, URL-safe, and never starting with "-", which a
    command line takes for a flag (`devd approve -TPD… 2` found no session to approve)."""
    while (name := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return name


class Registry:
    def __init__(
        self,
        core: Core,
        store: Store,
        fanout: Fanout,
        *,
        sessions_max: int,
        max_live: int,
        call_timeout_s: float,
        max_call_timeout_s: float,
        runner: Runner,
        snapshot_floor_bytes: int = 64 << 10,
        live_memory_bytes: int | None = None,
        fleet: Fleet | None = None,
    ) -> None:
        self.core = core
        self.store = store
        self.fanout = fanout
        self.sessions_max = sessions_max
        self.call_timeout_s = call_timeout_s
        self.max_call_timeout_s = max_call_timeout_s
        self.runner = runner
        self.snapshot_floor_bytes = snapshot_floor_bytes
        self.fleet = fleet  # a store shared with other daemons: sessions are adopted, and may move away
        self.stats = Counters()
        self.calls = Calls(self)
        self.history = History(self)
        self.residency = Residency(max_live, live_memory_bytes, lambda e: self.move(e, Input.DROP))
        self.fleet_sessions = FleetSessions(self, fleet)
        self._entries: dict[str, Entry] = {}
        self._by_state = dict.fromkeys(State, 0)  # the entries in each state, kept as they change: status is O(1)
        self._names: list[str] = []  # every name, sorted: list pages are a bisect and a slice
        self._reopened_seen = 0  # the store's reopens after write faults this registry has rebuilt its sessions for

    async def load(self) -> None:
        """Know every stored session (their instances are built on first use)."""
        self._reopened_seen = self.store.reopened
        started, wall = time.monotonic(), time.time()
        for row in await self.store.sessions():
            entry = Entry(row.name, FROM_HEALTH[row.health], row.seq, row.reason)
            entry.created = row.created
            entry.last_used = row.last_used
            # Unused since before this start: as long before now as the wall clock said at the start.
            entry.used_at = started - max(0.0, wall - row.last_used)
            self._entries[row.name] = entry
            self._by_state[entry.state] += 1
        self._names = sorted(self._entries)

    async def _heal(self) -> None:
        """After the store reopened itself (a write fault), what is on disk is the truth, and it may hold writes that
        were answered with errors (a failed fsync does not say whether they landed): every session not inside a call
        drops its instance and takes its state and head from disk (its next call rebuilds it); sessions on disk
        this registry did not know are known again, and names no longer on disk are forgotten. A session inside a
        call is left to it: its own write failed (and it dropped its instance), or it is durable."""
        self._reopened_seen = self.store.reopened
        rows = {row.name: row for row in await self.store.sessions()}
        for name, entry in list(self._entries.items()):
            if entry.busy:
                continue
            if entry.state is State.LIVE:
                self.move(entry, Input.DROP)
            row = rows.get(name)
            if row is None:
                self.forget(name)
            else:
                entry.seq = row.seq
        for name, row in rows.items():
            if name not in self._entries:
                entry = Entry(name, FROM_HEALTH[row.health], row.seq, row.reason)
                entry.created, entry.last_used = row.created, row.last_used
                self.add(entry)
        log.warning("sessions.rebuilt_from_disk", sessions=len(self._entries), reopens=self._reopened_seen)

    # -- the table of names -------------------------------------------------------------------------------------------

    def get(self, name: str) -> Entry | None:
        return self._entries.get(name)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def add(self, entry: Entry) -> None:
        self._entries[entry.name] = entry
        self._by_state[entry.state] += 1
        bisect.insort(self._names, entry.name)

    def forget(self, name: str) -> None:
        self._by_state[self._entries.pop(name).state] -= 1
        i = bisect.bisect_left(self._names, name)
        if i < len(self._names) and self._names[i] == name:
            del self._names[i]

    @contextlib.contextmanager
    def claimed(self, name: str | None) -> Iterator[Entry]:
        """A new name, held (no call enters it) until its session is durable; forgotten, with any instance attached
        to it, if the block raises."""
        if len(self._entries) >= self.sessions_max:
            raise FullError(f"the daemon holds {self.sessions_max} sessions, its limit; close one first")
        if name is None:
            name = made_up_name()
        if name in self._entries:
            raise ExistsError(f"a session named {name!r} exists; choose another name or close it first")
        now = time.time()
        entry = Entry(name, State.LIVE, 0, busy=True, created=now, last_used=now)
        self.add(entry)
        try:
            yield entry
        except BaseException:
            self.residency.detach(entry)
            self.forget(entry.name)
            raise
        finally:
            entry.free()

    @contextlib.contextmanager
    def held(self, entry: Entry) -> Iterator[Entry]:
        """entry held for one call, or one job of the daemon's own (a snapshot at the stop, a fleet take, expiry):
        no other may enter it meanwhile. The busy flag is set here, in `_enter` and in `claimed`, nowhere else."""
        if entry.busy:
            raise BusyError(f"session {entry.name!r} is inside another call; retry when that call has answered")
        entry.busy = True
        try:
            yield entry
        finally:
            entry.free()

    async def wait_free(self, name: str) -> None:
        """Return once no call holds the session (at once if none does, or there is no such session here): woken
        as the holding call ends, never by polling. Another call may enter it first: a caller tries again."""
        entry = self._entries.get(name)
        if entry is None or not entry.busy:
            return
        if entry.freed is None:
            entry.freed = anyio.Event()
        await entry.freed.wait()

    @contextlib.asynccontextmanager
    async def entered(self, name: str, *, any_state: bool = False) -> AsyncIterator[Entry]:
        """The session, held for one call: BUSY if another call holds it, HANDLE (or POISON) if it cannot take calls
        (`any_state` lets reads, recover and close in anyway). In a fleet it is adopted first when it is not known
        here (made or held elsewhere), and after rebuilding from disk what a reopen of the store may have changed."""
        await self._ready_for(name)
        entry = self._enter(name, any_state)
        try:
            yield entry
        finally:
            entry.free()

    async def _ready_for(self, name: str) -> None:
        """What must happen before a call enters a session: a rebuild from disk after the store reopened, and in a
        fleet the session held (adopted or taken again)."""
        if self.store.reopened != self._reopened_seen:
            await self._heal()
        if self.fleet is not None:
            await self.fleet_sessions.hold(name)

    def _enter(self, name: str, any_state: bool) -> Entry:
        """`entered`'s checks, the session held (busy) once they pass: the caller frees it (`Entry.free`). Written
        flat, without a context manager: every step passes here."""
        entry = self._entries.get(name)
        if entry is None:
            raise no_such(name)
        if entry.busy:
            raise BusyError(f"session {entry.name!r} is inside another call; retry when that call has answered")
        if not any_state and entry.state not in CALLABLE:
            kind = PoisonError if entry.state is State.POISONED else HandleError
            raise kind(f"session {name!r} {entry.state.value} ({entry.reason}); `session/recover` brings it back")
        entry.busy = True
        entry.last_used, entry.used_at = time.time(), time.monotonic()
        self.residency.touch(entry)
        return entry

    def move(self, entry: Entry, input: Input, reason: str | None = None, *, instance: Instance | None = None) -> None:
        """The one mover: the state table's edge, with the instance attached (given one) or detached (a state that
        has none) to match."""
        self._set_state(entry, next_state(entry.state, input))
        entry.reason = reason
        if instance is not None:
            self.residency.attach(entry, instance)
        elif entry.state is not State.LIVE:
            self.residency.detach(entry)

    def retaken(self, entry: Entry, health: Health, reason: str | None) -> None:
        """The mover's one edge from outside the table, the fleet's: a session taken again is in the state its store
        says (another daemon may have ended, poisoned or recovered it meanwhile), whatever this daemon knew, and has
        no instance (the one here may be behind the journal) until its next call rebuilds one from disk."""
        self.residency.detach(entry)
        self._set_state(entry, FROM_HEALTH[health])
        entry.reason = reason

    # -- starting sessions ------------------------------------------------------------------------------------------

    async def new(self, name: str | None, config: bytes) -> str:
        deadline = time.monotonic() + self.call_timeout_s
        return await self._start(
            name, lambda: self.runner.start(lambda t: self.core.new(config, timeout=t), deadline), config, None
        )

    async def restore(self, snapshot_b64: str, name: str | None) -> str:
        try:
            snapshot = base64.b64decode(snapshot_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParamsError("the snapshot must be base64, as session/snapshot gives it") from None
        deadline = time.monotonic() + self.call_timeout_s
        return await self._start(
            name, lambda: self.runner.start(lambda t: self.core.restore(snapshot, timeout=t), deadline), b"{}", snapshot
        )

    async def fork(self, source: str, at: int | None, name: str | None) -> str:
        """A new session whose history is source's up to step `at` (default: its latest). The source is held (BUSY
        to other calls) while its history is read and copied, so it cannot be closed or stepped meanwhile; its state
        does not matter (an ended or poisoned session's history can be forked)."""
        async with self.entered(source, any_state=True) as src:
            return await self._fork(src, at, name)

    async def _fork(self, src: Entry, at: int | None, name: str | None) -> str:
        source = src.name
        if self.fleet is not None and self.fleet.held(source) is None:
            await self.fleet_sessions.acquire(src)  # its head here may be old: another daemon may have stepped it
            src.seq = (await self.stored(source)).seq
        at = src.seq if at is None else at
        if at > src.seq:
            raise InvalidParamsError(f"session {source!r} has answered {src.seq} steps; fork at {src.seq} or earlier")
        stored = await self.store.load_at(source, at)
        if stored is None:
            kept = await self.store.load(source)
            oldest = kept.snapshot_seq if kept is not None else src.seq
            raise InvalidParamsError(
                f"the history of {source!r} at step {at} is no longer kept; fork at step {oldest} or later"
            )
        snapshot_needed = stored.snapshot is not None or (at > 0 and self.core.has_snapshots)
        await self.fleet_sessions.refuse_if_in_fleet(name)

        def build() -> tuple[Instance, bytes | None]:
            take = (lambda i, t: i.snapshot(timeout=t)) if snapshot_needed else (lambda i, t: None)
            return rebuild_and(self.core, stored, self.call_timeout_s, self.call_timeout_s, take)

        with self.claimed(name) as entry:
            instance, snapshot = await self.runner.off_loop(build)
            await self._made_durable(entry, instance, self.store.fork(source, at, entry.name, snapshot))
            if snapshot is None:
                entry.rebased(stored)
            else:
                entry.snapshot_bytes = len(snapshot)
            entry.seq = at
        return entry.name

    async def _start(
        self, name: str | None, start: Callable[[], Awaitable[Instance]], config: bytes, snapshot: bytes | None
    ) -> str:
        """Claim the name, start the instance, and make the session durable before it is answered."""
        if self.store.reopened != self._reopened_seen:
            await self._heal()
        await self.fleet_sessions.refuse_if_in_fleet(name)
        with self.claimed(name) as entry:
            instance = await start()
            await self._made_durable(entry, instance, self.store.create(entry.name, config, snapshot))
            entry.snapshot_bytes = len(snapshot or b"")
        return entry.name

    async def _made_durable(self, entry: Entry, instance: Instance, write: Awaitable[None]) -> None:
        """The claimed session's instance attached once `write` has made it durable; else the instance closed, and a
        MOVED said as the name being made on another daemon."""
        try:
            await write
        except BaseException as e:
            instance.close()
            if isinstance(e, MovedError):
                raise _made_elsewhere(entry.name) from None
            raise
        self.residency.attach(entry, instance)

    # -- calls on a session -----------------------------------------------------------------------------------------

    async def step(self, name: str, event: bytes, timeout_ms: int | None, key: str | None) -> Answered:
        # `entered`, written out: a step is the hot path, and an async context manager costs it microseconds.
        if self.fleet is not None or self.store.reopened != self._reopened_seen:
            await self._ready_for(name)
        entry = self._enter(name, False)
        try:
            event_digest = None
            if key is not None:
                event_digest = digest(event)
                replayed = await self.history.replayed(name, key, event_digest)
                if replayed is not None:
                    self.stats.replayed += 1
                    return replayed
            timeout_s = self.call_timeout_s if timeout_ms is None else min(timeout_ms / 1000, self.max_call_timeout_s)
            cost = len(event) + STEP_BYTES

            def due(actions: bytes) -> bool:
                # Read here, not before the call: a rebuild on the way (a wake, a restart) counts them afresh.
                since = entry.since_bytes + cost
                return self.core.has_snapshots and snapshot_due(
                    since, entry.snapshot_bytes, self.snapshot_floor_bytes, actions
                )

            # A snapshot costs what the whole state costs: a step that may take one, of a large session, runs where
            # it cannot hold up the loop (inline, it would pass the budget, be stopped, and rebuild the session).
            # Loaded first: what a wake or a restart reads back is what says whether one may be due.
            if entry.instance is None:
                await self.calls.wake(entry, Input.LOAD)
            may_save = due(b'{"Save":true}')
            summary = summaries.is_summary(event)

            def run(i: Instance, t: float) -> tuple[Took, bytes | None]:
                # What a Summary replaces is read just before it, in the same call: the core forgets it.
                before = i.transcript(0, timeout=t) if summary else None
                return step_and_save(i, event, t, due), before

            took, before = await self.calls.call(entry, timeout_s, run, whole_state=may_save or summary)
            actions, answer, snapshot, ignored = took
            seq = entry.seq + 1
            kept = journalled(event, ignored)
            try:
                await self.store.append(
                    Step(name, seq, kept, kept_answer(kept, actions), key, event_digest, snapshot, answer)
                )
            except StoreError as e:
                # The instance is ahead of the disk: drop it, so the next use rebuilds from what is durable.
                self.move(entry, Input.DROP)
                raise StoreError(f"the step was not acknowledged: {e}") from None
            except MovedError as e:  # fenced: another daemon took the session over; this step was not taken
                self.fleet_sessions.moved(entry, e)
                raise
            entry.seq = seq
            if before is not None:
                # After the step, never before it: a record of a step that did not happen would be read as one that
                # did; one lost to a stop in between is found missing by `summaries.whole`, and said so.
                await self.store.add_record(Record(name, seq, summaries.REPLACED, 0, summaries.replaced(before, event)))
            if snapshot is None:
                entry.since_bytes += cost
            else:
                entry.snapshot_bytes, entry.since_bytes = len(snapshot), 0
            self.stats.steps += 1
            self.fanout.publish(Stepped(name, seq, event, actions, time.time()))
            return Answered(actions, False, ignored)
        finally:
            entry.free()

    async def snapshot(self, name: str) -> str:
        async with self.entered(name) as entry:
            call = self.calls.call
            state = await call(entry, self.call_timeout_s, lambda i, t: i.snapshot(timeout=t), whole_state=True)
            return base64.b64encode(state).decode()

    async def pending(self, name: str) -> bytes:
        async with self.entered(name) as entry:
            return await self.calls.call(entry, self.call_timeout_s, lambda i, t: i.pending(timeout=t))

    async def transcript(self, name: str, start: int, whole: bool = False) -> tuple[int, bytes]:
        """The session's step count and its conversation from message `start` on, from the core (built outside the
        session's cap when it does not fit beside its state). With `whole`, the whole conversation: what Summary
        events replaced (kept in the session's records) in their place, and no Summary."""
        async with self.entered(name) as entry:
            at = 0 if whole else start
            try:
                messages = await self.calls.call(
                    entry, self.call_timeout_s, lambda i, t: i.transcript(at, timeout=t), whole_state=at == 0
                )
            except DoesNotFitError:
                messages = await self.calls.transcript_outside_cap(entry, at)
            if whole:
                kept = await self.store.records(name, (summaries.REPLACED,))
                messages = summaries.whole([r.body for r in kept], messages, start)
            return entry.seq, messages

    async def save_all(self) -> int:
        """At a clean stop: snapshot the live sessions with steps since their last (`devd.sessions.compaction`)."""
        return await compaction.save_all(self)

    async def recover(self, name: str) -> None:
        async with self.entered(name, any_state=True) as entry:
            if entry.state in (State.ENDED, State.POISONED):
                await self.calls.wake(entry, Input.RECOVER)
                await self.set_health(entry)
            elif entry.instance is None:
                await self.calls.wake(entry, Input.RECOVER)

    async def back(self, name: str, at: int, kinds: tuple[str, ...]) -> None:
        """Move the session back to step `at`: its journal after it goes, with its records of `kinds` written after it
        (what belongs to those steps; the rest of its log stays), and it is rebuilt from disk at its next call. Its
        watchers' subscriptions end ("rewound"): what they were told after `at` is no longer its history, and they
        watch again from `at`. INVALID_PARAMS when `at` is past its last step or its history there is no longer kept;
        nothing changes then."""
        async with self.entered(name, any_state=True) as entry:
            if at > entry.seq:
                raise InvalidParamsError(f"session {name!r} has answered {entry.seq} steps; it cannot go on to {at}")
            if await self.store.load_at(name, at) is None:
                raise InvalidParamsError(f"the history of {name!r} at step {at} is no longer kept; it cannot go back")
            await self.store.truncate(name, at, kinds)
            if entry.state is State.LIVE:
                self.move(entry, Input.DROP)
            entry.seq = at
            entry.rebased(await self.stored(name))
        self.fanout.rewound(name, at)

    async def close(self, name: str) -> None:
        async with self.entered(name, any_state=True) as entry:
            await self.delete(entry, "closed")

    async def delete(self, entry: Entry, reason: str) -> None:
        """Delete a held session: durably first, then its instance, its watchers (told `reason`) and its name."""
        await self.store.delete(entry.name)
        self.move(entry, Input.CLOSE)
        self.fanout.end(entry.name, reason)
        self.forget(entry.name)

    async def stored(self, name: str) -> Stored:
        stored = await self.store.load(name)
        if stored is None:
            raise no_such(name)
        return stored

    async def lost(self, entry: Entry, error: DevdError) -> DevdError:
        """The instance is gone after a deadline, a trap or a lost answer: record why, durably; the error to answer.
        A deadline is answered in the daemon's terms: the host's says to restore a snapshot, which a client of the
        daemon does with `session/recover`."""
        if isinstance(error, DeadlineError):
            self.stats.deadline_hits += 1
            error = DeadlineError(
                f"the call ran past its deadline and was stopped; session {entry.name!r} ended: `session/recover` "
                "brings it back from its last step"
            )
        if isinstance(error, DeadlineError | PanicError | PoisonError) or (
            isinstance(error, HandleError) and (entry.instance is None or not entry.instance.alive)
        ):
            how = Input.POISON if isinstance(error, PanicError | PoisonError) else Input.END
            self.move(entry, how, str(error))
            await self.set_health(entry)
        return error

    async def set_health(self, entry: Entry) -> None:
        """Record entry's standing durably. In a fleet, a session another daemon took meanwhile is forgotten here, and
        the call answers MOVED, naming where it is now."""
        try:
            await self.store.set_health(entry.name, HEALTH.get(entry.state, Health.OK), entry.reason)
        except MovedError as e:
            self.fleet_sessions.moved(entry, e)
            raise

    async def drain(self) -> int:
        """Give the sessions no call is inside back to the fleet (`devd.sessions.fleet`)."""
        return await self.fleet_sessions.drain()

    async def expire(self, unused_for_s: float, in_use: Callable[[str], bool] = lambda _: False) -> list[str]:
        """Delete the sessions no call has used for `unused_for_s`, but those `in_use` says are used
        (`devd.sessions.residency`)."""
        return await residency.expire(self, unused_for_s, in_use)

    # -- watchers ---------------------------------------------------------------------------------------------------

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription:
        """Subscribe sink to name's steps: from now on, or first every journalled step after `since`."""
        return await self.history.watch(name, sink, since)

    def unwatch(self, sub: Subscription) -> None:
        self.fanout.unsubscribe(sub)

    # -- status -----------------------------------------------------------------------------------------------------

    def page(self, limit: int | None = None, after: str | None = None) -> tuple[list[Info], str | None]:
        """Sessions by name: up to `limit` of them (all if None) after the name `after`; and the name to continue
        after, if there are more."""
        names, more = self.page_names(limit, after)
        return self.infos(names), more

    def page_names(self, limit: int | None = None, after: str | None = None) -> tuple[list[str], str | None]:
        """The names of `page` (one slice of a sorted list: cheap at any size), and the name to continue after."""
        start = 0 if after is None else bisect.bisect_right(self._names, after)
        names = self._names[start:] if limit is None else self._names[start : start + limit]
        more = limit is not None and start + limit < len(self._names)
        return names, (names[-1] if more and names else None)

    def infos(self, names: list[str]) -> list[Info]:
        """What `session/list` shows of these sessions; one closed since its name was read is left out."""
        return [self._info(e) for n in names if (e := self._entries.get(n)) is not None]

    def info(self, name: str) -> Info:
        """One session's entry, as `page` gives it; HandleError if there is no such session."""
        entry = self._entries.get(name)
        if entry is None:
            raise no_such(name)
        return self._info(entry)

    def _info(self, e: Entry) -> Info:
        held = None if self.fleet is None else self.fleet.current(e.name)
        return Info(e.name, e.state, e.seq, self.fanout.count(e.name), e.reason, e.created, e.last_used, held)

    def counts(self) -> dict[str, int]:
        """The sessions in each state (closed ones are gone), from counts kept as states change: no walk."""
        return {s.value: n for s, n in self._by_state.items() if s is not State.CLOSED}

    def _set_state(self, entry: Entry, state: State) -> None:
        self._by_state[entry.state] -= 1
        self._by_state[state] += 1
        entry.state = state

    @property
    def memory(self) -> int:
        """The live instances' memory together, as last measured."""
        return self.residency.memory

    def statistics(self) -> Statistics:
        s, r = self.stats, self.residency
        return Statistics(
            steps=s.steps,
            replayed=s.replayed,
            deadline_hits=s.deadline_hits,
            rebuilt=s.rebuilt,
            hibernated=r.hibernated,
            expired=s.expired,
            offloaded=self.runner.offloaded,
            live=len(r.names()),
            live_memory_bytes=r.memory,
        )

    def close_all(self) -> None:
        for entry in self._entries.values():
            self.residency.detach(entry)


def _made_elsewhere(name: str) -> ExistsError:
    """A name another daemon of the fleet made at the same moment (its create won): the name is in use, as for a
    session made there before (docs/fleet.md), not a session to follow."""
    return ExistsError(f"a session named {name!r} exists in the fleet; choose another name or close it first")
