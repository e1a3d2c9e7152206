"""A command's cgroups (devd.agent.cgroups), as a root daemon on cgroup v1 makes them: `memory_bytes_max` bounds the
command's memory as a whole, shared memory included (RLIMIT_DATA never counted a memfd: 6 GiB held under a 64 MiB
limit), `processes_max` its processes; the command is in its groups from its first instruction, and the groups are
gone once it ends, however it ends, and after a daemon killed mid-command at the next start."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from devd.agent import cgroups, runas
from devd.agent.profiles import Profile
from devd.agent.sandbox import Sandbox, choose, contain, limits
from devd.agent.tools import Result, run_command
from tests.agents import Agentd, start
from tests.daemon import Daemon, log_events
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]

WHERE = cgroups.place()
pytestmark = pytest.mark.skipif(isinstance(WHERE, str), reason=f"no cgroups for commands here: {WHERE}")
MIB = 2**20
MEMORY = 64 * MIB


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ws").mkdir()
    return tmp_path / "ws"


def profile(ws: Path, **fields: Any) -> Profile:
    base: dict[str, Any] = {"name": "p", "base_url": "http://h/v1", "model": "m", "workspace_roots": (str(ws),)}
    return Profile(**(base | {"memory_bytes_max": MEMORY} | fields))


def sandbox() -> Sandbox:
    chosen = choose(profile(Path("/")))
    assert isinstance(chosen, Sandbox), chosen
    return chosen


async def sandboxed(ws: Path, script: str, **fields: Any) -> Result:
    return await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws, **fields), sandbox=sandbox())


def groups(pid: int | None = None) -> list[str]:
    """The command groups of the daemon `pid` (default: this process, which plays the daemon) that are there now."""
    assert not isinstance(WHERE, str)
    prefix = f"devd.{pid or os.getpid()}."
    return sorted(
        os.path.join(parent, name)
        for parent in (WHERE.memory, WHERE.pids)
        if parent is not None
        for name in os.listdir(parent)
        if name.startswith(prefix)
    )


def fill_memfd(mib: int) -> str:
    """A script that writes `mib` MiB to a memfd (shared memory: RLIMIT_DATA never counted it), then says done."""
    code = f"import os; fd = os.memfd_create('m'); [os.write(fd, bytes(2**20)) for _ in range({mib})]; print('done')"
    return f'python3 -c "{code}"'


OUT_OF_MEMORY = Result(
    "Killed\n[exit status 137: the kernel killed a process of the command, whose processes together used more than "
    f"memory_bytes_max ({MEMORY} bytes, shared memory and files in /tmp and /dev/shm included)]",
    True,
    f"out of memory (memory_bytes_max, {MEMORY} bytes)",
)


async def test_a_memfd_filled_past_memory_bytes_max_is_oom_killed_and_the_model_told_so(ws: Path) -> None:
    assert (await sandboxed(ws, fill_memfd(200)), groups()) == (OUT_OF_MEMORY, [])


async def test_a_memfd_under_memory_bytes_max_is_written_whole(ws: Path) -> None:
    assert (await sandboxed(ws, fill_memfd(32)), groups()) == (Result("done\n"), [])


async def test_a_shared_anonymous_mapping_past_memory_bytes_max_is_oom_killed(ws: Path) -> None:
    mapped = "import mmap; m = mmap.mmap(-1, 200 * 2**20, flags=mmap.MAP_SHARED)"
    touch = f"{mapped}; [m.write(bytes(2**20)) for _ in range(200)]"
    assert await sandboxed(ws, f'python3 -c "{touch}"') == OUT_OF_MEMORY


async def test_dev_shm_is_a_tmpfs_of_tmp_bytes_max_anyone_may_write(ws: Path) -> None:
    """bubblewrap's own /dev/shm is root's (shm_open failed for a command of a root daemon) and unsized (a non-root
    daemon's command could fill half the host's memory)."""
    script = "stat -c %a /dev/shm; head -c 2097152 /dev/zero > /dev/shm/fill; echo $?"
    result = await sandboxed(ws, script, tmp_bytes_max=MIB)
    assert result == Result("1777\nhead: error writing 'standard output': No space left on device\n1\n")


async def test_a_command_is_in_its_own_memory_cgroup_from_its_first_instruction(ws: Path) -> None:
    """The command's first program reads its own cgroup: the group made for it, below the daemon's (this process)."""
    own = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line)
    result = await sandboxed(ws, "grep :memory: /proc/self/cgroup")
    assert result.text.rsplit(".", 1)[0] == f"{own}/devd.{os.getpid()}.{cgroups._started(os.getpid())}"


@pytest.mark.skipif(isinstance(WHERE, str) or WHERE.pids is None, reason="no pids cgroup hierarchy here")
@pytest.mark.parametrize("confined", [True, False], ids=["bubblewrap", "none"])
async def test_a_command_and_what_it_starts_are_in_both_its_groups(ws: Path, confined: bool) -> None:
    """The shell before it moves itself (writing to `tasks`, not its pid to `cgroup.procs`): a process it forks
    later is in the command's memory and pids groups too, under bubblewrap and under none."""
    script = "sh -c 'grep -E \":(memory|pids):\" /proc/self/cgroup'"
    chosen = sandbox() if confined else None
    result = await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws), sandbox=chosen)
    prefix = f"devd.{os.getpid()}.{cgroups._started(os.getpid())}."
    assert [line.rsplit("/", 1)[1].startswith(prefix) for line in result.text.splitlines()] == [True, True]


