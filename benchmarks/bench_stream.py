"""`python -m benchmarks.bench stream`: the agent runtime at scale, a model's stream fanned out to watchers.

N agent sessions at once, each one turn: the model streams `--tokens` text fragments at `--rate` a second, then asks
for one Read; the Read's result goes back and the model answers "done". Every session has a client of its own (one
connection: it makes the session, watches it and prompts it), so every delta is one notice to one watcher.

The model is a stand-in of its own here (asyncio, in a process of its own, chunked server-sent events written on a
fixed schedule by one task for every stream), lean enough to keep 300 streams at 50 tokens/s on time on this
machine; each fragment's text is the monotonic time (CLOCK_MONOTONIC, shared by every process) at which the model
wrote it, so a watcher tells each fragment's latency from the model's write to its own read, however the daemon
groups fragments into notices.

Measured: the daemon's CPU (utime + stime of every thread, from /proc) over the turns, per streamed fragment, and per
thread; each turn from its prompt to its Done, against the model's own time (tokens / rate); the delta latency p50,
p99 and max; turns that never ended (a `session/stalled`, an `Unwatched`, or no Done within 3 times the model's
time). With `--baseline DIR` (a checkout of another devd, e.g. `git worktree add ../base main`) rounds alternate
between that daemon and this one, and each figure is also given as this / baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

CLK_TCK = os.sysconf("SC_CLK_TCK")
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


# -- the model --------------------------------------------------------------------------------------------------------


def _event(doc: dict[str, Any] | str) -> bytes:
    data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
    line = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(line), line)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "s",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "standin",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


_TEXT_BEFORE, _TEXT_AFTER = (b"data: " + json.dumps(_chunk({"content": "@@"})).encode() + b"\n\n").split(b"@@")


def _text_event(text: bytes) -> bytes:
    line = _TEXT_BEFORE + text + _TEXT_AFTER
    return b"%x\r\n%s\r\n" % (len(line), line)


_USAGE = {"id": "s", "object": "chat.completion.chunk", "created": 0, "model": "standin", "choices": []}


class _Schedule:
    """Every stream's fragments, written by one task on their schedule: a heap of (when the next is due, stream).

    One task a stream sleeping before each fragment (300 streams at 50 a second: 15,000 wake-ups a second) took a
    fifth of a core of this 2-core machine, beside the daemon it measures; this task wakes at most once a
    millisecond and writes every fragment then due."""

    TICK_S = 0.001  # the shortest sleep: a fragment is written up to this late, and its text says when it was

    def __init__(self, rate: float, late: list[float]) -> None:
        self.rate, self.late = rate, late
        self._heap: list[tuple[float, int, _Stream]] = []
        self._added = asyncio.Event()
        self._n = 0

    def add(self, stream: _Stream) -> None:
        self._n += 1
        heapq.heappush(self._heap, (stream.t0, self._n, stream))
        self._added.set()

    async def run(self) -> None:
        heap = self._heap
        while True:
            if not heap:
                self._added.clear()
                await self._added.wait()
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                due, n, stream = heapq.heappop(heap)
                self.late.append(now - due)
                stream.transport.write(_text_event(b"%.6f;" % now))
                stream.sent += 1
                if stream.sent < stream.tokens:
                    heapq.heappush(heap, (stream.t0 + stream.sent / self.rate, n, stream))
                else:
                    stream.done.set_result(None)
            if heap:
                await asyncio.sleep(max(self.TICK_S, heap[0][0] - time.monotonic()))


class _Stream:
    __slots__ = ("transport", "tokens", "t0", "sent", "done")

    def __init__(self, transport: asyncio.Transport, tokens: int, done: asyncio.Future[None]) -> None:
        self.transport, self.tokens, self.t0, self.sent, self.done = transport, tokens, time.monotonic(), 0, done


class _Model(asyncio.Protocol):
    """One connection of the stand-in: requests one after another (keep-alive), each answered as a stream."""

    def __init__(self, tokens: int, schedule: _Schedule) -> None:
        self.tokens, self.schedule = tokens, schedule
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, rest = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(rest) < length:
            return
        body, self.buffer = json.loads(rest[:length]), rest[length:]
        asyncio.get_running_loop().create_task(self.answer(body))

    async def answer(self, body: dict[str, Any]) -> None:
        transport = self.transport
        assert transport is not None
        messages = body["messages"]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        transport.write(_HEAD + _event(_chunk({"role": "assistant", "content": ""})))
        if any(m["role"] == "tool" for m in messages[last_user:]):
            transport.write(_event(_chunk({"content": "done"})) + _event(_chunk({}, "stop")))
        else:
            if self.tokens:
                done = asyncio.get_running_loop().create_future()
                self.schedule.add(_Stream(transport, self.tokens, done))
                await done
            call = {"index": 0, "id": "call_1", "type": "function"}
            call["function"] = {"name": "read", "arguments": '{"path": "a.txt"}'}
            transport.write(_event(_chunk({"tool_calls": [call]})) + _event(_chunk({}, "tool_calls")))
        usage = {"prompt_tokens": 10, "completion_tokens": self.tokens, "total_tokens": self.tokens + 10}
        transport.write(_event(_USAGE | {"usage": usage}) + _event("[DONE]") + b"0\r\n\r\n")


def _model_main(port_file: str, tokens: int, rate: float) -> None:
    """`bench _stream_model FILE TOKENS RATE`: the stand-in, its port written to FILE; on SIGTERM, how late its writes
    were against their schedule (FILE.late, JSON)."""
    import uvloop

    late: list[float] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        schedule = _Schedule(rate, late)
        writer = loop.create_task(schedule.run())
        server = await loop.create_server(lambda: _Model(tokens, schedule), "127.0.0.1", 0, backlog=4096)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        await stop.wait()
        writer.cancel()
        server.close()

    uvloop.run(serve())
    late.sort()
    n = len(late)
    summary = {"writes": n, "late_ms_p50": late[n // 2] * 1000, "late_ms_p99": late[int(n * 0.99)] * 1000} if n else {}
    Path(port_file + ".late").write_text(json.dumps(summary))


# -- the sessions' clients --------------------------------------------------------------------------------------------


class _Line(msgspec.Struct):
    id: int | None = None
    method: str | None = None
    params: msgspec.Raw = msgspec.Raw()
    result: msgspec.Raw = msgspec.Raw()
    error: Any = None


class _Delta(msgspec.Struct):
    text: str


class _Op(msgspec.Struct):
    op: dict[str, Any]


class _Actions(msgspec.Struct):
    actions: list[_Op]


_line = msgspec.json.Decoder(_Line)
_delta = msgspec.json.Decoder(_Delta)
_actions = msgspec.json.Decoder(_Actions)


class _Session:
    """One session's client: a connection that makes it, watches it, prompts it and reads its notices."""

    def __init__(self, latencies: list[float]) -> None:
        self.latencies = latencies
        self.notices = 0
        self.fragments = 0
        self.prompted = 0.0
        self.first = 0.0  # the first fragment's write, by the model's clock (monotonic: the same as this one's)
        self.last = 0.0  # the last fragment's write
        self.done = 0.0
        self.ended: str | None = None  # why the turn ended without its Done
        self.finished = asyncio.Event()

    async def open(self, sock: str, workspace: str, watch: bool) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(sock, limit=1 << 24)
        new = await self.call("session/new", {"agent": "bench", "workspace": workspace})
        self.name = new["session"]
        if watch:
            await self.call("session/watch", {"session": self.name})

    async def follow(self, sock: str, name: str) -> None:
        """Watch another client's session on a connection of its own (a second UI, an editor)."""
        self.reader, self.writer = await asyncio.open_unix_connection(sock, limit=1 << 24)
        self.name = name
        await self.call("session/watch", {"session": name})

    async def watch_turn(self, deadline_s: float) -> None:
        """Read the session's notices until its turn's Done, as a watcher that did not prompt it."""
        try:
            await asyncio.wait_for(self._read(), deadline_s)
        except TimeoutError:
            self.ended = f"no Done within {deadline_s:.0f} s"

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        self.writer.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode() + b"\n")
        while True:
            line = _line.decode(await self.reader.readline())
            if line.id == 1:
                if line.error is not None:
                    raise RuntimeError(f"{method}: {line.error}")
                return msgspec.json.decode(line.result)

    async def turn(self, deadline_s: float, shared: bool) -> None:
        self.prompted = time.monotonic()
        prompt = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "session/prompt",
            "params": {"session": self.name, "prompt": "go"},
        }
        self.writer.write(json.dumps(prompt).encode() + b"\n")
        try:
            await asyncio.wait_for(self.finished.wait() if shared else self._read(), deadline_s)
        except TimeoutError:
            self.ended = f"no Done within {deadline_s:.0f} s"

    async def _read(self) -> None:
        readline = self.reader.readline
        while True:
            raw = await readline()
            if not raw:
                self.ended = "the connection closed"
                return
            if self.take(_line.decode(raw), time.monotonic()):
                return

    def take(self, line: _Line, t: float) -> bool:
        """One notice of this session, read at t; True once the turn is over."""
        if line.method == "session/delta":
            self.notices += 1
            for stamp in _delta.decode(line.params).text.split(";")[:-1]:
                self.last = float(stamp)
                self.first = self.first or self.last
                self.latencies.append(t - self.last)
                self.fragments += 1
        elif line.method == "session/actions":
            if any("Done" in a.op for a in _actions.decode(line.params).actions):
                self.done = t
                self.finished.set()
                return True
        elif line.method in ("session/stalled", "session/unwatched"):
            self.ended = f"{line.method}: {bytes(line.params or b'')[:300]!r}"
            self.finished.set()
            return True
        return False


