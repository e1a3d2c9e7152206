"""sd_notify, the watchdog, socket activation and the container's entry command, against the real daemon, no systemd.

The test plays systemd's part: it binds the datagram socket named by NOTIFY_SOCKET and reads what the daemon says
there, or creates the listening socket and hands it over as fd 3 with LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES.
The helpers at the top start `python -m devd serve` in a tmp_path and are shared with the other end-to-end tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devd.client import Client

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
    return env


def state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    state.chmod(0o700)
    return state


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- sd_notify ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(NOTIFY_TIMEOUT_S)
    try:
        yield sock
    finally:
        sock.close()


def receive_until(sock: socket.socket, field: bytes) -> tuple[bytes, list[bytes]]:
    """The first datagram with the line `field`, and those before it."""
    before = []
    while True:
        datagram = sock.recv(4096)
        if field in datagram.split(b"\n"):
            return datagram, before
        before.append(datagram)


def test_ready_is_sent_once_listening_and_stopping_on_sigterm_then_exit_0_without_the_socket(tmp_path: Path) -> None:
    """READY=1 (with STATUS) is the first thing said; a connect right after it succeeds; SIGTERM says STOPPING=1."""
    with notify_socket(tmp_path) as notify:
        with devd(tmp_path, env=daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify"))) as proc:
            assert notify.recv(4096) == b"READY=1\nSTATUS=serving 0 sessions"
            with Client.connect(tmp_path / "run" / "devd.sock", timeout=EXIT_TIMEOUT_S) as client:
                assert client.call("daemon/status")["connections"] == 1
            # No WATCHDOG_USEC: the periodic message is STATUS alone.
            assert notify.recv(4096) == b"STATUS=sessions 0, connections 0"
            assert stop(proc) == 0
            stopping, _ = receive_until(notify, b"STOPPING=1")
            assert stopping == b"STOPPING=1"
    assert not (tmp_path / "run" / "devd.sock").exists()


def test_watchdog_pings_arrive_at_half_the_interval(tmp_path: Path) -> None:
    """WATCHDOG_USEC=200000 (no WATCHDOG_PID) gives WATCHDOG=1 every 0.1 s, from the event loop."""
    env = daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="200000")
    with notify_socket(tmp_path) as notify:
        with devd(tmp_path, env=env) as proc:
            assert notify.recv(4096) == b"READY=1\nSTATUS=serving 0 sessions"
            first = time.monotonic()
            pings = [notify.recv(4096) for _ in range(4)]
            elapsed = time.monotonic() - first
            assert pings == [b"STATUS=sessions 0, connections 0\nWATCHDOG=1"] * 4
            assert 0.25 <= elapsed < 2.0  # pings 2-4 are 0.1 s apart; well inside WatchdogSec
            assert stop(proc) == 0


def test_watchdog_for_another_pid_is_not_pinged(tmp_path: Path) -> None:
    """WATCHDOG_PID naming another process means the pings are not this daemon's to send."""
    env = daemon_env(NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="200000", WATCHDOG_PID="1")
    with notify_socket(tmp_path) as notify:
        with devd(tmp_path, env=env) as proc:
            assert notify.recv(4096) == b"READY=1\nSTATUS=serving 0 sessions"
            assert notify.recv(4096) == b"STATUS=sessions 0, connections 0"
            notify.settimeout(0.5)
            with pytest.raises(TimeoutError):
                notify.recv(4096)  # the next STATUS is 10 s away, and no ping comes before it
            assert stop(proc) == 0


# -- socket activation -------------------------------------------------------------------------------------------


