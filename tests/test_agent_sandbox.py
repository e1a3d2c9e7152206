"""Commands under the real bubblewrap: the workspace writable and nothing else, a private /tmp, a new pid namespace,
no network unless the profile allows it, never root, within the profile's limits; and what happens where bubblewrap
is missing, and under `sandbox = "none"`."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from devd import errors
from devd.agent import runas
from devd.agent.cgroups import Group
from devd.agent.profiles import Profile
from devd.agent.sandbox import Refusal, Sandbox, choose, contain, limits, probe, wrap
from devd.agent.tools import Result, command_env, run_command, write_file
from tests.agents import SECRET, Agentd, agents_toml, run_turn, start
from tests.daemon import ROOT, Daemon
from tests.helpers import gone
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="what a daemon run as root does")
NOBODY = 65534


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


# What a command running as run_as in root's workspace (these tests' ws, under root) is told besides, for Git.
GUEST_GIT = "GIT_CONFIG_COUNT=1\nGIT_CONFIG_KEY_0=safe.directory\nGIT_CONFIG_VALUE_0=*\n" if os.geteuid() == 0 else ""
PROC_READ_ONLY = ("--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger")
TMP = ("--perms", "1777", "--tmpfs", "/dev/shm", "--perms", "1777", "--tmpfs", "/tmp")
TMP += ("--perms", "0755", "--tmpfs", "/run")


def test_the_command_line_binds_the_workspace_over_a_read_only_root() -> None:
    assert wrap(["make"], Path("/w"), False, {"PATH": "/bin"}) == [
        "bwrap",
        *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *PROC_READ_ONLY, *TMP, "--bind", "/w", "/w"),
        *("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--cap-drop", "ALL"),
        *("--die-with-parent", "--new-session", "--chdir", "/w"),
        *("--clearenv", "--setenv", "PATH", "/bin", "--", "make"),
    ]


def test_the_daemons_own_paths_are_covered_once_the_workspace_is_bound() -> None:
    hidden = [("/w/devd.sock", False), ("/var/lib/devd", True)]
    assert wrap(["make"], Path("/w"), False, bwrap="b", hidden=hidden)[:34] == [
        "b",
        *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *PROC_READ_ONLY, *TMP, "--bind", "/w", "/w"),
        *("--ro-bind", "/dev/null", "/w/devd.sock", "--tmpfs", "/var/lib/devd"),
    ]


async def test_a_daemon_path_reached_through_a_link_is_covered_where_it_leads(ws: Path, outside: Path) -> None:
    """systemd's DynamicUser= makes the state directory /var/lib/devd a link to /var/lib/private/devd: it was covered
    as a file, bubblewrap followed the link, and every command of the shipped unit failed ("Can't create file at
    /var/lib/devd: Is a directory"). Covered where it leads, neither path shows the token."""
    (outside / "private").mkdir(mode=0o755)
    (outside / "private" / "token").write_text("secret\n")
    (outside / "state").symlink_to(outside / "private")
    box = Sandbox(bwrap=sandbox().bwrap, hidden=(str(outside / "state"),))
    script = f"cat {outside}/state/token {outside}/private/token 2>/dev/null; echo $?"
    result = await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws), sandbox=box)
    assert result == Result("1\n")


def test_a_command_of_a_daemon_not_run_as_root_cannot_make_a_user_namespace(outside: Path) -> None:
    """In one it holds every capability over what it makes (mounts, network namespaces): kernel attack surface. As
    root, the daemon is played by nobody (its workspace its own), with the sandbox `choose` gives a non-root daemon."""
    root = os.geteuid() == 0
    box = Sandbox(bwrap=sandbox().bwrap, userns_closed=True) if root else sandbox()
    command = box.wrap(["sh", "-c", "unshare -Ur true 2>&1; echo $?"], outside, False, command_env(outside))
    as_daemon = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if root else []
    done = subprocess.run([*as_daemon, *command], cwd=outside, capture_output=True, text=True, timeout=60, check=False)
    assert (done.stdout, done.stderr) == ("unshare: unshare failed: No space left on device\n1\n", "")


