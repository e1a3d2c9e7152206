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


# What devd's start loads beyond the floor with the core, in the order `--phases` loads it: each stage's modules on top
# of the stages before it (what a stage shares with an earlier one is counted there). "wire" is devd without its agent
# runtime (none of its modules import devd.agent); "agent" is the rest of `devd serve`'s imports.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("floor", ("asyncio", "uvloop", "msgspec", "sqlite3")),
    ("core", ("devd.host",)),
    ("anyio", ("anyio", "anyio._backends._asyncio")),  # and its lazy names, below: what `anyio.run` loads
    ("structlog", ("structlog",)),
    ("wire", ("devd.cli", "devd.cli.serve", "devd.sessions.registry", "devd.storage.sqlite", "devd.server.methods")),
    ("agent", ("devd.server.daemon",)),
)


def _phased_devd(argv: list[str]) -> None:
    """`devd serve argv` importing its modules a stage of PHASES at a time first, the process's CPU after each
    written to stderr as one JSON line (`PHASED`)."""
    import importlib
    import json

    cpu = {"startup": time.process_time()}
    for name, modules in PHASES:
        for module in modules:
            importlib.import_module(module)
        if name == "anyio":
            import anyio

            anyio.Lock  # noqa: B018 - anyio builds its lazy names at the first one asked for
        cpu[name] = time.process_time()
    sys.stderr.write(PHASED + json.dumps(cpu) + "\n")
    sys.stderr.flush()
    from devd.cli import main

    sys.argv = ["devd", *argv]
    main()


PHASED = "phased "


def _cpu_ms(pid: int) -> float:
    """CPU the process's threads have run so far (/proc's schedstat, in ns: precise, where stat counts 10 ms ticks),
    in ms. CPU moves far less with the machine's load than the wall clock does."""
    tasks = Path(f"/proc/{pid}/task")
    return sum(int((tasks / t / "schedstat").read_text().split()[0]) for t in os.listdir(tasks)) / 1e6


def _first_answer(
    argv: list[str], sock: Path, env: dict[str, str], cwd: Path | None = None, said: list[str] | None = None
) -> tuple[float, float]:
    """Milliseconds from just before the exec of argv (in cwd) to the answer of an initialize on sock, and the CPU
    milliseconds the process had used by then; what it wrote to stderr appended to `said`, given one."""
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
        err = proc.communicate(timeout=30)[1]
        if said is not None:
            said.append(err.decode(errors="replace"))
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


def bench_start_phases(rounds: int) -> dict[str, Any]:
    """Where devd's start goes beyond the floor with the core's: `devd serve` loading its modules a stage of PHASES at
    a time before it serves, the CPU of each stage and of its work from then to the answer (`serve`), against the
    floor with the core's whole start; medians of the rounds."""
    import json

    root = Path(tempfile.mkdtemp(prefix="devd-bench-start-"))
    sock, state = root / "s.sock", root / "state"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    here = Path(__file__).resolve().parent.parent
    serve = _devd_argv(sock, state)[3:]
    phased_argv = [sys.executable, "-m", "benchmarks.bench_start", "_phased", *serve]
    floor_core_argv = [sys.executable, "-m", "benchmarks.bench_start", "_floor", str(sock), str(state)]
    _first_answer(_devd_argv(sock, state), sock, env, here)  # fills the state's cache, and the bytecode's
    _first_answer(phased_argv, sock, env, here)
    _first_answer(floor_core_argv, sock, env, here)
    floor_core: list[float] = []
    stages: dict[str, list[float]] = {}
    for _ in range(rounds):
        floor_core.append(_first_answer(floor_core_argv, sock, env, here)[1])
        said: list[str] = []
        total = _first_answer(phased_argv, sock, env, here, said)[1]
        line = next(x for x in said[0].splitlines() if x.startswith(PHASED))
        cpu = {k: v * 1000 for k, v in json.loads(line[len(PHASED) :]).items()}
        before = 0.0
        for name, at in [*cpu.items(), ("serve", total)]:
            stages.setdefault(name, []).append(at - before)
            before = at
    devd_ms = statistics.median(sum(runs[i] for runs in stages.values()) for i in range(rounds))
    floor_core_ms = statistics.median(floor_core)
    return {
        "rounds": rounds,
        "cpu_ms": {
            "floor_core": round(floor_core_ms, 1),
            "devd": round(devd_ms, 1),
            "devd_stages": {name: round(statistics.median(runs), 1) for name, runs in stages.items()},
        },
        "devd_over_floor_core": round(devd_ms / floor_core_ms, 2),
        "devd_beyond_floor_core_ms": round(devd_ms - floor_core_ms, 1),
        "budget_beyond_floor_core_ms": round(0.3 * floor_core_ms, 1),  # what 1.3x the floor with the core leaves
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=9, help="alternations of the sides (default 9)")
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of another devd, alternated with this one")
    p.add_argument(
        "--phases", action="store_true", help="where devd's start goes: its CPU by stage of its imports, then serving"
    )


if __name__ == "__main__" and sys.argv[1:2] == ["_phased"]:
    _phased_devd(sys.argv[2:])
if __name__ == "__main__" and sys.argv[1:2] == ["_floor"]:
    # The floor's own process: `python -m benchmarks.bench_start _floor SOCKET [STATE_DIR]` (kept out of bench.py,
    # whose imports the floor would otherwise pay for).
    _floor_server(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
