"""A person's terminal, for tests: a `devd` command in a real pseudo-terminal, read through pyte (a terminal
emulator), so that a test asserts what a person would see on the screen, not the bytes that drew it. pyte answers the
cursor-position reports prompt_toolkit asks for, as a terminal does."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from typing import Self

import pyte

from tests.daemon import ROOT

SHOWN_TIMEOUT_S = 30.0
HISTORY_LINES = 10_000  # lines scrolled off the top that `history` keeps


class Terminal:
    """`devd ARGS` in a pseudo-terminal of `rows` x `cols`; `shown()` is the screen as a person sees it."""

    def __init__(self, *args: str, rows: int = 60, cols: int = 120, env: dict[str, str] | None = None) -> None:
        leader, follower = os.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.fd = leader
        self.screen = pyte.HistoryScreen(cols, rows, history=HISTORY_LINES)
        self.stream = pyte.ByteStream(self.screen)
        self.screen.write_process_input = self._answer  # type: ignore[method-assign]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "devd", *args],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", **(env or {})},
            start_new_session=True,  # the terminal is its controlling terminal, as a shell's child's is
        )
        os.close(follower)
        self.raw = b""

    def _answer(self, data: str) -> None:
        """What the emulated terminal answers the program (a cursor position report), typed back to it."""
        os.write(self.fd, data.encode())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)

    def _read(self, wait_s: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], wait_s)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # the process ended and closed its side
            return False
        self.raw += data
        self.stream.feed(data)
        return bool(data)

    def when_written(self, wanted: bytes, timeout_s: float = SHOWN_TIMEOUT_S) -> float:
        """When (time.monotonic) the program wrote `wanted` to the terminal, from now on: taken as the bytes are
        read, before the emulator reads them (for a benchmark: the emulator's own time is not the program's)."""
        start = len(self.raw)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                break
            data = os.read(self.fd, 65536)
            self.raw += data
            written = time.monotonic()
            self.stream.feed(data)
            if wanted in self.raw[start:]:
                return written
        raise AssertionError(f"the terminal was not written {wanted!r}; it showed:\n{self.shown()}")

    def shown(self) -> str:
        """The screen's lines, trailing spaces and empty lines at the end dropped."""
        return "\n".join(line.rstrip() for line in self.screen.display).rstrip("\n")

    def history(self) -> list[str]:
        """The lines scrolled off the top of the screen, oldest first (trailing spaces dropped)."""
        columns = self.screen.columns
        return ["".join(line[x].data for x in range(columns)).rstrip() for line in self.screen.history.top]

    def wait_for(self, wanted: str | Callable[[str], bool], timeout_s: float = SHOWN_TIMEOUT_S) -> str:
        """The screen once it shows `wanted` (a text, or a test of the screen); fails saying what it showed."""
        test = wanted if callable(wanted) else lambda shown: wanted in shown
        deadline = time.monotonic() + timeout_s
        while not test(self.shown()):
            left = deadline - time.monotonic()
            if left <= 0 or (not self._read(left) and self.proc.poll() is not None):
                raise AssertionError(f"the terminal did not show {wanted!r}; it showed:\n{self.shown()}")
        return self.shown()

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def exit_status(self, timeout_s: float = SHOWN_TIMEOUT_S) -> int:
        """The process's exit status, reading what it shows meanwhile."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.05)
        while self._read(0.05):
            pass
        return self.proc.wait(max(0.0, deadline - time.monotonic()))
