"""Benchmarks, each against a baseline measured in the same run (machines here are noisy: trust the ratios).

python -m devd.bench core      # devd's step vs the naive ABI dance, session creation, RSS per idle session
python -m devd.bench daemon    # N clients in another process: devd vs devd's dispatch with stub handlers vs a floor
                               # (a minimal anyio echo), each server its own process, rounds alternated
"""

from __future__ import annotations

import argparse
import array
import asyncio
import gc
import itertools
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec

from devd.messages import Call, Event, Exec, Output, Read, answer, encode, turn

TURNS_PER_SESSION = 20


def _seed_turn(turn_id: int, first_id: int) -> list[bytes]:
    """The seed's full turn: a prompt, an answer with two calls, their two results, a text answer."""
    build, lib = Call(Exec=Exec(argv=["cargo", "build"])), Call(Read=Read(path="src/lib.rs"))
    return [
        encode(turn(turn_id, "fix the build")),
        encode(answer(first_id, "Let me look.", [build, lib])),
        encode(Event(Exec=Output(id=first_id + 1, text="error[E0425]", failed=True))),
        encode(Event(File=Output(id=first_id + 2, text="pub fn f() -> u8 { x }"))),
        encode(answer(first_id + 3, "`x` was never declared.")),
    ]


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
    warm, turn_events = _seed_turn(1, 1), _seed_turn(2, 8)

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
    import dataclasses

    import anyio

    from devd import log
    from devd.config import Settings
    from devd.daemon import Daemon, build
    from devd.listeners import bind_unix
    from devd.memory_store import MemoryStore
    from devd.methods import METHODS, Call, NewParams, SessionResult, StepParams, StepResult  # noqa: F401

    async def new(call: Call, params: NewParams) -> SessionResult:
        return SessionResult(params.session or "echo")

    async def step(call: Call, params: StepParams) -> StepResult:
        return StepResult(msgspec.Raw(b"[]"))

    stubs = {
        **METHODS,
        "session/new": dataclasses.replace(METHODS["session/new"], handler=new),
        "session/step": dataclasses.replace(METHODS["session/step"], handler=step),
    }
    log.configure("json", "warning")
    settings = Settings(state_dir=Path(tempfile.mkdtemp()), socket_path=Path(socket_path))
    _, dispatcher = build(settings, None, MemoryStore(), methods=stubs)  # type: ignore[arg-type]
    daemon = Daemon(settings, dispatcher, None)
    listeners = [(bind_unix(Path(socket_path))[0], "unix")]
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


# -- the load generator ----------------------------------------------------------------------------------------------
#
# The generator must not be what is measured, so it is not devd.client: asyncio Protocols on uvloop, one request in
# flight per client, the requests built from bytes encoded once (per process for the events, per conversation for
# the session name), each reply checked by a prefix comparison and decoded only when that does not match.

WARMUP_S = 1.0  # the generators start, connect and run this long before the measured window opens
_REQUEST_HEAD = b'{"jsonrpc":"2.0","id":%d'
_NEW_TAIL = b',"method":"session/new","params":{"session":"%s"}}\n'
_STEP_TAIL = b',"method":"session/step","params":{"session":"%s","event":%s}}\n'


def _conversation() -> list[bytes]:
    """The events of one conversation: TURNS_PER_SESSION seed turns, their ids continuing as a real session's do."""
    events, next_id = [], 1
    for t in range(1, TURNS_PER_SESSION + 1):
        events += _seed_turn(t, next_id)
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


async def _generate(address: str, clients: int, first_client: int, seconds: float, start_at: float) -> LoadResult:
    loop = asyncio.get_running_loop()
    load = _Load(loop, clients, start_at, start_at + seconds)
    load.clients = [_LoadClient(load, first_client + i) for i in range(clients)]
    # An exception in a protocol callback is only logged by the loop; here it must end the run, not stall a client.
    loop.set_exception_handler(lambda _, context: load.fail(f"generator callback failed: {context.get('exception')!r}"))
    await asyncio.gather(*(loop.create_unix_connection(lambda c=c: c, address) for c in load.clients))  # type: ignore[misc]
    if time.monotonic() >= start_at:
        raise RuntimeError(f"the generator connected after its window opened; raise WARMUP_S ({WARMUP_S} s)")
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


