"""`python -m benchmarks.bench rewind`: what `session/rewind` costs, against the turn whose writes it puts back.

Each round: a daemon-driven session (the stand-in model server of a checkout, in a process of its own) in a fresh
workspace of `files` files of 8 KiB (past what a claim holds inline: each previous content is kept in a record of its
own), one turn whose one reply rewrites every file (the Writes, each with its claim, its previous content, its ledger
and trace records and its step), timed from the prompt to the turn's Done as a watcher sees it; then `session/rewind`
of that turn (the plan journalled, the conversation forked, every file checked and put back, the session moved back),
timed from the call to its answer, and every file checked to hold its old content. The figures are the medians over
rounds, and the rewind's as a ratio of the turn's in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FILE_BYTES = 8192


def bench_rewind(rounds: int, files: int) -> dict[str, Any]:
    from benchmarks.bench import _agent_notices, _start_standin, _wait_socket
    from devd.client import Client

    root = Path(tempfile.mkdtemp(prefix="devd-bench-rewind-"))
    (root / "roots").mkdir()
    standin, url = _start_standin(root)
    turns: list[float] = []
    rewinds: list[float] = []
    try:
        (root / "agents.toml").write_text(
            f'[agent.bench]\nbase_url = "{url}"\nmodel = "standin"\nworkspace_roots = ["{root / "roots"}"]\n'
        )
        sock, state = root / "devd.sock", root / "state"
        argv = [sys.executable, "-m", "devd", "serve", "--socket", str(sock), "--state-dir", str(state)]
        proc = subprocess.Popen([*argv, "--agents", str(root / "agents.toml"), "--log-level", "warning"])
        try:
            _wait_socket(sock, proc)
            with Client.connect(sock, timeout=120) as c:
                for r in range(rounds):
                    workspace = root / "roots" / f"ws{r}"
                    workspace.mkdir()
                    for i in range(files):
                        (workspace / f"f{i}.txt").write_bytes(b"%d " % i + b"y" * FILE_BYTES)
                    session = c.new(agent="bench", workspace=str(workspace))
                    c.call("session/watch", {"session": session})
                    started = time.perf_counter()
                    turn = c.prompt(session, f"write {files}")
                    _agent_notices(c, turn)
                    turned = time.perf_counter()
                    done = c.rewind(session, turn)
                    rewound = time.perf_counter()
                    back = all((workspace / f"f{i}.txt").read_bytes().startswith(b"%d y" % i) for i in range(files))
                    if len(done.restored) != files or not back:
                        raise SystemExit(f"round {r}: the rewind put back {len(done.restored)} of {files} files")
                    turns.append((turned - started) * 1000)
                    rewinds.append((rewound - turned) * 1000)
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        standin.terminate()
        standin.wait(30)
    turn_ms, rewind_ms = statistics.median(turns), statistics.median(rewinds)
    return {
        "what": f"a turn of {files} Writes over {FILE_BYTES}-byte files, then its rewind; medians of {rounds}",
        "turn_ms": round(turn_ms, 1),
        "rewind_ms": round(rewind_ms, 1),
        "rewind_per_file_ms": round(rewind_ms / files, 2),
        "ratio": round(statistics.median(w / t for w, t in zip(rewinds, turns, strict=True)), 2),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--files", type=int, default=100)
