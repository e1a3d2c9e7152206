"""The operator's commands: `devd doctor` (checks an installation, with or without a running daemon), `status`,
`backup` and `drain`."""

from __future__ import annotations

import argparse
import functools
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from devd.config import (
    default_state_dir,
)
from devd.errors import DevdError
from devd.server.metrics import prometheus
from devd.storage.doctor import Check, size

if TYPE_CHECKING:
    from devd.client import Client
from devd.cli.common import (
    EXIT_ANSWERED_ERROR,
    EXIT_OK,
    POSTGRES_SCHEMES,
    LocalError,
    OutputClosed,
    _address,
    _duration,
    _emit,
    _pairs,
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
        ("memory", f"{size(s['memory_rss_bytes'])} resident, {size(s['live_memory_bytes'])} in live sessions"),
    ]
    return _pairs(pairs)


DATABASE_FILE = "devd.sqlite3"  # in the state directory, as `devd serve` names it


def check_daemon(args: argparse.Namespace, stopped: Path | None = None) -> Check:
    """The daemon answers `daemon/status` at the address the client commands use. One that does not, when its store
    is there and no daemon holds its state directory `stopped`, is stopped (for a restore, or an upgrade): said, and
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
        if stopped is not None:
            return Check(
                "daemon",
                "skip",
                f"not running: nothing listens at {address}, and no daemon holds {stopped}: as expected while it is "
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


def _doctor(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else default_state_dir()
    spec = args.store or f"sqlite:{state / DATABASE_FILE}"
    if spec.startswith(POSTGRES_SCHEMES):
        from devd.storage import postgres_doctor

        stopped, store = None, functools.partial(postgres_doctor.checks, spec)
    else:
        from devd.storage import sqlite_doctor

        db = Path(spec.removeprefix("sqlite:")).absolute()
        stopped = state if sqlite_doctor.stopped(db, state) else None
        store = functools.partial(sqlite_doctor.checks, db, state)
    # The store's first check says whether it is there (or answers); what it holds is checked after the core.
    reached, *held = store()
    checks = [
        check_daemon(args, stopped),
        check_state_dir(state),
        reached,
        check_core(Path(args.core) if args.core else None),
        *held,
    ]
    try:
        _emit("".join(c.line() + "\n" for c in checks).encode())
    except OutputClosed:
        pass
    return EXIT_OK if all(c.outcome != "FAIL" for c in checks) else EXIT_ANSWERED_ERROR
