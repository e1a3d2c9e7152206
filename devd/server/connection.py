"""A connection's rules, without I/O: bytes in, what to do out (the sans-I/O habit of h11).

`Rules.receive(data, now)` turns received bytes into `Line` (a request for the dispatcher), `Send` (an answer the
rules give themselves) and `Close` (end the connection, after sending its bytes). `Rules.deadline()` says by when
more bytes must arrive before the connection is closed. The rules:
- a connection that opens like an HTTP request is closed without an answer;
- on TCP, nothing is read as a request until `initialize` has presented the token (compared in constant time); lines
  before that are short (`auth_line_bytes_max`), and authentication has one deadline in all (`auth_timeout_s`);
- an over-long line is answered TOO_LARGE once and its rest discarded (before authentication it closes instead);
- once authenticated, a request line must arrive whole within `line_timeout_s` of its first byte (slowloris); an
  idle connection may stay as long as it likes.
"""

from __future__ import annotations

import hmac
import math

import msgspec

from devd.config import Settings
from devd.errors import UnauthorizedError
from devd.protocol import InitializeParams
from devd.server.rpc import TOO_LONG, LineFramer, RequestError, decode_request, error_response, too_large

_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
_initialize = msgspec.json.Decoder(InitializeParams)


class Line(msgspec.Struct, frozen=True):
    data: bytes


class Send(msgspec.Struct, frozen=True):
    data: bytes


class Close(msgspec.Struct, frozen=True):
    reason: str
    data: bytes = b""


Event = Line | Send | Close


class Rules:
    def __init__(self, settings: Settings, *, authenticated: bool, token: str | None, now: float) -> None:
        self.settings = settings
        self.authenticated = authenticated
        self.closed = False
        self._token = token.encode() if token is not None else None
        self._framer = LineFramer(settings.line_bytes_max if authenticated else settings.auth_line_bytes_max)
        self._head: bytes | None = b""  # the first bytes, until there are enough to tell an HTTP request
        self._auth_deadline = now + settings.auth_timeout_s
        self._line_started = now

    def deadline(self) -> float:
        """The monotonic time by which more bytes must arrive, or inf."""
        if not self.authenticated:
            return self._auth_deadline
        if self._framer.pending_bytes:
            return self._line_started + self.settings.line_timeout_s
        return math.inf

    def timed_out(self) -> Close:
        self.closed = True
        return Close("unauthenticated too long" if not self.authenticated else "a line did not arrive whole in time")

    def receive(self, data: bytes, now: float) -> list[Event]:
        if self.closed:
            return []
        if self._head is not None:
            data, self._head = self._head + data, None
            head = data.lstrip()
            if head.startswith(_HTTP_METHODS):
                self.closed = True
                return [Close("an HTTP request on the JSON-RPC socket")]
            # Undecided while what arrived could still begin a method ("G", "POS"): kept, not yet framed.
            if any(m.startswith(head) for m in _HTTP_METHODS) and b"\n" not in head:
                self._head = data
                return []
        framer = self._framer
        if not framer.pending_bytes or b"\n" in data:
            self._line_started = now  # whatever is left partial after this chunk began in it
        events: list[Event] = []
        for line in framer.feed(data):
            if line is TOO_LONG:
                if not self.authenticated:
                    self.closed = True
                    events.append(Close("an over-long line before initialize"))
                    return events
                events.append(Send(too_large(framer.line_bytes_max)))
                continue
            assert isinstance(line, bytes)
            if not line.strip():
                continue
            if not self.authenticated:
                refusal = self._authenticate(line)
                if refusal is not None:
                    self.closed = True
                    events.append(refusal)
                    return events
                self.authenticated = True
                framer.line_bytes_max = self.settings.line_bytes_max
            events.append(Line(line))
        return events

    def _authenticate(self, line: bytes) -> Close | None:
        """None if line is initialize with the token; else the Close that refuses it."""
        try:
            request = decode_request(line)
        except RequestError:
            return Close("unauthorized")
        token = None
        if request.method == "initialize":
            try:
                raw = bytes(request.params)
                token = _initialize.decode(b"{}" if raw.strip() == b"null" else raw).token
            except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
                token = None
        if (
            token is not None
            and self._token is not None
            and hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self._token)
        ):
            return None
        if request.notification:
            return Close("unauthorized")
        error = UnauthorizedError(
            "this connection must first call initialize with the token from the daemon's state directory (file `token`)"
        )
        return Close("unauthorized", error_response(request.id, error))
