"""The real daemon in this process, for the tests that do not need a process of its own.

The daemon is wired exactly as `devd serve` wires it (the same flags, parsed by the same parser, the same state
directory checks and lock, a real SQLite file, a real Unix socket), and it serves on an event loop of its own, on a
thread of the test process; a stop is the daemon's own graceful shutdown, asked for as SIGTERM would ask for it.
What it saves is the interpreter's start and the core's compile for each daemon: the compiled core is shared by
every in-process daemon of the run.

Settings that `devd serve` has no flag for (the shutdown grace, the authentication deadline) can be given as
`settings=`: a test of a timeout waits a fraction of a second, not the production default.

A test that kills the daemon, reads its log, passes it file descriptors, or arms failure points needs a process:
`tests.daemon.Daemon`, whose interface this one shares (start, stop, client, socket, state).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import msgspec

from devd import files
from devd.addresses import UnixListen
from devd.cli import parse_args
from devd.cli.serve import _agents, _backend_options, _open_store, settings_from
from devd.client import Client
from devd.config import Settings, backup_dir
from devd.host import Core
from devd.server.daemon import Daemon, build
from devd.server.dispatch import Dispatcher
from devd.server.listeners import bind, lock_state_dir, prepare_state_dir, read_token

START_TIMEOUT_S = 20.0
_cores: dict[tuple[Path | None, float, int], Core] = {}
T = TypeVar("T")


def _core(settings: Settings) -> Core:
    """One compiled core per configuration for the whole run (a compile is most of a daemon's start)."""
    key = (settings.core_path, settings.call_timeout_s, settings.memory_bytes_per_session)
    if key not in _cores:
        _cores[key] = Core.open(
            settings.core_path, call_timeout=settings.call_timeout_s, memory_bytes=settings.memory_bytes_per_session
        )
    return _cores[key]


class InProcess:
    def __init__(self, root: Path, *args: str, settings: dict[str, Any] | None = None) -> None:
        self.root = root
        self.state = root / "state"
        self.socket = root / "run" / "devd.sock"
        self.args = args
        self.settings = settings or {}  # Settings fields over what the flags give
        self._running: _Running | None = None

    def start(self) -> InProcess:
        assert self._running is None, "the daemon is running already"
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        argv = ["serve", "--socket", str(self.socket), "--state-dir", str(self.state), *self.args]
        self._running = _Running(parse_args(argv, os.environ), self.settings)
        return self

    def client(self) -> Client:
        return Client.connect(self.socket, timeout=30)

    def on_loop(self, read: Callable[[Dispatcher], T]) -> T:
        """read(the daemon's dispatcher), called on the daemon's event loop: what a test reads of its state."""
        assert self._running is not None, "the daemon is not running"
        dispatcher = self._running.dispatcher
        return self._running.portal.call(lambda: read(dispatcher))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Stop the daemon as `sig` would (SIGTERM or SIGINT: its graceful shutdown); 0, as the process exits."""
        assert self._running is not None, "the daemon is not running"
        running, self._running = self._running, None
        running.stop(sig, timeout)
        return 0

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Ask for a stop as `sig` would, without waiting for it (a process's send_signal); `wait` then ends it."""
        assert self._running is not None, "the daemon is not running"
        self._running.signal(sig)

    def wait(self, timeout: float = 20.0) -> int:
        """Wait for a stop asked for by `signal`; 0, as the process exits."""
        assert self._running is not None, "the daemon is not running"
        running, self._running = self._running, None
        running.wait(timeout)
        return 0

    def __enter__(self) -> InProcess:
        if self._running is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._running is not None:
            self.stop()


class _Running:
    """One life of an in-process daemon, from its start to its stop."""

    def __init__(self, args: Any, overrides: dict[str, Any]) -> None:
        self._opened = contextlib.ExitStack()  # what this life opened, closed in reverse at its end
        try:
            self._start(args, overrides, self._opened)
        except BaseException:
            self._opened.close()
            raise

    def _start(self, args: Any, overrides: dict[str, Any], opened: contextlib.ExitStack) -> None:
        settings = msgspec.structs.replace(settings_from(args), **overrides)
        prepare_state_dir(settings.state_dir)
        prepare_state_dir(backup_dir(settings), "the backup directory", "--backup-dir")
        files.remove_partials(backup_dir(settings))  # as devd serve does: a backup a killed daemon was writing
        opened.callback(os.close, lock_state_dir(settings.state_dir, settings.socket_path))
        assert settings.socket_path is not None
        unix = bind(UnixListen(settings.socket_path))
        opened.callback(unix.close)  # and the socket removed
        listeners = [unix]
        if settings.tcp:
            tcp = bind(settings.tcp)
            opened.callback(tcp.close)
            listeners.append(tcp)
        token = read_token(settings.state_dir) if settings.tcp else None
        store, fleet = _open_store(args, settings, listeners)
        opened.callback(store.close)
        registry, dispatcher = build(settings, _core(settings), store, fleet=fleet, agents=_agents(args))
        opened.callback(registry.close_all)
        portal = opened.enter_context(anyio.from_thread.start_blocking_portal("asyncio", _backend_options()))
        self.stops, receive = portal.call(lambda: anyio.create_memory_object_stream[int](1))
        opened.callback(receive.close)
        opened.callback(self.stops.close)
        ready = threading.Event()
        daemon = Daemon(settings, registry, dispatcher, token)
        self.portal = portal
        self.dispatcher = dispatcher
        self.served: Future[None] = portal.start_task_soon(daemon.serve, listeners, ready.set, None, receive)
        opened.callback(self._cancel_if_running)  # before the portal's end, which waits for its tasks
        self.served.add_done_callback(lambda _: ready.set())
        if not ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the in-process daemon was not ready within {START_TIMEOUT_S}s")
        if self.served.done():
            self.served.result(0)  # the daemon's own error: it failed to start
            raise RuntimeError("the in-process daemon returned before it was ready")

    def _cancel_if_running(self) -> None:
        if not self.served.done():
            self.served.cancel()  # a stop that timed out: the daemon's task is cancelled where it stands

    def stop(self, sig: int, timeout: float) -> None:
        try:
            self.signal(sig)
            self.served.result(timeout)
        finally:
            self._opened.close()

    def signal(self, sig: int) -> None:
        self.portal.call(self.stops.send_nowait, sig)

    def wait(self, timeout: float) -> None:
        try:
            self.served.result(timeout)
        finally:
            self._opened.close()
