"""A Streamable HTTP MCP server as the transport of a connection's life: the SDK's `streamable_http_client` over an
HTTP client of the daemon's own, with the server's headers (their values read from the daemon's environment, or given
by the session, never logged or shown), its responses bounded.

What it promises: the same face as a stdio `Process` (`connect`, `ended`, `why`, `exit_status`; no pid), so that a
connection's supervisor serves either alike; a response body (a JSON answer, or one event of a stream) past
`body_bytes_max` is cut off and the connection ended, saying so (`why`), rather than growing the daemon; the URL is
shown without a user or password. The daemon connects itself (no sandbox: there is no process of the server's here).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import httpx2
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

from devd.agent.profiles import shown_url


class TooLarge(Exception):
    """A response body went past the bound."""


class _Bounded(httpx2.AsyncByteStream):
    """A response body that raises TooLarge once it passed `limit` bytes (SSE streams are bounded per event by the
    SDK, but a JSON answer is read whole)."""

    def __init__(self, inner: Any, limit: int, endpoint: Endpoint, sse: bool) -> None:
        self.inner, self.limit, self.endpoint, self.sse = inner, limit, endpoint, sse

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.inner:
            seen += len(chunk)
            if seen > self.limit and not self.sse:
                self.endpoint.why = f"it sent a response longer than {self.limit} bytes, which devd does not read"
                self.endpoint.ended.set()
                raise TooLarge(self.endpoint.why)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Transport(httpx2.AsyncBaseTransport):
    def __init__(self, endpoint: Endpoint, limit: int) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.endpoint, self.limit = endpoint, limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        sse = response.headers.get("content-type", "").startswith("text/event-stream")
        response.stream = _Bounded(response.stream, self.limit, self.endpoint, sse)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class Endpoint:
    """One Streamable HTTP server, as a connection life's transport."""

    pid: int | None = None
    returncode: int | None = None

    def __init__(self, url: str, headers: Mapping[str, str], *, body_bytes_max: int) -> None:
        self.url, self.headers, self.body_bytes_max = url, dict(headers), body_bytes_max
        self.ended = anyio.Event()
        self.why: str | None = None

    def tail(self) -> str:
        return ""

    def exit_status(self) -> str:
        """Where the server is, for the sentence that says how its connection ended."""
        return f"its URL is {shown_url(self.url)}"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[TransportStreams]:
        """The read and write streams of a connection to the server; closed (and its session ended) on leaving."""
        client = httpx2.AsyncClient(  # as the SDK's own (create_mcp_http_client), with a bounded body
            headers=self.headers,
            timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
            transport=_Transport(self, self.body_bytes_max),
        )
        try:
            async with (
                client,
                streamable_http_client(self.url, http_client=client, max_sse_event_size=self.body_bytes_max) as streams,
            ):
                yield streams
        finally:
            self.ended.set()
