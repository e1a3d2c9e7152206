"""Benchmarks, each against a baseline measured in the same run (machines here are noisy: trust the ratios).

python -m benchmarks.bench core     # devd's step vs the naive ABI dance, session creation, RSS per idle session
python -m benchmarks.bench daemon   # N clients in another process: devd vs the durable floor (a minimal server
                                    # committing each request to SQLite before it answers) vs that floor stepping the
                                    # core too vs devd's dispatch with stub handlers vs a minimal anyio echo, each
                                    # server its own process, rounds alternated
python -m benchmarks.bench soak --minutes N  # the daemon for N minutes under mixed clients and watchers, restarted
                                    # every minute (SIGTERM, SIGKILL by turns): its resources' curve and lost answers
python -m benchmarks.bench long     # one session's cost as it grows, turn after turn, and after a restart; or one
                                    # turn of many tool calls (--big-turn N); in benchmarks/bench_long.py
python -m benchmarks.bench fleet    # one and two daemons on one PostgreSQL vs the SQLite daemon, and a session's move
                                    # between daemons; in benchmarks/bench_fleet.py
python -m benchmarks.bench agent    # the agent runtime's own time per model call and per tool call, against the
                                    # stand-in model server's, and a turn of 50 tool calls end to end
python -m benchmarks.bench approvals  # what approvals, spend ceilings and the trace add to a turn
python -m benchmarks.bench idle     # an idle daemon's wake-ups a second, against a process blocked in accept()
python -m benchmarks.bench chat     # a model's first streamed chunk to devd chat's screen, against reading it
                                    # directly; in bench_chat.py
python -m benchmarks.bench start    # exec to the first answer: devd vs a minimal Python daemon, without and with the
                                    # core loaded; in bench_start.py
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import dataclasses
import gc
import io
import itertools
import math
import os
import random
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec

from devd.messages import Call
from tests.helpers import seed_turn  # the seed turn the tests check, step for step

TURNS_PER_SESSION = 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Naive:
    """The ABI dance as the seed's host does it, with wasmtime-py's checked API (Func.__call__, Memory.read/write)."""

    def __init__(self, engine: Any, module: Any) -> None:
        import wasmtime

        self.store = wasmtime.Store(engine)
        self.store.set_limits(memory_size=64 << 20)
        self.store.set_epoch_deadline(1 << 30)
        ex: Any = wasmtime.Instance(self.store, module, []).exports(self.store)
        self.memory = ex["memory"]
        self.alloc, self.release, self.new = ex["dev_alloc"], ex["dev_release"], ex["dev_new"]
        self.step_fn, self.free = ex["dev_step"], ex["dev_free"]
        self.out = self.alloc(self.store, 12)
        cfg = b"{}"
        ptr = self.alloc(self.store, len(cfg))
        self.memory.write(self.store, cfg, ptr)
        assert self.new(self.store, ptr, len(cfg), self.out) == 0
        self.release(self.store, ptr, len(cfg))
        self.handle = int.from_bytes(self.memory.read(self.store, self.out, self.out + 8), "little")

    def step(self, data: bytes) -> bytes:
        s = self.store
        s.set_epoch_deadline(1 << 30)
        ptr = self.alloc(s, len(data))
        self.memory.write(s, data, ptr)
        rc = self.step_fn(s, self.handle, ptr, len(data), self.out)
        assert rc == 0, rc
        head = self.memory.read(s, self.out, self.out + 8)
        p, n = int.from_bytes(head[:4], "little"), int.from_bytes(head[4:], "little")
        answer = bytes(self.memory.read(s, p, p + n))
        self.free(s, self.out)
        self.release(s, ptr, len(data))
        return answer


def bench_core(rounds: int, sessions: int) -> dict[str, float]:
    from devd.host import Core

    core = Core.open()
    # Each round: a fresh session runs the seed's turn once to warm its memory, then the same turn again, measured.
    warm, turn_events = seed_turn(1, 1), seed_turn(2, 8)

    def timed_turn(step: Callable[[bytes], bytes]) -> float:
        for e in warm:
            step(e)
        started = time.perf_counter()
        for e in turn_events:
            step(e)
        return time.perf_counter() - started

    def devd_turn() -> float:
        s = core.new()
        elapsed = timed_turn(s.step_raw)
        s.close()
        return elapsed

    def naive_turn() -> float:
        n = _Naive(core._engine, core._module)
        elapsed = timed_turn(n.step)
        n.store.close()
        return elapsed

    # The answers must be the same, or the comparison means nothing.
    check = core.new()
    naive = _Naive(core._engine, core._module)
    assert [check.step_raw(e) for e in warm + turn_events] == [naive.step(e) for e in warm + turn_events]
    check.close()
    naive.store.close()

    devd_times, naive_times = [], []
    for _ in range(rounds):  # interleaved, so drift on a noisy machine hits both alike
        devd_times.append(devd_turn())
        naive_times.append(naive_turn())
    per_step = statistics.median(devd_times) / len(turn_events)
    naive_step = statistics.median(naive_times) / len(turn_events)

    create = []
    for _ in range(rounds):
        started = time.perf_counter()
        s = core.new()
        create.append(time.perf_counter() - started)
        s.close()

    gc.collect()
    before = _rss()
    live = [core.new() for _ in range(sessions)]
    rss_per_session = (_rss() - before) / sessions
    for s in live:
        s.close()
    core.close()
    return {
        "devd_us_per_step": per_step * 1e6,
        "devd_steps_per_s": 1 / per_step,
        "naive_us_per_step": naive_step * 1e6,
        "naive_steps_per_s": 1 / naive_step,
        "ratio_devd_over_naive": per_step / naive_step,
        "new_session_us": statistics.median(create) * 1e6,
        "rss_kib_per_idle_session": rss_per_session / 1024,
        "idle_sessions": sessions,
    }


# -- the daemon under load ------------------------------------------------------------------------------------------


def _echo_server(socket_path: str) -> None:
    """devd's transport and dispatcher (`devd serve` minus the core and the store): steps answer [] at once."""
    import anyio

    from devd import log
    from devd.addresses import UnixListen
    from devd.config import Settings
    from devd.protocol import NewParams, SessionResult, StepParams, StepResult
    from devd.server.daemon import Daemon, build
    from devd.server.listeners import bind
    from devd.server.methods import METHODS, Call  # noqa: F401
    from devd.storage.memory import MemoryStore

    async def new(call: Call, params: NewParams) -> SessionResult:
        return SessionResult(params.session or "echo")

    async def step(call: Call, params: StepParams) -> StepResult:
        return StepResult(msgspec.Raw(b"[]"))

    stubs = {
        **METHODS,
        "session/new": msgspec.structs.replace(METHODS["session/new"], handler=new),
        "session/step": msgspec.structs.replace(METHODS["session/step"], handler=step),
    }
    log.configure("json", "warning")
    settings = Settings(state_dir=Path(tempfile.mkdtemp()), socket_path=Path(socket_path))
    registry, dispatcher = build(settings, None, MemoryStore(), methods=stubs)  # type: ignore[arg-type]
    daemon = Daemon(settings, registry, dispatcher, None)
    listeners = [bind(UnixListen(Path(socket_path)))]
    ready = lambda: print("ready", flush=True)  # noqa: E731
    anyio.run(daemon.serve, listeners, ready, backend="asyncio", backend_options=_uvloop_options())


# A floor below devd's transport: anyio streams and msgspec, nothing else. It reads what devd reads (a request line,
# its envelope decoded with params left raw) and writes what an empty step writes, so that the gap between it and
# `_echo_server` is devd's transport and dispatch, and the gap above that is the core, the journal and the fsync.


class _EchoRequest(msgspec.Struct):
    id: int | str | None = None
    method: str = ""
    params: msgspec.Raw = msgspec.Raw(b"{}")


class _EchoActions(msgspec.Struct):
    actions: list[Any] = msgspec.field(default_factory=list)


class _EchoResponse(msgspec.Struct):
    jsonrpc: str
    id: int | str | None
    result: _EchoActions


def _uvloop_options() -> dict[str, Any]:
    """anyio's asyncio backend on uvloop when it is installed, as `devd serve` runs, so every server has one loop."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _anyio_echo_server(socket_path: str) -> None:
    """The floor: a minimal NDJSON JSON-RPC echo on anyio, one task per connection; every request answers no actions."""
    import anyio
    import anyio.abc

    decode = msgspec.json.Decoder(_EchoRequest).decode
    encode_reply = msgspec.json.Encoder().encode
    empty = _EchoActions()

    async def connection(stream: anyio.abc.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                try:
                    buffer += await stream.receive(65536)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
                *lines, buffer = buffer.split(b"\n")
                replies = [encode_reply(_EchoResponse("2.0", decode(line).id, empty)) + b"\n" for line in lines if line]
                if replies:
                    try:
                        await stream.send(b"".join(replies))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        return

    async def serve() -> None:
        listener = await anyio.create_unix_listener(socket_path)
        print("ready", flush=True)
        await listener.serve(connection)

    anyio.run(serve, backend="asyncio", backend_options=_uvloop_options())


# The durable floor: what a step's durability costs at the least, on this disk, in this language. asyncio on uvloop,
# msgspec, one SQLite file in WAL mode with synchronous=FULL, one commit thread doing group commits (the requests
# queued while a commit runs share the next one, in one INSERT statement), each request one row holding its line, and
# each answered only after the commit holding its row. devd pays for everything it does on top of this.


class _FloorConnection(asyncio.Protocol):
    def __init__(self, floor: _DurableFloor) -> None:
        self.floor = floor
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        floor = self.floor
        for line in lines:
            if line:
                if floor.tasks:
                    assert floor.loop is not None
                    floor.loop.create_task(self._call(line))
                else:
                    row, reply = floor.take(line)
                    floor.queue.put((row, reply, self))

    async def _call(self, line: bytes) -> None:
        """A request as devd runs one: a task of its own, which waits for its commit on a future."""
        floor = self.floor
        assert floor.loop is not None
        row, reply = floor.take(line)
        committed: asyncio.Future[bytes] = floor.loop.create_future()
        floor.queue.put((row, reply, committed))
        self.answer(await committed)

    def answer(self, reply: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


class _DurableFloor:
    def __init__(self, db_path: str, *, tasks: bool = False) -> None:
        import queue
        import sqlite3

        self.decode = msgspec.json.Decoder(_EchoRequest).decode
        self.encode = msgspec.json.Encoder().encode
        self.empty = _EchoActions()
        self.tasks = tasks  # a task per request, answered through a future, as devd runs them
        self.queue: queue.SimpleQueue[tuple[bytes, bytes, _FloorConnection | asyncio.Future[bytes]]] = (
            queue.SimpleQueue()
        )
        self.db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA locking_mode=EXCLUSIVE")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS requests (id INTEGER PRIMARY KEY, line BLOB NOT NULL)")
        self.loop: asyncio.AbstractEventLoop | None = None

    def take(self, line: bytes) -> tuple[bytes, bytes]:
        """What a request's row holds (its line), and its answer (made once the row is committed: b"")."""
        return line, b""

    def commit_loop(self) -> None:
        import queue

        while True:
            batch = [self.queue.get()]
            while len(batch) < 500:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            # One statement, its own transaction: one fsync of the WAL for the batch.
            self.db.execute(
                "INSERT INTO requests (line) VALUES " + ",".join(["(?)"] * len(batch)), [row for row, _, _ in batch]
            )
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.answer, batch)

    def answer(self, batch: list[tuple[bytes, bytes, _FloorConnection | asyncio.Future[bytes]]]) -> None:
        for row, reply, to in batch:
            reply = reply or self.encode(_EchoResponse("2.0", self.decode(row).id, self.empty)) + b"\n"
            if isinstance(to, asyncio.Future):
                to.set_result(reply)
            else:
                to.answer(reply)


class _CoreRequest(msgspec.Struct):
    id: int
    method: str
    params: _CoreParams


class _CoreParams(msgspec.Struct):
    session: str
    event: msgspec.Raw = msgspec.Raw(b"null")


class _DurableFloorWithCore(_DurableFloor):
    """The durable floor that also steps each session's own instance of the core, inline on the loop as devd does,
    and keeps the core's answer in the request's row: the least any daemon of this design can do, so that what
    separates it from the durable floor is the core, and what separates devd from it is devd's own code."""

    def __init__(self, db_path: str, *, tasks: bool = False) -> None:
        from devd.host import Core, Instance
        from devd.sessions.compaction import kept_answer
        from devd.storage.store import answer_digest

        super().__init__(db_path, tasks=tasks)
        self.kept_answer, self.answer_digest = kept_answer, answer_digest
        self.core = Core.open()
        self.instances: dict[str, Instance] = {}
        self.decode_core = msgspec.json.Decoder(_CoreRequest).decode

    def take(self, line: bytes) -> tuple[bytes, bytes]:
        request = self.decode_core(line)
        session = request.params.session
        if request.method == "session/new":
            self.instances[session] = self.core.new()
            actions = b"[]"
        else:
            actions = self.instances[session].step_raw(bytes(request.params.event))
        # The row holds the request (its event) and the answer as devd's journal keeps it (whole, or its digest).
        row = line + (self.kept_answer(line, actions) or self.answer_digest(actions))
        return row, b'{"jsonrpc":"2.0","id":%d,"result":{"actions":%s}}\n' % (request.id, actions)


