"""The session registry: names, states, one call at a time, durability before answers, idempotent keys, watchers.

What it promises:
- a step's answer is returned only after the step (and the snapshot the core asked for with `Save`) is durable;
- a step whose session is inside another call answers BUSY (nothing is queued);
- a keyed step already answered is replayed from the journal, byte for byte, and never executed twice; the same key
  with another event is CONFLICT;
- a step runs inline under a short budget, so small steps cost microseconds; when the budget passes, the session is
  rebuilt from its durable state on a worker thread and the step runs again there under its full deadline, so one
  slow session never holds up the others;
- a session that ended (deadline, lost answer) or trapped keeps that state on disk until `recover`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import msgspec
import structlog

from devd.errors import (
    BusyError,
    ConflictError,
    DeadlineError,
    DevdError,
    ExistsError,
    FullError,
    HandleError,
    InternalError,
    InvalidParamsError,
    PanicError,
    PoisonError,
)
from devd.host import Core, Session
from devd.rpc import SessionInfo, StepNotice, UnwatchedNotice, notification
from devd.store import Store, Stored

log = structlog.get_logger("devd.sessions")

INLINE_SECONDS = 0.002  # a step's inline budget before it moves to a worker thread
_SAVE = b'{"Save":true}'  # the core writes compact JSON, so this cannot occur inside a string


class Watcher:
    """A connection's subscription to one session. `offer` must not block: the stepping client never waits."""

    def __init__(self, session: str, offer: Callable[[bytes], bool], force: Callable[[bytes], None]) -> None:
        self.session = session
        self.offer = offer
        self.force = force
        self.last_seq = 0


@dataclass
class Entry:
    name: str
    state: str  # live | stored | ended | poisoned
    seq: int
    reason: str | None = None
    session: Session | None = None
    busy: bool = False
    watchers: set[Watcher] = field(default_factory=set)


@dataclass
class Stats:
    steps: int = 0
    replayed: int = 0
    deadline_hits: int = 0
    offloaded: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def _digest(event: bytes) -> bytes:
    """The event's identity for key conflicts: its JSON with members sorted, so whitespace does not matter."""
    try:
        canonical = msgspec.json.encode(msgspec.json.decode(event), order="sorted")
    except (msgspec.DecodeError, RecursionError):
        canonical = event
    return hashlib.sha256(canonical).digest()


def _name_error(name: str) -> HandleError:
    return HandleError(f"no session is named {name!r}; `session/list` shows the sessions there are")


