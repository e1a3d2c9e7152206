"""A store held in memory, for tests and benchmarks: the `devd.storage.store.Store` contract without a disk.

"Durable" here means "visible to every later read of this object"; nothing survives the process. It keeps all
history (it never prunes) and counts each write as one commit.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import anyio
import msgspec

from devd.errors import NullError
from devd.storage.commits import CommitTimes
from devd.storage.store import (
    Counter,
    Health,
    Keyed,
    Over,
    Record,
    Row,
    SessionRow,
    Step,
    Stored,
    StoreError,
    StoreStats,
    Tally,
)


@dataclass
class _Session:
    config: bytes
    health: Health = Health.OK
    reason: str | None = None
    journal: dict[int, Step] = field(default_factory=dict)
    at: dict[int, float] = field(default_factory=dict)  # when each step was journalled
    records: list[Record] = field(default_factory=list)
    spend: dict[Counter, list[int]] = field(default_factory=dict)  # its turns' and its own: [spent, reserved]
    tally: Tally = field(default_factory=Tally)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)


class MemoryStore:
    reopened = 0  # it has no disk to fault

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        self._times = CommitTimes()
        self.fail_writes: str | None = None  # tests: make every write fail with this message
        self._days: dict[Counter, list[int]] = {}  # [spent, reserved] of each profile's day
        # Each call's counters and tokens, and the sessions it reserved on (one made again since is another's).
        self._reservations: dict[int, tuple[list[Counter], int, list[_Session | None]]] = {}
        self._numbers = itertools.count(1)

    async def run(self) -> None:
        await anyio.sleep_forever()

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def statistics(self) -> StoreStats:
        return self._times.statistics()

    async def backup(self, path: str) -> int:
        raise NullError("this daemon keeps its sessions in memory: there is nothing on disk to back up")

    def _committed(self, started: float) -> None:
        if self.fail_writes is not None:
            raise StoreError(f"the state could not be made durable and nothing of it was applied: {self.fail_writes}")
        self._times.add(time.perf_counter() - started)

    async def create(self, name: str, config: bytes, snapshot: bytes | None = None) -> None:
        self._committed(time.perf_counter())
        session = self._sessions[name] = _Session(config)
        if snapshot is not None:
            session.journal[0] = Step(name, 0, b"", None, snapshot=snapshot)

    async def append(self, step: Step) -> None:
        self._committed(time.perf_counter())
        session = self._sessions.get(step.session)
        if session is None or step.seq in session.journal:
            raise StoreError(f"step {step.seq} of {step.session!r} cannot be journalled: no such session or seq")
        session.journal[step.seq] = step
        session.at[step.seq] = time.time()
        session.last_used = time.time()

    async def save_snapshot(self, name: str, seq: int, snapshot: bytes) -> None:
        self._committed(time.perf_counter())
        session = self._sessions.get(name)
        if session is None or seq not in session.journal:
            return
        if any(s.snapshot is not None for n, s in session.journal.items() if n >= seq):
            return
        session.journal[seq] = msgspec.structs.replace(session.journal[seq], snapshot=snapshot)

    async def set_health(self, name: str, health: Health, reason: str | None) -> None:
        self._committed(time.perf_counter())
        if session := self._sessions.get(name):
            session.health, session.reason = health, reason

    async def delete(self, name: str) -> None:
        self._committed(time.perf_counter())
        self._sessions.pop(name, None)

    async def fork(self, source: str, at: int, name: str, snapshot: bytes | None) -> None:
        self._committed(time.perf_counter())
        src = self._sessions.get(source)
        if src is None:
            raise StoreError(f"there is no session {source!r} to fork")
        copy = _Session(src.config)
        copy.records = [msgspec.structs.replace(r, session=name) for r in src.records if r.seq <= at]
        for seq, step in src.journal.items():
            if seq <= at:
                copy.journal[seq] = msgspec.structs.replace(step, session=name)
        if snapshot is not None:
            kept = copy.journal.get(at) or Step(name, at, b"", None)
            copy.journal[at] = msgspec.structs.replace(kept, snapshot=snapshot)
        self._sessions[name] = copy

    async def truncate(self, name: str, at: int, kinds: tuple[str, ...]) -> None:
        self._committed(time.perf_counter())
        session = self._sessions.get(name)
        if session is None:
            return
        for seq in [seq for seq in session.journal if seq > at]:
            del session.journal[seq]
            session.at.pop(seq, None)
        session.records = [r for r in session.records if r.seq <= at or r.kind not in kinds]

    async def sessions(self) -> list[SessionRow]:
        return [
            SessionRow(name, s.health, s.reason, max(s.journal, default=0), s.created, s.last_used)
            for name, s in sorted(self._sessions.items())
        ]

    async def load(self, name: str) -> Stored | None:
        return self._load(name, None)

    async def load_at(self, name: str, at: int) -> Stored | None:
        return self._load(name, at)

    def _load(self, name: str, at: int | None) -> Stored | None:
        session = self._sessions.get(name)
        if session is None:
            return None
        upto = max(session.journal, default=0) if at is None else at
        saved = [s for seq, s in session.journal.items() if s.snapshot is not None and seq <= upto]
        if not saved and 0 in session.journal:
            return None  # restored from a snapshot no longer kept: its history cannot be rebuilt from the config
        base = max(saved, key=lambda s: s.seq) if saved else None
        base_seq = base.seq if base else 0
        journal = [_row(s) for seq, s in sorted(session.journal.items()) if base_seq < seq <= upto]
        if [row.seq for row in journal] != list(range(base_seq + 1, upto + 1)):
            return None
        snapshot = base.snapshot if base else None
        return Stored(name, session.config, snapshot, base_seq, session.health, session.reason, journal)

    async def keyed(self, name: str, key: str) -> Keyed | None:
        session = self._sessions.get(name)
        for step in session.journal.values() if session else ():
            if step.key == key:
                assert step.digest is not None
                return Keyed(step.seq, step.digest, step.actions, step.answer)
        return None

    async def steps_since(self, name: str, since: int, limit: int) -> list[Row]:
        session = self._sessions.get(name)
        steps = sorted(session.journal.items()) if session else []
        return [_row(s) for seq, s in steps if seq > since][:limit]

    async def journalled(self, name: str, since: int, limit: int) -> dict[int, float]:
        session = self._sessions.get(name)
        times = sorted(session.at.items()) if session else []
        return dict([(seq, at) for seq, at in times if seq > since][:limit])

    async def add_records(self, records: Sequence[Record]) -> None:
        for record in records:
            await self.add_record(record)

    async def add_record(self, record: Record) -> None:
        self._committed(time.perf_counter())
        session = self._sessions.get(record.session)
        if session is None:
            return  # deleted meanwhile: as the other stores, dropped
        n = session.records[-1].n + 1 if session.records else 1
        session.records.append(msgspec.structs.replace(record, at=time.time(), n=n))

    async def records(
        self, name: str, kinds: tuple[str, ...] | None = None, after: int = 0, limit: int | None = None
    ) -> list[Record]:
        session = self._sessions.get(name)
        found = [r for r in (session.records if session else ()) if r.n > after and (kinds is None or r.kind in kinds)]
        return found if limit is None else found[:limit]

    async def forget_records(self, name: str, kind: str, actions: Collection[int]) -> None:
        self._committed(time.perf_counter())
        session = self._sessions.get(name)
        if session is None or not session.records:
            return
        newest = session.records[-1]
        session.records = [r for r in session.records if r is newest or r.kind != kind or r.action not in actions]

    async def trim_records(self, name: str, kind: str, kept: int) -> int:
        self._committed(time.perf_counter())
        session = self._sessions.get(name)
        if session is None:
            return 0
        of_kind = [r.n for r in session.records if r.kind == kind]
        going = set(of_kind[: max(0, len(of_kind) - max(1, kept))])
        session.records = [r for r in session.records if r.n not in going]
        return len(going)

    async def recorded(self, kind: str) -> list[str]:
        return [name for name, s in sorted(self._sessions.items()) if any(r.kind == kind for r in s.records)]

    def _counter(self, counter: Counter) -> list[int] | None:
        """[spent, reserved] of the counter, made on first use; None for one of a session that does not exist."""
        if counter.scope == "day":
            return self._days.setdefault(counter, [0, 0])
        session = self._sessions.get(counter.owner)
        return None if session is None else session.spend.setdefault(counter, [0, 0])

    async def reserve(
        self, session: str, counters: Sequence[Counter], checks: Sequence[tuple[Counter, int]], tokens: int
    ) -> int | Over:
        self._committed(time.perf_counter())
        for check, (counter, limit) in enumerate(checks):
            spent, reserved = self._counter(counter) or (0, 0)
            if spent + reserved + tokens > limit:
                if owner := self._sessions.get(session):
                    owner.tally = msgspec.structs.replace(owner.tally, refused=owner.tally.refused + 1)
                return Over(check, spent, reserved)
        number = next(self._numbers)
        held = list(dict.fromkeys(counters))
        for counter in held:
            if (kept := self._counter(counter)) is not None:
                kept[1] += tokens
        self._reservations[number] = (held, tokens, [self._sessions.get(c.owner) for c in held])
        return number

    async def unreserve(self, reservation: int) -> None:
        self._committed(time.perf_counter())
        self._release(reservation)

    def _release(self, reservation: int) -> None:
        held, tokens, owners = self._reservations.pop(reservation, ([], 0, []))
        for counter, owner in zip(held, owners, strict=True):
            mine = counter.scope == "day" or self._sessions.get(counter.owner) is owner
            if mine and (kept := self._counter(counter)) is not None:
                kept[1] -= tokens

    async def charge(self, reservation: int | None, counters: Sequence[Counter], tally: Tally, record: Record) -> None:
        self._committed(time.perf_counter())
        await self.add_record(record)
        if reservation is not None:
            self._release(reservation)
        for counter in dict.fromkeys(counters):
            if (kept := self._counter(counter)) is not None:
                kept[0] += tally.input_tokens + tally.output_tokens
        if session := self._sessions.get(record.session):
            summed = zip(msgspec.structs.astuple(session.tally), msgspec.structs.astuple(tally), strict=True)
            session.tally = Tally(*(a + b for a, b in summed))

    async def counted(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        found = [self._counter(counter) or [0, 0] for counter in counters]
        return [(spent, reserved) for spent, reserved in found]

    async def tally(self, session: str) -> Tally:
        owner = self._sessions.get(session)
        return Tally() if owner is None else owner.tally


def _row(step: Step) -> Row:
    return Row(step.seq, step.event, step.actions, step.answer)