def test_a_command_of_a_daemon_not_run_as_root_writes_run_only_up_to_tmp_bytes_max(outside: Path) -> None:
    """/run is a fresh tmpfs the command's user owns under a daemon not run as root (played by nobody, as above): an
    unsized one took as much memory as the host's tmpfs default (half of it), past `tmp_bytes_max` (an attack)."""
    root = os.geteuid() == 0
    box = Sandbox(bwrap=sandbox().bwrap, userns_closed=True) if root else sandbox()
    script = "head -c 2097152 /dev/zero > /run/fill; echo $?"
    bounds = limits(profile(outside, tmp_bytes_max=1 << 20))
    command = box.wrap(["sh", "-c", script], outside, False, command_env(outside), limits=bounds)
    as_daemon = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if root else []
    done = subprocess.run([*as_daemon, *command], cwd=outside, capture_output=True, text=True, timeout=60, check=False)
    assert (done.stdout, done.stderr) == ("1\n", "head: error writing 'standard output': No space left on device\n")


@pytest.fixture
def bus() -> Iterator[Path]:
    """A socket anyone may connect to in the host's /run, where the session bus ($XDG_RUNTIME_DIR/bus) and systemd's
    user manager listen: `systemd-run --user` through them runs anything outside the sandbox."""
    if not os.access("/run", os.W_OK):
        pytest.skip("needs to make a socket in /run (as root)")
    with tempfile.TemporaryDirectory(dir="/run", prefix="devd-test-") as d:
        os.chmod(d, 0o755)
        with socket.socket(socket.AF_UNIX) as listening:
            listening.bind(f"{d}/bus")
            os.chmod(f"{d}/bus", 0o777)
            listening.listen()
            yield Path(d) / "bus"


@pytest.mark.parametrize("network", [False, True])
async def test_a_command_cannot_reach_a_socket_in_run(ws: Path, bus: Path, network: bool) -> None:
    connect = f"import socket; socket.socket(socket.AF_UNIX).connect('{bus}')"
    result = await sandboxed(ws, f'python3 -c "{connect}" 2>/dev/null || echo refused', network=network)
    assert result == Result("refused\n")


