"""Commands under the real bubblewrap: the workspace writable and nothing else, a private /tmp, a new pid namespace,
no network unless the profile allows it; and what happens where bubblewrap is missing."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from devd.agent.profiles import Profile
from devd.agent.sandbox import Refusal, Sandbox, choose, probe, wrap
from devd.agent.tools import Result, run_command
from tests.helpers import gone


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ws").mkdir()
    (tmp_path / "outside").mkdir()
    return tmp_path / "ws"


def profile(ws: Path, **fields: Any) -> Profile:
    base: dict[str, Any] = {"name": "p", "base_url": "http://h/v1", "model": "m", "workspace_roots": (str(ws),)}
    return Profile(**(base | fields))


def sandbox() -> Sandbox:
    chosen = choose(profile(Path("/")))
    assert isinstance(chosen, Sandbox), chosen
    return chosen


async def sandboxed(ws: Path, script: str, **fields: Any) -> Result:
    return await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws, **fields), sandbox=sandbox())


def test_bubblewrap_starts_here() -> None:
    assert probe() is None


def test_the_command_line_binds_the_workspace_over_a_read_only_root() -> None:
    assert wrap(["make"], Path("/w"), False, {"PATH": "/bin"}) == [
        "bwrap",
        *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", "/w", "/w"),
        *("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--cap-drop", "ALL"),
        *("--die-with-parent", "--new-session", "--chdir", "/w"),
        *("--clearenv", "--setenv", "PATH", "/bin", "--", "make"),
    ]


def test_the_daemons_own_paths_are_covered_once_the_workspace_is_bound() -> None:
    hidden = [("/w/devd.sock", False), ("/var/lib/devd", True)]
    assert wrap(["make"], Path("/w"), True, bwrap="b", hidden=hidden)[:18] == [
        "b",
        *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--bind", "/w", "/w"),
        *("--ro-bind", "/dev/null", "/w/devd.sock", "--tmpfs", "/var/lib/devd"),
    ]


def test_sandbox_none_runs_unconfined(ws: Path) -> None:
    assert choose(profile(ws, sandbox="none")) is None


def test_where_bubblewrap_is_missing_commands_are_refused_saying_what_to_do(ws: Path) -> None:
    assert choose(profile(ws, sandbox="auto"), bwrap=str(ws / "bwrap")) == Refusal(
        f'commands cannot run: bubblewrap is not installed (no {ws}/bwrap), and [agent.p] sets sandbox = "auto"; '
        'install the bubblewrap package (Debian: apt-get install bubblewrap), or set sandbox = "none" in [agent.p] '
        "to run commands unconfined"
    )


async def test_the_workspace_is_writable(ws: Path) -> None:
    await sandboxed(ws, "echo made > made.txt")
    assert (ws / "made.txt").read_text() == "made\n"


@pytest.fixture
def outside() -> Iterator[Path]:
    """A directory of the host outside /tmp (which the sandbox replaces), writable outside the sandbox."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="devd-test-") as d:
        yield Path(d)


async def test_writing_outside_the_workspace_fails_read_only(ws: Path, outside: Path) -> None:
    result = await sandboxed(ws, f"echo x > {outside}/planted")
    assert (result, os.listdir(outside)) == (
        Result(f"sh: 1: cannot create {outside}/planted: Read-only file system\n[exit status 2]", True),
        [],
    )


async def test_tmp_is_private(ws: Path) -> None:
    name = f"devd-test-{uuid.uuid4().hex}"
    (Path("/tmp") / name).write_text("host")
    try:
        result = await sandboxed(ws, f"test -e /tmp/{name} && echo seen; echo inside > /tmp/x-{name} && echo wrote")
    finally:
        (Path("/tmp") / name).unlink()
    assert (result, os.path.exists(f"/tmp/x-{name}")) == (Result("wrote\n"), False)


async def test_a_command_holds_no_capabilities_even_when_the_daemon_runs_as_root(ws: Path) -> None:
    result = await sandboxed(ws, "grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status")
    assert result == Result("CapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapAmb:\t0000000000000000\n")


async def test_a_command_cannot_remount_the_root_writable_to_write_outside(ws: Path, outside: Path) -> None:
    # What a command of a daemon run as root did before its capabilities were dropped: remount / read-write, then
    # write on the host.
    await sandboxed(ws, f"mount -o remount,bind,rw / 2>/dev/null; echo x > {outside}/planted 2>/dev/null")
    assert os.listdir(outside) == []


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP listener of the test on loopback; its port."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


async def test_there_is_no_network(ws: Path, listener: int) -> None:
    result = await sandboxed(
        ws, f"bash -c 'echo hi > /dev/tcp/127.0.0.1/{listener}' 2>&1 | grep -m1 -o 'Connection refused'"
    )
    assert result == Result("Connection refused\n")


async def test_network_true_reaches_the_network(ws: Path, listener: int) -> None:
    result = await sandboxed(ws, f"bash -c 'echo hi > /dev/tcp/127.0.0.1/{listener}' && echo connected", network=True)
    assert result == Result("connected\n")


async def test_the_pid_namespace_is_new(ws: Path) -> None:
    result = await sandboxed(ws, "readlink /proc/self/ns/pid")
    assert result.text.strip() not in ("", os.readlink("/proc/self/ns/pid"))


async def test_the_environment_inside_is_only_the_scrubbed_one(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    result = await sandboxed(ws, "env | sort")
    assert result == Result(f"HOME={ws}\nLANG=C.UTF-8\nPATH=/usr/local/bin:/usr/bin:/bin\nPWD={ws}\nTERM=dumb\n")


async def test_a_timeout_under_the_sandbox_kills_what_runs_inside(ws: Path) -> None:
    marker = f"61.{uuid.uuid4().int % 10**9}"
    result = await sandboxed(ws, f"sleep {marker} & sleep {marker}", exec_timeout_s=0.5)
    assert (result.failed, [pid for pid in _running(marker) if not await gone(pid)]) == (True, [])


async def test_git_runs_in_the_sandbox(ws: Path) -> None:
    p = profile(ws)
    await run_command(["git", "init", "-q"], workspace=ws, profile=p, sandbox=sandbox())
    result = await run_command(["git", "status", "--porcelain=v1", "-b"], workspace=ws, profile=p, sandbox=sandbox())
    assert result.text.startswith("## No commits yet on ")


async def test_a_cancelled_command_returns_only_once_all_it_started_in_the_sandbox_is_dead(ws: Path) -> None:
    os.mkfifo(ws / "started")
    marker = f"62.{uuid.uuid4().int % 10**9}"

    async def run() -> None:
        script = f"sleep {marker} & sleep {marker} & echo > started; wait"
        result = await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws), sandbox=sandbox())
        pytest.fail(f"the command ended before it was cancelled: {result.text}")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await _written(ws / "started")
            tg.cancel_scope.cancel()
    assert _running(marker) == []


async def _written(fifo: Path) -> None:
    """Wait until something writes to fifo, cancellably: a blocking read in a worker thread outlives any cancel (the
    test held its worker until the run's timeout when the command never started)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def _running(argument: str) -> list[int]:
    """The processes (not zombies) with this argument."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if argument.encode() in argv and state not in (b"Z", b"X"):
            found.append(int(pid))
    return found
