"""The NDJSON connection's rules, without I/O: bytes in, what to do out (the sans-I/O habit of h11).

`Rules.receive(data, now)` turns received bytes into `Line` (a request for the dispatcher), `Send` (an answer the
rules give themselves) and `Close` (end the connection, after sending its bytes). `Rules.deadline()` says by when
more bytes must arrive before the connection is closed. It composes the two pieces below it, each sans-I/O too:
- `devd.server.framing` splits the stream into lines within a bound;
- `devd.server.admission` refuses an HTTP request, admits a TCP connection on its token, and keeps its deadlines.
Its own rules: an over-long line is answered TOO_LARGE once and its rest discarded (before authentication it
closes instead); blank lines are skipped.
"""

from __future__ import annotations

import msgspec

from devd.config import Settings
from devd.server.admission import Admission, Close
from devd.server.framing import TOO_LONG, LineFramer
from devd.server.rpc import too_large

__all__ = ["Close", "Event", "Line", "Rules", "Send"]


class Line(msgspec.Struct, frozen=True):
    data: bytes


class Send(msgspec.Struct, frozen=True):
    data: bytes


Event = Line | Send | Close


class Rules:
    def __init__(self, settings: Settings, *, authenticated: bool, token: str | None, now: float) -> None:
        self.admission = Admission(settings, authenticated=authenticated, token=token, now=now)
        self.closed = False
        self._framer = LineFramer(self.admission.message_bytes_max)

    @property
    def authenticated(self) -> bool:
        return self.admission.authenticated

    def deadline(self) -> float:
        """The monotonic time by which more bytes must arrive, or inf."""
        return self.admission.deadline(self._framer.partial_since)

    def timed_out(self) -> Close:
        self.closed = True
        return self.admission.timed_out()

    def receive(self, data: bytes, now: float) -> list[Event]:
        if self.closed:
            return []
        admission = self.admission
        if admission.sniffing:
            sniffed = admission.sniff(data)
            if not isinstance(sniffed, bytes):
                self.closed = sniffed is not None
                return [] if sniffed is None else [sniffed]
            data = sniffed
        framer = self._framer
        events: list[Event] = []
        for line in framer.feed(data, now):
            if line is TOO_LONG:
                if not admission.authenticated:
                    self.closed = True
                    events.append(Close("an over-long line before initialize"))
                    return events
                events.append(Send(too_large(framer.line_bytes_max)))
                continue
            assert isinstance(line, bytes)
            if not line.strip():
                continue
            if not admission.authenticated:
                refusal = admission.admit(line)
                if refusal is not None:
                    self.closed = True
                    events.append(refusal)
                    return events
                framer.line_bytes_max = admission.message_bytes_max
            events.append(Line(line))
        return events
