"""The operator's commands: `devd doctor` (checks an installation, with or without a running daemon), `status`,
`backup` and `inspect` (one session's entry and what its turn waits for, for a person)."""

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
from devd.errors import DevdError, HandleError
from devd.render import inline
from devd.server.metrics import prometheus
from devd.storage.doctor import Check, size

if TYPE_CHECKING:
    from devd.client import Client
    from devd.messages import Action
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
    _when,
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


def _mcp(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("daemon/mcp")
    if args.json:
        _emit(raw + b"\n")
    else:
        _emit(mcp_table(msgspec.json.decode(raw)["servers"]).encode())
    return EXIT_OK


def mcp_table(servers: list[dict[str, Any]]) -> str:
    """`devd mcp`: a line per MCP server connection (its last error on the next line, indented)."""
    if not servers:
        return "no MCP servers (no profile names one, or none was needed yet)\n"
    lines = []
    for s in servers:
        owner = f"agent {s['agent']}" if s["agent"] is not None else "a session's own"
        pid = f"pid {s['pid']}" if s["pid"] is not None else "no process"
        lines.append(
            f"{inline(s['name'])} ({owner}): {s['state']}, {pid}, {s['sessions']} sessions, {s['tools']} tools, "
            f"{s['restarts']} restarts" + (f", MCP {s['mode']}" if s.get("mode") else "")
        )
        if s["last_error"]:
            lines.append(f"  last error: {inline(s['last_error'])}")
    return "\n".join(lines) + "\n"


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
    from devd.host import Core

    which = str(path) if path is not None else "the packaged core"
    try:
        core = Core.open(path)
        abi = core.abi
        core.close()
    except (DevdError, OSError) as e:
        return Check(
            "core",
            "FAIL",
            f"{which} does not load: {e}; reinstall devd (in a checkout: `make build`), "
            "or pass the --core that `devd serve` is given",
        )
    return Check("core", "ok", f"{which} loads and speaks ABI {abi}")


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


class _Page(msgspec.Struct):
    """A `session/list` page, its entries kept as the daemon sent them."""

    sessions: list[msgspec.Raw]


class _Pending(msgspec.Struct):
    """A `session/pending` answer, its actions kept as the daemon sent them."""

    actions: msgspec.Raw


def _listed(client: Client, session: str) -> msgspec.Raw | None:
    """The session's entry in `session/list`, as the daemon sent it, or None when it lists no such session. Only that
    entry is fetched: a page of one, from a cursor that sorts just below the name."""
    from devd.driver import _just_before  # the driver finds a session's entry the same way

    if not session:
        return None  # nothing sorts below the empty name; the daemon refuses it by name when asked
    page = msgspec.json.decode(
        client.call_raw("session/list", {"limit": 1, "cursor": _just_before(session)}), type=_Page
    )
    if page.sessions and msgspec.json.decode(page.sessions[0])["session"] == session:
        return page.sessions[0]
    return None


def _inspect(client: Client, args: argparse.Namespace) -> int:
    entry = _listed(client, args.session)
    if entry is None:
        # Not among the sessions this daemon lists: `session/pending` says why in the daemon's own words (HANDLE: no
        # such session), or, in a fleet, follows the session to the daemon that holds it, which lists it.
        client.call_raw("session/pending", {"session": args.session})
        entry = _listed(client, args.session)
    if entry is None:  # closed between the two calls
        raise HandleError(f"no session is named {args.session!r}; `session/list` shows the sessions there are")
    info = msgspec.json.decode(entry)
    pending: msgspec.Raw | None = None
    if info["state"] in ("live", "stored"):  # an ended or poisoned session is refused until recovered: not asked
        raw = client.call_raw("session/pending", {"session": args.session})
        pending = msgspec.json.decode(raw, type=_Pending).actions
    if args.json:
        _emit(msgspec.json.encode({"session": entry, "pending": pending}) + b"\n")
    else:
        from devd.messages import decode_actions

        _emit(inspection(info, None if pending is None else decode_actions(bytes(pending))).encode())
    return EXIT_OK


SUMMARY_CHARS_MAX = 72  # an action's summary in `devd inspect`, so that each stays on one line


def action_summary(action: Action) -> str:
    """An action's kind and what it is about, on one line: `Read src/lib.rs`, `Model (12 messages)`; what a model chose
    in it shown safely (devd.render: a command as a shell takes it, a control or bidi character escaped)."""
    from devd.agent import kinds  # each kind says what its calls are about; loaded by the commands that show them

    op = action.op
    kind = next(name for name in op.__struct_fields__ if getattr(op, name) is not None)
    if op.Model is not None:
        n = len(op.Model.messages)
        about = f"({n} message{'' if n == 1 else 's'})"
    elif (called := kinds.of(op)) is not None:
        about = called[0].summary(called[1])
    elif op.Done is not None:
        about = f"turn {op.Done.turn}"
    else:
        about = inline(" ".join((op.Emit or "").split()))  # its lines run together before any is escaped
    about = " ".join(about.split())
    if len(about) > SUMMARY_CHARS_MAX:
        about = about[: SUMMARY_CHARS_MAX - 3] + "..."
    return f"{kind} {about}".rstrip()


def inspection(entry: dict[str, Any], pending: list[Action] | None) -> str:
    """`devd inspect`: a session's `session/list` entry as `key: value` lines, whether a turn is running, and the
    actions it waits for (`pending`: None for an ended or poisoned session, which is not asked), one a line."""
    name = entry["session"]
    pairs = [("session", name), ("state", entry["state"])]
    if entry.get("reason"):
        pairs.append(("reason", inline(entry["reason"])))
    pairs += [
        ("seq", str(entry["seq"])),
        ("watchers", str(entry.get("watchers", 0))),
        ("created", _when(entry["created"])),
        ("last used", _when(entry["last_used"])),
    ]
    if pending is None:
        pairs.append(("turn", f"none: the session is {entry['state']}; `devd recover {name}` brings it back"))
    elif pending:
        pairs.append(("turn", f"running, waiting for {len(pending)} action{'' if len(pending) == 1 else 's'}"))
    else:
        pairs.append(("turn", "none running"))
    if entry.get("title"):
        pairs.insert(1, ("title", inline(entry["title"])))
    actions = pending or []
    width = max((len(str(a.id)) for a in actions), default=0)
    from devd.cli.sessions import attention

    listed = "".join(f"  {a.id:>{width}}  {action_summary(a)}\n" for a in actions)
    return _pairs(pairs) + listed + attention(name, entry.get("stalled"), actions)
