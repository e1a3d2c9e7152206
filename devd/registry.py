"""The session registry: names, states, one call at a time, durability before answers, idempotent keys, watchers.

What it promises:
- a step's answer is returned only after the step is durable;
- what a step writes is a function of the step, not of the session's history: an answer as large as the transcript
  is journalled as its digest and derived again when asked for, and snapshots follow the log-compaction rule (one is
  taken when the events since the last have grown past a fraction of its size, preferably where the core asked to
  `Save`), so a rebuild replays at most that much;
- a call on a session that is inside another call answers BUSY (nothing is queued);
- a keyed step already answered is replayed from the journal, byte for byte (an answer kept as a digest is derived
  again), and never executed twice; the same key with another event is CONFLICT, and so is a key whose answer is no
  longer kept at all;
- one slow session never holds up the others (see `devd.offload`);
- a session that ended (deadline, lost answer) or trapped keeps that state on disk until `recover`;
- a fork is built from the source's durable state and never touches the source.

States change only through `_move`, by the table in `devd.state`.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import functools
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import structlog

from devd import failpoints
from devd.errors import (
    BusyError,
    ConflictError,
    DeadlineError,
    DevdError,
    DoesNotFitError,
    ExistsError,
    FullError,
    HandleError,
    InvalidParamsError,
    MovedError,
    NullError,
    OutOfMemoryError,
    PanicError,
    PoisonError,
    StoreError,
)
from devd.host import Core, Instance
from devd.messages import without_payload
from devd.offload import Runner, rebuild, rebuild_and, replay, saved, step_and_save
from devd.state import CALLABLE, TRANSITIONS, Input, State, next_state
from devd.store import Fleet, Health, Row, Step, Store, Stored
from devd.watchers import Fanout, Sink, Stepped, Subscription

log = structlog.get_logger("devd.registry")
T = TypeVar("T")
CATCH_UP_ROWS = 256  # journal rows read at a time when a watcher asks for history
HEAVY_MEMORY_BYTES = 8 << 20  # a rebuilt instance this large (a megabytes-long transcript) starts on a worker
WHOLE_STATE_INLINE_BYTES = 4 << 20  # an instance this large is snapshotted on a worker (~1 ms a MB of transcript)
SHUTDOWN_SNAPSHOT_BYTES = 16 << 10  # journal since its snapshot past which a stopping daemon snapshots a session
LIGHT_CALLS_TO_RETURN = 16  # quick calls in a row after which a session's calls run inline again
IGNORED_KEPT_BYTES = 1024  # an ignored event larger than this is journalled without its text
TRANSCRIPT_CAP_FACTOR = 4  # a transcript too large for a session's cap is built under this many times it
WAKE_BASE_BYTES = 1 << 20  # what a woken instance is reserved beyond its state: an empty one holds ~512 KiB
ROOM_RECHECK_S = 0.005  # how often a wake waiting for room looks again
WAKE_GROWTH = 4  # and per byte of its snapshot and journal (a 4 MiB prompt was seen to hold 15.4 MiB)
STEP_BYTES = 2048  # what a step costs a replay beyond its event's bytes (~45 us here), in bytes of events


def kept_answer(event: bytes, actions: bytes) -> bytes | None:
    """The answer as journalled: whole when it is about as large as its event (calls, text, Save, Done), else None,
    for a digest alone (a Model ask: the whole transcript, which the events already hold)."""
    return actions if len(actions) <= 4 * len(event) + 256 else None


def snapshot_due(since_bytes: int, snapshot_bytes: int, floor_bytes: int, actions: bytes) -> bool:
    """Log compaction: a snapshot once the journal since the last one has grown past a quarter of its size (and past
    the floor, below which a replay is cheap anyway), at a Save (the end of a turn); past twice that, at any step (so
    one long turn is not one long replay). A rebuild then replays at most half a snapshot's worth, and snapshots
    add at most four times the journal's bytes to what is written."""
    threshold = max(floor_bytes, snapshot_bytes // 4)
    return since_bytes >= 2 * threshold or (since_bytes >= threshold and saved(actions))


@dataclass
class Entry:
    name: str
    state: State
    seq: int
    reason: str | None = None
    instance: Instance | None = None
    busy: bool = False
    created: float = 0.0  # wall-clock seconds
    last_used: float = 0.0  # wall-clock seconds of the last call on it (shown; never used to decide expiry)
    used_at: float = field(default_factory=time.monotonic)  # the same on the monotonic clock: what expiry reads
    memory: int = 0  # bytes of its instance's memory when last measured (0: no instance)
    heavy: bool = False  # a call did not fit the inline budget, or its instance is large: calls run on a worker
    light_calls: int = 0  # calls in a row, since, that would have fitted it easily (enough of them end `heavy`)
    snapshot_bytes: int = 0  # of its latest durable snapshot (0: its config is the start)
    since_bytes: int = 0  # of the journal since that snapshot, as a replay costs it (events, and a bit a step)

    def rebased(self, stored: Stored) -> None:
        """Count the replay cost from what is on disk."""
        self.snapshot_bytes = len(stored.snapshot or b"")
        self.since_bytes = sum(len(row.event) + STEP_BYTES for row in stored.journal)


@dataclass
class Stats:
    steps: int = 0
    replayed: int = 0
    deadline_hits: int = 0
    rebuilt: int = 0  # instances rebuilt from disk (woken, recovered, or after an inline call was stopped)
    hibernated: int = 0  # idle instances dropped to make room (their sessions stay, stored)
    expired: int = 0  # sessions deleted for going unused longer than the daemon keeps them


class Answered(NamedTuple):
    """A step's answer: its actions, whether a keyed retry was answered from the journal, and the action id the step
    ignored (a result or a Model answer for an action the session did not dispatch, or already had the answer of)."""

    actions: bytes
    replayed: bool
    ignored: int | None = None


@dataclass(frozen=True, slots=True)
class Info:
    name: str
    state: State
    seq: int
    watchers: int
    reason: str | None
    created: float
    last_used: float
    held: bool | None = None  # in a fleet, whether this daemon holds it (else its state here may be behind)


_HEALTH = {State.ENDED: Health.ENDED, State.POISONED: Health.POISONED}
_FROM_HEALTH = {Health.OK: State.STORED, Health.ENDED: State.ENDED, Health.POISONED: State.POISONED}


def digest(event: bytes) -> bytes:
    """The event's identity for key conflicts: its JSON with members sorted, so whitespace does not matter."""
    try:
        canonical = msgspec.json.encode(msgspec.json.decode(event), order="sorted")
    except (msgspec.DecodeError, RecursionError):
        canonical = event
    return hashlib.sha256(canonical).digest()


def _no_such(name: str) -> HandleError:
    return HandleError(f"no session is named {name!r}; `session/list` shows the sessions there are")


class _Deriver:
    """The answers of journalled steps, in order, for a watcher catching up: those kept as digests are derived by one
    instance rebuilt from the state before the first of them and stepped along from there, on a worker thread."""

    def __init__(self, registry: Registry, name: str) -> None:
        self.registry = registry
        self.name = name
        self.instance: Instance | None = None
        self.seq = 0  # the step the instance stands at

    async def answers(self, rows: list[Row]) -> list[bytes] | None:
        """Each row's answer; None when what derives the first one needed is no longer kept."""
        first = next((r for r in rows if r.actions is None), None) if self.instance is None else None
        if first is not None:
            before = await self.registry.store.load_at(self.name, first.seq - 1)
            if before is None:
                return None
            self.instance = await self.registry.runner.off_loop(
                lambda: rebuild(self.registry.core, before, self.registry.call_timeout_s)
            )
            self.seq = first.seq - 1
        if self.instance is None:
            return [r.actions for r in rows if r.actions is not None]
        return await self.registry.runner.off_loop(lambda: self._step(rows))

    def _step(self, rows: list[Row]) -> list[bytes]:
        assert self.instance is not None
        timeout = self.registry.call_timeout_s
        answers = []
        for row in rows:
            if row.seq > self.seq:
                if row.actions is None:
                    answers.append(replay(self.instance, row, timeout))
                else:
                    self.instance.apply(row.event, timeout=timeout)
                    answers.append(row.actions)
                self.seq = row.seq
            else:
                assert row.actions is not None
                answers.append(row.actions)
        return answers

    def close(self) -> None:
        if self.instance is not None:
            self.instance.close()


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
        self.max_live = max_live
        self.call_timeout_s = call_timeout_s
        self.max_call_timeout_s = max_call_timeout_s
        self.runner = runner
        self.snapshot_floor_bytes = snapshot_floor_bytes
        self.live_memory_bytes = live_memory_bytes
        self.fleet = fleet  # a store shared with other daemons: sessions are adopted, and may move away
        self.memory = 0  # the live instances' memory together, as last measured
        self.stats = Stats()
        self._waking = 0  # sessions being rebuilt, counted against --max-live before their instance exists
        self._reserved = 0  # and the memory reserved for them against --live-memory
        self._room: anyio.Event | None = None  # set when an instance is let go or a wake ends: room may be free
        self._roomy: Core | None = None  # the core with a larger cap, for transcripts (made on first need)
        self._roomy_lock = anyio.Lock()
        self._entries: dict[str, Entry] = {}
        self._by_state = dict.fromkeys(State, 0)  # the entries in each state, kept as they change: status is O(1)
        self._names: list[str] = []  # every name, sorted: list pages are a bisect and a slice
        self._live: OrderedDict[str, None] = OrderedDict()  # names with an instance, least recently used first

    async def load(self) -> None:
        """Know every stored session (their instances are built on first use)."""
        started, wall = time.monotonic(), time.time()
        for row in await self.store.sessions():
            entry = Entry(row.name, _FROM_HEALTH[row.health], row.seq, row.reason)
            entry.created = row.created
            entry.last_used = row.last_used
            # Unused since before this start: as long before now as the wall clock said at the start.
            entry.used_at = started - max(0.0, wall - row.last_used)
            self._add(entry)
        self._names = sorted(self._entries)

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
        src = await self._entered(source, any_state=True)
        try:
            return await self._fork(src, at, name)
        finally:
            src.busy = False

    async def _fork(self, src: Entry, at: int | None, name: str | None) -> str:
        source = src.name
        if self.fleet is not None and self.fleet.held(source) is None:
            await self._acquire(src)  # its head here may be old: another daemon may have stepped it since
            src.seq = (await self._stored(source)).seq
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
        await self._refuse_if_in_fleet(name)

        def build() -> tuple[Instance, bytes | None]:
            take = (lambda i, t: i.snapshot(timeout=t)) if snapshot_needed else (lambda i, t: None)
            return rebuild_and(self.core, stored, self.call_timeout_s, self.call_timeout_s, take)

        name = self._claim(name)
        instance: Instance | None = None
        try:
            instance, snapshot = await self.runner.off_loop(build)
            await self.store.fork(source, at, name, snapshot)
        except BaseException as e:
            if instance is not None:
                instance.close()
            self._forget(name)
            if isinstance(e, MovedError):
                raise self._made_elsewhere(name) from None
            raise
        entry = self._entries[name]
        assert instance is not None
        self._attach(entry, instance)
        if snapshot is None:
            entry.rebased(stored)
        else:
            entry.snapshot_bytes = len(snapshot)
        entry.seq, entry.busy = at, False
        return name

    async def _start(
        self, name: str | None, start: Callable[[], Awaitable[Instance]], config: bytes, snapshot: bytes | None
    ) -> str:
        """Claim the name, start the instance, and make the session durable before it is answered."""
        await self._refuse_if_in_fleet(name)
        name = self._claim(name)
        try:
            instance = await start()
        except BaseException:
            self._forget(name)
            raise
        try:
            await self.store.create(name, config, snapshot)
        except MovedError:
            instance.close()
            self._forget(name)
            raise self._made_elsewhere(name) from None
        except BaseException:
            instance.close()
            self._forget(name)
            raise
        entry = self._entries[name]
        self._attach(entry, instance)
        entry.snapshot_bytes = len(snapshot or b"")
        entry.busy = False
        return name

    def _made_elsewhere(self, name: str) -> ExistsError:
        """A name another daemon of the fleet made at the same moment (its create won): the name is in use, as for a
        session made there before (docs/fleet.md), not a session to follow."""
        return ExistsError(f"a session named {name!r} exists in the fleet; choose another name or close it first")

    def _claim(self, name: str | None) -> str:
        if len(self._entries) >= self.sessions_max:
            raise FullError(f"the daemon holds {self.sessions_max} sessions, its limit; close one first")
        if name is None:
            name = secrets.token_urlsafe(16)
        if name in self._entries:
            raise ExistsError(f"a session named {name!r} exists; choose another name or close it first")
        now = time.time()
        self._add(Entry(name, State.LIVE, 0, busy=True, created=now, last_used=now))
        bisect.insort(self._names, name)
        return name

    def _add(self, entry: Entry) -> None:
        self._entries[entry.name] = entry
        self._by_state[entry.state] += 1

    def _forget(self, name: str) -> None:
        self._by_state[self._entries.pop(name).state] -= 1
        self._live.pop(name, None)
        i = bisect.bisect_left(self._names, name)
        if i < len(self._names) and self._names[i] == name:
            del self._names[i]

    # -- calls on a session -----------------------------------------------------------------------------------------

    async def step(self, name: str, event: bytes, timeout_ms: int | None, key: str | None) -> Answered:
        entry = await self._entered(name)
        try:
            event_digest = None
            if key is not None:
                event_digest = digest(event)
                kept = await self.store.keyed(name, key)
                if kept is not None:
                    if kept.digest != event_digest:
                        raise ConflictError(
                            f"key {key!r} was used for another event (step {kept.seq}); use a new key for a new event"
                        )
                    answer = kept.actions
                    if answer is None:
                        answer = await self._derive(name, kept.seq, key)
                    self.stats.replayed += 1
                    return Answered(answer, True)
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
                await self._load(entry, Input.LOAD)
            may_save = due(b'{"Save":true}')
            actions, answer, snapshot, ignored = await self._call(
                entry, timeout_s, lambda i, t: step_and_save(i, event, t, due), whole_state=may_save
            )
            seq = entry.seq + 1
            journalled = event
            if ignored is not None and len(event) > IGNORED_KEPT_BYTES:
                # The session took no notice of it: a replay ignores it without its text just the same, so a client
                # that sends megabytes the session never asked for does not make every fork and rebuild carry them.
                journalled = without_payload(event) or event
            try:
                await self.store.append(
                    Step(name, seq, journalled, kept_answer(journalled, actions), key, event_digest, snapshot, answer)
                )
            except StoreError as e:
                # The instance is ahead of the disk: drop it, so the next use rebuilds from what is durable.
                self._detach(entry)
                self._move(entry, Input.DROP)
                raise StoreError(f"the step was not acknowledged: {e}") from None
            except MovedError as e:  # fenced: another daemon took the session over; this step was not taken
                self._moved(entry, e)
                raise
            entry.seq = seq
            if snapshot is None:
                entry.since_bytes += cost
            else:
                entry.snapshot_bytes, entry.since_bytes = len(snapshot), 0
            self.stats.steps += 1
            self.fanout.publish(Stepped(name, seq, event, actions))
            return Answered(actions, False, ignored)
        finally:
            entry.busy = False

    async def _derive(self, name: str, seq: int, key: str) -> bytes:
        """The answer to journalled step `seq`, kept as a digest: its event as journalled (a retry's may be spelled
        otherwise) stepped again on the state before it."""
        rows = await self.store.steps_since(name, seq - 1, 1)
        before = await self.store.load_at(name, seq - 1)
        if before is None or not rows or rows[0].seq != seq:
            raise ConflictError(
                f"key {key!r} was answered at step {seq}, and that answer is no longer kept (only recent history "
                "is); the step is not run twice: `session/pending` shows what the session waits for"
            )
        row = rows[0]

        def derive() -> bytes:
            instance = rebuild(self.core, before, self.call_timeout_s)
            try:
                return replay(instance, row, self.call_timeout_s)
            finally:
                instance.close()

        return await self.runner.off_loop(derive)

    async def snapshot(self, name: str) -> str:
        entry = await self._entered(name)
        try:
            state = await self._call(entry, self.call_timeout_s, lambda i, t: i.snapshot(timeout=t), whole_state=True)
            return base64.b64encode(state).decode()
        finally:
            entry.busy = False

    async def pending(self, name: str) -> bytes:
        entry = await self._entered(name)
        try:
            return await self._call(entry, self.call_timeout_s, lambda i, t: i.pending(timeout=t))
        finally:
            entry.busy = False

    async def transcript(self, name: str, start: int) -> tuple[int, bytes]:
        """The session's step count and its conversation from message `start` on, from the core. A transcript that
        does not fit beside the session's state within its cap (a delta session's tool output can take most of it,
        and a client recovers its conversation from this) is built outside the cap, from what is durable."""
        entry = await self._entered(name)
        try:
            try:
                messages = await self._call(
                    entry, self.call_timeout_s, lambda i, t: i.transcript(start, timeout=t), whole_state=start == 0
                )
            except DoesNotFitError:
                messages = await self._transcript_outside_cap(entry, start)
            return entry.seq, messages
        finally:
            entry.busy = False

    async def _transcript_outside_cap(self, entry: Entry, start: int) -> bytes:
        """The transcript from an instance rebuilt from what is durable under TRANSCRIPT_CAP_FACTOR times the cap,
        one such instance at a time, dropped once it has answered."""
        if self._roomy is None:
            self._roomy = self.core.with_memory(self.core.memory_bytes * TRANSCRIPT_CAP_FACTOR)
        roomy = self._roomy
        stored = await self._stored(entry.name)

        def build() -> bytes:
            instance = rebuild(roomy, stored, self.call_timeout_s)
            try:
                return instance.transcript(start, timeout=self.call_timeout_s)
            finally:
                instance.close()

        async with self._roomy_lock:
            try:
                return await self.runner.off_loop(build)
            except OutOfMemoryError:
                raise NullError(
                    f"the transcript of {entry.name!r} from message {start} does not fit even in "
                    f"{roomy.memory_bytes >> 20} MiB; ask for it from a later message (`from`), a part at a time"
                ) from None

    async def save_all(self) -> int:
        """At a clean stop, once no call runs: snapshot every live session with more than a few steps since its last
        snapshot, so the next start resumes it without replaying them. How many were; a failure only costs a replay
        after the restart. The snapshots are taken one by one (a small one inline) and handed to the store together,
        so its group commit writes them in a few commits rather than one each."""
        if not self.core.has_snapshots:
            return 0
        taken: list[Entry] = []
        async with anyio.create_task_group() as tg:
            for entry in list(self._entries.values()):
                instance = entry.instance
                if entry.busy or instance is None or entry.since_bytes < SHUTDOWN_SNAPSHOT_BYTES:
                    continue
                # A turn of the loop a session: the stop's time limit can end this, and the saves run meanwhile.
                await anyio.lowlevel.checkpoint()
                entry.busy = True
                try:
                    take = functools.partial(instance.snapshot, timeout=self.call_timeout_s)
                    snapshot = await self.runner.off_loop(take) if entry.memory >= WHOLE_STATE_INLINE_BYTES else take()
                except BaseException as e:  # cancelled too (the stop's time is up): the session is free again
                    entry.busy = False
                    if not isinstance(e, DevdError):
                        raise
                    log.warning("session.snapshot_failed", session=entry.name, error=str(e))
                    continue
                tg.start_soon(self._save_snapshot, entry, snapshot, taken)
        return len(taken)

    async def _save_snapshot(self, entry: Entry, snapshot: bytes, taken: list[Entry]) -> None:
        try:
            await self.store.save_snapshot(entry.name, entry.seq, snapshot)
        except DevdError as e:
            log.warning("session.snapshot_failed", session=entry.name, error=str(e))
            return
        finally:
            entry.busy = False
        entry.snapshot_bytes, entry.since_bytes = len(snapshot), 0
        taken.append(entry)

    async def recover(self, name: str) -> None:
        entry = await self._entered(name, any_state=True)
        try:
            if entry.state in (State.ENDED, State.POISONED):
                await self._load(entry, Input.RECOVER)
                await self._set_health(entry)
            elif entry.instance is None:
                await self._load(entry, Input.RECOVER)
        finally:
            entry.busy = False

    async def close(self, name: str) -> None:
        await self._delete(await self._entered(name, any_state=True), "closed")

    async def _delete(self, entry: Entry, reason: str) -> None:
        """Delete an entered session: durably first, then its instance, its watchers (told `reason`) and its name."""
        try:
            await self.store.delete(entry.name)
        finally:
            entry.busy = False
        self._detach(entry)
        self._move(entry, Input.CLOSE)
        self.fanout.end(entry.name, reason)
        self._forget(entry.name)

    async def _call(
        self, entry: Entry, timeout_s: float, call: Callable[[Instance, float], T], *, whole_state: bool = False
    ) -> T:
        """Run call(instance, timeout) inline under the budget; past it, rebuild from disk and run it on a worker.
        A heavy session (a call of it passed the budget, and 16 quick ones in a row have not followed) runs this one
        on a worker from the start, and so does a call that costs the whole state (`whole_state`: a snapshot) of a
        large session. The call has `timeout_s` of its own: a rebuild it needed first is not charged to it."""
        if entry.instance is None:
            await self._load(entry, Input.LOAD)
        assert entry.instance is not None
        deadline = time.monotonic() + timeout_s
        if whole_state and entry.memory >= WHOLE_STATE_INLINE_BYTES and not entry.heavy:
            return await self._call_off_loop(entry, entry.instance, deadline, call, counted=False)
        if entry.heavy:
            return await self._call_off_loop(entry, entry.instance, deadline, call)
        timeout, final = self.runner.inline_timeout(deadline)
        started = time.perf_counter()
        try:
            result = call(entry.instance, timeout)
            if time.perf_counter() - started > self.runner.inline_budget_s / 2:
                entry.heavy, entry.light_calls = True, 0
            self._measure(entry)
            return result
        except OutOfMemoryError:
            self._detach(entry)
            self._move(entry, Input.DROP)
            raise self._does_not_fit(entry) from None
        except DeadlineError as e:
            if final:
                await self._lost(entry, e)
                raise
        except DevdError as e:
            await self._lost(entry, e)
            raise
        # The inline attempt was stopped mid-call; its instance is gone. What is durable is exactly the state
        # before this call, so rebuild from it and run the call where it cannot hold up the event loop.
        self.runner.offloaded += 1
        self.stats.rebuilt += 1
        entry.heavy, entry.light_calls = True, 0
        self._detach(entry)
        self._move(entry, Input.DROP)
        stored = await self._stored(entry.name)
        try:
            # On the quick lane: this session's calls fitted the budget until now (it may only have missed it for
            # the contention), so it must not wait behind the heavy sessions' calls.
            instance, result = await self.runner.off_loop(
                lambda: rebuild_and(self.core, stored, self.call_timeout_s, deadline - time.monotonic(), call),
                quick=True,
            )
        except OutOfMemoryError:
            raise self._does_not_fit(entry) from None
        except DevdError as e:
            await self._lost(entry, e)
            raise
        self._attach(entry, instance)
        self._move(entry, Input.LOAD)
        entry.rebased(stored)
        return result

    async def _call_off_loop(
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
        self.runner.offloaded += 1

        def timed() -> tuple[T, float]:
            started = time.perf_counter()
            return call(instance, deadline - time.monotonic()), time.perf_counter() - started

        try:
            result, seconds = await self.runner.off_loop(timed)
        except OutOfMemoryError:
            self._detach(entry)
            self._move(entry, Input.DROP)
            raise self._does_not_fit(entry) from None
        except DevdError as e:
            await self._lost(entry, e)
            raise
        # A long transcript makes only some calls slow (a Model ask); a run of quick ones is needed before the session
        # is trusted inline again, or each slow one would be stopped inline and rebuilt.
        if counted:
            entry.light_calls = entry.light_calls + 1 if seconds < self.runner.inline_budget_s / 4 else 0
            entry.heavy = entry.light_calls < LIGHT_CALLS_TO_RETURN
        self._measure(entry)
        return result

    def _does_not_fit(self, entry: Entry) -> NullError:
        """The call ran out of the session's memory cap: its instance is gone, but nothing durable changed, so the
        session goes on from its last step (rebuilt on its next call) rather than being poisoned."""
        return DoesNotFitError(
            f"the call does not fit in session {entry.name!r}'s memory ({self.core.memory_bytes >> 20} MiB); nothing "
            f"changed, the session continues from step {entry.seq}: send a smaller event, or fork or close it"
        )

    async def _load(self, entry: Entry, how: Input) -> None:
        """Bring a stored session back: restore its snapshot and replay its journal, on a worker thread."""
        await self._acquire(entry)  # before its state is read: what is read is then this daemon's
        started = time.perf_counter()
        stored = await self._stored(entry.name)
        loaded = time.perf_counter()
        self.stats.rebuilt += 1
        reserved = await self._room_for_wake(entry, stored)
        try:
            await self._rebuild(entry, how, stored)
        finally:
            self._waking -= 1
            self._reserved -= reserved
            self._room_freed()
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

    async def _room_for_wake(self, entry: Entry, stored: Stored) -> int:
        """Wait until one more instance fits `--max-live` and `--live-memory`, hibernating idle sessions to make room
        and, when every live one is inside a call, waiting for one to end (up to the call deadline: BUSY past it),
        then reserve the room; the bytes reserved. Concurrent wakes so never build more instances than the caps
        hold. A session larger than the memory budget alone still wakes once nothing else is live."""
        need = WAKE_BASE_BYTES + WAKE_GROWTH * (len(stored.snapshot or b"") + sum(len(r.event) for r in stored.journal))
        with anyio.move_on_after(self.call_timeout_s) as scope:
            while True:
                while not self._fits(need) and self._hibernate_one():
                    pass
                if self._fits(need) or not (self._live or self._waking):
                    break
                if self._room is None or self._room.is_set():
                    self._room = anyio.Event()
                # Woken when an instance is let go or a wake ends; a call's end is not signalled, so look again soon.
                with anyio.move_on_after(ROOM_RECHECK_S):
                    await self._room.wait()
        if scope.cancelled_caught:
            raise BusyError(
                f"session {entry.name!r} cannot be woken: the {len(self._live)} sessions in memory (--max-live "
                f"{self.max_live}, --live-memory) are all inside calls; retry when one has answered"
            )
        self._waking += 1
        self._reserved += need
        return need

    def _fits(self, need: int) -> bool:
        if len(self._live) + self._waking >= self.max_live:
            return False
        budget = self.live_memory_bytes
        return budget is None or self.memory + self._reserved + need <= budget

    def _room_freed(self) -> None:
        if self._room is not None:
            self._room.set()

    async def _rebuild(self, entry: Entry, how: Input, stored: Stored) -> None:
        try:
            # A small session wakes on the quick lane, not behind the heavy sessions' calls.
            small = len(stored.snapshot or b"") + sum(len(r.event) for r in stored.journal) < HEAVY_MEMORY_BYTES // 4
            instance = await self.runner.off_loop(lambda: rebuild(self.core, stored, self.call_timeout_s), quick=small)
        except DeadlineError as e:
            # Stopped, not broken: a replayed step ran past its deadline (or the shutdown's grace ended).
            self.stats.deadline_hits += 1
            if (entry.state, Input.END) in TRANSITIONS:
                self._move(entry, Input.END, f"rebuilding it ran past its deadline: {e}")
                await self._set_health(entry)
            raise
        except DevdError as e:
            reason = f"rebuilding it failed: {e}"
            log.error("session.rebuild_failed", session=entry.name, error=str(e))
            self._move(entry, Input.POISON, reason)
            await self._set_health(entry)
            raise PoisonError(
                f"session {entry.name!r} could not be rebuilt from its durable state ({e}); "
                "its snapshot and journal are kept, see the daemon's log"
            ) from None
        self._waking -= 1  # its room is taken by its instance now, and measured
        self._attach(entry, instance)
        self._waking += 1
        self._move(entry, how)
        entry.seq = stored.seq
        entry.rebased(stored)

    async def _stored(self, name: str) -> Stored:
        stored = await self.store.load(name)
        if stored is None:
            raise _no_such(name)
        return stored

    async def _lost(self, entry: Entry, error: DevdError) -> None:
        """The instance is gone after a deadline, a trap or a lost answer: record why, durably."""
        if isinstance(error, DeadlineError):
            self.stats.deadline_hits += 1
        if isinstance(error, DeadlineError | PanicError | PoisonError) or (
            isinstance(error, HandleError) and (entry.instance is None or not entry.instance.alive)
        ):
            how = Input.POISON if isinstance(error, PanicError | PoisonError) else Input.END
            self._detach(entry)
            self._move(entry, how, str(error))
            await self._set_health(entry)

    async def _set_health(self, entry: Entry) -> None:
        """Record entry's standing durably. In a fleet, a session another daemon took meanwhile is forgotten here, and
        the call answers MOVED, naming where it is now."""
        try:
            await self.store.set_health(entry.name, _HEALTH.get(entry.state, Health.OK), entry.reason)
        except MovedError as e:
            self._moved(entry, e)
            raise

    def _move(self, entry: Entry, input: Input, reason: str | None = None) -> None:
        self._set_state(entry, next_state(entry.state, input))
        entry.reason = reason

    def _attach(self, entry: Entry, instance: Instance) -> None:
        """Give entry its instance, hibernating the least recently used idle sessions past `max_live` first, and
        past the memory budget after."""
        while len(self._live) >= self.max_live and self._hibernate_one():
            pass
        entry.instance = instance
        self._live[entry.name] = None
        self._measure(entry)

    def _measure(self, entry: Entry) -> None:
        """Count entry's instance memory (it grows with the session, never shrinks) and keep within the budget."""
        if entry.instance is None:
            return
        memory = entry.instance.memory_bytes()
        self.memory += memory - entry.memory
        entry.memory = memory
        if self.live_memory_bytes is not None:
            while self.memory > self.live_memory_bytes and self._hibernate_one():
                pass

    def _hibernate_one(self) -> bool:
        """Drop the instance of the least recently used session not inside a call: its durable state is complete,
        so this writes nothing, and its next call rebuilds it. False if every live session is inside a call."""
        for name in self._live:
            entry = self._entries[name]
            if not entry.busy:
                failpoints.hit("hibernate")
                self._detach(entry)
                self._move(entry, Input.DROP)
                self.stats.hibernated += 1
                log.info("session.hibernated", session=name)
                return True
        return False

    def _detach(self, entry: Entry) -> None:
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

    def _enter(self, name: str, *, any_state: bool = False) -> Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise _no_such(name)
        if entry.busy:
            raise BusyError(f"session {name!r} is inside another call; retry when that call has answered")
        if not any_state and entry.state not in CALLABLE:
            kind = PoisonError if entry.state is State.POISONED else HandleError
            raise kind(f"session {name!r} {entry.state.value} ({entry.reason}); `session/recover` brings it back")
        entry.busy = True
        entry.last_used, entry.used_at = time.time(), time.monotonic()
        if name in self._live:
            self._live.move_to_end(name)
        return entry

    async def _entered(self, name: str, *, any_state: bool = False) -> Entry:
        """`_enter`, in a fleet after making sure this daemon holds the session (`_hold`)."""
        if self.fleet is not None:
            await self._hold(name)
        return self._enter(name, any_state=any_state)

    async def _hold(self, name: str) -> None:
        """In a fleet, before a call uses what this daemon keeps of a session: adopt one it does not know (made or
        held elsewhere); take again one whose epoch here is not known current (never taken here, or taken before this
        daemon's lease lapsed, when another daemon may have stepped it), starting from what is durable, and end its
        watchers if steps were made elsewhere meanwhile. MovedError (and it is forgotten) when another live daemon
        holds it."""
        assert self.fleet is not None
        entry = self._entries.get(name)
        if entry is None:
            await self._adopt(name)
            return
        if entry.busy or self.fleet.current(name):
            return  # busy: the call inside holds it (and `_enter` answers BUSY)
        entry.busy = True
        try:
            epoch = await self.fleet.acquire(name)
            stored = await self.store.load(name) if epoch is not None else None
        except MovedError as e:
            self._moved(entry, e)
            raise
        finally:
            entry.busy = False
        self._detach(entry)  # it may be behind the journal: the next call rebuilds it from what is durable
        if stored is None:  # closed elsewhere
            self._move(entry, Input.CLOSE)
            self.fanout.end(name, "closed")
            self._forget(name)
            raise _no_such(name)
        self._set_state(entry, _FROM_HEALTH[stored.health])
        entry.reason = stored.reason
        if stored.seq != entry.seq:
            self.fanout.end(name, "moved")  # they missed the steps made elsewhere: watch again, with since
            entry.seq = stored.seq
        log.info("session.retaken", session=name, epoch=epoch, seq=stored.seq)

    async def check_holds(self) -> None:
        """In a fleet, take again (or let go, MOVED) every watched session whose epoch here is no longer known
        current, so that its watchers hear of steps made elsewhere (they are ended) rather than nothing."""
        assert self.fleet is not None
        for name in self.fanout.watched():  # the watched sessions only: a round costs nothing per session kept
            entry = self._entries.get(name)
            lost = self.fleet.held(name) is not None and not self.fleet.current(name)
            if entry is not None and not entry.busy and lost:
                with contextlib.suppress(DevdError):  # MOVED: its watchers are told; else the next round tries again
                    await self._hold(name)

    async def _adopt(self, name: str) -> None:
        """Take a session of the fleet for this daemon: MovedError if another live daemon holds it."""
        assert self.fleet is not None
        epoch = await self.fleet.acquire(name)
        stored = await self.store.load(name) if epoch is not None else None
        if stored is None:
            raise _no_such(name)
        if name in self._entries:
            return  # adopted meanwhile, by another call
        now = time.time()
        self._add(Entry(name, _FROM_HEALTH[stored.health], stored.seq, stored.reason, created=now, last_used=now))
        bisect.insort(self._names, name)
        log.info("session.adopted", session=name, epoch=epoch, seq=stored.seq)

    async def _acquire(self, entry: Entry) -> None:
        """In a fleet, hold the session before reading its state; MovedError (and it is forgotten here) when another
        live daemon holds it."""
        if self.fleet is None or self.fleet.held(entry.name) is not None:
            return
        try:
            await self.fleet.acquire(entry.name)
        except MovedError as e:
            self._moved(entry, e)
            raise

    async def _refuse_if_in_fleet(self, name: str | None) -> None:
        """A new session may not take the name of one that lives elsewhere in the fleet."""
        if self.fleet is None or name is None or name in self._entries:
            return
        try:
            await self._adopt(name)
        except HandleError:
            return  # no such session: the name is free
        except MovedError:
            pass
        raise ExistsError(f"a session named {name!r} exists in the fleet; choose another name or close it first")

    def _moved(self, entry: Entry, error: MovedError) -> None:
        """Another daemon holds the session now: forget it here, and tell its watchers where it went."""
        log.info("session.moved", session=entry.name, node=error.node, address=error.address)
        self._detach(entry)
        self._move(entry, Input.CLOSE)
        owner = (error.node, error.address or "") if error.node is not None else None
        self.fanout.end(entry.name, "moved", owner)
        self._forget(entry.name)

    async def drain(self) -> int:
        """Give every session this daemon holds and no call is inside back to the fleet (a call in flight keeps its
        session until it answers); how many were let go. Another daemon takes each at its next call, at once rather
        than after this one's lease."""
        assert self.fleet is not None
        idle = [e for e in self._entries.values() if not e.busy]
        held = [e.name for e in idle if self.fleet.held(e.name) is not None]
        for entry in idle:
            self._moved(entry, MovedError("drained"))
        await self.fleet.release(held)
        log.info("fleet.drained", sessions=len(held))
        return len(held)

    # -- watchers ---------------------------------------------------------------------------------------------------

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription:
        """Subscribe sink to name's steps: from now on, or first every journalled step after `since`. In a fleet,
        only on the daemon that holds the session (its steps are made there): MOVED elsewhere."""
        if self.fleet is not None:
            await self._hold(name)
        entry = self._entries.get(name)
        if entry is None:
            raise _no_such(name)
        if since is None:
            return self.fanout.subscribe(name, sink, entry.seq, catching_up=False)
        if since > entry.seq:
            raise InvalidParamsError(
                f"session {name!r} has answered {entry.seq} steps; watch since {entry.seq} or earlier"
            )
        sub = self.fanout.subscribe(name, sink, since, catching_up=True)
        deriver = _Deriver(self, name)
        try:
            while sub.active:
                rows = await self.store.steps_since(name, sub.last_seq, CATCH_UP_ROWS)
                whole = [r.seq for r in rows] == list(range(sub.last_seq + 1, sub.last_seq + 1 + len(rows)))
                cut = len(rows) if whole else next(i for i, r in enumerate(rows) if r.seq != sub.last_seq + 1 + i)
                gap = None if whole else rows[cut].seq
                rows = rows[:cut]
                answers = await deriver.answers(rows)
                if answers is None:  # what derives these answers is pruned; the latest snapshot derives what follows
                    kept = await self.store.load(name)
                    if kept is None:  # closed meanwhile (here, or by another daemon of a fleet), not pruned
                        if sub.last_seq == since:
                            raise _no_such(name)
                        if sub.active:  # a close here has told it already
                            self.fanout.end_one(sub, "closed")
                        return sub
                    gap = kept.snapshot_seq + 1
                for row, actions in zip(rows, answers or (), strict=False):
                    if not self.fanout.deliver(
                        sub, row.seq, self.fanout.encode(Stepped(name, row.seq, row.event, actions))
                    ):
                        return sub
                if gap is not None:  # pruned: a watcher is promised every step after since, or nothing
                    if sub.last_seq == since:
                        raise InvalidParamsError(
                            f"the history of {name!r} before step {gap} is no longer kept; watch since {gap - 1} "
                            "or later"
                        )
                    self.fanout.end_one(sub, f"the history before step {gap} is no longer kept")
                    return sub
                if len(rows) < CATCH_UP_ROWS and sub.last_seq >= entry.seq:
                    break  # no await since the check: no step can slip between history and live
                if not rows:
                    break  # history was pruned past what is durable; nothing more to read
        except BaseException:
            self.fanout.unsubscribe(sub)
            raise
        finally:
            deriver.close()
        sub.catching_up = False
        return sub

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

    def _info(self, e: Entry) -> Info:
        held = None if self.fleet is None else self.fleet.current(e.name)
        return Info(e.name, e.state, e.seq, self.fanout.count(e.name), e.reason, e.created, e.last_used, held)

    async def expire(self, unused_for_s: float) -> list[str]:
        """Delete the sessions no call has used for `unused_for_s` (none inside a call); their names."""
        cutoff = time.monotonic() - unused_for_s  # recency within a run: a stepped wall clock cannot age a session
        expired = []
        for name in [e.name for e in self._entries.values() if e.used_at < cutoff]:
            entry = self._entries.get(name)
            # Checked again at its turn: an earlier delete awaited, and meanwhile a call may have used or closed it.
            if entry is None or entry.busy or entry.used_at >= cutoff:
                continue
            if self.fleet is not None and self.fleet.held(name) is None:
                continue  # in a fleet, only the daemon that holds a session knows when it was last used
            entry.busy = True  # nothing may enter it while it is deleted
            try:
                await self._delete(entry, "expired")
            except MovedError as e:  # another daemon took it over meanwhile: it is theirs to keep
                self._moved(entry, e)
                continue
            self.stats.expired += 1
            log.info("session.expired", session=name, unused_s=round(time.monotonic() - entry.used_at))
            expired.append(name)
        return expired

    def counts(self) -> dict[str, int]:
        """The sessions in each state (closed ones are gone), from counts kept as states change: no walk."""
        return {s.value: n for s, n in self._by_state.items() if s is not State.CLOSED}

    def _set_state(self, entry: Entry, state: State) -> None:
        self._by_state[entry.state] -= 1
        self._by_state[state] += 1
        entry.state = state

    def close_all(self) -> None:
        for entry in self._entries.values():
            self._detach(entry)
