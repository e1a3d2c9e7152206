"""The `devd` command: `serve` runs the daemon in the foreground; the other subcommands are clients of it."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec

from devd import __version__, log, systemd
from devd.config import Settings, default, default_socket_path, default_state_dir, parse_duration, parse_size, parse_tcp
from devd.errors import DevdError


def _serve(args: argparse.Namespace) -> int:
    import anyio
    import structlog

    from devd.daemon import Daemon, build
    from devd.errors import StoreError
    from devd.host import Core
    from devd.listeners import (
        StartupError,
        bind_tcp,
        bind_unix,
        lock_state_dir,
        prepare_state_dir,
        read_token,
        unlink_socket,
    )
    from devd.sqlite_store import SQLiteStore

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
        settings = Settings(
            state_dir=Path(args.state_dir) if args.state_dir else default_state_dir(),
            socket_path=Path(args.socket) if args.socket else default_socket_path(),
            tcp=parse_tcp(args.listen) if args.listen else None,
            core_path=Path(args.core) if args.core else None,
            call_timeout_s=args.call_timeout,
            sessions_max=args.max_sessions,
            max_live=args.max_live,
            snapshot_floor_bytes=args.snapshot_floor,
            live_memory_bytes=parse_size(args.live_memory) if args.live_memory else None,
            expire_after_s=parse_duration(args.expire_after) if args.expire_after else None,
            connections_max=args.max_connections,
            line_bytes_max=args.max_line_bytes,
            line_timeout_s=args.line_timeout,
            send_timeout_s=args.send_timeout,
            max_call_timeout_s=args.max_call_timeout,
            log_format=args.log_format,
            log_level=args.log_level,
        )
        prepare_state_dir(settings.state_dir)
        lock_state_dir(settings.state_dir, settings.socket_path)  # held (by its open descriptor) until exit
        core = Core.open(
            settings.core_path,
            call_timeout=settings.call_timeout_s,
            memory_bytes=settings.memory_bytes_per_session,
        )
        store = SQLiteStore(
            settings.state_dir / "devd.sqlite3",
            keys_kept=settings.keys_kept_per_session,
            steps_kept=settings.steps_kept_per_session,
            prune_every_steps=settings.prune_every_steps,
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
    except (StartupError, ValueError, OSError, DevdError) as e:
        print(f"devd: cannot start: {e}", file=sys.stderr)
        return 2

    registry, dispatcher = build(settings, core, store)
    daemon = Daemon(settings, dispatcher, token)

    def ready() -> None:
        systemd.notify(f"READY=1\nSTATUS=serving {sum(registry.counts().values())} sessions")
        logger.info(
            "daemon.listening",
            socket=str(bound_socket[0]) if bound_socket else None,
            tcp=[f"{a[0]}:{a[1]}" for s, t in listeners if t == "tcp" for a in [s.getsockname()]] or None,
            activated=activated or None,
            state_dir=str(settings.state_dir),
            version=__version__,
        )

    try:
        anyio.run(daemon.serve, listeners, ready, backend="asyncio", backend_options=_backend_options())
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
        if bound_socket is not None:
            unlink_socket(*bound_socket)
    logger.info("daemon.stopped")
    return 0


def _backend_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _address(args: argparse.Namespace) -> str:
    return args.connect or os.environ.get("DEVD_SOCKET") or str(default_socket_path())


def _client(args: argparse.Namespace) -> Any:
    from devd.client import Client

    token = args.token
    if token is None and args.token_file:
        token = Path(args.token_file).read_text().strip()
    return Client.connect(_address(args), token=token)


def _print(value: Any) -> None:
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(value), indent=2) + b"\n")


def _run_client(args: argparse.Namespace) -> int:
    from devd.client import NotRunningError

    try:
        with _client(args) as client:
            if args.command == "status":
                status = client.call("daemon/status")
                if args.prometheus:
                    sys.stdout.write(prometheus(status))
                else:
                    _print(status)
            elif args.command == "ls":
                _print(client.call("session/list"))
            elif args.command == "new":
                params: dict[str, Any] = {}
                if args.model:
                    params["config"] = {"model": args.model}
                if args.session:
                    params["session"] = args.session
                print(client.call("session/new", params)["session"])
            elif args.command == "step":
                step: dict[str, Any] = {"session": args.session, "event": msgspec.Raw(args.event.encode())}
                if args.key is not None:  # an empty key is the daemon's to refuse, not ours to drop
                    step["key"] = args.key
                if args.timeout_ms is not None:
                    step["timeout_ms"] = args.timeout_ms
                _print(client.call("session/step", step))
            elif args.command == "snapshot":
                print(client.call("session/snapshot", {"session": args.session})["snapshot"])
            elif args.command == "restore":
                data = sys.stdin.read().strip() if args.snapshot == "-" else args.snapshot
                restore: dict[str, Any] = {"snapshot": data}
                if args.session:
                    restore["session"] = args.session
                print(client.call("session/restore", restore)["session"])
            elif args.command == "fork":
                print(client.fork(args.session, at=args.at, name=args.name))
            elif args.command == "pending":
                _print(client.call("session/pending", {"session": args.session}))
            elif args.command == "recover":
                print(client.call("session/recover", {"session": args.session})["session"])
            elif args.command == "close":
                client.call("session/close", {"session": args.session})
            elif args.command == "watch":
                watch: dict[str, Any] = {"session": args.session}
                if args.since is not None:
                    watch["since"] = args.since
                client.call("session/watch", watch)
                while True:
                    notice = client.wait_notification()
                    sys.stdout.buffer.write(
                        msgspec.json.encode({"method": notice.method, "params": notice.params}) + b"\n"
                    )
                    sys.stdout.flush()
                    if notice.method == "session/unwatched":
                        # The session closed (or expired): the watch is over, normally. Dropped for falling
                        # behind: exit 1, and watch again with --since to catch up.
                        return 0 if notice.params.get("reason") in ("closed", "expired") else 1
    except DevdError as e:
        print(f"devd: {e.kind}: {e}", file=sys.stderr)
        return 1
    except NotRunningError as e:
        print(f"devd: {e.strerror}", file=sys.stderr)
        return 3
    except (OSError, ConnectionError) as e:
        print(f"devd: cannot reach the daemon at {_address(args)}: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


def prometheus(status: dict[str, Any]) -> str:
    """daemon/status in the Prometheus text format."""
    lines = [
        "# TYPE devd_uptime_seconds gauge",
        f"devd_uptime_seconds {status['uptime_s']}",
        "# TYPE devd_sessions gauge",
        *(f'devd_sessions{{state="{state}"}} {n}' for state, n in sorted(status["sessions"].items())),
        "# TYPE devd_connections gauge",
        f"devd_connections {status['connections']}",
        "# TYPE devd_steps_total counter",
        f"devd_steps_total {status['steps']}",
        "# TYPE devd_durable_commits_total counter",
        f"devd_durable_commits_total {status['durable_writes']}",
        "# TYPE devd_deadline_hits_total counter",
        f"devd_deadline_hits_total {status['deadline_hits']}",
        "# TYPE devd_offloaded_total counter",
        f"devd_offloaded_total {status['offloaded']}",
        "# TYPE devd_errors_total counter",
        *(f'devd_errors_total{{kind="{kind}"}} {n}' for kind, n in sorted(status["errors"].items())),
        "# TYPE devd_commit_latency_ms gauge",
        f'devd_commit_latency_ms{{quantile="0.5"}} {status["commit_ms_p50"]}',
        f'devd_commit_latency_ms{{quantile="0.99"}} {status["commit_ms_p99"]}',
        "# TYPE devd_resident_memory_bytes gauge",
        f"devd_resident_memory_bytes {status['memory_rss_bytes']}",
    ]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="devd", description="A session daemon for agent tools.")
    p.add_argument("--version", action="version", version=f"devd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--socket", help="Unix socket path (default $XDG_RUNTIME_DIR/devd/devd.sock)")
    serve.add_argument("--listen", help="also listen on tcp://HOST:PORT (clients must present the token)")
    serve.add_argument("--state-dir", help="where sessions are kept (default $STATE_DIRECTORY or $XDG_STATE_HOME/devd)")
    serve.add_argument("--core", help="load this wasm module (ABI 1) instead of the packaged core")
    serve.add_argument(
        "--call-timeout", type=float, default=default("call_timeout_s"), help="default deadline of a call, in seconds"
    )
    serve.add_argument(
        "--max-call-timeout",
        type=float,
        default=default("max_call_timeout_s"),
        help="the longest deadline a client may ask for, in seconds (longer ones are cut to it)",
    )
    serve.add_argument(
        "--max-sessions", type=int, default=default("sessions_max"), help="sessions kept, live or stored"
    )
    serve.add_argument(
        "--max-live",
        type=int,
        default=default("max_live"),
        help="sessions held in memory; past it the least recently used idle one hibernates (to disk)",
    )
    serve.add_argument(
        "--live-memory",
        metavar="SIZE",
        help="the sessions in memory together may use this much (e.g. 4G); past it the least recently used idle "
        "ones hibernate. Default: no cap but --max-live (each session's own cap is 64 MiB)",
    )
    serve.add_argument(
        "--snapshot-floor",
        type=int,
        metavar="BYTES",
        default=default("snapshot_floor_bytes"),
        help="journal bytes since a session's last snapshot below which no new one is taken (a replay of that "
        "much is cheap); past it, one is taken once the journal outgrows half the last snapshot",
    )
    serve.add_argument(
        "--expire-after",
        metavar="DURATION",
        help="delete sessions no call has used for this long (e.g. 30d, 12h); default: keep them",
    )
    serve.add_argument("--max-connections", type=int, default=default("connections_max"))
    serve.add_argument("--max-line-bytes", type=int, default=default("line_bytes_max"))
    serve.add_argument(
        "--line-timeout",
        type=float,
        default=default("line_timeout_s"),
        help="seconds a request line may take to arrive",
    )
    serve.add_argument(
        "--send-timeout",
        type=float,
        default=default("send_timeout_s"),
        help="seconds a client may take no bytes while the daemon has some for it, before it is disconnected",
    )
    serve.add_argument("--log-format", choices=["json", "console"])
    serve.add_argument("--log-level", default=default("log_level"), choices=["debug", "info", "warning", "error"])

    schema = sub.add_parser("schema", help="print the JSON Schema of every message of the protocol")
    form = schema.add_mutually_exclusive_group()
    form.add_argument(
        "--openrpc", action="store_true", help="print an OpenRPC 1.3 document instead: methods, params and results"
    )
    form.add_argument(
        "--typescript", action="store_true", help="print the protocol's types as a TypeScript module instead"
    )

    def client(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("--connect", help="socket path or tcp://HOST:PORT (default: the daemon's default socket)")
        c.add_argument("--token", help="token for TCP")
        c.add_argument("--token-file", help="read the TCP token from this file")
        return c

    client("status", "show the daemon's status").add_argument("--prometheus", action="store_true")
    client("ls", "list sessions")
    new = client("new", "start a session and print its name")
    new.add_argument("--model")
    new.add_argument("--session", help="name it (default: chosen by the daemon)")
    step = client("step", "step a session with an event (JSON)")
    step.add_argument("session")
    step.add_argument("event")
    step.add_argument("--key", help="idempotency key")
    step.add_argument("--timeout-ms", type=int)
    watch = client("watch", "print every step of a session as it happens")
    watch.add_argument("session")
    watch.add_argument("--since", type=int)
    client("snapshot", "print a session's snapshot (base64)").add_argument("session")
    restore = client("restore", "start a session from a snapshot (base64, or - for stdin)")
    restore.add_argument("snapshot")
    restore.add_argument("--session")
    fork = client("fork", "start a session from another's history (up to step --at) and print its name")
    fork.add_argument("session")
    fork.add_argument("--at", type=int, help="the step to fork at (default: the session's latest)")
    fork.add_argument("--as", dest="name", help="name the fork (default: chosen by the daemon)")
    client("pending", "print the actions a session still waits for (JSON)").add_argument("session")
    client("recover", "bring an ended or poisoned session back from its durable state").add_argument("session")
    client("close", "end a session and delete its state").add_argument("session")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "schema":
        from devd.schema import openrpc_json, schema_json, typescript

        if args.typescript:
            sys.stdout.write(typescript())
        else:
            sys.stdout.buffer.write((openrpc_json() if args.openrpc else schema_json()) + b"\n")
        return 0
    return _run_client(args)
