"""The operator's commands: `devd doctor` (checks an installation, with or without a running daemon), `status`,
`backup` and `drain`."""

from __future__ import annotations

import argparse
import fcntl
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

import msgspec

from devd.config import (
    default_state_dir,
)
from devd.errors import DevdError
from devd.server.metrics import prometheus

if TYPE_CHECKING:
    from devd.client import Client
from devd.cli.common import (
    EXIT_ANSWERED_ERROR,
    EXIT_OK,
    LocalError,
    OutputClosed,
    _address,
    _duration,
    _emit,
    _pairs,
    _size,
    _token,
    in_cli_terms,
)


def _status(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("daemon/status")
    if args.json:
        _emit(raw + b"\n")
    elif args.prometheus:
        _emit(prometheus(msgspec.json.decode(raw)).encode())
    else:
        _emit(status_summary(msgspec.json.decode(raw)).encode())
    return EXIT_OK


def _backup(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("daemon/backup", {"name": args.name})
    if args.json:
        _emit(raw + b"\n")
    else:
        made = msgspec.json.decode(raw)
        _emit(f"{made['path']}: {made['bytes']} bytes\n".encode())
    return EXIT_OK


def _drain(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("daemon/drain")
    _emit(raw + b"\n" if args.json else f"{msgspec.json.decode(raw)['sessions']} sessions given back\n".encode())
    return EXIT_OK


def status_summary(status: dict[str, Any]) -> str:
    """`devd status`: daemon/status as `key: value` lines."""
    s = status
    pairs = [
        ("daemon", f"{s['server']['name']} {s['server']['version']}, up {_duration(s['uptime_s'])}"),
        ("sessions", ", ".join(f"{n} {state}" for state, n in s["sessions"].items())),
        ("connections", str(s["connections"])),
        ("steps", str(s["steps"])),
        ("durable writes", f"{s['durable_writes']} (commit p50 {s['commit_ms_p50']} ms, p99 {s['commit_ms_p99']} ms)"),
        ("deadline hits", str(s["deadline_hits"])),
        ("offloaded", str(s["offloaded"])),
        ("rebuilt", str(s["rebuilt"])),
        ("hibernated", str(s["hibernated"])),
        ("expired", str(s["expired"])),
        ("errors", ", ".join(f"{n} {kind}" for kind, n in sorted(s["errors"].items())) or "none"),
        ("memory", f"{_size(s['memory_rss_bytes'])} resident, {_size(s['live_memory_bytes'])} in live sessions"),
    ]
    return _pairs(pairs)


DATABASE_FILE = "devd.sqlite3"  # in the state directory, as `devd serve` names it


class Check(msgspec.Struct, frozen=True):
    """One check of `devd doctor`: `ok`, `FAIL` (what is wrong and what to do), or `skip` (it could not be made
    now, and why: not a failure)."""

    name: str
    outcome: Literal["ok", "FAIL", "skip"]
    says: str

    def line(self) -> str:
        """One line, whatever it says (wasmtime's errors span several)."""
        return f"{self.outcome:<4}  {self.name}: {' '.join(self.says.split())}"


def check_daemon(args: argparse.Namespace, state: Path | None = None) -> Check:
    """The daemon answers `daemon/status` at the address the client commands use. One that does not, while no daemon
    holds the state directory `state` and its database is there, is stopped (for a restore, or an upgrade): said, and
    not a failure."""
    from devd.client import Client, NotRunningError

    address = _address(args)
    try:
        with Client.connect(address, token=_token(args), timeout=10) as client:
            status = client.call("daemon/status")
    except LocalError as e:
        return Check("daemon", "FAIL", str(e))
    except DevdError as e:
        return Check("daemon", "FAIL", f"the daemon at {address} answered {e.kind}: {in_cli_terms(e, args)}")
    except NotRunningError as e:
        if state is not None and _stopped(state):
            return Check(
                "daemon",
                "skip",
                f"not running: nothing listens at {address}, and no daemon holds {state}: as expected while it is "
                "stopped (to restore a backup, or to upgrade), so its database is checked below; start it with "
                "`devd serve` (or its systemd unit) when you are done",
            )
        return Check("daemon", "FAIL", e.strerror or str(e))
    except (OSError, ConnectionError) as e:
        return Check("daemon", "FAIL", f"cannot reach the daemon at {address}: {e}")
    sessions = sum(status["sessions"].values())
    server = f"{status['server']['name']} {status['server']['version']}"
    return Check(
        "daemon", "ok", f"answers at {address} ({server}, up {_duration(status['uptime_s'])}, {sessions} sessions)"
    )


def _stopped(state: Path) -> bool:
    """The state directory holds a database and no daemon holds the directory."""
    try:
        return (state / DATABASE_FILE).is_file() and lock_holder(state) is None
    except OSError:
        return False


def check_state_dir(state: Path) -> Check:
    """The state directory exists, is a directory, is this user's (root may check anyone's) and is 0700."""
    try:
        st = state.stat()
    except FileNotFoundError:
        return Check(
            "state dir",
            "FAIL",
            f"{state} does not exist; `devd serve` makes it on first start (for a daemon run "
            "with --state-dir DIR, pass the same here)",
        )
    except OSError as e:
        return Check("state dir", "FAIL", f"{state} cannot be read: {e.strerror}; run devd doctor as its owner")
    if not stat.S_ISDIR(st.st_mode):
        return Check("state dir", "FAIL", f"{state} is not a directory; move it away, or pass another --state-dir")
    uid = os.getuid()
    if st.st_uid != uid and uid != 0:
        return Check(
            "state dir",
            "FAIL",
            f"{state} belongs to uid {st.st_uid}, not to you (uid {uid}); the daemon "
            "refuses it: run it and devd doctor as that user, or use a --state-dir of your own",
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        return Check(
            "state dir",
            "FAIL",
            f"{state} is mode {mode:04o}; run `chmod 700 {state}` (its sessions "
            "are yours alone, and the daemon refuses a directory others may write)",
        )
    owner = "yours" if st.st_uid == uid else f"uid {st.st_uid}'s"
    return Check("state dir", "ok", f"{state} is 0700 and {owner}")


def check_database(state: Path) -> Check:
    """The database file is there."""
    db = state / DATABASE_FILE
    try:
        size = db.stat().st_size
    except FileNotFoundError:
        return Check(
            "database",
            "FAIL",
            f"{db} does not exist; `devd serve` makes it on first start (if this "
            "state directory held sessions, they are gone: restore a backup into it)",
        )
    except OSError as e:
        return Check("database", "FAIL", f"{db} cannot be read: {e.strerror}; run devd doctor as its owner")
    wal = Path(f"{db}-wal")
    log = f", and a write-ahead log of {_size(wal.stat().st_size)}" if wal.exists() else ""
    return Check("database", "ok", f"{db} ({_size(size)}{log})")


def check_core(path: Path | None) -> Check:
    """The core compiles and speaks this devd's ABI."""
    from devd import ABI
    from devd.host import Core

    which = str(path) if path is not None else "the packaged core"
    try:
        Core.open(path).close()
    except (DevdError, OSError) as e:
        return Check(
            "core",
            "FAIL",
            f"{which} does not load: {e}; reinstall devd (in a checkout: `make build`), "
            "or pass the --core that `devd serve` is given",
        )
    return Check("core", "ok", f"{which} loads and speaks ABI {ABI}")


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


def check_integrity(state: Path) -> Check:
    """With no daemon holding the state directory, the database passes `PRAGMA quick_check` through a read-only
    connection, and is of a format this devd reads. A running daemon keeps the file open in exclusive mode, so then
    the check is skipped: a second connection would be refused, and must not be tried."""
    db = state / DATABASE_FILE
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
    import sqlite3

    from devd.storage.sqlite import MIGRATIONS, SNAPSHOTS_DIR

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


def _doctor(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else default_state_dir()
    checks = [
        check_daemon(args, state),
        check_state_dir(state),
        check_database(state),
        check_core(Path(args.core) if args.core else None),
        check_integrity(state),
    ]
    try:
        _emit("".join(c.line() + "\n" for c in checks).encode())
    except OutputClosed:
        pass
    return EXIT_OK if all(c.outcome != "FAIL" for c in checks) else EXIT_ANSWERED_ERROR
