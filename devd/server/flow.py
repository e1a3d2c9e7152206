"""Flow control, whatever the wire protocol: how many of a connection's requests run at once, when it is not read,
when it is cut off for not reading, and whether a watcher's notice may be queued for it.

What it promises:
- a connection's requests run concurrently up to `requests_in_flight_max`; past that, it is not read until one
  answers;
- a connection whose unsent bytes pass `outbox_bytes_soft` is not read from until it takes them, and is cut off if
  it takes nothing for `send_timeout_s`;
- a notice is refused (`offer`) rather than queued past that bound, or past `outboxes_bytes_max` for every
  connection together (`Outboxes`); a notice of any size still goes to a connection with nothing queued;
- once told to close (`close_when_answered`), a connection is read no more, and closes when its last answer has been
  handed to it.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from devd.config import Settings

log = structlog.get_logger("devd.server.flow")


class Outboxes(msgspec.Struct):
    """Every connection's unsent bytes together, and the flows that hold them."""

    flows: set[Flow] = msgspec.field(default_factory=set)
    _unsent: int = 0
    _unsent_at: float = 0.0

    def unsent_bytes(self) -> int:
        """Summed at most once a millisecond (it is O(connections)), and counted up by what is queued meanwhile."""
        now = time.monotonic()
        if now - self._unsent_at > 0.001:
            self._unsent = sum(f.unsent_bytes for f in self.flows)
            self._unsent_at = now
        return self._unsent

    def queued(self, n: int) -> None:
        self._unsent += n


class Flow:
    """One connection's flow control, over its asyncio transport. The protocol calls `started` and `ended` around
    each request and hands asyncio's `pause_writing`/`resume_writing` on; it writes through `write` and `offer`."""

    def __init__(self, transport: asyncio.Transport, settings: Settings, outboxes: Outboxes) -> None:
        self.transport = transport
        self.settings = settings
        self.outboxes = outboxes
        self.in_flight = 0
        self.closing = False  # no more requests are read; close once every answer is written
        self.lost = False
        self._paused = {"in_flight": False, "writing": False}
        self._send_timer: asyncio.TimerHandle | None = None
        # Past half the watcher bound, stop reading and start the send timer: a client that takes nothing for
        # send_timeout_s is cut off, a watch-only one included (its notices stop at the bound, but it stays paused).
        transport.set_write_buffer_limits(high=settings.outbox_bytes_soft // 2, low=settings.outbox_bytes_soft // 8)
        outboxes.flows.add(self)

    # -- requests ---------------------------------------------------------------------------------------------------

    def started(self) -> None:
        self.in_flight += 1
        if self.in_flight >= self.settings.requests_in_flight_max:
            self._pause("in_flight")

    def ended(self) -> None:
        self.in_flight -= 1
        self._resume("in_flight")
        if self.closing and not self.in_flight and not self.lost:
            self.transport.close()  # asyncio sends what is buffered first

    # -- writing ----------------------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.lost:
            self.transport.write(data)

    def offer(self, data: bytes) -> bool:
        """Queue a notice if there is room for it (True); True too once the connection is gone (the subscription
        ends with it)."""
        if self.lost:
            return True
        queued = self.transport.get_write_buffer_size()
        if queued and (
            queued + len(data) > self.settings.outbox_bytes_soft
            or self.outboxes.unsent_bytes() + len(data) > self.settings.outboxes_bytes_max
        ):
            return False
        self.transport.write(data)
        self.outboxes.queued(len(data))
        return True

    @property
    def unsent_bytes(self) -> int:
        return 0 if self.lost else self.transport.get_write_buffer_size()

    def pause_writing(self) -> None:
        self._pause("writing")
        self._send_timer = asyncio.get_running_loop().call_later(self.settings.send_timeout_s, self._too_slow)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self._resume("writing")

    # -- the end ----------------------------------------------------------------------------------------------------

    def close_when_answered(self) -> None:
        self.closing = True
        if self.transport.is_reading():
            self.transport.pause_reading()
        if not self.in_flight:
            self.transport.close()

    def connection_lost(self) -> None:
        self.lost = True
        self.closing = True
        if self._send_timer is not None:
            self._send_timer.cancel()
        self.outboxes.flows.discard(self)

    def _too_slow(self) -> None:
        log.warning("connection.dropped", reason="the client stopped reading")
        self.transport.abort()

    def _pause(self, why: str) -> None:
        if not self._paused[why] and not self.lost:
            self._paused[why] = True
            if self.transport.is_reading():
                self.transport.pause_reading()

    def _resume(self, why: str) -> None:
        if self._paused[why]:
            self._paused[why] = False
            if not any(self._paused.values()) and not self.closing and not self.lost:
                self.transport.resume_reading()