def test_a_command_cannot_read_the_environment_file_in_the_daemons_configuration_directory(
    tmp_path: Path, standin: Standin
) -> None:
    """The systemd units read the API keys from CONFIGURATION_DIRECTORY/environment: an independent attack's command
    read it (0644 here, so that under a root daemon only the sandbox stands in the way of run_as; a daemon not run as
    root runs its commands as itself)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="devd-test-") as conf:
        os.chmod(conf, 0o755)
        (Path(conf) / "environment").write_text(f"OPENAI_API_KEY={SECRET}\n")
        os.chmod(Path(conf) / "environment", 0o644)
        agentd = start(tmp_path, standin, env={"CONFIGURATION_DIRECTORY": conf})
        with agentd.daemon:
            argv = ["sh", "-c", f"cat {conf}/environment 2>/dev/null; echo $?"]
            standin.script(Scripted(tool_calls=[("exec", {"argv": argv})]), Scripted(text="ok"))
            with agentd.client() as c:
                run_turn(c, agentd.session(c), "read the keys")
    assert standin.requests[1].body["messages"][-1]["content"] == "1\n"


def test_a_workspace_holding_the_agents_file_is_refused_saying_why(tmp_path: Path, standin: Standin) -> None:
    """A command, or Write, could otherwise rewrite the profile's rules for the daemon's next start (under a root
    daemon the grant even gave run_as the file)."""
    ws = tmp_path / "roots" / "ws"
    ws.mkdir(parents=True)
    (ws / "agents.toml").write_text(agents_toml(standin.url, tmp_path / "roots"))
    daemon = Daemon(tmp_path / "d", "--agents", str(ws / "agents.toml"), env={"DEVD_TEST_KEY": SECRET})
    with daemon.start(), daemon.client() as c, pytest.raises(errors.InvalidParamsError) as refused:
        c.new(agent="coder", workspace=ws)
    assert str(refused.value) == (
        f"workspace {ws} holds the daemon's own {ws / 'agents.toml'}, which no session may reach; use a directory "
        "that does not hold it"
    )


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
        os.chmod(d, 0o777)  # anyone's to write: only the sandbox's read-only root stands in the way
        yield Path(d)


async def test_writing_outside_the_workspace_fails_read_only(ws: Path, outside: Path) -> None:
    result = await sandboxed(ws, f"echo x > {outside}/planted")
    assert (result, os.listdir(outside)) == (
        Result(
            f"sh: 1: cannot create {outside}/planted: Read-only file system\n[exit status 2]", True, "exit status 2"
        ),
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
    assert result == Result(
        f"{GUEST_GIT}HOME={ws}\nLANG=C.UTF-8\nPATH=/usr/local/bin:/usr/bin:/bin\nPWD={ws}\nTERM=dumb\n"
    )


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
    assert [pid for pid in _running(marker) if not await gone(pid)] == []


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


# -- never root ---------------------------------------------------------------------------------------------------


def confined(ws: Path, script: str, **fields: Any) -> subprocess.CompletedProcess[str]:
    """The script run as run_command runs it, by the sandbox layer alone: `wrap` and a real subprocess."""
    p = profile(ws, **fields)
    fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    try:
        who = runas.account(p, fd, str(ws))
    finally:
        os.close(fd)
    command = sandbox().wrap(["sh", "-c", script], ws, False, command_env(ws), account=who, limits=limits(p))
    return subprocess.run(command, cwd=ws, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


@as_root
async def test_a_command_of_a_root_daemon_runs_as_nobody_with_no_other_group(ws: Path) -> None:
    assert await sandboxed(ws, "id -u; id -G") == Result(f"{NOBODY}\n{NOBODY}\n")


@as_root
def test_a_command_cannot_set_a_kernel_setting_and_core_pattern_stays_as_it_was(ws: Path) -> None:
    # What the command of a root daemon did: set core_pattern to a pipe into the workspace, crash, and have the
    # kernel run the workspace's script as root on the host. The value written here is harmless, and put back.
    core_pattern = Path("/proc/sys/kernel/core_pattern")
    before = core_pattern.read_text()
    try:
        done = confined(ws, f"echo devd-test-core > {core_pattern}")
    finally:
        after = core_pattern.read_text()
        if after != before:
            core_pattern.write_text(before)
    assert (done.returncode, done.stderr, after) == (
        2,
        f"sh: 1: cannot create {core_pattern}: Read-only file system\n",
        before,
    )


@as_root
def test_a_command_cannot_write_sysrq_trigger(ws: Path) -> None:
    # Where the kernel has no sysrq, there is none to write; where it has, it is read-only ('h' only prints help).
    why = "Read-only file system" if os.path.exists("/proc/sysrq-trigger") else "Directory nonexistent"
    done = confined(ws, "echo h > /proc/sysrq-trigger")
    assert (done.returncode, done.stderr) == (2, f"sh: 1: cannot create /proc/sysrq-trigger: {why}\n")


@as_root
def test_roots_workspace_is_written_as_run_as_through_an_acl_and_no_owner_changes(ws: Path) -> None:
    (ws / "old.txt").write_text("old\n")
    (ws / "sub").mkdir()
    done = confined(ws, "id -u; echo new >> old.txt; echo made > sub/made.txt; mkdir sub/dir && echo in > sub/dir/f")
    owners = {p.relative_to(ws).as_posix(): p.stat().st_uid for p in [ws, *sorted(ws.rglob("*"))]}
    assert (done.stdout, done.stderr, (ws / "old.txt").read_text(), owners) == (
        f"{NOBODY}\n",
        "",
        "old\nnew\n",
        {".": 0, "old.txt": 0, "sub": 0, "sub/dir": NOBODY, "sub/dir/f": NOBODY, "sub/made.txt": NOBODY},
    )


@as_root
def test_a_workspace_a_user_owns_runs_its_commands_as_that_user_and_gets_no_acl(ws: Path) -> None:
    os.chown(ws, 4242, 4242)
    done = confined(ws, "id -u; id -g; echo made > made.txt")
    assert (done.stdout, (ws / "made.txt").stat().st_uid, runas.ACCESS in os.listxattr(ws)) == (
        "4242\n4242\n",
        4242,
        False,
    )


def granted(ws: Path) -> None:
    fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    try:
        runas.grant(fd, str(ws), NOBODY)
    finally:
        os.close(fd)


def acl(path: Path) -> dict[tuple[int, int], int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        found = runas._read(fd, runas.ACCESS)
    finally:
        os.close(fd)
    assert found is not None
    return found


USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20  # acl(5)'s tags
ANY = 0xFFFFFFFF


@as_root
def test_a_file_root_makes_with_umask_077_in_a_granted_workspace_is_only_its_owners_and_run_as(ws: Path) -> None:
    """The default entries copied the directory's group and other bits, and any default ACL makes the kernel ignore
    the umask: root's `umask 077; echo KEY > .env` came out -rw-rw-r--+ (an independent attack)."""
    granted(ws)
    old = os.umask(0o077)
    try:
        (ws / ".env").write_text("KEY=secret\n")
    finally:
        os.umask(old)
    private = {(USER_OBJ, ANY): 6, (GROUP_OBJ, ANY): 0, (OTHER, ANY): 0}
    assert acl(ws / ".env") == private | {(USER, NOBODY): 7, (MASK, ANY): 6}


