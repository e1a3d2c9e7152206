"""Clients of the daemon: `AsyncClient` (anyio) and `Client`, a small blocking wrapper for scripts and the CLI.

Both speak the daemon's JSON-RPC over a Unix socket path or `tcp://HOST:PORT` (with the token), raise the
`devd.errors` class whose kind the daemon answered, and take and return the protocol Structs.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from devd import errors
from devd.config import parse_tcp
from devd.listeners import peer_uid
from devd.messages import Action, Config, Event, decode_actions, encode
from devd.methods import METHODS, ForkParams, PendingResult, SessionParams, SessionResult

_KINDS: dict[str, type[errors.DevdError]] = {
    cls.kind: cls
    for cls in (
        errors.HandleError,
        errors.MalformedError,
        errors.PoisonError,
        errors.PanicError,
        errors.NullError,
        errors.BusyError,
        errors.FullError,
        errors.DeadlineError,
        errors.TooLargeError,
        errors.UnauthorizedError,
        errors.ExistsError,
        errors.ConflictError,
        errors.ParseError,
        errors.InvalidRequestError,
        errors.MethodNotFoundError,
        errors.InvalidParamsError,
        errors.InternalError,
    )
}


class Reply(msgspec.Struct):
    id: Any = None
    result: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))
    error: dict[str, Any] | None = None
    method: str | None = None
    params: Any = None


_reply = msgspec.json.Decoder(Reply)
_encoder = msgspec.json.Encoder()


def _raise(error: dict[str, Any]) -> None:
    kind = (error.get("data") or {}).get("kind", "INTERNAL")
    cls = _KINDS.get(kind, errors.DevdError)
    raise cls(error.get("message", ""))


def _request(id: int, method: str, params: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "id": id, "method": method, "params": params}) + b"\n"


def _step_params(session: str, event: Event | bytes, timeout_ms: int | None, key: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "session": session,
        "event": msgspec.Raw(event if isinstance(event, bytes) else encode(event)),
    }
    if timeout_ms is not None:
        params["timeout_ms"] = timeout_ms
    if key is not None:
        params["key"] = key
    return params


class NotRunningError(ConnectionRefusedError):
    """No daemon listens at the address: says so, and how to start one."""

    def __init__(self, address: str, cause: OSError) -> None:
        super().__init__(
            cause.errno,
            f"no daemon is listening at {address} ({cause.strerror}); start one with `devd serve` (or `make run` in "
            "a checkout), or point at yours with --connect or DEVD_SOCKET",
        )


def check_peer(sock: socket.socket, address: str) -> None:
    """Refuse a Unix socket served by anyone but this user or root: whoever could create the socket's directory first
    could otherwise stand in for the daemon, and take our events and hand us their actions (Exec included)."""
    uid = peer_uid(sock)
    if uid not in (os.getuid(), 0):
        raise PermissionError(
            f"the socket {address} is served by uid {uid}, not by this user (uid {os.getuid()}) or root, so it is not "
            "your daemon; nothing was sent. Check who owns its directory, or use --connect with your own socket"
        )


class Client:
    """A blocking client: one request at a time; notifications received meanwhile are kept in `notifications`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._file = sock.makefile("rb")
        self._ids = itertools.count(1)
        self.notifications: list[Reply] = []

    @classmethod
    def connect(cls, address: str | Path, *, token: str | None = None, timeout: float | None = 30.0) -> Client:
        address = str(address)
        if address.startswith("tcp://"):
            host, port = parse_tcp(address)
            sock = socket.create_connection((host, port), timeout=timeout)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(address)
                check_peer(sock, address)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                sock.close()
                raise NotRunningError(address, e) from e
            except BaseException:
                sock.close()
                raise
        client = cls(sock)
        if address.startswith("tcp://") or token is not None:
            try:
                client.call("initialize", {"client": {"name": "devd.client"}, "token": token})
            except BaseException:
                client.close()
                raise
        return client

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_line(self, line: bytes) -> None:
        self._sock.sendall(line)

    def read_reply(self) -> Reply:
        line = self._file.readline()
        if not line:
            raise ConnectionError("the daemon closed the connection")
        return _reply.decode(line)

    def call_raw(self, method: str, params: Any = None) -> bytes:
        """The result's raw JSON; raises the error the daemon answered."""
        id = next(self._ids)
        self._sock.sendall(_request(id, method, params if params is not None else {}))
        while True:
            reply = self.read_reply()
            if reply.method is not None:
                self.notifications.append(reply)
                continue
            if reply.error is not None:
                _raise(reply.error)
            return bytes(reply.result)

    def call(self, method: str, params: Any = None) -> Any:
        return msgspec.json.decode(self.call_raw(method, params))

    def request(self, method: str, params: msgspec.Struct) -> Any:
        """Call method with its params Struct; the result comes back as the method's result Struct."""
        return msgspec.json.decode(self.call_raw(method, params), type=METHODS[method].result)

    def fork(self, session: str, *, at: int | None = None, name: str | None = None) -> str:
        """A new session whose history is session's up to step `at` (default: its latest); its name."""
        result: SessionResult = self.request("session/fork", ForkParams(session, at, name))
        return result.session

    def pending(self, session: str) -> list[Action]:
        """The actions session's core dispatched and still waits for."""
        result: PendingResult = self.request("session/pending", SessionParams(session))
        return decode_actions(bytes(result.actions))

    def wait_notification(self, timeout: float | None = None) -> Reply:
        """The next notification, waiting up to `timeout` seconds for it (None: for as long as it takes; the
        connection's own timeout is for answers, not for a session that is quiet)."""
        if self.notifications:
            return self.notifications.pop(0)
        previous = self._sock.gettimeout()
        self._sock.settimeout(timeout)
        try:
            reply = self.read_reply()
        finally:
            self._sock.settimeout(previous)
        assert reply.method is not None, reply
        return reply

    # typed methods
    def new(self, config: Config | None = None, session: str | None = None) -> str:
        params: dict[str, Any] = {}
        if config is not None:
            params["config"] = config
        if session is not None:
            params["session"] = session
        return str(self.call("session/new", params)["session"])

    def step(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> list[Action]:
        result = self.call_raw("session/step", _step_params(session, event, timeout_ms, key))
        return decode_actions(bytes(msgspec.json.decode(result, type=_StepResult).actions))

    def step_result(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> dict[str, Any]:
        return self.call("session/step", _step_params(session, event, timeout_ms, key))  # type: ignore[no-any-return]


class _StepResult(msgspec.Struct):
    actions: msgspec.Raw
    replayed: bool = False


class AsyncClient:
    """An anyio client: many requests in flight, replies matched by id, notifications on `notifications`."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[anyio.Event, list[Reply]]] = {}
        self._send_notice, self.notifications = anyio.create_memory_object_stream[Reply](1 << 16)

    @classmethod
    @asynccontextmanager
    async def connect(cls, address: str | Path, *, token: str | None = None) -> AsyncIterator[AsyncClient]:
        address = str(address)
        stream: anyio.abc.ByteStream
        if address.startswith("tcp://"):
            host, port = parse_tcp(address)
            stream = await anyio.connect_tcp(host, port)
        else:
            try:
                stream = await anyio.connect_unix(address)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise NotRunningError(address, e) from e
            try:
                check_peer(stream.extra(anyio.abc.SocketAttribute.raw_socket), address)
            except BaseException:
                await stream.aclose()
                raise
        async with stream, anyio.create_task_group() as tg:
            client = cls(stream)
            tg.start_soon(client._read)
            if address.startswith("tcp://") or token is not None:
                await client.call("initialize", {"client": {"name": "devd.client"}, "token": token})
            yield client
            tg.cancel_scope.cancel()

    async def _read(self) -> None:
        buffer = b""
        try:
            while True:
                buffer += await self._stream.receive(65536)
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    reply = _reply.decode(line)
                    if reply.method is not None:
                        await self._send_notice.send(reply)
                    elif isinstance(reply.id, int) and reply.id in self._waiting:
                        event, slot = self._waiting.pop(reply.id)
                        slot.append(reply)
                        event.set()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            for event, _ in self._waiting.values():
                event.set()
            self._waiting.clear()
            self._send_notice.close()

    async def call_raw(self, method: str, params: Any = None) -> bytes:
        id = next(self._ids)
        event, slot = anyio.Event(), list[Reply]()
        self._waiting[id] = (event, slot)
        await self._stream.send(_request(id, method, params if params is not None else {}))
        await event.wait()
        if not slot:
            raise ConnectionError("the daemon closed the connection")
        reply = slot[0]
        if reply.error is not None:
            _raise(reply.error)
        return bytes(reply.result)

    async def call(self, method: str, params: Any = None) -> Any:
        return msgspec.json.decode(await self.call_raw(method, params))

    async def request(self, method: str, params: msgspec.Struct) -> Any:
        """Call method with its params Struct; the result comes back as the method's result Struct."""
        return msgspec.json.decode(await self.call_raw(method, params), type=METHODS[method].result)

    async def fork(self, session: str, *, at: int | None = None, name: str | None = None) -> str:
        """A new session whose history is session's up to step `at` (default: its latest); its name."""
        result: SessionResult = await self.request("session/fork", ForkParams(session, at, name))
        return result.session

    async def pending(self, session: str) -> list[Action]:
        """The actions session's core dispatched and still waits for."""
        result: PendingResult = await self.request("session/pending", SessionParams(session))
        return decode_actions(bytes(result.actions))

    async def new(self, config: Config | None = None, session: str | None = None) -> str:
        params: dict[str, Any] = {}
        if config is not None:
            params["config"] = config
        if session is not None:
            params["session"] = session
        return str((await self.call("session/new", params))["session"])

    async def step(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> list[Action]:
        result = await self.call_raw("session/step", _step_params(session, event, timeout_ms, key))
        return decode_actions(bytes(msgspec.json.decode(result, type=_StepResult).actions))
