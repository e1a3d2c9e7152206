"""The model call's HTTP path (devd.agent.http.post) against real servers: no bound on calls in flight, connections
kept alive and reused, a chunked stream read to its end."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from devd.agent import http
from devd.agent.model import ModelUnavailable, complete
from devd.agent.profiles import Profile
from devd.messages import Message
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]

CALLS = 120  # past httpx's default pool of 100 connections


def profile(base_url: str) -> Profile:
    return Profile(name="coder", base_url=base_url, model="m1", workspace_roots=("/",))


async def test_more_model_calls_than_a_pool_of_100_are_in_flight_at_once(standin: Standin) -> None:
    everyone_asked = threading.Event()
    standin.script(*[Scripted(text="hi", held=everyone_asked, held_after=1)] * CALLS)
    texts: list[str | None] = []

    async def ask(client: http.Client) -> None:
        done = await complete(client, profile(standin.url), [Message(User="go")], environ={}, exec_available=True)
        texts.append(done.text)

    async with http.new_client() as client, anyio.create_task_group() as tg:
        for _ in range(CALLS):
            tg.start_soon(ask, client)
        with anyio.move_on_after(10):
            while standin.count < CALLS:  # each request is held by the server until all have come
                await anyio.sleep(0.02)
        at_once = standin.count
        everyone_asked.set()
    assert (at_once, texts) == (CALLS, ["hi"] * CALLS)


def _chunked(*events: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + body
        + b"0\r\n\r\n"
    )


class KeepAlive:
    """An HTTP/1.1 server that keeps its connections open and answers every POST with one chunked stream (over TLS
    with `tls`); it counts the connections it accepted."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        self.tls = tls
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://localhost:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        held = b""
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):  # the client refused the certificate
                conn.close()
                return
        with conn:
            while data := conn.recv(65536):
                held += data
                head, sep, rest = held.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]) if sep else -1
                if sep and len(rest) >= length:
                    held = rest[length:]
                    chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}'
                    conn.sendall(_chunked(chunk + b"\n\n", b"data: [DONE]\n\n"))


@pytest.fixture
def keep_alive() -> Iterator[KeepAlive]:
    server = KeepAlive()
    yield server
    server.listener.close()


async def test_a_second_model_call_reuses_the_connection_the_first_left_at_its_end(keep_alive: KeepAlive) -> None:
    got: list[Any] = []
    async with http.new_client() as client:
        for _ in range(2):
            done = await complete(
                client, profile(keep_alive.url), [Message(User="go")], environ={}, exec_available=True
            )
            got.append(done.text)
    assert (got, keep_alive.connections) == (["hi", "hi"], 1)


async def test_a_stream_silent_past_the_read_timeout_is_given_up_saying_so(standin: Standin) -> None:
    standin.script(Scripted(text="never finished", hang=True))
    async with http.new_client(read_timeout_s=0.3) as client:
        with pytest.raises(ModelUnavailable, match="ReadTimeout: the server sent nothing for 0.3 s"):
            await complete(
                client, profile(standin.url), [Message(User="go")], environ={}, exec_available=True, attempts=1
            )


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for localhost: (the CA's file, the server's certificate, its key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def made(
        subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey
    ) -> x509.Certificate:
        builder = x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        builder = builder.issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        builder = builder.public_key(key.public_key()).serial_number(x509.random_serial_number())
        builder = builder.not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(
            now + datetime.timedelta(days=1)
        )
        if subject == issuer:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = made("test CA", ca_key, "test CA", ca_key)
    cert = made("localhost", key, "test CA", ca_key)
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    unencrypted = serialization.NoEncryption()
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, unencrypted))
    return paths


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[KeepAlive, Path]]:
    ca, cert, key = _certificates(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = KeepAlive(context)
    yield server, ca
    server.listener.close()


async def test_an_https_model_server_is_verified_against_the_trusted_authorities(
    tls_server: tuple[KeepAlive, Path],
) -> None:
    server, ca = tls_server
    got = []
    async with http.new_client() as client:
        with pytest.raises(ModelUnavailable, match="CERTIFICATE_VERIFY_FAILED"):  # its CA is not certifi's
            await complete(
                client, profile(server.url), [Message(User="go")], environ={}, exec_available=True, attempts=1
            )
        client._tls = ssl.create_default_context(cafile=ca)  # the same check, trusting the test's CA
        for _ in range(2):
            done = await complete(client, profile(server.url), [Message(User="go")], environ={}, exec_available=True)
            got.append(done.text)
    assert (got, server.connections) == (["hi", "hi"], 2)  # the refused one, then one kept alive for both
