"""The fleet's store: sessions in one PostgreSQL database shared by many daemons, each session stepped by one daemon
at a time. The only module that touches PostgreSQL.

It keeps every promise of `devd.storage.store.Store` (tests/test_store.py runs the same suite against it), and adds
ownership:

- **Nodes and leases.** Each daemon is a node: a row (`nodes`: id, address, `lease_until`) it registers when it opens
  and renews every ttl/3 while `run()` runs, on the database's clock (`now()`), so the daemons' clocks need not agree.
  Its own deadline is on its monotonic clock, counted from before it sent the renewal that succeeded: the database's
  lease cannot end before it. Past that deadline `lease_valid()` is False and every write is refused (fail closed)
  until a renewal succeeds again.
- **Epochs.** Each session row names its owner and an `epoch`, the fencing token, drawn from one sequence (so a token
  is never reused, not even by a session deleted and made again), and its `head_seq`. A node acquires a session it
  does not hold (explicitly with `acquire`, or on its first write to it) by drawing a new epoch in one
  `UPDATE … RETURNING`, allowed only when nobody owns the session, this node does, or the owner's lease has ended.
  When a live node owns it, the answer is `MovedError` naming that node and its address.
- **Fencing.** Every journal append compare-and-sets (owner, epoch, head_seq) in the statement that inserts the row.
  A node paused past its lease (GC, SIGSTOP, a partition) that wakes believing it owns a session commits nothing:
  zero rows updated means fenced, and the write fails with `MovedError`, never an acknowledgement. The appends of a
  group commit are one statement (arrays through `unnest`), fenced still row by row: a fenced row fails its own
  write, the others of the batch commit.
- **Drain.** `release` and `release_all` set the owner to none, so another node takes the sessions at once.
- **Forks.** A fork copies its source's journal a few MiB a commit (others' steps commit in between, rather than wait
  behind one commit of the whole history): its session row is made first, claimed by this node under a new epoch with
  head `UNMADE`, which no read lists, loads or takes; every copy is fenced on that claim, and the last commit sets the
  head. A fork cut short is dropped then; one left by a crash, when a daemon next connects and its owner's lease has
  ended (or the owner is that daemon).
- **Spend.** The spend counters are rows every node shares, not fenced (what was spent stays spent whoever holds
  the session next). A reservation is one conditional `UPDATE … SET reserved = reserved + n WHERE spent + reserved +
  n <= limit` per counter, in one order, under a savepoint: two nodes cannot pass a limit together. A reservation
  row names its node: a node joining releases its own left from before and those of nodes whose lease ended, and a
  reservation that would pass a limit first releases those of nodes whose lease ended.

Writes go through the group commit of `devd.storage.commits` (on the event loop): writes queued while a commit runs
share the next one, and a write returns only once its transaction committed (PostgreSQL's own fsync;
`synchronous_commit` must stay on). Every transaction runs READ COMMITTED on PostgreSQL (fencing is one statement
each; see ISOLATIONS) or SERIALIZABLE (as CockroachDB always does), and is retried whole on a serialization failure
(40001) or a deadlock (40P01). The SQL sticks to what CockroachDB and YugabyteDB also accept: no LISTEN/NOTIFY, no
advisory locks, no stored procedures. Every failure crosses as `StoreError` (or `MovedError`), never as psycopg's
own: `_failing` and `_failed` are the boundary.

Connections are the store's own (psycopg 3, async, on anyio's asyncio backend): one for commits, one for the lease,
a few for reads and acquisitions. No pool runs tasks of its own, so `close()` needs no event loop.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import msgspec
import psycopg
import structlog
from psycopg import pq
from psycopg.rows import TupleRow

from devd import failpoints
from devd.errors import DevdError, MovedError, NullError
from devd.storage.boundary import map_exceptions
from devd.storage.commits import FORK_COPY_BYTES, GroupCommit, spans
from devd.storage.migrations import Migrations
from devd.storage.retention import Retention
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

__all__ = ["MIGRATIONS", "Owner", "PostgresStore", "default_node"]

log = structlog.get_logger("devd.storage.postgres")

T = TypeVar("T")
Conn = psycopg.AsyncConnection[TupleRow]

LEASE_TTL_S = 10.0
TIMEOUT_S = 10.0  # any one transaction, connecting included: a database that hangs fails writes, it does not hold them
READERS_MAX = 4  # connections for reads and acquisitions; commits and the lease have one each
ROWS_PER_STATEMENT = 1000  # steps in one append statement; arrays have no parameter limit, this bounds its bytes
RETRIES_MAX = 10  # attempts of a transaction that keeps meeting serialization failures
RETRY_BACKOFF_S = 0.002  # doubled per attempt, jittered, so that the transactions in conflict do not meet again
RETRYABLE = frozenset({"40001", "40P01"})  # serialization failure, deadlock detected: the transaction did not commit
ENDED = frozenset({"57P01", "57P02", "57P03"})  # the server ended the connection (or is starting): nothing committed
# Two daemons migrating at once: the second's insert of the version row, or its `CREATE TABLE IF NOT EXISTS` (which
# races in PostgreSQL's catalog), fails; it reads the version again.
RACED = RETRYABLE | {"23505", "42P07", "42710"}  # unique violation, duplicate table, duplicate object
ROW = "seq, event, actions, answer"  # the columns of a `Row`
# Fencing needs no more than READ COMMITTED: every fenced write is one statement whose WHERE (owner, epoch, head_seq)
# PostgreSQL checks again on the row it locks. SERIALIZABLE (what CockroachDB always runs) also works, retried on
# 40001, but two daemons creating sessions at once meet false conflicts on shared index pages often enough to fail
# a write after every retry (measured by `bench fleet`), so PostgreSQL runs READ COMMITTED unless asked otherwise.
ISOLATIONS = {"read committed": "read committed", "serializable": "serializable"}

# The database's format, one migration per version; `devd_schema` records those applied, one row each, run by
# `devd.storage.migrations` at open; daemons opening one database at once are safe (the version's row is inserted
# first, so only one of them applies it). Never edit a migration that has shipped: add the next one.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: nodes and their leases, sessions with their owner and fencing epoch, the journal
    (
        "CREATE TABLE nodes (id TEXT PRIMARY KEY, address TEXT NOT NULL, lease_until TIMESTAMPTZ NOT NULL)",
        "CREATE SEQUENCE epochs",
        """CREATE TABLE sessions (
            name TEXT PRIMARY KEY,
            config BYTEA NOT NULL,
            state TEXT NOT NULL DEFAULT 'ok',
            reason TEXT,
            created DOUBLE PRECISION NOT NULL,
            last_used DOUBLE PRECISION NOT NULL,
            owner TEXT,
            epoch BIGINT NOT NULL,
            head_seq BIGINT NOT NULL
        )""",
        "CREATE INDEX sessions_owner ON sessions (owner)",
        """CREATE TABLE journal (
            session TEXT NOT NULL,
            seq BIGINT NOT NULL,
            epoch BIGINT NOT NULL,
            key TEXT,
            digest BYTEA,
            event BYTEA NOT NULL,
            actions BYTEA,
            answer BYTEA,
            snapshot BYTEA,
            at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session, seq)
        )""",
        "CREATE INDEX journal_key ON journal (session, key) WHERE key IS NOT NULL",
    ),
    # 2: each session's record log (devd.storage.store.Record): what the daemon did for it beside its journal
    (
        """CREATE TABLE records (
            session TEXT NOT NULL,
            n BIGINT NOT NULL,
            seq BIGINT NOT NULL,
            kind TEXT NOT NULL,
            action BIGINT NOT NULL,
            body BYTEA NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session, n)
        )""",
        "CREATE INDEX records_kind ON records (kind, session)",
    ),
    # 3: a session's records of a kind found without reading its others (a trace of 300,000 records made every read
    # of its binding read them all)
    ("CREATE INDEX records_session_kind ON records (session, kind, n)",),
    # 4: spend counters (devd.storage.store.Counter) shared by the fleet, and the reservations of calls in flight (by
    # node, released when it joins again or by any node joining after its lease lapsed); counted at once from the
    # usage and refusal records kept so far (a fork's copies of its source's records count for the source only)
    (
        """CREATE TABLE spend (
            scope TEXT NOT NULL,
            owner TEXT NOT NULL,
            part TEXT NOT NULL,
            spent BIGINT NOT NULL DEFAULT 0,
            reserved BIGINT NOT NULL DEFAULT 0,
            input_tokens BIGINT NOT NULL DEFAULT 0,
            output_tokens BIGINT NOT NULL DEFAULT 0,
            cached_tokens BIGINT NOT NULL DEFAULT 0,
            calls BIGINT NOT NULL DEFAULT 0,
            refused BIGINT NOT NULL DEFAULT 0,
            PRIMARY KEY (scope, owner, part)
        )""",
        """CREATE TABLE reservations (
            id BIGINT NOT NULL,
            scope TEXT NOT NULL,
            owner TEXT NOT NULL,
            part TEXT NOT NULL,
            tokens BIGINT NOT NULL,
            node TEXT NOT NULL,
            PRIMARY KEY (id, scope, owner, part)
        )""",
        "CREATE INDEX reservations_node ON reservations (node)",
        "CREATE SEQUENCE reservation_numbers",
        """CREATE TEMP VIEW used AS SELECT session, b->>'profile' AS profile, b->>'turn' AS turn, b->>'day' AS day,
            (b->'usage'->>'input_tokens')::bigint AS i, (b->'usage'->>'output_tokens')::bigint AS o,
            COALESCE((b->'usage'->>'cached_tokens')::bigint, 0) AS c
            FROM (SELECT session, convert_from(body, 'UTF8')::jsonb AS b FROM records WHERE kind = 'usage') AS u
            WHERE b->>'session' = session""",
        """INSERT INTO spend (scope, owner, part, spent, input_tokens, output_tokens, cached_tokens, calls)
            SELECT 'session', session, '', SUM(i + o), SUM(i), SUM(o), SUM(c), COUNT(*) FROM used GROUP BY session""",
        "INSERT INTO spend (scope, owner, part, spent) SELECT 'turn', session, turn, SUM(i + o) FROM used "
        "GROUP BY session, turn",
        "INSERT INTO spend (scope, owner, part, spent) SELECT 'day', profile, day, SUM(i + o) FROM used "
        "GROUP BY profile, day",
        """INSERT INTO spend (scope, owner, part, refused) SELECT 'session', session, '', COUNT(*)
            FROM (SELECT session, convert_from(body, 'UTF8')::jsonb AS b FROM records WHERE kind = 'refusal') AS r
            WHERE b->>'session' = session GROUP BY session
            ON CONFLICT (scope, owner, part) DO UPDATE SET refused = excluded.refused""",
        "DROP VIEW used",
    ),
)
FORMAT = Migrations(MIGRATIONS)
VERSIONS = (
    "CREATE TABLE IF NOT EXISTS devd_schema (version INT PRIMARY KEY, applied TIMESTAMPTZ NOT NULL DEFAULT now())"
)
UNMADE = -1  # the head of a fork being copied: no read lists, loads or takes the session until its last commit

# A session this node may take: nobody owns it, this node does, or its owner's lease has ended (database clock).
FREE = (
    "(s.owner IS NULL OR s.owner = %(node)s OR NOT EXISTS "
    "(SELECT 1 FROM nodes n WHERE n.id = s.owner AND n.lease_until > now()))"
)
REGISTER = (
    "INSERT INTO nodes (id, address, lease_until) "
    "VALUES (%(node)s, %(address)s, now() + %(ttl)s * interval '1 second') "
    "ON CONFLICT (id) DO UPDATE SET address = excluded.address, lease_until = excluded.lease_until"
)
ACQUIRE = (
    "UPDATE sessions s SET owner = %(node)s, epoch = nextval('epochs') "
    f"WHERE s.name = ANY(%(names)s) AND s.head_seq <> {UNMADE} AND {FREE} RETURNING s.name, s.epoch"
)
OWNERS = (
    "SELECT s.name, s.owner, s.epoch, s.head_seq, n.address, COALESCE(n.lease_until > now(), false) "
    f"FROM sessions s LEFT JOIN nodes n ON n.id = s.owner WHERE s.name = ANY(%(names)s) AND s.head_seq <> {UNMADE}"
)
# The appends of a batch: each row advances its session's head only if this node still owns it under the epoch it
# holds and the row is the next step; only rows that advanced are inserted. One statement, one round trip. The byte
# arrays go in binary (%b): psycopg writes an array of bytes in text format as escaped text, in Python, on the event
# loop: 0.7 s for one step of 8 MiB with its 16 MiB answer, during which no connection was served.
APPEND = """
WITH b AS (
    SELECT * FROM unnest(
        %(session)s::text[], %(seq)s::int8[], %(epoch)s::int8[], %(key)s::text[], %(digest)b::bytea[],
        %(event)b::bytea[], %(actions)b::bytea[], %(answer)b::bytea[], %(snapshot)b::bytea[]
    ) AS b(session, seq, epoch, key, digest, event, actions, answer, snapshot)
), advanced AS (
    UPDATE sessions s SET head_seq = b.seq, last_used = %(at)s
    FROM b
    WHERE s.name = b.session AND s.owner = %(node)s AND s.epoch = b.epoch AND s.head_seq = b.seq - 1
    RETURNING s.name
)
INSERT INTO journal (session, seq, epoch, key, digest, event, actions, answer, snapshot, at)
SELECT b.session, b.seq, b.epoch, b.key, b.digest, b.event, b.actions, b.answer, b.snapshot, %(at)s
FROM b JOIN advanced ON advanced.name = b.session
RETURNING session
"""
MAKE = (
    "INSERT INTO sessions AS s (name, config, state, reason, created, last_used, owner, epoch, head_seq) {source} "
    "ON CONFLICT (name) DO UPDATE SET config = excluded.config, state = 'ok', reason = NULL, "
    "created = excluded.created, last_used = excluded.last_used, owner = excluded.owner, epoch = excluded.epoch, "
    f"head_seq = excluded.head_seq WHERE {FREE} RETURNING s.epoch"
)
CREATE = MAKE.format(source="VALUES (%(name)s, %(config)s, 'ok', NULL, %(at)s, %(at)s, %(node)s, nextval('epochs'), 0)")
FORK = MAKE.format(
    source=f"SELECT %(name)s, config, 'ok', NULL, %(at)s, %(at)s, %(node)s, nextval('epochs'), {UNMADE} "
    f"FROM sessions WHERE name = %(source)s AND head_seq <> {UNMADE}"
)
# Every write of a fork being copied holds its claim (the row locked until the commit): none lands once it is lost.
CLAIM = (
    f"UPDATE sessions SET head_seq = {UNMADE} WHERE name = %(name)s AND owner = %(node)s AND epoch = %(epoch)s "
    f"AND head_seq = {UNMADE} RETURNING name"
)
# Unmade forks nobody is copying: left by a crash of their daemon (this one, or one whose lease has ended).
UNMADE_LEFT = f"DELETE FROM sessions s WHERE s.head_seq = {UNMADE} AND {FREE} RETURNING s.name"
SNAPSHOTS = (
    "SELECT seq FROM journal WHERE session = %(name)s AND snapshot IS NOT NULL AND seq <= %(latest)s AND seq >= "
    "COALESCE((SELECT seq FROM journal WHERE session = %(name)s AND snapshot IS NOT NULL AND seq < %(promised)s "
    "ORDER BY seq DESC LIMIT 1), 0) ORDER BY seq"
)


def default_node() -> str:
    """This daemon's node name when none is given: its host name and process id, unique among live daemons."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class Owner:
    """The live node that owns a session, and the address its clients reach it at."""

    node: str
    address: str


