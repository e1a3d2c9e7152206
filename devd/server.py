"""The daemon's sockets: listeners, one task per connection, the methods, and graceful shutdown. The only socket code.

What it promises:
- the Unix socket is 0600 in a 0700 directory and refuses peers of another uid but root (SO_PEERCRED), whatever
  its mode;
- a TCP connection answers nothing until it has presented the state directory's token (compared in constant time),
  and a connection that opens like an HTTP request is closed without acting;
- accepting survives running out of file descriptors (it backs off and retries);
- a bad line gets its JSON-RPC error and leaves the connection usable; an over-long line answers TOO_LARGE once;
- a line that does not arrive whole within `line_timeout_s` closes its connection (slowloris), and a client that
  stops reading is cut off after `send_timeout_s`, and a watcher that falls behind is dropped, so
  neither can hold up anyone else;
- SIGTERM/SIGINT: stop accepting, finish calls in flight, commit, remove the socket, exit 0.
"""

from __future__ import annotations

import errno
import hmac
import math
import os
import secrets
import signal
import socket
import stat
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from devd import ABI, __version__, systemd
from devd.config import Settings
from devd.errors import BusyError, DevdError, FullError, InternalError, UnauthorizedError
from devd.host import Core
from devd.rpc import (
    TOO_LONG,
    Empty,
    InitializeParams,
    InitializeResult,
    Limits,
    LineFramer,
    ListResult,
    NewParams,
    Request,
    RequestError,
    RestoreParams,
    Server,
    SessionParams,
    SessionResult,
    SnapshotResult,
    StatusResult,
    StepParams,
    StepResult,
    WatchParams,
    decode_params,
    decode_request,
    error_response,
    response,
    too_large,
)
from devd.sessions import Sessions, Watcher
from devd.store import KEYS_KEPT, Store

log = structlog.get_logger("devd.server")

_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
_ACCEPT_RETRY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
RECEIVE_BYTES = 65536
REQUESTS_IN_FLIGHT_MAX = 64  # per connection


class StartupError(Exception):
    """The daemon cannot start as configured; the message says why and what to change."""


# -- the state directory, the token and the sockets ----------------------------------------------------------------


def prepare_state_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode
    if mode & 0o022:
        raise StartupError(
            f"the state directory {path} is writable by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"run `chmod go-w {path}` (0700 is best) and start again"
        )


