"""`python -m benchmarks.bench mixed`: what one client's large steps cost everyone else's small commits.

One real daemon (`python -m devd serve` on a fresh state directory). `clients` connections each make a session, time
its `session/new` (durable before it answers: one small commit), and close it, in a loop. Round by round they run
alone, then beside a stepper in a process of its own that steps turns whose prompts are `payload_mib` MiB (each step
one large row, and a snapshot of that size too), on sessions it makes and closes. The figures are `session/new`'s
p50, p99 and worst beside the stepper as ratios of the same figures alone, in the same run, on the same daemon. With
`--postgres`, the daemon runs on the fleet's store instead (`--store postgresql://…`), on a PostgreSQL the bench starts
as `bench fleet` does.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.synchronize
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec

from benchmarks.bench import _ms, _wait_socket
from devd.client import AsyncClient, Client
from devd.messages import answer, encode, turn

TURNS_PER_SESSION = 2  # the stepper's turns on one session before it closes it (its transcript grows a payload a turn)


def _stepper(address: str, payload_mib: int, stop: multiprocessing.synchronize.Event, steps: Any) -> None:
    """In a process of its own: turns of `payload_mib` MiB prompts until `stop`; counts its steps in `steps`."""
    prompt = "x" * (payload_mib << 20)

    async def run() -> None:
        async with AsyncClient.connect(address) as c:
            n = 0
            while not stop.is_set():
                n += 1
                name = await c.new(session=f"big{n}")
                asked = 1
                for t in range(1, TURNS_PER_SESSION + 1):
                    if stop.is_set():
                        break
                    await c.call_raw("session/step", {"session": name, "event": msgspec.Raw(encode(turn(t, prompt)))})
                    await c.call_raw(
                        "session/step", {"session": name, "event": msgspec.Raw(encode(answer(asked, "ok")))}
                    )
                    asked += 4  # an ask, then Emit, Save and Done
                    steps.value += 2
                await c.call_raw("session/close", {"session": name})

    anyio.run(run)


async def _makers(address: str, clients: int, seconds: float, tag: str) -> list[float]:
    """`clients` connections making and closing sessions for `seconds`; each `session/new`'s seconds."""
    times: list[float] = []
    deadline = time.monotonic() + seconds

    async def one(i: int) -> None:
        async with AsyncClient.connect(address) as c:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                name = f"{tag}-{i}-{n}"
                started = time.perf_counter()
                await c.call_raw("session/new", {"session": name})
                times.append(time.perf_counter() - started)
                await c.call_raw("session/close", {"session": name})

    async with anyio.create_task_group() as tg:
        for i in range(clients):
            tg.start_soon(one, i)
    return times


def _figures(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {"n": len(ms), "p50_ms": _ms(ms, 0.5), "p99_ms": _ms(ms, 0.99), "max_ms": round(ms[-1], 1)}


@contextlib.contextmanager
def _store_flags(postgres: bool) -> Iterator[list[str]]:
    """The daemon's store flags: none (SQLite in its state directory), or a PostgreSQL of this run's, stopped after."""
    if not postgres:
        yield []
        return
    from benchmarks import pg_local
    from benchmarks.bench_fleet import PG_SETTINGS

    pg = pg_local.start(PG_SETTINGS, prefix="devd-bench-pg-", database_prefix="mixed")
    try:
        yield ["--store", pg.url(pg.create_database()), "--node", "a"]
    finally:
        pg.stop()


def bench_mixed(rounds: int, seconds: float, clients: int, payload_mib: int, postgres: bool = False) -> dict[str, Any]:
    with _store_flags(postgres) as flags:
        return _bench(rounds, seconds, clients, payload_mib, flags) | {"store": "postgres" if postgres else "sqlite"}


def _bench(rounds: int, seconds: float, clients: int, payload_mib: int, flags: list[str]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-mixed-"))
    (root / "state").mkdir(mode=0o700)
    sock = root / "devd.sock"
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(root / "state"), *flags]
    daemon = subprocess.Popen([*argv, "--log-level", "warning"], stderr=subprocess.DEVNULL)
    alone: list[float] = []
    beside: list[float] = []
    steps = multiprocessing.get_context("spawn").Value("q", 0, lock=False)
    try:
        _wait_socket(sock, daemon)
        with Client.connect(sock) as c:  # a fleet daemon accepts before its store is open: wait for an answer
            c.call("daemon/status")
        for r in range(rounds):
            alone += anyio.run(_makers, str(sock), clients, seconds, f"a{r}")
            stop = multiprocessing.get_context("spawn").Event()
            stepper = multiprocessing.get_context("spawn").Process(
                target=_stepper, args=(str(sock), payload_mib, stop, steps)
            )
            stepper.start()
            try:
                before = steps.value
                while steps.value == before and stepper.is_alive():  # its first large step is under way
                    time.sleep(0.05)
                beside += anyio.run(_makers, str(sock), clients, seconds, f"b{r}")
            finally:
                stop.set()
                stepper.join(120)
            if stepper.exitcode != 0:
                raise RuntimeError(f"the stepper failed (exit {stepper.exitcode}); see its output above")
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(root, ignore_errors=True)  # its state: the large turns' snapshot files, tens of MiB
    a, b = _figures(alone), _figures(beside)
    return {
        "what": f"session/new of {clients} clients, {rounds} rounds of {seconds:g} s alone then beside one client "
        f"stepping {payload_mib} MiB turns",
        "alone": a,
        "beside_large_steps": b,
        "large_steps": steps.value,
        "ratio": {k: round(b[k] / a[k], 2) for k in ("p50_ms", "p99_ms", "max_ms")},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="each side's window in a round")
    p.add_argument("--clients", type=int, default=47, help="connections making sessions")
    p.add_argument("--payload-mib", type=int, default=8, help="the stepper's prompt, per turn")
    p.add_argument("--postgres", action="store_true", help="the daemon on a PostgreSQL the bench starts, not SQLite")
