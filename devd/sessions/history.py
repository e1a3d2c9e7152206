"""A session's history as clients see it again: keyed steps replayed from the journal, answers kept as digests
derived again, and watchers caught up on every journalled step after the one they name.

What it promises: a keyed step already answered is replayed byte for byte (an answer kept as a digest is derived
again) and never executed twice; the same key with another event is CONFLICT, and so is a key whose answer is no
longer kept at all. A watcher catching up sees every step after `since`, then the live ones, none missing and none
twice; or, when that history is no longer kept, a clear error (or its end, if some of it was already sent).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from devd.errors import ConflictError, InvalidParamsError
from devd.host import Instance
from devd.sessions.calls import rebuild, replay
from devd.sessions.entry import Answered, no_such
from devd.sessions.watchers import Sink, Stepped, Subscription
from devd.storage.store import Row

if TYPE_CHECKING:
    from devd.sessions.registry import Registry

CATCH_UP_ROWS = 256  # journal rows read at a time when a watcher asks for history


def digest(event: bytes) -> bytes:
    """The event's identity for key conflicts: its JSON with members sorted, so whitespace does not matter."""
    try:
        canonical = msgspec.json.encode(msgspec.json.decode(event), order="sorted")
    except (msgspec.DecodeError, RecursionError):
        canonical = event
    return hashlib.sha256(canonical).digest()


class History:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def replayed(self, name: str, key: str, event_digest: bytes) -> Answered | None:
        """The answer of the step journalled under `key`, if there is one; CONFLICT if it was another event's."""
        kept = await self.registry.store.keyed(name, key)
        if kept is None:
            return None
        if kept.digest != event_digest:
            raise ConflictError(
                f"key {key!r} was used for another event (step {kept.seq}); use a new key for a new event"
            )
        answer = kept.actions
        if answer is None:
            answer = await self._derive(name, kept.seq, key)
        return Answered(answer, True)

    async def _derive(self, name: str, seq: int, key: str) -> bytes:
        """The answer to journalled step `seq`, kept as a digest: its event as journalled (a retry's may be spelled
        otherwise) stepped again on the state before it."""
        registry = self.registry
        rows = await registry.store.steps_since(name, seq - 1, 1)
        before = await registry.store.load_at(name, seq - 1)
        if before is None or not rows or rows[0].seq != seq:
            raise ConflictError(
                f"key {key!r} was answered at step {seq}, and that answer is no longer kept (only recent history "
                "is); the step is not run twice: `session/pending` shows what the session waits for"
            )
        row = rows[0]

        def derive() -> bytes:
            instance = rebuild(registry.core, before, registry.call_timeout_s)
            try:
                return replay(instance, row, registry.call_timeout_s)
            finally:
                instance.close()

        return await registry.runner.off_loop(derive)

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription:
        """Subscribe sink to name's steps: from now on, or first every journalled step after `since`."""
        registry = self.registry
        fanout, store = registry.fanout, registry.store
        if registry.fleet is not None:  # only on the daemon that holds the session (its steps are made there)
            await registry.fleet_sessions.hold(name)
        entry = registry.get(name)
        if entry is None:
            raise no_such(name)
        if since is None:
            return fanout.subscribe(name, sink, entry.seq, catching_up=False)
        if since > entry.seq:
            raise InvalidParamsError(
                f"session {name!r} has answered {entry.seq} steps; watch since {entry.seq} or earlier"
            )
        sub = fanout.subscribe(name, sink, since, catching_up=True)
        deriver = _Deriver(registry, name)
        try:
            while sub.active:
                rows = await store.steps_since(name, sub.last_seq, CATCH_UP_ROWS)
                whole = [r.seq for r in rows] == list(range(sub.last_seq + 1, sub.last_seq + 1 + len(rows)))
                cut = len(rows) if whole else next(i for i, r in enumerate(rows) if r.seq != sub.last_seq + 1 + i)
                gap = None if whole else rows[cut].seq
                rows = rows[:cut]
                answers = await deriver.answers(rows)
                times = await store.journalled(name, sub.last_seq, len(rows)) if rows else {}
                if answers is None:  # what derives these answers is pruned; the latest snapshot derives what follows
                    kept = await store.load(name)
                    if kept is None:  # closed meanwhile (here, or by another daemon of a fleet), not pruned
                        if sub.last_seq == since:
                            raise no_such(name)
                        if sub.active:  # a close here has told it already
                            fanout.end_one(sub, "closed")
                        return sub
                    gap = kept.snapshot_seq + 1
                for row, actions in zip(rows, answers or (), strict=False):
                    at = times.get(row.seq, entry.created)  # a step from before times were kept: its session's birth
                    if not fanout.deliver(sub, row.seq, fanout.encode(Stepped(name, row.seq, row.event, actions, at))):
                        return sub
                if gap is not None:  # pruned: a watcher is promised every step after since, or nothing
                    if sub.last_seq == since:
                        raise InvalidParamsError(
                            f"the history of {name!r} before step {gap} is no longer kept; watch since {gap - 1} "
                            "or later"
                        )
                    fanout.end_one(sub, f"the history before step {gap} is no longer kept")
                    return sub
                if len(rows) < CATCH_UP_ROWS and sub.last_seq >= entry.seq:
                    break  # no await since the check: no step can slip between history and live
                if not rows:
                    break  # history was pruned past what is durable; nothing more to read
        except BaseException:
            fanout.unsubscribe(sub)
            raise
        finally:
            deriver.close()
        fanout.caught_up(sub)
        return sub


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