def _durable_floor_server(socket_path: str, db_path: str, *, core: bool = False, tasks: bool = False) -> None:
    """The durable floor (above): answers every request with no actions, once its row is committed; with `core`,
    each step is stepped by its session's instance first and answered with the core's actions; with `tasks`, each
    request runs in a task of its own that waits for its commit on a future, as devd's do (which lets a connection's
    requests run concurrently), rather than inline in the connection's callback."""
    import threading

    sys.setswitchinterval(0.0001)  # as devd serve does, so that the commit thread gets the GIL as promptly
    floor = _DurableFloorWithCore(db_path, tasks=tasks) if core else _DurableFloor(db_path, tasks=tasks)

    async def serve() -> None:
        floor.loop = asyncio.get_running_loop()
        threading.Thread(target=floor.commit_loop, name="floor-commit", daemon=True).start()
        server = await floor.loop.create_unix_server(lambda: _FloorConnection(floor), socket_path)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    with asyncio.Runner(loop_factory=_new_loop) as runner:
        runner.run(serve())


# -- the load generator ----------------------------------------------------------------------------------------------
#
# The generator must not be what is measured, so it is not devd.client: asyncio Protocols on uvloop, one request in
# flight per client, the requests built from bytes encoded once (per process for the events, per conversation for
# the session name), each reply checked by a prefix comparison and decoded only when that does not match.

WARMUP_S = 2.0  # once every generator has connected, they run this long before the measured window opens
READY = b"connected\n"  # a generator's first line when started --after-ready: its clients are connected
READY_TIMEOUT_S = 120.0  # how long a generator may take to start and connect on a loaded machine
_REQUEST_HEAD = b'{"jsonrpc":"2.0","id":%d'
_NEW_TAIL = b',"method":"session/new","params":{"session":"%s"}}\n'
_STEP_TAIL = b',"method":"session/step","params":{"session":"%s","event":%s}}\n'


def _conversation() -> list[bytes]:
    """The events of one conversation: TURNS_PER_SESSION seed turns, their ids continuing as a real session's do."""
    events, next_id = [], 1
    for t in range(1, TURNS_PER_SESSION + 1):
        events += seed_turn(t, next_id)
        next_id += 7  # ask, two calls, ask, emit, save, done
    return events


class _Reply(msgspec.Struct):
    id: Any = None
    error: Any = None


class LoadResult(msgspec.Struct):
    """What one generator process measured in its window; latencies are float64 seconds, one per step."""

    clients: int
    window_s: float
    steps: int
    requests: int
    cpu_s: float
    cpu_wall_s: float
    latencies: bytes


class _Load:
    def __init__(self, loop: asyncio.AbstractEventLoop, clients: int, start: float, end: float) -> None:
        self.start = start
        self.end = end
        self.requests = 0
        self.latencies = array.array("d")
        self.events = _conversation()
        self.error: str | None = None
        self.pending = clients
        self.clients: list[_LoadClient] = []
        self.done: asyncio.Future[None] = loop.create_future()
        # The generator's own CPU over the window, to show it is not the bottleneck: near 1.0 means it is.
        self.marks: list[tuple[float, float]] = []

    def mark(self) -> None:
        """At the window's start, then at its end: by a timer, or by the first reply past it if that comes first."""
        if len(self.marks) < 2:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            self.marks.append((time.monotonic(), usage.ru_utime + usage.ru_stime))

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        for c in self.clients:
            if c.transport is not None:
                c.transport.abort()
        if not self.done.done():
            self.done.set_result(None)

    def finished(self) -> None:
        self.pending -= 1
        if not self.pending and not self.done.done():
            self.done.set_result(None)


class _LoadClient(asyncio.Protocol):
    """One client: a conversation of TURNS_PER_SESSION seed turns, then a new session, one request at a time.

    A new session every conversation keeps the transcript (and the work per step) the size of a working session
    rather than growing for the whole run.
    """

    def __init__(self, load: _Load, index: int) -> None:
        self.load = load
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.id = 0
        self.expect = b""
        self.sent_at = 0.0
        self.step = False
        self.conversations = 0
        self.tails: list[bytes] = []
        self.position = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport's
        self._new_session()

    def _send(self, tail: bytes, step: bool) -> None:
        assert self.transport is not None
        self.id += 1
        head = _REQUEST_HEAD % self.id
        self.expect = head + b',"result":'
        self.step = step
        self.sent_at = time.monotonic()
        self.transport.write(head + tail)

    def _new_session(self) -> None:
        name = b"bench-%d-%d-%d" % (self.index, self.conversations, os.getpid())
        self.conversations += 1
        self.tails = [_STEP_TAIL % (name, event) for event in self.load.events]
        self.position = 0
        self._send(_NEW_TAIL % name, False)

    def data_received(self, data: bytes) -> None:
        if self.buffer:
            data = self.buffer + data
        end = data.find(b"\n")
        if end < 0:
            self.buffer = data
            return
        if end != len(data) - 1:
            self.load.fail(f"client {self.index}: more than one line for one request: {data[:200]!r}")
            return
        self.buffer = b""
        now = time.monotonic()
        if not data.startswith(self.expect):
            reply = msgspec.json.decode(data, type=_Reply)  # another server's member order, or an error
            if reply.error is not None or reply.id != self.id:
                self.load.fail(f"client {self.index}: request {self.id} answered {data[:300]!r}")
                return
        load = self.load
        if load.start <= now < load.end:
            load.requests += 1
            if self.step:
                load.latencies.append(now - self.sent_at)
        elif now >= load.end:
            load.mark()
            self.closed = True
            assert self.transport is not None
            self.transport.close()
            return
        if self.position < len(self.tails):
            self.position += 1
            self._send(self.tails[self.position - 1], True)
        else:
            self._new_session()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.load.fail(f"client {self.index}: the server closed the connection ({exc})")
        self.load.finished()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _generate(address: str, clients: int, first_client: int, seconds: float, after_ready: bool) -> LoadResult:
    loop = asyncio.get_running_loop()
    load = _Load(loop, clients, math.inf, math.inf)
    load.clients = [_LoadClient(load, first_client + i) for i in range(clients)]
    # An exception in a protocol callback is only logged by the loop; here it must end the run, not stall a client.
    loop.set_exception_handler(lambda _, context: load.fail(f"generator callback failed: {context.get('exception')!r}"))
    await asyncio.gather(*(loop.create_unix_connection(lambda c=c: c, address) for c in load.clients))  # type: ignore[misc]
    if after_ready:
        # The window opens when the parent says, once every generator is connected: one loaded generator that was
        # slow to start then delays the window instead of missing it (the loop waits meanwhile, its clients too).
        _write_stdout(READY)
        start_at = float(sys.stdin.readline())
    else:
        start_at = time.monotonic() + WARMUP_S
    load.start, load.end = start_at, start_at + seconds
    loop.call_later(start_at - time.monotonic(), load.mark)
    loop.call_later(start_at + seconds - time.monotonic(), load.mark)
    try:
        await asyncio.wait_for(load.done, seconds + (start_at - time.monotonic()) + 30)
    except TimeoutError:
        load.fail("the server did not answer within 30 s of the window's end")
    if load.error is not None:
        raise RuntimeError(load.error)
    (t0, cpu0), (t1, cpu1) = load.marks
    steps = len(load.latencies)
    return LoadResult(clients, seconds, steps, load.requests, cpu1 - cpu0, t1 - t0, load.latencies.tobytes())


def _load_main(address: str, clients: int, first_client: int, seconds: float, after_ready: bool) -> None:
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        result = runner.run(_generate(address, clients, first_client, seconds, after_ready))
    _write_stdout(msgspec.json.encode(result) + b"\n")


def _write_stdout(data: bytes) -> None:
    """All of data: with PYTHONUNBUFFERED set, sys.stdout.buffer is a raw FileIO, whose write to a pipe may be short."""
    view = memoryview(data)
    while view:
        view = view[os.write(sys.stdout.fileno(), view) :]


# -- running the servers ---------------------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """A process's user and system CPU, all its threads, from /proc (utime and stime are fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each thread's user and system CPU (by thread id) of a process, from /proc/PID/task."""
    got: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # ended meanwhile
        got[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return got


def _machine_busy_seconds() -> float:
    """CPU time spent by every process on the machine (user, nice, system, irq, softirq, steal), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _run_load(address: str, clients: int, seconds: float, generators: int, server_pid: int) -> dict[str, float]:
    """Generator processes splitting `clients` against one server, one window for all."""
    split = [clients * (g + 1) // generators - clients * g // generators for g in range(generators)]
    return _run_split_load([(address, n) for n in split], seconds, [server_pid])


def _run_split_load(targets: list[tuple[str, int]], seconds: float, server_pids: list[int]) -> dict[str, float]:
    """One generator process per (address, clients), one window for all, while the servers' CPU (summed) is read
    from outside."""
    procs, first = [], 0
    for address, clients in targets:
        argv = [sys.executable, "-m", "benchmarks.bench", "_load", address, "--clients", str(clients)]
        argv += ["--first-client", str(first), "--seconds", str(seconds), "--after-ready"]
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        first += clients
    ready = [_ready(p) for p in procs]  # each has connected, or failed (and says why below)
    start_at = time.monotonic() + WARMUP_S
    for p, connected in zip(procs, ready, strict=True):
        if connected:
            assert p.stdin is not None
            p.stdin.write(f"{start_at!r}\n".encode())
            p.stdin.flush()  # not closed: communicate() flushes it, then closes it
    server_cpu = machine_busy = loop_cpu = other_thread_cpu = float("nan")
    try:
        _sleep_until(start_at)
        cpu0, busy0 = sum(_cpu_seconds(p) for p in server_pids), _machine_busy_seconds()
        threads0 = _thread_cpu_seconds(server_pids[0])
        _sleep_until(start_at + seconds)
        server_cpu = (sum(_cpu_seconds(p) for p in server_pids) - cpu0) / seconds
        machine_busy = (_machine_busy_seconds() - busy0) / seconds
        threads = {t: (c - threads0.get(t, 0.0)) / seconds for t, c in _thread_cpu_seconds(server_pids[0]).items()}
        loop_cpu = threads.pop(server_pids[0], float("nan"))
        other_thread_cpu = max(threads.values(), default=0.0)
    except FileNotFoundError:
        pass  # a server died; the generators say how
    # Every generator is waited for before a failure is raised: one that failed must not leave another running.
    outputs = [_collect(p, seconds + WARMUP_S + 60) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode:
            raise RuntimeError(f"a load generator failed: {err.decode(errors='replace').strip()[-2000:]}")
    results = [msgspec.json.decode(out, type=LoadResult) for out, _ in outputs]
    latencies = sorted(itertools.chain.from_iterable(array.array("d", r.latencies) for r in results))
    if not latencies:
        raise RuntimeError(f"no step was answered in the window against {sorted({a for a, _ in targets})}")
    generator_cpu = sum(r.cpu_s / r.cpu_wall_s for r in results)
    steps_per_s = sum(r.steps for r in results) / seconds
    return {
        "steps_per_s": steps_per_s,
        "requests_per_s": sum(r.requests for r in results) / seconds,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        # Shares are in cores over the window. The generators' is each process's CPU time over its wall time,
        # summed; the busiest one is given too, since a single process near 1.0 is the bottleneck.
        "generator_cpu_share": generator_cpu,
        "generator_cpu_share_max": max(r.cpu_s / r.cpu_wall_s for r in results),
        "server_cpu_share": server_cpu,
        # The server's CPU a step, in µs, all its threads; then the (first) server's by thread, from /proc/PID/task:
        # its main thread (the event loop), and its busiest other thread (the commit thread, for devd and the durable
        # floors: their other threads are idle). Steadier under load than steps/s.
        "server_cpu_us_per_step": server_cpu / steps_per_s * 1e6 if steps_per_s else float("nan"),
        "loop_cpu_us_per_step": loop_cpu / steps_per_s * 1e6 if steps_per_s else float("nan"),
        "commit_thread_cpu_us_per_step": other_thread_cpu / steps_per_s * 1e6 if steps_per_s else float("nan"),
        # Whatever else ran on the machine meanwhile (another build or test): the noise this run had. /proc/stat and
        # the per-process figures are sampled at different ticks, so it is good to about 0.1 core (and can dip below 0).
        "other_cpu_share": machine_busy - server_cpu - generator_cpu,
    }


def _ready(proc: subprocess.Popen[bytes]) -> bool:
    """Whether a generator said it connected (within READY_TIMEOUT_S); one that did not is killed."""
    assert proc.stdout is not None
    if select.select([proc.stdout], [], [], READY_TIMEOUT_S)[0] and proc.stdout.readline() == READY:
        return True
    proc.kill()
    return False


def _collect(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    """A generator's stdout and stderr once it has exited; killed if it overruns its bound."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _wait_socket(path: Path, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(1500):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before listening on {path}")
        if path.exists():
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
                return
            except OSError:
                pass
        time.sleep(0.02)
    raise TimeoutError(f"the server did not listen on {path} within 30 s")


SERVERS = (
    "anyio-echo",
    "durable-floor",
    "durable-floor-core",
    "durable-floor-core-tasks",
    "dispatch",
    "devd",
    "durable-floor-1-client",
    "durable-floor-core-1-client",
    "durable-floor-core-tasks-1-client",
    "devd-1-client",
)
# One client alone: the latency, nothing queued before.
SINGLE_CLIENT = (
    "durable-floor-1-client",
    "durable-floor-core-1-client",
    "durable-floor-core-tasks-1-client",
    "devd-1-client",
    "devd-baseline-1-client",
)
# devd of another checkout (`--baseline PATH`, e.g. a `git worktree` of the commit before a change), measured in the
# same run as this one: a change's before and after, alternated round by round like the rest. Asked for by name only.
BASELINE_SERVERS = ("devd-baseline", "devd-baseline-1-client")


def _server_argv(name: str, sock: Path, state: Path) -> list[str]:
    if name == "anyio-echo":
        return [sys.executable, "-m", "benchmarks.bench", "_anyio_echo", str(sock)]
    if name == "dispatch":
        return [sys.executable, "-m", "benchmarks.bench", "_echo", str(sock)]
    if name.startswith("durable-floor"):
        state.mkdir(mode=0o700)
        argv = [sys.executable, "-m", "benchmarks.bench", "_durable_floor", str(sock), str(state / "floor.sqlite3")]
        argv += ["--core"] if name.startswith("durable-floor-core") else []
        return argv + (["--tasks"] if name.startswith("durable-floor-core-tasks") else [])
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(state)]
    return argv + ["--log-level", "warning"]


