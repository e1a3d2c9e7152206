"""docs/protocol.md tells the truth: every ```jsonl transcript in it is replayed against a real daemon, and every
line the daemon sends must be exactly the documented one.

Transcript syntax: `> LINE` is sent by the client, `< LINE` is the next line the daemon must send; a digit before
the arrow (`2>`, `2<`) names another connection open at the same time. Each block gets fresh connections (Unix,
or TCP for ```` ```jsonl tcp ````, where `$TOKEN` in client lines stands for the token); all blocks run in order
against one daemon. After a block, no connection may have anything more to read.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.daemon import devd, free_port, stop, wait_connectable, wait_token
from tests.helpers import DOC, Block, transcripts

READ_TIMEOUT_S = 10.0
QUIET_S = 0.05  # how long a connection must stay silent after its block


class Connection:
    def __init__(self, address: str | Path) -> None:
        address = str(address)
        if address.startswith("tcp://"):
            host, port = address[len("tcp://") :].rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(READ_TIMEOUT_S)
            self.sock.connect(address)
        self.buffer = b""

    def readline(self) -> str:
        while b"\n" not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                return "(the daemon closed the connection)"
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def rest(self) -> bytes:
        """Whatever arrives within QUIET_S (b"" at end of stream)."""
        self.sock.settimeout(QUIET_S)
        try:
            return self.buffer + self.sock.recv(65536)
        except TimeoutError:
            return self.buffer

    def close(self) -> None:
        self.sock.close()


TIME = re.compile(r'"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"')  # `$TIME` in a daemon line stands for one


def replay(block: Block, address: str | Path, token: str) -> list[tuple[str, str, str]]:
    """The block as it happens: client lines as sent, daemon lines as received."""
    connections: dict[str, Connection] = {}
    happened = []
    try:
        for name, arrow, text in block.lines:
            if name not in connections:
                connections[name] = Connection(address)
            conn = connections[name]
            if arrow == ">":
                conn.sock.sendall(text.replace("$TOKEN", token).encode() + b"\n")
                happened.append((name, arrow, text))
            else:
                happened.append((name, arrow, TIME.sub('"$TIME"', conn.readline())))
        for name, conn in connections.items():
            if extra := conn.rest():
                happened.append((name, "<", extra.decode(errors="replace").rstrip("\n")))
    finally:
        for conn in connections.values():
            conn.close()
    return happened


def test_the_protocol_document_has_transcripts_of_every_kind() -> None:
    blocks = transcripts(DOC.read_text())
    assert len(blocks) >= 4
    assert any(b.tcp for b in blocks)
    assert any(name != "1" for b in blocks for name, _, _ in b.lines)
    assert all(b.lines and b.lines[0][1] == ">" for b in blocks)


def test_every_transcript_in_the_protocol_document_replays_exactly(tmp_path: Path) -> None:
    blocks = transcripts(DOC.read_text())
    port = free_port()
    socket_path = tmp_path / "run" / "devd.sock"
    with devd(tmp_path, "--listen", f"tcp://127.0.0.1:{port}") as proc:
        wait_connectable(socket_path, proc).close()
        token = wait_token(tmp_path / "state", proc)
        for block in blocks:
            address = f"tcp://127.0.0.1:{port}" if block.tcp else socket_path
            happened = replay(block, address, token)
            if happened != block.lines:
                shown = "\n".join(f"{'' if n == '1' else n}{a} {t}" for n, a, t in happened)
                pytest.fail(f"{DOC.name}: the block at line {block.start_line} replays as\n{shown}")
        assert stop(proc) == 0
