"""What many test modules build with: messages and the seed turn, a watcher's sink, a keyed conversation with its
expected answers, runners of the `devd` command and of waits, the transcripts of docs/protocol.md, and a
daemon/status answer with every field set. Store steps, and a registry wired over a store, are `tests.stores`'.

One home for each, so that a test module imports from here and never from another test module. The daemons
themselves are `tests.harness` (in this process) and `tests.daemon` (a process of its own).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec

from devd import cli
from devd.client import Reply
from devd.messages import (
    Action,
    Agent,
    Call,
    Dispatch,
    Event,
    Exec,
    Message,
    Op,
    Output,
    Read,
    Tool,
    answer,
    ask,
    done,
    encode,
    turn,
)
from tests.daemon import ROOT

# -- messages and the seed turn --------------------------------------------------------------------------------------

FIX = "fix the build"


def user(text: str) -> Message:
    return Message(User=text)


def agent(text: str | None = None, calls: list[Dispatch] | None = None) -> Message:
    return Message(Agent=Agent(text=text, calls=calls))


def tool(id: int, text: str, failed: bool = False) -> Message:
    return Message(Tool=Tool(id=id, text=text, failed=failed))


def finish(first_id: int, turn_id: int, text: str) -> list[Action]:
    """The actions a text answer ends its turn with: Emit it, Save, Done."""
    return [
        Action(id=first_id, op=Op(Emit=text)),
        Action(id=first_id + 1, op=Op(Save=True)),
        Action(id=first_id + 2, op=done(turn_id)),
    ]


def seed_turn(turn_id: int, first_id: int) -> list[bytes]:
    """The seed's full turn, as encoded events: a prompt, an answer with two calls, their two results, a text answer."""
    build, lib = Call(Exec=Exec(argv=["cargo", "build"])), Call(Read=Read(path="src/lib.rs"))
    return [
        encode(turn(turn_id, FIX)),
        encode(answer(first_id, "Let me look.", [build, lib])),
        encode(Event(Exec=Output(id=first_id + 1, text="error[E0425]", failed=True))),
        encode(Event(File=Output(id=first_id + 2, text="pub fn f() -> u8 { x }"))),
        encode(answer(first_id + 3, "`x` was never declared.")),
    ]


class Conversation:
    """One client's session and the model of what it must be answered, stepped under keys (turn-N, answer-N)."""

    def __init__(self, name: str, answer_bytes: int = 0) -> None:
        self.name = name
        self.pad = "." * answer_bytes  # on every answer: a long one makes its snapshots large
        self.transcript: list[Message] = []
        self.next_id = 1
        self.turn = 0
        self.asked = 0
        self.pending: tuple[str, object, list[Action]] | None = None
        self.acked = 0
        self.replays = 0

    def next_step(self) -> tuple[str, object, list[Action]]:
        """The next (key, event, expected actions), advancing the model only once it is acknowledged."""
        if self.pending is None:
            if self.asked == 0:
                t = self.turn + 1
                prompt = f"{self.name} turn {t}"
                expected = [Action(id=self.next_id, op=ask(*self.transcript, user(prompt)))]
                self.pending = (f"turn-{t}", turn(t, prompt), expected)
            else:
                text = f"answer {self.turn}{self.pad}"
                self.pending = (f"answer-{self.turn}", answer(self.asked, text), finish(self.next_id, self.turn, text))
        return self.pending

    def acknowledged(self) -> None:
        key, event, expected = self.pending  # type: ignore[misc]
        self.pending = None
        self.acked += 1
        if key.startswith("turn-"):
            self.turn += 1
            self.transcript.append(user(f"{self.name} turn {self.turn}"))
            self.asked = self.next_id
            self.next_id += 1
        else:
            self.transcript.append(agent(f"answer {self.turn}{self.pad}"))
            self.asked = 0
            self.next_id += 3


# -- a watcher's connection ------------------------------------------------------------------------------------------


