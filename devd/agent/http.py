"""The only home of httpx: one client, a streamed POST and a GET from checked addresses, and one error for the network.

A client never reads proxies or certificates from the environment (`trust_env=False`): what the daemon reaches is
what its profiles say. Every httpx error becomes a `TransportError`, so no other module needs to know httpx. Every
request asks for no content encoding, and a body in one is refused unread (`Encoded`): a body is never decoded.

httpx is imported, and its client (with the TLS context that loads the CA bundle) made, at the first request, not
when the daemon starts: the two cost a start about 70 ms on this machine (half of what `devd serve` takes to its first
answer), for a runtime that may never call out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


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
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def new_client(*, connect_timeout_s: float = 10.0, read_timeout_s: float = 300.0) -> Client:
    """A client for the agent runtime (see `Client`)."""
    return Client(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)


class Response:
    """A response whose body is still arriving. Its body is read as it came (httpx never decodes it): a body in a
    content encoding other than identity is refused (`Encoded`) before a byte of it is read, since every request
    asks for none (`Accept-Encoding: identity`) and a compressed body could inflate past every bound."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: Mapping[str, str] = response.headers

    def _chunks(self) -> AsyncIterator[bytes]:
        encodings = [e.strip().lower() for e in self.headers.get("content-encoding", "").split(",")]
        if any(e not in ("", "identity") for e in encodings):
            shown = self.headers.get("content-encoding", "")[:100].encode("ascii", "backslashreplace").decode()
            raise Encoded(
                f"the server sent its answer in content encoding {shown!r}, which devd does not decode (it asks for "
                "identity: a compressed body can inflate past every bound); make the server answer uncompressed"
            )
        return self._response.aiter_raw()

    async def lines(self, bytes_max: int) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends (LF, CRLF or CR, as server-sent events end them),
        decoded as UTF-8. `TooLarge` once more than `bytes_max` bytes of body came, line ends or not: what is held is at
        most `bytes_max` and one read (the body is never decoded, so a read is what the network gave)."""
        import httpx

        held = bytearray()  # the line not yet ended
        received = 0
        try:
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
        except httpx.HTTPError as e:
            raise TransportError(_why(e)) from None

    async def read(self, limit_bytes: int) -> tuple[bytes, int]:
        """Up to `limit_bytes` of the body, and how many bytes past that were cut (the rest is not read)."""
        import httpx

        kept = bytearray()
        cut = 0
        try:
            async for chunk in self._chunks():
                room = limit_bytes - len(kept)
                kept += chunk[:room]
                cut += max(0, len(chunk) - room)
                if cut:
                    break  # do not read a large body to its end just to count it
        except httpx.HTTPError as e:
            raise TransportError(_why(e)) from None
        return bytes(kept), cut


@asynccontextmanager
async def post(client: Client, url: str, body: bytes, headers: Mapping[str, str]) -> AsyncIterator[Response]:
    """POST and hand over the response as soon as its head is in; leaving the block (or being cancelled) closes it."""
    streaming = client._httpx()
    import httpx

    try:
        async with streaming.stream("POST", url, content=body, headers=dict(headers)) as response:
            yield Response(response)
    except httpx.HTTPError as e:
        raise TransportError(_why(e)) from None


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
            yield Response(response)
        finally:
            await response.aclose()
        return
    raise TransportError(_why(refused) if refused is not None else "no address to connect to")


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
