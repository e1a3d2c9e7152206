"""One exception family for devd, each class mapped to exactly one protocol error kind and JSON-RPC code.

The first seven mirror the core's status table (ABI 2, the same as ABI 1's); the rest are the daemon's own. Every
message says what happened and what to do next; `kind` and `code` are what crosses the wire.
"""

from __future__ import annotations

from typing import ClassVar


class DevdError(Exception):
    """The root of every error devd raises on purpose."""

    kind: ClassVar[str] = "INTERNAL"
    code: ClassVar[int] = -32603


class HandleError(DevdError):
    """The session is gone (closed, ended by its deadline, or its answer was lost): recover or restore it."""

    kind = "HANDLE"
    code = -32001


class MalformedError(DevdError):
    """The payload is not a message of this protocol; nothing changed."""

    kind = "MALFORMED"
    code = -32002


class PoisonError(DevdError):
    """A previous call on this session trapped; close it and restore or recover it."""

    kind = "POISON"
    code = -32003


class PanicError(DevdError):
    """This call trapped (a panic or memory the core was refused); the session is now poisoned."""

    kind = "PANIC"
    code = -32004


class OutOfMemoryError(PanicError):
    """This call trapped because the session ran out of its memory cap: what the call asked for does not fit."""


class NullError(DevdError):
    """Something the call needs could not be lent (too large for the session's memory, or missing)."""

    kind = "NULL"
    code = -32005


class DoesNotFitError(NullError):
    """A call needed more memory than the session's cap; nothing changed (the session goes on from its last step)."""


class BusyError(DevdError):
    """The session is inside another call; calls are refused, not queued: retry when that call has answered."""

    kind = "BUSY"
    code = -32006


class FullError(DevdError):
    """No room is left for another session."""

    kind = "FULL"
    code = -32007


class DeadlineError(HandleError, TimeoutError):
    """The call ran past its deadline and was stopped where it stood; the session ended with it."""

    kind = "DEADLINE"
    code = -32008


class TooLargeError(DevdError):
    """A request line is longer than the daemon accepts."""

    kind = "TOO_LARGE"
    code = -32009


class UnauthorizedError(DevdError):
    """The connection has not presented a valid token."""

    kind = "UNAUTHORIZED"
    code = -32010


class ExistsError(DevdError):
    """A session of that name already exists."""

    kind = "EXISTS"
    code = -32011


class ConflictError(DevdError):
    """An idempotency key was reused with a different event."""

    kind = "CONFLICT"
    code = -32012


class MovedError(DevdError):
    """Another daemon of the fleet owns the session (or took it over from this one); nothing was done here. Send the
    call to the daemon at `data.owner.address`; with `owner` null, no live daemon holds it: send the call again."""

    kind = "MOVED"
    code = -32013

    def __init__(self, message: str, node: str | None = None, address: str | None = None) -> None:
        super().__init__(message)
        self.node = node  # the owner's node name, None when no live daemon owns the session
        self.address = address  # where its clients reach it (`devd serve --advertise`)

    @property
    def data(self) -> dict[str, object]:
        """The wire error's `data`: `{kind: "MOVED", owner: {node, address}}`, `owner` null when nobody holds it."""
        owner = None if self.node is None else {"node": self.node, "address": self.address or ""}
        return {"kind": self.kind, "owner": owner}


class AbiError(DevdError):
    """The module does not speak the core's ABI (wrong version, imports, or export types)."""

    kind = "ABI"


class ParseError(DevdError):
    kind = "PARSE"
    code = -32700


class InvalidRequestError(DevdError):
    kind = "INVALID_REQUEST"
    code = -32600


class MethodNotFoundError(DevdError):
    kind = "METHOD_NOT_FOUND"
    code = -32601


class InvalidParamsError(DevdError):
    kind = "INVALID_PARAMS"
    code = -32602


class InternalError(DevdError):
    kind = "INTERNAL"
    code = -32603


class StoreError(InternalError):
    """The store could not read or write; what was asked was not done, and nothing of it was half-applied."""


# dev.h's status table, indexed by the negated status code.
STATUS: tuple[type[DevdError] | None, ...] = (
    None,
    HandleError,
    MalformedError,
    PoisonError,
    PanicError,
    NullError,
    BusyError,
    FullError,
)

STATUS_MESSAGES: dict[type[DevdError], str] = {
    HandleError: "the handle names no live session; restore or recover it",
    MalformedError: "the core cannot read it (an event or config that is not protocol 1, or a damaged snapshot); "
    "nothing changed, fix it and send it again",
    PoisonError: "a previous call on this session trapped; close it and restore or recover it",
    PanicError: "the call trapped inside the core; the session is poisoned, recover it from its last durable state",
    NullError: "the core could not lend memory for the call; send a smaller event",
    BusyError: "the session is inside another call; retry when that call has answered",
    FullError: "the core has no slot for another session",
}


class ConfigError(InternalError):
    """A configuration file the daemon was given cannot be used (`FILE:LINE: what is wrong and what to do`); the
    daemon refuses to start. It stops a start, never a call, so it never crosses the wire (and adds no kind)."""