class Sink:
    """A watcher's connection that records every line it takes; one that refuses takes only what is forced on it."""

    def __init__(self, *, refuses: bool = False) -> None:
        self.lines: list[bytes] = []
        self.refuses = refuses

    def offer(self, data: bytes) -> bool:
        if self.refuses:
            return False
        self.lines.append(data)
        return True

    def force(self, data: bytes) -> None:
        self.lines.append(data)


# -- runners ---------------------------------------------------------------------------------------------------------


class Wire:
    """A bare connection to the daemon's socket, for the tests that send what no client would (half lines, bad JSON,
    a request not waited for) and read each line as it comes: bytes out, replies in."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rb")

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> bytes:
        """The next whole line; ConnectionError when the daemon ends the connection first."""
        line = self.file.readline()
        if not line.endswith(b"\n"):
            raise ConnectionError("the daemon closed the connection")
        return line

    def reply(self) -> Reply:
        return msgspec.json.decode(self.line(), type=Reply)

    def call(self, method: str, params: Any = None, id: int = 1) -> Reply:
        """One request, and the first line that answers it (notices before it are skipped)."""
        self.send(msgspec.json.encode({"jsonrpc": "2.0", "id": id, "method": method, "params": params or {}}) + b"\n")
        while True:
            reply = self.reply()
            if reply.id == id:
                return reply


def devd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The `devd` command as a user runs it (`python -m devd ARGS`): its exit status, stdout and stderr."""
    return subprocess.run([sys.executable, "-m", "devd", *args], capture_output=True, text=True, timeout=timeout)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """The `devd` command's subcommands by name, with their parsers."""
    (sub,) = [a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait for a condition another process or thread makes true (a watcher subscribed), polling."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.01)


async def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether the process has ended (or ends within a few seconds: a SIGKILLed process closes its files, which
    ends the output the tool waits for, a moment before it is a zombie). A pidfd turns readable when it ends."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        with anyio.move_on_after(within_s):
            await anyio.wait_readable(fd)
            return True
        return False
    finally:
        os.close(fd)


# -- docs/protocol.md's transcripts ---------------------------------------------------------------------------------

DOC = ROOT / "docs" / "protocol.md"
LINE = re.compile(r"(\d*)([<>]) ?(.*)")


@dataclass
class Block:
    start_line: int  # 1-based line of the opening fence, for messages
    tcp: bool
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (connection, ">" or "<", text)


def transcripts(text: str) -> list[Block]:
    blocks: list[Block] = []
    current: Block | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if current is None:
            words = line.strip().removeprefix("```").split()
            if line.startswith("```") and words[:1] == ["jsonl"]:
                assert words[1:] in ([], ["tcp"]), f"{DOC.name}:{number}: unknown block options {words[1:]}"
                current = Block(number, tcp=words[1:] == ["tcp"])
        elif line.startswith("```"):
            blocks.append(current)
            current = None
        elif line.strip():
            match = LINE.fullmatch(line)
            assert match, f"{DOC.name}:{number}: a transcript line starts with >, <, N> or N<: {line!r}"
            current.lines.append((match[1] or "1", match[2], match[3]))
    assert current is None, f"{DOC.name}: the block at line {current.start_line} is not closed"
    return blocks


# -- a daemon/status answer, every field set ---------------------------------------------------------------------

STATUS: dict[str, Any] = {
    "server": {"name": "devd", "version": "0.1.0"},
    "uptime_s": 12.5,
    "sessions": {"live": 1, "stored": 2, "ended": 0, "poisoned": 3},
    "connections": 4,
    "steps": 5,
    "durable_writes": 6,
    "errors": {"INTERNAL": 1, "BUSY": 2},
    "deadline_hits": 7,
    "offloaded": 8,
    "rebuilt": 9,
    "hibernated": 10,
    "live_memory_bytes": 1245184,
    "expired": 11,
    "store_reopened": 12,
    "commit_ms_p50": 1.1,
    "commit_ms_p99": 12.25,
    "memory_rss_bytes": 63991808,
}
