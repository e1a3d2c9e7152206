"""`python -m benchmarks.bench client`: one call's round trip through each way a Python program talks to devd.

One real daemon (`python -m devd serve` on a fresh state directory), one connection per side, `daemon/status` called
`calls` times in a row (after a warm-up), sides alternated round by round; the median of each side's per-round mean
in microseconds, and each as a ratio of the baseline: a bare blocking socket that writes the request's line and
reads the answer's (the least any client can do). The sides: `Client` (the blocking client: `AsyncClient` driven on
a loop in the calling thread), `AsyncClient` awaited in a loop, and `AsyncClient` through anyio's blocking portal
(the design `Client` did not take: its hop to a second thread).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread

from benchmarks.bench import _wait_socket
from devd.client import AsyncClient, Client

STATUS = b'{"jsonrpc":"2.0","id":1,"method":"daemon/status","params":{}}\n'
WARM_UP = 200


def _per_call_us(call: Callable[[], object], calls: int) -> float:
    for _ in range(WARM_UP):
        call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


def _bare(sock_path: Path, calls: int) -> float:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(sock_path))
        lines = sock.makefile("rb")

        def call() -> bytes:
            sock.sendall(STATUS)
            return lines.readline()

        return _per_call_us(call, calls)


def _blocking(sock_path: Path, calls: int) -> float:
    with Client.connect(sock_path) as c:
        return _per_call_us(lambda: c.call_raw("daemon/status"), calls)


def _async(sock_path: Path, calls: int) -> float:
    async def measure() -> float:
        async with AsyncClient.connect(sock_path) as c:
            for _ in range(WARM_UP):
                await c.call_raw("daemon/status")
            started = time.perf_counter()
            for _ in range(calls):
                await c.call_raw("daemon/status")
            return (time.perf_counter() - started) / calls * 1e6

    return anyio.run(measure)


def _portal(sock_path: Path, calls: int) -> float:
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(AsyncClient.connect(sock_path)) as c:
            return _per_call_us(lambda: portal.call(c.call_raw, "daemon/status"), calls)


SIDES: dict[str, Callable[[Path, int], float]] = {
    "bare socket": _bare,
    "Client": _blocking,
    "AsyncClient": _async,
    "portal": _portal,
}


def bench_client(rounds: int, calls: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-client-"))
    (root / "state").mkdir(mode=0o700)
    sock_path = root / "devd.sock"
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock_path), "--state-dir", str(root / "state")]
    daemon = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    try:
        _wait_socket(sock_path, daemon)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(rounds):
            for side, measure in SIDES.items():
                times[side].append(measure(sock_path, calls))
    finally:
        daemon.terminate()
        daemon.wait(30)
    medians = {side: statistics.median(t) for side, t in times.items()}
    base = medians["bare socket"]
    return {
        "what": f"daemon/status, {calls} calls a round, {rounds} rounds alternated; per call",
        "us": {side: round(m, 1) for side, m in medians.items()},
        "ratio_to_bare_socket": {side: round(m / base, 2) for side, m in medians.items()},
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