@pytest.mark.parametrize("confined", [True, False], ids=["bubblewrap", "none"])
async def test_a_commands_data_limit_is_memory_bytes_max_soft_and_hard_and_it_cannot_raise_it(
    ws: Path, confined: bool
) -> None:
    """Set by the shell that puts it in its groups (`ulimit -d`, as root), not by prlimit after the drop: the same
    limit, which the command's user cannot lift."""
    script = "grep 'Max data size' /proc/self/limits; ulimit -d unlimited 2>/dev/null || echo refused"
    chosen = sandbox() if confined else None
    result = await run_command(["sh", "-c", script], workspace=ws, profile=profile(ws), sandbox=chosen)
    assert result.text.split() == ["Max", "data", "size", str(MEMORY), str(MEMORY), "bytes", "refused"]


def test_a_commands_data_limit_in_a_user_namespace_of_its_own_cannot_be_raised_even_as_root_of_a_nested_one() -> None:
    # With a memory group but no pids one, a root daemon's command under none gets a user namespace of its own (for
    # RLIMIT_NPROC): the limit the shell set before, root's, binds there too, and under a nested namespace's root
    # (CAP_SYS_RESOURCE counts only in the first).
    assert not isinstance(WHERE, str)
    made = cgroups.make(WHERE, MEMORY, 64)
    raise_it = "ulimit -d unlimited 2>/dev/null || echo refused"
    script = f"{raise_it}; unshare -Ur sh -c '{raise_it}'"
    try:
        command = contain(
            ["sh", "-c", script],
            account=runas.Account(65534, 65534),
            limits=limits(profile(Path("/"))),
            user_namespace=True,
            group=cgroups.Group(made.directories[:1]),  # its memory group alone
        )
        run = subprocess.run(command, capture_output=True, text=True, cwd="/")
    finally:
        made.remove()
    assert run.stdout == "refused\nrefused\n"


