"""`devd serve`: the daemon in the foreground, its settings from flags and environment, its store, its listeners."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devd import __version__, log
from devd.addresses import TcpListen, UnixListen
from devd.cli.common import POSTGRES_SCHEMES
from devd.config import (
    Settings,
    backup_dir,
    default_live_memory,
    default_socket_path,
    default_state_dir,
)
from devd.errors import DevdError
from devd.server import systemd
from devd.server.listeners import ActivatedListen, Listen, bind

if TYPE_CHECKING:
    from devd.host import Core
    from devd.server.listeners import Listening
    from devd.storage.store import Fleet, Store

# The collector's thresholds once the daemon serves (Python's: 700, 10, 10); see `_settle_gc`.
GC_THRESHOLDS = (10_000, 20, 20)
# How long after the daemon is ready `_settle_gc` runs: its full collection (15 ms and more) held up the first answer
# when it ran at ready (`bench start`).
GC_SETTLE_AFTER_S = 1.0


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
    from devd.server.daemon import Daemon, build
    from devd.server.listeners import StartupError, lock_state_dir, prepare_state_dir, read_token

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
    listeners: list[Listening] = []
    try:
        settings = settings_from(args)
        prepare_state_dir(settings.state_dir)
        lock_state_dir(settings.state_dir, settings.socket_path)  # held (by its open descriptor) until exit
        prepare_state_dir(backup_dir(settings), "the backup directory", "--backup-dir")
        files.remove_partials(backup_dir(settings))  # a backup a killed daemon was writing
        core = _core(settings)
        activated = [ActivatedListen(sock, name) for sock, name in systemd.listen_sockets()]
        listeners = [bind(where) for where in activated or _asked(settings)]
        token = read_token(settings.state_dir) if any(bound.served.needs_token for bound in listeners) else None
        metrics_socket = None
        if settings.metrics:
            from devd.server import scrape  # h11 loaded only by a daemon that serves metrics

            metrics_socket = scrape.bind(settings.metrics)
        agents = _agents(args)
        if agents:
            _seal()  # its /proc/PID/environ holds the API keys: no agent's command may read it
        store, fleet = _open_store(args, settings, listeners)
    except (StartupError, ValueError, OSError, DevdError) as e:
        for bound in listeners:  # a socket made for a start that failed must not be left behind, stale
            bound.close()
        print(f"devd: cannot start: {e}", file=sys.stderr)
        return 2

    registry, dispatcher = build(settings, core, store, fleet=fleet, agents=agents, agents_file=_agents_path(args))
    daemon = Daemon(settings, registry, dispatcher, token)

    def ready() -> None:
        asyncio.get_running_loop().call_later(GC_SETTLE_AFTER_S, _settle_gc)
        systemd.notify(f"READY=1\nSTATUS=serving {sum(registry.counts().values())} sessions")
        logger.info(
            "daemon.listening",
            socket=next((str(b.listen.path) for b in listeners if isinstance(b.listen, UnixListen)), None),
            tcp=[f"{t.host}:{t.port}" for b in listeners if isinstance(t := b.served, TcpListen)] or None,
            metrics="{}:{}".format(*metrics_socket.getsockname()[:2]) if metrics_socket else None,
            activated=[a.name for a in activated] or None,
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
        for listening in listeners:
            listening.close()  # and the Unix socket it bound removed
        if metrics_socket is not None:
            metrics_socket.close()
    logger.info("daemon.stopped")
    return 0


def _seal() -> None:
    """Make the daemon non-dumpable: its /proc/PID files (environ with the API keys, mem, fd) become root's and need
    ptrace access, which an agent's command never has (it never runs as root, nor in an ancestor's user namespace).
    Under `sandbox = "none"` a command sees the daemon's /proc; under bubblewrap this is a second wall. What it
    trades: no core dump of the daemon, and a debugger (or a tool reading /proc/PID/fd) must be root; so only a
    daemon that runs agents does it. Its children are dumpable again once they exec."""
    import ctypes

    pr_set_dumpable = 4
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _asked(settings: Settings) -> list[Listen]:
    """Where the flags say to listen, when systemd passed no sockets: the Unix socket, and TCP with --listen."""
    assert settings.socket_path is not None
    return [UnixListen(settings.socket_path), *([settings.tcp] if settings.tcp else [])]


def _agents(args: argparse.Namespace) -> dict[str, Any]:
    """The agent profiles of --agents (default: agents.toml where `default_agents_path` finds one; none there: no
    agents); ConfigError (FILE:LINE: what is wrong) for a bad file."""
    path = _agents_path(args)
    if path is None:
        return {}
    from devd.agent.profiles import load_profiles  # its parser and policy's regexes: only with an agents file

    return dict(load_profiles(path))


def _agents_path(args: argparse.Namespace) -> Path | None:
    from devd.agent.profiles import default_agents_path

    return Path(args.agents) if args.agents else default_agents_path(os.environ)


def _core(settings: Settings) -> Core:
    """The core, compiled (or loaded from the state directory's cache); a --core that cannot be read or compiled is
    refused saying which file and what to pass instead."""
    from devd.host import Core
    from devd.server.listeners import StartupError

    try:
        return Core.open(
            settings.core_path,
            call_timeout=settings.call_timeout_s,
            memory_bytes=settings.memory_bytes_per_session,
            cache_dir=settings.state_dir / "cache",
        )
    except (OSError, DevdError) as e:
        if settings.core_path is None:
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise StartupError(
            f"the core {settings.core_path} (--core) cannot be loaded: {why}; pass a wasm module built from core/ "
            "(ABI 2), or leave --core out for the packaged one"
        ) from None


def _open_store(args: argparse.Namespace, settings: Settings, listeners: list[Listening]) -> tuple[Store, Fleet | None]:
    """The store --store names (default: the state directory's SQLite file), and the fleet when it is shared."""
    spec = args.store or f"sqlite:{settings.state_dir / 'devd.sqlite3'}"
    if spec.startswith(POSTGRES_SCHEMES):
        from devd.storage.postgres import PostgresStore

        store = PostgresStore(
            spec,
            keys_kept=settings.keys_kept_per_session,
            steps_kept=settings.steps_kept_per_session,
            prune_every_steps=settings.prune_every_steps,
            node=args.node,
            advertise=args.advertise or str(listeners[0].served),  # its first listener, as a client addresses it
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


def _settle_gc() -> None:
    """Once the daemon serves: what it made to start (modules, the core, the registry) is kept out of every later
    collection, and collections run less often. With the defaults, 300 agent sessions streaming at once ran ~530
    collections in 12 s, 0.6 s of the event loop, the full ones 80-118 ms each (every streamed fragment waiting
    meanwhile); frozen and with these thresholds, 35 collections, 0.18 s, the longest 39 ms. Garbage is still freed:
    most of it by reference counts, cycles by the collections that remain."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _backend_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