def read_token(state_dir: Path) -> str:
    """The TCP token, created 0600 on first use; a token file others can read is refused."""
    path = state_dir / "token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise StartupError(
                f"the token file {path} is readable by others (mode {mode:04o}); run `chmod 600 {path}` or delete it"
            ) from None
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at path: its directory made 0700 before binding, the socket 0600 from birth."""
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # made 0700 before binding when it is ours to make
    st = parent.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        # Anyone could replace the socket with their own: refuse, as git's credential-cache daemon does.
        raise StartupError(
            f"the socket directory {parent} is writable by anyone (mode {mode:04o}); "
            "pass a --socket in a directory of your own (0700 is best)"
        )
    if st.st_uid != os.getuid() or mode & 0o077:
        # The socket is 0600 and peers are checked by uid, so this is safe, but not what was asked for.
        log.warning("socket.directory_open", directory=str(parent), mode=f"{mode:04o}", owner=st.st_uid)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise StartupError(f"another daemon is listening on {path}; stop it or pass another --socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # a stale socket from a daemon that died
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


# -- one connection's output -----------------------------------------------------------------------------------------


class Outbox:
    """What a connection has yet to send. Replies wait for room; notifications are refused when it is full."""

    def __init__(self, soft_bytes: int, hard_bytes: int) -> None:
        self._items: deque[bytes] = deque()
        self._bytes = 0
        self._soft = soft_bytes
        self._hard = hard_bytes
        self._ready = anyio.Event()
        self._room = anyio.Event()
        self._sending = False

    def offer(self, data: bytes) -> bool:
        if self._bytes + len(data) > self._soft:
            return False
        self.force(data)
        return True

    def force(self, data: bytes) -> None:
        self._items.append(data)
        self._bytes += len(data)
        self._ready.set()

    async def put(self, data: bytes) -> None:
        while self._bytes > self._hard:
            await self._room.wait()
        self.force(data)

    async def wait_sent(self, timeout_s: float) -> None:
        """Return once everything queued has been handed to the socket (or timeout_s passed)."""
        with anyio.move_on_after(timeout_s):
            while self._items or self._sending:
                await self._room.wait()

    async def drain_to(self, stream: anyio.abc.ByteSendStream, send_timeout_s: float) -> None:
        """Send for ever; a client that takes nothing for send_timeout_s raises TimeoutError."""
        while True:
            if not self._items:
                self._ready = anyio.Event()
                await self._ready.wait()
            chunk = b"".join(self._items)
            self._items.clear()
            self._bytes = 0
            self._sending = True
            try:
                with anyio.fail_after(send_timeout_s):
                    await stream.send(chunk)
            finally:
                self._sending = False
                room, self._room = self._room, anyio.Event()
                room.set()


class Connection:
    def __init__(self, daemon: Daemon, outbox: Outbox, transport: str) -> None:
        self.daemon = daemon
        self.outbox = outbox
        self.transport = transport
        self.authenticated = transport == "unix"
        self.limiter = anyio.Semaphore(REQUESTS_IN_FLIGHT_MAX)
        self.watchers: dict[str, Watcher] = {}


# -- the daemon ------------------------------------------------------------------------------------------------------


class Daemon:
    def __init__(self, settings: Settings, core: Core, store: Store, token: str | None) -> None:
        self.settings = settings
        self.core = core
        self.store = store
        self.token = token
        self.sessions = Sessions(core, store, sessions_max=settings.sessions_max, call_timeout=settings.call_timeout_s)
        self.started = time.monotonic()
        self.connections = 0
        self.in_flight = 0
        self.draining = False
        self._idle = anyio.Event()
        self._outboxes: set[Outbox] = set()
        self._methods: dict[str, Callable[[Connection, Any], Awaitable[msgspec.Struct]]] = {
            "initialize": self._initialize,
            "session/new": self._new,
            "session/step": self._step,
            "session/snapshot": self._snapshot,
            "session/restore": self._restore,
            "session/recover": self._recover,
            "session/close": self._close,
            "session/list": self._list,
            "session/watch": self._watch,
            "session/unwatch": self._unwatch,
            "daemon/status": self._status,
        }

    # -- running ------------------------------------------------------------------------------------------------

    async def serve(self, listeners: list[tuple[socket.socket, str]], on_ready: Callable[[], None]) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully.

        The signal receiver stays open until everything is committed, so a second SIGTERM during the shutdown is
        absorbed rather than killing the process half-way.
        """
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.store.run)
                with anyio.CancelScope() as accepting:
                    async with anyio.create_task_group() as conns:
                        for sock, transport in listeners:
                            conns.start_soon(self._accept_loop, sock, transport, conns)
                        conns.start_soon(self._until_signal, signals, accepting)
                        conns.start_soon(self._watchdog)
                        on_ready()
                        log.info(
                            "daemon.ready", sessions=len(self.sessions.list()), listeners=[t for _, t in listeners]
                        )
                tg.cancel_scope.cancel()
            await self.store.flush()

    async def _until_signal(self, signals: AsyncIterator[int], accepting: anyio.CancelScope) -> None:
        async for signum in signals:
            log.info("daemon.stopping", signal=signal.Signals(signum).name, in_flight=self.in_flight)
            systemd.notify("STOPPING=1")
            self.draining = True
            with anyio.move_on_after(self.settings.shutdown_grace_s):
                while self.in_flight:
                    self._idle = anyio.Event()
                    await self._idle.wait()
                for outbox in list(self._outboxes):  # every answer given is also sent
                    await outbox.wait_sent(self.settings.shutdown_grace_s)
            accepting.cancel()
            return

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        while True:
            systemd.notify(
                f"STATUS=sessions {sum(self.sessions.counts().values())}, connections {self.connections}"
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
        except Exception:
            log.exception("connection.failed", transport=transport)
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
            if self.connections >= settings.connections_max or self.draining:
                reason = (
                    "the daemon is shutting down"
                    if self.draining
                    else f"it serves {settings.connections_max} connections, its limit"
                )
                with anyio.move_on_after(1):
                    await stream.send(error_response(None, FullError(f"connection refused: {reason}; try again later")))
                return
            self.connections += 1
            outbox = Outbox(settings.outbox_bytes_soft, settings.outbox_bytes_hard)
            self._outboxes.add(outbox)
            conn = Connection(self, outbox, transport)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._send_loop, outbox, stream, tg.cancel_scope)
                    await self._receive_loop(conn, stream, tg)
                    self._unwatch_all(conn)
                    # The peer closed its side: answer what it asked before it did, then close ours.
                    with anyio.move_on_after(settings.send_timeout_s):
                        for _ in range(REQUESTS_IN_FLIGHT_MAX):
                            await conn.limiter.acquire()
                        await outbox.wait_sent(settings.send_timeout_s)
                    tg.cancel_scope.cancel()
            finally:
                self.connections -= 1
                self._outboxes.discard(outbox)
                self._unwatch_all(conn)

    def _unwatch_all(self, conn: Connection) -> None:
        for name, watcher in conn.watchers.items():
            self.sessions.unwatch(name, watcher)
        conn.watchers.clear()

    async def _send_loop(self, outbox: Outbox, stream: anyio.abc.ByteSendStream, scope: anyio.CancelScope) -> None:
        try:
            await outbox.drain_to(stream, self.settings.send_timeout_s)
        except TimeoutError:
            log.warning("connection.dropped", reason="the client stopped reading")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    async def _receive_loop(
        self, conn: Connection, stream: anyio.abc.ByteReceiveStream, tg: anyio.abc.TaskGroup
    ) -> None:
        settings = self.settings
        limiter = conn.limiter
        framer = LineFramer(settings.line_bytes_max if conn.authenticated else settings.auth_line_bytes_max)
        first = True
        line_started = 0.0  # when the partial line in the framer began; a line must arrive whole within a bound
        while True:
            if not conn.authenticated:
                bound = settings.auth_timeout_s
            elif framer.pending_bytes:
                bound = line_started + settings.line_timeout_s - time.monotonic()
            else:
                bound = math.inf
            try:
                if bound == math.inf:  # idle between lines: no timer to arm (a cancel scope per read costs ~5%)
                    data = await stream.receive(RECEIVE_BYTES)
                else:
                    with anyio.fail_after(bound):
                        data = await stream.receive(RECEIVE_BYTES)
            except TimeoutError:
                log.warning("connection.dropped", reason="a line did not arrive whole in time")
                return
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            if not framer.pending_bytes or b"\n" in data:
                line_started = time.monotonic()  # whatever is left partial after this chunk began in it
            if first:
                first = False
                if data.lstrip().startswith(_HTTP_METHODS):
                    log.warning("connection.refused", reason="an HTTP request on the JSON-RPC socket")
                    return
            for line in framer.feed(data):
                if line is TOO_LONG:
                    if not conn.authenticated:
                        return
                    await conn.outbox.put(too_large(framer.line_bytes_max))
                    continue
                assert isinstance(line, bytes)
                if not line.strip():
                    continue
                if not conn.authenticated:
                    if not await self._authenticate(conn, line):
                        return
                    framer.line_bytes_max = settings.line_bytes_max
                    continue
                await limiter.acquire()
                tg.start_soon(self._dispatch, conn, line, limiter)

    async def _authenticate(self, conn: Connection, line: bytes) -> bool:
        """The first request on TCP must be initialize with the token; anything else closes the connection."""
        try:
            request = decode_request(line)
            params = decode_params(request) if request.method == "initialize" else None
        except (RequestError, DevdError):
            params, request = None, None
        token = params.token if isinstance(params, InitializeParams) else None
        if (
            request is None
            or token is None
            or self.token is None
            or not hmac.compare_digest(token.encode(), self.token.encode())
        ):
            log.warning("connection.unauthorized", transport=conn.transport)
            if request is not None and not request.notification:
                await conn.outbox.put(
                    error_response(
                        request.id,
                        UnauthorizedError(
                            "this connection must first call initialize with the token from the daemon's state "
                            "directory (file `token`)"
                        ),
                    )
                )
                with anyio.move_on_after(1):
                    while conn.outbox._items:
                        await anyio.sleep(0.01)
            return False
        conn.authenticated = True
        if not request.notification:
            await conn.outbox.put(response(request.id, self._initialize_result()))
        return True

    async def _dispatch(self, conn: Connection, line: bytes, limiter: anyio.Semaphore) -> None:
        started = time.perf_counter()
        self.in_flight += 1
        request: Request | None = None
        params: Any = None
        outcome = "ok"
        try:
            request = decode_request(line)
            params = decode_params(request)
            if self.draining and request.method != "daemon/status":
                raise BusyError("the daemon is shutting down; retry against the next one")
            # A call runs to its end even if its client goes: it is bounded by its deadline and a commit, and
            # stopping it between the core and the journal would leave the two apart.
            with anyio.CancelScope(shield=True):
                result = await self._methods[request.method](conn, params)
            reply = response(request.id, result)
        except RequestError as e:
            outcome = e.error.kind
            reply = b"" if e.notification else error_response(e.id, e.error)
        except DevdError as e:
            outcome = e.kind
            reply = error_response(request.id if request else None, e)
        except Exception:
            outcome = "INTERNAL"
            log.exception("request.failed", method=request.method if request else None)
            reply = error_response(
                request.id if request else None, InternalError("the daemon failed to answer; see its log")
            )
        if outcome != "ok":
            errors = self.sessions.stats.errors
            errors[outcome] = errors.get(outcome, 0) + 1
        try:
            if reply and not (request is not None and request.notification):
                await conn.outbox.put(reply)
        finally:
            # Counted until the answer is queued, so that shutdown waits for it and a client that reads nothing
            # holds its in-flight slots.
            self.in_flight -= 1
            limiter.release()
            if not self.in_flight:
                self._idle.set()
        log.debug(
            "request",
            method=request.method if request else None,
            session=getattr(params, "session", None),
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
            outcome=outcome,
        )

    # -- the methods --------------------------------------------------------------------------------------------

    def _initialize_result(self) -> InitializeResult:
        s = self.settings
        return InitializeResult(
            server=Server("devd", __version__),
            protocol=1,
            abi=ABI,
            limits=Limits(
                line_bytes_max=s.line_bytes_max,
                sessions_max=s.sessions_max,
                connections_max=s.connections_max,
                call_timeout_ms=int(s.call_timeout_s * 1000),
                memory_bytes_per_session=s.memory_bytes_per_session,
                keys_kept_per_session=KEYS_KEPT,
            ),
        )

    async def _initialize(self, conn: Connection, params: InitializeParams) -> msgspec.Struct:
        return self._initialize_result()

    async def _new(self, conn: Connection, params: NewParams) -> msgspec.Struct:
        from devd.protocol import Config, encode

        name = await self.sessions.new(params.session, encode(params.config or Config()))
        return SessionResult(name)

    async def _step(self, conn: Connection, params: StepParams) -> msgspec.Struct:
        actions, replayed = await self.sessions.step(params.session, bytes(params.event), params.timeout_ms, params.key)
        return StepResult(msgspec.Raw(actions), replayed)

    async def _snapshot(self, conn: Connection, params: SessionParams) -> msgspec.Struct:
        return SnapshotResult(await self.sessions.snapshot(params.session))

    async def _restore(self, conn: Connection, params: RestoreParams) -> msgspec.Struct:
        return SessionResult(await self.sessions.restore(params.snapshot, params.session))

    async def _recover(self, conn: Connection, params: SessionParams) -> msgspec.Struct:
        await self.sessions.recover(params.session)
        return SessionResult(params.session)

    async def _close(self, conn: Connection, params: SessionParams) -> msgspec.Struct:
        await self.sessions.close(params.session)
        conn.watchers.pop(params.session, None)
        return Empty()

    async def _list(self, conn: Connection, params: Any) -> msgspec.Struct:
        return ListResult(self.sessions.list())

    async def _watch(self, conn: Connection, params: WatchParams) -> msgspec.Struct:
        old = conn.watchers.pop(params.session, None)
        if old is not None:
            self.sessions.unwatch(params.session, old)
        watcher = Watcher(params.session, conn.outbox.offer, conn.outbox.force)
        self.sessions.watch(params.session, watcher, params.since)
        conn.watchers[params.session] = watcher
        return Empty()

    async def _unwatch(self, conn: Connection, params: SessionParams) -> msgspec.Struct:
        watcher = conn.watchers.pop(params.session, None)
        if watcher is not None:
            self.sessions.unwatch(params.session, watcher)
        return Empty()

    async def _status(self, conn: Connection, params: Any) -> msgspec.Struct:
        return self.status()

    def status(self) -> StatusResult:
        commits = sorted(self.store.commit_seconds) or [0.0]
        stats = self.sessions.stats
        return StatusResult(
            server=Server("devd", __version__),
            uptime_s=round(time.monotonic() - self.started, 3),
            sessions=self.sessions.counts(),
            connections=self.connections,
            steps=stats.steps,
            durable_writes=self.store.commits,
            errors=dict(stats.errors),
            deadline_hits=stats.deadline_hits,
            offloaded=stats.offloaded,
            commit_ms_p50=round(commits[len(commits) // 2] * 1000, 3),
            commit_ms_p99=round(commits[min(len(commits) - 1, int(len(commits) * 0.99))] * 1000, 3),
            memory_rss_bytes=_rss_bytes(),
        )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
