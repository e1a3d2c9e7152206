"""What devd needs from durable storage, as one interface, and the records that cross it.

A store keeps, per session, a row (its config and health) and a journal of the steps it answered: the event, the
actions or only their digest (a `Model` ask carries the whole transcript, so keeping every answer would make a
session's bytes grow with the square of its length; the core is deterministic, so an answer not kept is derived again
from the events), the idempotency key and the event's digest; now and then a step also carries the snapshot taken
after it. What rebuilds a session is its latest snapshot plus the journal after it; rows before that are history for
watchers and keys, kept up to the limits the store was opened with, together with the snapshot they are derived from
(every row from that anchor on can be rebuilt with `load_at`; keyed rows older than it keep their key and digests, and
an answer among them not kept whole can no longer be derived).

What every implementation promises (tests/test_store.py checks each of them against every implementation):
- a write returns only once it is durable; a write that cannot be made durable raises `StoreError`, and nothing in
  it is visible afterwards; a step's snapshot alone is a cache of what the journal derives, which a store may make
  durable after the step returns, or drop (SQLite writes a large one to a file afterwards): `load` then starts from
  an older snapshot and replays more;
- reads see every write that has returned;
- every failure crosses this interface as `StoreError`, never as the backend's own exception.

`run()` must be running (in the daemon's task group) for writes to complete.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple, Protocol

import msgspec

from devd.errors import StoreError

__all__ = [
    "Counter",
    "Fleet",
    "Health",
    "Keyed",
    "Over",
    "Record",
    "Row",
    "SessionRow",
    "Step",
    "Store",
    "StoreError",
    "StoreStats",
    "Stored",
    "Tally",
    "answer_digest",
]


class Health(enum.Enum):
    """A stored session's standing, as kept on disk."""

    OK = "ok"
    ENDED = "ended"  # its deadline passed or its answer was lost; `recover` brings it back
    POISONED = "poisoned"  # it trapped, or rebuilding it failed; `recover` brings it back


def answer_digest(actions: bytes) -> bytes:
    """What a journal keeps of an answer it does not keep whole: enough to check the answer derived again."""
    return hashlib.sha256(actions).digest()


class Step(msgspec.Struct, frozen=True):
    """One answered step, as journalled."""

    session: str
    seq: int
    event: bytes
    actions: bytes | None  # None: not kept, derived again from the events when asked for
    key: str | None = None
    digest: bytes | None = None  # of the event, for keys: see `devd.sessions.history.digest`
    snapshot: bytes | None = None  # the core's state after this step, when one was taken
    answer: bytes | None = None  # `answer_digest(actions)`; always set when the actions are not kept


class Row(NamedTuple):
    """A journalled step as read back."""

    seq: int
    event: bytes
    actions: bytes | None  # None: not kept; derive it from the snapshot before it and the events since
    answer: bytes | None  # the answer's digest; None only in rows from before digests were kept (format 3)


class Stored(msgspec.Struct, frozen=True):
    """What a session is on disk: enough to rebuild it exactly."""

    name: str
    config: bytes
    snapshot: bytes | None
    snapshot_seq: int
    health: Health
    reason: str | None
    journal: list[Row]  # after the snapshot, in order

    @property
    def seq(self) -> int:
        return self.journal[-1][0] if self.journal else self.snapshot_seq


class Keyed(msgspec.Struct, frozen=True):
    """A keyed step already answered: what a retry with the same key is answered."""

    seq: int
    digest: bytes
    actions: bytes | None  # None: not kept; derived again (`load_at(seq - 1)` and the row at seq rebuild it)
    answer: bytes | None


class SessionRow(msgspec.Struct, frozen=True):
    """A session as listed at start: its name, health, last step, when it was made and when it last stepped."""

    name: str
    health: Health
    reason: str | None
    seq: int
    created: float  # wall-clock seconds
    last_used: float  # of its last step (its creation if none)


class Record(msgspec.Struct, frozen=True):
    """One entry of a session's record log: what the daemon itself did for the session beside its journal (the agent
    runtime's bindings, claims and inserted exchanges; later approvals, usage and traces). `kind` says what `body`
    (JSON) is, `action` the action it is about (0: none), `seq` the session's last step when it was written (a fork
    at step N carries the records written at or before N). A store sets `at` (wall-clock seconds) and `n` (the
    record's number in its session's log, from 1, in order) when it writes one; what is given for them is ignored."""

    session: str
    seq: int
    kind: str
    action: int
    body: bytes
    at: float = 0.0
    n: int = 0


