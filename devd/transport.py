"""One connection's I/O: reading bytes into `Rules`, running each request through the dispatcher, sending answers.

What it promises:
- requests on one connection run concurrently, up to `requests_in_flight_max`; past that, the connection is not
  read until one answers;
- answers and notifications go out through one outbox per connection; a client that takes no bytes for
  `send_timeout_s` is cut off, and a watcher whose outbox holds more than `outbox_bytes_soft` is dropped (one notice
  of any size still goes through to an empty outbox);
- at the peer's EOF, what it asked before is still answered, then the connection closes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import structlog

from devd.config import Settings
from devd.connection import Close, Line, Rules, Send
from devd.dispatch import Dispatcher
from devd.methods import Peer

log = structlog.get_logger("devd.transport")

RECEIVE_BYTES = 65536


class Outbox:
    """What a connection has yet to send. Answers wait for room; notifications are refused when it is full."""

    def __init__(self, soft_bytes: int, hard_bytes: int) -> None:
        self._items: deque[bytes] = deque()
        self._bytes = 0
        self._soft = soft_bytes
        self._hard = hard_bytes
        self._ready = anyio.Event()
        self._room = anyio.Event()
        self._sending = False

    def offer(self, data: bytes) -> bool:
        if self._bytes and self._bytes + len(data) > self._soft:
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

    @property
    def empty(self) -> bool:
        return not self._items and not self._sending

    async def wait_sent(self, timeout_s: float) -> None:
        """Return once everything queued has been handed to the socket (or timeout_s passed)."""
        with anyio.move_on_after(timeout_s):
            while not self.empty:
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


async def serve_stream(
    stream: anyio.abc.ByteStream,
    rules: Rules,
    dispatcher: Dispatcher,
    peer: Peer,
    outbox: Outbox,
    *,
    on_eof: Callable[[], None],
) -> None:
    """Serve one connection until the peer closes it, breaks a rule, or stops reading."""
    settings = dispatcher.app.settings
    limiter = anyio.Semaphore(settings.requests_in_flight_max)

    async def run(line: bytes) -> None:
        try:
            await dispatcher.serve(peer, line, outbox.put)
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(_send_loop, outbox, stream, settings, tg.cancel_scope)
        await _receive_loop(stream, rules, outbox, limiter, tg, run)
        on_eof()
        # The peer closed its side (or broke a rule): answer what it asked before, then close ours.
        with anyio.move_on_after(settings.send_timeout_s):
            for _ in range(settings.requests_in_flight_max):
                await limiter.acquire()
            await outbox.wait_sent(settings.send_timeout_s)
        tg.cancel_scope.cancel()


async def _receive_loop(
    stream: anyio.abc.ByteReceiveStream,
    rules: Rules,
    outbox: Outbox,
    limiter: anyio.Semaphore,
    tg: anyio.abc.TaskGroup,
    run: Callable[[bytes], Awaitable[None]],
) -> None:
    while True:
        deadline = rules.deadline()
        try:
            if deadline == math.inf:  # idle between lines: no timer to arm (a cancel scope per read costs ~5%)
                data = await stream.receive(RECEIVE_BYTES)
            else:
                with anyio.fail_after(max(deadline - time.monotonic(), 0)):
                    data = await stream.receive(RECEIVE_BYTES)
        except TimeoutError:
            log.warning("connection.dropped", reason=rules.timed_out().reason)
            return
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return
        for event in rules.receive(data, time.monotonic()):
            if isinstance(event, Line):
                await limiter.acquire()
                tg.start_soon(run, event.data)
            elif isinstance(event, Send):
                await outbox.put(event.data)
            else:
                await _close(event, outbox)
                return


async def _close(event: Close, outbox: Outbox) -> None:
    log.warning("connection.refused", reason=event.reason)
    if event.data:
        outbox.force(event.data)
        await outbox.wait_sent(1.0)


async def _send_loop(
    outbox: Outbox, stream: anyio.abc.ByteSendStream, settings: Settings, scope: anyio.CancelScope
) -> None:
    try:
        await outbox.drain_to(stream, settings.send_timeout_s)
    except TimeoutError:
        log.warning("connection.dropped", reason="the client stopped reading")
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    scope.cancel()