@dataclass(frozen=True, slots=True)
class _Ownership:
    node: str | None
    epoch: int
    head_seq: int
    address: str
    live: bool  # the owner's lease has not ended, on the database's clock


async def _owners(conn: Conn, names: list[str]) -> dict[str, _Ownership]:
    """Who owns each of these sessions (those that exist), under which epoch, and whether that node is live."""
    rows = await (await conn.execute(OWNERS, {"names": names})).fetchall()
    return {name: _Ownership(node, epoch, head, address or "", live) for name, node, epoch, head, address, live in rows}


# -- connections ------------------------------------------------------------------------------------------------------


async def _connect(url: str, isolation: str) -> Conn:
    conn = await psycopg.AsyncConnection.connect(
        url, autocommit=True, connect_timeout=max(2, int(TIMEOUT_S)), application_name="devd"
    )
    await conn.execute(f"SET default_transaction_isolation TO '{ISOLATIONS[isolation]}'")
    return conn


class _Connections:
    """A few connections, taken one at a time, made when first needed, dropped when broken or left mid-transaction."""

    def __init__(self, url: str, size: int, isolation: str) -> None:
        self._url = url
        self._isolation = isolation
        self._limiter = anyio.Semaphore(size)
        self._idle: list[Conn] = []
        self._open: set[Conn] = set()

    @asynccontextmanager
    async def take(self) -> AsyncIterator[Conn]:
        async with self._limiter:
            conn = self._idle.pop() if self._idle else await _connect(self._url, self._isolation)
            self._open.add(conn)
            try:
                yield conn
            finally:
                # A statement the server refused leaves the connection idle and usable; one lost, cancelled or left
                # inside a transaction does not.
                if not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                    self._idle.append(conn)
                else:
                    self._open.discard(conn)
                    conn.pgconn.finish()
                    if conn.closed:
                        self._drop_idle()  # what ended one (a restart, a failover) has likely ended the others

    def _drop_idle(self) -> None:
        for conn in self._idle:
            self._open.discard(conn)
            conn.pgconn.finish()
        self._idle.clear()

    def close(self) -> None:
        """Close every connection at once, without the event loop (libpq's finish)."""
        for conn in self._open:
            conn.pgconn.finish()
        self._open.clear()
        self._idle.clear()