@as_root
def test_the_grant_never_widens_a_files_acl_mask(ws: Path) -> None:
    """0640 root:staff with group staff rw-, group users rw- and mask r--: the grant made the mask rw-, and both
    groups could write (an independent attack). run_as gets what the mask allows, and the mask stays."""
    payroll = ws / "payroll.csv"
    payroll.write_text("salaries\n")
    before = {(USER_OBJ, ANY): 6, (GROUP_OBJ, ANY): 6, (GROUP, 100): 6, (MASK, ANY): 4, (OTHER, ANY): 0}
    os.setxattr(payroll, runas.ACCESS, runas._encode(before))
    granted(ws)
    assert acl(payroll) == before | {(USER, NOBODY): 6}


@as_root
def test_the_grant_leaves_what_is_mounted_in_the_workspace_alone(ws: Path) -> None:
    """A directory bind-mounted into root's workspace (same file system, same device) was granted, and its 0600 file
    read and appended to as nobody; the ACL stayed after the unmount (an independent attack)."""
    outside = ws.parent / "outside"
    (outside / "keys").write_text("root's\n")
    os.chmod(outside / "keys", 0o600)
    (ws / "data").mkdir()
    script = f"import os; from devd.agent import runas; runas.grant(os.open('{ws}', os.O_PATH), '{ws}', {NOBODY})"
    grant = f'mount --bind {outside} {ws}/data && {sys.executable} -c "{script}"'
    subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", grant], check=True, cwd=ROOT, timeout=30)
    assert (os.listxattr(outside / "keys"), os.listxattr(outside)) == ([], [])


@as_root
async def test_git_works_as_run_as_in_roots_workspace(ws: Path) -> None:
    await sandboxed(ws, "git init -q && echo a > a && git add a")
    assert await sandboxed(ws, "git status --porcelain=v1") == Result("A  a\n")


# -- limits -------------------------------------------------------------------------------------------------------


