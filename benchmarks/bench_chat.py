"""`python -m benchmarks.bench chat`: the daemon's own latency from a model's first streamed byte to the terminal.

The stand-in model server (tests/standin_model.py) holds each reply after its role chunk; the benchmark notes the time
and releases it, and the first content chunk goes out at once. Three readers of that chunk, rounds alternated:
**direct**, an HTTP client in this process reading the stand-in's stream itself (the floor: the stand-in and the
loopback); **a watching client**, a bare JSON-RPC connection watching the session `devd chat` shows, until the
chunk's `session/delta` (the daemon's model driver and its watch notice); **devd chat**, `devd chat` in a real
pseudo-terminal (tests/terminal.py, read through pyte), prompted once a round, against a daemon of its own, until the
chunk's text is on the emulated screen (the same, then the client's screen model and prompt_toolkit's redraw). The
last two see the same release. Reported: each p50 and p90, and each devd reader's p50 minus the floor's (what devd
adds). Run from the repository (the stand-in and the terminal are the tests').
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.agents import start
from tests.standin_model import Scripted, Standin
from tests.terminal import Terminal

SETTLE_S = 0.05  # after the request reached the stand-in: its role chunk is out and it holds the rest


def _held(standin: Standin, marker: str) -> threading.Event:
    released = threading.Event()
    standin.script(Scripted(text=f"{marker} is the first chunk", split=64, held=released, held_after=1))
    return released


def _wait_request(standin: Standin, count: int) -> None:
    while standin.count < count:
        time.sleep(0.001)
    time.sleep(SETTLE_S)


def _direct(standin: Standin, marker: str) -> float:
    """Seconds from the release to this process reading the chunk from the stream itself."""
    released = _held(standin, marker)
    body = {"model": "standin-model", "stream": True, "messages": [{"role": "user", "content": "go"}]}
    count = standin.count + 1
    with httpx.Client() as http, http.stream("POST", f"{standin.url}/chat/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)  # the role chunk
        _wait_request(standin, count)
        sent = time.monotonic()
        released.set()
        for line in lines:
            if line.startswith("data: ") and marker in json.loads(line[6:]).get("choices", [{}])[0].get(
                "delta", {}
            ).get("content", ""):
                return time.monotonic() - sent
    raise RuntimeError("the stand-in's stream ended before the marker")


def _through_devd(
    standin: Standin, term: Terminal, watcher: socket.socket, marker: str, turns: int
) -> tuple[float, float]:
    """Seconds from the release to the chunk's `session/delta` at a client watching the session, and to its text on
    the emulated screen of `devd chat` (its `turns`th turn)."""
    released = _held(standin, marker)
    count = standin.count + 1
    term.type("say the next thing\r")  # not the marker: the screen shows the prompt too
    _wait_request(standin, count)
    noticed: list[float] = []
    thread = threading.Thread(target=_notice, args=(watcher, marker, noticed))
    thread.start()
    sent = time.monotonic()
    released.set()
    shown = term.when_written(marker.encode()) - sent
    thread.join()
    term.wait_for(lambda screen: screen.count("complete]") >= turns)
    return noticed[0] - sent, shown


def _notice(watcher: socket.socket, marker: str, noticed: list[float]) -> None:
    """When a line of the watch that holds the marker came (a `session/delta`: the steps hold it only later)."""
    wanted = marker.encode()
    while True:
        data = watcher.recv(65536)
        if not data:
            raise RuntimeError("the daemon closed the watch")
        if wanted in data:
            noticed.append(time.monotonic())
            return


def _watching(path: Path, session: str) -> socket.socket:
    """A bare JSON-RPC connection watching the session (no client library between the daemon and the clock)."""
    watcher = socket.socket(socket.AF_UNIX)
    watcher.connect(str(path))
    for n, (method, params) in enumerate((("initialize", {}), ("session/watch", {"session": session}))):
        watcher.sendall(json.dumps({"jsonrpc": "2.0", "id": n, "method": method, "params": params}).encode() + b"\n")
    return watcher


def bench_chat(rounds: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="devd-bench-chat-"))
    times: dict[str, list[float]] = {"direct": [], "a watching client": [], "devd chat": []}
    with Standin() as standin:
        agentd = start(root, standin)
        with agentd.daemon:
            where = ["--connect", str(agentd.daemon.socket), "--agent", "coder", "--workspace", str(agentd.workspace)]
            with Terminal("chat", *where, rows=4 * rounds + 20, env={"XDG_STATE_HOME": str(root / "state")}) as term:
                session = re.search(r"\[session (\S+) ", term.wait_for("/help"))
                assert session is not None
                watcher = _watching(agentd.daemon.socket, session[1])
                for n in range(rounds):
                    times["direct"].append(_direct(standin, f"direct{n}x"))
                    noticed, shown = _through_devd(standin, term, watcher, f"chat{n}x", n + 1)
                    times["a watching client"].append(noticed)
                    times["devd chat"].append(shown)
                term.type("\x04")
                term.exit_status()
                watcher.close()
    ms = {name: sorted(1000 * t for t in taken) for name, taken in times.items()}
    return {
        "what": "ms from the stand-in's release of a model's first content chunk to its text being read",
        "rounds": rounds,
        "p50_ms": {name: round(statistics.median(t), 2) for name, t in ms.items()},
        "p90_ms": {name: round(t[int(0.9 * (len(t) - 1))], 2) for name, t in ms.items()},
        "devd_p50_minus_direct_ms": {
            name: round(statistics.median(ms[name]) - statistics.median(ms["direct"]), 2)
            for name in ("a watching client", "devd chat")
        },
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=30)