def _run_server(
    name: str, root: Path, r: int, clients: int, seconds: float, generators: int, baseline: Path | None = None
) -> dict[str, Any]:
    """One server process under load; a server or generator that fails gives its error, and the benchmark goes on."""
    # A fresh state directory per run, so no round inherits the sessions of the one before.
    sock, state, log = root / f"{name}-{r}.sock", root / f"state-{name}-{r}", root / f"{name}-{r}.log"
    # `python -m devd` imports the devd of its working directory: the baseline's checkout for its servers.
    cwd = baseline if name in BASELINE_SERVERS else None
    with open(log, "wb") as out:
        proc = subprocess.Popen(_server_argv(name, sock, state), stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        _wait_socket(sock, proc)
        return _run_load(str(sock), clients, seconds, generators, proc.pid)
    except (RuntimeError, TimeoutError, OSError, msgspec.DecodeError) as e:
        tail = log.read_bytes()[-1500:].decode(errors="replace").strip()
        return {"error": f"{e}" + (f"; the server's output ends: {tail}" if tail else "")}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def over(a: str, b: str) -> float | None:
        if "steps_per_s" not in rows.get(a, {}) or "steps_per_s" not in rows.get(b, {}):
            return None  # one of the two was not measured, or failed
        return float(rows[a]["steps_per_s"] / rows[b]["steps_per_s"])

    def p50_over(a: str, b: str) -> float | None:
        if "p50_ms" not in rows.get(a, {}) or "p50_ms" not in rows.get(b, {}):
            return None
        return float(rows[a]["p50_ms"] / rows[b]["p50_ms"])

    def cpu_over(a: str, b: str) -> float | None:
        if "server_cpu_us_per_step" not in rows.get(a, {}) or "server_cpu_us_per_step" not in rows.get(b, {}):
            return None
        return float(rows[a]["server_cpu_us_per_step"] / rows[b]["server_cpu_us_per_step"])

    return {
        "dispatch_over_anyio_echo": over("dispatch", "anyio-echo"),
        "devd_over_anyio_echo": over("devd", "anyio-echo"),
        "devd_over_dispatch": over("devd", "dispatch"),
        "devd_over_durable_floor": over("devd", "durable-floor"),
        "durable_floor_core_over_durable_floor": over("durable-floor-core", "durable-floor"),
        "devd_over_durable_floor_core": over("devd", "durable-floor-core"),
        "durable_floor_core_tasks_over_durable_floor_core": over("durable-floor-core-tasks", "durable-floor-core"),
        "devd_over_durable_floor_core_tasks": over("devd", "durable-floor-core-tasks"),
        "single_client_p50_devd_over_durable_floor": p50_over("devd-1-client", "durable-floor-1-client"),
        "single_client_p50_durable_floor_core_over_durable_floor": p50_over(
            "durable-floor-core-1-client", "durable-floor-1-client"
        ),
        "single_client_p50_devd_over_durable_floor_core": p50_over("devd-1-client", "durable-floor-core-1-client"),
        "single_client_p50_durable_floor_core_tasks_over_durable_floor_core": p50_over(
            "durable-floor-core-tasks-1-client", "durable-floor-core-1-client"
        ),
        "cpu_per_step_devd_over_durable_floor_core": cpu_over("devd", "durable-floor-core"),
        "cpu_per_step_durable_floor_core_tasks_over_durable_floor_core": cpu_over(
            "durable-floor-core-tasks", "durable-floor-core"
        ),
        "devd_over_devd_baseline": over("devd", "devd-baseline"),
        "cpu_per_step_devd_over_devd_baseline": cpu_over("devd", "devd-baseline"),
        "single_client_p50_devd_over_devd_baseline": p50_over("devd-1-client", "devd-baseline-1-client"),
    }


def _median_row(measured: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [m for m in measured if "error" not in m]
    if not ok:
        return {"error": measured[0]["error"]}
    row: dict[str, Any] = {k: statistics.median(m[k] for m in ok) for k in ok[0]}
    if len(ok) < len(measured):
        row["failed_rounds"] = len(measured) - len(ok)
    return row


def bench_daemon(
    clients: int,
    seconds: float,
    rounds: int,
    single_client_seconds: float = 3.0,
    generators: int = 1,
    servers: tuple[str, ...] = SERVERS,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """Each server in its own process, alternated round by round so that drift hits all alike; medians reported.

    The machine has two cores, which the server and the generator share: a server that needs one core and a
    generator that needs a fraction of the other is the shape of a fair measurement, and `generator_cpu_share`
    and `server_cpu_share` (cores, over the window) show which it was.
    """
    root = Path(tempfile.mkdtemp(prefix="devd-bench-"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    try:
        for r in range(rounds):
            for name in servers:
                if name in SINGLE_CLIENT:
                    runs[name].append(_run_server(name, root, r, 1, single_client_seconds, 1, baseline))
                else:
                    runs[name].append(_run_server(name, root, r, clients, seconds, generators, baseline))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results: dict[str, Any] = {
        "clients": clients,
        "seconds": seconds,
        "rounds": rounds,
        "single_client_seconds": single_client_seconds,
        "generators": generators,
        "event_loop": _loop_name(),
        "cpus": os.cpu_count(),
    }
    medians = {name: _median_row(measured) for name, measured in runs.items()}
    results.update(medians)
    results.update(_ratios(medians))
    if "p50_ms" in medians.get("devd-1-client", {}):
        results["single_client_p50_ms"] = medians["devd-1-client"]["p50_ms"]
        results["single_client_p99_ms"] = medians["devd-1-client"]["p99_ms"]
    results["ratios_per_round"] = [_ratios({name: runs[name][r] for name in servers}) for r in range(rounds)]
    results["runs"] = {
        name: [{k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()} for m in measured]
        for name, measured in runs.items()
    }
    return results


# -- the soak: a daemon's long life in minutes -------------------------------------------------------------------------
#
# `soak` runs the real daemon for N minutes under mixed clients and watchers (in a load process of their own, so the
# daemon's figures are the daemon's), restarts it about every minute (SIGTERM and SIGKILL by turns), samples its
# resources, and checks the promises the restarts put at risk: nothing answered is lost, nothing keyed runs twice,
# watchers see every step once and in order.

SOAK_RESTART_EVERY_S = 60.0
SOAK_TIMEOUT_S = 30.0  # a request unanswered this long on an open connection means the daemon hung: an anomaly
SOAK_GRACE_S = 60.0  # past its window, a load process may take this long to settle what it has in flight
SOAK_STOP_S = 30.0  # a SIGTERM'd daemon must be gone by then (its grace for calls in flight is 10 s)
SOAK_BACKOFF_S = (0.05, 1.0)  # reconnect backoff: the first delay and the ceiling; doubled each time, with jitter
SOAK_LINE_LIMIT = 64 << 20  # StreamReader's default (64 KiB) is less than a long session's Model ask
SOAK_LEFT_OPEN_MAX = 250  # sessions each client leaves open; past it, it closes its oldest (sessions_max is 10,000)
SOAK_RESUME_P = 0.25  # a client takes up a session it left (a stored one, after a restart) instead of a new one
SOAK_LEAVE_P = 0.4  # a client leaves a session open rather than close it after its turns
SOAK_KEYED_P = 0.5  # a session's steps all carry idempotency keys
SOAK_DUPLICATE_P = 0.05  # a keyed step answered is sent again at once: it must be answered `replayed`, same bytes
SOAK_REPLAY_AFTER_RESTART_P = 0.5  # after a reconnect, the last keyed step answered is sent again, as above
SOAK_WATCHED = 6  # sessions each watcher connection watches at a time
SOAK_WATCH_TICK_S = 0.1  # how often a watcher trades sessions gone idle for busy ones: a client's visit is short
SOAK_NEVER_READ_S = 45.0  # longer than the daemon's send_timeout_s (30 s), so that it cuts the never-reader off
# A watcher's StreamReader buffers up to twice its limit before it stops reading the socket: kept small, so that a
# slow or absent reader is felt by the daemon at once (watchers read with read(), so lines may be longer).
SOAK_WATCHER_BUFFER = 1 << 16
SOAK_SLOW_READ = (2048, 0.05)  # a slow watcher reads this many bytes, then pauses this long (about 40 KB/s)
SOAK_WATCHER_KINDS = ("since", "slow", "never", "live")
# The plateau rule, per metric: PASS if the mean of the last third of the samples is at most the mean of the middle
# third times (1 + relative) plus the absolute slack. The first third is left out: it holds the warm-up.
SOAK_PLATEAU = {"rss_mib": (0.10, 4.0), "fds": (0.10, 4.0), "threads": (0.10, 2.0)}
_SOAK_LOAD_ENTRY = "import sys; from benchmarks.bench import _soak_load_main; sys.exit(_soak_load_main(sys.argv[1]))"


class SoakLoadConfig(msgspec.Struct):
    """What the orchestrator tells a load process (as JSON on its command line)."""

    socket: str
    clients: int
    watchers: int
    seconds: float
    think_ms: float
    progress: str  # a file the load process rewrites every second: steps answered so far
    seed: int


class SoakLoadResult(msgspec.Struct):
    """What a load process found; `sessions` (name: [seq, 1 if one more step may have happened]) and `closed` are
    checked once more against the daemon after a last restart."""

    counts: dict[str, int]
    anomalies: dict[str, int]
    examples: list[str]
    sessions: dict[str, tuple[int, int]]
    closed: list[str]


class _SoakAway(Exception):
    """The daemon is not there: refused, reset, closed, or turning new calls away while it shuts down."""


class _SoakReply(msgspec.Struct):
    id: Any = None
    result: msgspec.Raw = msgspec.Raw(b"null")
    error: dict[str, Any] | None = None
    method: str | None = None
    params: msgspec.Raw = msgspec.Raw(b"null")


class _SoakStepResult(msgspec.Struct):
    actions: msgspec.Raw
    replayed: bool = False


class _SoakListed(msgspec.Struct):
    session: str
    state: str
    seq: int


class _SoakList(msgspec.Struct):
    sessions: list[_SoakListed]


class _SoakNotice(msgspec.Struct):
    session: str
    seq: int
    reason: str | None = None


_soak_reply = msgspec.json.Decoder(_SoakReply)
_soak_encoder = msgspec.json.Encoder()


def _error_kind(error: dict[str, Any]) -> str:
    return str((error.get("data") or {}).get("kind", "?"))


@dataclasses.dataclass
class _SoakTally:
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    anomalies: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)

    def anomaly(self, kind: str, text: str) -> None:
        self.anomalies[kind] += 1
        if len(self.examples) < 60:
            self.examples.append(f"{kind}: {text}")


class _SoakConn:
    """One connection, one request at a time (the clients never watch, so every line is a reply)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tally: _SoakTally) -> None:
        self.reader = reader
        self.writer = writer
        self.tally = tally
        self.next_id = 0

    @classmethod
    async def open(cls, path: str, tally: _SoakTally) -> _SoakConn:
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=SOAK_LINE_LIMIT)
        except OSError as e:  # no socket yet, or nobody listening on it
            raise _SoakAway(str(e)) from None
        return cls(reader, writer, tally)

    def close(self) -> None:
        self.writer.close()

    async def call(self, method: str, params: dict[str, Any]) -> _SoakReply:
        self.next_id += 1
        request = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        try:
            self.writer.write(_soak_encoder.encode(request) + b"\n")
            async with asyncio.timeout(SOAK_TIMEOUT_S):
                await self.writer.drain()
                while True:
                    line = await self.reader.readline()
                    if not line.endswith(b"\n"):
                        raise _SoakAway("the daemon closed the connection")
                    reply = _soak_reply.decode(line)
                    if reply.id == self.next_id:
                        return reply
                    if reply.id is None and reply.error is not None:  # refused at connect: FULL while draining
                        raise _SoakAway(f"refused: {reply.error.get('message')}")
        except TimeoutError:
            self.tally.anomaly("unanswered", f"{method} had no answer within {SOAK_TIMEOUT_S:.0f} s")
            raise _SoakAway("no answer") from None
        except (OSError, ValueError, RuntimeError) as e:  # reset, a line past the limit, uvloop's closed transport
            raise _SoakAway(str(e)) from None


@dataclasses.dataclass(eq=False)
class _SoakConv:
    """A client's session and what it was answered: `seq` is exactly what session/list must show for it."""

    name: str
    keyed: bool
    seq: int = 0
    turn: int = 0  # turns begun
    position: int = 5  # the next event's index in the current turn's five; 5: the turn is over
    turns_left: int = 0  # turns still to run on this visit
    last_keyed: tuple[str, bytes, bytes] | None = None  # key, event, the answer's actions: for replay checks

    def next_event(self) -> tuple[bytes, str | None]:
        turn, position = (self.turn + 1, 0) if self.position >= 5 else (self.turn, self.position)
        event = seed_turn(turn, 7 * (turn - 1) + 1)[position]  # ids go on as a real session's: 7 actions a turn
        return event, (f"t{turn}.{position}" if self.keyed else None)

    def advance(self) -> None:
        if self.position >= 5:
            self.turn += 1
            self.position = 0
            self.turns_left -= 1
        self.position += 1
        self.seq += 1

    @property
    def visit_over(self) -> bool:
        return self.position >= 5 and self.turns_left <= 0


@dataclasses.dataclass(eq=False)
class _SoakOp:
    kind: str  # new | step | duplicate | close
    conv: _SoakConv
    event: bytes = b""
    key: str | None = None
    lost: bool = False  # its answer went with the connection; settled against session/list after the reconnect
    resent: bool = False
    expect_replayed: bool | None = None  # for a keyed step resent after a loss: what session/list says it must be


class _SoakLoad:
    """What a load process's clients and watchers share."""

    def __init__(self, config: SoakLoadConfig) -> None:
        self.config = config
        self.tally = _SoakTally()
        self.end = time.monotonic() + config.seconds
        self.hard_end = self.end + SOAK_GRACE_S
        self.clients: list[_SoakClient] = []

    def busy_sessions(self) -> list[_SoakConv]:
        """The sessions clients are stepping now: what watchers watch, so they have something to fall behind on."""
        return [c.current for c in self.clients if c.current is not None and c.current.name in c.sessions]

    def left_sessions(self) -> list[_SoakConv]:
        return [conv for c in self.clients for conv in c.left.values()]

    async def report_progress(self) -> None:
        """Steps answered so far, for the orchestrator's samples; replaced whole, so it never reads half a file."""
        path = Path(self.config.progress)
        while True:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode({"steps": self.tally.counts["steps answered"]}))
            os.replace(tmp, path)
            await asyncio.sleep(1.0)


class _SoakClient:
    """A client of many sessions: creates them, steps seed turns (keyed or not), closes some and leaves others, takes
    left ones up again, and rides out restarts: reconnect with backoff, check session/list against what it was
    answered, settle the request whose answer was lost, and go on."""

    def __init__(self, load: _SoakLoad, index: int) -> None:
        self.load = load
        self.tally = load.tally
        self.index = index
        self.rng = random.Random(load.config.seed * 1000 + index)
        self.think_s = load.config.think_ms / 1000
        self.conn: _SoakConn | None = None
        self.sessions: dict[str, _SoakConv] = {}  # answered `new`, not closed, not given up on
        self.current: _SoakConv | None = None
        self.left: dict[str, _SoakConv] = {}  # left open, oldest first
        self.closed: list[str] = []
        self.pending: _SoakOp | None = None
        self.made = 0
        self.connected_once = False
        self.away_since: float | None = None

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            if now >= self.load.hard_end:
                if self.pending is not None:
                    self.tally.counts["client requests unsettled at the end"] += 1
                break
            if now >= self.load.end and self.pending is None:
                break
            try:
                if self.conn is None:
                    await self._reconnect()
                if self.pending is not None:
                    await self._perform(self.pending)
                else:
                    await self._next()
            except _SoakAway:
                if self.conn is not None:
                    self.conn.close()
                    self.conn = None
                if self.pending is not None:
                    self.pending.lost = True
                if self.away_since is None:
                    self.away_since = time.monotonic()
        if self.conn is not None:
            self.conn.close()

    async def _reconnect(self) -> None:
        delay = SOAK_BACKOFF_S[0]
        while True:
            if time.monotonic() >= self.load.hard_end:
                raise _SoakAway("out of time")
            conn = None
            try:
                conn = await _SoakConn.open(self.load.config.socket, self.tally)
                reply = await conn.call("session/list", {})
                if reply.error is not None:  # BUSY: the daemon is draining; the next one will answer
                    raise _SoakAway(_error_kind(reply.error))
                break
            except _SoakAway:
                if conn is not None:
                    conn.close()
                self.tally.counts["client connect attempts refused"] += 1
                await asyncio.sleep(delay * self.rng.uniform(0.5, 1.5))
                delay = min(delay * 2, SOAK_BACKOFF_S[1])
        self.conn = conn
        if self.away_since is not None:
            away = time.monotonic() - self.away_since
            self.tally.counts["client reconnects"] += 1
            longest = self.tally.counts["client longest away ms"]
            self.tally.counts["client longest away ms"] = max(longest, int(away * 1e3))
            self.away_since = None
        listing = {s.session: s for s in msgspec.json.decode(reply.result, type=_SoakList).sessions}
        if self.connected_once:
            self._verify(listing)
            self._settle(listing)
        self.connected_once = True

    def _give_up(self, conv: _SoakConv) -> None:
        """Stop checking a session whose state an anomaly made unknown, so that one fault is counted once."""
        self.sessions.pop(conv.name, None)
        self.left.pop(conv.name, None)
        if self.current is conv:
            self.current = None
        if self.pending is not None and self.pending.conv is conv:
            self.pending = None

    def _verify(self, listing: dict[str, _SoakListed]) -> None:
        """After a restart every session must be at exactly the step this client was answered for it (one more
        where the answer to a step was lost); every session whose close was answered must be gone."""
        lost = self.pending if self.pending is not None and self.pending.lost else None
        for conv in list(self.sessions.values()):
            row = listing.get(conv.name)
            may_be_ahead = lost is not None and lost.conv is conv and lost.kind == "step"
            if row is None:
                if not (lost is not None and lost.conv is conv and lost.kind == "close"):
                    self.tally.anomaly("lost_ack", f"{conv.name}: answered {conv.seq} steps, missing after a restart")
                    self._give_up(conv)
            elif row.seq < conv.seq:
                self.tally.anomaly("lost_ack", f"{conv.name}: session/list says seq {row.seq}, answered {conv.seq}")
                self._give_up(conv)
            elif row.seq > conv.seq + may_be_ahead:
                self.tally.anomaly("extra_step", f"{conv.name}: session/list says seq {row.seq}, answered {conv.seq}")
                self._give_up(conv)
            elif row.state not in ("live", "stored"):
                self.tally.anomaly("session_state", f"{conv.name} is {row.state} after a restart")
                self._give_up(conv)
        for name in self.closed:
            if name in listing:
                self.tally.anomaly("closed_back", f"{name} was closed (answered) and is listed after a restart")
        self.tally.counts["sessions checked after restarts"] += len(self.sessions)

    def _settle(self, listing: dict[str, _SoakListed]) -> None:
        """Decide what became of the request whose answer was lost: acknowledge it, or send it again."""
        op = self.pending
        if op is None:
            conv = self.current
            if conv is not None and conv.last_keyed is not None and self.rng.random() < SOAK_REPLAY_AFTER_RESTART_P:
                key, event, _ = conv.last_keyed
                self.pending = _SoakOp("duplicate", conv, event, key)  # answered before the restart: must replay
            return
        if not op.lost:
            return
        op.lost, op.resent = False, True
        row = listing.get(op.conv.name)
        if op.kind == "new":
            if row is not None:  # it was made; the answer was lost
                self.pending = None
                self._made(op.conv)
        elif op.kind == "close":
            if row is None:
                self.pending = None
                self._closed(op.conv)
        elif op.kind == "step":
            if row is None:
                return  # _verify counted it
            if op.key is None:
                if row.seq == op.conv.seq + 1:  # it ran and is durable; only the answer was lost
                    self.pending = None
                    self.tally.counts["unkeyed steps whose lost answer was applied"] += 1
                    op.conv.advance()
            else:
                op.expect_replayed = row.seq == op.conv.seq + 1
                self.tally.counts["keyed steps resent after a lost answer"] += 1

    async def _next(self) -> None:
        conv = self.current
        if conv is None:
            if len(self.left) > SOAK_LEFT_OPEN_MAX:
                op = _SoakOp("close", next(iter(self.left.values())))
            elif self.left and self.rng.random() < SOAK_RESUME_P:
                conv = self.left.pop(self.rng.choice(list(self.left)))
                conv.turns_left = self.rng.randint(1, 3)
                self.current = conv
                self.tally.counts["sessions taken up again"] += 1
                return
            else:
                self.made += 1
                name = f"soak-{os.getpid()}-{self.index}-{self.made}"
                op = _SoakOp("new", _SoakConv(name, keyed=self.rng.random() < SOAK_KEYED_P))
        elif conv.visit_over:
            if self.rng.random() < SOAK_LEAVE_P:
                self.left[conv.name] = conv
                self.current = None
                self.tally.counts["sessions left open"] += 1
                return
            op = _SoakOp("close", conv)
        else:
            event, key = conv.next_event()
            op = _SoakOp("step", conv, event, key)
        self.pending = op
        await self._perform(op)
        await asyncio.sleep(self.rng.expovariate(1 / self.think_s) if self.think_s > 0 else 0)

    async def _perform(self, op: _SoakOp) -> None:
        assert self.conn is not None
        conv = op.conv
        params: dict[str, Any] = {"session": conv.name}
        method = {"new": "session/new", "close": "session/close"}.get(op.kind, "session/step")
        if method == "session/step":
            params["event"] = msgspec.Raw(op.event)
            if op.key is not None:
                params["key"] = op.key
        busy_since = time.monotonic()
        while True:
            reply = await self.conn.call(method, params)
            if reply.error is None:
                break
            kind = _error_kind(reply.error)
            if kind == "BUSY" and time.monotonic() - busy_since < SOAK_TIMEOUT_S:
                self.tally.counts["client BUSY answers (retried)"] += 1  # the daemon drains; it will close soon
                await asyncio.sleep(0.05)
                continue
            message = str(reply.error.get("message", ""))[:200]
            if kind == "CONFLICT":
                self.tally.anomaly("conflict", f"{conv.name} key {op.key} ({op.kind}, resent {op.resent}): {message}")
            else:
                self.tally.anomaly("unexpected_error", f"{method} on {conv.name} answered {kind}: {message}")
            self._give_up(conv)
            return
        self.pending = None
        if op.kind == "new":
            self._made(conv)
        elif op.kind == "close":
            self._closed(conv)
        else:
            self._stepped(op, msgspec.json.decode(reply.result, type=_SoakStepResult))

    def _made(self, conv: _SoakConv) -> None:
        self.sessions[conv.name] = conv
        conv.turns_left = self.rng.randint(1, 4)
        self.current = conv
        self.tally.counts["sessions made"] += 1

    def _closed(self, conv: _SoakConv) -> None:
        self.sessions.pop(conv.name, None)
        self.left.pop(conv.name, None)
        if self.current is conv:
            self.current = None
        self.closed.append(conv.name)
        self.tally.counts["sessions closed"] += 1

    def _stepped(self, op: _SoakOp, result: _SoakStepResult) -> None:
        conv, tally = op.conv, self.tally
        tally.counts["steps answered"] += 1
        if op.kind == "duplicate":
            tally.counts["keyed steps sent twice on purpose"] += 1
            assert conv.last_keyed is not None
            if not result.replayed:
                tally.anomaly("ran_twice", f"{conv.name} key {op.key} was answered before, and ran again")
                self._give_up(conv)
            elif bytes(result.actions) != conv.last_keyed[2]:
                tally.anomaly("replay_differs", f"{conv.name} key {op.key}: the replay is not the first answer")
            return
        if op.resent and op.key is not None:
            if op.expect_replayed is not None and result.replayed != op.expect_replayed:
                durable = "was durable" if op.expect_replayed else "was not durable"
                tally.anomaly(
                    "ran_twice" if op.expect_replayed else "replay_of_nothing",
                    f"{conv.name} key {op.key}: session/list said the step {durable}; "
                    f"answered replayed={result.replayed}",
                )
            tally.counts["resent keyed steps answered replayed" if result.replayed else "resent keyed steps run"] += 1
        elif result.replayed:
            tally.anomaly("replay_of_nothing", f"{conv.name}: key {op.key}, never sent before, answered replayed")
        conv.advance()
        if op.key is not None:
            conv.last_keyed = (op.key, op.event, bytes(result.actions))
            if self.rng.random() < SOAK_DUPLICATE_P:
                self.pending = _SoakOp("duplicate", conv, op.event, op.key)


class _SoakWatcher:
    """A watcher connection. "live" watches busy sessions from now on; "since" catches up on them from a few steps back
    (and on left ones from the start); "slow" reads a trickle, so it falls behind and is unwatched, then watches again
    from the last step it saw; "never" watches and reads nothing, so the daemon must drop it. Every kind reconnects
    after a restart and watches again from the last step seen. Seen steps must come one by one, none twice."""

    def __init__(self, load: _SoakLoad, index: int, kind: str) -> None:
        self.load = load
        self.tally = load.tally
        self.kind = kind
        self.rng = random.Random(load.config.seed * 1000 + 500 + index)
        self.watching: dict[str, int | None] = {}  # session: the last step seen (None: none yet, watched from now)
        self.catching_up: set[str] = set()  # watched with `since`, not answered yet: not to be unwatched before
        self.ending: set[str] = set()  # unwatch sent, not answered: notices sent before it may still come
        self.requests: dict[int, tuple[str, str]] = {}  # request id: (method, session)
        self.next_id = 0
        self.writer: asyncio.StreamWriter | None = None

    async def run(self) -> None:
        delay = SOAK_BACKOFF_S[0]
        while time.monotonic() < self.load.end:
            try:
                reader, writer = await asyncio.open_unix_connection(self.load.config.socket, limit=SOAK_WATCHER_BUFFER)
            except OSError:
                await asyncio.sleep(delay * self.rng.uniform(0.5, 1.5))
                delay = min(delay * 2, SOAK_BACKOFF_S[1])
                continue
            delay = SOAK_BACKOFF_S[0]
            self.tally.counts[f"watcher connections ({self.kind})"] += 1
            try:
                if self.kind == "never":
                    await self._never(reader, writer)
                else:
                    await self._serve(reader, writer)
            finally:
                writer.close()

    def _send(self, method: str, params: dict[str, Any]) -> bool:
        """Write a request; False when the connection is gone (uvloop raises RuntimeError on a closed transport)."""
        if self.writer is None or self.writer.is_closing():
            return False
        self.next_id += 1
        request = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        try:
            self.writer.write(_soak_encoder.encode(request) + b"\n")
        except (OSError, RuntimeError):
            return False
        self.requests[self.next_id] = (method, params["session"])
        return True

    def _watch(self, name: str, since: int | None) -> None:
        params: dict[str, Any] = {"session": name} if since is None else {"session": name, "since": since}
        if not self._send("session/watch", params):
            return  # the next connection watches it again, from the last step seen
        self.watching[name] = since
        if since is not None:
            self.catching_up.add(name)
        self.tally.counts["watches sent" if since is None else "watches sent with since"] += 1

    def _candidates(self) -> list[tuple[str, int | None]]:
        busy = self.load.busy_sessions()
        if self.kind == "since":
            picks: list[tuple[str, int | None]] = [(c.name, max(0, c.seq - 3)) for c in busy]
            left = self.load.left_sessions()
            if left and self.rng.random() < 0.1:  # about one whole history a second, caught up then unwatched
                picks.append((self.rng.choice(left).name, 0))
            return picks
        return [(c.name, None) for c in busy]

    def _unwatch(self, name: str) -> None:
        if not self._send("session/unwatch", {"session": name}):
            return
        self.watching.pop(name, None)
        self.ending.add(name)
        self.tally.counts["unwatches sent"] += 1

    def _top_up(self) -> None:
        """Unwatch what is idle (once its catch-up is over), then watch busy sessions up to SOAK_WATCHED. A slow
        watcher reads its answers late; it must still trade idle sessions for busy ones, or it never falls behind."""
        busy = {c.name for c in self.load.busy_sessions()}
        for name in [n for n in self.watching if n not in busy and n not in self.catching_up]:
            self._unwatch(name)
        candidates = [c for c in self._candidates() if c[0] not in self.watching and c[0] not in self.ending]
        self.rng.shuffle(candidates)
        for name, since in candidates[: max(0, SOAK_WATCHED - len(self.watching))]:
            self._watch(name, since)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.requests.clear()
        self.catching_up.clear()
        self.ending.clear()
        for name, last in list(self.watching.items()):
            self._watch(name, last)  # from the last step seen: nothing missed while the daemon was away
        reading = asyncio.ensure_future(self._read(reader))
        try:
            while time.monotonic() < self.load.end and not reading.done():
                self._top_up()
                await asyncio.wait({reading}, timeout=SOAK_WATCH_TICK_S)
        finally:
            reading.cancel()
            self.writer = None
        if reading.done() and not reading.cancelled():
            self.tally.counts[f"watcher connections lost ({self.kind})"] += 1

    async def _read(self, reader: asyncio.StreamReader) -> None:
        buffer = b""
        size, pause = SOAK_SLOW_READ if self.kind == "slow" else (1 << 16, 0.0)
        try:
            while True:
                chunk = await reader.read(size)
                if not chunk:
                    return
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    self._line(line)
                if pause:
                    await asyncio.sleep(pause)
        except OSError:
            return

    def _line(self, line: bytes) -> None:
        tally = self.tally
        message = _soak_reply.decode(line)
        if message.method == "session/actions":
            notice = msgspec.json.decode(message.params, type=_SoakNotice)
            tally.counts["watch notices"] += 1
            tally.counts["watch notice bytes"] += len(line) + 1
            if notice.session in self.ending:
                return  # sent before the daemon had our unwatch
            if notice.session not in self.watching:
                tally.anomaly("watch_stray", f"a notice for {notice.session}, which this connection does not watch")
                return
            last = self.watching[notice.session]
            if last is not None and notice.seq != last + 1:
                kind = "watch_gap" if notice.seq > last + 1 else "watch_repeat"
                tally.anomaly(kind, f"{notice.session}: step {notice.seq} after step {last} ({self.kind} watcher)")
            self.watching[notice.session] = notice.seq
        elif message.method == "session/unwatched":
            notice = msgspec.json.decode(message.params, type=_SoakNotice)
            tally.counts[f"unwatched: {notice.reason} ({self.kind})"] += 1
            if notice.session in self.ending:
                return
            last = self.watching.get(notice.session)
            if last is not None and notice.seq != last:
                tally.anomaly("watch_gap", f"{notice.session}: unwatched after step {notice.seq}, last seen {last}")
            if notice.reason == "closed":
                self.watching.pop(notice.session, None)
            elif self.writer is not None:
                self._watch(notice.session, notice.seq)  # catch up from the journal, as the protocol says
        elif isinstance(message.id, int) and message.id in self.requests:
            method, name = self.requests.pop(message.id)
            self.catching_up.discard(name)  # a watch's catch-up is sent before its answer
            if method == "session/unwatch":
                self.ending.discard(name)
                if message.error is not None and _error_kind(message.error) != "BUSY":
                    tally.anomaly("unexpected_error", f"session/unwatch {name} answered {message.error}")
                return
            if message.error is None:
                tally.counts["watches answered"] += 1
                return
            kind = _error_kind(message.error)
            if kind == "HANDLE":  # closed meanwhile
                self.watching.pop(name, None)
                tally.counts["watches of sessions gone"] += 1
            elif kind == "BUSY":
                tally.counts["watches answered BUSY (draining)"] += 1  # watched again on the next connection
            else:
                tally.anomaly("unexpected_error", f"session/watch {name} answered {kind}: {message.error}")
                self.watching.pop(name, None)

    async def _never(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Keep watching the busy sessions (and left ones from the start) and read nothing, for longer than the
        daemon's send timeout; then see whether the daemon unwatched it and cut the connection off."""
        self.writer = writer
        self.watching.clear()
        self.requests.clear()
        left = self.load.left_sessions()
        for conv in self.rng.sample(left, min(SOAK_WATCHED, len(left))):
            self._watch(conv.name, 0)
        until = min(time.monotonic() + SOAK_NEVER_READ_S, self.load.end)
        while time.monotonic() < until and not writer.is_closing():
            # Writing does not need reading: the watches go on piling notices up until the daemon stops reading us.
            for conv in self.load.busy_sessions():
                if conv.name not in self.watching and len(self.watching) < 50 * SOAK_WATCHED:
                    self._watch(conv.name, None)
            await asyncio.sleep(SOAK_WATCH_TICK_S)
        self.writer = None
        unread, dropped, cut_off = 0, 0, False
        try:
            while True:
                chunk = await asyncio.wait_for(reader.read(1 << 20), 0.5)
                if not chunk:
                    cut_off = True
                    break
                unread += len(chunk)
                dropped += chunk.count(b'"reason":"fell too far behind"')
        except TimeoutError:
            pass
        except OSError:
            cut_off = True
        tally = self.tally
        tally.counts["never-reader holds"] += 1
        tally.counts["never-reader holds cut off (restart or send timeout)"] += cut_off
        tally.counts["never-reader KiB left unread"] += unread // 1024
        tally.counts["never-reader unwatched (fell too far behind), read after its hold"] += dropped


async def _soak_load(config: SoakLoadConfig) -> SoakLoadResult:
    load = _SoakLoad(config)
    load.clients = [_SoakClient(load, i) for i in range(config.clients)]
    watchers = [_SoakWatcher(load, i, SOAK_WATCHER_KINDS[i % len(SOAK_WATCHER_KINDS)]) for i in range(config.watchers)]
    progress = asyncio.ensure_future(load.report_progress())
    runs = [c.run() for c in load.clients] + [w.run() for w in watchers]
    try:
        # Bounded whatever the daemon does: past the grace, whatever still runs is cancelled and counted.
        outcomes = await asyncio.wait_for(
            asyncio.gather(*runs, return_exceptions=True), config.seconds + SOAK_GRACE_S + 30
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):  # a fault of the load's own: counted, so it cannot pass unseen
                load.tally.anomaly("load_error", f"{type(outcome).__name__}: {outcome}"[:300])
    except TimeoutError:
        load.tally.anomaly("load_stuck", "the load did not finish within its grace")
    finally:
        progress.cancel()
    sessions: dict[str, tuple[int, int]] = {}
    for c in load.clients:
        for conv in c.sessions.values():
            ahead = c.pending is not None and c.pending.conv is conv and c.pending.kind == "step"
            sessions[conv.name] = (conv.seq, int(ahead))
    closed = [name for c in load.clients for name in c.closed]
    tally = load.tally
    usage = resource.getrusage(resource.RUSAGE_SELF)
    tally.counts["load process cpu ms"] = int((usage.ru_utime + usage.ru_stime) * 1000)
    return SoakLoadResult(dict(tally.counts), dict(tally.anomalies), tally.examples, sessions, closed)


def _soak_load_main(config_json: str) -> int:
    """The load process: runs for its window (plus a bounded grace), writes its result as JSON on stdout, exits."""
    config = msgspec.json.decode(config_json, type=SoakLoadConfig)
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        result = runner.run(_soak_load(config))
    _write_stdout(msgspec.json.encode(result) + b"\n")
    return 0


# -- the soak's orchestrator: the daemon's lives, samples, restarts, verdicts -----------------------------------------


class _SoakStartError(Exception):
    """A life of the daemon did not come up: the soak cannot go on, and says why."""


class _SoakDaemon:
    """The daemon as a subprocess, run from a frozen copy of the package: restarts must not pick up files being
    edited meanwhile, and every life must run the same code."""

    def __init__(self, root: Path, code: Path) -> None:
        self.root = root
        self.code = code
        self.socket = root / "run" / "devd.sock"
        self.state = root / "state"
        self.env = {**os.environ, "PYTHONPATH": str(code)}
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0
        self.started_at = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> float:
        """Start a new life; the seconds until it listens."""
        self.lives += 1
        argv = [sys.executable, "-m", "devd", "serve", "--socket", str(self.socket), "--state-dir", str(self.state)]
        started = time.monotonic()
        with open(self.root / f"daemon-{self.lives}.log", "wb") as out:
            self.proc = subprocess.Popen(
                argv + ["--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, cwd=self.code, env=self.env
            )
        try:
            _wait_socket(self.socket, self.proc)
        except (RuntimeError, TimeoutError) as e:
            tail = (self.root / f"daemon-{self.lives}.log").read_bytes()[-1500:].decode(errors="replace").strip()
            raise _SoakStartError(f"life {self.lives} did not start: {e}; its log ends: {tail}") from None
        self.started_at = time.monotonic()
        return self.started_at - started

    def stop(self, how: str) -> dict[str, Any]:
        """SIGTERM (graceful: it must exit 0 within SOAK_STOP_S) or SIGKILL; what happened."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
        try:
            code = self.proc.wait(SOAK_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            how += " (hung; killed)"
        return {"how": how, "life": self.lives, "exit": code, "stop_s": round(time.monotonic() - started, 2)}

    def call(self, method: str) -> Any:
        """One request on a connection of its own; by hand, so that nothing is imported from a tree being edited."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(self.socket))
            sock.sendall(_soak_encoder.encode({"jsonrpc": "2.0", "id": 1, "method": method, "params": {}}) + b"\n")
            with sock.makefile("rb") as f:
                reply = _soak_reply.decode(f.readline(SOAK_LINE_LIMIT))
        if reply.error is not None:
            raise ValueError(f"{method} answered {reply.error}")
        return msgspec.json.decode(reply.result)


def _proc_status(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "Threads"):
                fields[name] = int(value.split()[0])
    return fields


def _tree_bytes(path: Path) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:  # the WAL or a temporary file went meanwhile
                pass
    return total


def _soak_sample(daemon: _SoakDaemon, t0: float, progress: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The daemon's resources now (read from /proc before the status connection, which would count as an fd)."""
    now = time.monotonic()
    status = _proc_status(daemon.pid)
    fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    cpu = _cpu_seconds(daemon.pid)
    # CPU in cores since the previous sample, or since this life began: the load the daemon was under.
    if previous is not None and previous["life"] == daemon.lives:
        cpu_share = (cpu - previous["cpu_s"]) / (now - t0 - previous["t_s"])
    else:
        cpu_share = cpu / max(now - daemon.started_at, 1e-3)
    sample: dict[str, Any] = {
        "cpu_s": cpu,
        "cpu": round(cpu_share, 2),
        "t_s": round(now - t0, 1),
        "life": daemon.lives,
        "uptime_s": round(now - daemon.started_at, 1),
        "rss_mib": round(status["VmRSS"] / 1024, 1),
        "fds": fds,
        "threads": status["Threads"],
        "state_mib": round(_tree_bytes(daemon.state) / (1 << 20), 2),
    }
    try:
        sample["steps"] = int(msgspec.json.decode(progress.read_bytes())["steps"])
    except (OSError, msgspec.DecodeError, KeyError):
        sample["steps"] = None
    try:
        st = daemon.call("daemon/status")
        sample["sessions"] = sum(st["sessions"].values())
        sample["live"] = st["sessions"].get("live")  # sessions whose instance is in memory
        sample["connections"] = st["connections"]
        sample["daemon_errors"] = st["errors"]
    except Exception as e:  # a sample must not end the soak; the table shows the gap
        sample["sessions"] = sample["live"] = sample["connections"] = None
        sample["status_error"] = f"{type(e).__name__}: {e}"[:200]
    return sample


def _soak_verdicts(samples: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(samples)
    verdicts: dict[str, Any] = {}
    if n < 6:
        return {"error": f"{n} samples; the plateau needs at least 6 (two per third)"}
    middle, last = samples[n // 3 : 2 * n // 3], samples[2 * n // 3 :]
    for metric, (relative, slack) in SOAK_PLATEAU.items():
        m = statistics.fmean(s[metric] for s in middle)
        la = statistics.fmean(s[metric] for s in last)
        limit = m * (1 + relative) + slack
        verdicts[metric] = {
            "middle_mean": round(m, 2),
            "last_mean": round(la, 2),
            "limit": round(limit, 2),
            "verdict": "PASS" if la <= limit else "FAIL",
        }

    def growth(part: list[dict[str, Any]]) -> float | None:
        """KiB of state directory per 1,000 steps answered, from the part's first sample to its last."""
        first, end = part[0], part[-1]
        if first["steps"] is None or end["steps"] is None or end["steps"] <= first["steps"]:
            return None
        kib = (float(end["state_mib"]) - float(first["state_mib"])) * 1024
        return round(kib / (int(end["steps"]) - int(first["steps"])) * 1000, 1)

    verdicts["state_mib"] = {
        "kib_per_1000_steps": growth(samples),
        "middle_third": growth(middle),
        "last_third": growth(last),
        "verdict": "INFO",
    }
    verdicts["thirds"] = {"samples": n, "middle": [n // 3 + 1, 2 * n // 3], "last": [2 * n // 3 + 1, n]}
    return verdicts


def _soak_final_check(daemon: _SoakDaemon, result: SoakLoadResult, tally: _SoakTally) -> None:
    """After the load is over and one more restart: what the clients were answered is what the daemon holds."""
    listing = {s["session"]: s for s in daemon.call("session/list")["sessions"]}
    for name, (seq, may_be_ahead) in result.sessions.items():
        row = listing.get(name)
        if row is None:
            tally.anomaly("lost_ack", f"{name}: answered {seq} steps, missing at the end")
        elif row["seq"] < seq:
            tally.anomaly("lost_ack", f"{name}: session/list says seq {row['seq']} at the end, answered {seq}")
        elif row["seq"] > seq + may_be_ahead:
            tally.anomaly("extra_step", f"{name}: session/list says seq {row['seq']} at the end, answered {seq}")
        elif row["state"] not in ("live", "stored"):
            tally.anomaly("session_state", f"{name} is {row['state']} at the end: {row.get('reason')}")
    for name in result.closed:
        if name in listing:
            tally.anomaly("closed_back", f"{name} was closed (answered) and is listed at the end")
    tally.counts["sessions checked at the end"] = len(result.sessions)
    tally.counts["closed sessions checked at the end"] = len(result.closed)


def _soak_logs(root: Path) -> list[dict[str, Any]]:
    """The daemon's warnings and errors over all its lives, grouped by event, with one example of each."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(root.glob("daemon-*.log"), key=lambda p: int(p.stem.split("-")[1])):
        for raw in path.read_bytes().splitlines():
            try:
                entry = msgspec.json.decode(raw)
                key = (str(entry.get("level", "?")), str(entry.get("event", "?")) + _soak_log_reason(entry))
            except (msgspec.DecodeError, AttributeError):
                key = ("text", raw.decode(errors="replace")[:100])
            group = groups.setdefault(key, {"level": key[0], "event": key[1], "count": 0, "example": raw[:400]})
            group["count"] += 1
            group["lives"] = sorted({*group.get("lives", []), int(path.stem.split("-")[1])})
    rows = sorted(groups.values(), key=lambda g: -int(g["count"]))
    for g in rows:
        g["example"] = g["example"].decode(errors="replace")
    return rows


def _soak_log_reason(entry: dict[str, Any]) -> str:
    reason = entry.get("reason")
    return f" ({reason})" if isinstance(reason, str) else ""


def _soak_freeze(code: Path, git_rev: str | None) -> str:
    """Copy the package the daemon and the load run from, and say what it is. The working tree by default; with
    `git_rev`, that commit's devd/ (plus core.wasm, which git does not track, and these benchmarks for the load)."""
    here = Path(__file__).parent
    repo = here.parent
    package = repo / "devd"

    def git(*argv: str) -> bytes:
        return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, check=True).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").decode().strip()
    except (OSError, subprocess.CalledProcessError):
        head = "?"
    shutil.copytree(here, code / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    if git_rev is None:
        shutil.copytree(package, code / "devd", ignore=shutil.ignore_patterns("__pycache__"))
        try:
            changed = git("status", "--short", "--", str(package)).decode().split("\n")
        except (OSError, subprocess.CalledProcessError):
            changed = []
        changed = [c.strip() for c in changed if c.strip()]
        return f"working tree at {head}" + (f", uncommitted: {', '.join(changed)}" if changed else "")
    with tarfile.open(fileobj=io.BytesIO(git("archive", git_rev, "devd"))) as tar:
        tar.extractall(code, filter="data")
    shutil.copy2(package / "core.wasm", code / "devd" / "core.wasm")
    rev = git("rev-parse", "--short", git_rev).decode().strip()
    return f"git {rev} (devd/ as committed; core.wasm and the benchmarks from the working tree)"


def bench_soak(
    minutes: float,
    clients: int,
    watchers: int,
    interval_s: float,
    think_ms: float = 10.0,
    restart_every_s: float = SOAK_RESTART_EVERY_S,
    seed: int = 1,
    keep: bool = False,
    git_rev: str | None = None,
) -> dict[str, Any]:
    """The daemon for `minutes` under clients and watchers, restarted every `restart_every_s` (SIGTERM, SIGKILL by
    turns; 0: never), sampled every `interval_s`; the curve, the restarts, what the load counted, and the anomalies."""
    root = Path(tempfile.mkdtemp(prefix="devd-soak-"))
    code = root / "code"
    provenance = _soak_freeze(code, git_rev)
    daemon = _SoakDaemon(root, code)
    run = _SoakRun(daemon, root, minutes * 60, interval_s, restart_every_s)
    config = SoakLoadConfig(str(daemon.socket), clients, watchers, run.seconds, think_ms, str(run.progress), seed)
    error: str | None = None
    try:
        run.run(config)
    except _SoakStartError as e:  # nothing more can be measured; what was is reported, and the run fails
        error = str(e)
        run.tally.anomaly("daemon_start", error)
    finally:
        run.end()
    tally, result = run.tally, run.result
    for r in run.restarts:
        if r["how"].startswith("SIGTERM") and r["exit"] != 0:
            tally.anomaly("graceful_stop", f"life {r['life']}: SIGTERM gave exit {r['exit']} after {r['stop_s']} s")
    anomalies = collections.Counter(tally.anomalies)
    examples = list(tally.examples)
    counts: dict[str, int] = dict(tally.counts)
    if result is not None:
        anomalies.update(result.anomalies)
        examples = result.examples + examples
        counts = {**result.counts, **counts}
    logs = _soak_logs(root)
    kept = keep or bool(anomalies)
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "minutes": minutes,
        "clients": clients,
        "watchers": watchers,
        "interval_s": interval_s,
        "think_ms": think_ms,
        "restart_every_s": restart_every_s,
        "cpus": os.cpu_count(),
        "code": provenance,
        "error": error,
        "samples": run.samples,
        "restarts": run.restarts,
        "verdicts": _soak_verdicts(run.samples),
        "counts": counts,
        "anomalies": dict(anomalies),
        "anomaly_examples": examples[:60],
        "daemon_log": logs,
        "kept": str(root) if kept else None,
    }


class _SoakRun:
    """The orchestrator's loop: one clock for samples and restarts, so a sample never lands on a restart."""

    def __init__(self, daemon: _SoakDaemon, root: Path, seconds: float, interval_s: float, restart_s: float) -> None:
        self.daemon = daemon
        self.root = root
        self.seconds = seconds
        self.interval_s = interval_s
        self.restart_s = restart_s
        self.progress = root / "progress.json"
        self.tally = _SoakTally()
        self.samples: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.result: SoakLoadResult | None = None
        self.load: subprocess.Popen[bytes] | None = None
        self.kinds = itertools.cycle(("SIGTERM", "SIGKILL"))
        self.t0 = time.monotonic()

    def restart(self, how: str, **extra: Any) -> None:
        self.restarts.append({"t_s": round(time.monotonic() - self.t0, 1), **extra, **self.daemon.stop(how)})
        self.restarts[-1]["ready_s"] = round(self.daemon.start(), 2)

    def run(self, config: SoakLoadConfig) -> None:
        daemon = self.daemon
        daemon.start()
        with open(self.root / "load.err", "wb") as err:
            argv = [sys.executable, "-c", _SOAK_LOAD_ENTRY, msgspec.json.encode(config).decode()]
            self.load = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, cwd=daemon.code, env=daemon.env)
        self.t0 = t0 = time.monotonic()
        next_sample = t0 + self.interval_s
        # Restarts fall half-way between samples, so that no sample is of a daemon a moment old.
        no_restarts = self.restart_s <= 0  # a run without them shows what one long life accumulates
        next_restart = float("inf") if no_restarts else t0 + self.restart_s + self.interval_s / 2
        while time.monotonic() < t0 + self.seconds and self.load.poll() is None:
            _sleep_until(min(next_sample, next_restart, t0 + self.seconds))
            assert daemon.proc is not None
            if daemon.proc.poll() is not None:
                self.tally.anomaly("daemon_died", f"life {daemon.lives} exited by itself with {daemon.proc.returncode}")
                self.restarts.append({"how": "died", "life": daemon.lives, "exit": daemon.proc.returncode, "stop_s": 0})
                self.restarts[-1]["ready_s"] = round(daemon.start(), 2)
            if time.monotonic() >= next_restart:
                self.restart(next(self.kinds))
                next_restart += self.restart_s
            if time.monotonic() >= next_sample:
                # Not of a daemon a moment old: its clients are still reconnecting, and its fds would read low.
                _sleep_until(daemon.started_at + min(3.0, self.interval_s / 2))
                self.samples.append(_soak_sample(daemon, t0, self.progress, self.samples[-1] if self.samples else None))
                s = self.samples[-1]
                print(
                    f"soak: {s['t_s']:.0f}/{self.seconds:.0f} s, life {s['life']}, rss {s['rss_mib']} MiB, "
                    f"fds {s['fds']}, threads {s['threads']}, state {s['state_mib']} MiB, steps {s['steps']}",
                    file=sys.stderr,
                    flush=True,
                )
                next_sample += self.interval_s
        try:
            out, _ = self.load.communicate(timeout=SOAK_GRACE_S + 90)
        except subprocess.TimeoutExpired:
            self.load.kill()
            out, _ = self.load.communicate()
            self.tally.anomaly("load_stuck", "the load process overran its bound and was killed")
        if self.load.returncode == 0:
            self.result = msgspec.json.decode(out, type=SoakLoadResult)
            # One more restart, the kind that comes next, then every session against what its client was answered.
            self.restart(next(self.kinds), final=True)
            try:
                _soak_final_check(daemon, self.result, self.tally)
            except (OSError, ConnectionError, ValueError) as e:  # the daemon did not answer session/list
                self.tally.anomaly("final_check", f"session/list after the last restart failed: {e}")
        else:
            tail = (self.root / "load.err").read_bytes()[-2000:].decode(errors="replace")
            self.tally.anomaly("load_failed", f"the load process exited {self.load.returncode}: {tail}")
        self.restarts.append({"t_s": round(time.monotonic() - t0, 1), "final": True, **daemon.stop("SIGTERM")})

    def end(self) -> None:
        """Whatever happened, no process of the soak outlives it."""
        for proc in (self.load, self.daemon.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _soak_report(r: dict[str, Any]) -> str:
    """The curve as a table, the restarts, what the load counted, the verdicts with their rule, and the anomalies."""
    out: list[str] = []
    cols = [("t_s", 7), ("life", 5), ("uptime_s", 9), ("cpu", 5), ("rss_mib", 8), ("fds", 5), ("threads", 8)]
    cols += [("state_mib", 10), ("steps", 9), ("sessions", 9), ("live", 6), ("connections", 12)]
    out.append(
        f"soak: {r['minutes']} min, {r['clients']} clients, {r['watchers']} watchers, samples every "
        f"{r['interval_s']} s, restarts every {r['restart_every_s']} s, think {r['think_ms']} ms, "
        f"{r['cpus']} cpus"
    )
    out.append(f"code: {r['code']}")
    if r.get("error"):
        out.append(f"stopped early: {r['error']}")
    out.append("")
    out.append("".join(f"{name:>{w}}" for name, w in cols))
    for s in r["samples"]:
        out.append("".join(f"{'-' if s.get(name) is None else s[name]:>{w}}" for name, w in cols))
    out.append("")
    out.append("restarts:")
    for x in r["restarts"]:
        final = " (final)" if x.get("final") else ""
        at = f"t={x['t_s']:>6} s  " if "t_s" in x else ""
        ready = f", next life listening after {x['ready_s']} s" if "ready_s" in x else ""
        out.append(f"  {at}life {x['life']:>2}: {x['how']}{final}, exit {x['exit']} after {x['stop_s']} s{ready}")
    out.append("")
    out.append("load:")
    width = max((len(name) for name in r["counts"]), default=0)
    for name, value in sorted(r["counts"].items()):
        out.append(f"  {name:<{width}} {value:>12,}")
    out.append("")
    v = r["verdicts"]
    if "error" in v:
        out.append(f"plateau: no verdict ({v['error']})")
    else:
        t = v["thirds"]
        out.append(
            f"plateau (rule, per metric: PASS if mean(last third) <= mean(middle third) x (1 + relative) + slack; "
            f"samples {t['middle'][0]}-{t['middle'][1]} vs {t['last'][0]}-{t['last'][1]} of {t['samples']}):"
        )
        for metric, (relative, slack) in SOAK_PLATEAU.items():
            m = v[metric]
            out.append(
                f"  {metric:<9} middle {m['middle_mean']:>9}  last {m['last_mean']:>9}  limit {m['limit']:>9} "
                f"(x{1 + relative:.2f} + {slack:g})  {m['verdict']}"
            )
        st = v["state_mib"]
        out.append(
            f"  state_mib grows {st['kib_per_1000_steps']} KiB per 1,000 steps answered over the run (middle third "
            f"{st['middle_third']}, last third {st['last_third']}); it holds the sessions left open, so no plateau "
            "is expected: INFO"
        )
    out.append("")
    if r["daemon_log"]:
        out.append("daemon log (warnings and errors, all lives):")
        for g in r["daemon_log"][:12]:
            out.append(f"  {g['count']:>6} {g['level']:<8} {g['event']}  lives {g['lives'][:8]}")
        out.append("")
    if r["anomalies"]:
        kinds = ", ".join(f"{k} {n}" for k, n in r["anomalies"].items())
        out.append(f"anomalies: {sum(r['anomalies'].values())} ({kinds})")
        for e in r["anomaly_examples"][:20]:
            out.append(f"  {e}")
    else:
        out.append(
            "anomalies: none (no lost acknowledged step, no extra step, no CONFLICT on a retry, no unexpected "
            "error kind, no watcher gap or repeat, every SIGTERM exited 0)"
        )
    if r["kept"]:
        out.append(f"kept: {r['kept']}")
    return "\n".join(out)


def _soak_command(args: argparse.Namespace) -> int:
    """Exit 1 on any anomaly, 2 if there is none but a plateau verdict is FAIL, else 0."""
    result = bench_soak(
        args.minutes,
        args.clients,
        args.watchers,
        args.interval_s,
        args.think_ms,
        args.restart_every_s,
        args.seed,
        args.keep,
        args.git_rev,
    )
    print(_soak_report(result), flush=True)
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    if result["anomalies"]:
        return 1
    verdicts = result["verdicts"]
    return 2 if any(isinstance(m, dict) and m.get("verdict") == "FAIL" for m in verdicts.values()) else 0


# -- many sessions: hibernation at scale ----------------------------------------------------------------------------


def _proc_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


async def _fill(address: str, sessions: int, clients: int) -> float:
    """Create `sessions` sessions of one seed turn's first two steps each, from `clients` connections; seconds."""
    import anyio

    from devd.client import AsyncClient

    turn_events = seed_turn(1, 1)[:2]
    started = time.monotonic()

    async def one(first: int) -> None:
        async with AsyncClient.connect(address) as c:
            for n in range(first, sessions, clients):
                name = await c.new(session=f"m{n:07}")
                for event in turn_events:
                    await c.call_raw("session/step", {"session": name, "event": msgspec.Raw(event)})

    async with anyio.create_task_group() as tg:
        for i in range(clients):
            tg.start_soon(one, i)
    return time.monotonic() - started


def bench_many(sessions: int, clients: int, max_live: int, wakes: int) -> dict[str, Any]:
    """`sessions` stored sessions under `--max-live max_live`: the fill, then a restart: time to ready, RSS, the
    latency of waking a stored session (a step on it), and of a `session/list` page of 1,000."""
    import anyio

    from devd.client import Client

    root = Path(tempfile.mkdtemp(prefix="devd-many-"))
    root.chmod(0o700)
    sock, state = root / "d.sock", root / "state"
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(state)]
    argv += ["--log-level", "warning", "--max-live", str(max_live)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_socket(sock, proc)
        fill_s = anyio.run(_fill, str(sock), sessions, clients)
        rss_filled = _proc_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_socket(sock, proc)
        with Client.connect(sock) as c:
            c.call("daemon/status")
            ready_s = time.monotonic() - started
            rss_ready = _proc_rss_mib(proc.pid)
            rng = random.Random(1)
            wake = []
            for n in rng.sample(range(sessions), min(wakes, sessions)):
                t = time.perf_counter()
                c.call_raw("session/step", {"session": f"m{n:07}", "event": msgspec.Raw(b'{"Timer":true}')})
                wake.append(time.perf_counter() - t)
            pages, cursor = [], None
            for _ in range(20):
                params: dict[str, Any] = {"limit": 1000} if cursor is None else {"limit": 1000, "cursor": cursor}
                t = time.perf_counter()
                page = c.call("session/list", params)
                pages.append(time.perf_counter() - t)
                cursor = page.get("next")
            status = c.call("daemon/status")
            rss_woken = _proc_rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    wake.sort()
    pages.sort()
    return {
        "sessions": sessions,
        "max_live": max_live,
        "fill_s": round(fill_s, 1),
        "fill_sessions_per_s": round(sessions / fill_s),
        "rss_mib_filled": round(rss_filled, 1),
        "restart_ready_s": round(ready_s, 3),
        "rss_mib_ready": round(rss_ready, 1),
        "wake_step_p50_ms": round(wake[len(wake) // 2] * 1000, 3),
        "wake_step_p99_ms": round(wake[int(len(wake) * 0.99)] * 1000, 3),
        "list_page_1000_p50_ms": round(pages[len(pages) // 2] * 1000, 3),
        "rss_mib_after_wakes": round(rss_woken, 1),
        "live_after_wakes": status["sessions"]["live"],
        "hibernated": status["hibernated"],
        "state_dir_mib": round(sum(f.stat().st_size for f in state.iterdir()) / (1 << 20), 1),
    }


# -- the agent runtime: the daemon's own time per action, against the stand-in model's --------------------------------


def _agent_notices(client: Any, turn: int) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, params) of each `session/actions` a watching client reads, up to the turn's Done."""
    seen = []
    while True:
        notice = client.wait_notification(60)
        if notice.method != "session/actions":
            continue
        seen.append((time.perf_counter(), notice.params))
        if any(a["op"].get("Done", {}).get("turn") == turn for a in notice.params["actions"]):
            return seen


def _stand_in_ms(url: str, rounds: int) -> list[float]:
    """How long one streamed completion of the stand-in takes as the daemon's own model driver sees it, from this
    process: the model's time, without the daemon."""
    import anyio

    from devd.agent import http, model
    from devd.agent.profiles import Profile
    from devd.messages import Message

    profile = Profile(name="bench", base_url=url, model="standin", workspace_roots=("/",))
    times: list[float] = []

    async def ask() -> None:
        async with http.new_client() as client:
            for _ in range(rounds):
                started = time.perf_counter()
                await model.complete(client, profile, [Message(User="hi")], environ={}, exec_available=True)
                times.append((time.perf_counter() - started) * 1000)

    anyio.run(ask)
    return times


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 3) if ordered else 0.0


def _agent_reply(body: dict[str, Any]) -> Any:
    """The stand-in's script as a function of the request: a prompt `read N` (or `run N`) is answered with a Read
    of a.txt (an Exec of `true`) until N results have come, then with text; `write N` with one reply of N Writes
    (f0.txt, f1.txt, ...), then text; any other prompt with text."""
    from tests.standin_model import Scripted

    messages = body["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    verb, _, count = str(messages[last_user]["content"]).partition(" ")
    done = sum(m["role"] == "tool" for m in messages[last_user:])
    if verb == "read" and done < int(count):
        return Scripted(tool_calls=[("read", {"path": "a.txt"})])
    if verb == "run" and done < int(count):
        return Scripted(tool_calls=[("exec", {"argv": ["true"]})])
    if verb == "write" and done == 0:  # one reply of N Writes, each rewriting f{i}.txt (bench rewind)
        return Scripted(tool_calls=[("write", {"path": f"f{i}.txt", "text": "new"}) for i in range(int(count))])
    return Scripted(text="ok")


def _standin_main(url_file: str) -> None:
    """`bench _standin FILE`: the stand-in model server in a process of its own (so that its threads do not share a
    GIL with the client that measures), answering `_agent_reply`; its url is written to FILE."""
    from tests.standin_model import Standin

    with Standin() as standin:
        standin.script(*[_agent_reply] * 1_000_000)
        Path(url_file).write_text(standin.url)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _start_standin(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    url_file = root / "standin.url"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench", "_standin", str(url_file)])
    for _ in range(1500):
        if url_file.exists() and (url := url_file.read_text()):
            return proc, url
        if proc.poll() is not None:
            raise SystemExit("bench agent needs the stand-in model server of a checkout (tests/standin_model.py)")
        time.sleep(0.02)
    raise TimeoutError("the stand-in model server did not start within 30 s")


def bench_agent(calls: int, model_turns: int, execs: int) -> dict[str, Any]:
    """The agent runtime against the stand-in model server (tests/standin_model.py, so: from a checkout), each in a
    process of its own: a daemon with one profile, and a watcher here reading every step as it is made.

    - the stand-in's own time per streamed completion, measured from here with the daemon's model driver;
    - per model call, the daemon's own time: from the step that dispatched the ask to the step of its answer (as the
      watcher sees them), less the stand-in's median time;
    - per Read call (a worker thread, no subprocess, no claim): from the step that dispatched it to its result's
      step; per Exec of `true` (a durable claim, a process under bubblewrap), the same;
    - a turn of `calls` tool calls (a Read each, a model call before each and one after), end to end, against the
      stand-in's time for its model calls."""
    from devd.client import Client

    root = Path(tempfile.mkdtemp(prefix="devd-bench-agent-"))
    workspace = root / "roots" / "ws"
    workspace.mkdir(parents=True)
    (workspace / "a.txt").write_text("hello\n")
    standin, url = _start_standin(root)
    try:
        (root / "agents.toml").write_text(
            f'[agent.bench]\nbase_url = "{url}"\nmodel = "standin"\nworkspace_roots = ["{root / "roots"}"]\n'
        )
        direct = _stand_in_ms(url, 20)
        sock, state = root / "devd.sock", root / "state"
        argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(state)]
        proc = subprocess.Popen([*argv, "--agents", str(root / "agents.toml"), "--log-level", "warning"])
        try:
            _wait_socket(sock, proc)
            with Client.connect(sock, timeout=60) as c:
                session = c.new(agent="bench", workspace=str(workspace))
                c.call("session/watch", {"session": session})
                model_ms: list[float] = []
                overhead: list[float] = []
                for _ in range(model_turns):  # alternated with the stand-in asked from here, so drift hits both
                    alone = _stand_in_ms(url, 3)[1:]  # the first of a new event loop and client is a cold one
                    direct += alone
                    seen = _agent_notices(c, c.prompt(session, "hi"))
                    model_ms.append((seen[1][0] - seen[0][0]) * 1000)
                    overhead.append(model_ms[-1] - statistics.median(alone))
                steps = [t for t, _ in _agent_notices(c, c.prompt(session, f"run {execs}"))]
                exec_ms = [(steps[i + 1] - steps[i]) * 1000 for i in range(1, 2 * execs, 2)]
                started = time.perf_counter()
                steps = [t for t, _ in _agent_notices(c, c.prompt(session, f"read {calls}"))]
                turn_ms = (time.perf_counter() - started) * 1000
                read_ms = [(steps[i + 1] - steps[i]) * 1000 for i in range(1, 2 * calls, 2)]
                model_ms += [(steps[i + 1] - steps[i]) * 1000 for i in range(0, 2 * calls + 1, 2)]
                commit_ms = c.status().commit_ms_p50
                c.close_session(session)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    finally:
        standin.send_signal(signal.SIGTERM)
        standin.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    stand_in = _ms(direct, 0.5)
    overhead += [m - stand_in for m in model_ms[model_turns:]]
    return {
        "stand_in_ms_p50": stand_in,
        "commit_ms_p50": commit_ms,  # the daemon's fsync'd commit, which every step waits for
        "model_call_ms_p50": _ms(model_ms, 0.5),
        "model_call_overhead_ms_p50": _ms(overhead, 0.5),
        "model_call_overhead_ms_p90": _ms(overhead, 0.9),
        "model_call_overhead_per_stand_in_ms": round(_ms(overhead, 0.5) / stand_in, 3) if stand_in else None,
        "read_call_ms_p50": _ms(read_ms, 0.5),
        "read_call_ms_p90": _ms(read_ms, 0.9),
        "exec_true_ms_p50": _ms(exec_ms, 0.5),
        f"turn_of_{calls}_reads_ms": round(turn_ms, 1),
        f"turn_of_{calls}_reads_per_stand_in_time": round(turn_ms / ((calls + 1) * stand_in), 2) if stand_in else None,
        "model_calls_measured": len(model_ms),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench")
    sub = p.add_subparsers(dest="what", required=True)
    core = sub.add_parser("core")
    core.add_argument("--rounds", type=int, default=300)
    core.add_argument("--sessions", type=int, default=1000)
    daemon = sub.add_parser("daemon")
    daemon.add_argument("--clients", type=int, default=16)
    daemon.add_argument("--seconds", type=float, default=5.0)
    daemon.add_argument("--rounds", type=int, default=3)
    daemon.add_argument("--single-client-seconds", type=float, default=3.0)
    daemon.add_argument("--generators", type=int, default=1, help="load generator processes splitting the clients")
    daemon.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help=f"a comma-separated subset of {','.join(SERVERS)}, and {','.join(BASELINE_SERVERS)} (with --baseline)",
    )
    daemon.add_argument("--baseline", help="a checkout whose devd the devd-baseline servers run, for a before/after")
    echo = sub.add_parser("_echo")
    echo.add_argument("socket")
    anyio_echo = sub.add_parser("_anyio_echo")
    anyio_echo.add_argument("socket")
    durable_floor = sub.add_parser("_durable_floor")
    durable_floor.add_argument("socket")
    durable_floor.add_argument("database")
    durable_floor.add_argument("--core", action="store_true", help="step each session's instance of the core too")
    durable_floor.add_argument("--tasks", action="store_true", help="run each request in a task of its own, as devd")
    load = sub.add_parser("_load")
    load.add_argument("address")
    load.add_argument("--clients", type=int, default=16)
    load.add_argument("--first-client", type=int, default=0)
    load.add_argument("--seconds", type=float, default=5.0)
    load.add_argument(
        "--after-ready", action="store_true", help="say when connected, then read the window's start from stdin"
    )
    many = sub.add_parser("many", help="stored sessions at scale: restart, RSS, waking, list pages")
    many.add_argument("--sessions", type=int, default=100_000)
    many.add_argument("--clients", type=int, default=16)
    many.add_argument("--max-live", type=int, default=1000)
    many.add_argument("--wakes", type=int, default=2000)
    soak = sub.add_parser("soak", help="exit 1 on an anomaly, 2 if none but a plateau verdict is FAIL")
    soak.add_argument("--minutes", type=float, required=True)
    soak.add_argument("--clients", type=int, default=8)
    soak.add_argument("--watchers", type=int, default=4, help=f"connections, by turns {', '.join(SOAK_WATCHER_KINDS)}")
    soak.add_argument("--interval-s", type=float, default=10.0, help="seconds between samples")
    soak.add_argument("--think-ms", type=float, default=10.0, help="each client's mean pause after a request")
    soak.add_argument("--restart-every-s", type=float, default=SOAK_RESTART_EVERY_S, help="0: no restarts")
    soak.add_argument("--seed", type=int, default=1)
    soak.add_argument("--json", help="write the samples, restarts, counts and verdicts here")
    soak.add_argument("--keep", action="store_true", help="keep the state, logs and code copy (kept on anomalies)")
    soak.add_argument("--git-rev", help="run the daemon from this commit's devd/ rather than the working tree")
    sub.add_parser("_standin").add_argument("url_file")
    agent = sub.add_parser("agent", help="the agent runtime's own time per action, against the stand-in model's")
    agent.add_argument("--calls", type=int, default=50, help="tool calls of the measured turn")
    agent.add_argument("--model-turns", type=int, default=30, help="turns of one model call each")
    agent.add_argument("--execs", type=int, default=10, help="Exec calls of `true` (under the sandbox)")
    agent.add_argument(
        "--oversight",
        action="store_true",
        help="instead, what approvals, spend ceilings and the trace add: a turn of --calls commands with and without "
        "them, alternated (the same as `approvals`)",
    )
    from benchmarks import bench_fleet, bench_long  # here, not at the top: they import this module's helpers

    bench_long.add_arguments(sub.add_parser("long", help="one session's cost as it grows; exit 1 on error answers"))
    bench_fleet.add_arguments(sub.add_parser("fleet", help="daemons on one PostgreSQL; exit 1 when a setup failed"))
    approvals_parser = sub.add_parser(
        "approvals", help="what approvals, spend ceilings and the trace add to a turn the daemon drives"
    )
    from benchmarks.bench_approvals import add_arguments as approvals_arguments
    from benchmarks.bench_start import add_arguments as start_arguments

    start_arguments(sub.add_parser("start", help="exec to the first answer: devd vs a minimal Python daemon"))
    from benchmarks.bench_client import add_arguments as client_arguments

    client_arguments(sub.add_parser("client", help="one call's round trip through each client, against a bare socket"))
    from benchmarks.bench_sandbox import add_arguments as sandbox_arguments

    sandbox_arguments(sub.add_parser("sandbox", help="a command's confinement, per command, against an unconfined one"))
    from benchmarks.bench_mcp import add_arguments as mcp_arguments

    mcp_arguments(sub.add_parser("mcp", help="the MCP broker's cost per call, and server processes for N sessions"))
    from benchmarks.bench_idle import add_arguments as idle_arguments

    idle_arguments(sub.add_parser("idle", help="an idle daemon's wake-ups a second, against a process that waits"))
    from benchmarks.bench_rows import add_arguments as rows_arguments

    rows_arguments(sub.add_parser("rows", help="a journal row's cost to the commit thread, against the floor's row"))
    from benchmarks.bench_rewind import add_arguments as rewind_arguments

    rewind_arguments(sub.add_parser("rewind", help="session/rewind of a turn's writes, against that turn"))

    from benchmarks.bench_chat import add_arguments as chat_arguments

    chat_arguments(sub.add_parser("chat", help="a model's first streamed chunk to devd chat's screen, against direct"))
    from benchmarks.bench_children import add_arguments as children_arguments
    from benchmarks.bench_mixed import add_arguments as mixed_arguments

    children_arguments(sub.add_parser("children", help="a child run's start and hand-back, and 100 children at once"))

    mixed_arguments(sub.add_parser("mixed", help="session/new beside one client's large steps, against it alone"))
    from benchmarks import bench_codex, bench_first, bench_stream

    bench_codex.add_arguments(sub.add_parser("codex", help="a scripted turn through devd and Codex's app-server"))
    sub.add_parser("_codex_models").add_argument("url_file")

    bench_first.add_arguments(sub.add_parser("first", help="devd run to the model's first text, cold and warm daemon"))
    sub.add_parser("_first_model").add_argument("url_file")

    bench_stream.add_arguments(sub.add_parser("stream", help="N agent sessions streaming to watchers: CPU, latency"))
    model = sub.add_parser("_stream_model")
    model.add_argument("port_file")
    model.add_argument("tokens", type=int)
    model.add_argument("rate", type=float)

    approvals_arguments(approvals_parser)

    args = p.parse_args(argv)
    if args.what == "soak":
        return _soak_command(args)
    if args.what == "long":
        return bench_long.command(args)
    if args.what == "fleet":
        return bench_fleet.command(args)
    if args.what == "codex":
        return bench_codex.main(args)
    if args.what == "_codex_models":
        bench_codex._models_main(args.url_file)
        return 0
    if args.what == "first":
        return bench_first.main(args)
    if args.what == "_first_model":
        bench_first._standin_main(args.url_file)
        return 0
    if args.what == "stream":
        return bench_stream.main(args)
    if args.what == "_stream_model":
        bench_stream._model_main(args.port_file, args.tokens, args.rate)
        return 0
    if args.what == "approvals":
        from benchmarks import bench_approvals as approvals  # the agent runtime's, loaded only when asked for

        return approvals.run(args)
    if args.what == "core":
        result: Any = bench_core(args.rounds, args.sessions)
    elif args.what == "start":
        from benchmarks.bench_start import bench_start, bench_start_phases

        result = bench_start_phases(args.rounds) if args.phases else bench_start(args.rounds, args.baseline)
    elif args.what == "client":
        from benchmarks.bench_client import bench_client

        result = bench_client(args.rounds, args.calls)
    elif args.what == "sandbox":
        from benchmarks.bench_sandbox import bench_sandbox

        result = bench_sandbox(args.rounds, args.runs)
    elif args.what == "chat":
        from benchmarks.bench_chat import bench_chat

        result = bench_chat(args.rounds)
    elif args.what == "mcp":
        from benchmarks.bench_mcp import bench_mcp

        result = bench_mcp(args.rounds, args.calls, args.sessions)
    elif args.what == "idle":
        from benchmarks.bench_idle import bench_idle

        result = bench_idle(args.seconds, args.settle)
    elif args.what == "rows":
        from benchmarks.bench_rows import bench_rows

        result = bench_rows(args.rows, args.batch, args.rounds)
    elif args.what == "rewind":
        from benchmarks.bench_rewind import bench_rewind

        result = bench_rewind(args.rounds, args.files)
    elif args.what == "children":
        from benchmarks.bench_children import bench_children

        result = bench_children(args.rounds, args.children)
    elif args.what == "mixed":
        from benchmarks.bench_mixed import bench_mixed

        result = bench_mixed(args.rounds, args.seconds, args.clients, args.payload_mib, args.postgres)
    elif args.what == "agent" and args.oversight:
        from benchmarks import bench_approvals as approvals

        return approvals.run(argparse.Namespace(calls=args.calls, rounds=3, turns=3))
    elif args.what == "agent":
        result = bench_agent(args.calls, args.model_turns, args.execs)
    elif args.what == "many":
        result = bench_many(args.sessions, args.clients, args.max_live, args.wakes)
    elif args.what == "daemon":
        servers = tuple(s for s in args.servers.split(",") if s)
        unknown = set(servers) - set(SERVERS) - set(BASELINE_SERVERS)
        if unknown:
            p.error(f"unknown servers: {', '.join(sorted(unknown))}")
        baseline = Path(args.baseline).resolve() if args.baseline else None
        if set(servers) & set(BASELINE_SERVERS) and (baseline is None or not (baseline / "devd").is_dir()):
            p.error("devd-baseline needs --baseline PATH, a checkout holding devd/ (and devd/core.wasm)")
        result = bench_daemon(
            args.clients, args.seconds, args.rounds, args.single_client_seconds, args.generators, servers, baseline
        )
    elif args.what == "_standin":
        _standin_main(args.url_file)
        return 0
    elif args.what == "_echo":
        _echo_server(args.socket)
        return 0
    elif args.what == "_anyio_echo":
        _anyio_echo_server(args.socket)
        return 0
    elif args.what == "_durable_floor":
        _durable_floor_server(args.socket, args.database, core=args.core, tasks=args.tasks)
        return 0
    else:
        _load_main(args.address, args.clients, args.first_client, args.seconds, args.after_ready)
        return 0
    _write_stdout(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
