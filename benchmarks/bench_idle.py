"""`python -m benchmarks.bench idle`: how often an idle daemon wakes, against a process that only waits on a socket.

A daemon is started, serves one session's turn (so its core, store and epoch ticker have all run), and is then left
alone past its call deadline; every thread's context switches are counted from /proc over `seconds`. The baseline is
a Python process blocked in `accept()` on a Unix socket: the least a server can wake. Wake-ups are counted, not
timed, so the figure barely moves with the machine's load.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.daemon import Daemon
from tests.helpers import seed_turn

_WAITER = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); s.accept()"


def _switches(pid: int) -> int:
    """Voluntary and involuntary context switches of every thread of pid, so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def _rate(pid: int, seconds: float) -> float:
    before = _switches(pid)
    time.sleep(seconds)
    return (_switches(pid) - before) / seconds


def bench_idle(seconds: float, settle: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-idle-"))
    waiter = subprocess.Popen([sys.executable, "-c", _WAITER, str(root / "waiter.sock")])
    daemon = Daemon(root / "daemon").start()
    try:
        assert daemon.proc is not None
        with daemon.client() as client:
            session = client.new()
            for event in seed_turn(1, 1):
                client.step(session, event)
        time.sleep(settle)  # past the last call's deadline (--call-timeout, 5 s by default)
        devd = _rate(daemon.proc.pid, seconds)
        base = _rate(waiter.pid, seconds)
    finally:
        daemon.stop()
        waiter.kill()
        waiter.wait()
    return {
        "what": f"context switches a second over {seconds} s, {settle} s after the last call, every thread",
        "wakeups_per_s": {"socket waiter": round(base, 2), "devd": round(devd, 2)},
        "devd_minus_waiter": round(devd - base, 2),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--settle", type=float, default=6.0)
