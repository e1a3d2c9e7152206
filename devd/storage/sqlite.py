"""The embedded store: one SQLite file per daemon. The only module that touches SQLite.

Writes go through one commit thread (the group commit of `devd.storage.commits`): every write waits until the
transaction holding it has committed with `synchronous=FULL` in WAL mode (the WAL is fsync'd), and writes that arrive
while a commit runs share the next one. A batch of steps alone is one INSERT statement, so one transaction and one
crossing of the GIL for the commit thread. A failed commit fails every write in it with `StoreError`; nothing is
retried, so nothing is acknowledged that is not on disk. After a write fault (a failed write or fsync) every write
fails until the store has reopened the database: a fresh connection, its identity, format and pages checked, its log
checkpointed and fsync'd; it tries at every write and read, and on its own while none comes, backing off (up to
REOPEN_DELAY_S apart) for as long as the faults go on, and counts each reopen (`reopened`), so that the registry
rebuilds its live sessions from what is on disk. Maintenance runs on the commit thread once a batch is answered,
never inside a commit: the log is checkpointed once its file has grown past WAL_BYTES_KEPT (SQLite's own
checkpoints are off) and then written again from its start, and each snapshot committed lets go of the ones its
session's kept history no longer needs, with their files, and prunes history every `prune_every_steps` (both decided
by `devd.storage.retention`). The file is opened in exclusive locking mode, through one connection that commits and
reads take turns on; reads run on a thread of their own, batched (`devd.storage.reads`), never on the event loop and
never behind calls moved off it. Spend counters are updated on the commit thread too, so a reservation's check and its
update are one step no other write comes between (one daemon has the file); reservations left by a daemon that
stopped are released when it opens the file again.

A large snapshot (`FILE_SNAPSHOT_BYTES` or more) is kept in a file of its own in `snapshots/` beside the database,
so writing, fsyncing and checkpointing megabytes never holds up the commit thread: its step is committed and
acknowledged without it, and the snapshot is written by one writer afterwards (a newer one of the same session
replaces one still queued), fsync'd, renamed into place, and only then pointed at from the step's row by a commit of
its own. A snapshot is a cache of what the journal derives, so one that never lands (a crash, a full disk, the session
deleted or made again meanwhile) costs a longer replay, never a step. A snapshot that is a session's state rather
than a cache (a restore's, a fork's) is written to its file before the commit that names it, and so is the snapshot
of a step whose row is large (`LARGE_ROW_BYTES`): pointing a row at its file rewrites the whole row, megabytes that the
commit thread would write and checkpoint again while every other write waits. A row holds its file snapshot as an
empty `snapshot` (no snapshot is empty) and the file's name, so the newest snapshot is found as before; a file no
row names any more is removed after the commit that let it go, and at open (after a crash). A backup is one file
still: it carries the snapshots' bytes inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import structlog

from devd import failpoints, files
from devd.errors import ExistsError
from devd.storage.boundary import map_exceptions
from devd.storage.commits import FORK_COPY_BYTES, GroupCommit, spans
from devd.storage.migrations import Migrations
from devd.storage.reads import ReadThread
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

log = structlog.get_logger("devd.storage.sqlite")

ROWS_PER_STATEMENT = 500  # 10 variables a row, well under SQLite's 32,766
# The log's file: SQLite cuts it back to this at the first commit after a checkpoint, and the commit thread
# checkpoints it once it has grown past this (between batches).
WAL_BYTES_KEPT = 4 << 20
ROW = "seq, event, actions, answer"  # the columns of a `Row`
INLINE_READ_BYTES = 64 << 10  # the most a read on the event loop takes; larger ones run on a worker thread
SNAPSHOTS_DIR = "snapshots"  # beside the database: the large snapshots' files
FILE_SNAPSHOT_BYTES = 256 << 10  # a snapshot this long or longer is kept in a file, written off the commit thread
# A step whose row (event and answer) is this long or longer has its snapshot's file written before its commit, which
# names it: pointing at it afterwards rewrote the whole row (SQLite writes a row anew to change a column of it).
LARGE_ROW_BYTES = 1 << 20
SNAPSHOTS_QUEUED_BYTES_MAX = 512 << 20  # past this, a snapshot waiting for its file is dropped (it is only a cache)
SNAPSHOT_WRITE_S = 10  # the most one snapshot file and its pointer may take; past it the snapshot is dropped
SNAPSHOTS_AT_SHUTDOWN_S = 5  # how long a shutdown waits for the snapshot files still queued (systemd waits 20 s)
T = TypeVar("T")
U = TypeVar("U")

FORK_NOTE = "fork:"  # a `meta` key: the fork of this name is being copied, not made yet

# The on-disk format, one migration per version (`PRAGMA user_version` counts those applied), run by
# `devd.storage.migrations` at start. Never edit a migration that has shipped: add the next one.
MIGRATIONS: tuple[str, ...] = (
    # 1: sessions and their journal (the first release, which did not set user_version)
    """
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
    """,
    # 2: the database's identity, checked against the file beside it
    """
    CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
    """,
    # 3: when a session was made and when each step was journalled (wall-clock seconds), for lists and expiry;
    # sessions from before it count as made when it ran
    """
    ALTER TABLE sessions ADD COLUMN created REAL;
    ALTER TABLE journal ADD COLUMN at REAL;
    UPDATE sessions SET created = (julianday('now') - 2440587.5) * 86400.0;
    """,
    # 4: an answer may be kept as its digest alone (`actions` is then empty: no answer is an empty array), derived
    # again from the events when asked for; rows from before keep their actions whole and no digest
    """
    ALTER TABLE journal ADD COLUMN answer BLOB;
    """,
    # 5: a large snapshot may be kept in a file of `snapshots/` beside the database: its row's snapshot is then empty
    # (no snapshot is empty) and `snapshot_file` names the file; the index finds the rows that still need a file
    """
    ALTER TABLE journal ADD COLUMN snapshot_file TEXT;
    CREATE INDEX IF NOT EXISTS journal_snapshot_file ON journal (snapshot_file) WHERE snapshot_file IS NOT NULL;
    """,
    # 6: each session's record log (devd.storage.store.Record): what the daemon did for it beside its journal
    """
    CREATE TABLE IF NOT EXISTS records (
        session TEXT NOT NULL,
        n INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        action INTEGER NOT NULL,
        body BLOB NOT NULL,
        at REAL NOT NULL,
        PRIMARY KEY (session, n)
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS records_kind ON records (kind, session);
    """,
    # 7: a session's records of a kind found without reading its others (a trace of 300,000 records made every read
    # of its binding read them all, under the connection's lock)
    """
    CREATE INDEX IF NOT EXISTS records_session_kind ON records (session, kind, n);
    """,
    # 8: spend counters (devd.storage.store.Counter) and the reservations of calls in flight, which lived in one
    # daemon's memory (a restart spent the day again); counted at once from the usage and refusal records kept so far
    # (a fork's copies of its source's records count for the source only)
    """
    CREATE TABLE spend (
        scope TEXT NOT NULL,
        owner TEXT NOT NULL,
        part TEXT NOT NULL,
        spent INTEGER NOT NULL DEFAULT 0,
        reserved INTEGER NOT NULL DEFAULT 0,
        input_tokens INTEGER NOT NULL DEFAULT 0,
        output_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        calls INTEGER NOT NULL DEFAULT 0,
        refused INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, owner, part)
    ) WITHOUT ROWID;
    CREATE TABLE reservations (
        id INTEGER NOT NULL,
        scope TEXT NOT NULL,
        owner TEXT NOT NULL,
        part TEXT NOT NULL,
        tokens INTEGER NOT NULL,
        PRIMARY KEY (id, scope, owner, part)
    ) WITHOUT ROWID;
    CREATE TEMP VIEW used AS SELECT session,
        json_extract(CAST(body AS TEXT), '$.profile') AS profile,
        CAST(json_extract(CAST(body AS TEXT), '$.turn') AS TEXT) AS turn,
        json_extract(CAST(body AS TEXT), '$.day') AS day,
        json_extract(CAST(body AS TEXT), '$.usage.input_tokens') AS i,
        json_extract(CAST(body AS TEXT), '$.usage.output_tokens') AS o,
        COALESCE(json_extract(CAST(body AS TEXT), '$.usage.cached_tokens'), 0) AS c
        FROM records WHERE kind = 'usage' AND json_extract(CAST(body AS TEXT), '$.session') = session;
    INSERT INTO spend (scope, owner, part, spent, input_tokens, output_tokens, cached_tokens, calls)
        SELECT 'session', session, '', SUM(i + o), SUM(i), SUM(o), SUM(c), COUNT(*) FROM used GROUP BY session;
    INSERT INTO spend (scope, owner, part, spent) SELECT 'turn', session, turn, SUM(i + o) FROM used
        GROUP BY session, turn;
    INSERT INTO spend (scope, owner, part, spent) SELECT 'day', profile, day, SUM(i + o) FROM used
        GROUP BY profile, day;
    INSERT INTO spend (scope, owner, part, refused) SELECT 'session', session, '', COUNT(*) FROM records
        WHERE kind = 'refusal' AND json_extract(CAST(body AS TEXT), '$.session') = session GROUP BY session
        ON CONFLICT (scope, owner, part) DO UPDATE SET refused = excluded.refused;
    DROP VIEW used;
    """,
    # 9: the journal and the record log as rowid tables, their large columns last. A WITHOUT ROWID table's rows are
    # the keys of its b-tree, and SQLite loads a key that spills onto overflow pages whole to compare it: every seek
    # that passed a step of 8 MiB (making, stepping or deleting any session) read all of it, and small commits queued
    # behind it on the commit thread (session/new's p99 from 0.06 to 2.2 s beside one such client). A rowid table's
    # b-tree is keyed by integers, its (session, seq) index holds only the key, and a row's small columns are read
    # without walking past its large ones.
    """
    CREATE TABLE journal_rows (
        session TEXT NOT NULL,
        seq INTEGER NOT NULL,
        key TEXT,
        digest BLOB,
        at REAL,
        answer BLOB,
        snapshot_file TEXT,
        snapshot BLOB,
        actions BLOB NOT NULL,
        event BLOB NOT NULL,
        PRIMARY KEY (session, seq)
    );
    INSERT INTO journal_rows (session, seq, key, digest, at, answer, snapshot_file, snapshot, actions, event)
        SELECT session, seq, key, digest, at, answer, snapshot_file, snapshot, actions, event FROM journal
        ORDER BY session, seq;
    DROP TABLE journal;
    ALTER TABLE journal_rows RENAME TO journal;
    CREATE INDEX journal_key ON journal (session, key) WHERE key IS NOT NULL;
    CREATE INDEX journal_snapshot_file ON journal (snapshot_file) WHERE snapshot_file IS NOT NULL;
    CREATE TABLE records_rows (
        session TEXT NOT NULL,
        n INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        action INTEGER NOT NULL,
        at REAL NOT NULL,
        body BLOB NOT NULL,
        PRIMARY KEY (session, n)
    );
    INSERT INTO records_rows (session, n, seq, kind, action, at, body)
        SELECT session, n, seq, kind, action, at, body FROM records ORDER BY session, n;
    DROP TABLE records;
    ALTER TABLE records_rows RENAME TO records;
    CREATE INDEX records_kind ON records (kind, session);
    CREATE INDEX records_session_kind ON records (session, kind, n);
    """,
)
FORMAT = Migrations(MIGRATIONS)
BY_KIND = "records_session_kind"  # the index of a session's records by kind (7)
# A session's own counters (8), and its calls' reservations on them: a late release of a call of the session before
# must not take from the counters of one made again under its name.
OWN_SPEND = (
    "DELETE FROM spend WHERE scope IN ('session', 'turn') AND owner = ?",
    "DELETE FROM reservations WHERE scope IN ('session', 'turn') AND owner = ?",
)
SQLITE_IOERR = 10  # the primary result code of every I/O error, fsync's included
# How long an open waits for a lock someone else holds on the database. One daemon holds its file exclusively for
# its life, so there is nothing worth waiting for: a second daemon on the same --store was told it is in use only
# after sqlite3's 5 s default. A moment is kept for a brief reader (a `devd doctor` of the stopped daemon's file).
BUSY_TIMEOUT_S = 0.25
REOPEN_DELAY_S = (0.05, 5.0)  # after a fault a reopen is tried at once, then after each delay, doubled up to the cap


class _FiledStep(msgspec.Struct, frozen=True):
    """A step whose snapshot was written to `file` before its commit: its row names the file from the start."""

    step: Step  # its snapshot b"": the row's mark of a snapshot kept in a file
    file: str


Op = Callable[[sqlite3.Connection], None] | Step | _FiledStep

# -- the boundary: what SQLite and the file system raise, and what crosses instead ------------------------------------

FAULTS: tuple[type[Exception], ...] = (sqlite3.Error, OSError)


def _failing(
    say: Callable[[Exception], str], faults: tuple[type[Exception], ...] = FAULTS
) -> AbstractContextManager[None]:
    """Every translation of this module's faults to StoreError goes through here."""
    return map_exceptions(faults, say)


