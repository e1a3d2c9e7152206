"""The agent runtime's port onto the sessions: a second client of them beside the wire, through the registry.

The runner sees the sessions only through `Sessions`: step an event under a key (as a client does: same events, same
journal, same keys; BUSY waited out: woken as the call holding the session ends, never by polling), read what a
session waits for and its conversation, keep and read records and spend counters (`RecordLog`), learn of every step
and of a session's end, and send a session's watchers notices that are not steps. `RegistryPort` is that port over
the daemon's `Registry` and `Store` (its `RecordLog` is the store's, `StoreRecordLog`); `ObservedFanout` is the
registry's watcher fan-out with observers added, so the runner hears of steps other clients make (a `Cancel`)
without a connection of its own. Notices are encoded by the function the daemon gives (`notify`: the wire's), so that
nothing here imports the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import msgspec

from devd.deltas import Stream
from devd.errors import BusyError, HandleError
from devd.messages import Action, Event, Message, Turn, decode_actions, decode_messages, encode
from devd.protocol import DeltaNotice
from devd.sessions.port import SessionPort
from devd.sessions.watchers import Fanout, Sink, Stepped, Subscription
from devd.storage.store import Counter, Over, Record, Store, Tally

T = TypeVar("T")
DELTA_NOTICE = "session/delta"
BUSY_WAIT_MAX_S = 60.0  # a session held by other calls this long: the step gives up with the last BusyError


class Observer(Protocol):
    def stepped(self, stepped: Stepped) -> None:
        """A step of some session was answered (called before its caller is answered; must not block)."""

    def ended(self, session: str) -> None:
        """The session was closed, expired or moved away."""


class ObservedFanout(Fanout, kw_only=True):
    """The watcher fan-out, also telling in-process observers of every step and every session's end, and sending
    notices that are not steps (`notify(method, params)`: a notification line).

    A model's text is told in batches: the fragments that come in one turn of the event loop (a read of a stream
    holds several once the daemon is busy) go out after it as one `session/delta` per action, and a watcher's
    deltas of all the sessions it watches as one write (a socket write a notice was a third of the daemon's CPU per
    fragment with 300 sessions streaming). Whatever else is told of a session (a step, another notice, its end, a
    watcher joining) first sends what is batched, so a watcher's notices keep their order."""

    notify: Callable[[str, Any], bytes]
    observers: list[Observer] = msgspec.field(default_factory=list)
    streams: dict[str, dict[int, Stream]] = msgspec.field(default_factory=dict)  # per session: Model text so far
    _batched: dict[tuple[str, int], list[str]] = msgspec.field(default_factory=dict)  # text not yet told
    _flush: Any = None  # the loop's callback that tells what is batched, while one is due

    def publish(self, stepped: Stepped) -> None:
        self.flush()
        super().publish(stepped)
        for observer in self.observers:
            observer.stepped(stepped)

    def end(self, session: str, reason: str, owner: tuple[str, str] | None = None) -> None:
        self.flush()
        super().end(session, reason, owner)
        for observer in self.observers:
            observer.ended(session)

    def rewound(self, session: str, at: int) -> None:
        self.flush()
        super().rewound(session, at)

    def stopped(self, session: str, reason: str, owner: tuple[str, str] | None = None) -> None:
        self.flush()
        super().stopped(session, reason, owner)

    def tell(self, session: str, data: bytes) -> None:
        """A notice that is not a step, to the session's live watchers (one still catching up on history gets it
        not: it would arrive before the steps it follows). A watcher with no room for it is dropped, as for a step."""
        self.flush()
        for sub in list(self._by_session.get(session, ())):
            if sub.active and not sub.catching_up and not sub.sink.offer(data):
                self.end_one(sub, "fell too far behind")

    def stream(self, session: str, action: int, text: str) -> None:
        """Text the model wrote for the Model action `action`, told as a `session/delta` to the live watchers (after
        this turn of the event loop, with the rest of what came in it), and kept: a watcher that joins before
        `streamed` is first told all of it, so the deltas any watcher gets are its reply's whole text (a second UI,
        or an editor back after the daemon restarted, joins mid-stream)."""
        kept = self.streams.setdefault(session, {}).setdefault(action, Stream())
        fresh = kept.add(text)
        if not fresh or session not in self._by_session:
            return
        batched = self._batched.get((session, action))
        if batched is not None:
            batched.append(fresh)
            return
        self._batched[(session, action)] = [fresh]
        if self._flush is None:
            try:
                self._flush = asyncio.get_running_loop().call_soon(self._flush_due)
            except RuntimeError:  # no loop running (a test driving the fan-out by hand): told now
                self.flush()

    def _flush_due(self) -> None:
        self._flush = None
        self.flush()

    def flush(self, skip: Subscription | None = None) -> None:
        """Tell what is batched now: a delta per action, and one write per watcher of all its deltas (`skip` aside:
        a watcher joining, told the whole text instead)."""
        if not self._batched:
            return
        batched, self._batched = self._batched, {}
        writes: dict[int, tuple[Sink, list[Subscription], list[bytes]]] = {}
        for (session, action), texts in batched.items():
            subs = self._by_session.get(session)
            if not subs:
                continue
            text = texts[0] if len(texts) == 1 else "".join(texts)
            data = self.notify(DELTA_NOTICE, DeltaNotice(session, action, text))
            for sub in subs:
                if sub.active and not sub.catching_up and sub is not skip:
                    write = writes.get(id(sub.sink))
                    if write is None:
                        writes[id(sub.sink)] = (sub.sink, [sub], [data])
                    else:
                        write[1].append(sub)
                        write[2].append(data)
        for sink, subs_of_sink, datas in writes.values():
            if not sink.offer(datas[0] if len(datas) == 1 else b"".join(datas)):
                for sub in subs_of_sink:
                    if sub.active:
                        self.end_one(sub, "fell too far behind")

    def stream_again(self, session: str, action: int) -> None:
        """The text of `action` starts again from its beginning (an attempt that failed mid-stream is retried, or the
        model is asked again): what it repeats of the text told is not told twice."""
        self.flush()
        kept = self.streams.get(session, {}).get(action)
        if kept is not None:
            kept.again()

    def streamed(self, session: str, action: int) -> None:
        """The stream of `action` is over: its answer was stepped, or the ask stalled or was stopped."""
        self.flush()
        kept = self.streams.get(session, {})
        kept.pop(action, None)
        if not kept:
            self.streams.pop(session, None)

    def live(self, sub: Subscription) -> None:
        self.flush(skip=sub)  # what is batched goes to those watching before sub; sub is told the whole text so far
        for action, kept in self.streams.get(sub.session, {}).items():
            if not sub.sink.offer(self.notify(DELTA_NOTICE, DeltaNotice(sub.session, action, kept.text()))):
                self.end_one(sub, "fell too far behind")
                return


