"""The model call's HTTP path (devd.agent.http.post) against real servers: no bound on calls in flight, connections
kept alive and reused, a chunked stream read to its end."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
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
    """An HTTP/1.1 server that keeps its connections open and answers every POST with one chunked stream; it counts
    the connections it accepted."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
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
