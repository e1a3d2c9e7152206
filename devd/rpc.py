"""JSON-RPC 2.0 over newline-delimited JSON: framing, request decoding, method params and error mapping. No I/O.

`LineFramer` turns received bytes into lines, answering an over-long line once as too large and discarding the
rest of it, so the stream stays in step. `decode_request` turns a line into a `Request` (or a `DevdError` that
says which JSON-RPC error it is); `response` and `error_response` turn results and errors into lines. Events and
actions cross as `msgspec.Raw`: what the core validates is never decoded and re-encoded here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Raw, UnsetType

from devd.errors import (
    DevdError,
    InvalidParamsError,
    InvalidRequestError,
    MethodNotFoundError,
    ParseError,
    TooLargeError,
)
from devd.protocol import Config

LINE_BYTES_MAX_DEFAULT = 16 << 20
KEY_BYTES_MAX = 256
SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

Id = int | str | None


# -- framing ------------------------------------------------------------------------------------------------------


class TooLong:
    """Marks a line that passed the limit; it is answered once, and its remaining bytes are dropped."""


TOO_LONG = TooLong()


class LineFramer:
    """Splits a byte stream at b"\\n" with a bound on line length; never holds more than the bound."""

    def __init__(self, line_bytes_max: int = LINE_BYTES_MAX_DEFAULT) -> None:
        self.line_bytes_max = line_bytes_max
        self._buffer = bytearray()
        self._discarding = False

    def feed(self, data: bytes) -> Iterator[bytes | TooLong]:
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


# -- messages -----------------------------------------------------------------------------------------------------


class _Envelope(msgspec.Struct):
    """A request as received, each member still undecoded, so that every fault maps to its own error."""

    jsonrpc: Raw | UnsetType = UNSET
    method: Raw | UnsetType = UNSET
    params: Raw | UnsetType = UNSET
    id: Raw | UnsetType = UNSET


class Request(msgspec.Struct, frozen=True):
    method: str
    params: Raw
    id: Id
    notification: bool


class Client(msgspec.Struct, frozen=True):
    name: str
    version: str | None = None


class InitializeParams(msgspec.Struct, frozen=True):
    client: Client | None = None
    token: str | None = None


class NewParams(msgspec.Struct, frozen=True):
    config: Config | None = None
    session: str | None = None


class StepParams(msgspec.Struct, frozen=True):
    session: str
    event: Raw
    timeout_ms: int | None = None
    key: str | None = None


class SessionParams(msgspec.Struct, frozen=True):
    session: str


class RestoreParams(msgspec.Struct, frozen=True):
    snapshot: str
    session: str | None = None


class WatchParams(msgspec.Struct, frozen=True):
    session: str
    since: int | None = None


class NoParams(msgspec.Struct, frozen=True):
    pass


PARAMS: dict[str, type[msgspec.Struct]] = {
    "initialize": InitializeParams,
    "session/new": NewParams,
    "session/step": StepParams,
    "session/snapshot": SessionParams,
    "session/restore": RestoreParams,
    "session/recover": SessionParams,
    "session/close": SessionParams,
    "session/list": NoParams,
    "session/watch": WatchParams,
    "session/unwatch": SessionParams,
    "daemon/status": NoParams,
}

_DECODERS = {method: msgspec.json.Decoder(t) for method, t in PARAMS.items()}
_envelope = msgspec.json.Decoder(_Envelope)
_id = msgspec.json.Decoder(int | str | None)
_str = msgspec.json.Decoder(str)


class RequestError(Exception):
    """A line that is not a usable request: the error to answer, and the id to answer it under (None if unknown)."""

    def __init__(self, error: DevdError, id: Id, notification: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.id = id
        self.notification = notification


def decode_request(line: bytes) -> Request:
    """The request on one line, or RequestError carrying the JSON-RPC error to answer."""
    try:
        line.decode()  # msgspec skips unknown members unchecked; every byte of a line must be UTF-8
    except UnicodeDecodeError as e:
        raise RequestError(
            ParseError(f"the line is not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON"), None
        ) from None
    try:
        env = _envelope.decode(line)
    except RecursionError:
        raise RequestError(ParseError("the request nests too deeply to parse; flatten it"), None) from None
    except msgspec.ValidationError:
        what = (
            "a batch (batches are not supported: send one request per line)"
            if line.lstrip()[:1] == b"["
            else "not an object"
        )
        raise RequestError(InvalidRequestError(f"the request is {what}"), None) from None
    except msgspec.DecodeError as e:
        raise RequestError(
            ParseError(f"the line is not UTF-8 JSON ({e}); send one JSON object per line"), None
        ) from None
    notification = env.id is UNSET
    id: Id = None
    if not notification:
        try:
            id = _id.decode(env.id)  # type: ignore[arg-type]
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise RequestError(InvalidRequestError("the id must be a string, an integer or null"), None) from None
    if _text(env.jsonrpc) != "2.0":
        raise RequestError(InvalidRequestError('the request must say "jsonrpc": "2.0"'), id, notification)
    method = _text(env.method)
    if method is None:
        raise RequestError(InvalidRequestError("the request needs a method, as a string"), id, notification)
    params = env.params if env.params is not UNSET else Raw(b"{}")
    return Request(method=method, params=params, id=id, notification=notification)


def _text(member: Raw | UnsetType) -> str | None:
    """A member that must be a JSON string, or None when it is absent or anything else."""
    if isinstance(member, UnsetType):
        return None
    try:
        return _str.decode(member)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def decode_params(request: Request) -> Any:
    """The method's own params, or MethodNotFoundError / InvalidParamsError."""
    decoder = _DECODERS.get(request.method)
    if decoder is None:
        raise MethodNotFoundError(f"there is no method {request.method!r}; see `devd schema` for the methods")
    raw = bytes(request.params)
    if raw.strip() == b"null":
        raw = b"{}"
    try:
        params = decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise InvalidParamsError(f"bad params for {request.method}: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise InvalidParamsError(f"the params of {request.method} cannot be read: {e}") from None
    check_params(params)
    return params


def check_params(params: Any) -> None:
    """Rules msgspec's types cannot state."""
    for field in ("session",):
        name = getattr(params, field, None)
        if name is not None and (not SESSION_NAME.fullmatch(name) or name in (".", "..")):
            raise InvalidParamsError(
                f"session names are 1-64 of A-Z a-z 0-9 . _ - and not . or ..; {name[:80]!r} is not one"
            )
    if isinstance(params, StepParams):
        if params.timeout_ms is not None and params.timeout_ms <= 0:
            raise InvalidParamsError("timeout_ms must be a positive number of milliseconds")
        if params.key is not None:
            try:
                encoded = params.key.encode()
            except UnicodeEncodeError:
                raise InvalidParamsError("the key must be valid Unicode text") from None
            if not 0 < len(encoded) <= KEY_BYTES_MAX:
                raise InvalidParamsError(f"the key must be 1-{KEY_BYTES_MAX} bytes of UTF-8")
    if isinstance(params, WatchParams) and params.since is not None and params.since < 0:
        raise InvalidParamsError("since must be a step number, 0 or more")


# -- answers ------------------------------------------------------------------------------------------------------


class ErrorData(msgspec.Struct, frozen=True):
    kind: str


class Error(msgspec.Struct, frozen=True):
    code: int
    message: str
    data: ErrorData


class Response(msgspec.Struct, frozen=True):
    jsonrpc: Literal["2.0"]
    id: Id
    result: Any


class ErrorResponse(msgspec.Struct, frozen=True):
    jsonrpc: Literal["2.0"]
    id: Id
    error: Error


class Notification(msgspec.Struct, frozen=True):
    jsonrpc: Literal["2.0"]
    method: str
    params: Any


_encoder = msgspec.json.Encoder()


def response(id: Id, result: Any) -> bytes:
    return _encoder.encode(Response("2.0", id, result)) + b"\n"


def error_response(id: Id, error: DevdError) -> bytes:
    return _encoder.encode(ErrorResponse("2.0", id, Error(error.code, str(error), ErrorData(error.kind)))) + b"\n"


def notification(method: str, params: Any) -> bytes:
    return _encoder.encode(Notification("2.0", method, params)) + b"\n"


def too_large(line_bytes_max: int) -> bytes:
    return error_response(
        None, TooLargeError(f"the line is longer than {line_bytes_max} bytes; it was discarded, send a shorter one")
    )


# -- results ------------------------------------------------------------------------------------------------------


class Server(msgspec.Struct, frozen=True):
    name: str
    version: str


class Limits(msgspec.Struct, frozen=True):
    line_bytes_max: int
    sessions_max: int
    connections_max: int
    call_timeout_ms: int
    memory_bytes_per_session: int
    keys_kept_per_session: int


class InitializeResult(msgspec.Struct, frozen=True):
    server: Server
    protocol: int
    abi: int
    limits: Limits


class SessionResult(msgspec.Struct, frozen=True):
    session: str


class StepResult(msgspec.Struct, frozen=True, omit_defaults=True):
    actions: Raw
    replayed: bool = False


class SnapshotResult(msgspec.Struct, frozen=True):
    snapshot: str


class SessionInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    session: str
    state: Literal["live", "stored", "ended", "poisoned"]
    seq: int
    watchers: int = 0
    reason: str | None = None


class ListResult(msgspec.Struct, frozen=True):
    sessions: list[SessionInfo]


class Empty(msgspec.Struct, frozen=True):
    pass


class StepNotice(msgspec.Struct, frozen=True):
    """`session/actions`: one answered step of a watched session."""

    session: str
    seq: int
    event: Raw
    actions: Raw


class UnwatchedNotice(msgspec.Struct, frozen=True):
    """`session/unwatched`: the watcher fell too far behind and was dropped after `seq`."""

    session: str
    seq: int
    reason: str


class StatusResult(msgspec.Struct, frozen=True):
    server: Server
    uptime_s: float
    sessions: dict[str, int]
    connections: int
    steps: int
    durable_writes: int
    errors: dict[str, int]
    deadline_hits: int
    offloaded: int  # calls that passed their inline budget and ran on a worker thread
    commit_ms_p50: float
    commit_ms_p99: float
    memory_rss_bytes: int