@pytest.mark.parametrize("failing", [0, 1], ids=["first", "second"])
def test_a_command_whose_move_into_a_group_fails_is_never_run(tmp_path: Path, failing: int) -> None:
    # A move the kernel refuses at the write (here a `tasks` that is /dev/full: ENOSPC), not only one whose file is
    # gone: the shell's echo says so and fails, and nothing after it runs, outside the groups.
    directories = [tmp_path / "memory", tmp_path / "pids"]
    for d in directories:
        d.mkdir()
        (d / "tasks").write_text("")
    (directories[failing] / "tasks").unlink()
    (directories[failing] / "tasks").symlink_to("/dev/full")
    prefix = cgroups.Group(tuple(map(str, directories))).prefix(MEMORY)
    run = subprocess.run([*prefix, "echo", "ran"], capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (1, "")


async def test_a_command_refused_for_its_run_as_after_its_groups_were_made_leaves_no_groups(ws: Path) -> None:
    """Its groups are made with its confinement, in one worker thread, before run_as is found to be no user here."""
    result = await run_command(["true"], workspace=ws, profile=profile(ws, run_as="no-such-user-here"), sandbox=None)
    assert (result.failed, "no such user" in result.text, groups()) == (True, True, [])


async def test_a_timed_out_commands_groups_are_removed(ws: Path) -> None:
    result = await sandboxed(ws, "sleep 30 & sleep 30", exec_timeout_s=0.5)
    assert (result.why, groups()) == ("timed out after 0.5 s", [])


async def test_a_cancelled_commands_groups_are_removed(ws: Path) -> None:
    with anyio.move_on_after(0.5):
        await sandboxed(ws, "sleep 30 & sleep 30")
    assert groups() == []


async def test_under_none_a_memfd_past_memory_bytes_max_is_oom_killed(ws: Path) -> None:
    result = await run_command(["sh", "-c", fill_memfd(200)], workspace=ws, profile=profile(ws), sandbox=None)
    assert (result, groups()) == (OUT_OF_MEMORY, [])


@pytest.mark.skipif(isinstance(WHERE, str) or WHERE.pids is None, reason="no pids cgroup hierarchy here")
async def test_processes_max_is_the_commands_pids_max_counting_its_own_alone(ws: Path) -> None:
    """pids.max counts the command's processes and threads, not its user's elsewhere (RLIMIT_NPROC would): 20 threads
    start under a limit of 32 while another command of the same user holds 40 processes."""
    threads = "import threading, time; [threading.Thread(target=time.sleep, args=(1,)).start() for _ in range(20)]"
    many = "i=0; while [ $i -lt 40 ]; do sleep 30 & i=$((i+1)); done; echo > up; wait"
    async with anyio.create_task_group() as tg:
        tg.start_soon(sandboxed, ws, many)
        while not (ws / "up").exists():
            await anyio.sleep(0.02)
        # Memory enough for 20 threads' stacks (8 MiB each, which RLIMIT_DATA counts): only processes are counted here.
        result = await sandboxed(ws, f'python3 -c "{threads}" && echo ran', processes_max=32, memory_bytes_max=2**30)
        tg.cancel_scope.cancel()
    assert result == Result("ran\n")


async def test_a_daemon_killed_mid_command_leaves_its_groups_and_the_next_start_removes_them(
    tmp_path: Path, standin: Standin
) -> None:
    assert not isinstance(WHERE, str)
    agentd: Agentd = start(tmp_path, standin)
    daemon = agentd.daemon
    assert isinstance(daemon, Daemon)
    with daemon:
        standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo > up; sleep 60"]})]))
        with agentd.client() as c:
            c.prompt(agentd.session(c), "start it")
        with anyio.fail_after(20):
            while not (agentd.workspace / "up").exists():
                await anyio.sleep(0.02)
        assert daemon.proc is not None
        killed = daemon.proc.pid
        left = groups(killed)
        daemon.kill()
        with anyio.fail_after(20):  # the command dies with bubblewrap, which dies with the daemon: not at once
            while any(Path(group, "cgroup.procs").read_text() for group in left):
                await anyio.sleep(0.02)
        daemon.start()
        started = [e for e in log_events(daemon.log) if e.get("event") == "agent.cgroups"]
    assert (len(left), groups(killed), len(started)) == (1 if WHERE.pids is None else 2, [], 2)


async def test_a_command_that_goes_on_after_a_process_of_it_was_oom_killed_succeeds_and_is_told(ws: Path) -> None:
    result = await sandboxed(ws, f"{fill_memfd(200)} 2>/dev/null; echo went on")
    assert result == Result(
        "went on\n[exit status 0, but the kernel killed a process of the command, whose processes together used more "
        f"than memory_bytes_max ({MEMORY} bytes, shared memory and files in /tmp and /dev/shm included)]"
    )
