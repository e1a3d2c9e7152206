"""The daemon's lifecycle: wire the parts together, accept connections, and shut down gracefully.

What it promises:
- accepting survives running out of file descriptors (asyncio's accept loop backs off and retries);
- no connection can end the daemon: whatever happens in one is logged and the others go on;
- past `connections_max` (counted for Unix and TCP apart, so TCP can never starve the Unix socket), a new connection
  is answered FULL and closed;
- with a metrics socket (`--metrics`), `GET /metrics` answers from the same status as `daemon/status`, from accept
  until the daemon returns, apart from the JSON-RPC listeners (`devd.server.metrics`);
- SIGTERM/SIGINT: stop taking calls (status still answers), let calls in flight finish for `shutdown_grace_s`, then
  stop the rest where they stand (they end as DEADLINE, durably); snapshot the live sessions with steps since their
  last snapshot (when nothing had to be stopped), so the next start replays none; give a fleet's sessions back (so
  other daemons take them at once), send every answer given, commit, and return; a second signal meanwhile is
  absorbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import anyio
import msgspec
import structlog

from devd.addresses import UnixListen
from devd.agent.port import ObservedFanout, RegistryPort
from devd.agent.profiles import Profile
from devd.agent.runner import Runtime
from devd.agent.wire import AgentPort
from devd.config import Settings, backup_dir, configuration_dirs
from devd.host import Core
from devd.server import metrics, systemd
from devd.server.dispatch import Dispatcher
from devd.server.hub import Hub
from devd.server.listeners import BACKLOG, Listening
from devd.server.methods import METHODS, App, Method, status
from devd.server.ndjson import Connection
from devd.server.rpc import encode_notice, notification
from devd.sessions.calls import Runner
from devd.sessions.registry import Registry
from devd.storage.sqlite import SQLiteStore
from devd.storage.store import Fleet, Store

FLEET_CHECK_S = 0.5  # how often a fleet daemon looks for watched sessions it may have lost
SHUTDOWN_SNAPSHOTS_S = 5.0  # of a stop's time (systemd waits 20 s) spent snapshotting sessions; the rest replay
log = structlog.get_logger("devd.server.daemon")


def build(
    settings: Settings,
    core: Core,
    store: Store,
    *,
    methods: Mapping[str, Method] = METHODS,
    fleet: Fleet | None = None,
    agents: Mapping[str, Profile] | None = None,
    agents_file: Path | None = None,
) -> tuple[Registry, Dispatcher]:
    """The parts of a daemon, wired: registry over core and store (and the fleet, when the store is shared with
    other daemons), dispatcher over the methods, and the agent runtime with the agent profiles given (none: sessions
    of an agent are refused; `agents_file`, where they were read, one of the daemon's private paths), a second client
    of the sessions beside the wire."""
    runner = Runner(
        core,
        inline_budget_s=settings.inline_budget_s,
        threads_max=settings.call_threads_max,
        quick_threads_max=settings.quick_threads_max,
    )
    registry = Registry(
        core,
        store,
        ObservedFanout(encode_notice, notify=notification),
        sessions_max=settings.sessions_max,
        max_live=settings.max_live,
        call_timeout_s=settings.call_timeout_s,
        max_call_timeout_s=settings.max_call_timeout_s,
        runner=runner,
        snapshot_floor_bytes=settings.snapshot_floor_bytes,
        live_memory_bytes=settings.live_memory_bytes,
        fleet=fleet,
    )
    private = private_paths(settings, store, agents_file)
    runtime = Runtime(agents or {}, RegistryPort(registry, store), os.environ, private)
    if settings.otel_endpoint is not None:
        from devd.agent.otel import Exporter  # imported only when asked for: the SDK takes a while to load

        runtime.oversight.spans = Exporter(settings.otel_endpoint)
    port = AgentPort(registry, runtime)  # the wire's handlers call the sessions through the runtime's port
    app = App(settings, port, store, connections=lambda: 0, beside=port)
    return registry, Dispatcher(methods, app)


def private_paths(settings: Settings, store: Store, agents_file: Path | None = None) -> list[Path]:
    """What only the daemon may reach: its state directory (the token, the database, the lock), its backups, its
    socket, a SQLite store kept elsewhere (the directory given to it), its configuration directory (the agents
    file, and the environment file with the API keys the systemd units read), and its agents file wherever it is (a
    command that rewrote it would choose its own rules from the next start). Hidden from the commands it runs, never
    read or written by Read and Write, and no session's workspace may be inside one or hold one."""
    paths = [settings.state_dir, backup_dir(settings), *configuration_dirs(os.environ)]
    if settings.socket_path is not None:
        paths.append(settings.socket_path)
    if isinstance(store, SQLiteStore):
        paths.append(store.path.parent)
    if agents_file is not None:
        paths.append(agents_file)
    return paths


class Daemon:
    def __init__(self, settings: Settings, registry: Registry, dispatcher: Dispatcher, token: str | None) -> None:
        self.settings = settings
        self.registry = registry  # the daemon's own jobs on the sessions (load, expiry, shutdown); handlers use a port
        self.dispatcher = dispatcher
        self.token = token
        self.hub: Hub | None = None
        dispatcher.app.connections = lambda: len(self.hub.connections) if self.hub else 0

    async def serve(
        self,
        listeners: list[Listening],
        on_ready: Callable[[], None],
        metrics_socket: socket.socket | None = None,
        stops: AsyncIterator[int] | None = None,
    ) -> None:
        """Serve until SIGTERM/SIGINT (or until `stops` yields a signal number: a daemon not on the main thread, in a
        test), then shut down gracefully; serve `GET /metrics` on metrics_socket, if any, until the end.

        The signal receiver stays open until everything is committed, so a second SIGTERM during the shutdown is
        absorbed rather than killing the process half-way.
        """
        app = self.dispatcher.app
        if self.registry.fleet is not None:
            await self.registry.fleet.connect()
        await self.registry.load()
        with _stop_requests(stops) as signals:
            # The store outlives everything that writes to it: a step the agent runtime makes as it stops (shielded:
            # a turn cut short) is committed before the commit thread ends, instead of waiting for a commit that
            # would only come once this group had ended.
            async with anyio.create_task_group() as kept:
                kept.start_soon(app.store.run)
                async with anyio.create_task_group() as tg:
                    if app.beside is not None:
                        await tg.start(app.beside.run)
                    tg.start_soon(self._watchdog)
                    if self.settings.expire_after_s is not None:
                        tg.start_soon(self._expire, self.settings.expire_after_s)
                    if self.registry.fleet is not None:
                        tg.start_soon(self._check_holds)
                    self.hub = Hub(self.settings, self.dispatcher, self.token)
                    servers = [await _listen(self.hub, listening) for listening in listeners]
                    if metrics_socket is not None:
                        # In the task group, so the group's cancel at the end stops it; started before ready.
                        from devd.server import scrape  # h11 loaded only by a daemon that serves metrics

                        await tg.start(scrape.serve, metrics_socket, self._exposition, self.settings)
                    on_ready()
                    sessions = sum(self.registry.counts().values())
                    log.info(
                        "daemon.ready", sessions=sessions, listeners=[listening.served.kind for listening in listeners]
                    )
                    await self._until_signal(signals, servers)
                    if app.beside is not None:
                        app.beside.stop()  # nothing new starts while calls drain; an effect cut short is found claimed
                    if running := self.hub.running:
                        # The grace is over: calls still running end now, as DEADLINE, and are recorded as such.
                        log.warning("daemon.interrupting", calls=len(running))
                        longest = max(self.settings.max_call_timeout_s, self.settings.call_timeout_s)
                        self.registry.core.interrupt_all(longest)
                    await self.hub.drain()
                    if not running:  # after an interrupt every call ends as DEADLINE: no snapshot could be taken
                        await self._snapshot_all()
                    if self.registry.fleet is not None:
                        await self._release()
                    await self._close_connections()
                    tg.cancel_scope.cancel()
                kept.cancel_scope.cancel()
            await app.store.flush()
            if app.beside is not None:
                await app.beside.flush()  # the spans still queued are sent

    def _exposition(self) -> str:
        """The metrics, from daemon/status's answer exactly as a client decodes it."""
        return metrics.prometheus(msgspec.json.decode(msgspec.json.encode(status(self.dispatcher.app))))

    async def _until_signal(self, signals: AsyncIterator[int], servers: list[asyncio.Server]) -> None:
        """Wait for SIGTERM/SIGINT; then stop accepting and give calls in flight the grace to finish."""
        async for signum in signals:
            assert self.hub is not None
            log.info("daemon.stopping", signal=signal.Signals(signum).name, in_flight=len(self.hub.running))
            systemd.notify("STOPPING=1")
            self.dispatcher.draining = True
            for server in servers:
                server.close()
            with anyio.move_on_after(self.settings.shutdown_grace_s):
                await self.hub.drain()
            return

    async def _snapshot_all(self) -> None:
        """Snapshot the live sessions with steps since their last snapshot, for as long as the grace allows, so the
        next start resumes each without replaying them (a restart for an upgrade costs no replay)."""
        try:
            with anyio.move_on_after(SHUTDOWN_SNAPSHOTS_S) as scope:
                taken = await self.registry.save_all()
                log.info("daemon.snapshots_taken", sessions=taken)
        except Exception as e:  # only a cache: the stop goes on (every step was durable before it was answered)
            log.error("daemon.snapshots_failed", error=f"{type(e).__name__}: {e}"[:500])
            return
        if scope.cancelled_caught:
            log.warning("daemon.snapshots_cut_short", after_s=SHUTDOWN_SNAPSHOTS_S)

    async def _release(self) -> None:
        """Give the fleet back every session, now that no call runs, so other daemons take them at once rather than
        after this one's lease ends. A failure only costs them that wait."""
        try:
            with anyio.fail_after(self.settings.shutdown_grace_s):
                await self.registry.drain()
                assert self.registry.fleet is not None
                await self.registry.fleet.release_all()  # and any session a write took without the registry knowing
        except Exception as e:
            log.error("fleet.release_failed", error=f"{type(e).__name__}: {e}"[:500])

    async def _close_connections(self) -> None:
        """Send every answer given, then close every connection: wait while some connection still has bytes to send
        and is taking them (a client that has taken nothing for a second is not waited for: it may be a watcher that
        never reads), for as long as the grace allows."""
        assert self.hub is not None
        stalled_after_s = 1.0
        flows = self.hub.outboxes.flows
        progress = {f: (f.unsent_bytes, time.monotonic()) for f in flows}
        with anyio.move_on_after(self.settings.shutdown_grace_s):
            while progress:
                await anyio.sleep(0.01)
                now = time.monotonic()
                for flow, (before, since) in list(progress.items()):
                    unsent = flow.unsent_bytes
                    if not unsent or (unsent >= before and now - since > stalled_after_s):
                        del progress[flow]
                    elif unsent < before:
                        progress[flow] = (unsent, now)
        for flow in list(flows):
            flow.transport.close()

    async def _expire(self, unused_for_s: float) -> None:
        """Delete sessions unused for longer than the daemon keeps them, checking a few times per that period."""
        beside = self.dispatcher.app.beside
        in_use = beside.in_use if beside is not None else lambda _: False
        while True:
            await anyio.sleep(min(max(unused_for_s / 10, 0.1), 60.0))
            if self.dispatcher.draining:
                continue
            try:
                await self.registry.expire(unused_for_s, in_use)
            except Exception as e:  # a failed round (the store refused a delete) must not end the daemon
                log.error("sessions.expiry_failed", error=f"{type(e).__name__}: {e}"[:500])

    async def _check_holds(self) -> None:
        """In a fleet, find the watched sessions this daemon may have lost while its lease lapsed, so that their
        watchers hear of it."""
        while True:
            await anyio.sleep(FLEET_CHECK_S)
            try:
                await self.registry.fleet_sessions.check_holds()
            except Exception as e:  # a failed round (the database is away) must not end the daemon
                log.error("fleet.check_failed", error=f"{type(e).__name__}: {e}"[:500])

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        while True:
            connections = len(self.hub.connections) if self.hub else 0
            systemd.notify(
                f"STATUS=sessions {sum(self.registry.counts().values())}, connections {connections}"
                + ("\nWATCHDOG=1" if interval else "")
            )
            await anyio.sleep(interval or 10.0)


@contextlib.contextmanager
def _stop_requests(stops: AsyncIterator[int] | None) -> Iterator[AsyncIterator[int]]:
    if stops is not None:
        yield stops
        return
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        yield signals


async def _listen(hub: Hub, listening: Listening) -> asyncio.Server:
    """Accept on the listener; asyncio's accept loop backs off when out of descriptors (or memory) instead of dying."""
    loop = asyncio.get_running_loop()
    served, sock = listening.served, listening.sock
    if isinstance(served, UnixListen):
        return await loop.create_unix_server(lambda: Connection(hub, served), sock=sock, backlog=BACKLOG)
    return await loop.create_server(lambda: Connection(hub, served), sock=sock, backlog=BACKLOG)
