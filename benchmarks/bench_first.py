"""`python -m benchmarks.bench first`: `devd run` to the model's first text, on a daemon that has just started (cold)
against one that has already carried out a turn (warm).

Each round starts a daemon with one agent profile (the stand-in model server, in a process of its own, answers every
request with the same text), waits for its socket, and times `devd run --agent bench PROMPT` from just before its
exec to the first byte of the model's text on its standard output; then the same again on that daemon, now warm.
What a cold daemon adds (cold - warm) is its first turn's own work: what it loads and probes at the first model call
and the first command a profile may run. With `--sandbox none` the profile runs commands unconfined (the probe is
of a pid namespace), else under bubblewrap (the probe runs bubblewrap). Rounds alternate with `--baseline DIR` (a
checkout of another devd, whose daemon is then the one started), medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT = "FIRSTTEXT"


def _standin_main(url_file: str) -> None:
    """`bench _first_model FILE`: the stand-in, answering every request with TEXT."""
    from tests.standin_model import Scripted, Standin

    with Standin() as standin:
        standin.default = Scripted(text=TEXT)
        Path(url_file).write_text(standin.url)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _first_text_ms(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Milliseconds from just before the exec of argv to the model's text on its output, and the CPU milliseconds
    the process used in all (it ends with the turn): its own imports are most of what `devd run` takes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)  # the only child reaped meanwhile is this one
    t0 = time.perf_counter()
    # In the side's checkout: `-m devd` imports the devd of its working directory before PYTHONPATH's.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    assert proc.stdout is not None
    seen = b""
    try:
        while TEXT.encode() not in seen:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"devd run ended before the model's text: {proc.stderr.read().decode()[-800:]}")  # type: ignore[union-attr]
            seen += chunk
        wall = (time.perf_counter() - t0) * 1000
    finally:
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()  # type: ignore[union-attr]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000


def _cpu_ms(pid: int) -> float:
    """CPU the daemon used so far (user and system, its own and its waited-for children's: the probes), in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(f) for f in fields[11:15]) * 1000 / os.sysconf("SC_CLK_TCK")


def _round(code: Path, root: Path, url: str, sandbox: str) -> tuple[float, float, float, float, float, float]:
    run = Path(tempfile.mkdtemp(prefix="r-", dir=root))
    workspace = run / "roots" / "ws"
    workspace.mkdir(parents=True)
    agents = run / "agents.toml"
    agents.write_text(
        f'[agent.bench]\nbase_url = "{url}"\nmodel = "standin"\nworkspace_roots = ["{run / "roots"}"]\n'
        f'sandbox = "{sandbox}"\n'
    )
    sock = run / "devd.sock"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"PYTHONPATH": str(code), "PYTHONPYCACHEPREFIX": str(root / f"pycache-{code.name}")}
    argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(run / "state")]
    daemon = subprocess.Popen(
        [*argv, "--agents", str(agents), "--log-level", "warning"], cwd=code, env=env, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(3000):
            if sock.exists():
                break
            time.sleep(0.005)
        time.sleep(0.5)  # what the daemon does in the background once it answers is done by then, as it is for a user
        client = [sys.executable, "-m", "devd", "run", "--connect", str(sock), "--agent", "bench"]
        client += ["--workspace", str(workspace), "say it"]
        cpu0 = _cpu_ms(daemon.pid)
        cold, cold_run_cpu = _first_text_ms(client, env, code)
        cpu1 = _cpu_ms(daemon.pid)
        warm, warm_run_cpu = _first_text_ms(client, env, code)
        cpu2 = _cpu_ms(daemon.pid)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        shutil.rmtree(run, ignore_errors=True)
    return cold, warm, cpu1 - cpu0, cpu2 - cpu1, cold_run_cpu, warm_run_cpu


def bench_first(rounds: int, sandbox: str, baseline: Path | None) -> dict[str, Any]:
    here = Path(__file__).resolve().parent.parent
    sides = {"this": here} | ({"baseline": baseline.resolve()} if baseline is not None else {})
    root = Path(tempfile.mkdtemp(prefix="devd-bench-first-", dir=Path.home()))  # not /tmp: the sandbox's is private
    url_file = root / "model.url"
    model = subprocess.Popen([sys.executable, "-m", "benchmarks.bench", "_first_model", str(url_file)])
    try:
        while not (url_file.exists() and url_file.read_text()):
            time.sleep(0.02)
        url = url_file.read_text()
        for code in sides.values():  # each side's bytecode cached first, as an installed wheel has it
            _round(code, root, url, sandbox)
        got: dict[str, list[tuple[float, float, float, float, float, float]]] = {name: [] for name in sides}
        for r in range(rounds):
            for name, code in sides.items() if r % 2 == 0 else reversed(sides.items()):
                got[name].append(_round(code, root, url, sandbox))
                print(
                    json.dumps({"round": r, "side": name, "cold_ms": got[name][-1][0], "warm_ms": got[name][-1][1]}),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        model.send_signal(signal.SIGTERM)
        model.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"rounds": rounds, "sandbox": sandbox}
    for name, runs in got.items():
        out[name] = {
            "cold_ms": round(statistics.median(r[0] for r in runs), 1),
            "warm_ms": round(statistics.median(r[1] for r in runs), 1),
            "cold_minus_warm_ms": round(statistics.median(r[0] - r[1] for r in runs), 1),
            "daemon_cpu_ms_cold_turn": round(statistics.median(r[2] for r in runs), 1),
            "daemon_cpu_ms_warm_turn": round(statistics.median(r[3] for r in runs), 1),
            "run_cpu_ms_cold": round(statistics.median(r[4] for r in runs), 1),  # the devd run process's, in all
            "run_cpu_ms_warm": round(statistics.median(r[5] for r in runs), 1),
        }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sandbox", choices=("auto", "none"), default="auto")
    p.add_argument("--baseline", type=Path, default=None, help="a checkout of the devd to compare with, alternated")


def main(args: argparse.Namespace) -> int:
    print(json.dumps(bench_first(args.rounds, args.sandbox, args.baseline), indent=1))
    return 0