class Sessions:
    def __init__(self, core: Core, store: Store, *, sessions_max: int, call_timeout: float) -> None:
        self.core = core
        self.store = store
        self.sessions_max = sessions_max
        self.call_timeout = call_timeout
        self.stats = Stats()
        self._entries: dict[str, Entry] = {}
        for name, state, reason, seq in store.names():
            mapped = {"ok": "stored", "ended": "ended", "poisoned": "poisoned"}[state]
            self._entries[name] = Entry(name, mapped, seq, reason)

    # -- lifecycle --------------------------------------------------------------------------------------------------

    async def new(self, name: str | None, config: bytes) -> str:
        return await self._start(name, lambda timeout: self.core.new(config, timeout=timeout), config, None)

    async def restore(self, snapshot_b64: str, name: str | None) -> str:
        try:
            snapshot = base64.b64decode(snapshot_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidParamsError("the snapshot must be base64, as session/snapshot gives it") from None
        return await self._start(name, lambda timeout: self.core.restore(snapshot, timeout=timeout), b"{}", snapshot)

    async def _start(
        self, name: str | None, start: Callable[[float], Session], config: bytes, snapshot: bytes | None
    ) -> str:
        """Claim the name, start the instance, and make the session durable before it is answered."""
        name = self._claim(name)
        try:
            session = await self._off_loop_if_slow(start)
        except BaseException:
            del self._entries[name]
            raise
        try:
            await self.store.write(Store.create(name, config, snapshot))
        except BaseException:
            session.close()
            del self._entries[name]
            raise
        entry = self._entries[name]
        entry.session, entry.busy = session, False
        return name

    async def _off_loop_if_slow(self, start: Callable[[float], Session]) -> Session:
        """Start a session inline under the short budget; past it, start it afresh on a worker thread."""
        deadline = time.monotonic() + self.call_timeout
        try:
            return start(INLINE_SECONDS)
        except DeadlineError:
            self.stats.offloaded += 1
            return await anyio.to_thread.run_sync(start, deadline - time.monotonic(), abandon_on_cancel=False)

    def _claim(self, name: str | None) -> str:
        if len(self._entries) >= self.sessions_max:
            raise FullError(f"the daemon holds {self.sessions_max} sessions, its limit; close one first")
        if name is None:
            name = secrets.token_urlsafe(16)
        if name in self._entries:
            raise ExistsError(f"a session named {name!r} exists; choose another name or close it first")
        self._entries[name] = Entry(name, "live", 0, busy=True)
        return name

    async def close(self, name: str) -> None:
        entry = self._enter(name, any_state=True)
        try:
            await self.store.write(Store.delete(name))
            self._drop_instance(entry)
            for w in list(entry.watchers):
                w.force(notification("session/unwatched", UnwatchedNotice(name, w.last_seq, "closed")))
            del self._entries[name]
        finally:
            entry.busy = False

    async def recover(self, name: str) -> None:
        entry = self._enter(name, any_state=True)
        try:
            if entry.state in ("ended", "poisoned"):
                await self._load(entry)
                await self.store.write(Store.set_state(name, "ok", None))
            elif entry.session is None:
                await self._load(entry)
        finally:
            entry.busy = False

    async def snapshot(self, name: str) -> str:
        entry = self._enter(name)
        try:
            if entry.session is None:
                await self._load(entry)
            assert entry.session is not None
            deadline = time.monotonic() + self.call_timeout
            try:
                state = entry.session.snapshot(timeout=INLINE_SECONDS)
            except DeadlineError:
                # The instance is gone; what is durable is exactly its state, so rebuild it off the loop.
                self.stats.offloaded += 1
                entry.session = None
                stored = self._stored(name)
                try:
                    entry.session, state = await anyio.to_thread.run_sync(
                        _rebuild_and_snapshot, self.core, stored, deadline, self.call_timeout, abandon_on_cancel=False
                    )
                except DevdError as e:
                    await self._lost(entry, e)
                    raise
            except DevdError as e:
                await self._lost(entry, e)
                raise
            return base64.b64encode(state).decode()
        finally:
            entry.busy = False

    # -- stepping ---------------------------------------------------------------------------------------------------

    async def step(self, name: str, event: bytes, timeout_ms: int | None, key: str | None) -> tuple[bytes, bool]:
        started = time.monotonic()
        entry = self._enter(name)
        try:
            digest = None
            if key is not None:
                digest = _digest(event)
                kept = self.store.keyed(name, key)
                if kept is not None:
                    if kept.digest != digest:
                        raise ConflictError(
                            f"key {key!r} was used for another event (step {kept.seq}); use a new key for a new event"
                        )
                    self.stats.replayed += 1
                    return kept.actions, True
            timeout = self.call_timeout if timeout_ms is None else timeout_ms / 1000
            deadline = started + timeout
            if entry.session is None:
                await self._load(entry)
            actions, snapshot = await self._run(entry, event, deadline)
            seq = entry.seq + 1
            try:
                await self.store.write(Store.step(name, seq, event, actions, key, digest, snapshot))
            except OSError as e:
                # The instance is ahead of the disk: drop it, so the next use rebuilds from what is durable.
                self._drop_instance(entry)
                entry.state = "stored"
                raise InternalError(f"the step could not be made durable and was not applied: {e}") from None
            entry.seq = seq
            self.stats.steps += 1
            self._publish(entry, seq, event, actions)
            return actions, False
        finally:
            entry.busy = False

    async def _run(self, entry: Entry, event: bytes, deadline: float) -> tuple[bytes, bytes | None]:
        """Step inline under a short budget; past it, rebuild from disk and step again on a worker thread."""
        assert entry.session is not None
        session = entry.session
        remaining = deadline - time.monotonic()
        final = remaining <= INLINE_SECONDS * 2
        try:
            return _step_and_save(session, event, remaining if final else INLINE_SECONDS)
        except DeadlineError as e:
            if final:
                await self._lost(entry, e)
                raise
        except DevdError as e:
            await self._lost(entry, e)
            raise
        # The inline attempt was stopped mid-step; its instance is gone. What is durable is exactly the state
        # before this step, so rebuild from it and run the step where it cannot hold up the event loop.
        self.stats.offloaded += 1
        entry.session = None
        stored = self._stored(entry.name)
        try:
            rebuilt, result = await anyio.to_thread.run_sync(
                _rebuild_and_step, self.core, stored, event, deadline, self.call_timeout, abandon_on_cancel=False
            )
        except DevdError as e:
            await self._lost(entry, e)
            raise
        entry.session = rebuilt
        return result

    async def _load(self, entry: Entry) -> None:
        """Bring a stored session back: restore its snapshot and replay its journal, on a worker thread."""
        stored = self._stored(entry.name)
        try:
            entry.session = await anyio.to_thread.run_sync(
                _rebuild, self.core, stored, self.call_timeout, abandon_on_cancel=False
            )
        except DevdError as e:
            entry.state, entry.reason = "poisoned", f"rebuilding it failed: {e}"
            log.error("session.rebuild_failed", session=entry.name, error=str(e))
            await self.store.write(Store.set_state(entry.name, "poisoned", entry.reason))
            raise PoisonError(
                f"session {entry.name!r} could not be rebuilt from its durable state ({e}); "
                "its snapshot and journal are kept, see the daemon's log"
            ) from None
        entry.state, entry.reason, entry.seq = "live", None, stored.seq

    def _stored(self, name: str) -> Stored:
        stored = self.store.load(name)
        if stored is None:
            raise _name_error(name)
        return stored

    async def _lost(self, entry: Entry, error: DevdError) -> None:
        """The instance is gone after a deadline, a trap or a lost answer: record why, durably."""
        if isinstance(error, DeadlineError):
            self.stats.deadline_hits += 1
        state = "poisoned" if isinstance(error, (PanicError, PoisonError)) else "ended"
        if isinstance(error, DeadlineError | PanicError | PoisonError) or (
            isinstance(error, HandleError) and (entry.session is None or not entry.session.alive)
        ):
            self._drop_instance(entry)
            entry.state, entry.reason = state, str(error)
            await self.store.write(Store.set_state(entry.name, state, entry.reason))

    def _drop_instance(self, entry: Entry) -> None:
        session, entry.session = entry.session, None
        if session is not None:
            try:
                session.close()
            except BusyError:  # pragma: no cover - the entry's busy flag orders every call
                pass

    def _enter(self, name: str, *, any_state: bool = False) -> Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise _name_error(name)
        if entry.busy:
            raise BusyError(f"session {name!r} is inside another call; retry when that call has answered")
        if not any_state and entry.state in ("ended", "poisoned"):
            kind = PoisonError if entry.state == "poisoned" else HandleError
            raise kind(f"session {name!r} {entry.state} ({entry.reason}); `session/recover` brings it back")
        entry.busy = True
        return entry

    # -- watchers ---------------------------------------------------------------------------------------------------

    def watch(self, name: str, watcher: Watcher, since: int | None) -> None:
        entry = self._entries.get(name)
        if entry is None:
            raise _name_error(name)
        watcher.last_seq = entry.seq if since is None else since
        if since is not None:
            for seq, event, actions in self.store.steps_since(name, since):
                self._deliver(entry, watcher, seq, event, actions)
        entry.watchers.add(watcher)

    def unwatch(self, name: str, watcher: Watcher) -> None:
        entry = self._entries.get(name)
        if entry is not None:
            entry.watchers.discard(watcher)

    def _publish(self, entry: Entry, seq: int, event: bytes, actions: bytes) -> None:
        for watcher in list(entry.watchers):
            self._deliver(entry, watcher, seq, event, actions)

    def _deliver(self, entry: Entry, watcher: Watcher, seq: int, event: bytes, actions: bytes) -> None:
        if seq <= watcher.last_seq:
            return  # already sent (read back from the journal while its step was still on its way here)
        notice = notification("session/actions", StepNotice(entry.name, seq, msgspec.Raw(event), msgspec.Raw(actions)))
        if watcher.offer(notice):
            watcher.last_seq = seq
            return
        entry.watchers.discard(watcher)
        watcher.force(
            notification("session/unwatched", UnwatchedNotice(entry.name, watcher.last_seq, "fell too far behind"))
        )

    # -- status -----------------------------------------------------------------------------------------------------

    def list(self) -> list[SessionInfo]:
        return [
            SessionInfo(e.name, e.state, e.seq, len(e.watchers), e.reason)  # type: ignore[arg-type]
            for e in sorted(self._entries.values(), key=lambda e: e.name)
        ]

    def counts(self) -> dict[str, int]:
        counts = {"live": 0, "stored": 0, "ended": 0, "poisoned": 0}
        for e in self._entries.values():
            counts[e.state] += 1
        return counts

    def close_all(self) -> None:
        for entry in self._entries.values():
            self._drop_instance(entry)


def _step_and_save(session: Session, event: bytes, timeout: float) -> tuple[bytes, bytes | None]:
    """One step, and the snapshot the core asked for with Save, both under `timeout` from now."""
    deadline = time.monotonic() + timeout
    actions = session.step_raw(event, timeout=timeout)
    snapshot = session.snapshot(timeout=deadline - time.monotonic()) if _SAVE in actions else None
    return actions, snapshot


def _rebuild(core: Core, stored: Stored, call_timeout: float) -> Session:
    """The session as it is on disk: its snapshot (or its config) and then its journal, checked step by step."""
    session = core.restore(stored.snapshot) if stored.snapshot is not None else core.new(stored.config)
    try:
        for seq, event, recorded in stored.journal:
            replayed = session.step_raw(event, timeout=call_timeout)
            if replayed != recorded:
                raise HandleError(
                    f"replaying step {seq} gave other actions than were answered; the core is not the one that "
                    "wrote this journal"
                )
    except BaseException:
        session.close()
        raise
    return session


def _rebuild_and_snapshot(core: Core, stored: Stored, deadline: float, call_timeout: float) -> tuple[Session, bytes]:
    session = _rebuild(core, stored, call_timeout)
    try:
        return session, session.snapshot(timeout=deadline - time.monotonic())
    except BaseException:
        if session.alive:
            session.close()
        raise


def _rebuild_and_step(
    core: Core, stored: Stored, event: bytes, deadline: float, call_timeout: float
) -> tuple[Session, tuple[bytes, bytes | None]]:
    session = _rebuild(core, stored, call_timeout)
    try:
        return session, _step_and_save(session, event, deadline - time.monotonic())
    except BaseException:
        if session.alive:
            session.close()
        raise
