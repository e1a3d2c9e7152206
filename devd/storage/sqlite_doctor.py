"""`devd doctor`'s checks of a SQLite store: the database file is there, and (with no daemon holding the state
directory) it passes `PRAGMA quick_check`, is of a format this devd reads, and every snapshot file it names is beside
it. Read only: nothing in the file, its log or the directory is changed."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any
from urllib.parse import quote

from devd.storage.doctor import Check, size
from devd.storage.sqlite import MIGRATIONS, SNAPSHOTS_DIR

__all__ = ["checks", "lock_holder", "stopped"]


def checks(db: Path, state: Path) -> list[Check]:
    """The database `db` of the daemon whose state directory is `state` (where its lock is)."""
    return [check_database(db), check_integrity(db, state)]


def stopped(db: Path, state: Path) -> bool:
    """The database is there and no daemon holds the state directory."""
    try:
        return db.is_file() and lock_holder(state) is None
    except OSError:
        return False


def check_database(db: Path) -> Check:
    """The database file is there, and no one but its owner may write it (the daemon refuses it otherwise)."""
    try:
        st = db.stat()
    except FileNotFoundError:
        return Check(
            "database",
            "FAIL",
            f"{db} does not exist; `devd serve` makes it on first start (if this "
            "state directory held sessions, they are gone: restore a backup into it)",
        )
    except OSError as e:
        return Check("database", "FAIL", f"{db} cannot be read: {e.strerror}; run devd doctor as its owner")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        return Check(
            "database",
            "FAIL",
            f"{db} is writable by group or others (mode {mode:04o}), so the daemon refuses it; run `chmod go-w {db}`",
        )
    wal = Path(f"{db}-wal")
    log = f", and a write-ahead log of {size(wal.stat().st_size)}" if wal.exists() else ""
    return Check("database", "ok", f"{db} ({size(st.st_size)}{log})")


def lock_holder(state: Path) -> str | None:
    """Who holds STATE_DIR/lock, as the daemon wrote it there (its pid and socket); None when no daemon does.
    Probed with a shared lock taken and let go at once: nothing is written, and a daemon that starts meanwhile
    waits on nothing."""
    try:
        fd = os.open(state / "lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that did not say who it is"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_integrity(db: Path, state: Path) -> Check:
    """With no daemon holding the state directory, the database passes `PRAGMA quick_check` through a read-only
    connection, and is of a format this devd reads. A running daemon keeps the file open in exclusive mode, so then
    the check is skipped: a second connection would be refused, and must not be tried."""
    if not db.exists():
        return Check("integrity", "skip", f"there is no {db} to check")
    try:
        holder = lock_holder(state)
    except OSError as e:
        return Check(
            "integrity", "FAIL", f"{state / 'lock'} cannot be read: {e.strerror}; run devd doctor as its owner"
        )
    if holder is not None:
        return Check(
            "integrity",
            "skip",
            f"a daemon holds {state} ({holder}) and keeps its database open "
            "exclusively; stop the daemon, then run devd doctor again to check the database",
        )
    return quick_check(db)


def quick_check(db: Path) -> Check:
    """`PRAGMA quick_check` and the format version, read only: nothing in the file or its log is changed."""
    shm = Path(f"{db}-shm")
    had_shm = shm.exists()
    # With no write-ahead log beside it, the file is read as immutable: a read-only connection to a database in WAL
    # mode would otherwise create an empty -wal (and a -shm), which a restore must not find beside the database it
    # puts in place. With a log (a daemon that was killed), the log is read too, as the daemon will read it.
    mode = "mode=ro" if Path(f"{db}-wal").exists() else "mode=ro&immutable=1"
    try:
        ro = sqlite3.connect(f"file:{quote(str(db))}?{mode}", uri=True)
        try:
            found = [str(row[0]) for row in ro.execute("PRAGMA quick_check")]
            version = int(ro.execute("PRAGMA user_version").fetchone()[0])
            named = _snapshot_files(ro) if found == ["ok"] else []
        finally:
            ro.close()
    except sqlite3.Error as e:
        return Check(
            "integrity", "FAIL", f"{db} cannot be read: {e}; keep it as it is (copy it aside) and restore a backup"
        )
    finally:
        # A read-only connection to a database with a write-ahead log makes a -shm file; the daemon (in exclusive
        # mode) never uses one, so the directory is left as it was found.
        if not had_shm:
            shm.unlink(missing_ok=True)
    if found != ["ok"]:
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        return Check(
            "integrity",
            "FAIL",
            f"PRAGMA quick_check on {db} found: {shown}; keep the file as it is (copy it aside) and restore a backup",
        )
    if version > len(MIGRATIONS):
        return Check(
            "integrity",
            "FAIL",
            f"{db} is format {version}, written by a newer devd (this one reads up to "
            f"{len(MIGRATIONS)}); run that devd or a newer one",
        )
    directory = db.parent / SNAPSHOTS_DIR
    missing = [name for name in named if not (directory / name).is_file()]
    if missing:
        return Check(
            "integrity",
            "FAIL",
            f"{len(missing)} of the {len(named)} snapshot files {db.name} names are missing from {directory} (such as "
            f"{missing[0]}); the sessions that need them cannot be rebuilt: put them back, or restore the state "
            "directory from a backup",
        )
    upgrade = f"; this devd migrates it to format {len(MIGRATIONS)} when it starts" if version < len(MIGRATIONS) else ""
    files = f"; every snapshot file it names ({len(named)}) is in {directory}" if named else ""
    return Check("integrity", "ok", f"{db} passes PRAGMA quick_check (format {version}{upgrade}){files}")


def _snapshot_files(db: Any) -> list[str]:
    """The snapshot files the database names (none before format 5, which added them)."""
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(journal)")}
    if "snapshot_file" not in columns:
        return []
    return [
        str(row[0]) for row in db.execute("SELECT DISTINCT snapshot_file FROM journal WHERE snapshot_file IS NOT NULL")
    ]