# -- the boundary: what psycopg and the network raise, and what crosses instead ----------------------------------------

FAULTS: tuple[type[Exception], ...] = (psycopg.Error, OSError)  # OSError holds TimeoutError, anyio's `fail_after`'s


def _failing(what: str) -> AbstractContextManager[None]:
    """Every translation of a fault outside a commit: StoreError saying what failed and why."""
    return map_exceptions(FAULTS, lambda e: f"{what} failed: {_describe(e)}")


def _retryable(e: BaseException) -> bool:
    """Whether the transaction surely did not commit and may be tried again (on a new connection, if it was lost)."""
    return isinstance(e, psycopg.Error) and (e.sqlstate in RETRYABLE or e.sqlstate in ENDED)


def _lost(e: BaseException) -> bool:
    """The connection was lost without the server saying why (or could not be made)."""
    return isinstance(e, psycopg.OperationalError) and e.sqlstate is None


def _refused_by_server(e: BaseException) -> bool:
    """The server answered with an error: the transaction did not commit. Otherwise (the connection was lost, or
    timed out) it may or may not have."""
    return isinstance(e, psycopg.Error) and e.sqlstate is not None and not e.sqlstate.startswith("08")


async def _backoff(attempt: int) -> None:
    await anyio.sleep(RETRY_BACKOFF_S * (2**attempt) * random.uniform(0.5, 1.5))


# -- the group commit -------------------------------------------------------------------------------------------------

Op = Callable[[Conn, "_Batch"], Awaitable[DevdError | None]]  # a write other than an append; returns its refusal


@dataclass
class _Batch:
    """What one attempt at a commit changes in the node's epochs, applied only once it commits."""

    store: PostgresStore
    run: int  # the lease run the batch began in: what it takes is known current only while that run lasts
    taken: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int | None] = field(default_factory=dict)  # name: the epoch held when dropped
    renewed: set[str] = field(default_factory=set)  # sessions whose history starts again (pruned from seq 0)
    snapshots: list[Step] = field(default_factory=list)  # committed steps with a snapshot, for pruning

    def epoch(self, name: str) -> int | None:
        if name in self.taken:
            return self.taken[name]
        if name in self.dropped:
            return None
        return self.store._epochs.get(name)

    def take(self, name: str, epoch: int) -> None:
        self.dropped.pop(name, None)
        self.taken[name] = epoch

    def drop(self, name: str) -> None:
        self.taken.pop(name, None)
        self.dropped.setdefault(name, self.store._epochs.get(name))

    def apply(self) -> None:
        epochs = self.store._epochs
        for name, held in self.dropped.items():
            if epochs.get(name) == held:  # not if an `acquire` took it again meanwhile
                epochs.pop(name, None)
                self.store._epoch_runs.pop(name, None)
        epochs.update(self.taken)
        self.store._epoch_runs.update(dict.fromkeys(self.taken, self.run))
        for name in self.renewed:
            self.store._pruned.pop(name, None)