class _Named(msgspec.Struct):
    session: str


_named = msgspec.json.Decoder(_Named)


async def _watch_all(sock: str, sessions: list[_Session]) -> asyncio.Task[None]:
    """One connection watching every session (a dashboard), handing each notice to its session's client."""
    reader, writer = await asyncio.open_unix_connection(sock, limit=1 << 24)
    by_name = {s.name: s for s in sessions}
    for n, session in enumerate(sessions):
        request = {"jsonrpc": "2.0", "id": n, "method": "session/watch", "params": {"session": session.name}}
        writer.write(json.dumps(request).encode() + b"\n")
    answered = 0
    while answered < len(sessions):
        answered += _line.decode(await reader.readline()).id is not None

    async def read() -> None:
        left = len(sessions)
        while left:
            raw = await reader.readline()
            if not raw:
                return
            line = _line.decode(raw)
            if line.method is not None and by_name[_named.decode(line.params).session].take(line, time.monotonic()):
                left -= 1
        writer.close()

    return asyncio.get_running_loop().create_task(read())


# -- a round ----------------------------------------------------------------------------------------------------------


def _cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of pid: "loop" for the main thread, else by thread id."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = "loop" if task.name == str(pid) else f"thread {task.name}"
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def _runqueue_s(pid: int) -> float:
    """How long pid's main thread (the daemon's event loop) has waited, runnable, for a CPU (schedstat's second
    field): what a machine busy with other processes costs the loop, apart from its own work."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _quantiles(values: list[float]) -> list[float] | None:
    return [round(values[int(len(values) * q)], 3) for q in (0.5, 0.9)] + [round(values[-1], 3)] if values else None


def _start_model(root: Path, tokens: int, rate: float) -> tuple[subprocess.Popen[bytes], str]:
    port_file = root / "model.port"
    argv = [sys.executable, "-m", "benchmarks.bench", "_stream_model", str(port_file), str(tokens), str(rate)]
    proc = subprocess.Popen(argv)
    for _ in range(1500):
        if port_file.exists() and (port := port_file.read_text()):
            return proc, f"http://127.0.0.1:{port}/v1"
        if proc.poll() is not None:
            raise SystemExit("the stand-in model did not start")
        time.sleep(0.02)
    raise TimeoutError("the stand-in model did not start within 30 s")


def _start_daemon(code: Path, root: Path, url: str) -> tuple[subprocess.Popen[bytes], Path]:
    workspace = root / "roots" / "ws"
    workspace.mkdir(parents=True)
    (workspace / "a.txt").write_text("hello\n")
    (root / "agents.toml").write_text(
        f'[agent.bench]\nbase_url = "{url}"\nmodel = "standin"\nworkspace_roots = ["{root / "roots"}"]\n'
    )
    sock = root / "devd.sock"
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(root / "state")]
    argv += ["--agents", str(root / "agents.toml"), "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(code))
    proc = subprocess.Popen(argv, cwd=code, env=env, stderr=open(root / "daemon.log", "wb"))  # noqa: SIM115
    for _ in range(3000):
        if sock.exists():
            return proc, workspace
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited: {(root / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.01)
    raise TimeoutError("the daemon did not start within 30 s")


async def _drive(
    sock: Path,
    workspace: Path,
    sessions: int,
    model_s: float,
    pid: int,
    profile: Path | None,
    shared: bool,
    model_pid: int | None = None,
    watchers: int = 1,
) -> dict[str, Any]:
    latencies: list[float] = []
    clients = [_Session(latencies) for _ in range(sessions)]
    for i in range(0, sessions, 50):
        await asyncio.gather(*(c.open(str(sock), str(workspace), not shared) for c in clients[i : i + 50]))
    others = [(_Session(latencies), c.name) for c in clients for _ in range(watchers - 1)]  # beside each prompter
    for i in range(0, len(others), 50):
        await asyncio.gather(*(w.follow(str(sock), name) for w, name in others[i : i + 50]))
    dashboard = await _watch_all(str(sock), clients) if shared else None
    spy = None
    if profile is not None:  # py-spy's collapsed stacks of every thread, while the turns run
        # Without stopping the daemon for each sample: stopped 200 times a second, its slowest turn took 2.34 times
        # the model's time against 1.31 unprofiled (300 sessions, load average 2); sampled as it runs, 1.29-1.42 at
        # load 3.5-6, where unprofiled rounds took 1.17-1.29 (py-spy's own CPU is on the same two cores).
        argv = [os.environ.get("PY_SPY", "py-spy"), "record", "-p", str(pid), "-r", "200", "--threads", "--idle"]
        argv.append("--nonblocking")
        spy = subprocess.Popen([*argv, "-f", "raw", "-o", str(profile)], stdout=subprocess.DEVNULL)
    model0 = sum(_cpu(model_pid).values()) if model_pid is not None else 0.0
    cpu0, t0, mine, waited = _cpu(pid), time.monotonic(), time.process_time(), _runqueue_s(pid)
    await asyncio.gather(
        *(c.turn(3 * model_s + 30, shared) for c in clients), *(w.watch_turn(3 * model_s + 30) for w, _ in others)
    )
    cpu1, wall, mine = _cpu(pid), time.monotonic() - t0, time.process_time() - mine
    waited = _runqueue_s(pid) - waited
    model_cpu = sum(_cpu(model_pid).values()) - model0 if model_pid is not None else None
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    for c in [*clients, *(w for w, _ in others)]:
        c.writer.close()
    if dashboard is not None:
        dashboard.cancel()
    threads = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1}
    cpu = sum(threads.values())
    fragments = sum(c.fragments for c in clients)  # streamed: each read by its prompter (and by `others` again)
    turns = sorted(c.done - c.prompted for c in clients if c.ended is None)
    before = sorted(c.first - c.prompted for c in clients if c.first)  # prompt to the model's first write
    after = sorted(c.done - c.last for c in clients if c.ended is None and c.last)  # its last write to Done
    latencies.sort()
    n = len(latencies)
    ended = [c.ended for c in clients if c.ended is not None]
    unfollowed = [w.ended for w, _ in others if w.ended is not None]
    return {
        "sessions": sessions,
        "wall_s": round(wall, 2),
        "daemon_cpu_s": round(cpu, 2),
        "watchers_cpu_s": round(mine, 2),  # this process's, reading every notice: near wall_s, it is the bottleneck
        "model_cpu_s": None if model_cpu is None else round(model_cpu, 2),  # the stand-in's, writing every fragment
        "load_average": os.getloadavg()[0],
        "fragments": fragments,
        "notices": sum(c.notices for c in clients),
        "watchers_a_session": watchers,
        "fragments_delivered": fragments + sum(w.fragments for w, _ in others),
        "cpu_us_per_fragment": round(cpu / max(1, fragments) * 1e6, 1),
        "loop_runqueue_wait_s": round(waited, 2),  # the loop ready to run but given no CPU by the machine
        "cpu_by_thread_s": {k: round(v, 2) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])[:4]},
        "turn_s_p50": round(turns[len(turns) // 2], 2) if turns else None,
        "turn_s_max": round(turns[-1], 2) if turns else None,
        "turn_max_per_model_time": round(turns[-1] / model_s, 3) if turns else None,
        "prompt_to_first_write_s_p50_max": [round(before[len(before) // 2], 3), round(before[-1], 3)]
        if before
        else None,
        "last_write_to_done_s_p50_max": [round(after[len(after) // 2], 3), round(after[-1], 3)] if after else None,
        "delta_ms_p50": round(latencies[n // 2] * 1000, 2) if n else None,
        "delta_ms_p99": round(latencies[int(n * 0.99)] * 1000, 2) if n else None,
        "delta_ms_max": round(latencies[-1] * 1000, 2) if n else None,
        "turns_not_ended": len(ended),
        "why_not_ended": ended[:3],
        "watchers_not_told_the_end": len(unfollowed),  # of the other watchers: a Done never read
        "why_not_told": unfollowed[:3],
    }


def _round(
    code: Path, sessions: int, tokens: int, rate: float, profile: Path | None, shared: bool, watchers: int
) -> dict[str, Any]:
    import uvloop

    root = Path(tempfile.mkdtemp(prefix="devd-bench-stream-"))
    model, url = _start_model(root, tokens, rate)
    result: dict[str, Any] = {}
    try:
        daemon, workspace = _start_daemon(code, root, url)
        try:
            result |= uvloop.run(
                _drive(
                    root / "devd.sock",
                    workspace,
                    sessions,
                    tokens / rate,
                    daemon.pid,
                    profile,
                    shared,
                    model.pid,
                    watchers,
                )
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            stopped = [line for line in (root / "daemon.log").read_text().splitlines() if "driver_stopped" in line]
            result["daemon_driver_stopped"] = stopped[:3]
    finally:
        model.send_signal(signal.SIGTERM)
        model.wait(30)
        late = root / "model.port.late"
        result["model_writes_late"] = json.loads(late.read_text()) if late.exists() else None
        shutil.rmtree(root, ignore_errors=True)
    return result


def bench_stream(
    sessions: int,
    tokens: int,
    rate: float,
    rounds: int,
    baseline: Path | None,
    profile: Path | None = None,
    shared: bool = False,
    watchers: int = 1,
) -> dict[str, Any]:
    if watchers < 1 or (shared and watchers > 1):
        raise ValueError("--watchers is at least 1, and only for a connection a session (not with --shared)")
    here = Path(__file__).resolve().parent.parent
    sides = {"this": here} | ({"baseline": baseline.resolve()} if baseline is not None else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, code in sides.items() if r % 2 == 0 else reversed(sides.items()):
            spied = None if profile is None else profile.with_suffix(f".{name}.{r}.txt")
            runs[name].append(_round(code, sessions, tokens, rate, spied, shared, watchers))
            print(json.dumps({"round": r, "side": name, **runs[name][-1]}), file=sys.stderr, flush=True)
    out: dict[str, Any] = {"sessions": sessions, "tokens": tokens, "rate": rate, "model_s": tokens / rate}
    out["watchers"] = (
        "one connection watching every session"
        if shared
        else "a connection a session"
        if watchers == 1
        else f"{watchers} connections a session (one prompts it)"
    )
    keys = ["cpu_us_per_fragment", "turn_max_per_model_time", "delta_ms_p50", "delta_ms_p99", "turns_not_ended"]
    for name, results in runs.items():
        out[name] = {k: statistics.median([r[k] for r in results if r[k] is not None] or [0]) for k in keys}
    if baseline is not None:
        out["this_per_baseline"] = {
            k: round(out["this"][k] / out["baseline"][k], 3) if out["baseline"][k] else None for k in keys[:4]
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=300)
    p.add_argument("--tokens", type=int, default=500)
    p.add_argument(
        "--rate",
        "--tokens-per-second",
        type=float,
        default=50.0,
        help="fragments (tokens) a second each session's model streams",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of the devd to compare with, alternated")
    p.add_argument("--profile", type=Path, default=None, help="py-spy's stacks of each round to PROFILE.SIDE.ROUND.txt")
    p.add_argument("--shared", action="store_true", help="one connection watches every session (a dashboard)")
    p.add_argument(
        "--watchers", type=int, default=1, help="connections watching each session, the one that prompts it among them"
    )


def main(args: argparse.Namespace) -> int:
    print(
        json.dumps(
            bench_stream(
                args.sessions,
                args.tokens,
                args.rate,
                args.rounds,
                args.baseline,
                args.profile,
                args.shared,
                args.watchers,
            ),
            indent=1,
        )
    )
    return 0
