"""The real daemon as a subprocess, on a temporary socket and state directory, for end-to-end tests."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devd import compiled, host
from devd.client import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def testing(env: dict[str, str]) -> dict[str, str]:
    """env, saying it is a test's when it arms failure points (a daemon obeys DEVD_FAILPOINTS only then)."""
    return {"DEVD_TESTING": "1", **env} if "DEVD_FAILPOINTS" in env else env


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
        seed_cache(self.state)
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
                env=testing({**os.environ, **self.env}),
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
                keep_cache(self.state)
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


# -- lower-level helpers: a daemon process with a given environment and inherited fds ----------------------------

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 20.0  # a cold start compiles the core: well under a second here, generous for a loaded CI
EXIT_TIMEOUT_S = 10.0
NOTIFY_TIMEOUT_S = 10.0

# Exec'd in the child so that fd 3 and LISTEN_PID are right for the very process that becomes the daemon.
_ACTIVATE = """\
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_PID"] = os.environ.get("TEST_LISTEN_PID") or str(os.getpid())
os.environ.pop("TEST_LISTEN_PID", None)
os.execv(sys.executable, [sys.executable, "-m", "devd", *sys.argv[2:]])
"""


def daemon_env(**extra: str) -> dict[str, str]:
    """This environment without systemd's variables, with the repo importable, plus extra."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LISTEN_", "WATCHDOG_")) and k not in ("NOTIFY_SOCKET", "PYTHONPATH")
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return testing(env)


def state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    state.chmod(0o700)
    seed_cache(state)
    return state


# The compiled core, shared by the daemon processes of a run as one daemon's state directory keeps it across its
# restarts: in a fresh state directory each start would compile the core (about 0.3 s of CPU, some 80 starts a run).
# A daemon checks a copied file as it checks its own (the wasm's digest, the engine's, the payload's). The copies are
# kept by engine: the engine's digest names its wasmtime library's size and time, so another checkout's virtualenv
# (a CI clone's) is another engine, whose daemons refused a copy kept here by the first and compiled the core at
# every start (CI's suite ran 20 s longer than a checkout's, with 45 s more CPU).
CWASM_SEED = Path(tempfile.gettempdir()) / f"devd-tests-cwasm-{os.getuid()}"


@functools.cache
def _seed_dir() -> Path:
    """Where the copies for this interpreter's engine are kept."""
    return CWASM_SEED / host._engine_digest(host._engine_version()).hex()[:16]


@functools.cache
def _cwasm_pattern() -> str:
    """The cache files of this checkout's core, on any wasmtime version (as devd.compiled names them)."""
    return compiled.file_name(hashlib.sha256((ROOT / "devd" / "core.wasm").read_bytes()).digest(), "*")


def seed_cache(state: Path) -> None:
    """Give a state directory no daemon has used the compiled core an earlier daemon kept (`keep_cache`), if any."""
    kept = next(_seed_dir().glob(_cwasm_pattern()), None)
    if (state / "cache").exists() or kept is None or kept.stat().st_uid != os.getuid():
        return
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    (state / "cache").mkdir(mode=0o700)
    shutil.copyfile(kept, state / "cache" / kept.name)
    (state / "cache" / kept.name).chmod(0o600)


def keep_cache(state: Path) -> None:
    """Keep the compiled core a daemon wrote in its state directory for the daemons after it."""
    written = next((state / "cache").glob(_cwasm_pattern()), None)
    seeds = _seed_dir()
    if written is None or (seeds / written.name).exists():
        return
    name, kept = written.name, seeds / written.name
    CWASM_SEED.mkdir(mode=0o700, exist_ok=True)
    seeds.mkdir(mode=0o700, exist_ok=True)
    temporary = seeds / f".{name}.{os.getpid()}"
    shutil.copyfile(written, temporary)
    os.replace(temporary, kept)


def serve_args(tmp_path: Path, *extra: str) -> list[str]:
    """`serve` with its state and socket in tmp_path (socket: tmp_path/run/devd.sock)."""
    state = tmp_path / "state"
    if not state.exists():
        state_dir(tmp_path)
    return [
        "serve",
        "--socket",
        str(tmp_path / "run" / "devd.sock"),
        "--state-dir",
        str(state),
        "--log-format",
        "json",
        *extra,
    ]


@contextlib.contextmanager
def running(
    argv: list[str], env: dict[str, str], log: Path, pass_fds: tuple[int, ...] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """The process, killed on the way out if the test left it running; its stderr (the JSON log) goes to log."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err, pass_fds=pass_fds
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(EXIT_TIMEOUT_S)


def devd(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """`python -m devd serve` with its state and socket in tmp_path."""
    return running(
        [sys.executable, "-m", "devd", *serve_args(tmp_path, *extra)], env or daemon_env(), tmp_path / "devd.log"
    )


def wait_connectable(address: str | Path, proc: subprocess.Popen[bytes], token: str | None = None) -> Client:
    """A client of the daemon once it accepts; fails (with the daemon's log) if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    address = str(address)
    while True:
        try:
            # A probe of our own first: Client.connect does not close its socket when the connect fails.
            if address.startswith("tcp://"):
                host, port = address[len("tcp://") :].rsplit(":", 1)
                socket.create_connection((host, int(port)), timeout=EXIT_TIMEOUT_S).close()
            else:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(address)
            return Client.connect(address, token=token, timeout=EXIT_TIMEOUT_S)
        except (FileNotFoundError, ConnectionRefusedError):
            if proc.poll() is not None:
                pytest.fail(f"the daemon exited with {proc.returncode} before accepting")
            if time.monotonic() > deadline:
                pytest.fail(f"the daemon did not accept on {address} within {START_TIMEOUT_S} s")
            time.sleep(0.02)


def wait_token(state: Path, proc: subprocess.Popen[bytes]) -> str:
    """The TCP token, once the daemon has written it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(FileNotFoundError):
            if token := (state / "token").read_text().strip():
                return token
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the daemon wrote no token in {state} (exit status {proc.poll()})")
        time.sleep(0.02)


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(EXIT_TIMEOUT_S)


def log_events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_bytes().splitlines() if line.startswith(b"{")]
