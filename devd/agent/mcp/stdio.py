"""The stdio transport of an MCP server's process: the SDK's `Transport` (read and write streams of JSON-RPC
messages) over a process the daemon starts itself, so that its command line is the sandbox's and every read is
bounded (the SDK's own stdio client reads a line of any length and writes stderr to a file).

What it promises: a line from the server longer than `line_bytes_max`, or one that is not a JSON-RPC message, ends
the connection, saying so (`Process.why`) rather than growing the daemon or leaving a call waiting; stderr is kept as
its last `STDERR_TAIL_BYTES` (`Process.tail`), for the failure a call reports; `Process.ended` is set once the
server's stdout closed or the connection ended. Leaving the context stops the process: stdin closed, then SIGTERM and
SIGKILL of its whole process group, each after a grace period, shielded from cancellation, so no server outlives its
connection."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence

import anyio
import anyio.abc
import mcp_types
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream
from mcp.client._transport import TransportStreams
from mcp.shared.message import SessionMessage

from devd.agent import cgroups

log = structlog.get_logger("devd.mcp")

STDERR_TAIL_BYTES = 4096
STDIN_GRACE_S = 2.0  # for the server to exit once its stdin is closed
TERM_GRACE_S = 2.0  # after SIGTERM, before SIGKILL
KILL_WAIT_S = 5.0


class Process:
    """One server process, as a transport: `ended` once its output is over; `why` what ended it when it was not a
    plain exit; `tail` the end of its stderr."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str,
        owned_fds: Sequence[int] = (),
        line_bytes_max: int,
        group: cgroups.Group | None = None,
    ) -> None:
        # owned_fds: descriptors passed to the process (the workspace's) and closed here once it started (or failed)
        self.command, self.env, self.cwd, self.owned_fds = list(command), dict(env), cwd, tuple(owned_fds)
        self.line_bytes_max = line_bytes_max
        self.group = group  # its cgroups (devd.agent.cgroups), removed once it stopped
        self.ended = anyio.Event()
        self.why: str | None = None
        self._tail = bytearray()
        self.process: anyio.abc.Process | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def tail(self) -> str:
        """The last lines the server wrote to stderr (at most STDERR_TAIL_BYTES), as text."""
        return bytes(self._tail).decode("utf-8", "replace").strip()

    def exit_status(self) -> str:
        """How the process ended, in words, with its stderr's tail."""
        code = self.returncode
        said = "it is still running" if code is None else _status(code)
        tail = self.tail()
        return f"{said}; its stderr ends: {tail[-1000:]}" if tail else f"{said}; it wrote nothing to stderr"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[TransportStreams]:
        """The read and write streams of the running server (started here); the process is stopped on leaving."""
        try:
            with anyio.CancelScope(shield=True):  # once started, only the stop below may end it
                process = self.process = await anyio.open_process(
                    self.command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=self.cwd,
                    env=self.env,
                    start_new_session=True,  # its own process group, killed whole
                    pass_fds=self.owned_fds,
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._ungroup()
            raise
        finally:
            for fd in self.owned_fds:
                os.close(fd)
        to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](16)
        to_server, from_session = anyio.create_memory_object_stream[SessionMessage](16)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, process, to_session)
                tg.start_soon(self._write, process, from_session)
                tg.start_soon(self._stderr, process)
                try:
                    yield from_server, to_server
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop(process)
                for stream in (to_session, from_server, to_server, from_session):
                    await stream.aclose()
                await self._ungroup()
            self.ended.set()

    async def _ungroup(self) -> None:
        """Its cgroups removed (once the last of its processes is gone; else the next daemon's sweep removes them)."""
        if self.group is not None:
            left = await anyio.to_thread.run_sync(self.group.remove)
            if left is not None:
                log.warning("mcp.cgroup_left", why=left)

    async def _read(
        self, process: anyio.abc.Process, sink: anyio.abc.ObjectSendStream[SessionMessage | Exception]
    ) -> None:
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        try:
            async with sink:
                while True:
                    line = await lines.receive_until(b"\n", self.line_bytes_max)
                    if not line.strip():
                        continue
                    try:
                        message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                    except ValueError:
                        sample = line[:200].decode("utf-8", "replace")
                        self.why = f"it wrote a line to stdout that is not a JSON-RPC message: {sample!r}"
                        return
                    await sink.send(SessionMessage(message))
        except anyio.DelimiterNotFound:
            self.why = f"it sent a message longer than {self.line_bytes_max} bytes, which devd does not read"
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            self.ended.set()

    async def _write(self, process: anyio.abc.Process, source: anyio.abc.ObjectReceiveStream[SessionMessage]) -> None:
        assert process.stdin is not None
        try:
            async with source:
                async for item in source:
                    data = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send(data.encode() + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            self.ended.set()

    async def _stderr(self, process: anyio.abc.Process) -> None:
        assert process.stderr is not None
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            async for chunk in process.stderr:
                self._tail += chunk
                del self._tail[:-STDERR_TAIL_BYTES]

    async def _stop(self, process: anyio.abc.Process) -> None:
        """stdin closed; then SIGTERM, then SIGKILL of the whole process group, each after its grace period."""
        if process.stdin is not None:
            with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await process.stdin.aclose()
        for sig, grace in ((None, STDIN_GRACE_S), (signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, sig)
            if await _exited(process, grace):
                break
        # What the server started, in its group, dies with it (a server started under bubblewrap is in a pid
        # namespace of its own, which ends with bwrap).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            await process.aclose()


async def _exited(process: anyio.abc.Process, within_s: float) -> bool:
    """Whether the process exited within the time, by its returncode: asyncio's wait() also waits for its pipes to
    close, which a child that inherited them keeps open."""
    deadline = anyio.current_time() + within_s
    while process.returncode is None:
        if anyio.current_time() >= deadline:
            return False
        await anyio.sleep(0.01)
    return True


def _status(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"it was killed by {name}"
    return f"it exited with status {code}"