def _load_main(address: str, clients: int, first_client: int, seconds: float, start_at: float | None) -> None:
    if start_at is None:
        start_at = time.monotonic() + WARMUP_S
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        result = runner.run(_generate(address, clients, first_client, seconds, start_at))
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
    """Generator processes splitting `clients`, one window for all, while the server's CPU is read from outside."""
    start_at = time.monotonic() + WARMUP_S
    procs = []
    for g in range(generators):
        first, last = clients * g // generators, clients * (g + 1) // generators
        argv = [sys.executable, "-m", "devd.bench", "_load", address, "--clients", str(last - first)]
        argv += ["--first-client", str(first), "--seconds", str(seconds), "--start-at", repr(start_at)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    server_cpu = machine_busy = float("nan")
    try:
        _sleep_until(start_at)
        cpu0, busy0 = _cpu_seconds(server_pid), _machine_busy_seconds()
        _sleep_until(start_at + seconds)
        server_cpu = (_cpu_seconds(server_pid) - cpu0) / seconds
        machine_busy = (_machine_busy_seconds() - busy0) / seconds
    except FileNotFoundError:
        pass  # the server died; the generators say how
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=seconds + WARMUP_S + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"a load generator failed: {err.decode(errors='replace').strip()[-2000:]}")
        results.append(msgspec.json.decode(out, type=LoadResult))
    latencies = sorted(itertools.chain.from_iterable(array.array("d", r.latencies) for r in results))
    if not latencies:
        raise RuntimeError(f"no step was answered in the window against {address}")
    generator_cpu = sum(r.cpu_s / r.cpu_wall_s for r in results)
    return {
        "steps_per_s": sum(r.steps for r in results) / seconds,
        "requests_per_s": sum(r.requests for r in results) / seconds,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
        # Shares are in cores over the window. The generators' is each process's CPU time over its wall time,
        # summed; the busiest one is given too, since a single process near 1.0 is the bottleneck.
        "generator_cpu_share": generator_cpu,
        "generator_cpu_share_max": max(r.cpu_s / r.cpu_wall_s for r in results),
        "server_cpu_share": server_cpu,
        # Whatever else ran on the machine meanwhile (another build or test): the noise this run had. /proc/stat and
        # the per-process figures are sampled at different ticks, so it is good to about 0.1 core (and can dip below 0).
        "other_cpu_share": machine_busy - server_cpu - generator_cpu,
    }


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


SERVERS = ("anyio-echo", "dispatch", "devd", "devd-1-client")


def _server_argv(name: str, sock: Path, state: Path) -> list[str]:
    if name == "anyio-echo":
        return [sys.executable, "-m", "devd.bench", "_anyio_echo", str(sock)]
    if name == "dispatch":
        return [sys.executable, "-m", "devd.bench", "_echo", str(sock)]
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(state)]
    return argv + ["--log-level", "warning"]


def _run_server(name: str, root: Path, r: int, clients: int, seconds: float, generators: int) -> dict[str, Any]:
    """One server process under load; a server or generator that fails gives its error, and the benchmark goes on."""
    # A fresh state directory per run, so no round inherits the sessions of the one before.
    sock, state, log = root / f"{name}-{r}.sock", root / f"state-{name}-{r}", root / f"{name}-{r}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_server_argv(name, sock, state), stdout=out, stderr=subprocess.STDOUT)
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

    return {
        "dispatch_over_anyio_echo": over("dispatch", "anyio-echo"),
        "devd_over_anyio_echo": over("devd", "anyio-echo"),
        "devd_over_dispatch": over("devd", "dispatch"),
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
                if name == "devd-1-client":  # the latency of one client alone, nothing queued before it
                    runs[name].append(_run_server(name, root, r, 1, single_client_seconds, 1))
                else:
                    runs[name].append(_run_server(name, root, r, clients, seconds, generators))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devd.bench")
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
    daemon.add_argument("--servers", default=",".join(SERVERS), help=f"a comma-separated subset of {','.join(SERVERS)}")
    echo = sub.add_parser("_echo")
    echo.add_argument("socket")
    anyio_echo = sub.add_parser("_anyio_echo")
    anyio_echo.add_argument("socket")
    load = sub.add_parser("_load")
    load.add_argument("address")
    load.add_argument("--clients", type=int, default=16)
    load.add_argument("--first-client", type=int, default=0)
    load.add_argument("--seconds", type=float, default=5.0)
    load.add_argument("--start-at", type=float, help="time.monotonic() at which the window opens (all generators)")
    args = p.parse_args(argv)
    if args.what == "core":
        result: Any = bench_core(args.rounds, args.sessions)
    elif args.what == "daemon":
        servers = tuple(s for s in args.servers.split(",") if s)
        unknown = set(servers) - set(SERVERS)
        if unknown:
            p.error(f"unknown servers: {', '.join(sorted(unknown))}")
        result = bench_daemon(
            args.clients, args.seconds, args.rounds, args.single_client_seconds, args.generators, servers
        )
    elif args.what == "_echo":
        _echo_server(args.socket)
        return 0
    elif args.what == "_anyio_echo":
        _anyio_echo_server(args.socket)
        return 0
    else:
        _load_main(args.address, args.clients, args.first_client, args.seconds, args.start_at)
        return 0
    _write_stdout(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
