"""The agent runtime's HTTP: one client, a streamed POST (a model call) and a GET from checked addresses (httpx), and
one error for the network.

A client never reads proxies or certificates from the environment: what the daemon reaches is what its profiles say.
Every network error becomes a `TransportError`, so no other module needs to know how the bytes travel. Every request
asks for no content encoding, and a body in one is refused unread (`Encoded`): a body is never decoded.

The POST is HTTP/1.1 written here, on asyncio streams, with connections kept alive per origin and no bound on how many
(a daemon's model calls are at most one per session at a time: a pool bound made a session's call wait for another
session's to end, which looks like a slow model). A model streams hundreds of server-sent events a second per
session, one read each; httpx spent about 100 µs of the daemon's CPU on each (its pool's bookkeeping, h11's events,
a cancel scope per read), this path about a fifth of that: a read is de-chunked in place, and the silence between
reads is bounded by one timer per response, not one per read.

httpx is imported, and its client (with the TLS context that loads the CA bundle) made, at the first GET, not when the
daemon starts: the two cost a start about 70 ms on this machine, for a runtime that may never browse. The POST's TLS
context (the same CA bundle: certifi's) is made at the first https model call.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import anyio

if TYPE_CHECKING:
    import ssl

    import httpx

KEEPALIVE_S = 5.0  # an idle connection older than this is closed, not reused (as httpx's pool)
HEAD_BYTES_MAX = 64 << 10  # a response's status line and headers
READ_BYTES = 1 << 16


class TooLarge(Exception):
    """A body passed the bound its reader was given (`bytes_max`); `line_bytes`: how long its unfinished line was."""

    def __init__(self, bytes_max: int, line_bytes: int) -> None:
        super().__init__(f"the body passed {bytes_max} bytes")
        self.bytes_max, self.line_bytes = bytes_max, line_bytes


class TransportError(Exception):
    """The request did not get an answer (refused, reset, timed out, cut short); `why` says which."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Encoded(TransportError):
    """The body came in a content encoding (gzip, say) though none was asked for: it is not read (a few KiB of gzip
    inflate to GiB), and the same request would be answered the same way."""


def _why(e: httpx.HTTPError) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if text != type(e).__name__ else text


class Client:
    """The agent runtime's connections, pooled; the httpx client behind them is made at the first request and closed
    when the block using this one ends. `read_timeout_s` bounds the silence between two reads (a model may think)."""

    def __init__(self, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 300.0) -> None:
        self._timeouts = connect_timeout_s, read_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}  # kept-alive POST connections, by origin
        self._tls: ssl.SSLContext | None = None

    def _httpx(self) -> httpx.AsyncClient:
        if self._client is None:
            import httpx

            connect_timeout_s, read_timeout_s = self._timeouts
            timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
            self._client = httpx.AsyncClient(timeout=timeout, trust_env=False, follow_redirects=False)
        return self._client

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for kept in self._idle.values():
            for connection in kept:
                connection.writer.transport.abort()
        self._idle.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            import ssl

            try:
                import certifi
            except ImportError:  # pragma: no cover (httpx depends on it)
                self._tls = ssl.create_default_context()
            else:
                self._tls = ssl.create_default_context(cafile=certifi.where())
            self._tls.set_alpn_protocols(["http/1.1"])
        return self._tls

    async def _connection(self, scheme: str, host: str, port: int) -> _Connection:
        """A kept-alive connection to the origin (one the server has not closed, idle less than KEEPALIVE_S), else a
        new one."""
        kept = self._idle.get((scheme, host, port))
        now = time.monotonic()
        while kept:
            connection = kept.pop()
            if now - connection.idle_since < KEEPALIVE_S and not connection.gone():
                return connection
            connection.writer.transport.abort()
        connect_timeout_s, _ = self._timeouts
        tls = self._tls_context() if scheme == "https" else None
        try:
            with anyio.fail_after(connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None, limit=HEAD_BYTES_MAX
                )
        except TimeoutError:
            raise TransportError(
                f"ConnectTimeout: no connection to {host}:{port} within {connect_timeout_s:g} s"
            ) from None
        except OSError as e:  # refused, unreachable, a name that does not resolve, a certificate refused
            raise TransportError(f"ConnectError: {e}") from None
        return _Connection((scheme, host, port), reader, writer)

    def _keep(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, []).append(connection)


def new_client(*, connect_timeout_s: float = 10.0, read_timeout_s: float = 300.0) -> Client:
    """A client for the agent runtime (see `Client`)."""
    return Client(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)


