"""Benchmarks, each against a baseline measured in the same run (machines here are noisy: trust the ratios).

python -m devd.bench core      # devd's step vs the naive ABI dance, session creation, RSS per idle session
python -m devd.bench daemon    # N clients in another process: devd vs an echo server on the same transport
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from devd.protocol import Call, Event, Exec, Output, Read, answer, encode, turn

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
    """A minimal JSON-RPC server on devd's own transport code: every step answers [] at once, nothing stored."""
    import anyio

    from devd.config import Settings
    from devd.rpc import StepResult
    from devd.server import Daemon, bind_unix

    class Echo(Daemon):
        async def _step(self, conn: Any, params: Any) -> Any:
            return StepResult(msgspec.Raw(b"[]"))

        async def _new(self, conn: Any, params: Any) -> Any:
            from devd.rpc import SessionResult

            return SessionResult(params.session or "echo")

    class NoStore:
        commits = 0
        commit_seconds: list[float] = []

        async def run(self) -> None:
            await anyio.sleep_forever()

        async def flush(self) -> None:
            pass

        def names(self) -> list[Any]:
            return []

    state = Path(tempfile.mkdtemp())
    settings = Settings(state_dir=state, socket_path=Path(socket_path))
    daemon = Echo(settings, None, NoStore(), None)  # type: ignore[arg-type]
    anyio.run(daemon.serve, [(bind_unix(Path(socket_path)), "unix")], lambda: print("ready", flush=True))


async def _load(address: str, clients: int, seconds: float, echo: bool) -> dict[str, float]:
    import anyio

    from devd.client import AsyncClient

    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def one(i: int) -> None:
        async with AsyncClient.connect(address) as c:
            for n in itertools.count():
                # A conversation of TURNS_PER_SESSION seed turns, then a new session, so the transcript (and the work
                # per step) stays the size of a working session rather than growing for the whole run.
                name = await c.new(session=f"bench-{i}-{n}-{os.getpid()}")
                next_id = 1
                for t in range(1, TURNS_PER_SESSION + 1):
                    for event in _seed_turn(t, next_id):
                        if time.monotonic() >= deadline:
                            return
                        started = time.perf_counter()
                        await c.call_raw("session/step", {"session": name, "event": msgspec.Raw(event)})
                        latencies.append(time.perf_counter() - started)
                    next_id += 7  # ask, two calls, ask, emit, save, done

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for i in range(clients):
            tg.start_soon(one, i)
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "steps_per_s": len(latencies) / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


def _run_load(address: str, clients: int, seconds: float) -> dict[str, float]:
    """The load runs in a process of its own, so the server's CPU is not the clients'."""
    out = subprocess.run(
        [sys.executable, "-m", "devd.bench", "_load", address, str(clients), str(seconds)],
        capture_output=True,
        check=True,
        timeout=seconds + 60,
    )
    return msgspec.json.decode(out.stdout)  # type: ignore[no-any-return]


def _wait_socket(path: Path, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(1000):
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        if path.exists():
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
                return
            except OSError:
                pass
        time.sleep(0.02)
    raise TimeoutError(path)


def bench_daemon(clients: int, seconds: float, rounds: int) -> dict[str, Any]:
    """Echo and devd, alternated `rounds` times so that drift on a noisy machine hits both; medians reported."""
    root = Path(tempfile.mkdtemp(prefix="devd-bench-"))
    servers = {
        "echo": [sys.executable, "-m", "devd.bench", "_echo", str(root / "echo.sock")],
        "devd": [
            sys.executable,
            "-m",
            "devd",
            "serve",
            "--socket",
            str(root / "devd.sock"),
            "--state-dir",
            str(root / "state"),
            "--log-level",
            "warning",
        ],
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for _ in range(rounds):
        for name, argv in servers.items():
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                _wait_socket(root / f"{name}.sock", proc)
                runs[name].append(_run_load(str(root / f"{name}.sock"), clients, seconds))
            finally:
                proc.terminate()
                proc.wait(30)
    results: dict[str, Any] = {"clients": clients, "seconds": seconds, "rounds": rounds}
    for name, measured in runs.items():
        results[name] = {k: statistics.median(m[k] for m in measured) for k in measured[0]}
    results["ratio_devd_over_echo"] = results["devd"]["steps_per_s"] / results["echo"]["steps_per_s"]
    results["ratios_per_round"] = [
        d["steps_per_s"] / e["steps_per_s"] for e, d in zip(runs["echo"], runs["devd"], strict=True)
    ]
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
    echo = sub.add_parser("_echo")
    echo.add_argument("socket")
    load = sub.add_parser("_load")
    load.add_argument("address")
    load.add_argument("clients", type=int)
    load.add_argument("seconds", type=float)
    args = p.parse_args(argv)
    if args.what == "core":
        result: Any = bench_core(args.rounds, args.sessions)
    elif args.what == "daemon":
        result = bench_daemon(args.clients, args.seconds, args.rounds)
    elif args.what == "_echo":
        _echo_server(args.socket)
        return 0
    else:
        import anyio

        result = anyio.run(_load, args.address, args.clients, args.seconds, False)
        sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
        return 0
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
