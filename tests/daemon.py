"""The real daemon as a subprocess, on a temporary socket and state directory, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from devd.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.state = root / "state"
        self.socket = root / "run" / "devd.sock"
        self.args = args
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"
        self._ready_seen = 0

    def start(self, wait: bool = True) -> Daemon:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self.socket.unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "devd",
                    "serve",
                    "--socket",
                    str(self.socket),
                    "--state-dir",
                    str(self.state),
                    "--log-format",
                    "json",
                    *self.args,
                ],
                stdout=log,
                stderr=log,
                env={**os.environ, **self.env},
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait for the daemon's `daemon.ready` log line (a probe connection would count against its limits)."""
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.log.read_text().count('"daemon.ready"') > self._ready_seen:
                self._ready_seen += 1
                return
            time.sleep(0.02)
        raise TimeoutError(f"the daemon was not ready within {timeout}s:\n{self.log.read_text()}")

    def client(self) -> Client:
        return Client.connect(self.socket, timeout=30)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> Daemon:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
