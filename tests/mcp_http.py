"""A Streamable HTTP MCP server on loopback for the tests: a real process (the SDK's test server, tests/mcp_server.py
`--http PORT`, or the reference server-everything `streamableHttp`), started on a free port, waited for until it
accepts connections, and stopped (SIGTERM, then SIGKILL) by its pid when the test is done."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

import pytest

from tests.mcp_npm import everything
from tests.mcp_place import SERVER

START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(argv: Sequence[str], port: int, env: dict[str, str] | None = None) -> Iterator[str]:
    """The server argv starts, listening on port: its MCP endpoint's URL. Its stderr goes to a file (a pipe no one
    reads would stop a server that logs each request once it filled)."""
    errors = tempfile.TemporaryFile()
    process = subprocess.Popen(
        argv, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=errors, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    errors.seek(0)
                    said = errors.read().decode(errors="replace")
                    pytest.fail(f"the MCP server {argv} did not listen on {port}: {said[-2000:]}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        errors.close()


@contextlib.contextmanager
def sdk_server() -> Iterator[str]:
    """tests/mcp_server.py over Streamable HTTP (the SDK's MCPServer: it speaks the 2026-07-28 revision)."""
    port = free_port()
    with serving([sys.executable, str(SERVER), "--http", str(port)], port) as url:
        yield url


@contextlib.contextmanager
def everything_server() -> Iterator[str]:
    """server-everything over Streamable HTTP (the TypeScript SDK 1.x: it speaks the handshake era only)."""
    port = free_port()
    with serving(["node", str(everything()), "streamableHttp"], port, {"PORT": str(port)}) as url:
        yield url
