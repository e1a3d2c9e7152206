"""sd_notify, the watchdog, socket activation and the container's entry command, against the real daemon, no systemd;
and that the shipped units keep what the agent needs of them (.ci/units-live runs the system unit under systemd).

The test plays systemd's part: it binds the datagram socket named by NOTIFY_SOCKET and reads what the daemon says
there, or creates the listening socket and hands it over as fd 3 with LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES.
The helpers at the top start `python -m devd serve` in a tmp_path and are shared with the other end-to-end tests.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devd.client import Client
from devd.server.systemd import watchdog_interval
from tests.daemon import (
    _ACTIVATE,
    EXIT_TIMEOUT_S,
    NOTIFY_TIMEOUT_S,
    ROOT,
    daemon_env,
    devd,
    free_port,
    log_events,
    running,
    serve_args,
    state_dir,
    stop,
    wait_connectable,
    wait_token,
)

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
            assert elapsed >= 0.25  # pings 2-4 are 0.1 s apart, not sooner (their period: the test below)
            assert stop(proc) == 0


def test_the_watchdog_period_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 0.1


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
                for _ in range(100):  # the probe connection wait_connectable made may still be closing
                    if status["connections"] == 1:
                        break
                    time.sleep(0.01)
                    status = client.call("daemon/status")
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


# -- the shipped units run the agent -------------------------------------------------------------------------------


def unit_settings(path: Path) -> dict[str, list[str]]:
    """Each setting of a unit file, with its values in the order given (a key may be given more than once)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


# The user daemon finds ~/.config/devd/agents.toml by itself; ConfigurationDirectory= there would be, under systemd
# 252, the state directory itself, with a mode of its own.
@pytest.mark.parametrize(
    ("unit", "configuration"), [("systemd/devd.service", ["devd"]), ("systemd/user/devd.service", [])]
)
def test_the_units_let_bubblewrap_start_the_model_servers_be_reached_and_profiles_be_found(
    unit: str, configuration: list[str]
) -> None:
    """What the agent needs of its service, each found missing once (issue 29: the shipped units could not run it).
    bubblewrap makes user, mount, pid, ipc, uts and net namespaces, mounts in them and drops capabilities there, and
    brings up lo over netlink; it cannot mount a command's /proc where ProtectKernelTunables=, ProtectKernelLogs= or
    ProcSubset= hid part of the service's; model servers are on the network; the system service's profiles are in its
    configuration directory. (systemd-analyze verify, the exposure score and a live run are .ci/units'.)"""
    settings = unit_settings(ROOT / unit)
    found = (
        set(settings["RestrictNamespaces"][-1].split()),
        settings["SystemCallFilter"][-1],  # the last line: what is given back after ~@privileged
        "AF_NETLINK" in settings["RestrictAddressFamilies"][-1].split(),
        [k for k in ("ProtectKernelTunables", "ProtectKernelLogs", "ProcSubset", "PrivateNetwork") if k in settings],
        settings.get("IPAddressDeny", []),
        settings.get("ProtectHome", ["no"])[-1] != "yes",
        settings.get("ConfigurationDirectory", []),
    )
    assert found == (
        {"user", "mnt", "pid", "ipc", "uts", "net"},
        "@mount capset pivot_root",
        True,
        [],
        [],
        True,
        configuration,
    )


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
