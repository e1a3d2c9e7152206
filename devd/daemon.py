"""The daemon's lifecycle: wire the parts together, accept connections, and shut down gracefully.

What it promises:
- accepting survives running out of file descriptors (it backs off and retries);
- no connection can end the daemon: whatever happens in one is logged and the others go on;
- past `connections_max`, a new connection is answered FULL and closed;
- SIGTERM/SIGINT: stop taking calls (status still answers), finish calls in flight, send every answer given,
  commit, and return; a second signal meanwhile is absorbed.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.abc
import structlog

from devd import systemd
from devd.config import Settings
from devd.connection import Rules
from devd.dispatch import Dispatcher
from devd.errors import FullError
from devd.host import Core
from devd.listeners import peer_uid
from devd.methods import METHODS, App, Peer
from devd.offload import Runner
from devd.registry import Registry
from devd.rpc import encode_notice, error_response
from devd.store import Store
from devd.transport import Outbox, serve_stream
from devd.watchers import Fanout

log = structlog.get_logger("devd.daemon")

_ACCEPT_RETRY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}


def build(settings: Settings, core: Core, store: Store) -> tuple[Registry, Dispatcher]:
    """The parts of a daemon, wired: registry over core and store, dispatcher over the methods."""
    runner = Runner(core, inline_budget_s=settings.inline_budget_s, threads_max=settings.call_threads_max)
    registry = Registry(
        core,
        store,
        Fanout(encode_notice),
        sessions_max=settings.sessions_max,
        call_timeout_s=settings.call_timeout_s,
        runner=runner,
    )
    app = App(settings, registry, store, connections=lambda: 0)
    return registry, Dispatcher(METHODS, app)


class Daemon:
    def __init__(self, settings: Settings, dispatcher: Dispatcher, token: str | None) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.token = token
        self.connections = 0
        self._outboxes: set[Outbox] = set()
        dispatcher.app.connections = lambda: self.connections

    async def serve(self, listeners: list[tuple[socket.socket, str]], on_ready: Callable[[], None]) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully.

        The signal receiver stays open until everything is committed, so a second SIGTERM during the shutdown is
        absorbed rather than killing the process half-way.
        """
        store = self.dispatcher.app.store
        await self.dispatcher.app.registry.load()
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.run)
                with anyio.CancelScope() as accepting:
                    async with anyio.create_task_group() as conns:
                        for sock, transport in listeners:
                            conns.start_soon(self._accept_loop, sock, transport, conns)
                        conns.start_soon(self._until_signal, signals, accepting)
                        conns.start_soon(self._watchdog)
                        on_ready()
                        log.info(
                            "daemon.ready",
                            sessions=len(self.dispatcher.app.registry.list()),
                            listeners=[t for _, t in listeners],
                        )
                tg.cancel_scope.cancel()
            await store.flush()

    async def _until_signal(self, signals: AsyncIterator[int], accepting: anyio.CancelScope) -> None:
        async for signum in signals:
            log.info("daemon.stopping", signal=signal.Signals(signum).name, in_flight=self.dispatcher.in_flight)
            systemd.notify("STOPPING=1")
            self.dispatcher.draining = True
            grace = self.settings.shutdown_grace_s
            with anyio.move_on_after(grace):
                await self.dispatcher.idle()
                for outbox in list(self._outboxes):  # every answer given is also sent
                    await outbox.wait_sent(grace)
            accepting.cancel()
            return

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        registry = self.dispatcher.app.registry
        while True:
            systemd.notify(
                f"STATUS=sessions {sum(registry.counts().values())}, connections {self.connections}"
                + ("\nWATCHDOG=1" if interval else "")
            )
            await anyio.sleep(interval or 10.0)

    async def _accept_loop(self, sock: socket.socket, transport: str, tg: anyio.abc.TaskGroup) -> None:
        """Accept for ever; out of descriptors (or memory) backs off instead of dying, as asyncio's own loop does."""
        backoff = 0.0
        while True:
            await anyio.wait_readable(sock)
            try:
                client, _ = sock.accept()
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno not in _ACCEPT_RETRY:
                    raise
                backoff = min(max(backoff * 2, 0.01), 0.5)
                log.warning("accept.backoff", error=os.strerror(e.errno or 0), seconds=backoff)
                await anyio.sleep(backoff)
                continue
            backoff = 0.0
            tg.start_soon(self._connection, client, transport)

    async def _connection(self, client: socket.socket, transport: str) -> None:
        """One connection; whatever happens in it, the daemon goes on."""
        try:
            await self._serve_connection(client, transport)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the peer went away
        except Exception as e:
            log.error("connection.failed", transport=transport, error=f"{type(e).__name__}: {e}"[:500])
        finally:
            client.close()

    async def _serve_connection(self, client: socket.socket, transport: str) -> None:
        client.setblocking(False)
        if transport == "unix":
            uid = peer_uid(client)
            if uid not in (os.getuid(), 0):  # root can read the state directory anyway
                log.warning("connection.refused", reason="peer of another uid", uid=uid)
                return
            stream: anyio.abc.SocketStream = await anyio.abc.UNIXSocketStream.from_socket(client)
        else:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = await anyio.abc.SocketStream.from_socket(client)
        settings = self.settings
        async with stream:
            if self.connections >= settings.connections_max or self.dispatcher.draining:
                reason = (
                    "the daemon is shutting down"
                    if self.dispatcher.draining
                    else f"it serves {settings.connections_max} connections, its limit"
                )
                with anyio.move_on_after(1):
                    await stream.send(error_response(None, FullError(f"connection refused: {reason}; try again later")))
                return
            self.connections += 1
            outbox = Outbox(settings.outbox_bytes_soft, settings.outbox_bytes_hard)
            self._outboxes.add(outbox)
            peer = Peer(transport, outbox)
            rules = Rules(settings, authenticated=transport == "unix", token=self.token, now=time.monotonic())
            registry = self.dispatcher.app.registry

            def unwatch_all() -> None:
                for sub in peer.watches.values():
                    registry.unwatch(sub)
                peer.watches.clear()

            try:
                await serve_stream(stream, rules, self.dispatcher, peer, outbox, on_eof=unwatch_all)
            finally:
                self.connections -= 1
                self._outboxes.discard(outbox)
                unwatch_all()
