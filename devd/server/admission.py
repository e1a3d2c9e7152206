"""Who may speak on a connection, and for how long it may take, without I/O and whatever the framing: the HTTP
sniff, the token, and the connection's deadlines. A wire protocol feeds it its first bytes and its first messages.

What it promises:
- a connection that opens like an HTTP request is refused (`sniff`), however its first bytes are chunked;
- on TCP, no message is admitted until `initialize` has presented the token (compared in constant time); messages
  before that are short (`message_bytes_max` is `auth_line_bytes_max`), and authentication has one deadline in all
  (`auth_timeout_s`), whatever arrives;
- once authenticated, a message must arrive whole within `line_timeout_s` of its first byte (slowloris); an idle
  connection may stay as long as it likes.
"""

from __future__ import annotations

import hmac
import math

import msgspec

from devd.config import Settings
from devd.errors import UnauthorizedError
from devd.protocol import InitializeParams
from devd.server.rpc import RequestError, decode_request, error_response

_HTTP_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
_initialize = msgspec.json.Decoder(InitializeParams)
# The most first bytes held undecided: whitespace alone (blank lines, spaces) could begin a request for ever, and held
# bytes are joined again at every read. Past this they are framed like any other (blank lines are skipped there).
SNIFF_BYTES_MAX = 64


class Close(msgspec.Struct, frozen=True):
    """The connection is to close, after `data` (the answer it is owed, if any) is sent; `reason` is for the log."""

    reason: str
    data: bytes = b""


class Admission:
    def __init__(self, settings: Settings, *, authenticated: bool, token: str | None, now: float) -> None:
        self.settings = settings
        self.authenticated = authenticated
        self.sniffing = True  # until the first bytes tell whether this is an HTTP request
        self._token = token.encode() if token is not None else None
        self._head = b""
        self._auth_deadline = now + settings.auth_timeout_s

    @property
    def message_bytes_max(self) -> int:
        return self.settings.line_bytes_max if self.authenticated else self.settings.auth_line_bytes_max

    def deadline(self, partial_since: float | None) -> float:
        """The monotonic time by which more must arrive, or inf; `partial_since` is when the message still
        arriving began (None: none is)."""
        if not self.authenticated:
            return self._auth_deadline
        if partial_since is not None:
            return partial_since + self.settings.line_timeout_s
        return math.inf

    def timed_out(self) -> Close:
        return Close("unauthenticated too long" if not self.authenticated else "a line did not arrive whole in time")

    def sniff(self, data: bytes) -> bytes | Close | None:
        """The connection's first bytes: what to frame (data, after any held before it), a Close for an HTTP
        request, or None while what arrived could still begin one ("G", "POS"), kept until more comes (at most
        SNIFF_BYTES_MAX bytes)."""
        data, self._head = self._head + data, b""
        head = data.lstrip()
        if head.startswith(_HTTP_METHODS):
            self.sniffing = False
            return Close("an HTTP request on the JSON-RPC socket")
        if len(data) <= SNIFF_BYTES_MAX and b"\n" not in head and any(m.startswith(head) for m in _HTTP_METHODS):
            self._head = data
            return None
        self.sniffing = False
        return data

    def admit(self, message: bytes) -> Close | None:
        """None, and authenticated from now on, if message is initialize with the token; else the Close."""
        refusal = self._check_token(message)
        if refusal is None:
            self.authenticated = True
        return refusal

    def _check_token(self, message: bytes) -> Close | None:
        try:
            request = decode_request(message)
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
