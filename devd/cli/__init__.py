"""The `devd` command: `serve` runs the daemon in the foreground, `doctor` checks an installation, `schema` prints
the protocol's types, and the other subcommands are clients of the daemon.

What it promises: a client command shows the daemon's answer for people (a table for `devd ls`, `key: value` lines
for `devd status`), or with `--json` exactly the JSON the daemon answered, for scripts. An error the daemon answers
is said in the command's terms (the command for a method it names, the flag for a token it wants). The exit status
says what happened (`EXIT_CODES`, shown by `devd --help`): 0 done, 1 the daemon answered an error, 2 a usage or
local problem, 3 the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import faulthandler
import fcntl
import getpass
import os
import re
import shlex
import signal
import socket
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import quote

import msgspec

from devd import __version__, log
from devd.config import (
    Settings,
    backup_dir,
    default,
    default_live_memory,
    default_socket_path,
    default_state_dir,
    parse_duration,
    parse_size,
    parse_tcp,
)
from devd.errors import DevdError, HandleError
from devd.protocol import METHODS
from devd.server import systemd
from devd.server.metrics import prometheus

if TYPE_CHECKING:
    from devd.client import Client
    from devd.messages import Action
    from devd.storage.store import Fleet, Store


def settings_from(args: argparse.Namespace) -> Settings:
    """`devd serve`'s flags as the daemon's settings (the defaults where a flag is not given)."""
    return Settings(
        state_dir=Path(args.state_dir) if args.state_dir else default_state_dir(),
        socket_path=args.socket or default_socket_path(),
        tcp=args.listen,
        core_path=Path(args.core) if args.core else None,
        backup_dir=Path(args.backup_dir) if args.backup_dir else None,
        call_timeout_s=args.call_timeout,
        sessions_max=args.max_sessions,
        max_live=args.max_live,
        snapshot_floor_bytes=args.snapshot_floor,
        live_memory_bytes=args.live_memory or default_live_memory(),
        memory_bytes_per_session=args.session_memory,
        expire_after_s=args.expire_after,
        connections_max=args.max_connections,
        line_bytes_max=args.max_line_bytes,
        line_timeout_s=args.line_timeout,
        send_timeout_s=args.send_timeout,
        max_call_timeout_s=args.max_call_timeout,
        metrics=args.metrics,
        otel_endpoint=args.otel_endpoint,
        log_format=args.log_format,
        log_level=args.log_level,
    )


def _serve(args: argparse.Namespace) -> int:
    import anyio
    import structlog

    from devd import failpoints, files
    from devd.errors import StoreError
    from devd.host import Core
    from devd.server.daemon import Daemon, build
    from devd.server.listeners import (
        StartupError,
        bind_tcp,
        bind_unix,
        lock_state_dir,
        prepare_state_dir,
        read_token,
        unlink_socket,
    )
    from devd.server.metrics import bind as bind_metrics

    os.umask(0o077)  # state files, the token and the socket: this user's alone
    # A fault SQLite's shared-memory mapping can raise (SIGBUS on a failed write or a read-only remount) kills the
    # process; this leaves a traceback in the log rather than nothing. Enabled before the wasm engine exists, and
    # wasmtime runs without signal-based traps, so the two handlers do not meet (see shared/WASM-HOST.md).
    faulthandler.enable()
    # The commit thread and the epoch ticker need the GIL promptly; the default 5 ms switch interval makes them
    # wait behind the event loop (a convoy that stretched commits to ~4 ms here).
    sys.setswitchinterval(0.0001)
    log.configure(args.log_format, args.log_level)
    logger = structlog.get_logger("devd")
    try:
        armed = failpoints.arm(os.environ)
    except ValueError as e:
        print(f"devd: cannot start: {e}", file=sys.stderr)
        return 2
    if armed is not None and armed[0] == "armed":
        logger.warning("failpoints.armed", points=armed[1], note="a test: named writes will fail or kill the daemon")
    elif armed is not None:
        logger.warning("failpoints.ignored", points=armed[1], note="DEVD_FAILPOINTS is obeyed only with DEVD_TESTING=1")
    try:
        settings = settings_from(args)
        prepare_state_dir(settings.state_dir)
        lock_state_dir(settings.state_dir, settings.socket_path)  # held (by its open descriptor) until exit
        prepare_state_dir(backup_dir(settings), "the backup directory", "--backup-dir")
        files.remove_partials(backup_dir(settings))  # a backup a killed daemon was writing
        core = Core.open(
            settings.core_path,
            call_timeout=settings.call_timeout_s,
            memory_bytes=settings.memory_bytes_per_session,
            cache_dir=settings.state_dir / "cache",
        )
        listeners = systemd.listen_sockets()
        activated = [t for _, t in listeners]
        listeners = [(s, "unix" if s.family == socket.AF_UNIX else "tcp") for s, _ in listeners]
        bound_socket: tuple[Path, int] | None = None
        if not listeners:
            assert settings.socket_path is not None
            unix, inode = bind_unix(settings.socket_path)
            listeners.append((unix, "unix"))
            bound_socket = settings.socket_path, inode
            if settings.tcp:
                listeners.append((bind_tcp(*settings.tcp), "tcp"))
        token = read_token(settings.state_dir) if any(t == "tcp" for _, t in listeners) else None
        metrics_socket = bind_metrics(*settings.metrics) if settings.metrics else None
        agents = _agents(args)
        store, fleet = _open_store(args, settings, listeners)
    except (StartupError, ValueError, OSError, DevdError) as e:
        print(f"devd: cannot start: {e}", file=sys.stderr)
        return 2

    registry, dispatcher = build(settings, core, store, fleet=fleet, agents=agents)
    daemon = Daemon(settings, dispatcher, token)

    def ready() -> None:
        systemd.notify(f"READY=1\nSTATUS=serving {sum(registry.counts().values())} sessions")
        logger.info(
            "daemon.listening",
            socket=str(bound_socket[0]) if bound_socket else None,
            tcp=[f"{a[0]}:{a[1]}" for s, t in listeners if t == "tcp" for a in [s.getsockname()]] or None,
            metrics="{}:{}".format(*metrics_socket.getsockname()[:2]) if metrics_socket else None,
            activated=activated or None,
            state_dir=str(settings.state_dir),
            live_memory=settings.live_memory_bytes,
            version=__version__,
        )

    try:
        anyio.run(daemon.serve, listeners, ready, metrics_socket, backend="asyncio", backend_options=_backend_options())
        # Everything is committed: a late SIGTERM must not cut the last tidying short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except StoreError as e:
        logger.error("daemon.store_failed", error=str(e))
        print(f"devd: stopped: {e}; the database was left as it is", file=sys.stderr)
        return 2
    finally:
        registry.close_all()
        store.close()
        core.close()
        for sock, _ in listeners:
            sock.close()
        if metrics_socket is not None:
            metrics_socket.close()
        if bound_socket is not None:
            unlink_socket(*bound_socket)
    logger.info("daemon.stopped")
    return 0


def _agents(args: argparse.Namespace) -> dict[str, Any]:
    """The agent profiles of --agents (default: agents.toml where `default_agents_path` finds one; none there: no
    agents); ConfigError (FILE:LINE: what is wrong) for a bad file."""
    from devd.agent.profiles import default_agents_path, load_profiles

    path = Path(args.agents) if args.agents else default_agents_path(os.environ)
    return {} if path is None else dict(load_profiles(path))


def _open_store(
    args: argparse.Namespace, settings: Settings, listeners: list[tuple[socket.socket, str]]
) -> tuple[Store, Fleet | None]:
    """The store --store names (default: the state directory's SQLite file), and the fleet when it is shared."""
    spec = args.store or f"sqlite:{settings.state_dir / 'devd.sqlite3'}"
    if spec.startswith(_POSTGRES):
        from devd.storage.postgres import PostgresStore

        store = PostgresStore(
            spec,
            keys_kept=settings.keys_kept_per_session,
            steps_kept=settings.steps_kept_per_session,
            prune_every_steps=settings.prune_every_steps,
            node=args.node,
            advertise=args.advertise or _advertised(listeners),
            lease_ttl_s=args.lease_ttl,
        )
        return store, store
    from devd.server.listeners import check_database
    from devd.storage.sqlite import SQLiteStore

    path = Path(spec.removeprefix("sqlite:")).absolute()
    check_database(path)
    return SQLiteStore(
        path,
        keys_kept=settings.keys_kept_per_session,
        steps_kept=settings.steps_kept_per_session,
        prune_every_steps=settings.prune_every_steps,
    ), None


def _advertised(listeners: list[tuple[socket.socket, str]]) -> str:
    """Where other daemons send this one's clients: its first listener, as a client addresses it."""
    sock, kind = listeners[0]
    if kind == "unix":
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _backend_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


# -- client commands: the daemon's answers for people, or as it sent them (--json) ----------------------------------

EXIT_OK = 0
EXIT_ANSWERED_ERROR = 1  # the daemon answered an error (also: `devd watch` dropped, a `devd doctor` check failed)
EXIT_LOCAL = 2  # argparse's own status for a bad flag, so local problems share it: a token file, a refused start
EXIT_UNREACHABLE = 3  # no daemon at the address, or the connection to it was lost
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT

EXIT_CODES = """\
exit status:
  0    done
  1    the daemon answered an error, printed as `devd: KIND: what to do`; `devd watch`: the daemon dropped the
       watch because this client fell behind (watch again with --since); `devd doctor`: a check failed
  2    a usage or local problem: a bad flag (or DEVD_* variable of `devd serve`), a token file that cannot be
       read; `devd serve`: it cannot start, or its store failed
  3    the daemon cannot be reached: none listens at the address (start one with `devd serve`, or
       `systemctl --user start devd.socket`), or the connection was lost
  130  interrupted (Ctrl-C)

environment:
  DEVD_SOCKET  where the client commands find the daemon when --connect is not given, and where `devd serve`
               listens when --socket is not; unset, both use $RUNTIME_DIRECTORY/devd.sock, else
               $XDG_RUNTIME_DIR/devd/devd.sock, else /tmp/devd-UID/devd.sock
  DEVD_*       each flag of `devd serve` (DEVD_MAX_LIVE for --max-live: see `devd serve --help`); the command line
               wins

docs/operations.md covers running devd under systemd, its logs, metrics, `devd doctor` and upgrades."""


class LocalError(Exception):
    """Something on this side stops the command before the daemon is asked (a token file that cannot be read)."""


class OutputClosed(Exception):
    """Whoever reads our output stopped reading (`devd ls | head`): nothing more to say, and nothing went wrong."""


def _address(args: argparse.Namespace) -> str:
    return args.connect or os.environ.get("DEVD_SOCKET") or str(default_socket_path())


def _token_hint() -> str:
    return (
        "the daemon writes its token to STATE_DIR/token when it listens on TCP "
        f"({default_state_dir() / 'token'} for a daemon of yours with the default state directory, "
        "/var/lib/devd/token under systemd's devd.service)"
    )


def _token(args: argparse.Namespace) -> str | None:
    """The token for TCP: --token, else what --token-file holds. LocalError when that file cannot be read."""
    if args.token is not None:
        return str(args.token)
    if not args.token_file:
        return None
    try:
        return Path(args.token_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise LocalError(f"cannot read the token file {args.token_file}: {why}; {_token_hint()}") from None


def _emit(data: bytes) -> None:
    """Write to stdout now (a watch's lines must not wait in a buffer); OutputClosed when the reader has gone."""
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise OutputClosed from None


def _pretty(raw: bytes) -> bytes:
    return msgspec.json.format(raw, indent=2) + b"\n"


def _params(**members: Any) -> dict[str, Any]:
    """The members that were given: a flag left out is left to the daemon's default, never sent as null."""
    return {name: value for name, value in members.items() if value is not None}


def _status(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("daemon/status")
    if args.json:
        _emit(raw + b"\n")
    elif args.prometheus:
        _emit(prometheus(msgspec.json.decode(raw)).encode())
    else:
        _emit(status_summary(msgspec.json.decode(raw)).encode())
    return EXIT_OK


def _ls(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("session/list", _params(limit=args.limit, cursor=args.cursor))
    if args.json:
        _emit(raw + b"\n")
        return EXIT_OK
    page = msgspec.json.decode(raw)
    _emit(sessions_table(page["sessions"]).encode())
    if page.get("next") is not None:
        # On stderr, so that the table alone goes down a pipe.
        print(f"devd: more sessions follow: devd ls --limit {args.limit} --cursor {page['next']}", file=sys.stderr)
    return EXIT_OK


def _named(raw: bytes, args: argparse.Namespace) -> int:
    """A result that names a session: the name alone, or the answer as it came."""
    _emit(raw + b"\n" if args.json else msgspec.json.decode(raw)["session"].encode() + b"\n")
    return EXIT_OK


def _new(client: Client, args: argparse.Namespace) -> int:
    config = {"model": args.model} if args.model else None
    return _named(client.call_raw("session/new", _params(config=config, session=args.session)), args)


def _step(client: Client, args: argparse.Namespace) -> int:
    # An empty key and a zero timeout are sent as given: they are the daemon's to refuse, not ours to drop.
    event = msgspec.Raw(args.event.encode())
    raw = client.call_raw(
        "session/step", _params(session=args.session, event=event, key=args.key, timeout_ms=args.timeout_ms)
    )
    _emit(raw + b"\n" if args.json else _pretty(raw))
    return EXIT_OK


def _restore(client: Client, args: argparse.Namespace) -> int:
    data = sys.stdin.read().strip() if args.snapshot == "-" else args.snapshot
    return _named(client.call_raw("session/restore", _params(snapshot=data, session=args.session)), args)


def _fork(client: Client, args: argparse.Namespace) -> int:
    params = _params(session=args.session, at=args.at)
    if args.name is not None:
        params["as"] = args.name  # a Python keyword, so not through _params
    return _named(client.call_raw("session/fork", params), args)


def _decision(decision: Literal["allow", "deny"]) -> Callable[[Client, argparse.Namespace], int]:
    """`devd approve` / `devd deny`: answer an action that waits for approval, naming it by the digest of the action
    the session shows as pending (the same digest its `session/approval` carried)."""

    def run(client: Client, args: argparse.Namespace) -> int:
        from devd.agent.approvals import action_digest

        client.initialize(token=_token(args), name=cli_client_name())
        found = [a for a in client.pending(args.session) if a.id == args.action]
        if not found or found[0].awaiting != "approval":
            raise LocalError(
                f"action {args.action} of {args.session} is not waiting for approval; `devd pending {args.session}` "
                "shows what the session waits for"
            )
        digest = action_digest(args.action, msgspec.structs.replace(found[0], awaiting=None).op)
        client.approve(args.session, args.action, digest, decision, remember=args.remember)
        if args.json:
            _emit(b"{}\n")
        else:
            _emit(
                f"action {args.action} of {args.session}: {'allowed' if decision == 'allow' else 'denied'}\n".encode()
            )
        return EXIT_OK

    return run


def cli_client_name() -> str:
    """Who the command decides as (`by` of `session/decided`): the user, through devd's command line."""
    return f"{getpass.getuser()} (devd cli)"


def _usage(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("session/usage", {"session": args.session})
    _emit(raw + b"\n" if args.json else _pretty(raw))
    return EXIT_OK


def _trace(client: Client, args: argparse.Namespace) -> int:
    raw = client.call_raw("session/trace", _params(session=args.session, since=args.since))
    if args.json:
        _emit(raw + b"\n")
        return EXIT_OK
    for record in msgspec.json.decode(raw)["records"]:
        _emit(trace_line(record).encode())
    return EXIT_OK


def trace_line(r: dict[str, Any]) -> str:
    """One trace record for people: number, start, action, kind, outcome, duration, model and tokens, error."""
    what = r["kind"] if r.get("model") is None else f"{r['kind']} {r['model']}"
    if r.get("attempt"):
        what += f" (attempt {r['attempt']})"
    tokens = f" {r['input_tokens']}+{r['output_tokens']} tokens" if r.get("input_tokens") is not None else ""
    error = f": {r['error']}" if r.get("error") else ""
    took = f"{r['duration_ms']:.1f} ms"
    return f"{r['n']:>4} {r['started']} action {r['action']} {what} {r['outcome']} {took}{tokens}{error}\n"


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


def _watch(client: Client, args: argparse.Namespace) -> int:
    """Notifications as JSON lines (with or without --json: each is a message of the protocol) until the watch ends."""
    client.call("session/watch", _params(session=args.session, since=args.since))
    while True:
        notice = client.wait_notification()
        _emit(msgspec.json.encode({"method": notice.method, "params": notice.params}) + b"\n")
        if notice.method == "session/unwatched":
            # The session closed (or expired): the watch is over, normally. Dropped for falling behind: exit 1,
            # and watch again with --since to catch up.
            closed = notice.params.get("reason") in ("closed", "expired")
            return EXIT_OK if closed else EXIT_ANSWERED_ERROR


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


# -- commands that are plain calls, derived from the method table ---------------------------------------------------


@dataclass(frozen=True)
class Plain:
    """A command that is one call of a method of `devd.protocol.METHODS`: its arguments are the method's params (a
    required one positional, an optional one a flag), and for people it prints `show` of the answer (--json: the
    answer as it came)."""

    command: str
    method: str
    help: str
    show: Callable[[bytes], bytes]


def _member(member: str) -> Callable[[bytes], bytes]:
    return lambda raw: str(msgspec.json.decode(raw)[member]).encode() + b"\n"


def _nothing(raw: bytes) -> bytes:
    return b""


def _waits(raw: bytes) -> bytes:
    entry = msgspec.json.decode(raw)
    waits = ", ".join(f"{w['kind']} (id {w['id']})" for w in entry["waiting"]) or "nothing"
    return sessions_table([entry]).encode() + f"waiting for: {waits}\n".encode()


def _pretty_member(member: str) -> Callable[[bytes], bytes]:
    return lambda raw: _pretty(msgspec.json.encode(msgspec.json.decode(raw)[member]))


PLAIN: tuple[Plain, ...] = (
    Plain("snapshot", "session/snapshot", "print a session's snapshot (base64)", _member("snapshot")),
    Plain("pending", "session/pending", "print the actions a session still waits for (JSON)", _pretty),
    Plain(
        "info",
        "session/info",
        "show one session's entry (as `devd ls` has it) and the actions its turn waits for",
        _waits,
    ),
    Plain(
        "transcript",
        "session/transcript",
        "print a session's conversation (JSON), the whole of it or from message --from on",
        _pretty_member("messages"),
    ),
    Plain(
        "recover",
        "session/recover",
        "bring an ended or poisoned session back from its durable state",
        _member("session"),
    ),
    Plain("close", "session/close", "end a session and delete its state", _nothing),
)


def _plain_params(plain: Plain, args: argparse.Namespace) -> dict[str, Any]:
    """The method's params from the command's arguments, by the params' own names; a flag left out is not sent."""
    fields = msgspec.structs.fields(METHODS[plain.method].params)
    return _params(**{f.encode_name: getattr(args, f.name) for f in fields})


def _run_plain(plain: Plain) -> Callable[[Client, argparse.Namespace], int]:
    def run(client: Client, args: argparse.Namespace) -> int:
        raw = client.call_raw(plain.method, _plain_params(plain, args))
        _emit(raw + b"\n" if args.json else plain.show(raw))
        return EXIT_OK

    return run


def _plain_arguments(c: argparse.ArgumentParser, plain: Plain) -> None:
    """The method's params as arguments: `session` (and any other required one) positional, the rest flags."""
    for f in msgspec.structs.fields(METHODS[plain.method].params):
        doc = _param_help(f.type)
        if f.required:
            c.add_argument(f.name, help="the session's name" if f.name == "session" else doc)
        else:
            number = _is_int(f.type)
            c.add_argument(
                f"--{f.encode_name.replace('_', '-')}",
                dest=f.name,
                type=int if number else str,
                metavar="N" if number else None,
                help=doc,
            )


def _constraint(t: Any) -> tuple[msgspec.inspect.Type, str | None]:
    """A param's type, `X | None` as its X, and the description its `Meta` gives it."""
    info = msgspec.inspect.type_info(t)
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(i for i in info.types if not isinstance(i, msgspec.inspect.NoneType))
    if isinstance(info, msgspec.inspect.Metadata):
        return info.type, (info.extra_json_schema or {}).get("description")
    return info, None


def _is_int(t: Any) -> bool:
    return isinstance(_constraint(t)[0], msgspec.inspect.IntType)


def _param_help(t: Any) -> str | None:
    return _constraint(t)[1]


COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "backup": _backup,
    "drain": _drain,
    "status": _status,
    "ls": _ls,
    "new": _new,
    "step": _step,
    "restore": _restore,
    "fork": _fork,
    "inspect": _inspect,
    "watch": _watch,
    **{plain.command: _run_plain(plain) for plain in PLAIN},
    "approve": _decision("allow"),
    "deny": _decision("deny"),
    "usage": _usage,
    "trace": _trace,
}


def _run_client(args: argparse.Namespace) -> int:
    from devd.client import Client, NotRunningError

    try:
        token = _token(args)
        with Client.connect(_address(args), token=token, peers=args.peer) as client:
            return COMMANDS[args.command](client, args)
    except LocalError as e:
        print(f"devd: {e}", file=sys.stderr)
        return EXIT_LOCAL
    except OutputClosed:
        # Whatever is still buffered for stdout has nowhere to go: let the interpreter's last flush find nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except DevdError as e:
        print(f"devd: {e.kind}: {in_cli_terms(e, args)}", file=sys.stderr)
        return EXIT_ANSWERED_ERROR
    except NotRunningError as e:
        print(f"devd: {e.strerror}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (OSError, ConnectionError) as e:
        print(f"devd: cannot reach the daemon at {_address(args)}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


# -- errors in the command's terms -----------------------------------------------------------------------------------

# The command that does what a method does, for messages that name the method; {session} is the session the command
# at hand was given, else SESSION.
METHOD_COMMANDS: dict[str, str] = {
    "session/list": "devd ls",
    "session/new": "devd new",
    "session/step": "devd step {session} EVENT",
    "session/snapshot": "devd snapshot {session}",
    "session/restore": "devd restore SNAPSHOT",
    "session/fork": "devd fork {session}",
    "session/pending": "devd pending {session}",
    "session/info": "devd info {session}",
    "session/transcript": "devd transcript {session}",
    "session/recover": "devd recover {session}",
    "session/close": "devd close {session}",
    "session/watch": "devd watch {session}",
    "session/approve": "devd approve {session} ACTION",
    "session/usage": "devd usage {session}",
    "session/trace": "devd trace {session}",
    "daemon/status": "devd status",
}
_METHOD_NAMED = re.compile(r"`?\b((?:session|daemon)/[a-z]+)\b`?")


def in_cli_terms(error: DevdError, args: argparse.Namespace) -> str:
    """The daemon's message as a user of the command reads it: the commands for the methods it names, the flags for
    the token it wants, and where the daemon's log is when it failed."""
    if error.kind == "UNAUTHORIZED":
        return _unauthorized(args)
    session = getattr(args, "session", None) or "SESSION"

    def command(found: re.Match[str]) -> str:
        template = METHOD_COMMANDS.get(found[1])
        return found[0] if template is None else f"`{template.format(session=session)}`"

    message = _METHOD_NAMED.sub(command, str(error))
    if error.kind == "INTERNAL":
        message += " (the daemon's log: `journalctl -u devd`, with --user for a daemon of yours, or its stderr)"
    return message


def _unauthorized(args: argparse.Namespace) -> str:
    if args.token is None and not args.token_file:
        return f"the daemon at {_address(args)} wants its token first: pass --token-file PATH; {_token_hint()}"
    given = f"the token in {args.token_file}" if args.token is None else "the token given"
    return f"the daemon at {_address(args)} refused {given}: it is not this daemon's token; {_token_hint()}"


# -- the human formats: pure functions of the daemon's answers -------------------------------------------------------


def table(headers: list[str], rows: list[list[str]], right: frozenset[int] = frozenset()) -> str:
    """Columns two spaces apart, padded to their widest cell; the columns in `right` (numbers) aligned right."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded).rstrip()

    return "".join(line(row) + "\n" for row in [headers, *rows])


def _when(rfc3339: str) -> str:
    """An RFC 3339 time of the daemon's (UTC, to the millisecond) to the second: 2026-11-30T12:07:18Z."""
    return rfc3339[:19] + "Z" if len(rfc3339) >= 19 else rfc3339


def sessions_table(sessions: list[dict[str, Any]]) -> str:
    """`devd ls`: a session a line, by name; REASON only when a session has one (why it ended or was poisoned)."""
    if not sessions:
        return "no sessions\n"
    headers = ["NAME", "STATE", "SEQ", "WATCHERS", "CREATED", "LAST USED"]
    rows = [
        [s["session"], s["state"], str(s["seq"]), str(s.get("watchers", 0)), _when(s["created"]), _when(s["last_used"])]
        for s in sessions
    ]
    if any(s.get("reason") for s in sessions):
        headers.append("REASON")
        for row, s in zip(rows, sessions, strict=True):
            row.append(s.get("reason") or "")
    return table(headers, rows, right=frozenset({2, 3}))


def _pairs(pairs: list[tuple[str, str]]) -> str:
    """`key: value` lines, the values lined up."""
    width = max(len(key) for key, _ in pairs) + 1
    return "".join(f"{key + ':':<{width}} {value}\n" for key, value in pairs)


SUMMARY_CHARS_MAX = 72  # an action's summary in `devd inspect`, so that each stays on one line


def action_summary(action: Action) -> str:
    """An action's kind and what it is about, on one line: `Read src/lib.rs`, `Model (12 messages)`."""
    op = action.op
    kind = next(name for name in op.__struct_fields__ if getattr(op, name) is not None)
    if op.Model is not None:
        n = len(op.Model.messages)
        about = f"({n} message{'' if n == 1 else 's'})"
    elif op.Exec is not None:
        about = shlex.join(op.Exec.argv)
    elif op.Git is not None:
        about = shlex.join(op.Git.argv)
    elif op.Read is not None:
        about = op.Read.path
    elif op.Write is not None:
        about = f"{op.Write.path} ({len(op.Write.text)} characters)"
    elif op.Browse is not None:
        about = op.Browse.url
    elif op.Done is not None:
        about = f"turn {op.Done.turn}"
    else:
        about = op.Emit or ""
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
        pairs.append(("reason", entry["reason"]))
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
    actions = pending or []
    width = max((len(str(a.id)) for a in actions), default=0)
    return _pairs(pairs) + "".join(f"  {a.id:>{width}}  {action_summary(a)}\n" for a in actions)


def _duration(seconds: float) -> str:
    """12.5s, 4m 5s, 3h 12m, 2d 3h: the two largest units."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    left = int(seconds)
    days, left = divmod(left, 86400)
    hours, left = divmod(left, 3600)
    minutes, secs = divmod(left, 60)
    units = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    while units[0][0] == 0:
        units.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in units[:2])


def _size(n: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1 of it: 512 B, 4.0 KiB, 61.6 MiB, 1.5 GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


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


# -- devd doctor: one line per check, ok or FAIL and what to do ------------------------------------------------------

DATABASE_FILE = "devd.sqlite3"  # in the state directory, as `devd serve` names it


@dataclass(frozen=True)
class Check:
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


# -- `devd serve`'s flag values, from the command line or the environment --------------------------------------------

T = TypeVar("T")


def _flag_value(parse: Callable[[str], T]) -> Callable[[str], T]:
    """parse as an argparse type: its ValueError's message becomes the usage error (argparse's own says only
    "invalid value")."""

    def value(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    value.__name__ = parse.__name__
    return value


def _socket_path(text: str) -> Path:
    """The socket `devd serve` listens on: a path, or a path as a client names it (`unix:PATH`). A TCP address is
    refused rather than made a file name: DEVD_SOCKET may hold one for the client commands, but serving TCP is
    --listen's."""
    path = text.removeprefix("unix:")
    if not path or text.startswith("tcp://"):
        raise argparse.ArgumentTypeError(
            f"--socket takes the path of a Unix socket, not {text!r}; to serve TCP, pass --listen tcp://HOST:PORT"
        )
    return Path(path)


def _otel_endpoint(text: str) -> str:
    if not re.fullmatch(r"https?://[^/\s]+(/\S*)?", text):
        raise argparse.ArgumentTypeError(
            f"--otel-endpoint takes a collector's OTLP/HTTP base URL (e.g. http://127.0.0.1:4318), not {text!r}"
        )
    return text


def _metrics_address(text: str) -> tuple[str, int]:
    try:
        return parse_tcp(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--metrics takes tcp://HOST:PORT (e.g. tcp://127.0.0.1:9464), not {text!r}"
        ) from None


_POSTGRES = ("postgresql://", "postgres://")


def _store_url(text: str) -> str:
    if text.startswith(_POSTGRES) or (text.startswith("sqlite:") and len(text) > len("sqlite:")):
        return text
    raise argparse.ArgumentTypeError(f"--store takes postgresql://USER@HOST/DB (a fleet) or sqlite:PATH, not {text!r}")


def _flags(command: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in command._actions if action.option_strings and action.dest != "help"]


def flag_variable(action: argparse.Action) -> str:
    """The environment variable a flag of `devd serve` is read from: --max-live from DEVD_MAX_LIVE."""
    return "DEVD_" + max(action.option_strings, key=len).removeprefix("--").replace("-", "_").upper()


_SWITCH = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _from_environment(action: argparse.Action, variable: str, text: str) -> Any:
    """text as the flag's value, checked as argparse checks one given on the command line; ValueError, naming the
    variable, when the flag would refuse it."""
    said = f"environment variable {variable} ({max(action.option_strings, key=len)})"
    if action.nargs == 0:  # a switch, which takes no value on the command line
        if text.lower() not in _SWITCH:
            raise ValueError(f"{said}: 1, true or yes sets it, 0, false or no leaves it off; not {text!r}")
        return _SWITCH[text.lower()]
    convert = action.type if callable(action.type) else str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{said}: {e}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{said}: invalid {getattr(convert, '__name__', 'value')} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise ValueError(f"{said}: invalid choice: {text!r} (choose from {choices})")
    return value


def environment_defaults(command: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """The values command's flags take from the environment, by dest: each from its variable (`flag_variable`) when
    that is set and not empty (an empty one is unset, as an empty DEVD_SOCKET always was for the client commands, so
    systemd's `Environment=DEVD_X=` clears one). ValueError, naming the variable, for a value the flag would refuse."""
    values = {}
    for action in _flags(command):
        variable = flag_variable(action)
        if text := environ.get(variable):
            values[action.dest] = _from_environment(action, variable, text)
    return values


def parse_args(argv: list[str] | None, environ: Mapping[str, str]) -> argparse.Namespace:
    """The command line. For `devd serve`, each flag left out takes its value from its variable in environ, when set:
    the command line wins. A variable that is set must hold a value its flag takes, even when the flag is given too
    (a typo in a systemd drop-in is reported at once, not left for the day the flag is dropped); otherwise this
    exits 2, as for a bad flag, naming the variable."""
    top, serve = _parsers()
    args = top.parse_args(argv)
    if args.command != "serve":
        return args
    try:
        serve.set_defaults(**environment_defaults(serve, environ))
    except ValueError as e:
        serve.error(str(e))
    return top.parse_args(argv)  # again, now that the environment's values are the defaults


# -- the command line -----------------------------------------------------------------------------------------------


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written, and every flag's default after its help, except where there is none to
    show (None, or a switch's False): those flags say in their help what leaving them out does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _escaped(text: object) -> str:
    return str(text).replace("%", "%%")  # argparse %-formats help


def _connection_flags(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--connect",
        metavar="ADDRESS",
        help="the daemon's socket path, or tcp://HOST:PORT (default: $DEVD_SOCKET, else where `devd serve` listens "
        f"by default; here {_escaped(os.environ.get('DEVD_SOCKET') or default_socket_path())})",
    )
    c.add_argument("--token", help="the daemon's TCP token (--token-file keeps it out of `ps`)")
    c.add_argument(
        "--token-file", metavar="PATH", help="read the TCP token from this file: the daemon's STATE_DIR/token"
    )
    c.add_argument(
        "--peer",
        metavar="ADDRESS",
        action="append",
        default=[],
        help="another daemon of the fleet this command may follow MOVED to, and give the token (repeatable); "
        "without it MOVED is followed only to Unix sockets of this machine (docs/fleet.md)",
    )


def parser() -> argparse.ArgumentParser:
    """The `devd` command line (for `devd serve`'s environment variables, see `parse_args`)."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `devd` command line, and its `serve` subcommand's, whose flags also read the environment."""
    p = argparse.ArgumentParser(
        prog="devd",
        description="A session daemon for agent tools. `devd serve` runs it; the other commands talk to it.",
        epilog=EXIT_CODES,
        formatter_class=_Help,
    )
    p.add_argument("--version", action="version", version=f"devd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground until SIGTERM or SIGINT (exit 0; 2 when it cannot start). "
        "Each flag may be set in the environment instead, as its [env VARIABLE] says (--max-live as DEVD_MAX_LIVE; "
        "1, true or yes for a switch); the command line wins.",
        formatter_class=_Help,
    )
    serve.add_argument(
        "--socket",
        metavar="PATH",
        type=_socket_path,
        help="the Unix socket to listen on (default: $DEVD_SOCKET, which is also where the client commands look for "
        "the daemon, else $RUNTIME_DIRECTORY/devd.sock, else $XDG_RUNTIME_DIR/devd/devd.sock, else "
        f"/tmp/devd-UID/devd.sock; here {_escaped(os.environ.get('DEVD_SOCKET') or default_socket_path())}); "
        "ignored when systemd passes the daemon its sockets",
    )
    serve.add_argument(
        "--listen",
        metavar="tcp://HOST:PORT",
        type=_flag_value(parse_tcp),
        help="also listen on TCP, where a connection must first present the token from STATE_DIR/token "
        "(default: the Unix socket only)",
    )
    serve.add_argument(
        "--state-dir",
        metavar="DIR",
        help="where the sessions, the token and the lock are kept (default: $STATE_DIRECTORY, else "
        f"$XDG_STATE_HOME/devd; here {_escaped(default_state_dir())})",
    )
    serve.add_argument(
        "--backup-dir",
        metavar="DIR",
        help="where daemon/backup (devd backup NAME) writes its copies, each by a plain file name; made 0700, and "
        "refused like the state directory when it is another user's or others may write it "
        "(default: STATE_DIR/backups)",
    )
    serve.add_argument(
        "--core", metavar="PATH", help="load this wasm module (ABI 1) instead of the packaged core (default: packaged)"
    )
    serve.add_argument(
        "--call-timeout",
        type=float,
        metavar="S",
        default=default("call_timeout_s"),
        help="default deadline of a call, in seconds",
    )
    serve.add_argument(
        "--max-call-timeout",
        type=float,
        metavar="S",
        default=default("max_call_timeout_s"),
        help="the longest deadline a client may ask for, in seconds (longer ones are cut to it)",
    )
    serve.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        default=default("sessions_max"),
        help="sessions kept, live or stored",
    )
    serve.add_argument(
        "--max-live",
        type=int,
        metavar="N",
        default=default("max_live"),
        help="sessions held in memory; past it the least recently used idle one hibernates (to disk)",
    )
    serve.add_argument(
        "--live-memory",
        metavar="SIZE",
        type=_flag_value(parse_size),
        help="the sessions in memory together may use this much (e.g. 4G); past it the least recently used idle "
        "ones hibernate. Default: half of this machine's memory (each session's own cap is --session-memory)",
    )
    serve.add_argument(
        "--session-memory",
        metavar="SIZE",
        type=_flag_value(parse_size),
        default=default("memory_bytes_per_session"),
        help="the most memory one session's instance may use (e.g. 128M); a step that would need more is refused "
        "(NULL) and the session goes on",
    )
    serve.add_argument(
        "--store",
        metavar="URL",
        type=_store_url,
        help="where sessions are kept: sqlite:PATH, or postgresql://USER@HOST/DB to share them with other daemons "
        "(a fleet: see docs/fleet.md). Default: sqlite:STATE_DIR/devd.sqlite3",
    )
    serve.add_argument(
        "--node",
        metavar="NAME",
        help="this daemon's name in a fleet (default: HOSTNAME-PID); it must be unique among the daemons",
    )
    serve.add_argument(
        "--advertise",
        metavar="ADDRESS",
        help="where other daemons of a fleet send this one's clients: unix:PATH or tcp://HOST:PORT "
        "(default: its first listener)",
    )
    serve.add_argument(
        "--lease-ttl",
        type=float,
        metavar="SECONDS",
        default=10.0,
        help="a fleet daemon that cannot renew its lease for this long stops writing, and its sessions may be "
        "taken over by others",
    )
    serve.add_argument(
        "--snapshot-floor",
        type=int,
        metavar="BYTES",
        default=default("snapshot_floor_bytes"),
        help="journal bytes since a session's last snapshot below which no new one is taken (a replay of that "
        "much is cheap); past it, one is taken at the end of a turn once the journal outgrows a quarter of the last "
        "snapshot",
    )
    serve.add_argument(
        "--expire-after",
        metavar="DURATION",
        type=_flag_value(parse_duration),
        help="delete sessions no call has used for this long (e.g. 30d, 12h); default: keep them",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        default=default("connections_max"),
        help="connections open at once, for each of the Unix socket and TCP; past it, a new one is refused (FULL)",
    )
    serve.add_argument(
        "--max-line-bytes",
        type=int,
        metavar="BYTES",
        default=default("line_bytes_max"),
        help="the longest request line, in bytes; a longer one is discarded and answered TOO_LARGE",
    )
    serve.add_argument(
        "--line-timeout",
        type=float,
        metavar="S",
        default=default("line_timeout_s"),
        help="seconds a request line may take to arrive",
    )
    serve.add_argument(
        "--send-timeout",
        type=float,
        metavar="S",
        default=default("send_timeout_s"),
        help="seconds a client may take no bytes while the daemon has some for it, before it is disconnected",
    )
    serve.add_argument(
        "--metrics",
        metavar="tcp://HOST:PORT",
        type=_metrics_address,
        help="also answer HTTP GET /metrics there, in the Prometheus text format (as `devd status --prometheus`); "
        "use a loopback address unless others should read the counters (default: off)",
    )
    serve.add_argument(
        "--otel-endpoint",
        metavar="URL",
        type=_otel_endpoint,
        help="also export the trace of the sessions the daemon drives as OpenTelemetry spans (GenAI conventions, no "
        "message content) over OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 (default: off)",
    )
    serve.add_argument(
        "--agents",
        metavar="FILE",
        help="the agent profiles ([agent.NAME] tables, see the README's agent runtime section) of the sessions the "
        "daemon drives itself (default: $CONFIGURATION_DIRECTORY/agents.toml under systemd, else "
        "$XDG_CONFIG_HOME/devd/agents.toml, when there is one; else none)",
    )
    serve.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="json: one object a line, for journald and containers; console: for people (default: console when "
        "stderr is a terminal, else json)",
    )
    serve.add_argument(
        "--log-level",
        default=default("log_level"),
        choices=["debug", "info", "warning", "error"],
        help="the least severe events logged: info adds the daemon's and sessions' lifecycle to the warnings and "
        "errors that need attention (docs/operations.md lists the events)",
    )
    for action in _flags(serve):
        action.help = f"{action.help} [env {flag_variable(action)}]"

    schema = sub.add_parser("schema", help="print the JSON Schema of every message of the protocol")
    form = schema.add_mutually_exclusive_group()
    form.add_argument(
        "--openrpc", action="store_true", help="print an OpenRPC 1.3 document instead: methods, params and results"
    )
    form.add_argument(
        "--typescript", action="store_true", help="print the protocol's types as a TypeScript module instead"
    )

    def client(name: str, help: str, json: str = "") -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=_Help)
        _connection_flags(c)
        c.add_argument(
            "--json",
            action="store_true",
            help=json or "print the daemon's answer exactly as it sent it, on one line (for scripts)",
        )
        return c

    def session(c: argparse.ArgumentParser) -> argparse.ArgumentParser:
        c.add_argument("session", help="the session's name")
        return c

    status = client("status", "show the daemon's counters: sessions, steps, commits, errors, memory")
    status.add_argument("--prometheus", action="store_true", help="in the Prometheus text format (--json wins)")
    ls = client("ls", "list the sessions by name: a table of their state, last step, watchers and times")
    ls.add_argument(
        "--limit", type=int, metavar="N", help="at most this many sessions, 1-100000 (default: all of them)"
    )
    ls.add_argument("--cursor", metavar="NAME", help="start after this name (the page before says which)")
    new = client("new", "start a session and print its name")
    new.add_argument("--model", help="the model the session's Model actions name (default: none is named)")
    new.add_argument("--session", help="name it (default: chosen by the daemon)")
    step = session(client("step", "step a session with an event (JSON) and print the actions answered (JSON)"))
    step.add_argument("event", help='the event, e.g. \'{"Turn":{"id":1,"prompt":"fix the build"}}\'')
    step.add_argument(
        "--key", help="idempotency key: the step sent again with it is answered from the journal, never run twice"
    )
    step.add_argument(
        "--timeout-ms", type=int, help="this step's deadline in milliseconds (default: the daemon's --call-timeout)"
    )
    watch = session(
        client(
            "watch",
            "print every step of a session as it happens, as JSON lines, until the session is closed",
            json="accepted for uniformity: watch always prints the protocol's notifications as JSON lines",
        )
    )
    watch.add_argument("--since", type=int, help="start after this step, 0 for all of them (default: from now on)")
    restore = client("restore", "start a session from a snapshot and print its name")
    restore.add_argument("snapshot", help="the snapshot (base64), or - to read it from stdin")
    restore.add_argument("--session", help="name it (default: chosen by the daemon)")
    fork = session(client("fork", "start a session from another's history (up to step --at) and print its name"))
    fork.add_argument("--at", type=int, help="the step to fork at (default: the session's latest)")
    fork.add_argument("--as", dest="name", help="name the fork (default: chosen by the daemon)")
    session(
        client(
            "inspect",
            "show one session at a glance: its state, step, watchers and times, and the actions a running turn "
            "waits for (asking them loads a stored session)",
            json='print {"session": its entry as `devd ls --json` has it, "pending": the actions, as `devd pending '
            "--json` has them, or null for an ended or poisoned session} on one line",
        )
    )
    for plain in PLAIN:
        _plain_arguments(client(plain.command, plain.help), plain)
    for verb, does in (("approve", "allow"), ("deny", "deny")):
        decide = session(client(verb, f"{does} an action of a session the daemon drives that waits for approval"))
        decide.add_argument("action", type=int, help="the action's id (`devd pending SESSION` shows it)")
        decide.add_argument(
            "--remember",
            action="store_true",
            help=f"{does} later calls of the same argv prefix (Exec, Git) or path (Write) in this session too",
        )
    session(client("usage", "show what a session's model calls used: tokens, calls, and calls a ceiling refused"))
    trace = session(client("trace", "show a session's trace: one line per model call attempt and per tool run"))
    trace.add_argument("--since", type=int, help="only the records after this record number")
    backup = client("backup", "have the daemon write a consistent copy of every session to a new file")
    backup.add_argument(
        "name",
        help="the file name of the copy, in the daemon's backup directory (devd serve --backup-dir; default "
        "STATE_DIR/backups); it must not exist there",
    )
    client("drain", "have a fleet daemon give its sessions back to the fleet, so others take them at once")
    # The agent runtime's: a turn the daemon drives, shown as it happens (devd.agent.cli).
    run = sub.add_parser(
        "run",
        help="have the daemon carry out a turn of an agent and show it as it happens",
        description="Start a session of an agent (or continue --session) with PROMPT and show the turn as the daemon "
        "carries it out: the model's text as it streams, each call and its result, the outcome. Exit 0 when the "
        "turn is done, 1 when it ended otherwise, 130 after Ctrl-C (which cancels the turn).",
        formatter_class=_Help,
    )
    _connection_flags(run)
    run.add_argument("prompt", help="what to ask the agent")
    run.add_argument("--agent", help="the agent profile (default: the daemon's only one, when it has one)")
    run.add_argument("--workspace", metavar="DIR", help="the session's workspace (default: the current directory)")
    run.add_argument("--session", help="continue this session (made, of --agent in --workspace, if there is none)")
    attach = sub.add_parser(
        "attach",
        help="show the turn of a session the daemon drives as it happens, until it ends",
        description="Show what the daemon does for a session (someone else prompted) as it happens, until its "
        "running turn ends (exit 0) or Ctrl-C (130; the turn goes on).",
        formatter_class=_Help,
    )
    _connection_flags(attach)
    attach.add_argument("session", help="the session's name")

    from devd.acp.main import add_arguments as acp_arguments

    acp = sub.add_parser(
        "acp",
        help="be an Agent Client Protocol agent on stdin/stdout for an editor, backed by the daemon (docs/editors.md)",
        description="Be an Agent Client Protocol (v1) agent on stdin/stdout, as an editor spawns one (Zed, Neovim's "
        "CodeCompanion, Emacs' agent-shell: docs/editors.md), whose sessions are the running daemon's. Exit 0 when "
        "the editor closes our input, 3 when no daemon answers at the start.",
        formatter_class=_Help,
    )
    _connection_flags(acp)
    acp_arguments(acp)

    doctor = sub.add_parser(
        "doctor",
        help="check the daemon, its state directory, database and core",
        description="Check the daemon, its state directory, database and core, one line per check: ok, FAIL and "
        "what to do, or skip and why. Exit 0 when no check fails, else 1. The database's integrity is checked only "
        "while no daemon holds the state directory (a running daemon keeps the file open exclusively).",
        formatter_class=_Help,
    )
    _connection_flags(doctor)
    doctor.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the daemon's state directory (default: as `devd serve` chooses it; "
        f"here {_escaped(default_state_dir())})",
    )
    doctor.add_argument("--core", metavar="PATH", help="the core `devd serve --core` loads (default: the packaged one)")
    return p, serve


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, os.environ)
    if args.command == "serve":
        return _serve(args)
    if args.command == "schema":
        from devd.schema import openrpc_json, schema_json, typescript

        if args.typescript:
            sys.stdout.write(typescript())
        else:
            sys.stdout.buffer.write((openrpc_json() if args.openrpc else schema_json()) + b"\n")
        return 0
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "acp":
        from devd.acp.main import main as acp_main

        return acp_main(args)
    if args.command in ("run", "attach"):
        return _run_agent(args)
    return _run_client(args)


def _run_agent(args: argparse.Namespace) -> int:
    """`devd run` and `devd attach` (devd.agent.cli), with the errors and exit status of the other client commands."""
    from devd.agent import cli as agent_cli
    from devd.client import NotRunningError

    try:
        return agent_cli.main(args, _address(args), _token(args))
    except LocalError as e:
        print(f"devd: {e}", file=sys.stderr)
        return EXIT_LOCAL
    except DevdError as e:
        print(f"devd: {e.kind}: {in_cli_terms(e, args)}", file=sys.stderr)
        return EXIT_ANSWERED_ERROR
    except NotRunningError as e:
        print(f"devd: {e.strerror}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (OSError, ConnectionError) as e:
        print(f"devd: cannot reach the daemon at {_address(args)}: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