@as_root
async def test_a_fork_bomb_stops_at_processes_max_leaving_nothing_and_the_next_command_runs(ws: Path) -> None:
    # A limit below the default: where user namespaces are turned off, RLIMIT_NPROC counts every process of nobody,
    # and a bomb at the default would starve the commands other tests run as nobody meanwhile.
    marker = f"63.{uuid.uuid4().int % 10**9}"
    script = f"i=0; while [ $i -lt 400 ]; do sleep {marker} & i=$((i+1)); done"
    bomb = await sandboxed(ws, script, processes_max=64)
    assert ("Cannot fork" in bomb.text, await _ended(marker), await sandboxed(ws, "echo fine")) == (
        True,
        [],
        Result("fine\n"),
    )


async def test_a_600_mib_write_to_tmp_fails_at_tmp_bytes_max(ws: Path) -> None:
    result = await sandboxed(ws, f"head -c {600 * 2**20} /dev/zero > /tmp/big")
    assert result == Result(
        "head: error writing 'standard output': No space left on device\n[exit status 1]", True, "exit status 1"
    )


async def test_memory_past_memory_bytes_max_is_refused_to_the_process(ws: Path) -> None:
    result = await sandboxed(ws, "python3 -c 'bytearray(256 * 2**20)' 2>&1 | tail -n 1", memory_bytes_max=64 * 2**20)
    assert result == Result("MemoryError\n")


# -- sandbox = "none" ---------------------------------------------------------------------------------------------


def test_under_none_a_command_runs_in_a_pid_namespace_of_its_own_as_an_init_shells_child() -> None:
    assert contain(["make"]) == [
        *("/usr/bin/setpriv", "--pdeathsig=KILL", "--", "/usr/bin/unshare", "--pid", "--kill-child"),
        *([] if os.geteuid() == 0 else ["--map-current-user"]),
        *("--", "/bin/sh", "-c", 'unset PWD; "$@"; exit $?', "sh", "make"),
    ]


def test_under_none_a_commands_user_and_its_death_signal_are_set_by_one_setpriv_the_signal_after_the_user() -> None:
    # The kernel forgets a death signal as credentials change: setpriv sets --pdeathsig after --reuid, so one setpriv
    # does both (test_under_none_what_a_command_started_dies_with_the_daemon shows the signal kept).
    setpriv = ["/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all"]
    assert contain(["make"], account=runas.Account(NOBODY, NOBODY)) == [
        *("/usr/bin/setpriv", "--pdeathsig=KILL", "--", "/usr/bin/unshare", "--pid", "--kill-child"),
        *([] if os.geteuid() == 0 else ["--map-current-user"]),
        *("--", *setpriv, "--no-new-privs", "--pdeathsig=KILL", "--"),
        *("/bin/sh", "-c", 'unset PWD; "$@"; exit $?', "sh", "make"),
    ]


@pytest.mark.parametrize(
    ("directories", "prlimit"),
    [(("/m/g", "/p/g"), []), (("/m/g",), ["/usr/bin/prlimit", "--nproc=8", "--"])],
    ids=["memory and pids", "memory alone"],
)
def test_with_cgroups_the_shell_entering_them_sets_rlimit_data_and_prlimit_only_what_no_group_counts(
    directories: tuple[str, ...], prlimit: list[str]
) -> None:
    joins = " && ".join(f'echo 0 > "${i + 1}"' for i in range(len(directories)))
    script = f'{joins} && ulimit -d 3 && shift {len(directories)} && exec "$@"'
    bounds = limits(profile(Path("/"), processes_max=8, memory_bytes_max=3 * 1024 + 5))  # in whole KiB: 3
    command, grouped = contain(["make"], limits=bounds), contain(["make"], limits=bounds, group=Group(directories))
    assert grouped == [
        *("/bin/sh", "-c", script, "sh", *(f"{d}/tasks" for d in directories)),
        *command[: command.index("/usr/bin/prlimit")],
        *prlimit,
        *command[command.index("/bin/sh") :],
    ]