class RecordLog(Protocol):
    """A session's record log and the spend counters, kept by the store (see the methods of
    `devd.storage.store.Store` of the same names)."""

    async def add_record(self, record: Record) -> None: ...

    async def add_records(self, records: Sequence[Record]) -> None: ...

    async def records(
        self, session: str, kinds: tuple[str, ...], after: int = 0, limit: int | None = None
    ) -> list[Record]: ...

    async def recorded(self, kind: str) -> list[str]: ...

    async def forget_records(self, session: str, kind: str, actions: Collection[int]) -> None:
        """Records that no longer say anything (claims whose actions have their results), gone."""

    async def trim_records(self, session: str, kind: str, kept: int) -> int: ...

    async def reserve(
        self, session: str, counters: Sequence[Counter], checks: Sequence[tuple[Counter, int]], tokens: int
    ) -> int | Over:
        """Spend counters, kept by the store (see `devd.storage.store.Store.reserve` and the methods after it)."""

    async def unreserve(self, reservation: int) -> None: ...

    async def charge(
        self, reservation: int | None, counters: Sequence[Counter], tally: Tally, record: Record
    ) -> None: ...

    async def counted(self, counters: Sequence[Counter]) -> list[tuple[int, int]]: ...

    async def tally(self, session: str) -> Tally: ...