def _read_failed(e: Exception) -> str:
    return f"reading the database failed: {e}"


def _commit_failure(e: BaseException) -> StoreError:
    """What each write of a batch whose commit failed is answered."""
    if _is_io_error(e):
        # The log may hold the write even though its fsync failed: whether it survives is known once the store has
        # reopened the database, which then serves what is on disk.
        return StoreError(
            f"the write may or may not be on disk ({e}); the store reopens the database (at the next call, or on "
            "its own shortly): send it again then (a step with the same key answers replayed if it was kept)"
        )
    return StoreError(f"the state could not be made durable and nothing of it was applied: {e}")


def _is_io_error(e: BaseException) -> bool:
    if isinstance(e, sqlite3.Error):
        return (getattr(e, "sqlite_errorcode", 0) & 0xFF) == SQLITE_IOERR
    return isinstance(e, OSError) and e.errno == errno.EIO


def _locked_hint(e: Exception) -> str:
    return " (another process has it open: close it)" if "locked" in str(e) else ""


def _next(e: Exception) -> str:
    """What to do about a database that cannot be opened for what it holds (not for a lock, which says its own)."""
    if "locked" in str(e):
        return ""
    return "; `devd doctor` checks it, and a backup restores it (docs/operations.md, Backups)"


class _SnapshotJob(msgspec.Struct, frozen=True):
    """A large snapshot waiting for its file: taken after step `seq` of `session` while the session's name was at
    `generation` (see `SQLiteStore._generations`)."""

    session: str
    seq: int
    snapshot: bytes
    generation: int | None


class _Pointer(msgspec.Struct):
    """The commit that makes a written snapshot file the snapshot of its step's row (on the commit thread)."""

    job: _SnapshotJob
    file: str | None  # None: a small snapshot, kept in the row itself
    generations: dict[str, int]
    landed: bool = False  # whether it was pointed at; if not, the file is nobody's

    def __call__(self, db: sqlite3.Connection) -> None:
        job = self.job
        if self.generations.get(job.session) != job.generation:
            return  # the name was deleted, made again or forked over since the step: its row is another session's
        # Only onto the step's own row, still without a snapshot, of a session that exists, and never behind a newer
        # snapshot (pruning may already have dropped what an older one would anchor).
        pointed = db.execute(
            "UPDATE journal SET snapshot = ?, snapshot_file = ? WHERE session = ? AND seq = ? AND snapshot IS NULL "
            "AND EXISTS (SELECT 1 FROM sessions WHERE name = ?) AND NOT EXISTS (SELECT 1 FROM journal "
            "WHERE session = ? AND seq > ? AND snapshot IS NOT NULL)",
            (
                b"" if self.file is not None else job.snapshot,
                self.file,
                job.session,
                job.seq,
                job.session,
                job.session,
                job.seq,
            ),
        )
        self.landed = pointed.rowcount == 1


def _try_reopen(db: sqlite3.Connection) -> None:
    """The healer's write: nothing, committed once the store has reopened (a batch of a broken store tries first)."""


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    _configure(db)
    return db


def _configure(db: sqlite3.Connection) -> None:
    # Exclusive before anything reads the file: the WAL index then lives in this process's heap, not in a mapped
    # `-shm` file whose failed write would kill the process with SIGBUS. Only this connection may use the file, which
    # the state directory's lock (devd.server.listeners.lock_state_dir) makes true anyway.
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(f"PRAGMA journal_size_limit={WAL_BYTES_KEPT}")
    # No checkpoint inside a commit (SQLite's default runs one in the commit that passes 1,000 pages, and every step
    # of that batch waits for it): the commit thread checkpoints after a batch is answered (`_checkpoint_if_due`).
    db.execute("PRAGMA wal_autocheckpoint=0")


