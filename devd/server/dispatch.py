"""One request line in, one reply line out: method lookup, params, the handler, and every error mapped to JSON-RPC.

This is the seam between connections and the daemon's methods: a connection hands each request line to
`Dispatcher.answer` and sends what comes back (nothing, for a notification). Errors become JSON-RPC errors here and
only here. Every INTERNAL answer is logged at error level, once, with the method and the session (never the payload):
an INTERNAL `DevdError` with its message and type (`error_type`: a `StoreError` is the store failing to read or write),
and an exception that is not a `DevdError` with its type and message, its client answered "see its log". Other answers
log nothing here, errors of other kinds included: those are the client's to act on, and a request's path stays free of
log calls.

Callers must let `serve` run to its end even if the client goes (the transport never cancels it): a call is bounded by
its deadline and a commit, and stopping it between the core and the journal would leave the two apart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from devd.errors import BusyError, DevdError, InternalError
from devd.server.methods import App, Call, Method, Peer, resolve
from devd.server.rpc import Request, RequestError, decode_request, error_response, response

log = structlog.get_logger("devd.server.dispatch")


class Dispatcher:
    def __init__(self, methods: Mapping[str, Method], app: App) -> None:
        self.methods = methods
        self.app = app
        self.draining = False  # set at shutdown: new calls are refused BUSY, status still answers

    async def serve(self, peer: Peer, line: bytes, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Answer one request line and hand the answer to send (nothing, for a notification)."""
        reply = await self.answer(peer, line)
        if reply:
            await send(reply)

    async def answer(self, peer: Peer, line: bytes) -> bytes:
        """The reply to one request line: a JSON-RPC response, an error, or b"" for a notification."""
        request: Request | None = None
        params: Any = None
        try:
            request = decode_request(line)
            m, params = resolve(self.methods, request)
            if self.draining and not m.during_shutdown:
                raise BusyError("the daemon is shutting down; retry against the next one")
            result = await m.handler(Call(self.app, peer), params)
            reply = b"" if request.notification else response(request.id, result)
        except RequestError as e:
            reply = b"" if e.notification else error_response(e.id, e.error)
            self._count(e.error.kind)
        except DevdError as e:
            reply = b"" if request is not None and request.notification else error_response(_id(request), e)
            self._count(e.kind)
            if e.kind == "INTERNAL":
                log.error(
                    "request.failed",
                    method=_method(request),
                    session=getattr(params, "session", None),
                    error=str(e),
                    error_type=type(e).__name__,
                )
        except Exception as e:
            self._count("INTERNAL")
            log.error(
                "request.failed",
                method=_method(request),
                session=getattr(params, "session", None),
                error=f"{type(e).__name__}: {e}"[:500],
            )
            reply = (
                b""
                if request is not None and request.notification
                else error_response(_id(request), InternalError("the daemon failed to answer; see its log"))
            )
        return reply

    def _count(self, kind: str) -> None:
        errors = self.app.errors
        errors[kind] = errors.get(kind, 0) + 1


def _id(request: Request | None) -> Any:
    return request.id if request is not None else None


def _method(request: Request | None) -> str | None:
    return request.method if request is not None else None
