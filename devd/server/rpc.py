"""JSON-RPC 2.0 messages: request decoding, answers and notifications. No I/O, and no framing (a line's bytes in,
a line's bytes out; splitting a stream into lines is `devd.server.framing`'s).

`decode_request` turns a line into a `Request` (or a `DevdError` that says which JSON-RPC error it is); `response`
and `error_response` turn results and errors into lines. Events and actions cross as `msgspec.Raw`: what the core
validates is never decoded and re-encoded here.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec
from msgspec import UNSET, Raw, UnsetType

from devd.errors import DevdError, InvalidRequestError, MovedError, ParseError, TooLargeError
from devd.protocol import NOTIFICATIONS as NOTIFICATIONS  # the wire's types live in devd.protocol; re-exported here
from devd.protocol import (
    Error,
    ErrorData,
    Owner,
    StepNotice,
    rfc3339,
)
from devd.protocol import UnwatchedNotice as UnwatchedNotice
from devd.sessions.watchers import Notice, Stepped

Id = int | str | None


# -- messages -----------------------------------------------------------------------------------------------------


class _Envelope(msgspec.Struct):
    """A request as received, each member still undecoded, so that every fault maps to its own error."""

    jsonrpc: Raw | UnsetType = UNSET
    method: Raw | UnsetType = UNSET
    params: Raw | UnsetType = UNSET
    id: Raw | UnsetType = UNSET


class _WellFormed(msgspec.Struct):
    """A request as almost every line is: decoded in one pass (the envelope above is for naming what is wrong)."""

    jsonrpc: Literal["2.0"]
    method: str
    params: Raw | UnsetType = UNSET
    id: int | str | None | UnsetType = UNSET


class Request(msgspec.Struct, frozen=True):
    method: str
    params: Raw
    id: Id
    notification: bool


_envelope = msgspec.json.Decoder(_Envelope)
_request = msgspec.json.Decoder(_WellFormed)
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
    if not line.isascii():  # ASCII (almost every line) is UTF-8, and is told without decoding
        try:
            line.decode()  # msgspec skips unknown members unchecked; every byte of a line must be UTF-8
        except UnicodeDecodeError as e:
            raise RequestError(
                ParseError(f"the line is not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON"), None
            ) from None
    try:
        fast = _request.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        pass  # not a well-formed request: the slow path below names what is wrong
    else:
        params = Raw(b"{}") if fast.params is UNSET else fast.params
        if fast.id is UNSET:
            return Request(fast.method, params, None, True)
        return Request(fast.method, params, fast.id, False)
    try:
        env = _envelope.decode(line)
    except RecursionError:
        raise RequestError(ParseError("the request nests too deeply to parse; flatten it"), None) from None
    except msgspec.ValidationError:
        what = (
            "a batch (batches are not supported: send one request per line)"
            if line.lstrip()[:1] == b"["
            else "not an object (send one JSON-RPC request object per line)"
        )
        raise RequestError(InvalidRequestError(f"the request is {what}"), None) from None
    except msgspec.DecodeError as e:
        raise _undecodable(line, e) from None
    id: Id = None
    if env.id is not UNSET:
        try:
            id = _id.decode(env.id)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise RequestError(InvalidRequestError("the id must be a string, an integer or null"), None) from None
    # A line that is not a request is answered (id null when it has none), as JSON-RPC 2.0 answers its Invalid
    # Request: without an id it is no notification, or a client that forgot "jsonrpc" would hear nothing at all.
    if _text(env.jsonrpc) != "2.0":
        raise RequestError(InvalidRequestError('the request must say "jsonrpc": "2.0"'), id)
    method = _text(env.method)
    if method is None:
        raise RequestError(InvalidRequestError("the request needs a method, as a string"), id)
    params = env.params if env.params is not UNSET else Raw(b"{}")
    return Request(method=method, params=params, id=id, notification=env.id is UNSET)


def _undecodable(line: bytes, error: msgspec.DecodeError) -> RequestError:
    """The error for a line msgspec cannot decode. JSON that only escapes a lone UTF-16 surrogate (`\\ud83d` without
    its pair: what JavaScript's JSON.stringify writes for half an emoji) is JSON all the same, but no UTF-8 string
    can hold it: that is said as such, under the request's id when it has one, rather than as a parse error."""
    parse_error = RequestError(ParseError(f"the line is not UTF-8 JSON ({error}); send one JSON object per line"), None)
    if _SURROGATE_ESCAPE.search(line) is None:
        return parse_error
    try:
        # The standard library reads lone surrogates (and, unlike JSON, NaN: refused here too); only reached for a
        # line that failed.
        doc = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return parse_error
    raw_id = doc.get("id") if isinstance(doc, dict) else None
    usable = isinstance(raw_id, int | str) and not isinstance(raw_id, bool) and _well_formed(raw_id)
    id = raw_id if usable else None
    return RequestError(
        InvalidRequestError(
            "a string in the request holds a lone UTF-16 surrogate (an escape such as \\ud83d without its pair), "
            "which no UTF-8 text can carry; send well-formed Unicode (a character past U+FFFF as its whole pair)"
        ),
        id,
    )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _well_formed(value: int | str) -> bool:
    try:
        str(value).encode()
    except UnicodeEncodeError:
        return False
    return True


def _text(member: Raw | UnsetType) -> str | None:
    """A member that must be a JSON string, or None when it is absent or anything else."""
    if isinstance(member, UnsetType):
        return None
    try:
        return _str.decode(member)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


# -- answers ------------------------------------------------------------------------------------------------------


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
    line = bytearray()  # encoded in place and the newline appended: a large answer is not copied twice
    _encoder.encode_into(Response("2.0", id, result), line)
    line += b"\n"
    return line  # type: ignore[return-value]  # bytes-like, as every caller needs


def error_response(id: Id, error: DevdError) -> bytes:
    data = ErrorData(error.kind)
    if isinstance(error, MovedError):
        data = ErrorData(error.kind, Owner(error.node, error.address or "") if error.node is not None else None)
    return _encoder.encode(ErrorResponse("2.0", id, Error(error.code, str(error), data))) + b"\n"


def notification(method: str, params: Any) -> bytes:
    return _encoder.encode(Notification("2.0", method, params)) + b"\n"


def too_large(line_bytes_max: int) -> bytes:
    return error_response(
        None, TooLargeError(f"the line is longer than {line_bytes_max} bytes; it was discarded, send a shorter one")
    )


# -- notifications -------------------------------------------------------------------------------------------------


def encode_notice(notice: Notice) -> bytes:
    """A watcher's domain event as its notification line."""
    if isinstance(notice, Stepped):
        return notification(
            "session/actions",
            StepNotice(notice.session, notice.seq, Raw(notice.event), Raw(notice.actions), rfc3339(notice.at)),
        )
    owner = Owner(*notice.owner) if notice.owner is not None else None
    return notification("session/unwatched", UnwatchedNotice(notice.session, notice.seq, notice.reason, owner))