class SQLiteStore:
    """The SQLite file of one daemon (see `devd.storage.store.Store` for the contract)."""

    def __init__(self, path: Path, *, keys_kept: int, steps_kept: int, prune_every_steps: int) -> None:
        self.path = path
        self.retention = Retention(keys_kept, steps_kept, prune_every_steps)
        self._snapshot_dir = path.parent / SNAPSHOTS_DIR
        self._wal_path = Path(f"{path}-wal")
        self.checkpoints = 0  # the log checkpointed by the commit thread
        self._released: list[str] = []  # snapshot files rows stopped naming in the commit running (commit thread only)
        with _failing(
            lambda e: f"the database {path} cannot be opened: {e}{_locked_hint(e)}; it was left as it is{_next(e)}",
            (sqlite3.Error,),
        ):
            _check_wal(path)
            self._db = _connect(path)
            _check_identity(self._db, path)  # before migrating: a database refused is left exactly as it was
            migrate(self._db, path)
            self.id = _identify(self._db, path)
            with self._db:
                for (note,) in self._db.execute("SELECT key FROM meta WHERE key LIKE 'fork:%'").fetchall():
                    _drop_unmade_fork(self._db, None, note.removeprefix(FORK_NOTE))
                # Calls in flight when the daemon stopped: none is now (one daemon has the file), so none holds tokens.
                self._db.execute("UPDATE spend SET reserved = 0 WHERE reserved != 0")
                self._db.execute("DELETE FROM reservations")
            self._thin_all()
            self._sweep_snapshot_files()
        self._inode = _identity(path)
        self._wal_inode = _identity(self._wal_path)  # None until the log exists (its first commit makes it)
        # Set by a write fault: nothing more is acknowledged until the store has reopened itself (`_reopen`).
        self._broken: str | None = None
        self._reopen_at = 0.0  # monotonic time before which no reopen is tried (backing off while the disk fails)
        self._reopen_delay_s = 0.0
        self._reopened_thread = 0  # reopens done, as the commit thread counts them
        self.reopened = 0  # reopens done, as the event loop has been told of them (see `devd.storage.store.Store`)
        self._reads = ReadThread("devd-read")
        self._lock = threading.Lock()  # one connection: the commit thread and readers take turns
        self._commits: GroupCommit[Op] = GroupCommit()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pruned: dict[str, int] = {}  # the seq each session was last pruned at (commit thread only)
        # Set anew (from a counter) by every create and fork of a name, dropped by its delete, on the commit thread: a
        # snapshot file is pointed at only if its name's generation is still the one its step was appended under.
        self._generations: dict[str, int] = {}
        self._generation_next = 0
        self._snapshot_jobs: dict[str, _SnapshotJob] = {}  # waiting for their file, oldest first, one a session
        self._snapshot_jobs_bytes = 0
        self._snapshots_pending = 0  # snapshots handed to `append` and not yet landed or dropped
        self._snapshots_changed = anyio.Event()  # a job queued or a snapshot no longer pending
        self._snapshots_settled = anyio.Event()  # set when none is pending
        self._running = False
        self._faulted = anyio.Event()  # set (on the event loop) when the store breaks: the healer starts trying

    def close(self) -> None:
        self._reads.stop()
        with self._lock:
            self._db.close()

    def statistics(self) -> StoreStats:
        return self._commits.times.statistics(reopened=self.reopened)

    # -- writes ---------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Commit on a thread of its own for as long as this runs: a commit never waits for a worker thread, and a
        write reaches it without a turn of the event loop. Writes queued while a commit runs share the next one.
        Meanwhile write the large snapshots' files, one at a time; cancelled, finish those queued (for a while)."""
        self._loop = asyncio.get_running_loop()
        self._commits.start_thread(self._commit, name="devd-commit")
        self._running = True
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heal)
                await self._write_snapshots(until_idle=False)
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(SNAPSHOTS_AT_SHUTDOWN_S):
                    await self._write_snapshots(until_idle=True)
                if self._snapshot_jobs:  # out of time: they are only a cache
                    log.warning("store.snapshot_dropped", snapshots=len(self._snapshot_jobs), why="shutdown")
                    for _ in self._snapshot_jobs:
                        self._snapshot_done()
                    self._snapshot_jobs.clear()
                    self._snapshot_jobs_bytes = 0
                await self._commits.stop_thread()
                self._running = False

    async def flush(self) -> None:
        """Wait until everything handed to the store is done: writes committed (and the pruning after them), snapshot
        files written and pointed at. Without `run` (it ended, or never ran) run it meanwhile, or the writers wait for
        ever."""
        if self._running:
            await self._wait_idle()
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.run)
            await self._wait_idle()
            tg.cancel_scope.cancel()

    async def _wait_idle(self) -> None:
        while True:
            await self._commits.wait_idle()
            if not self._snapshots_pending:
                return
            while self._snapshots_pending:  # each ends in a pointer's commit: waited for on the next turn
                if self._snapshots_settled.is_set():
                    self._snapshots_settled = anyio.Event()
                await self._snapshots_settled.wait()

    async def _heal(self) -> None:
        """While the store is broken, try to reopen it each time its backoff ends, as a call would: service resumes
        once the disk takes writes again (and the registry rebuilds from it), whether or not calls come meanwhile."""
        while True:
            await self._faulted.wait()
            self._faulted = anyio.Event()  # before the tries: a fault during them is waited for again
            while self._broken is not None:
                await anyio.sleep(max(0.0, self._reopen_at - time.monotonic()))
                await self._commits.write(_try_reopen)  # its error is the fault's, answered to nobody

    def _commit(self, ops: list[Op]) -> tuple[list[BaseException | None], Callable[[], None]]:
        """A batch, on the commit thread: one transaction under the lock; then, once its writers are answered,
        the maintenance it calls for, between batches (what that writes holds up no step answered)."""
        with self._lock:
            error, snapshots = self._apply(ops)

        def maintain() -> None:
            with self._lock:
                self._prune_some(self._db, snapshots)
                self._checkpoint_if_due()

        return [error] * len(ops), maintain

    def _apply(self, ops: list[Op]) -> tuple[BaseException | None, list[tuple[str, int]]]:
        """Commit `ops` in one transaction; the error that failed them all (or None), and the snapshots (session,
        seq) it stored, for the maintenance after it."""
        steps = [_filed(op) for op in ops if isinstance(op, Step | _FiledStep)]
        pointers = [op for op in ops if isinstance(op, _Pointer)]
        if self._broken is not None and not self._reopen():
            return StoreError(self._broken), []
        db = self._db  # after a reopen: the fresh connection
        self._released.clear()
        try:
            self._check_file()
            failpoints.hit("commit.before")
            if pointers or any(s.snapshot is not None for s, _ in steps):
                failpoints.hit("commit.snapshot")
            if len(steps) == len(ops) and len(steps) <= ROWS_PER_STATEMENT:
                _insert_steps(db, steps)  # one statement: its own transaction
            else:
                db.execute("BEGIN IMMEDIATE")
                for op in ops:
                    if isinstance(op, Step | _FiledStep):
                        _insert_steps(db, [_filed(op)])
                    else:
                        op(db)
                db.execute("COMMIT")
        except BaseException as e:  # every write in the batch fails; none is retried
            if db.in_transaction:
                db.execute("ROLLBACK")
            for p in pointers:
                p.landed = False
            self._released.clear()
            if _is_io_error(e):
                # After a failed fsync the kernel may have dropped the dirty pages and will not say so again
                # (PostgreSQL's fsyncgate): nothing after it can be trusted to be durable until the store is reopened.
                self._break(f"writing the database failed ({e})")
            return e, []
        try:
            failpoints.hit("commit.after")
        except OSError as e:  # a fault once the batch is durable: as a failed fsync whose writes landed after all
            self._break(f"writing the database failed ({e})")
            return e, []
        self._reopen_delay_s = 0.0  # the disk takes writes again: a next fault is retried at once
        self._remove_released(db)
        snapshots = [(s.session, s.seq) for s, _ in steps if s.snapshot is not None]
        return None, snapshots + [(p.job.session, p.job.seq) for p in pointers if p.landed]

    def _checkpoint_if_due(self) -> None:
        """Copy the log into the database once its file has grown past WAL_BYTES_KEPT (on the commit thread, between
        batches: SQLite's own checkpoints are off), and have the next commit write it again from its start.

        The log is restarted, not truncated to nothing: SQLite cuts its file back to WAL_BYTES_KEPT at that next
        commit (`journal_size_limit`), and the commits after it overwrite blocks the file already has. Appending
        to an emptied log made every commit's fsync write the file's metadata too: a single client's step took
        0.89 ms against 0.64 ms before (issue 20). The file grows past WAL_BYTES_KEPT only when the log has more
        than that since the last checkpoint, so it stays within about that plus one batch."""
        if self._broken is not None:
            return
        try:
            if os.stat(self._wal_path).st_size <= WAL_BYTES_KEPT:
                return
        except FileNotFoundError:
            return
        try:
            failpoints.hit("checkpoint")
            self._db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
        except (sqlite3.Error, OSError) as e:
            if _is_io_error(e):
                self._break(f"checkpointing the database failed ({e})")
            log.warning("store.checkpoint_failed", error=str(e))
            return
        self.checkpoints += 1

    def _check_file(self) -> None:
        """The database file and its log must still be the ones opened: steps written to a deleted or replaced file
        are lost. A log deleted or replaced is first checkpointed through the connection, which still holds the one
        it wrote (so the steps it acknowledged reach the database file), and the store then reopens itself."""
        if _identity(self.path) != self._inode:
            self._break(f"the database file {self.path} was deleted or replaced while the daemon ran")
            raise StoreError(self._broken or "")
        wal = _identity(self._wal_path)
        if self._wal_inode is None:
            self._wal_inode = wal
        elif wal != self._wal_inode:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as e:
                log.error("store.log_rescue_failed", error=str(e))
            self._break(f"the database's log {self._wal_path} was deleted or replaced while the daemon ran")
            raise StoreError(self._broken or "")

    def _break(self, why: str) -> None:
        """A write fault: every call fails until the store has reopened itself (tried at every call and by the healer,
        backing off while the faults go on). Nothing more is acknowledged meanwhile."""
        if self._broken is None:
            self._broken = (
                f"{why}; the store acknowledges no more writes until it has reopened the database (it keeps trying, "
                f"at every call and on its own, at most {REOPEN_DELAY_S[1]:g} s apart while the disk fails; what was "
                "acknowledged before is on disk): send the call again shortly"
            )
            log.error("store.broken", error=self._broken)
            if self._loop is not None:  # the healer (in `run`) starts trying
                self._loop.call_soon_threadsafe(lambda: self._faulted.set())
        self._reopen_at = time.monotonic() + self._reopen_delay_s
        self._reopen_delay_s = min(max(2 * self._reopen_delay_s, REOPEN_DELAY_S[0]), REOPEN_DELAY_S[1])

    def _reopen(self) -> bool:
        """After a write fault, on the commit thread (the lock held): a fresh connection to the same file, its
        identity, format and pages checked, and its log checkpointed into the database and fsync'd, so that what
        the pages in memory say is what is on disk (after a failed fsync the kernel may have dropped the dirty
        pages and will not say so again); then writes go on through it. False while the fault lasts."""
        if time.monotonic() < self._reopen_at:
            return False
        try:
            self._db.close()
        except sqlite3.Error:
            pass  # the old connection's last checkpoint failed: the new one does it again
        try:
            failpoints.hit("reopen")
            db = _reconnect(self.path, self.id)
        except (sqlite3.Error, OSError, StoreError) as e:
            self._break(f"reopening the database failed ({e})")
            log.warning("store.reopen_failed", error=str(e), retry_in_s=round(self._reopen_at - time.monotonic(), 3))
            return False
        self._db, self._inode, self._broken = db, _identity(self.path), None
        self._wal_inode = _identity(self._wal_path)
        self._pruned.clear()  # their seqs are those before the fault: pruned again at their next snapshot
        self._reopened_thread += 1
        log.warning("store.reopened", database=str(self.path), reopens=self._reopened_thread)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._told_reopened, self._reopened_thread)
        return True

    def _told_reopened(self, reopens: int) -> None:
        self.reopened = reopens

    def _prune_some(self, db: sqlite3.Connection, snapshots: list[tuple[str, int]]) -> None:
        """Maintenance after a commit that stored snapshots (session, seq), in a transaction of its own once that
        commit is answered: the snapshots the kept history no longer needs go at once (`_thin`), and the history
        beyond what is promised every `prune_every_steps` (`_prune`). What it drops was already replaced by a later
        snapshot."""
        if self._broken is not None:
            return
        for session, seq in snapshots:
            due = self.retention.due(seq, self._pruned.get(session, 0))
            self._released.clear()
            try:
                failpoints.hit("prune")
                plan = self.retention.plan(self._snapshots(db, session, seq), seq)
                if not due and not plan.thinned:
                    continue
                db.execute("BEGIN IMMEDIATE")  # one transaction, one fsync, for every statement
                if due:
                    self._prune(db, session, plan.anchor)
                self._drop_snapshots(db, session, plan.thinned)
                db.execute("COMMIT")
                self._remove_released(db)
            except (sqlite3.Error, OSError) as e:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                self._released.clear()
                if _is_io_error(e):
                    self._break(f"pruning the database failed ({e})")
                log.warning("store.prune_failed", session=session, error=str(e))
            if due:
                self._pruned[session] = seq

    def _snapshots(self, db: sqlite3.Connection, name: str, latest: int) -> list[int]:
        """The seqs of the session's snapshots at or before `latest`, ascending, from the anchor on (the newest before
        the oldest step promised): what `Retention.plan` decides from (older ones change nothing)."""
        return [
            seq
            for (seq,) in db.execute(
                "SELECT seq FROM journal WHERE session = ? AND snapshot IS NOT NULL AND seq <= ? AND seq >= COALESCE(("
                "SELECT seq FROM journal WHERE session = ? AND snapshot IS NOT NULL AND seq < ? ORDER BY seq DESC "
                "LIMIT 1), 0) ORDER BY seq",
                (name, latest, name, self.retention.promised_from(latest)),
            )
        ]

    def _drop_snapshots(self, db: sqlite3.Connection, name: str, seqs: list[int]) -> None:
        """Clear the snapshots of these steps of `name` (their rows stay); their files go once that is committed."""
        for seq in seqs:
            self._release_files(db, "session = ? AND seq = ?", (name, seq))
        db.executemany(
            "UPDATE journal SET snapshot = NULL, snapshot_file = NULL WHERE session = ? AND seq = ?",
            [(name, seq) for seq in seqs],
        )

    def _thin_all(self) -> None:
        """At open: thin every session holding more than two snapshot files (a crash came between a snapshot and
        its thinning, or a devd from before thinning wrote them), as `_thinned` says."""
        crowded = self._db.execute(
            "SELECT session, COUNT(*) FROM journal WHERE snapshot_file IS NOT NULL GROUP BY session HAVING COUNT(*) > 2"
        ).fetchall()
        for session, _ in crowded:
            latest = self._db.execute(
                "SELECT MAX(seq) FROM journal WHERE session = ? AND snapshot IS NOT NULL", (session,)
            ).fetchone()[0]
            thin = self.retention.plan(self._snapshots(self._db, session, latest), latest).thinned
            if not thin:
                continue
            self._released.clear()
            self._db.execute("BEGIN IMMEDIATE")
            self._drop_snapshots(self._db, session, thin)
            self._db.execute("COMMIT")
            self._remove_released(self._db)

    def _prune(self, db: sqlite3.Connection, name: str, anchor_seq: int | None) -> None:
        """Drop history beyond what watchers and keys are promised (see `devd.storage.retention`)."""
        if anchor_seq is None:
            return  # everything kept is still derived from the config or the first snapshot
        self._release_files(db, "session = ? AND seq < ?", (name, anchor_seq))
        db.execute(
            "UPDATE journal SET snapshot = NULL, snapshot_file = NULL WHERE session = ? AND seq < ? "
            "AND snapshot IS NOT NULL",
            (name, anchor_seq),
        )
        db.execute("DELETE FROM journal WHERE session = ? AND key IS NULL AND seq < ?", (name, anchor_seq))
        # Keys older than the anchor keep their row (what a retry is answered, or at least that it was answered)
        # up to the number promised; an answer not kept among them can no longer be derived.
        db.execute(
            "DELETE FROM journal WHERE session = ? AND key IS NOT NULL AND seq < ? AND seq < ("
            " SELECT seq FROM journal WHERE session = ? AND key IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET ?)",
            (name, anchor_seq, name, self.retention.keys_offset),
        )

    # -- snapshot files ---------------------------------------------------------------------------------------------

    def _release_files(self, db: sqlite3.Connection, where: str, params: tuple[object, ...]) -> None:
        """Note the files of the rows (`where`) about to be deleted or cleared, to remove once that is committed."""
        self._released += [
            name
            for (name,) in db.execute(
                f"SELECT DISTINCT snapshot_file FROM journal WHERE {where} AND snapshot_file IS NOT NULL", params
            )
        ]

    def _remove_released(self, db: sqlite3.Connection) -> None:
        """After a commit: remove the files it released that no row names any more (forks share them). One left
        behind (a crash first) goes at the next open."""
        released, self._released = set(self._released), []
        try:
            for name in released:
                if db.execute("SELECT 1 FROM journal WHERE snapshot_file = ? LIMIT 1", (name,)).fetchone() is None:
                    (self._snapshot_dir / name).unlink(missing_ok=True)
        except (sqlite3.Error, OSError) as e:
            log.warning("store.snapshot_file_not_removed", error=str(e), directory=str(self._snapshot_dir))

    def _sweep_snapshot_files(self) -> None:
        """At open: remove this database's snapshot files that no row names (a crash came between a file and its
        pointer, or between a commit and the removal) and half-written ones. Another database's are left alone."""
        named = {n for (n,) in self._db.execute("SELECT snapshot_file FROM journal WHERE snapshot_file IS NOT NULL")}
        ours = f"{self.id}-"
        try:
            removed = [
                e
                for e in os.listdir(self._snapshot_dir)
                if (e.startswith(ours) and e.endswith(".snap") and e not in named)
                or (e.startswith(f".{ours}") and e.endswith(".partial"))
            ]
            for e in removed:
                (self._snapshot_dir / e).unlink(missing_ok=True)
        except FileNotFoundError:
            return  # no large snapshot was ever written
        except OSError as e:  # they only take room: serve anyway
            log.warning("store.snapshot_file_not_removed", error=str(e), directory=str(self._snapshot_dir))
            return
        if removed:
            log.info("store.snapshot_files_removed", files=len(removed), directory=str(self._snapshot_dir))

    def _queue_snapshot(self, job: _SnapshotJob) -> None:
        """Hand a large snapshot to the writer: it replaces an older one of its session still waiting."""
        older = self._snapshot_jobs.pop(job.session, None)
        if older is not None:
            self._snapshot_jobs_bytes -= len(older.snapshot)
            self._snapshot_done()
        if self._snapshot_jobs_bytes + len(job.snapshot) > SNAPSHOTS_QUEUED_BYTES_MAX:
            log.warning("store.snapshot_dropped", session=job.session, seq=job.seq, why="too many queued")
            self._snapshot_done()
            return
        self._snapshot_jobs[job.session] = job
        self._snapshot_jobs_bytes += len(job.snapshot)
        self._snapshots_changed.set()

    def _snapshot_done(self) -> None:
        self._snapshots_pending -= 1
        self._snapshots_changed.set()
        if not self._snapshots_pending:
            self._snapshots_settled.set()

    async def _write_snapshots(self, *, until_idle: bool) -> None:
        """The writer: the queued snapshots' files, oldest first, one at a time; for ever, or until none is pending."""
        while not until_idle or self._snapshots_pending:
            await anyio.lowlevel.checkpoint_if_cancelled()  # the job before was shielded: stop here when cancelled
            if not self._snapshot_jobs:
                self._snapshots_changed = anyio.Event()
                await self._snapshots_changed.wait()
                continue
            job = self._snapshot_jobs.pop(next(iter(self._snapshot_jobs)))
            self._snapshot_jobs_bytes -= len(job.snapshot)
            # Shielded: a shutdown lets the job in progress finish (a file with no pointer would only be swept).
            with anyio.move_on_after(SNAPSHOT_WRITE_S, shield=True) as scope:
                try:
                    await self._write_snapshot(job)
                finally:
                    self._snapshot_done()
            if scope.cancelled_caught:
                log.warning("store.snapshot_dropped", session=job.session, seq=job.seq, why="too slow")

    async def _write_snapshot(self, job: _SnapshotJob) -> None:
        """Write one snapshot's file, then point its step's row at it. A failure drops the snapshot and nothing else:
        the session is rebuilt from an older one, and the store goes on."""
        try:
            file = await anyio.to_thread.run_sync(self._write_snapshot_file, job.snapshot)
        except OSError as e:
            log.warning("store.snapshot_dropped", session=job.session, seq=job.seq, why=f"writing its file failed: {e}")
            return
        pointer = _Pointer(job, file, self._generations)
        try:
            await self._write(pointer)
        except StoreError as e:
            # The pointer may be on disk after all (a failed fsync): keep the file; the next open removes it if not.
            log.warning("store.snapshot_dropped", session=job.session, seq=job.seq, why=str(e))
            return
        if not pointer.landed:
            await anyio.to_thread.run_sync(self._remove_file, file)

    def _write_snapshot_file(self, snapshot: bytes) -> str:
        """A new file holding `snapshot`, durable under its name when this returns (on a worker thread); its name."""
        if not self._snapshot_dir.is_dir():
            self._snapshot_dir.mkdir(mode=0o700, exist_ok=True)
            files.fsync_dir(self._snapshot_dir.parent)  # the directory must outlast a crash before a file in it can
        name = f"{self.id}-{secrets.token_hex(8)}.snap"
        partial = self._snapshot_dir / f".{name}.partial"
        try:
            with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(snapshot)
                f.flush()
                os.fsync(f.fileno())
            failpoints.hit("snapshot.file")
            files.publish(partial, self._snapshot_dir / name)  # its own fsync of the file finds nothing left to write
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return name

    def _remove_file(self, name: str) -> None:
        try:
            (self._snapshot_dir / name).unlink(missing_ok=True)
        except OSError as e:
            log.warning("store.snapshot_file_not_removed", file=name, error=str(e))

    async def _write(self, op: Op) -> None:
        error = await self._commits.write(op)
        if error is not None:
            raise _commit_failure(error) from error

    def _new_generation(self, name: str) -> None:
        """The name now stands for a new session (on the commit thread, in the op that makes it)."""
        self._generation_next += 1
        self._generations[name] = self._generation_next

    async def create(self, name: str, config: bytes, snapshot: bytes | None = None) -> None:
        file = await self._state_file(snapshot)

        def op(db: sqlite3.Connection) -> None:
            self._pruned.pop(name, None)  # a new history: pruned by its own seqs, not the old one's
            self._new_generation(name)
            self._release_files(db, "session = ?", (name,))
            db.execute("DELETE FROM journal WHERE session = ?", (name,))
            db.execute("DELETE FROM records WHERE session = ?", (name,))
            _drop_own_spend(db, name)
            db.execute(
                "INSERT OR REPLACE INTO sessions (name, config, created) VALUES (?, ?, ?)", (name, config, time.time())
            )
            if snapshot is not None:
                db.execute(
                    "INSERT INTO journal (session, seq, event, actions, snapshot, snapshot_file, at) "
                    "VALUES (?, 0, x'', x'', ?, ?, ?)",
                    (name, b"" if file else snapshot, file, time.time()),
                )

        await self._write(op)

    async def _state_file(self, snapshot: bytes | None) -> str | None:
        """A large snapshot that is a session's state rather than a cache (a restore's, a fork's) is kept in a file
        too, but written before the commit that names it, on a worker thread: the commit thread never carries it, and
        the session never exists without it. A file whose commit then fails is swept at the next open."""
        if snapshot is None or len(snapshot) < FILE_SNAPSHOT_BYTES:
            return None
        with _failing(lambda e: f"the snapshot could not be written to {self._snapshot_dir} ({e}); nothing changed"):
            return await anyio.to_thread.run_sync(self._write_snapshot_file, snapshot)

    async def append(self, step: Step) -> None:
        """A large snapshot is left out of the step's commit and written to a file afterwards (see the module); that
        of a step whose row is large too is written first, and the step's commit names it (`LARGE_ROW_BYTES`)."""
        if step.snapshot is None or len(step.snapshot) < FILE_SNAPSHOT_BYTES:
            await self._write(step)
            return
        if len(step.event) + len(step.actions or b"") >= LARGE_ROW_BYTES:
            await self._write(await self._filed_step(step, step.snapshot))
            return
        # The generation before the step is queued: one that changes by the time the pointer commits means the row
        # may be another session's. Read here, off the commit thread: a dictionary read is atomic.
        job = _SnapshotJob(step.session, step.seq, step.snapshot, self._generations.get(step.session))
        self._snapshots_pending += 1
        try:
            await self._write(msgspec.structs.replace(step, snapshot=None))
        except BaseException:
            self._snapshot_done()
            raise
        self._queue_snapshot(job)

    async def _filed_step(self, step: Step, snapshot: bytes) -> Op:
        """A large row's step with its snapshot's file written first, for its commit to name; without the snapshot if
        the file could not be written (it is only a cache, as when a file written after its step fails). A file whose
        commit then fails is swept at the next open."""
        try:
            file = await anyio.to_thread.run_sync(self._write_snapshot_file, snapshot)
        except OSError as e:
            log.warning(
                "store.snapshot_dropped", session=step.session, seq=step.seq, why=f"writing its file failed: {e}"
            )
            return msgspec.structs.replace(step, snapshot=None)
        return _FiledStep(msgspec.structs.replace(step, snapshot=b""), file)

    async def save_snapshot(self, name: str, seq: int, snapshot: bytes) -> None:
        """See `devd.storage.store.Store.save_snapshot`: a large one is written to a file as an appended step's is,
        and waited
        for by `flush`; a small one goes onto its row in a commit."""
        job = _SnapshotJob(name, seq, snapshot, self._generations.get(name))
        if len(snapshot) >= FILE_SNAPSHOT_BYTES:
            self._snapshots_pending += 1
            self._queue_snapshot(job)
            return
        await self._write(_Pointer(job, None, self._generations))

    async def set_health(self, name: str, health: Health, reason: str | None) -> None:
        def op(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sessions SET state = ?, reason = ? WHERE name = ?", (health.value, reason, name))

        await self._write(op)

    async def delete(self, name: str) -> None:
        def op(db: sqlite3.Connection) -> None:
            self._pruned.pop(name, None)
            self._generations.pop(name, None)  # its rows go too: a pointer finds none (a new one gets a new number)
            self._release_files(db, "session = ?", (name,))
            db.execute("DELETE FROM journal WHERE session = ?", (name,))
            db.execute("DELETE FROM records WHERE session = ?", (name,))
            _drop_own_spend(db, name)
            db.execute("DELETE FROM sessions WHERE name = ?", (name,))

        await self._write(op)

    async def truncate(self, name: str, at: int, kinds: tuple[str, ...]) -> None:
        def op(db: sqlite3.Connection) -> None:
            self._pruned.pop(name, None)
            self._new_generation(name)  # a snapshot still being written for a step after `at` must land on no row
            self._release_files(db, "session = ? AND seq > ?", (name, at))
            db.execute("DELETE FROM journal WHERE session = ? AND seq > ?", (name, at))
            for kind in kinds:
                db.execute("DELETE FROM records WHERE session = ? AND kind = ? AND seq > ?", (name, kind, at))

        await self._write(op)

    async def fork(self, source: str, at: int, name: str, snapshot: bytes | None) -> None:
        """The source's journal up to `at` is copied a few MiB a commit (others' steps commit in between, rather
        than wait behind one commit of the whole history), under a note in `meta` that the fork is not made yet;
        the last commit makes the session and drops the note. Rows of a fork cut short (a failure, a crash) belong
        to no session: they are removed then, or at the next open."""
        file = await self._state_file(snapshot)
        cut = await self._read(lambda db: spans(_sizes(db, source, at), at, FORK_COPY_BYTES))
        note = f"{FORK_NOTE}{name}"

        def begin(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (note, source))
            self._release_files(db, "session = ?", (name,))
            db.execute("DELETE FROM journal WHERE session = ?", (name,))

        def copy(lo: int, hi: int) -> Op:
            def op(db: sqlite3.Connection) -> None:
                # Rows copied share their snapshot files with the source's: a file goes once neither names it.
                db.execute(
                    "INSERT INTO journal (session, seq, key, digest, event, actions, snapshot, answer, at, "
                    "snapshot_file) SELECT ?, seq, key, digest, event, actions, snapshot, answer, at, snapshot_file "
                    "FROM journal WHERE session = ? AND seq BETWEEN ? AND ?",
                    (name, source, lo, hi),
                )

            return op

        def op(db: sqlite3.Connection) -> None:
            self._pruned.pop(name, None)
            self._new_generation(name)
            made = db.execute(
                "INSERT OR REPLACE INTO sessions (name, config, created) SELECT ?, config, ? FROM sessions "
                "WHERE name = ?",
                (name, time.time(), source),
            )
            if made.rowcount != 1:
                raise StoreError(f"there is no session {source!r} to fork")
            db.execute("DELETE FROM meta WHERE key = ?", (note,))
            db.execute("DELETE FROM records WHERE session = ?", (name,))
            _drop_own_spend(db, name)  # a fork spends from zero
            db.execute(
                "INSERT INTO records (session, n, seq, kind, action, body, at) SELECT ?, n, seq, kind, action, body, "
                "at FROM records WHERE session = ? AND seq <= ?",
                (name, source, at),
            )
            if snapshot is not None:
                db.execute(
                    "INSERT INTO journal (session, seq, event, actions, snapshot, snapshot_file) "
                    "VALUES (?, ?, x'', x'', ?, ?) ON CONFLICT (session, seq) DO UPDATE SET "
                    "snapshot = excluded.snapshot, snapshot_file = excluded.snapshot_file",
                    (name, at, b"" if file else snapshot, file),
                )

        try:
            await self._write(begin)
            for lo, hi in cut:
                await self._write(copy(lo, hi))
            await self._write(op)
        except StoreError:
            with contextlib.suppress(StoreError):
                await self._write(lambda db: _drop_unmade_fork(db, self, name))
            raise

    # -- reads ----------------------------------------------------------------------------------------------------

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._read_then(fn, lambda got: got)

    async def _read_then(self, fn: Callable[[sqlite3.Connection], T], then: Callable[[T], U]) -> U:
        """`fn` under the lock, then `then` of what it read once the lock is free (on the same worker thread)."""

        def run() -> U:
            with _failing(_read_failed):
                failpoints.hit("read")
                with self._lock:  # no commit in between: the whole read sees one state of the database
                    # A broken store heals at a read too: a client that only reads, or whose keyed steps read
                    # their key first, would otherwise wait for ever for someone else's write to reopen it.
                    if self._broken is not None and not self._reopen():
                        raise StoreError(self._broken)
                    got = fn(self._db)
            return then(got)

        return await self._reads.read(run)

    async def sessions(self) -> list[SessionRow]:
        def read(db: sqlite3.Connection) -> list[SessionRow]:
            return [
                SessionRow(name, Health(state), reason, seq, created, last_used)
                for name, state, reason, seq, created, last_used in db.execute(
                    "SELECT s.name, s.state, s.reason, COALESCE(MAX(j.seq), 0), s.created, "
                    "COALESCE(MAX(j.at), s.created) "
                    "FROM sessions s LEFT JOIN journal j ON j.session = s.name GROUP BY s.name ORDER BY s.name"
                )
            ]

        return await self._read(read)

    async def load(self, name: str) -> Stored | None:
        return await self._read_then(lambda db: _load(db, name, None, self._snapshot_dir), _with_snapshot)

    async def load_at(self, name: str, at: int) -> Stored | None:
        return await self._read_then(lambda db: _load(db, name, at, self._snapshot_dir), _with_snapshot)

    async def keyed(self, name: str, key: str) -> Keyed | None:
        def read(db: sqlite3.Connection, inline: bool) -> Any:
            # Inline, an answer is read only when small: a large one (an event can be megabytes) waits for a worker.
            actions = "CASE WHEN length(actions) <= ? THEN actions END" if inline else "actions"
            return db.execute(
                f"SELECT seq, digest, {actions}, answer, length(actions) FROM journal WHERE session = ? AND key = ?",
                (INLINE_READ_BYTES, name, key) if inline else (name, key),
            ).fetchone()

        # One indexed row: read here when the connection is free (most of the time, it is), rather than pay a
        # thread's round trip; while a commit holds it, wait for it on a worker thread, never on the event loop. A
        # broken store is read on the worker too, which reopens it: its connection may be closed by a reopen that
        # failed, and a keyed step reads its key before it writes, so read here it would never heal.
        row, inline = None, False
        if self._lock.acquire(blocking=False):
            try:
                if self._broken is None:
                    with _failing(_read_failed):
                        row, inline = read(self._db, True), True
            finally:
                self._lock.release()
            if inline and row is None:
                return None
        if row is None or row[2] is None and row[4] > 0:
            row = await self._read(lambda db: read(db, False))
            if row is None:
                return None
        seq, digest, actions, answer, _ = row
        return Keyed(seq, digest, actions or None, answer)

    async def backup(self, path: str) -> int:
        """SQLite's online backup through this store's connection (the file is opened in exclusive mode: copying it,
        or reading it through a second connection, would be unsafe), with the snapshots kept in files put inline in
        the copy, so it is one file still. Commits wait while the pages and those files are copied (no file can be
        removed meanwhile); the copy is written to a new file of an unpredictable name beside `path` and linked into
        place once fsync'd, never over anything already at `path` (ExistsError)."""
        target = Path(path)

        def failed(e: Exception) -> str:
            return f"the backup to {path} failed ({e}); nothing was left there"

        with _failing(failed):
            partial = await anyio.to_thread.run_sync(files.new_partial, target)

        def copy(db: sqlite3.Connection) -> None:
            failpoints.hit("backup")
            out = sqlite3.connect(partial)
            try:
                db.backup(out)
                out.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
                with out:
                    named = out.execute("SELECT DISTINCT snapshot_file FROM journal WHERE snapshot_file IS NOT NULL")
                    for (name,) in named.fetchall():
                        snapshot = (self._snapshot_dir / name).read_bytes()
                        out.execute(
                            "UPDATE journal SET snapshot = ?, snapshot_file = NULL WHERE snapshot_file = ?",
                            (snapshot, name),
                        )
            finally:
                out.close()

        def publish() -> int:
            size = partial.stat().st_size
            files.publish_new(partial, target)
            return size

        try:
            with _failing(failed, (StoreError, OSError)):
                try:
                    await self._read(copy)
                    return await anyio.to_thread.run_sync(publish)
                except FileExistsError:
                    raise ExistsError(
                        f"{target.name} exists; choose a new name (a backup never overwrites a file)"
                    ) from None
        finally:
            partial.unlink(missing_ok=True)
            Path(f"{partial}-journal").unlink(missing_ok=True)  # SQLite's, should the copy have stopped mid-write

    async def add_record(self, record: Record) -> None:
        await self._write(lambda db: _add_record(db, record))

    async def add_records(self, records: Sequence[Record]) -> None:
        def op(db: sqlite3.Connection) -> None:
            for record in records:
                _add_record(db, record)

        await self._write(op)

    # -- spend ----------------------------------------------------------------------------------------------------

    async def reserve(
        self, session: str, counters: Sequence[Counter], checks: Sequence[tuple[Counter, int]], tokens: int
    ) -> int | Over:
        got: list[int | Over] = []

        def op(db: sqlite3.Connection) -> None:
            got.clear()  # a batch may be tried again
            for check, (counter, limit) in enumerate(checks):
                spent, reserved = _counted(db, counter)
                if spent + reserved + tokens > limit:
                    if _exists(db, session):
                        db.execute(
                            f"{TALLY} DO UPDATE SET refused = refused + 1", ("session", session, "", 0, 0, 0, 0, 1)
                        )
                    got.append(Over(check, spent, reserved))
                    return
            number = secrets.randbits(62)  # never given again, so a late release cannot take another call's
            for counter in dict.fromkeys(counters):
                db.execute(
                    "INSERT INTO reservations (id, scope, owner, part, tokens) VALUES (?, ?, ?, ?, ?)",
                    (number, *counter, tokens),
                )
                db.execute(f"{SPEND} DO UPDATE SET reserved = reserved + excluded.reserved", (*counter, 0, tokens))
            got.append(number)

        await self._write(op)
        return got[0]

    async def unreserve(self, reservation: int) -> None:
        await self._write(lambda db: _release(db, reservation))

    async def charge(self, reservation: int | None, counters: Sequence[Counter], tally: Tally, record: Record) -> None:
        def op(db: sqlite3.Connection) -> None:
            _add_record(db, record)
            if reservation is not None:
                _release(db, reservation)
            exists = _exists(db, record.session)
            tokens = tally.input_tokens + tally.output_tokens
            for counter in dict.fromkeys(counters):
                if counter.scope == "day" or exists:
                    db.execute(f"{SPEND} DO UPDATE SET spent = spent + excluded.spent", (*counter, tokens, 0))
            if exists:
                db.execute(
                    f"{TALLY} DO UPDATE SET input_tokens = input_tokens + excluded.input_tokens, output_tokens = "
                    "output_tokens + excluded.output_tokens, cached_tokens = cached_tokens + excluded.cached_tokens, "
                    "calls = calls + excluded.calls, refused = refused + excluded.refused",
                    ("session", record.session, "", *msgspec.structs.astuple(tally)),
                )

        await self._write(op)

    async def counted(self, counters: Sequence[Counter]) -> list[tuple[int, int]]:
        return await self._read(lambda db: [_counted(db, counter) for counter in counters])

    async def tally(self, session: str) -> Tally:
        def read(db: sqlite3.Connection) -> Tally:
            row = db.execute(
                "SELECT input_tokens, output_tokens, cached_tokens, calls, refused FROM spend WHERE scope = 'session' "
                "AND owner = ? AND part = ''",
                (session,),
            ).fetchone()
            return Tally() if row is None else Tally(*row)

        return await self._read(read)

    async def records(
        self, name: str, kinds: tuple[str, ...] | None = None, after: int = 0, limit: int | None = None
    ) -> list[Record]:
        # By kind through its index, named: without statistics SQLite takes the primary key (session, n) for the
        # order, and reads every record of the session to find a kind's few.
        by_kind = "" if kinds is None else f" INDEXED BY {BY_KIND} WHERE kind IN ({', '.join('?' * len(kinds))}) AND"

        def read(db: sqlite3.Connection) -> list[Record]:
            rows = db.execute(
                f"SELECT seq, kind, action, body, at, n FROM records{by_kind or ' WHERE'} session = ? AND n > ? "
                "ORDER BY n LIMIT ?",
                (*(kinds or ()), name, after, -1 if limit is None else limit),
            ).fetchall()
            return [Record(name, *row) for row in rows]

        return await self._read(read)

    async def forget_records(self, name: str, kind: str, actions: Collection[int]) -> None:
        listed = list(actions)
        if not listed:
            return

        def op(db: sqlite3.Connection) -> None:
            for i in range(0, len(listed), ROWS_PER_STATEMENT):
                some = listed[i : i + ROWS_PER_STATEMENT]
                db.execute(
                    f"DELETE FROM records INDEXED BY {BY_KIND} WHERE session = ? AND kind = ? AND action IN "
                    f"({', '.join('?' * len(some))}) AND n < (SELECT MAX(n) FROM records WHERE session = ?)",
                    (name, kind, *some, name),
                )

        await self._write(op)

    async def trim_records(self, name: str, kind: str, kept: int) -> int:
        trimmed = [0]

        def op(db: sqlite3.Connection) -> None:
            trimmed[0] = db.execute(
                f"DELETE FROM records INDEXED BY {BY_KIND} WHERE session = ? AND kind = ? AND n < (SELECT n FROM "
                f"records INDEXED BY {BY_KIND} WHERE session = ? AND kind = ? ORDER BY n DESC LIMIT 1 OFFSET ?)",
                (name, kind, name, kind, max(1, kept) - 1),
            ).rowcount

        await self._write(op)
        return trimmed[0]

    async def recorded(self, kind: str) -> list[str]:
        def read(db: sqlite3.Connection) -> list[str]:
            found = db.execute("SELECT DISTINCT session FROM records WHERE kind = ? ORDER BY session", (kind,))
            return [name for (name,) in found]

        return await self._read(read)

    async def steps_since(self, name: str, since: int, limit: int) -> list[Row]:
        return await self._read(
            lambda db: _rows(
                db.execute(
                    f"SELECT {ROW} FROM journal WHERE session = ? AND seq > ? ORDER BY seq LIMIT ?",
                    (name, since, limit),
                )
            )
        )

    async def journalled(self, name: str, since: int, limit: int) -> dict[int, float]:
        return await self._read(
            lambda db: dict(
                db.execute(
                    "SELECT seq, at FROM journal WHERE session = ? AND seq > ? AND at IS NOT NULL ORDER BY seq LIMIT ?",
                    (name, since, limit),
                )
            )
        )


def _add_record(db: sqlite3.Connection, record: Record) -> None:
    # A record of a session deleted meanwhile is dropped rather than refused: a refusal would fail every write of its
    # batch.
    db.execute(
        "INSERT INTO records (session, n, seq, kind, action, body, at) SELECT ?, "
        "COALESCE((SELECT MAX(n) FROM records WHERE session = ?), 0) + 1, ?, ?, ?, ?, ? "
        "WHERE EXISTS (SELECT 1 FROM sessions WHERE name = ?)",
        (
            record.session,
            record.session,
            record.seq,
            record.kind,
            record.action,
            record.body,
            time.time(),
            record.session,
        ),
    )


# A counter's row, made with what it adds when it is new, else updated as the statement's ON CONFLICT says.
SPEND = (
    "INSERT INTO spend (scope, owner, part, spent, reserved) VALUES (?, ?, ?, ?, ?) ON CONFLICT (scope, owner, part)"
)
TALLY = (
    "INSERT INTO spend (scope, owner, part, input_tokens, output_tokens, cached_tokens, calls, refused) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (scope, owner, part)"
)


def _drop_own_spend(db: sqlite3.Connection, session: str) -> None:
    for statement in OWN_SPEND:
        db.execute(statement, (session,))


def _counted(db: sqlite3.Connection, counter: Counter) -> tuple[int, int]:
    row = db.execute("SELECT spent, reserved FROM spend WHERE scope = ? AND owner = ? AND part = ?", counter).fetchone()
    return (0, 0) if row is None else (row[0], row[1])


def _exists(db: sqlite3.Connection, session: str) -> bool:
    return db.execute("SELECT 1 FROM sessions WHERE name = ?", (session,)).fetchone() is not None


def _release(db: sqlite3.Connection, reservation: int) -> None:
    db.execute(
        "UPDATE spend SET reserved = reserved - r.tokens FROM reservations AS r WHERE r.id = ? AND spend.scope = "
        "r.scope AND spend.owner = r.owner AND spend.part = r.part",
        (reservation,),
    )
    db.execute("DELETE FROM reservations WHERE id = ?", (reservation,))


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the database to the format this devd writes, one migration at a time."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    while (due := FORMAT.next(version, str(path))) is not None:
        version, script = due
        db.executescript(f"BEGIN IMMEDIATE; {script} PRAGMA user_version = {version}; COMMIT;")
        FORMAT.applied(version, database=str(path))


def _reconnect(path: Path, id: str) -> sqlite3.Connection:
    """A fresh connection to the database a store opened (never a new file in its place), once it is known to be
    that database (its id, its format), its pages pass `quick_check`, and its log is checkpointed and truncated."""
    _check_wal(path)
    db = sqlite3.connect(
        f"file:{path}?mode=rw", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )
    try:
        _configure(db)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        row = db.execute("SELECT value FROM meta WHERE key = 'id'").fetchone()
        if version != FORMAT.latest or row is None or row[0] != id:
            raise StoreError(f"{path} is no longer the database this daemon opened (id {row[0] if row else None})")
        checked = db.execute("PRAGMA quick_check").fetchall()
        if checked != [("ok",)]:
            raise StoreError(f"{path} fails its integrity check: {checked[0][0]}")
        busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            raise StoreError(f"the log of {path} could not be checkpointed")
    except BaseException:
        db.close()
        raise
    return db


def _check_wal(path: Path) -> None:
    """A write-ahead log beside the database is replayed into it on open: refuse one that is not this database's
    (a stray `-wal` from another state directory would silently replace its sessions). Read through a read-only
    connection, which never checkpoints, so a refused log changes nothing."""
    wal, id_file = Path(f"{path}-wal"), _id_path(path)
    if not wal.exists() or not id_file.exists():
        return
    expected = id_file.read_text().strip()

    def unchecked(e: Exception) -> str:
        # Not a sign of a foreign log: a full disk, a daemon holding the database, a damaged file. Said as what it
        # is, and the log is never called foreign: moving it away would lose every step in it.
        hint = (
            "another process has it open (a daemon on the same --store?): stop it, or pass another --store"
            if "locked" in str(e)
            else "free disk space or fix what the error names, and start again"
        )
        return (
            f"the database {path} and its write-ahead log could not be read to check that they belong together "
            f"({e}); both were left as they are (keep {wal.name}: it may hold acknowledged steps); {hint}"
        )

    with _failing(unchecked, (sqlite3.Error,)):
        ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            row = ro.execute("SELECT value FROM meta WHERE key = 'id'").fetchone()
        finally:
            ro.close()
    if row is None:
        raise StoreError(
            f"the database {path} read with its write-ahead log carries no id, though {id_file.name} names "
            f"{expected}; all three were left as they are (keep {wal.name}: it may hold acknowledged steps): run "
            "`devd doctor`, and see docs/operations.md on restoring"
        )
    if row[0] != expected:
        raise StoreError(
            f"the write-ahead log {wal} belongs to another database (read with it, the database's id is {row[0]}; "
            f"{id_file.name} says {expected}); move {wal.name} away (it was left as it is) and start again"
        )


def _id_path(path: Path) -> Path:
    return path.with_name(path.name + ".id")


def _sizes(db: sqlite3.Connection, session: str, at: int) -> sqlite3.Cursor:
    """(seq, bytes) of each step of the session's journal up to `at`, in order: what a fork cuts into spans."""
    return db.execute(
        "SELECT seq, length(event) + length(actions) + coalesce(length(snapshot), 0) FROM journal "
        "WHERE session = ? AND seq <= ? ORDER BY seq",
        (session, at),
    )


def _drop_unmade_fork(db: sqlite3.Connection, store: SQLiteStore | None, name: str) -> None:
    """Remove the rows a fork cut short copied for `name` (unless the session was made after all), and its note."""
    note = f"{FORK_NOTE}{name}"
    if db.execute("SELECT 1 FROM meta WHERE key = ?", (note,)).fetchone() is None:
        return
    if db.execute("SELECT 1 FROM sessions WHERE name = ?", (name,)).fetchone() is None:
        if store is not None:
            store._release_files(db, "session = ?", (name,))
        db.execute("DELETE FROM journal WHERE session = ?", (name,))
    db.execute("DELETE FROM meta WHERE key = ?", (note,))


def _check_identity(db: sqlite3.Connection, path: Path) -> None:
    """When the file beside it names the database this state directory was made with, refuse another one before
    anything is written to it (no migration runs on a database that is not ours)."""
    id_file = _id_path(path)
    if not id_file.exists():
        return  # a new database, or one restored from a backup: `_identify` writes the file after migrating
    has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
    row = db.execute("SELECT value FROM meta WHERE key = 'id'").fetchone() if has_meta else None
    expected = id_file.read_text().strip()
    if row is None or row[0] != expected:
        raise StoreError(
            f"{path} is not the database this state directory was made with (its id is "
            f"{row[0] if row else 'missing'}, {id_file.name} says {expected}); it was left as it is: put the right "
            "file back, or move both away to start afresh"
        )


def _identify(db: sqlite3.Connection, path: Path) -> str:
    """The database's random id, checked against the file beside it (made on first open)."""
    row = db.execute("SELECT value FROM meta WHERE key = 'id'").fetchone()
    id_file = _id_path(path)
    expected = id_file.read_text().strip() if id_file.exists() else None
    if row is None and expected is None:
        new = secrets.token_hex(16)
        db.execute("INSERT INTO meta (key, value) VALUES ('id', ?)", (new,))
        files.write_atomically(id_file, new)
        return new
    if row is None or (expected is not None and row[0] != expected):
        raise StoreError(
            f"{path} is not the database this state directory was made with (its id is "
            f"{row[0] if row else 'missing'}, {id_file.name} says {expected}); it was left as it is: put the right "
            "file back, or move both away to start afresh"
        )
    if expected is None:
        log.warning("store.id_restored", file=str(id_file))
        files.write_atomically(id_file, row[0])
    return str(row[0])


def _load(
    db: sqlite3.Connection, name: str, at: int | None, snapshot_dir: Path
) -> tuple[Stored, IO[bytes] | None] | None:
    """The session now (at None) or as it was at step `at`; None if there is no such session or history. A snapshot
    kept in a file comes as that file, opened: read it once the lock is free (`_with_snapshot`); open, it stays
    readable if a commit removes it meanwhile."""
    row = db.execute("SELECT config, state, reason FROM sessions WHERE name = ?", (name,)).fetchone()
    if row is None:
        return None
    config, state, reason = row
    upto = (1 << 63) - 1 if at is None else at
    saved = db.execute(
        "SELECT seq, snapshot, snapshot_file FROM journal WHERE session = ? AND snapshot IS NOT NULL AND seq <= ? "
        "ORDER BY seq DESC LIMIT 1",
        (name, upto),
    ).fetchone()
    if saved is None and db.execute("SELECT 1 FROM journal WHERE session = ? AND seq = 0", (name,)).fetchone():
        return None  # restored from a snapshot no longer kept: its history cannot be rebuilt from the config
    snapshot_seq, snapshot, snapshot_file = saved if saved else (0, None, None)
    journal = _rows(
        db.execute(
            f"SELECT {ROW} FROM journal WHERE session = ? AND seq > ? AND seq <= ? ORDER BY seq",
            (name, snapshot_seq, upto),
        )
    )
    if at is not None and [row.seq for row in journal] != list(range(snapshot_seq + 1, at + 1)):
        return None  # pruned (or not yet written): that point cannot be rebuilt
    stored = Stored(name, config, snapshot, snapshot_seq, Health(state), reason, journal)
    if snapshot_file is None:
        return stored, None
    path = snapshot_dir / snapshot_file
    with _failing(lambda e: _unreadable(stored, path, e), (OSError,)):
        return stored, open(path, "rb")  # closed by `_with_snapshot`, once the lock is free


def _identity(path: Path) -> tuple[int, int] | None:
    """A file's device and inode, or None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _with_snapshot(loaded: tuple[Stored, IO[bytes] | None] | None) -> Stored | None:
    """The session `_load` found, with its snapshot read from its file if it is kept in one."""
    if loaded is None:
        return None
    stored, file = loaded
    if file is None:
        return stored
    with file, _failing(lambda e: _unreadable(stored, Path(file.name), e), (OSError,)):
        snapshot = file.read()
    return msgspec.structs.replace(stored, snapshot=snapshot)


def _unreadable(stored: Stored, path: Path, e: Exception) -> str:
    strerror = e.strerror if isinstance(e, OSError) else None
    return (
        f"the snapshot of session {stored.name!r} after step {stored.snapshot_seq} is kept in {path}, which cannot be "
        f"read ({strerror or e}); the session cannot be rebuilt without it: put the file back (it is part of the "
        "state directory, like the database), or restore the state directory from a backup"
    )


def _rows(cursor: sqlite3.Cursor) -> list[Row]:
    return [Row(seq, event, actions or None, answer) for seq, event, actions, answer in cursor]


def _filed(op: Step | _FiledStep) -> tuple[Step, str | None]:
    """A step to insert, and the file its snapshot is in (None: none, or in the row)."""
    return (op.step, op.file) if isinstance(op, _FiledStep) else (op, None)


def _insert_steps(db: sqlite3.Connection, steps: list[tuple[Step, str | None]]) -> None:
    """Rows (a step and its snapshot's file) in one statement: sqlite3 releases the GIL around every statement it
    steps, and the commit thread has to win it back from the busy event loop each time, so one statement for a batch
    is much faster than one a row."""
    at = time.time()
    db.execute(
        "INSERT INTO journal (session, seq, key, digest, event, actions, snapshot, answer, at, snapshot_file) VALUES "
        + ",".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"] * len(steps)),
        [
            v
            for s, file in steps
            for v in (s.session, s.seq, s.key, s.digest, s.event, s.actions or b"", s.snapshot, s.answer, at, file)
        ],
    )