class PostgresStore:
    """One node's view of the fleet's database (see `devd.storage.store.Store` for the contract, the module for the
    rest).

    Open it with `await PostgresStore.open(url, ...)`; run `run()` in the daemon's task group (commits and the lease);
    `close()` at the end."""

    # Never more than 0: a failed commit drops its connection and the next write takes a fresh one, so nothing here
    # stays refused after a fault (the server's own recovery decides what was durable).
    reopened = 0

    def __init__(
        self,
        url: str,
        *,
        keys_kept: int,
        steps_kept: int,
        prune_every_steps: int,
        node: str | None = None,
        advertise: str = "",
        lease_ttl_s: float = LEASE_TTL_S,
        timeout_s: float = TIMEOUT_S,
        isolation: str = "read committed",
    ) -> None:
        """No I/O: `open` connects, migrates and registers the node."""
        self.url = url
        self.retention = Retention(keys_kept, steps_kept, prune_every_steps)
        self.node = node or default_node()
        self.advertise = advertise
        self.lease_ttl_s = lease_ttl_s
        self.timeout_s = timeout_s
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation is one of {', '.join(ISOLATIONS)}, not {isolation!r}")
        self._committer = _Connections(url, 1, isolation)
        self._lessee = _Connections(url, 1, isolation)
        self._readers = _Connections(url, READERS_MAX, isolation)
        self._epochs: dict[str, int] = {}  # the sessions this node holds, with their epochs
        # A lease run is a stretch of time over which this node's lease never lapsed: another node can take a session
        # from it only after a lapse, so an epoch taken in the current run is known current while the run lasts.
        self._lease_run = 0
        self._epoch_runs: dict[str, int] = {}  # the run each epoch of `_epochs` was taken in
        self._lease_deadline = float("-inf")  # monotonic
        self._lease_lost_logged = False
        self._commits: GroupCommit[Op | Step] = GroupCommit()
        self._retries = 0
        self._pruned: dict[str, int] = {}  # the seq each session was last pruned at

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        keys_kept: int,
        steps_kept: int,
        prune_every_steps: int,
        node: str | None = None,
        advertise: str = "",
        lease_ttl_s: float = LEASE_TTL_S,
        timeout_s: float = TIMEOUT_S,
        isolation: str = "read committed",
    ) -> PostgresStore:
        """Connect, bring the database's format up to date, and register this node with a fresh lease.

        Raises StoreError if the database cannot be reached or was written by a newer devd."""
        store = cls(
            url,
            keys_kept=keys_kept,
            steps_kept=steps_kept,
            prune_every_steps=prune_every_steps,
            node=node,
            advertise=advertise,
            lease_ttl_s=lease_ttl_s,
            timeout_s=timeout_s,
            isolation=isolation,
        )
        try:
            await store.connect()
        except BaseException:
            store.close()
            raise
        return store

    async def connect(self) -> None:
        """Bring the database's format up to date and register this node with a fresh lease: what `open` does once
        the store is made, for a store made outside the event loop that will use it (the daemon's)."""
        await self._call(self._readers, migrate, "bringing the database's format up to date")
        await self.renew()
        await self._call(self._readers, _drop_unmade_left(self.node), "removing forks cut short")
        await self._call(self._readers, _release_left(self.node), "releasing the reservations of stopped daemons")

    def close(self) -> None:
        for connections in (self._committer, self._lessee, self._readers):
            connections.close()

    def statistics(self) -> StoreStats:
        return self._commits.times.statistics()

    @property
    def retries(self) -> int:
        """Transactions tried again since open: after a serialization failure, a deadlock, or a lost connection."""
        return self._retries

    async def backup(self, path: str) -> int:
        """Refused: the sessions live in the fleet's database, not in a file of this daemon's; a copy taken by one
        daemon would not be consistent with what the others write."""
        raise NullError(
            "this daemon keeps its sessions in the fleet's PostgreSQL database, not on its own disk: back that "
            "database up with its own tools (pg_dump, or a base backup with its write-ahead log)"
        )

    # -- the lease --------------------------------------------------------------------------------------------------

    def lease_valid(self) -> bool:
        """Whether this node may write: its last renewal is younger than the ttl, on its own monotonic clock."""
        return time.monotonic() < self._lease_deadline

    async def renew(self) -> None:
        """Extend this node's lease to the ttl from now, on the database's clock (registering it if it is not).

        Raises StoreError if the database does not confirm it within a third of the ttl."""
        sent = time.monotonic()
        params = {"node": self.node, "address": self.advertise, "ttl": self.lease_ttl_s}

        async def register(conn: Conn) -> None:
            await conn.execute(REGISTER, params)

        await self._call(self._lessee, register, "renewing this daemon's lease", timeout_s=self.lease_ttl_s / 3)
        if time.monotonic() >= self._lease_deadline:
            # The lease lapsed before this renewal took (or this is the first): meanwhile another node may have taken
            # any session held here, so none of their epochs is known current any more.
            self._lease_run += 1
        # From before the request left: the database's lease began later, so it cannot end before this one does.
        self._lease_deadline = max(self._lease_deadline, sent + self.lease_ttl_s)
        if self._lease_lost_logged:
            log.info("fleet.lease_regained", node=self.node)
            self._lease_lost_logged = False

    async def _renew_forever(self) -> None:
        while True:
            try:
                await self.renew()
                pause = self.lease_ttl_s / 3
            except StoreError as e:
                log.warning("fleet.lease_renewal_failed", node=self.node, error=str(e))
                pause = self.lease_ttl_s / 10  # try again soon: the lease may still be saved
            if not self.lease_valid() and not self._lease_lost_logged:
                log.error("fleet.lease_lapsed", node=self.node, sessions=len(self._epochs))
                self._lease_lost_logged = True
            await anyio.sleep(pause)

    def _lapsed(self) -> StoreError:
        ago = time.monotonic() - self._lease_deadline
        return StoreError(
            f"this daemon's lease in the fleet (node {self.node!r}) ended {ago:.1f} s ago and could not be renewed; "
            "it writes nothing until the database confirms a renewal (another daemon may own its sessions by then); "
            "nothing was written"
        )

    # -- ownership --------------------------------------------------------------------------------------------------

    async def acquire(self, name: str) -> int | None:
        """Take the session for this node under a new epoch, and return it; None if there is no such session.

        Raises MovedError naming the owner when another live node holds it, StoreError when this node's lease has
        lapsed or the database fails."""
        if not self.lease_valid():
            raise self._lapsed()
        run = self._lease_run

        async def take(conn: Conn) -> int | MovedError | None:
            taken = await (await conn.execute(ACQUIRE, {"node": self.node, "names": [name]})).fetchall()
            return int(taken[0][1]) if taken else await self._refusal(conn, name)

        outcome = await self._call(self._readers, take, f"acquiring session {name!r}")
        if isinstance(outcome, MovedError):
            raise outcome
        if outcome is not None:
            self._epochs[name] = outcome
            self._epoch_runs[name] = run
            log.info("fleet.acquired", session=name, epoch=outcome)
        return outcome

    def held(self, name: str) -> int | None:
        """The epoch under which this node holds the session, as far as it knows (a write finds out for sure)."""
        return self._epochs.get(name)

    def current(self, name: str) -> bool:
        """Whether this node's epoch of the session is known current: taken in this lease run, which has not lapsed
        (so no other node can have taken the session since). Reads of its instance are answered only then."""
        return self.lease_valid() and name in self._epochs and self._epoch_runs.get(name) == self._lease_run

    async def owner(self, name: str) -> Owner | None:
        """The live node that owns the session; None if nobody live does (or there is no such session)."""

        async def read(conn: Conn) -> Owner | None:
            found = (await _owners(conn, [name])).get(name)
            return None if found is None or found.node is None or not found.live else Owner(found.node, found.address)

        return await self._call(self._readers, read, f"reading the owner of session {name!r}")

    async def release(self, names: Iterable[str]) -> None:
        """Give up these sessions (owner none) once every write queued before has committed, so that another node
        takes them at once; those this node does not own are left as they are."""
        wanted = list(names)

        async def op(conn: Conn, batch: _Batch) -> None:
            await conn.execute(
                "UPDATE sessions SET owner = NULL WHERE owner = %(node)s AND name = ANY(%(names)s)",
                {"node": self.node, "names": wanted},
            )
            for name in wanted:
                batch.drop(name)
            return None

        await self._write(op)

    async def release_all(self) -> None:
        """Drain: give up every session this node owns, once every write queued before has committed."""

        async def op(conn: Conn, batch: _Batch) -> None:
            await conn.execute("UPDATE sessions SET owner = NULL WHERE owner = %(node)s", {"node": self.node})
            for name in [*self._epochs, *batch.taken]:  # those taken earlier in this very batch too
                batch.drop(name)
            return None

        await self._write(op)
        log.info("fleet.released_all", node=self.node)

    def _moved(self, name: str, found: _Ownership) -> MovedError:
        if found.node is not None and found.node != self.node and found.live:
            where = found.address or "(no address advertised)"
            return MovedError(
                f"session {name!r} is owned by daemon {found.node!r} at {where}; send the call there",
                found.node,
                found.address,
            )
        return MovedError(
            f"session {name!r} is no longer this daemon's (another daemon took it over, or it was released); "
            "send the call again"
        )

    async def _refusal(self, conn: Conn, name: str) -> MovedError | None:
        """Why this node could not take the session: MovedError, or None when there is no such session."""
        found = (await _owners(conn, [name])).get(name)
        return None if found is None else self._moved(name, found)

    async def _epoch(self, conn: Conn, batch: _Batch, name: str) -> int | MovedError | None:
        """The epoch this node holds the session under, taking it in the batch's transaction if it holds none; else
        why not (None: no such session)."""
        held = batch.epoch(name)
        if held is not None:
            return held
        taken = await (await conn.execute(ACQUIRE, {"node": self.node, "names": [name]})).fetchall()
        if not taken:
            return await self._refusal(conn, name)
        batch.take(name, int(taken[0][1]))
        return int(taken[0][1])

    async def _lost(self, conn: Conn, batch: _Batch, name: str) -> MovedError | None:
        """A write other than an append found the session fenced: MovedError (and it is dropped), None if it is gone."""
        batch.drop(name)
        return await self._refusal(conn, name)

    # -- writes -----------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Renew the lease and commit writes (group commit) for as long as this runs. A commit under way when it is
        cancelled finishes first (bounded by the timeout), so no write is left between the two."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._renew_forever)
            await self._commits.serve(self._commit)

    async def flush(self) -> None:
        await self._commits.drain(self._commit)

    async def _write(self, op: Op | Step) -> None:
        error = await self._commits.write(op)
        if error is not None:
            raise error

    async def _commit(
        self, ops: list[Op | Step]
    ) -> tuple[list[DevdError | None], Callable[[], Awaitable[None]] | None]:
        """A batch: each write's own refusal (fenced, no such session) or none, or all the failure of the transaction;
        once committed, the pruning it calls for, before the writers hear of it, as the SQLite store does: a read
        after a write sees the pruned history."""
        outcome = await self._transact(ops)
        if isinstance(outcome, BaseException):
            return [_failed(outcome) for _ in ops], None
        errors, done = outcome
        done.apply()
        return errors, partial(self._prune_some, done.snapshots)

    async def _transact(self, ops: list[Op | Step]) -> tuple[list[DevdError | None], _Batch] | BaseException:
        """The ops in one transaction, retried whole on serialization failures: each op's refusal and what the
        transaction changed in this node's epochs; or why it failed."""
        try:
            with anyio.fail_after(self.timeout_s):
                for attempt in range(RETRIES_MAX):
                    if not self.lease_valid():
                        return self._lapsed()
                    done = _Batch(self, self._lease_run)
                    try:
                        async with self._committer.take() as conn:
                            failpoints.hit("commit.before")
                            return await self._apply(conn, ops, done), done
                    except FAULTS as e:
                        if not _retryable(e) or attempt == RETRIES_MAX - 1:
                            return e
                        self._retries += 1
                        log.info("store.retrying", attempt=attempt + 1, error=str(e).strip())
                        await _backoff(attempt)
        except TimeoutError as e:
            return e
        raise AssertionError("unreachable")

    async def _apply(self, conn: Conn, ops: list[Op | Step], batch: _Batch) -> list[DevdError | None]:
        """The batch's statements, in the order written; consecutive appends as one statement where they can be."""
        steps = [op for op in ops if isinstance(op, Step)]
        if (
            len(steps) == len(ops) <= ROWS_PER_STATEMENT
            and len({s.session for s in steps}) == len(steps)
            and all(batch.epoch(s.session) is not None for s in steps)
        ):
            # The usual batch: appends alone, each session once, all held. One statement is its own transaction.
            return await self._append(conn, steps, batch)
        errors: list[DevdError | None] = []
        async with conn.transaction():
            run: list[Step] = []
            for op in [*ops, None]:
                if isinstance(op, Step):
                    run.append(op)
                    continue
                if run:
                    errors += await self._append(conn, run, batch)
                    run = []
                if op is not None:
                    errors.append(await op(conn, batch))
        return errors

    async def _append(self, conn: Conn, steps: list[Step], batch: _Batch) -> list[DevdError | None]:
        """Appends in statements of distinct sessions (a session's later steps go in a later statement), each row
        fenced on (owner, epoch, head_seq); the refusal of each row that did not commit."""
        errors: dict[int, DevdError | None] = {}
        # Sessions not held are taken first, in name order, so that two nodes taking the same ones lock them alike.
        for name in sorted({s.session for s in steps if batch.epoch(s.session) is None}):
            epoch = await self._epoch(conn, batch, name)
            if not isinstance(epoch, int):
                errors.update({i: epoch or _no_session(s) for i, s in enumerate(steps) if s.session == name})
        for chunk in _rounds([(i, s) for i, s in enumerate(steps) if i not in errors]):
            at = time.time()
            rows = await (await conn.execute(APPEND, _columns([s for _, s in chunk], batch, self.node, at))).fetchall()
            advanced = {name for (name,) in rows}
            failed = [(i, s) for i, s in chunk if s.session not in advanced]
            if failed:
                errors.update(await self._why(conn, failed, batch))
            batch.snapshots += [s for _, s in chunk if s.session in advanced and s.snapshot is not None]
        return [errors.get(i) for i in range(len(steps))]

    async def _why(self, conn: Conn, failed: list[tuple[int, Step]], batch: _Batch) -> dict[int, DevdError | None]:
        """Why appends did not commit: fenced (MovedError, and the session is dropped), no such session, or not the
        session's next step."""
        found = await _owners(conn, list({s.session for _, s in failed}))
        errors: dict[int, DevdError | None] = {}
        for i, s in failed:
            session = found.get(s.session)
            if session is None:
                errors[i] = _no_session(s)
            elif session.node == self.node and session.epoch == batch.epoch(s.session):
                errors[i] = StoreError(
                    f"step {s.seq} of {s.session!r} is not its next step (it has answered {session.head_seq}); "
                    "nothing was written"
                )
            else:
                log.info("fleet.fenced", session=s.session, seq=s.seq, epoch=batch.epoch(s.session), owner=session.node)
                batch.drop(s.session)
                errors[i] = self._moved(s.session, session)
        return errors

    async def create(self, name: str, config: bytes, snapshot: bytes | None = None) -> None:
        """A new session owned by this node (see `devd.storage.store.Store.create`). Raises MovedError if another
        live node
        owns a session of that name."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            at = time.time()
            params = {"name": name, "config": config, "at": at, "node": self.node}
            made = await (await conn.execute(CREATE, params)).fetchone()
            if made is None:
                return await self._refusal(conn, name)
            batch.take(name, int(made[0]))
            batch.renewed.add(name)
            await conn.execute("DELETE FROM journal WHERE session = %s", (name,))
            await conn.execute("DELETE FROM records WHERE session = %s", (name,))
            await _drop_own_spend(conn, name)
            if snapshot is not None:
                await conn.execute(
                    "INSERT INTO journal (session, seq, epoch, event, snapshot, at) VALUES (%s, 0, %s, '', %s, %s)",
                    (name, made[0], snapshot, at),
                )
            return None

        await self._write(op)

    async def append(self, step: Step) -> None:
        """Journal a step (see `devd.storage.store.Store.append`); it must be the session's next (its seq one past
        the last).

        Raises MovedError when another node owns the session or took it from this one (nothing is written)."""
        await self._write(step)

    async def save_snapshot(self, name: str, seq: int, snapshot: bytes) -> None:
        """See `devd.storage.store.Store.save_snapshot`: fenced on the epoch this node holds, and only onto the
        session's head
        step; a session this node does not hold is never taken for it."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            epoch = batch.epoch(name)
            if epoch is not None:
                await conn.execute(
                    "UPDATE journal j SET snapshot = %s FROM sessions s WHERE j.session = %s AND j.seq = %s "
                    "AND j.snapshot IS NULL AND s.name = j.session AND s.owner = %s AND s.epoch = %s "
                    "AND s.head_seq = j.seq",
                    (snapshot, name, seq, self.node, epoch),
                )
            return None

        await self._write(op)

    async def set_health(self, name: str, health: Health, reason: str | None) -> None:
        """Fenced like an append (taking the session if this node holds none); a session that does not exist is left
        alone. Raises MovedError when another live node owns it."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            epoch = await self._epoch(conn, batch, name)
            if not isinstance(epoch, int):
                return epoch
            done = await conn.execute(
                "UPDATE sessions SET state = %s, reason = %s WHERE name = %s AND owner = %s AND epoch = %s",
                (health.value, reason, name, self.node, epoch),
            )
            return None if done.rowcount else await self._lost(conn, batch, name)

        await self._write(op)

    async def delete(self, name: str) -> None:
        """Fenced like an append (taking the session if this node holds none); a session that does not exist is left
        alone. Raises MovedError when another live node owns it."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            epoch = await self._epoch(conn, batch, name)
            if not isinstance(epoch, int):
                return epoch
            done = await conn.execute(
                "DELETE FROM sessions WHERE name = %s AND owner = %s AND epoch = %s", (name, self.node, epoch)
            )
            if not done.rowcount:
                return await self._lost(conn, batch, name)
            await conn.execute("DELETE FROM journal WHERE session = %s", (name,))
            await conn.execute("DELETE FROM records WHERE session = %s", (name,))
            await _drop_own_spend(conn, name)
            batch.drop(name)
            batch.renewed.add(name)
            return None

        await self._write(op)

    async def truncate(self, name: str, at: int, kinds: tuple[str, ...]) -> None:
        """Fenced like an append (taking the session if this node holds none): the head moves back to `at` in the
        statement that checks the owner and epoch. Raises MovedError when another live node owns it."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            epoch = await self._epoch(conn, batch, name)
            if not isinstance(epoch, int):
                return epoch
            done = await conn.execute(
                "UPDATE sessions SET head_seq = %s WHERE name = %s AND owner = %s AND epoch = %s AND head_seq >= %s",
                (at, name, self.node, epoch, at),
            )
            if not done.rowcount:
                return await self._lost(conn, batch, name)
            await conn.execute("DELETE FROM journal WHERE session = %s AND seq > %s", (name, at))
            await conn.execute(
                "DELETE FROM records WHERE session = %s AND kind = ANY(%s) AND seq > %s", (name, list(kinds), at)
            )
            return None

        await self._write(op)

    async def fork(self, source: str, at: int, name: str, snapshot: bytes | None) -> None:
        """See `devd.storage.store.Store.fork`; the fork is owned by this node, and copied a few MiB a commit (see the
        module). Raises MovedError if another live node owns a session named `name`."""
        cut = await self._read(partial(_spans, source=source, at=at))
        claimed: list[int] = []  # the fork's epoch, once its row is made

        async def begin(conn: Conn, batch: _Batch) -> DevdError | None:
            params = {"name": name, "source": source, "at": time.time(), "node": self.node}
            made = await (await conn.execute(FORK, params)).fetchone()
            if made is None:
                exists = await (
                    await conn.execute(f"SELECT 1 FROM sessions WHERE name = %s AND head_seq <> {UNMADE}", (source,))
                ).fetchone()
                if exists is None:
                    return StoreError(f"there is no session {source!r} to fork")
                return await self._refusal(conn, name)
            claimed.append(int(made[0]))
            batch.drop(name)  # whatever this node held of that name is gone; the fork is held once made
            batch.renewed.add(name)
            await conn.execute("DELETE FROM journal WHERE session = %s", (name,))
            await conn.execute("DELETE FROM records WHERE session = %s", (name,))
            await _drop_own_spend(conn, name)  # a fork spends from zero
            return None

        def copy(lo: int, hi: int) -> Op:
            async def op(conn: Conn, batch: _Batch) -> DevdError | None:
                if not await self._claim(conn, name, claimed[0]):
                    return await self._fork_lost(conn, name)
                await conn.execute(
                    "INSERT INTO journal (session, seq, epoch, key, digest, event, actions, answer, snapshot, at) "
                    "SELECT %s, seq, epoch, key, digest, event, actions, answer, snapshot, at FROM journal "
                    "WHERE session = %s AND seq BETWEEN %s AND %s",
                    (name, source, lo, hi),
                )
                return None

            return op

        async def finish(conn: Conn, batch: _Batch) -> DevdError | None:
            epoch = claimed[0]
            if not await self._claim(conn, name, epoch):
                return await self._fork_lost(conn, name)
            await conn.execute(
                "INSERT INTO records (session, n, seq, kind, action, body, at) "
                "SELECT %s, n, seq, kind, action, body, at FROM records WHERE session = %s AND seq <= %s",
                (name, source, at),
            )
            if snapshot is not None:
                await conn.execute(
                    "INSERT INTO journal (session, seq, epoch, event, snapshot, at) VALUES (%s, %s, %s, '', %s, %s) "
                    "ON CONFLICT (session, seq) DO UPDATE SET snapshot = excluded.snapshot",
                    (name, at, epoch, snapshot, time.time()),
                )
            await conn.execute(
                "UPDATE sessions SET head_seq = COALESCE((SELECT max(seq) FROM journal WHERE session = %s), 0) "
                "WHERE name = %s",
                (name, name),
            )
            batch.take(name, epoch)
            return None

        async def drop(conn: Conn, batch: _Batch) -> DevdError | None:
            gone = await conn.execute(
                f"DELETE FROM sessions WHERE name = %s AND epoch = %s AND head_seq = {UNMADE}", (name, claimed[0])
            )
            if gone.rowcount:
                await conn.execute("DELETE FROM journal WHERE session = %s", (name,))
            return None

        try:
            await self._write(begin)
            for lo, hi in cut:
                await self._write(copy(lo, hi))
            await self._write(finish)
        except DevdError:
            if claimed:  # its row was made: drop it and what was copied (if this fails, the next connect does)
                with suppress(DevdError):
                    await self._write(drop)
            raise

    async def _claim(self, conn: Conn, name: str, epoch: int) -> bool:
        """Whether this node still holds the unmade fork under its epoch (its row locked until the commit)."""
        params = {"name": name, "node": self.node, "epoch": epoch}
        return await (await conn.execute(CLAIM, params)).fetchone() is not None

    async def _fork_lost(self, conn: Conn, name: str) -> MovedError:
        """The unmade fork was taken from this node (its lease lapsed) or released: MovedError, naming a live owner."""
        return await self._refusal(conn, name) or self._moved(name, _Ownership(None, 0, 0, "", False))

    # -- pruning ----------------------------------------------------------------------------------------------------

    async def _prune_some(self, steps: list[Step]) -> None:
        """Maintenance after a commit: what it drops was already replaced by a later snapshot. A failure is logged,
        not raised: nothing acknowledged depends on it."""
        for s in steps:
            if not self.retention.due(s.seq, self._pruned.get(s.session, 0)):
                continue
            try:
                await self._call(self._committer, partial(self._prune, name=s.session, snapshot_seq=s.seq), "pruning")
            except StoreError as e:
                log.warning("store.prune_failed", session=s.session, error=str(e))
            self._pruned[s.session] = s.seq

    async def _prune(self, conn: Conn, *, name: str, snapshot_seq: int) -> None:
        """Drop history beyond what watchers and keys are promised (see `devd.storage.retention`; the snapshots kept
        are not thinned here: none is in a file of its own)."""
        async with conn.transaction():
            params = {"name": name, "latest": snapshot_seq, "promised": self.retention.promised_from(snapshot_seq)}
            seqs = [seq for (seq,) in await (await conn.execute(SNAPSHOTS, params)).fetchall()]
            found = self.retention.plan(seqs, snapshot_seq).anchor
            if found is None:
                return  # everything kept is still derived from the config or the first snapshot
            anchor = (found,)
            await conn.execute(
                "UPDATE journal SET snapshot = NULL WHERE session = %s AND seq < %s AND snapshot IS NOT NULL",
                (name, anchor[0]),
            )
            await conn.execute("DELETE FROM journal WHERE session = %s AND key IS NULL AND seq < %s", (name, anchor[0]))
            # Keys older than the anchor keep their row up to the number promised.
            await conn.execute(
                "DELETE FROM journal WHERE session = %s AND key IS NOT NULL AND seq < %s AND seq < ("
                " SELECT seq FROM journal WHERE session = %s AND key IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET %s)",
                (name, anchor[0], name, self.retention.keys_offset),
            )

    # -- reads ------------------------------------------------------------------------------------------------------

    async def _call(
        self,
        connections: _Connections,
        fn: Callable[[Conn], Awaitable[T]],
        what: str,
        *,
        timeout_s: float | None = None,
    ) -> T:
        """fn on a connection of the set within the timeout, retried when the transaction surely did not commit, and
        once on a new connection when the one taken was lost (fn must be safe to run twice: reads, the lease, an
        acquisition, pruning); every failure as StoreError."""
        with _failing(what), anyio.fail_after(timeout_s or self.timeout_s):
            for attempt in range(RETRIES_MAX):
                try:
                    async with connections.take() as conn:
                        return await fn(conn)
                except FAULTS as e:
                    if not (_retryable(e) or (_lost(e) and attempt == 0)) or attempt == RETRIES_MAX - 1:
                        raise
                    self._retries += 1
                    await _backoff(attempt)
        raise AssertionError("unreachable")

    async def _read(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        async def in_snapshot(conn: Conn) -> T:
            async with conn.transaction():  # one snapshot for the whole read
                return await fn(conn)

        return await self._call(self._readers, in_snapshot, "reading the database")

    async def sessions(self) -> list[SessionRow]:
        async def read(conn: Conn) -> list[SessionRow]:
            rows = await (
                await conn.execute(
                    f"SELECT name, state, reason, head_seq, created, last_used FROM sessions WHERE head_seq <> {UNMADE}"
                )
            ).fetchall()
            return [SessionRow(name, Health(h), why, seq, created, used) for name, h, why, seq, created, used in rows]

        listed = await self._call(self._readers, read, "reading the database")
        listed.sort(key=lambda r: r.name)  # by code point, as the registry orders names, whatever the collation
        return listed

    async def load(self, name: str) -> Stored | None:
        return await self._read(lambda conn: _load(conn, name, None))

    async def load_at(self, name: str, at: int) -> Stored | None:
        return await self._read(lambda conn: _load(conn, name, at))

    async def keyed(self, name: str, key: str) -> Keyed | None:
        async def read(conn: Conn) -> Keyed | None:
            row = await (
                await conn.execute(
                    "SELECT seq, digest, actions, answer FROM journal WHERE session = %s AND key = %s LIMIT 1",
                    (name, key),
                )
            ).fetchone()
            return None if row is None else Keyed(*row)

        return await self._call(self._readers, read, "reading the database")

    async def add_record(self, record: Record) -> None:
        """Not fenced: a record says what this daemon did (a claim before an effect), which stays true whoever holds
        the session next; a record of a session that does not exist is dropped."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            await _add_record(conn, record)
            return None

        await self._write(op)

    async def add_records(self, records: Sequence[Record]) -> None:
        """As `add_record`, each of them, in one write."""

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            for record in records:
                await _add_record(conn, record)
            return None

        await self._write(op)

    # -- spend: not fenced (what was spent stays spent whoever holds the session next) ------------------------------

    async def reserve(
        self, session: str, counters: Sequence[Counter], checks: Sequence[tuple[Counter, int]], tokens: int
    ) -> int | Over:
        """Each counter's row is made if new, then reserved on by a conditional update, in one order (two daemons
        reserving at once wait for each other's row, never deadlock): `reserved = reserved + tokens WHERE spent +
        reserved + tokens <= limit`, which PostgreSQL checks again on the row it locks. One that matches no row
        undoes the reservation's updates (a savepoint: the rest of the batch stands) and refuses it, unless releasing
        the reservations of daemons whose lease lapsed (calls that ended with them) makes room."""
        held = sorted(dict.fromkeys(counters))
        limits: dict[Counter, int] = {}
        for counter, limit in checks:
            limits[counter] = min(limit, limits.get(counter, limit))
        got: list[int | Over] = []

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            got.clear()  # a batch may be tried again
            for counter in sorted({*held, *limits}):
                await conn.execute(f"{SPEND} DO NOTHING", (*counter, 0, 0))
            for attempt in range(2):
                try:
                    got.append(await self._reserve(conn, held, limits, tokens))
                    return None
                except _Refused:
                    # Calls of a daemon whose lease lapsed hold nothing any more: released, and tried once again.
                    if attempt == 0 and await _release(conn, LAPSED, ()):
                        continue
                    got.append(await _over(conn, session, checks, tokens))
                    return None
            raise AssertionError("unreachable")

        await self._write(op)
        return got[0]

    async def _reserve(self, conn: Conn, held: list[Counter], limits: dict[Counter, int], tokens: int) -> int:
        """The reservation's number; _Refused, with nothing of it left (its savepoint rolled back), past a limit."""
        async with conn.transaction():
            for counter in held:
                limit = limits.get(counter)
                updated = await conn.execute(
                    "UPDATE spend SET reserved = reserved + %s WHERE scope = %s AND owner = %s AND part = %s "
                    "AND (%s::bigint IS NULL OR spent + reserved + %s <= %s)",
                    (tokens, *counter, limit, tokens, limit),
                )
                if updated.rowcount == 0:
                    raise _Refused
            for counter in limits.keys() - set(held):  # checked, not reserved on
                if not await _within(conn, counter, tokens, limits[counter]):
                    raise _Refused
            number = int((await (await conn.execute("SELECT nextval('reservation_numbers')")).fetchone() or [0])[0])
            for counter in held:
                await conn.execute(
                    "INSERT INTO reservations (id, scope, owner, part, tokens, node) VALUES (%s, %s, %s, %s, %s, %s)",
                    (number, *counter, tokens, self.node),
                )
        return number

    async def unreserve(self, reservation: int) -> None:
        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            await _release(conn, "id = %s", (reservation,))
            return None

        await self._write(op)

    async def charge(self, reservation: int | None, counters: Sequence[Counter], tally: Tally, record: Record) -> None:
        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            await _add_record(conn, record)
            if reservation is not None:
                await _release(conn, "id = %s", (reservation,))
            exists = await _exists(conn, record.session)
            tokens = tally.input_tokens + tally.output_tokens
            for counter in sorted(dict.fromkeys(counters)):
                if counter.scope == "day" or exists:
                    await conn.execute(
                        f"{SPEND} DO UPDATE SET spent = spend.spent + excluded.spent", (*counter, tokens, 0)
                    )
            if exists:
                await conn.execute(
                    f"{TALLY} DO UPDATE SET input_tokens = spend.input_tokens + excluded.input_tokens, output_tokens = "
                    "spend.output_tokens + excluded.output_tokens, cached_tokens = spend.cached_tokens + "
                    "excluded.cached_tokens, calls = spend.calls + excluded.calls, refused = spend.refused + "
                    "excluded.refused",
                    ("session", record.session, "", *msgspec.structs.astuple(tally)),
                )
            return None

        await self._write(op)

    async def counted(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        async def read(conn: Conn) -> list[tuple[int, int]]:
            return [await _counted(conn, counter) for counter in counters]

        return await self._call(self._readers, read, "reading the database")

    async def tally(self, session: str) -> Tally:
        async def read(conn: Conn) -> Tally:
            row = await (
                await conn.execute(
                    "SELECT input_tokens, output_tokens, cached_tokens, calls, refused FROM spend "
                    "WHERE scope = 'session' AND owner = %s AND part = ''",
                    (session,),
                )
            ).fetchone()
            return Tally() if row is None else Tally(*(int(v) for v in row))

        return await self._call(self._readers, read, "reading the database")

    async def records(
        self, name: str, kinds: tuple[str, ...] | None = None, after: int = 0, limit: int | None = None
    ) -> list[Record]:
        wanted = None if kinds is None else list(kinds)

        async def read(conn: Conn) -> list[Record]:
            cursor = await conn.execute(
                "SELECT seq, kind, action, body, at, n FROM records WHERE session = %s AND (%s::text[] IS NULL OR "
                "kind = ANY(%s::text[])) AND n > %s ORDER BY n LIMIT %s",
                (name, wanted, wanted, after, limit),
            )
            return [Record(name, *r) for r in await cursor.fetchall()]

        return await self._call(self._readers, read, "reading the database")

    async def forget_records(self, name: str, kind: str, actions: Collection[int]) -> None:
        """Not fenced, as `add_record` is not."""
        listed = list(actions)
        if not listed:
            return

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            await conn.execute(
                "DELETE FROM records WHERE session = %s AND kind = %s AND action = ANY(%s) "
                "AND n < (SELECT max(n) FROM records WHERE session = %s)",
                (name, kind, listed, name),
            )
            return None

        await self._write(op)

    async def trim_records(self, name: str, kind: str, kept: int) -> int:
        trimmed = [0]

        async def op(conn: Conn, batch: _Batch) -> DevdError | None:
            cursor = await conn.execute(
                "DELETE FROM records WHERE session = %s AND kind = %s AND n < (SELECT n FROM records "
                "WHERE session = %s AND kind = %s ORDER BY n DESC LIMIT 1 OFFSET %s)",
                (name, kind, name, kind, max(1, kept) - 1),
            )
            trimmed[0] = cursor.rowcount
            return None

        await self._write(op)
        return trimmed[0]

    async def recorded(self, kind: str) -> list[str]:
        async def read(conn: Conn) -> list[str]:
            cursor = await conn.execute("SELECT DISTINCT session FROM records WHERE kind = %s", (kind,))
            return sorted(name for (name,) in await cursor.fetchall())

        return await self._call(self._readers, read, "reading the database")

    async def steps_since(self, name: str, since: int, limit: int) -> list[Row]:
        async def read(conn: Conn) -> list[Row]:
            cursor = await conn.execute(
                f"SELECT {ROW} FROM journal WHERE session = %s AND seq > %s ORDER BY seq LIMIT %s", (name, since, limit)
            )
            return [Row(*r) for r in await cursor.fetchall()]

        return await self._call(self._readers, read, "reading the database")

    async def journalled(self, name: str, since: int, limit: int) -> dict[int, float]:
        async def read(conn: Conn) -> dict[int, float]:
            cursor = await conn.execute(
                "SELECT seq, at FROM journal WHERE session = %s AND seq > %s ORDER BY seq LIMIT %s",
                (name, since, limit),
            )
            return {seq: at for seq, at in await cursor.fetchall()}

        return await self._call(self._readers, read, "reading the database")


async def migrate(conn: Conn) -> int:
    """Bring the database to the format this devd writes, one migration at a time; the version reached.

    Safe when several daemons open one database at once: each migration's version row is inserted first, in the
    migration's own transaction, so a second daemon waits for it and then finds it applied."""
    for _ in range(RETRIES_MAX):
        try:
            await conn.execute(VERSIONS)
            version = (
                await (await conn.execute("SELECT COALESCE(max(version), 0) FROM devd_schema")).fetchone() or [0]
            )[0]
            due = FORMAT.next(int(version), "the database")
            if due is None:
                return int(version)
            reached, statements = due
            async with conn.transaction():
                await conn.execute("INSERT INTO devd_schema (version) VALUES (%s)", (reached,))
                for statement in statements:
                    await conn.execute(statement)
            FORMAT.applied(reached)
        except psycopg.Error as e:
            if e.sqlstate not in RACED:
                raise
            await _backoff(0)  # another daemon migrated at the same time: read the version again
    raise StoreError("the database's format could not be brought up to date: other daemons kept migrating it")


async def _load(conn: Conn, name: str, at: int | None) -> Stored | None:
    """The session now (at None) or as it was at step `at`; None if there is no such session or history."""
    made = f"SELECT config, state, reason FROM sessions WHERE name = %s AND head_seq <> {UNMADE}"
    row = await (await conn.execute(made, (name,))).fetchone()
    if row is None:
        return None
    config, state, reason = row
    upto = (1 << 63) - 1 if at is None else at
    saved = await (
        await conn.execute(
            "SELECT seq, snapshot FROM journal WHERE session = %s AND snapshot IS NOT NULL AND seq <= %s "
            "ORDER BY seq DESC LIMIT 1",
            (name, upto),
        )
    ).fetchone()
    if (
        saved is None
        and await (await conn.execute("SELECT 1 FROM journal WHERE session = %s AND seq = 0", (name,))).fetchone()
    ):
        return None  # restored from a snapshot no longer kept: its history cannot be rebuilt from the config
    snapshot_seq, snapshot = saved if saved else (0, None)
    cursor = await conn.execute(
        f"SELECT {ROW} FROM journal WHERE session = %s AND seq > %s AND seq <= %s ORDER BY seq",
        (name, snapshot_seq, upto),
    )
    journal = [Row(*r) for r in await cursor.fetchall()]
    if at is not None and [r.seq for r in journal] != list(range(snapshot_seq + 1, at + 1)):
        return None  # pruned (or not yet written): that point cannot be rebuilt
    return Stored(name, config, snapshot, snapshot_seq, Health(state), reason, journal)


async def _spans(conn: Conn, *, source: str, at: int) -> list[tuple[int, int]]:
    """The source's journal up to `at` as ranges of seqs a fork copies a commit at a time."""
    cursor = await conn.execute(
        "SELECT seq, length(event) + COALESCE(length(actions), 0) + COALESCE(length(snapshot), 0) FROM journal "
        "WHERE session = %s AND seq <= %s ORDER BY seq",
        (source, at),
    )
    return spans(await cursor.fetchall(), at, FORK_COPY_BYTES)


async def _add_record(conn: Conn, record: Record) -> None:
    await conn.execute(
        "INSERT INTO records (session, n, seq, kind, action, body, at) SELECT %(session)s, "
        "COALESCE((SELECT max(n) FROM records WHERE session = %(session)s), 0) + 1, %(seq)s, %(kind)s, "
        "%(action)s, %(body)s, %(at)s WHERE EXISTS (SELECT 1 FROM sessions WHERE name = %(session)s)",
        {
            "session": record.session,
            "seq": record.seq,
            "kind": record.kind,
            "action": record.action,
            "body": record.body,
            "at": time.time(),
        },
    )


# A counter's row, made with what it adds when it is new, else as the statement's ON CONFLICT says.
SPEND = (
    "INSERT INTO spend (scope, owner, part, spent, reserved) VALUES (%s, %s, %s, %s, %s) "
    "ON CONFLICT (scope, owner, part)"
)
TALLY = (
    "INSERT INTO spend (scope, owner, part, input_tokens, output_tokens, cached_tokens, calls, refused) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (scope, owner, part)"
)
# A session's own counters, and its calls' reservations on them: a late release of a call of the session before must
# not take from the counters of one made again under its name.
OWN_SPEND = (
    "DELETE FROM spend WHERE scope IN ('session', 'turn') AND owner = %s",
    "DELETE FROM reservations WHERE scope IN ('session', 'turn') AND owner = %s",
)


LAPSED = "node NOT IN (SELECT id FROM nodes WHERE lease_until > now())"  # reservations of daemons no longer live


class _Refused(Exception):
    """A reservation that would pass a limit: its savepoint is rolled back."""


async def _drop_own_spend(conn: Conn, session: str) -> None:
    for statement in OWN_SPEND:
        await conn.execute(statement, (session,))


async def _counted(conn: Conn, counter: Counter) -> tuple[int, int]:
    row = await (
        await conn.execute("SELECT spent, reserved FROM spend WHERE scope = %s AND owner = %s AND part = %s", counter)
    ).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


async def _within(conn: Conn, counter: Counter, tokens: int, limit: int) -> bool:
    spent, reserved = await _counted(conn, counter)
    return spent + reserved + tokens <= limit


async def _exists(conn: Conn, session: str) -> bool:
    return await (await conn.execute("SELECT 1 FROM sessions WHERE name = %s", (session,))).fetchone() is not None


async def _over(conn: Conn, session: str, checks: Sequence[tuple[Counter, int]], tokens: int) -> Over:
    """A refused reservation: the first check it passes now (the last, should another call have settled since), and
    the session's `refused` counted."""
    if await _exists(conn, session):
        await conn.execute(
            f"{TALLY} DO UPDATE SET refused = spend.refused + 1", ("session", session, "", 0, 0, 0, 0, 1)
        )
    found = [(await _counted(conn, counter), limit) for counter, limit in checks]
    check = next((i for i, ((s, r), limit) in enumerate(found) if s + r + tokens > limit), len(found) - 1)
    (spent, reserved), _ = found[check]
    return Over(check, spent, reserved)


async def _release(conn: Conn, where: str, params: tuple[object, ...]) -> int:
    """Release the reservations `where` says (once: their rows go as they are subtracted); how many counters had
    some."""
    released = await conn.execute(
        f"WITH gone AS (DELETE FROM reservations WHERE {where} RETURNING scope, owner, part, tokens) "
        "UPDATE spend SET reserved = spend.reserved - g.tokens FROM (SELECT scope, owner, part, SUM(tokens) AS tokens "
        "FROM gone GROUP BY scope, owner, part) AS g WHERE spend.scope = g.scope AND spend.owner = g.owner "
        "AND spend.part = g.part",
        params,
    )
    return released.rowcount


def _release_left(node: str) -> Callable[[Conn], Awaitable[None]]:
    """Release the reservations this node left when it stopped, and those of nodes whose lease has lapsed: their
    calls are over (a node whose lease lapsed and that settles later finds its reservation gone, and only charges)."""

    async def free(conn: Conn) -> None:
        async with conn.transaction():
            await _release(conn, f"node = %s OR {LAPSED}", (node,))

    return free


def _drop_unmade_left(node: str) -> Callable[[Conn], Awaitable[None]]:
    """Remove the forks cut short by a crash of their daemon (see `UNMADE_LEFT`), with what they had copied."""

    async def drop(conn: Conn) -> None:
        async with conn.transaction():
            names = [name for (name,) in await (await conn.execute(UNMADE_LEFT, {"node": node})).fetchall()]
            if names:
                await conn.execute("DELETE FROM journal WHERE session = ANY(%s)", (names,))
                log.info("store.unmade_forks_removed", sessions=names)

    return drop


def _rounds(steps: list[tuple[int, Step]]) -> Iterable[list[tuple[int, Step]]]:
    """Steps in statements where each session appears once and in order, at most ROWS_PER_STATEMENT each."""
    pending = steps
    while pending:
        seen: set[str] = set()
        chunk: list[tuple[int, Step]] = []
        later: list[tuple[int, Step]] = []
        for item in pending:
            if item[1].session in seen or len(chunk) == ROWS_PER_STATEMENT:
                later.append(item)
            else:
                seen.add(item[1].session)
                chunk.append(item)
        yield chunk
        pending = later


def _columns(steps: list[Step], batch: _Batch, node: str, at: float) -> dict[str, Any]:
    return {
        "session": [s.session for s in steps],
        "seq": [s.seq for s in steps],
        "epoch": [batch.epoch(s.session) for s in steps],
        "key": [s.key for s in steps],
        "digest": [s.digest for s in steps],
        "event": [s.event for s in steps],
        "actions": [s.actions for s in steps],
        "answer": [s.answer for s in steps],
        "snapshot": [s.snapshot for s in steps],
        "node": node,
        "at": at,
    }


def _no_session(step: Step) -> StoreError:
    return StoreError(f"step {step.seq} of {step.session!r} cannot be journalled: there is no such session")


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "the database did not answer in time"
    return str(e).strip() or type(e).__name__


def _failed(e: BaseException) -> DevdError:
    """What every write of a batch whose transaction failed is answered (each its own exception object)."""
    if isinstance(e, DevdError):
        return type(e)(str(e))
    if _refused_by_server(e):
        return StoreError(f"the state could not be made durable and nothing of it was applied: {_describe(e)}")
    return StoreError(
        f"the write may or may not be durable ({_describe(e)}); send it again once the database answers (a step with "
        "the same key answers replayed if it was kept)"
    )