async def test_under_none_a_command_that_left_its_session_is_gone_when_the_call_ends(ws: Path) -> None:
    marker = f"64.{uuid.uuid4().int % 10**9}"
    script = f"setsid sh -c 'echo > up; exec sleep {marker}' & until [ -e up ]; do sleep 0.01; done"
    result = await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws), sandbox=None)
    assert (result, await _ended(marker)) == (Result(""), [])


@as_root
async def test_under_none_a_command_runs_as_nobody(ws: Path) -> None:
    result = await run_command(["id", "-u"], workspace=ws, profile=profile(ws), sandbox=None)
    assert result == Result(f"{NOBODY}\n")


def test_under_none_a_command_cannot_read_the_daemons_environment(tmp_path: Path, standin: Standin) -> None:
    agentd: Agentd = start(tmp_path, standin, sandbox='"none"')
    with agentd.daemon:
        assert agentd.daemon.proc is not None
        environ = f"/proc/{agentd.daemon.proc.pid}/environ"
        standin.script(Scripted(tool_calls=[("exec", {"argv": ["cat", environ]})]), Scripted(text="ok"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "read the daemon's environment")
    assert standin.requests[1].body["messages"][-1]["content"] == (
        f"error: cat: {environ}: Permission denied\n[exit status 1]"
    )


@as_root  # a non-root daemon's unshare enters its user namespace itself, which forgets the death signal (docstring)
async def test_under_none_what_a_command_started_dies_with_the_daemon(tmp_path: Path, standin: Standin) -> None:
    # It kept running, and writing, after the daemon was killed and a restart said "interrupted".
    marker = f"65.{uuid.uuid4().int % 10**9}"
    agentd: Agentd = start(tmp_path, standin, sandbox='"none"')
    script = f"setsid sh -c 'echo > up; exec sleep {marker}' & sleep {marker}"
    with agentd.daemon:
        standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", script]})]))
        with agentd.client() as c:
            c.prompt(agentd.session(c), "start it")
        with anyio.fail_after(20):
            while not (agentd.workspace / "up").exists():
                await anyio.sleep(0.02)
        agentd.daemon.kill()
    assert await _ended(marker) == []


STARTER = (
    "import json, subprocess, sys, time; subprocess.Popen(json.loads(sys.argv[1]), start_new_session=True); "
    "time.sleep(60)"
)


@as_root
@pytest.mark.parametrize("user_namespace", [False, True], ids=["no user namespace", "a user namespace"])
@pytest.mark.parametrize("confined", [True, False], ids=["bubblewrap", "none"])
async def test_what_a_command_started_dies_with_the_process_that_started_it_after_the_drop_to_its_user(
    ws: Path, confined: bool, user_namespace: bool
) -> None:
    # The kernel forgets a process's death signal when its credentials change (the drop to the command's user, a
    # user namespace): each path sets it again after, which killing the process that started the command (the
    # daemon, here a stand-in) shows, on the command lines as run_command makes them, for a user namespace too (which
    # a pids cgroup spares the commands of a root daemon on this machine, so no other test runs it).
    marker = f"66.{uuid.uuid4().int % 10**9}"
    script = f"setsid sh -c 'echo > up; exec sleep {marker}' & sleep {marker}"
    ws.chmod(0o777)
    who, bounds = runas.Account(NOBODY, NOBODY), limits(profile(ws))
    if confined:
        command = sandbox().wrap(
            ["sh", "-c", script], ws, False, account=who, limits=bounds, user_namespace=user_namespace
        )
    else:
        command = contain(["sh", "-c", script], account=who, limits=bounds, user_namespace=user_namespace)
    starter = subprocess.Popen([sys.executable, "-c", STARTER, json.dumps(command)], cwd=ws)
    try:
        with anyio.fail_after(20):
            while not (ws / "up").exists():
                await anyio.sleep(0.02)
    finally:
        starter.kill()
        starter.wait()
    assert await _ended(marker) == []


async def _ended(argument: str, within_s: float = 10.0) -> list[int]:
    """The processes with this argument still running once they have had `within_s` to be killed and reaped."""
    deadline = time.monotonic() + within_s
    while (left := _running(argument)) and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    return left


@as_root
async def test_what_the_write_tool_makes_in_a_users_workspace_is_that_users_for_its_commands(ws: Path) -> None:
    os.chown(ws, 4242, 4242)
    await write_file(ws, "sub/a.txt", "written\n")
    result = await sandboxed(ws, "echo appended >> sub/a.txt && echo b > sub/b.txt && cat sub/a.txt")
    assert (result, (ws / "sub").stat().st_uid, (ws / "sub" / "a.txt").stat().st_uid) == (
        Result("written\nappended\n"),
        4242,
        4242,
    )


@as_root
async def test_a_file_the_write_tool_makes_in_roots_workspace_is_writable_as_run_as(ws: Path) -> None:
    await sandboxed(ws, "true")  # the workspace is given to run_as (its ACL) by the first command
    await write_file(ws, "a.txt", "written\n")
    assert await sandboxed(ws, "echo appended >> a.txt && cat a.txt") == Result("written\nappended\n")


@as_root
@pytest.mark.parametrize("run_as", [pwd.getpwuid(0).pw_name, 0])
async def test_a_run_as_that_is_uid_0_here_is_refused_and_nothing_runs(ws: Path, run_as: str | int) -> None:
    # The agents file refuses "root" and 0; a profile made otherwise, or another name for uid 0, is refused here.
    result = await sandboxed(ws, "echo ran > ran.txt", run_as=run_as)
    assert (result, (ws / "ran.txt").exists()) == (
        Result(
            f"cannot run sh: [agent.p] sets run_as = {run_as!r}, which is uid 0 (root) here; "
            "commands never run as root: name an unprivileged user",
            True,
        ),
        False,
    )


@as_root
async def test_processes_max_counts_the_commands_processes_not_its_users_others(ws: Path) -> None:
    # RLIMIT_NPROC counts every process of a user: a workspace owner with a desktop session's threads running, or
    # other sessions' commands as run_as, left a command no fork at all. Each command has a user namespace of its own.
    os.chown(ws, 4242, 4242)
    drop = ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "sleep", "60"]
    elsewhere = [subprocess.Popen(drop) for _ in range(40)]
    try:
        result = await sandboxed(
            ws, "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.1 & done; wait; echo forked", processes_max=20
        )
    finally:
        for process in elsewhere:
            process.kill()
            process.wait()
    assert result == Result("forked\n")


@as_root
async def test_a_workspace_below_a_directory_run_as_cannot_search_is_reached_by_its_path() -> None:
    # As under /root (0700): nobody could not pass it, so $HOME, Git and every absolute path into the workspace failed.
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="devd-test-") as d:
        (Path(d) / "ws").mkdir()
        (Path(d) / "beside").write_text("root's\n")
        ws = Path(d) / "ws"
        result = await sandboxed(ws, 'cd / && echo made > "$HOME/made" && ls -A "$(dirname "$HOME")"')
        assert (result, (ws / "made").read_text()) == (Result("ws\n"), "made\n")


@as_root
def test_a_directory_whose_acl_lets_run_as_search_it_is_not_veiled() -> None:
    nobody = runas.Account(NOBODY, NOBODY)
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="devd-test-") as d:
        os.chmod(d, 0o700)
        (Path(d) / "ws").mkdir()
        before = runas.veil(Path(d) / "ws", nobody)
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY)
        try:
            runas.grant(fd, d, NOBODY)
        finally:
            os.close(fd)
        assert (before, runas.veil(Path(d) / "ws", nobody)) == (Path(d), None)
