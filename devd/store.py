"""Durable session state: the only module that touches SQLite.

Each session has a row (its config and its state) and a journal of the steps it answered (event, actions,
idempotency key), in which a step the core asked to `Save` after also carries the snapshot taken then (a restored
session starts with a row 0 that holds only its snapshot). What the core needs to rebuild a session is its latest
snapshot plus the journal after it; rows before it are kept only as history for watchers and keys, up to
`STEPS_KEPT` unkeyed and `KEYS_KEPT` keyed steps per session.

Writes go through one group-commit task: every write waits until the transaction holding it has committed with
`synchronous=FULL` in WAL mode (the WAL is fsync'd), and writes that arrive while a commit runs share the next one.
A batch of steps alone is one INSERT statement, so one transaction and one crossing of the GIL for the commit thread.
A failed commit fails every write in it; nothing is retried, so nothing is acknowledged that is not on disk.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

log = structlog.get_logger("devd.store")

KEYS_KEPT = 1000
STEPS_KEPT = 1000
PRUNE_EVERY_STEPS = 256
ROWS_PER_STATEMENT = 500  # 7 variables a row, well under SQLite's 32,766

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY,
    config BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'ok',
    reason TEXT
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS journal (
    session TEXT NOT NULL,
    seq INTEGER NOT NULL,
    key TEXT,
    digest BLOB,
    event BLOB NOT NULL,
    actions BLOB NOT NULL,
    snapshot BLOB,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS journal_key ON journal (session, key) WHERE key IS NOT NULL;
"""


@dataclass(frozen=True)
class Stored:
    """What a session is on disk: enough to rebuild it exactly."""

    name: str
    config: bytes
    snapshot: bytes | None
    snapshot_seq: int
    state: str
    reason: str | None
    journal: list[tuple[int, bytes, bytes]]  # (seq, event, actions) after the snapshot, in order

    @property
    def seq(self) -> int:
        return self.journal[-1][0] if self.journal else self.snapshot_seq


@dataclass(frozen=True)
class Keyed:
    seq: int
    digest: bytes
    actions: bytes


@dataclass(frozen=True)
class StepRow:
    """One answered step; rows of a batch are written with one executemany, so the commit thread takes the GIL a
    handful of times per batch rather than several times per step."""

    name: str
    seq: int
    event: bytes
    actions: bytes
    key: str | None
    digest: bytes | None
    snapshot: bytes | None


Op = Callable[[sqlite3.Connection], None] | StepRow


@dataclass
class _Pending:
    op: Op
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA busy_timeout=5000")
    return db