class _Connection:
    """One HTTP/1.1 connection of the POST path."""

    __slots__ = ("origin", "reader", "writer", "idle_since")

    def __init__(self, origin: tuple[str, str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.origin, self.reader, self.writer = origin, reader, writer
        self.idle_since = 0.0

    def gone(self) -> bool:
        """The server closed it (or sent something unasked) while it was idle."""
        return self.writer.transport.is_closing() or self.reader.at_eof() or bool(self.reader._buffer)  # type: ignore[attr-defined]


class _Headers(dict[str, str]):
    """A response's headers, their names in lower case (a repeated one's values joined by ", ")."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


class Response:
    """A response whose body is still arriving. Its body is read as it came (never decoded): a body in a content
    encoding other than identity is refused (`Encoded`) before a byte of it is read, since every request asks for
    none (`Accept-Encoding: identity`) and a compressed body could inflate past every bound."""

    def __init__(self, status: int, headers: Mapping[str, str], body: AsyncIterator[bytes]) -> None:
        self._body = body
        self.status = status
        self.headers: Mapping[str, str] = headers

    def _chunks(self) -> AsyncIterator[bytes]:
        encodings = [e.strip().lower() for e in self.headers.get("content-encoding", "").split(",")]
        if any(e not in ("", "identity") for e in encodings):
            shown = self.headers.get("content-encoding", "")[:100].encode("ascii", "backslashreplace").decode()
            raise Encoded(
                f"the server sent its answer in content encoding {shown!r}, which devd does not decode (it asks for "
                "identity: a compressed body can inflate past every bound); make the server answer uncompressed"
            )
        return self._body

    async def lines(self, bytes_max: int) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends (LF, CRLF or CR, as server-sent events end them),
        decoded as UTF-8. `TooLarge` once more than `bytes_max` bytes of body came, line ends or not: what is held is at
        most `bytes_max` and one read (the body is never decoded, so a read is what the network gave)."""
        held = bytearray()  # the line not yet ended
        received = 0
        async for chunk in self._chunks():
            received += len(chunk)
            if received > bytes_max:
                raise TooLarge(bytes_max, len(held) + len(chunk))
            # Only the new bytes are split (a long line is not scanned again at each read). A CRLF split across
            # two reads ends a line at the CR and adds an empty one, which server-sent events ignore.
            for piece in chunk.splitlines(keepends=True):
                held += piece
                if held.endswith((b"\n", b"\r")):
                    line = held.rstrip(b"\r\n").decode("utf-8", "replace")
                    held.clear()
                    yield line
        if held:
            yield held.decode("utf-8", "replace")

    async def read(self, limit_bytes: int) -> tuple[bytes, int]:
        """Up to `limit_bytes` of the body, and how many bytes past that were cut (the rest is not read)."""
        kept = bytearray()
        cut = 0
        async for chunk in self._chunks():
            room = limit_bytes - len(kept)
            kept += chunk[:room]
            cut += max(0, len(chunk) - room)
            if cut:
                break  # do not read a large body to its end just to count it
        return bytes(kept), cut


@asynccontextmanager
async def post(client: Client, url: str, body: bytes, headers: Mapping[str, str]) -> AsyncIterator[Response]:
    """POST and hand over the response as soon as its head is in; leaving the block (or being cancelled) closes it,
    unless its body was read to its end, when the connection is kept for the next POST to the same origin."""
    parts = urlsplit(url)
    scheme, host = parts.scheme, parts.hostname
    if scheme not in ("http", "https") or not host:
        raise TransportError(f"UnsupportedProtocol: {url!r} is not an http:// or https:// URL")
    try:
        host = host.encode("idna").decode("ascii") if not host.isascii() else host
        port = parts.port or (443 if scheme == "https" else 80)
    except (UnicodeError, ValueError) as e:
        raise TransportError(f"InvalidURL: {e}") from None
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    shown_host = f"[{host}]" if ":" in host else host
    fields = {"Host": shown_host if parts.port is None else f"{shown_host}:{port}", "User-Agent": "devd"}
    fields |= headers
    if parts.username is not None or parts.password is not None:  # as httpx does: the URL's user is Basic auth
        user = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
        fields["Authorization"] = "Basic " + base64.b64encode(user).decode("ascii")
    fields["Content-Length"] = str(len(body))
    if any(c in k or c in v for k, v in fields.items() for c in "\r\n\0") or any(c in target for c in " \r\n\0"):
        raise TransportError("LocalProtocolError: a request header holds a line break or NUL; nothing was sent")
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    connection = await client._connection(scheme, host, port)
    _, read_timeout_s = client._timeouts
    exchange = _Exchange(client, connection, read_timeout_s)
    try:
        try:
            with anyio.fail_after(read_timeout_s):
                connection.writer.write(head.encode("latin-1", "replace") + body)
                await connection.writer.drain()
            status, response_headers = await exchange.head()
        except TimeoutError:
            raise TransportError(f"WriteTimeout: the request was not taken within {read_timeout_s:g} s") from None
        except OSError as e:
            raise TransportError(f"WriteError: {e}") from None
        yield Response(status, response_headers, exchange.body())
    finally:
        exchange.end()


class _Exchange:
    """One response read off a connection: its head, then its body de-chunked as it comes; the silence between two
    reads bounded by one timer (re-armed only when it fires), not a cancel scope per read."""

    def __init__(self, client: Client, connection: _Connection, read_timeout_s: float) -> None:
        self.client, self.connection, self.read_timeout_s = client, connection, read_timeout_s
        self.reader = connection.reader
        self.loop = asyncio.get_running_loop()
        self.last_read = self.loop.time()
        self.timer: asyncio.TimerHandle | None = self.loop.call_at(self.last_read + read_timeout_s, self._silent)
        self.timed_out = False
        self.finished = False  # the body was read to its end
        self.reusable = True

    def _silent(self) -> None:
        due = self.last_read + self.read_timeout_s
        if self.loop.time() < due:
            self.timer = self.loop.call_at(due, self._silent)
            return
        self.timer = None
        self.timed_out = True
        self.reader.set_exception(TimeoutError())  # the read waiting now (or the next) raises it

    def end(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.finished and self.reusable and not self.timed_out:
            self.client._keep(self.connection)
        else:
            self.connection.writer.transport.abort()  # mid-body (cancelled, cut short): never reused

    async def _read(self, most: int = READ_BYTES) -> bytes:
        try:
            data = await self.reader.read(most)
        except TimeoutError:
            raise TransportError(f"ReadTimeout: the server sent nothing for {self.read_timeout_s:g} s") from None
        except OSError as e:
            raise TransportError(f"ReadError: {e}") from None
        self.last_read = self.loop.time()
        return data

    async def head(self) -> tuple[int, _Headers]:
        while True:
            try:
                raw = await self.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                raise TransportError(
                    "RemoteProtocolError: the server closed the connection without an answer"
                ) from None
            except asyncio.LimitOverrunError:
                raise TransportError(f"RemoteProtocolError: the answer's head passed {HEAD_BYTES_MAX} bytes") from None
            except TimeoutError:
                raise TransportError(f"ReadTimeout: the server sent nothing for {self.read_timeout_s:g} s") from None
            except OSError as e:
                raise TransportError(f"ReadError: {e}") from None
            self.last_read = self.loop.time()
            lines = raw[:-4].decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise TransportError(f"RemoteProtocolError: not an HTTP/1.1 status line: {lines[0][:100]!r}")
            headers = _Headers()
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon:
                    raise TransportError(f"RemoteProtocolError: a malformed header line: {line[:100]!r}")
                name, value = name.strip().lower(), value.strip()
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
            if not 100 <= int(code) < 200:  # an informational answer (100 Continue) is followed by the real one
                break
        self.status = int(code)
        if version == "HTTP/1.0" or "close" in headers.get("connection", "").lower():
            self.reusable = False
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self.length: int | None = None
        if not self.chunked and length is not None:
            if not length.isdigit():
                raise TransportError(f"RemoteProtocolError: a malformed Content-Length: {length[:50]!r}")
            self.length = int(length)
        elif not self.chunked:
            self.reusable = False  # its body ends when the server closes
        return self.status, headers

    async def body(self) -> AsyncIterator[bytes]:
        if self.chunked:
            async for data in self._chunked():
                yield data
        elif self.length is not None:
            left = self.length
            while left:
                data = await self._read(min(left, READ_BYTES))
                if not data:
                    raise TransportError("RemoteProtocolError: the server closed the connection mid-body")
                left -= len(data)
                yield data
            self.finished = True
        else:
            while data := await self._read():
                yield data
            self.finished = True

    async def _chunked(self) -> AsyncIterator[bytes]:
        """The chunked body's data, a read at a time: every whole chunk (and the part come of one not whole) in what
        has been read is given as one piece."""
        buf = b""
        left = 0  # bytes of the current chunk's data still to come; then its CRLF
        crlf = False  # a chunk's data ended: its CRLF is next
        while True:
            data = await self._read()
            if not data:
                raise TransportError("RemoteProtocolError: the server closed the connection mid-body")
            buf = buf + data if buf else data
            out: list[bytes] = []
            at = 0
            while True:
                if left:
                    piece = buf[at : at + left]
                    out.append(piece)
                    at += len(piece)
                    left -= len(piece)
                    if left:
                        break
                    crlf = True
                if crlf:
                    if len(buf) - at < 2:
                        break
                    if buf[at : at + 2] != b"\r\n":
                        raise TransportError("RemoteProtocolError: malformed chunk footer")
                    at += 2
                    crlf = False
                end = buf.find(b"\r\n", at)
                if end < 0:
                    if len(buf) - at > 1024:
                        raise TransportError("RemoteProtocolError: a chunk size line passed 1024 bytes")
                    break
                size_text = buf[at:end].split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise TransportError(f"RemoteProtocolError: malformed chunk size {size_text[:20]!r}") from None
                if size < 0:
                    raise TransportError(f"RemoteProtocolError: malformed chunk size {size_text[:20]!r}")
                at = end + 2
                if size == 0:  # the last chunk: trailers (if any), then an empty line
                    tail = buf[at - 2 :]
                    if self._ended(tail):  # finished before its last data is given: a reader that stops at the
                        if out:  # stream's own end ([DONE]) leaves the connection reusable
                            yield b"".join(out)
                        return
                    if out:
                        yield b"".join(out)
                    await self._trailers(tail)
                    return
                left = size
            buf = buf[at:]
            if out:
                yield b"".join(out) if len(out) > 1 else out[0]

    def _ended(self, tail: bytes) -> bool:
        """Whether `tail` (from the CRLF of the last chunk's size line on) holds the end of the trailers: then the
        body is finished; bytes after it, unasked for, make the connection one not to reuse."""
        end = tail.find(b"\r\n\r\n")
        if end < 0:
            return False
        self.finished = True
        if len(tail) > end + 4:
            self.reusable = False
        return True

    async def _trailers(self, tail: bytes) -> None:
        """Read on to the end of the trailers after the last chunk (see `_ended`)."""
        while not self._ended(tail):
            if len(tail) > HEAD_BYTES_MAX:
                raise TransportError("RemoteProtocolError: the trailers passed their bound")
            data = await self._read()
            if not data:
                raise TransportError("RemoteProtocolError: the server closed the connection mid-body")
            tail += data


@asynccontextmanager
async def get(client: Client, url: str, addresses: Sequence[str]) -> AsyncIterator[Response]:
    """GET `url` from one of `addresses` (checked by the caller; tried in order until one connects), as `post` hands
    over its response. The host is not resolved again, so what is reached is what was checked; its name still goes
    in the Host header and, for https, in the TLS server name, against which the certificate is verified. No redirect
    is followed (the caller checks each hop), and the connection is closed after the response: one opened, and its
    certificate verified, for one name is never reused for another name at the same address."""
    import httpx

    streaming = client._httpx()
    target = httpx.URL(url)
    headers = {"Host": target.netloc.decode("ascii"), "Connection": "close", "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": target.raw_host.decode("ascii")} if target.scheme == "https" else {}
    refused: httpx.ConnectError | None = None
    for address in addresses:
        request = streaming.build_request("GET", target.copy_with(host=address), headers=headers, extensions=extensions)
        try:
            response = await streaming.send(request, stream=True)
        except httpx.ConnectError as e:
            refused = e  # the next address may answer
            continue
        except httpx.HTTPError as e:
            raise TransportError(_why(e)) from None
        try:
            yield Response(response.status_code, response.headers, _raw(response))
        finally:
            await response.aclose()
        return
    raise TransportError(_why(refused) if refused is not None else "no address to connect to")


async def _raw(response: httpx.Response) -> AsyncIterator[bytes]:
    """An httpx response's body as it came, its errors `TransportError`."""
    import httpx

    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        raise TransportError(_why(e)) from None


def host_port(url: str) -> tuple[str, int]:
    """The host of a valid http(s) URL as it is resolved (an internationalized name in its IDNA form, an IPv6
    address without brackets) and its port (the scheme's when none is given)."""
    import httpx

    parsed = httpx.URL(url)
    return parsed.raw_host.decode("ascii"), parsed.port or (443 if parsed.scheme == "https" else 80)


def join(url: str, location: str) -> str | None:
    """Where a redirect's `Location` leads from `url` (it may be relative); None when it is not a URL."""
    import httpx

    try:
        return str(httpx.URL(url).join(location))
    except httpx.InvalidURL:
        return None


def valid_url(url: str) -> str | None:
    """None when httpx can send to `url` over http(s), else why not."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        return str(e)
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:  # `host` would decode IDNA, which may fail
        return "it is not an http:// or https:// URL"
    return None