def activated(
    tmp_path: Path, listener: socket.socket, *extra: str, listen_pid: str | None = None, name: str = "rpc"
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The daemon with listener as fd 3, as systemd passes it (LISTEN_PID its own pid unless listen_pid says)."""
    env = daemon_env(LISTEN_FDS="1", LISTEN_FDNAMES=name)
    if listen_pid is not None:
        env["TEST_LISTEN_PID"] = listen_pid
    fd = listener.fileno()
    argv = [sys.executable, "-c", _ACTIVATE, str(fd), *serve_args(tmp_path, *extra)]
    return running(argv, env, tmp_path / "devd.log", pass_fds=(fd,))


def test_an_activated_unix_socket_is_served_and_left_in_place(tmp_path: Path) -> None:
    """fd 3 is served; the daemon binds no socket of its own, and leaves the activated one to its owner."""
    path = tmp_path / "activated.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(8)
        with activated(tmp_path, listener) as proc:
            with wait_connectable(path, proc) as client:
                status = client.call("daemon/status")
                assert status["server"]["name"] == "devd"
                assert status["connections"] == 1
            assert not (tmp_path / "run" / "devd.sock").exists()
            assert stop(proc) == 0
        assert path.exists()
    listening = [e for e in log_events(tmp_path / "devd.log") if e["event"] == "daemon.listening"]
    assert [(e["socket"], e["activated"]) for e in listening] == [(None, ["rpc"])]


def test_an_activated_tcp_socket_requires_the_token(tmp_path: Path) -> None:
    """A passed AF_INET socket is TCP: initialize with the state directory's token, or nothing is answered."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with activated(tmp_path, listener, name="tcp") as proc:
            with wait_connectable(address, proc, token=wait_token(tmp_path / "state", proc)) as client:
                assert client.call("session/list") == {"sessions": []}
            with socket.create_connection(listener.getsockname(), timeout=EXIT_TIMEOUT_S) as raw:
                raw.sendall(b'{"jsonrpc":"2.0","id":1,"method":"session/list"}\n')
                assert raw.makefile("rb").readline() == (
                    b'{"jsonrpc":"2.0","id":1,"error":{"code":-32010,"message":"this connection must first call '
                    b"initialize with the token from the daemon's state directory (file `token`)\","
                    b'"data":{"kind":"UNAUTHORIZED"}}}\n'
                )
            assert stop(proc) == 0
    assert (tmp_path / "state" / "token").stat().st_mode & 0o777 == 0o600


def test_sockets_passed_to_another_pid_are_ignored(tmp_path: Path) -> None:
    """LISTEN_PID naming another process: the daemon binds its own --socket and does not accept on fd 3."""
    path = tmp_path / "activated.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(8)
        with activated(tmp_path, listener, listen_pid="1") as proc:
            with wait_connectable(tmp_path / "run" / "devd.sock", proc) as client:
                assert client.call("session/list") == {"sessions": []}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
                other.settimeout(0.3)
                other.connect(str(path))  # lands in the backlog of the test's own socket...
                other.sendall(b'{"jsonrpc":"2.0","id":1,"method":"session/list"}\n')
                with pytest.raises(TimeoutError):
                    other.recv(1)  # ...and nobody answers it
            assert stop(proc) == 0
    assert not (tmp_path / "run" / "devd.sock").exists()


# -- the container's entry command -------------------------------------------------------------------------------


def dockerfile_exec_form(instruction: str) -> list[str]:
    """The exec-form argv of the Dockerfile's last `instruction` (CMD, or HEALTHCHECK's CMD)."""
    found = None
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        words = line.split(None, 1)
        if words and words[0] == instruction:
            found = words[1]
    assert found is not None, f"the Dockerfile has no {instruction}"
    if instruction == "HEALTHCHECK":
        found = found[found.index(" CMD ") + len(" CMD ") :]
    argv = json.loads(found)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def test_the_container_command_serves_tcp_and_its_healthcheck_passes(tmp_path: Path) -> None:
    """The Dockerfile's CMD, paths moved into tmp_path and another port, serves; its HEALTHCHECK exits 0."""
    port = str(free_port())
    state = state_dir(tmp_path)
    run = tmp_path / "run"

    def local(argv: list[str]) -> list[str]:
        assert argv[0] == "devd", argv
        moved = [
            a.replace("/var/lib/devd", str(state)).replace("/run/devd", str(run)).replace(":7411", f":{port}")
            for a in argv[1:]
        ]
        return [sys.executable, "-m", "devd", *moved]

    cmd = dockerfile_exec_form("CMD")
    health = dockerfile_exec_form("HEALTHCHECK")
    assert "--state-dir" in cmd and "tcp://0.0.0.0:7411" in cmd, shlex.join(cmd)
    with running(local(cmd), daemon_env(), tmp_path / "devd.log") as proc:
        wait_connectable(f"tcp://127.0.0.1:{port}", proc, token=wait_token(state, proc)).close()
        check = subprocess.run(local(health), cwd=ROOT, env=daemon_env(), capture_output=True, timeout=EXIT_TIMEOUT_S)
        assert check.returncode == 0, check.stderr
        assert json.loads(check.stdout)["server"]["name"] == "devd"
        assert stop(proc) == 0
    assert (state / "token").stat().st_mode & 0o777 == 0o600
    assert not (run / "devd.sock").exists()
