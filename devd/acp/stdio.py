"""This process's stdin and stdout as async line streams, on the event loop (no thread): ACP's transport.

Reads wait for the descriptor to be readable and then take what is there; a regular file or /dev/null (input
redirected), which the event loop cannot wait on, is read directly, as it never blocks. Writes go out whole, in
order, one writer at a time; stdout is made non-blocking when it is a pipe or a socket (what an editor gives us), so
a slow reader holds up only the writer.
"""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator

import anyio

READ_BYTES = 1 << 16
LINE_BYTES_MAX = 64 << 20  # a prompt with embedded files can be large; past this the editor is not speaking ACP


class LineTooLong(Exception):
    """The editor sent a line longer than LINE_BYTES_MAX."""


def _streamlike(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


class Stdio:
    def __init__(self, fd_in: int = 0, fd_out: int = 1) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        self._lock = anyio.Lock()
        mode = os.fstat(fd_out).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.set_blocking(fd_out, False)

    async def lines(self) -> AsyncIterator[bytes]:
        """Each line from stdin, without its newline, until end of input."""
        buffer = bytearray()  # split only when a read brings a newline: a long line costs its length, not its square
        wait = _streamlike(self.fd_in)
        while True:
            if wait:
                try:
                    await anyio.wait_readable(self.fd_in)
                except PermissionError:  # epoll refuses it (/dev/null): such a file never blocks a read
                    wait = False
            else:
                await anyio.lowlevel.checkpoint()
            data = os.read(self.fd_in, READ_BYTES)
            if not data:
                if buffer.strip():
                    yield bytes(buffer)
                return
            buffer += data
            if b"\n" in data:
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield bytes(line)
            if len(buffer) > LINE_BYTES_MAX:
                raise LineTooLong(f"a line from the editor passed {LINE_BYTES_MAX} bytes")

    async def write(self, data: bytes) -> None:
        """Write data whole (lines from concurrent writers are never interleaved)."""
        async with self._lock:
            view = memoryview(data)
            while view:
                try:
                    written = os.write(self.fd_out, view)
                except BlockingIOError:
                    await anyio.wait_writable(self.fd_out)
                    continue
                view = view[written:]
