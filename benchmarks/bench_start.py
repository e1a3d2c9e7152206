"""`python -m benchmarks.bench start`: exec to the first answer, devd against the least a Python daemon can do.

Each side is a fresh process, timed from just before its exec to the answer of an `initialize` sent as soon as its
socket accepts: the floor is this interpreter with asyncio on uvloop and msgspec (what any daemon of ours must load)
answering the line; the floor with the core is that, having first loaded the compiled core from the state directory's
cache and opened a SQLite file (what any daemon of this design has ready before it answers); devd is `python -m devd
serve` on a state directory whose compiled core is already cached (a first start on an empty one, which compiles the
core and every module's bytecode, is timed apart). With `--baseline DIR` (a checkout of another devd), that devd is
timed too, from its own directory. Beside the wall clock, the CPU each process had used by its answer (all its
threads, from /proc: the machine's load moves it far less). Sides alternate round by round; medians.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

INITIALIZE = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"client":{"name":"bench"}}}\n'


def _floor_server(socket_path: str, state: str | None = None) -> None:
    """The least a daemon of ours starts with: the loop it runs on, the codec it speaks, one answer per line. With a
    state directory, also what any daemon of this design has ready before it answers: the core, loaded from that
    directory's compiled cache (which devd's first start filled), and a SQLite file opened in WAL mode."""
    import asyncio

    import msgspec

    if state is not None:
        import sqlite3
        from pathlib import Path

        from devd.host import Core

        Core.open(cache_dir=Path(state) / "cache")
        db = sqlite3.connect(Path(state).parent / "floor.sqlite3", isolation_level=None)  # not in devd's directory
        db.execute("PRAGMA journal_mode=WAL")

    run: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - devd runs on asyncio's own loop then too
        pass

    decode, encode = msgspec.json.Decoder().decode, msgspec.json.Encoder().encode

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            request = decode(line)
            writer.write(encode({"jsonrpc": "2.0", "id": request["id"], "result": {"server": "floor"}}) + b"\n")
        writer.close()

    async def serve() -> None:
        server = await asyncio.start_unix_server(answer, socket_path)
        await server.serve_forever()

    run(serve())


def _cpu_ms(pid: int) -> float:
    """CPU the process's threads have run so far (/proc's schedstat, in ns: precise, where stat counts 10 ms ticks),
    in ms. CPU moves far less with the machine's load than the wall clock does."""
    tasks = Path(f"/proc/{pid}/task")
    return sum(int((tasks / t / "schedstat").read_text().split()[0]) for t in os.listdir(tasks)) / 1e6


def _first_answer(argv: list[str], sock: Path, env: dict[str, str], cwd: Path | None = None) -> tuple[float, float]:
    """Milliseconds from just before the exec of argv (in cwd) to the answer of an initialize on sock, and the CPU
    milliseconds the process had used by then."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[2]} exited {proc.returncode}: {proc.stderr.read().decode()[-800:]}")  # type: ignore[union-attr]
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(sock))
                    s.sendall(INITIALIZE)
                    answered = b""
                    while not answered.endswith(b"\n"):
                        chunk = s.recv(65536)
                        if not chunk:
                            raise ConnectionError("the server closed the connection before answering")
                        answered += chunk
                    return (time.perf_counter() - t0) * 1000, _cpu_ms(proc.pid)
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.0005)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()  # type: ignore[union-attr]
        sock.unlink(missing_ok=True)


def _devd_argv(sock: Path, state: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "devd",
        "serve",
        "--socket",
        str(sock),
        "--state-dir",
        str(state),
        "--log-level=warning",
    ]


def bench_start(rounds: int, baseline: Path | None = None) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-start-"))
    sock, state = root / "s.sock", root / "state"
    # Bytecode cached as an installed wheel has it (pip compiles on install), kept apart from the checkout; the first
    # start of each side writes it, and devd's first also compiles the core into the state directory's cache.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    here = Path(__file__).resolve().parent.parent
    # With a baseline, its devd runs from its own checkout (`-m devd` imports the one in its working directory),
    # its bytecode cached apart, alternated with this one's.
    codes = {"devd": here} | ({"baseline": baseline.resolve()} if baseline is not None else {})
    envs = {name: env | {"PYTHONPYCACHEPREFIX": str(root / f"pycache-{name}")} for name in codes}
    # Each side its own state directory: a newer devd may have moved the store's format on, which an older one refuses
    # to open. The floor with the core loads the core compiled by this devd's first start.
    states = {"devd": state, "baseline": root / "state-baseline"}
    floor_argv = [sys.executable, "-m", "benchmarks.bench_start", "_floor", str(sock)]
    floor_core_argv = floor_argv + [str(state)]
    _first_answer(floor_argv, sock, env, here)
    compiling = _first_answer(_devd_argv(sock, state), sock, envs["devd"], here)[0]  # fills the state's cache
    if baseline is not None:
        _first_answer(_devd_argv(sock, states["baseline"]), sock, envs["baseline"], codes["baseline"])
    _first_answer(floor_core_argv, sock, env, here)
    floor: list[tuple[float, float]] = []
    floor_core: list[tuple[float, float]] = []
    devds: dict[str, list[tuple[float, float]]] = {name: [] for name in codes}
    for r in range(rounds):
        floor.append(_first_answer(floor_argv, sock, env, here))
        floor_core.append(_first_answer(floor_core_argv, sock, env, here))
        for name in codes if r % 2 == 0 else reversed(codes):
            devds[name].append(_first_answer(_devd_argv(sock, states[name]), sock, envs[name], codes[name]))

    def median(runs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(run[i] for run in runs)

    floor_ms, floor_core_ms = median(floor, 0), median(floor_core, 0)
    floor_core_cpu = median(floor_core, 1)
    devd = devds["devd"]
    devd_ms = median(devd, 0)
    out: dict[str, Any] = {
        "rounds": rounds,
        "floor_ms": round(floor_ms, 1),
        "floor_core_ms": round(floor_core_ms, 1),
        "devd_ms": round(devd_ms, 1),
        "devd_over_floor": round(devd_ms / floor_ms, 2),
        "floor_core_over_floor": round(floor_core_ms / floor_ms, 2),
        "devd_over_floor_core": round(devd_ms / floor_core_ms, 2),
        "devd_ms_min_max": [round(min(r[0] for r in devd), 1), round(max(r[0] for r in devd), 1)],
        "devd_first_start_ms": round(compiling, 1),
        # CPU to the first answer (all threads), which the machine's load moves far less than the wall clock
        "cpu_ms": {
            "floor": round(median(floor, 1), 1),
            "floor_core": round(floor_core_cpu, 1),
            "devd": round(median(devd, 1), 1),
        },
        "devd_cpu_over_floor_core": round(median(devd, 1) / floor_core_cpu, 2),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if baseline is not None:
        base = devds["baseline"]
        out["baseline"] = {
            "devd_ms": round(median(base, 0), 1),
            "devd_over_floor_core": round(median(base, 0) / floor_core_ms, 2),
            "devd_ms_min_max": [round(min(r[0] for r in base), 1), round(max(r[0] for r in base), 1)],
            "cpu_ms": round(median(base, 1), 1),
            "cpu_over_floor_core": round(median(base, 1) / floor_core_cpu, 2),
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=9, help="alternations of the sides (default 9)")
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of another devd, alternated with this one")


if __name__ == "__main__" and sys.argv[1:2] == ["_floor"]:
    # The floor's own process: `python -m benchmarks.bench_start _floor SOCKET [STATE_DIR]` (kept out of bench.py,
    # whose imports the floor would otherwise pay for).
    _floor_server(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