class StoreRecordLog:
    """`RecordLog` as the store's own methods, for a class with a `store`."""

    store: Store

    async def add_record(self, record: Record) -> None:
        await self.store.add_record(record)

    async def add_records(self, records: Sequence[Record]) -> None:
        await self.store.add_records(records)

    async def records(
        self, session: str, kinds: tuple[str, ...], after: int = 0, limit: int | None = None
    ) -> list[Record]:
        return await self.store.records(session, kinds, after, limit)

    async def recorded(self, kind: str) -> list[str]:
        return await self.store.recorded(kind)

    async def forget_records(self, session: str, kind: str, actions: Collection[int]) -> None:
        await self.store.forget_records(session, kind, actions)

    async def trim_records(self, session: str, kind: str, kept: int) -> int:
        return await self.store.trim_records(session, kind, kept)

    async def reserve(
        self, session: str, counters: Sequence[Counter], checks: Sequence[tuple[Counter, int]], tokens: int
    ) -> int | Over:
        return await self.store.reserve(session, counters, checks, tokens)

    async def unreserve(self, reservation: int) -> None:
        await self.store.unreserve(reservation)

    async def charge(self, reservation: int | None, counters: Sequence[Counter], tally: Tally, record: Record) -> None:
        await self.store.charge(reservation, counters, tally, record)

    async def counted(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        return await self.store.counted(counters)

    async def tally(self, session: str) -> Tally:
        return await self.store.tally(session)


class Sessions(RecordLog, Protocol):
    """What the runner may do with sessions."""

    async def step(self, session: str, event: Event, key: str | None) -> list[Action]: ...

    async def step_bytes(self, session: str, event: bytes, key: str | None) -> list[Action]:
        """`step` of an event already encoded: observers see these very bytes (`Stepped.event is event`)."""

    async def keyed_turn(self, session: str, key: str) -> Turn | None:
        """The `Turn` step journalled under key; None if no step has that key."""

    async def pending(self, session: str) -> list[Action]: ...

    async def transcript(self, session: str) -> list[Message]: ...

    def seq(self, session: str) -> int | None:
        """The session's last step, None if there is no such session here."""

    async def known(self, session: str) -> bool:
        """Whether the session exists; in a fleet, one another daemon made (or held) is taken for this one first
        (MovedError when a live daemon holds it)."""

    async def steps(self, session: str, since: int, limit: int) -> list[tuple[int, bytes]]:
        """(seq, event) of up to `limit` journalled steps after `since`, in order."""

    async def fork(self, source: str, at: int, name: str) -> str:
        """A new session `name` holding the source's history up to step `at` (`session/fork`)."""

    async def new(self, name: str, config: bytes) -> str:
        """A new session `name` (a child session, `devd.agent.children`), durable."""

    async def close(self, name: str) -> None:
        """Close the session (a parent whose close a stopped daemon left unfinished)."""

    async def back(self, session: str, at: int, kinds: tuple[str, ...]) -> None:
        """Move the session back to step `at` (`devd.sessions.registry.Registry.back`)."""

    def observe(self, observer: Observer) -> None: ...

    def tell(self, session: str, method: str, params: msgspec.Struct) -> None: ...

    def unwatched(self, session: str, reason: str) -> None:
        """End every watcher's subscription to the session (`session/unwatched` with `reason`); the session stays."""

    def stream(self, session: str, action: int, text: str) -> None:
        """Text the model wrote for `action`, to the watchers now and to those that join before `streamed`."""

    def stream_again(self, session: str, action: int) -> None:
        """The text of `action` starts again from its beginning (a retry): what repeats is not told twice."""

    def streamed(self, session: str, action: int) -> None: ...


class RegistryPort(StoreRecordLog):
    """`Sessions` over the daemon's registry and store."""

    def __init__(self, registry: SessionPort, store: Store) -> None:
        assert isinstance(registry.fanout, ObservedFanout), "the daemon builds its registry with an ObservedFanout"
        self.registry = registry
        self.store = store
        self.fanout: ObservedFanout = registry.fanout

    async def step(self, session: str, event: Event, key: str | None) -> list[Action]:
        return await self.step_bytes(session, encode(event), key)

    async def step_bytes(self, session: str, event: bytes, key: str | None) -> list[Action]:
        """Step as a client does; BUSY (another client's call on the session) is waited out."""
        answered = await self._unbusy(session, lambda: self.registry.step(session, event, None, key))
        return decode_actions(answered.actions)

    async def keyed_turn(self, session: str, key: str) -> Turn | None:
        kept = await self.store.keyed(session, key)
        if kept is None:
            return None
        rows = await self.store.steps_since(session, kept.seq - 1, 1)
        if not rows or rows[0].seq != kept.seq:
            return None
        return _turns.decode(rows[0].event).Turn

    async def pending(self, session: str) -> list[Action]:
        return decode_actions(await self._unbusy(session, lambda: self.registry.pending(session)))

    async def transcript(self, session: str) -> list[Message]:
        _, messages = await self._unbusy(session, lambda: self.registry.transcript(session, 0))
        return decode_messages(messages)

    def seq(self, session: str) -> int | None:
        try:
            return self.registry.info(session).seq
        except HandleError:
            return None

    async def known(self, session: str) -> bool:
        if self.seq(session) is not None:
            return True
        if self.registry.fleet is None:
            return False
        try:
            await self._unbusy(session, lambda: self.registry.pending(session))  # adopts it, as any call on it would
        except HandleError:
            return False
        return True

    async def steps(self, session: str, since: int, limit: int) -> list[tuple[int, bytes]]:
        return [(row.seq, row.event) for row in await self.store.steps_since(session, since, limit)]

    async def fork(self, source: str, at: int, name: str) -> str:
        return await self._unbusy(source, lambda: self.registry.fork(source, at, name))

    async def new(self, name: str, config: bytes) -> str:
        return await self.registry.new(name, config)

    async def close(self, name: str) -> None:
        await self._unbusy(name, lambda: self.registry.close(name))

    async def back(self, session: str, at: int, kinds: tuple[str, ...]) -> None:
        await self._unbusy(session, lambda: self.registry.back(session, at, kinds))

    def observe(self, observer: Observer) -> None:
        self.fanout.observers.append(observer)

    def tell(self, session: str, method: str, params: msgspec.Struct) -> None:
        self.fanout.tell(session, self.fanout.notify(method, params))

    def unwatched(self, session: str, reason: str) -> None:
        self.fanout.stopped(session, reason)

    def stream(self, session: str, action: int, text: str) -> None:
        self.fanout.stream(session, action, text)

    def stream_again(self, session: str, action: int) -> None:
        self.fanout.stream_again(session, action)

    def streamed(self, session: str, action: int) -> None:
        self.fanout.streamed(session, action)

    async def _unbusy(self, session: str, call: Callable[[], Awaitable[T]]) -> T:
        """call(), waiting out BUSY (another client's call on the session) for BUSY_WAIT_MAX_S at most: each BUSY
        waits until the call holding the session ends (`wait_free`), then tries again. The call itself is shielded:
        a registry call stopped half-way (between the core's step and its commit) would leave the session's
        instance ahead of what it knows of the disk; a cancel lands once the call has answered."""
        deadline = anyio.current_time() + BUSY_WAIT_MAX_S
        while True:
            try:
                with anyio.CancelScope(shield=True):
                    answered = await call()
                await anyio.lowlevel.checkpoint_if_cancelled()
                return answered
            except BusyError:
                if anyio.current_time() >= deadline:
                    raise
            with anyio.move_on_after(deadline - anyio.current_time()):
                await self.registry.wait_free(session)


_turns = msgspec.json.Decoder(Event)


def action_ids(actions: Sequence[Action]) -> set[int]:
    return {a.id for a in actions}