class Store:
    """The SQLite file of one daemon. `run()` must be running (in the daemon's task group) for writes to commit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer = _connect(path)
        self._writer.executescript(_SCHEMA)
        self._reader = _connect(path)
        self._pending: list[_Pending] = []
        self._wake = anyio.Event()
        self.commits = 0
        self.commit_seconds: list[float] = []
        self._pruned: dict[str, int] = {}  # the seq each session was last pruned at (commit thread only)

    def close(self) -> None:
        self._writer.close()
        self._reader.close()

    # -- writes ---------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Commit pending writes in batches, for ever; each batch is one transaction, one fsync."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            batch, self._pending = self._pending, []
            if batch:
                await self._commit(batch)

    async def flush(self) -> None:
        """Commit whatever is pending now (used at shutdown, when run() is no longer scheduled)."""
        batch, self._pending = self._pending, []
        if batch:
            await self._commit(batch)

    async def _commit(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        error = await anyio.to_thread.run_sync(self._apply, [p.op for p in batch], abandon_on_cancel=False)
        self.commits += 1
        self.commit_seconds.append(time.perf_counter() - started)
        del self.commit_seconds[:-1024]
        for p in batch:
            p.error = error
            p.done.set()

    def _apply(self, ops: list[Op]) -> BaseException | None:
        db = self._writer
        rows = [op for op in ops if isinstance(op, StepRow)]
        try:
            if len(rows) == len(ops) and len(rows) <= ROWS_PER_STATEMENT:
                _insert_steps(db, rows)  # one statement: its own transaction
            else:
                db.execute("BEGIN IMMEDIATE")
                for op in ops:
                    if isinstance(op, StepRow):
                        _insert_steps(db, [op])
                    else:
                        op(db)
                db.execute("COMMIT")
        except BaseException as e:  # every write in the batch fails; none is retried
            if db.in_transaction:
                db.execute("ROLLBACK")
            return e
        self._prune_some(db, rows)
        return None

    def _prune_some(self, db: sqlite3.Connection, rows: list[StepRow]) -> None:
        """Maintenance after a commit: what it drops was already replaced by a later snapshot."""
        for r in rows:
            if r.snapshot is not None and r.seq - self._pruned.get(r.name, 0) >= PRUNE_EVERY_STEPS:
                try:
                    with db:
                        _prune(db, r.name, r.seq)
                except sqlite3.Error as e:
                    log.warning("store.prune_failed", session=r.name, error=str(e))
                self._pruned[r.name] = r.seq

    async def write(self, op: Op) -> None:
        """Apply op in the next commit and return once it is durable; raise if the commit failed."""
        pending = _Pending(op)
        self._pending.append(pending)
        self._wake.set()
        await pending.done.wait()
        if pending.error is not None:
            raise OSError(f"the state could not be made durable: {pending.error}") from pending.error

    # -- the operations -------------------------------------------------------------------------------------------

    @staticmethod
    def create(name: str, config: bytes, snapshot: bytes | None = None) -> Op:
        def op(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM journal WHERE session = ?", (name,))
            db.execute("INSERT OR REPLACE INTO sessions (name, config) VALUES (?, ?)", (name, config))
            if snapshot is not None:
                _insert_steps(db, [StepRow(name, 0, b"", b"", None, None, snapshot)])

        return op

    @staticmethod
    def step(
        name: str, seq: int, event: bytes, actions: bytes, key: str | None, digest: bytes | None, snapshot: bytes | None
    ) -> Op:
        return StepRow(name, seq, event, actions, key, digest, snapshot)

    @staticmethod
    def set_state(name: str, state: str, reason: str | None) -> Op:
        def op(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sessions SET state = ?, reason = ? WHERE name = ?", (state, reason, name))

        return op

    @staticmethod
    def delete(name: str) -> Op:
        def op(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM journal WHERE session = ?", (name,))
            db.execute("DELETE FROM sessions WHERE name = ?", (name,))

        return op

    # -- reads (event-loop thread, a connection of their own) ------------------------------------------------------

    def names(self) -> list[tuple[str, str, str | None, int]]:
        """Every stored session: (name, state, reason, seq)."""
        return [
            (name, state, reason, seq)
            for name, state, reason, seq in self._reader.execute(
                "SELECT s.name, s.state, s.reason, COALESCE(MAX(j.seq), 0) "
                "FROM sessions s LEFT JOIN journal j ON j.session = s.name GROUP BY s.name ORDER BY s.name"
            )
        ]

    def load(self, name: str) -> Stored | None:
        row = self._reader.execute("SELECT config, state, reason FROM sessions WHERE name = ?", (name,)).fetchone()
        if row is None:
            return None
        config, state, reason = row
        saved = self._reader.execute(
            "SELECT seq, snapshot FROM journal WHERE session = ? AND snapshot IS NOT NULL ORDER BY seq DESC LIMIT 1",
            (name,),
        ).fetchone()
        snapshot_seq, snapshot = saved if saved else (0, None)
        journal = self._reader.execute(
            "SELECT seq, event, actions FROM journal WHERE session = ? AND seq > ? ORDER BY seq", (name, snapshot_seq)
        ).fetchall()
        return Stored(name, config, snapshot, snapshot_seq, state, reason, journal)

    def keyed(self, name: str, key: str) -> Keyed | None:
        row = self._reader.execute(
            "SELECT seq, digest, actions FROM journal WHERE session = ? AND key = ?", (name, key)
        ).fetchone()
        return Keyed(*row) if row else None

    def steps_since(self, name: str, since: int) -> list[tuple[int, bytes, bytes]]:
        return self._reader.execute(
            "SELECT seq, event, actions FROM journal WHERE session = ? AND seq > ? ORDER BY seq", (name, since)
        ).fetchall()


def _insert_steps(db: sqlite3.Connection, rows: list[StepRow]) -> None:
    """Rows in one statement: sqlite3 releases the GIL around every statement it steps, and the commit thread has to
    win it back from the busy event loop each time, so one statement for a batch is much faster than one a row."""
    db.execute(
        "INSERT INTO journal (session, seq, key, digest, event, actions, snapshot) VALUES "
        + ",".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(rows)),
        [v for r in rows for v in (r.name, r.seq, r.key, r.digest, r.event, r.actions, r.snapshot)],
    )


def _prune(db: sqlite3.Connection, name: str, snapshot_seq: int) -> None:
    """Drop history behind the snapshot at snapshot_seq beyond what watchers and keys are promised."""
    db.execute(
        "UPDATE journal SET snapshot = NULL WHERE session = ? AND seq < ? AND snapshot IS NOT NULL",
        (name, snapshot_seq),
    )
    db.execute(
        "DELETE FROM journal WHERE session = ? AND key IS NULL AND seq < ? AND seq <= ?",
        (name, snapshot_seq, snapshot_seq - STEPS_KEPT),
    )
    db.execute(
        "DELETE FROM journal WHERE session = ? AND key IS NOT NULL AND seq < ? AND seq < ("
        " SELECT seq FROM journal WHERE session = ? AND key IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET ?)",
        (name, snapshot_seq, name, KEYS_KEPT - 1),
    )
