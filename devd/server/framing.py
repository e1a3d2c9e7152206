"""Newline-delimited framing, without I/O: a byte stream in, its lines out, each within a bound.

What it promises: `LineFramer.feed(data, now)` yields every whole line of the stream, an over-long one as `TOO_LONG`
once (its remaining bytes are dropped, so the stream stays in step), and never holds more than `line_bytes_max`
bytes; `partial_since` says when the line still arriving began, for a deadline on it (`devd.server.admission`).
What a line means, and what an over-long one is answered, is the protocol's (`devd.server.connection`).
"""

from __future__ import annotations

from collections.abc import Iterator


class TooLong:
    """Marks a line that passed the limit; it is answered once, and its remaining bytes are dropped."""


TOO_LONG = TooLong()


class LineFramer:
    """Splits a byte stream at b"\\n" with a bound on line length; never holds more than the bound."""

    def __init__(self, line_bytes_max: int) -> None:
        self.line_bytes_max = line_bytes_max  # raised once a connection is admitted (auth lines are shorter)
        self._buffer = bytearray()
        self._discarding = False
        self._started = 0.0

    def feed(self, data: bytes, now: float) -> Iterator[bytes | TooLong]:
        """The lines data ends, at time now (whatever is left partial after it began in it, unless some of it
        was held already)."""
        if not self._buffer or b"\n" in data:
            self._started = now
        if data[-1:] == b"\n" and not self._buffer and not self._discarding and data.find(b"\n") == len(data) - 1:
            # One whole line in one read, the usual case: no buffering, no scanning twice.
            if len(data) - 1 > self.line_bytes_max:
                yield TOO_LONG
            else:
                yield data[:-1]
            return
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            if self._discarding:
                self._discarding = False
            elif len(self._buffer) + end - start > self.line_bytes_max:
                self._buffer.clear()
                yield TOO_LONG
            else:
                self._buffer += data[start:end]
                line = bytes(self._buffer)
                self._buffer.clear()
                yield line
            start = end + 1
        rest = len(data) - start
        if self._discarding or not rest:
            return
        if len(self._buffer) + rest > self.line_bytes_max:
            self._buffer.clear()
            self._discarding = True
            yield TOO_LONG
        else:
            self._buffer += data[start:]

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)

    @property
    def partial_since(self) -> float | None:
        """When the line still arriving began, or None when no part of one is held."""
        return self._started if self._buffer else None