class Counter(NamedTuple):
    """A spend counter: what one scope has spent (tokens) and has reserved for calls in flight. `scope` is "turn"
    (`owner` the session, `part` the turn), "session" (`part` "") or "day" (`owner` the agent profile, `part` the UTC
    day). A session's own counters go with it; a day's stay."""

    scope: str
    owner: str
    part: str


class Tally(msgspec.Struct, frozen=True):
    """A session's usage, kept on its "session" counter: tokens (the provider's counts, else devd's estimate),
    calls charged, and calls a ceiling refused."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    calls: int = 0
    refused: int = 0


class Over(NamedTuple):
    """A reservation refused: the check (its index) it would pass, and what that counter had spent and reserved."""

    check: int
    spent: int
    reserved: int


class StoreStats(msgspec.Struct, frozen=True):
    commits: int
    commit_ms_p50: float
    commit_ms_p99: float
    reopened: int = 0  # times the store reopened its database after a write fault


class Store(Protocol):
    # Times the store reopened itself after a write fault (a failed write or fsync), as the event loop knows it. The
    # writes of the fault were answered with errors; what is on disk since may hold some of them, so a registry that
    # sees this change rebuilds its sessions from disk. Stores that never stop taking writes keep it 0.
    reopened: int

    async def run(self) -> None:
        """Complete writes for ever (group commit); cancelled at shutdown, after which `flush` commits the rest."""

    async def flush(self) -> None:
        """Complete whatever was handed to the store: pending writes committed and the pruning they call for done,
        snapshots written afterwards (SQLite's files) written or dropped."""

    def close(self) -> None:
        """Release the store's resources; nothing may be called after."""

    async def create(self, name: str, config: bytes, snapshot: bytes | None = None) -> None:
        """A new session (replacing any leftover of that name), starting from config or from snapshot at seq 0."""

    async def append(self, step: Step) -> None:
        """Journal an answered step (and its snapshot, if any)."""

    async def save_snapshot(self, name: str, seq: int, snapshot: bytes) -> None:
        """Keep `snapshot` as the session's state after step `seq` (its latest), so a rebuild replays nothing: a
        cache, taken when the daemon stops. Dropped without a word when that step has a snapshot already, a later one
        has, or the session was deleted, made again or (in a fleet) is no longer this daemon's."""

    async def set_health(self, name: str, health: Health, reason: str | None) -> None: ...

    async def delete(self, name: str) -> None:
        """The session and all its history, gone."""

    async def fork(self, source: str, at: int, name: str, snapshot: bytes | None) -> None:
        """A new session `name` whose journal (keys and snapshots included) is the source's up to step `at`, with
        `snapshot` (the source's state at `at`; None when the state at `at` is the config's) as its starting point;
        the source is untouched."""

    async def truncate(self, name: str, at: int, kinds: tuple[str, ...]) -> None:
        """The session's steps after `at` gone, with its records of `kinds` written after it (`Record.seq` > `at`);
        its other records stay, as does the history up to `at`. The caller has checked that `load_at(name, at)` can
        rebuild it (so `load` does, afterwards). Nothing happens to a session that does not exist."""

    async def sessions(self) -> list[SessionRow]:
        """Every stored session, by name."""

    async def load(self, name: str) -> Stored | None:
        """The session as it is on disk, or None if there is none of that name."""

    async def load_at(self, name: str, at: int) -> Stored | None:
        """The session as it was at step `at`: the latest snapshot at or before it and the journal up to it; None
        when that history is no longer kept (see `Stored.snapshot_seq` of `load` for what is)."""

    async def keyed(self, name: str, key: str) -> Keyed | None: ...

    async def steps_since(self, name: str, since: int, limit: int) -> list[Row]:
        """Up to `limit` journalled steps after `since`, in order."""

    async def journalled(self, name: str, since: int, limit: int) -> dict[int, float]:
        """When each of those steps was journalled (wall-clock seconds), by seq: what a watcher catching up on the
        history is told as the step's time. A step from before times were kept (format 3) is missing."""

    def statistics(self) -> StoreStats: ...

    # -- the record log: durable like steps, deleted with the session, carried by a fork up to its step; a record's
    # number (`Record.n`) is never given twice in a session, so a reader may page by it

    async def add_record(self, record: Record) -> None:
        """Keep a record in its session's log; returns once it is durable. A record of a session that does not exist
        (deleted meanwhile) is dropped."""

    async def add_records(self, records: Sequence[Record]) -> None:
        """Keep several records as `add_record` keeps one, in one write: durable together, in order (an effect's
        ledger and trace records, which its result's step waits for)."""

    async def records(
        self, name: str, kinds: tuple[str, ...] | None = None, after: int = 0, limit: int | None = None
    ) -> list[Record]:
        """The session's records (those of `kinds`, or all) numbered past `after`, in the order they were written, at
        most `limit` of them. Found by (session, kind): records of other kinds cost nothing to skip."""

    async def forget_records(self, name: str, kind: str, actions: Collection[int]) -> None:
        """The session's records of `kind` about these actions, gone (a claim whose action has its result). Its
        newest record always stays, so a record's number is never given again."""

    async def trim_records(self, name: str, kind: str, kept: int) -> int:
        """Of the session's records of `kind` only the newest `kept` (at least 1) stay; how many went."""

    async def recorded(self, kind: str) -> list[str]:
        """The sessions with at least one record of `kind`, by name."""

    async def backup(self, path: str) -> int:
        """A consistent copy of everything stored, written to the new file `path` (made atomically, fsync'd), while
        the store keeps serving; its size in bytes. A store with nothing on disk of its own raises NullError."""

    # -- spend: counters shared by every daemon of the store, so a restart, a second daemon of a fleet or a session
    # taken over by another one spends nothing twice. A reservation is a call in flight; one left by a daemon that
    # stopped is released when it starts again (in a fleet, also by any daemon that joins after its lease lapsed).

    async def reserve(
        self, session: str, counters: Sequence[Counter], checks: Sequence[tuple[Counter, int]], tokens: int
    ) -> int | Over:
        """Reserve `tokens` on every one of `counters` if, for each check (a counter and its limit, in order), what
        it has spent and reserved plus `tokens` stays within the limit: the reservation's number. Else nothing is
        reserved, the session's `refused` counts one more, and the first check it would pass is told. Atomic against
        every other daemon of the store: two calls cannot pass a limit together."""

    async def unreserve(self, reservation: int) -> None:
        """The call is over and charged nothing: its reservation goes (once; again, nothing happens)."""

    async def charge(self, reservation: int | None, counters: Sequence[Counter], tally: Tally, record: Record) -> None:
        """A call's usage, in one transaction: `record` kept (as `add_record`), the reservation (if any) released, its
        tokens (input + output) added to every counter, and `tally` to the session's. Counters of a session that no
        longer exists are left alone; a day's always counts."""

    async def counted(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        """What each counter has spent and reserved (0 and 0 for one never used)."""

    async def tally(self, session: str) -> Tally:
        """The session's usage (zeros for one with none)."""


class Fleet(Protocol):
    """What a store shared by several daemons adds (devd.storage.postgres): which one of them steps each session. Its
    writes
    are fenced: one for a session another daemon took over fails with MovedError, never commits."""

    node: str  # this daemon's name in the fleet

    async def connect(self) -> None:
        """Reach the database, bring its format up to date, and join the fleet (a fresh lease)."""

    async def acquire(self, name: str) -> int | None:
        """Take the session for this daemon (its epoch), or None if there is no such session; MovedError naming the
        owner when another live daemon holds it."""

    def held(self, name: str) -> int | None:
        """The epoch this daemon holds the session under, as far as it knows; None if it does not hold it."""

    def current(self, name: str) -> bool:
        """Whether that epoch is known current: no other daemon can have taken the session since it was taken (this
        daemon's lease has not lapsed meanwhile). A live instance answers reads only then."""

    async def release(self, names: Iterable[str]) -> None:
        """Give up these sessions (those this daemon holds), so others take them at once (drain)."""

    async def release_all(self) -> None:
        """Give up every session this daemon holds (at shutdown, once no call runs)."""


def percentile_ms(seconds: list[float], q: float) -> float:
    """The q-quantile of a list of durations in seconds, in milliseconds (0 for none)."""
    if not seconds:
        return 0.0
    ordered = sorted(seconds)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000, 3)
