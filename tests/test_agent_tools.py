"""The tools on real files, symlinks and subprocesses: confinement, atomic writes, commands' limits (Browse is in
test_agent_browse.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from devd.agent.profiles import Profile
from devd.agent.sandbox import choose
from devd.agent.tools import (
    GLIBC_RESERVED,
    Command,
    Refused,
    Result,
    _walk,
    read_file,
    resolve,
    run_command,
    write_file,
)
from tests.helpers import gone


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ws").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("the secret")
    return tmp_path / "ws"


PROFILE = Profile(name="p", base_url="http://h/v1", model="m", workspace_roots=())  # Read's: commands run as nobody


def profile(ws: Path, **fields: Any) -> Profile:
    base: dict[str, Any] = {"name": "p", "base_url": "http://h/v1", "model": "m", "workspace_roots": (str(ws),)}
    return Profile(**(base | fields))


def refusal(ws: Path, path: str, *, for_write: bool = False) -> str:
    with pytest.raises(Refused) as e:
        resolve(ws, path, for_write=for_write)
    return e.value.why


def test_a_path_climbing_out_is_refused(ws: Path) -> None:
    assert (
        refusal(ws, "a/../../outside/secret")
        == "a/../../outside/secret climbs out of the workspace; give a path inside it"
    )


def test_an_absolute_path_is_refused(ws: Path) -> None:
    assert refusal(ws, "/etc/passwd") == "/etc/passwd is absolute; give a path relative to the workspace"


def test_a_symlink_to_outside_is_refused(ws: Path) -> None:
    os.symlink(ws.parent / "outside" / "secret", ws / "link")
    assert refusal(ws, "link") == (
        f"link leads outside the workspace (to {ws.parent}/outside/secret) through a symbolic link"
    )


def test_a_path_through_a_symlinked_parent_is_refused(ws: Path) -> None:
    os.symlink(ws.parent / "outside", ws / "dir")
    assert refusal(ws, "dir/new.txt", for_write=True).startswith("dir/new.txt leads outside the workspace")


def test_a_symlink_inside_the_workspace_is_followed(ws: Path) -> None:
    (ws / "real.txt").write_text("x")
    os.symlink("real.txt", ws / "alias.txt")
    assert resolve(ws, "alias.txt", for_write=True) == ws / "real.txt"


async def test_reading_through_a_symlink_to_outside_reads_nothing(ws: Path) -> None:
    os.symlink(ws.parent / "outside" / "secret", ws / "link")
    result = await read_file(ws, "link", 1000, profile=PROFILE)
    assert result == Result(
        f"refused: link leads outside the workspace (to {ws.parent}/outside/secret) through a symbolic link", True
    )


async def test_writing_through_a_symlink_to_outside_writes_nothing(ws: Path) -> None:
    os.symlink(ws.parent / "outside" / "secret", ws / "link")
    result = await write_file(ws, "link", "overwritten")
    assert (result.failed, (ws.parent / "outside" / "secret").read_text()) == (True, "the secret")


async def test_writing_into_a_symlinked_parent_dir_creates_nothing_outside(ws: Path) -> None:
    os.symlink(ws.parent / "outside", ws / "dir")
    await write_file(ws, "dir/planted.txt", "x")
    assert sorted(os.listdir(ws.parent / "outside")) == ["secret"]


def test_a_directory_swapped_for_a_link_after_resolving_is_refused(ws: Path) -> None:
    """The race a concurrent command could run: resolved while `dir` was a directory, used once it is a link out."""
    (ws / "dir").mkdir()
    real = resolve(ws, "dir/a.txt", for_write=True)
    (ws / "dir").rmdir()
    os.symlink(ws.parent / "outside", ws / "dir")
    root = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(Refused) as e:
            _walk(root, real.relative_to(ws).parts, create=True)
    finally:
        os.close(root)
    assert e.value.why == "dir became a link while it was used; nothing was done"


async def test_a_write_below_a_file_is_refused_saying_it_is_a_file(ws: Path) -> None:
    (ws / "dir").mkdir()
    (ws / "dir" / "f").write_text("plain")
    result = await write_file(ws, "a/../dir/f/g", "x")
    assert result == Result("refused: f is a file, not a directory; nothing was done", failed=True)


async def test_reading_the_workspace_itself_lists_it(ws: Path) -> None:
    (ws / "src").mkdir()
    (ws / "a.txt").write_text("")
    assert await read_file(ws, ".", 100, profile=PROFILE) == Result(". is a directory; it holds: a.txt, src/", True)


async def test_a_directory_of_20000_entries_is_read_no_further_than_its_first_1001(ws: Path) -> None:
    """Read of a directory read and sorted every name though it showed 50 (a million took 5.9 s and 165 MiB, and
    stalled the event loop); it now stops after 1,001 entries and says that there are at least that many."""
    made = {f"f{i:05d}" for i in range(20000)}
    (ws / "d").mkdir()
    for name in made:
        os.close(os.open(ws / "d" / name, os.O_CREAT | os.O_WRONLY))
    head = (
        "d is a directory; it holds more than 1000 entries, too many to read here; the first 50 entries read, of at "
        "least 1001: "
    )
    tail = "; list it with a command (Exec) to see more"
    began = time.monotonic()
    result = await read_file(ws, "d", 100, profile=PROFILE)
    elapsed = time.monotonic() - began
    shown = result.text.removeprefix(head).removesuffix(tail).split(", ")
    assert (result.text[: len(head)], result.text[-len(tail) :], len(shown), set(shown) <= made, elapsed < 1.0) == (
        head,
        tail,
        50,
        True,
        True,
    )


async def test_a_directory_of_60_entries_shows_the_first_50_by_name_and_how_many_more(ws: Path) -> None:
    for i in range(60):
        (ws / f"f{i:02d}").write_text("")
    listed = ", ".join(f"f{i:02d}" for i in range(50))
    assert await read_file(ws, ".", 100, profile=PROFILE) == Result(
        f". is a directory; it holds: {listed} and 10 more", True
    )


async def test_a_read_gives_the_text(ws: Path) -> None:
    (ws / "a.txt").write_text("héllo\n")
    assert await read_file(ws, "a.txt", 1000, profile=PROFILE) == Result("héllo\n")


async def test_a_long_read_is_cut_with_a_note(ws: Path) -> None:
    (ws / "a.txt").write_text("0123456789")
    assert await read_file(ws, "a.txt", 4, profile=PROFILE) == Result(
        "0123\n[cut: 6 more bytes of a.txt were not read]"
    )


@pytest.mark.parametrize("owner", [0, 65534], ids=["root's workspace", "nobody's workspace"])
async def test_a_hard_link_to_a_root_only_file_outside_is_refused_to_read(ws: Path, owner: int) -> None:
    """A command (as nobody: the workspace's owner, or run_as in root's) links a file it cannot read into the
    workspace, as the kernel lets it where fs.protected_hardlinks is 0 (its default): `ln /etc/shadow stolen`. Read,
    which runs as root, gave the model the file. The link is made here by the test, so as on any host."""
    os.chown(ws, owner, owner)
    secret = ws.parent / "outside" / "secret"
    secret.chmod(0o600)
    os.link(secret, ws / "stolen")
    assert await read_file(ws, "stolen", 100, profile=PROFILE) == Result(
        "refused: stolen is uid 0's (mode 0600, 2 links), and uid 65534, as whom this workspace's commands run, may "
        "not read it; Read shows only what those commands could read (a hard link to a file outside the workspace "
        "reads nothing of it): make it readable to uid 65534 first if it should be read",
        True,
    )


async def test_a_workspace_file_with_two_links_its_user_may_read_reads(ws: Path) -> None:
    (ws / "a.txt").write_text("shared")
    os.link(ws / "a.txt", ws / "b.txt")
    assert await read_file(ws, "b.txt", 100, profile=PROFILE) == Result("shared")


async def test_roots_own_private_file_in_roots_workspace_reads(ws: Path) -> None:
    """A single link of root's in root's workspace is the commands' user's to read by the grant (devd.agent.runas)
    made as the first command runs, whether or not one ran yet."""
    (ws / "a.txt").write_text("root's")
    (ws / "a.txt").chmod(0o600)
    assert await read_file(ws, "a.txt", 100, profile=PROFILE) == Result("root's")


async def test_reading_a_missing_file_fails_saying_so(ws: Path) -> None:
    assert await read_file(ws, "none.txt", 100, profile=PROFILE) == Result("none.txt does not exist", True)


async def test_reading_a_binary_file_fails_saying_so(ws: Path) -> None:
    (ws / "a.bin").write_bytes(b"\x7fELF\x00\x01")
    assert await read_file(ws, "a.bin", 100, profile=PROFILE) == Result(
        "a.bin is a binary file (6 bytes); it is not shown", True
    )


async def test_invalid_utf8_is_read_with_replacement(ws: Path) -> None:
    (ws / "a.txt").write_bytes(b"caf\xe9")
    assert await read_file(ws, "a.txt", 100, profile=PROFILE) == Result("caf\ufffd")


async def test_a_write_creates_missing_directories_and_leaves_no_temp_file(ws: Path) -> None:
    result = await write_file(ws, "src/deep/a.c", "int x;")
    assert (result, (ws / "src" / "deep" / "a.c").read_text(), os.listdir(ws / "src" / "deep")) == (
        Result("wrote 6 bytes to src/deep/a.c"),
        "int x;",
        ["a.c"],
    )


async def test_a_write_keeps_the_files_mode(ws: Path) -> None:
    (ws / "run.sh").write_text("old")
    os.chmod(ws / "run.sh", 0o755)
    await write_file(ws, "run.sh", "new")
    assert oct((ws / "run.sh").stat().st_mode & 0o777) == "0o755"


async def test_a_write_over_a_set_user_id_program_leaves_an_ordinary_file(ws: Path) -> None:
    """A command may hard-link root's set-user-ID program into the workspace; the daemon, as root, wrote the model's
    text over it and kept the bit (-rwsr-xr-x root): a set-user-ID root program anyone could run."""
    (ws / "x").write_text("old")
    os.chmod(ws / "x", 0o6755)
    await write_file(ws, "x", "#!/bin/sh\nid\n")
    assert oct((ws / "x").stat().st_mode & 0o7777) == "0o755"


WRITE_WITH_SMALL_FILES = """
import resource, signal, sys, anyio
from pathlib import Path
from devd.agent.tools import write_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
print(anyio.run(write_file, Path(sys.argv[1]), "a.txt", "a much longer text").text)
"""


def test_a_write_that_fails_leaves_the_original_and_no_temp_file(ws: Path) -> None:
    """A real write that fails half way: a process whose files may hold at most 4 bytes (EFBIG)."""
    (ws / "a.txt").write_text("old")
    done = subprocess.run(
        [sys.executable, "-c", WRITE_WITH_SMALL_FILES, str(ws)], capture_output=True, text=True, check=True
    )
    assert (done.stdout, (ws / "a.txt").read_text(), os.listdir(ws)) == (
        "cannot write a.txt: File too large; the file is as it was\n",
        "old",
        ["a.txt"],
    )


# What a command running as run_as in root's workspace (these tests' ws, under root) is told besides, for Git.
GUEST_GIT = (
    ["GIT_CONFIG_COUNT=1", "GIT_CONFIG_KEY_0=safe.directory", "GIT_CONFIG_VALUE_0=*"] if os.geteuid() == 0 else []
)
# A command runs in a pid namespace of its own, where $$ and $! are that namespace's numbers; /proc is the host's, so
# /proc/self/stat names the process as the host sees it.
OWN_PID = "read -r pid rest < /proc/self/stat; echo $pid"
# A child left running in the background, its (host) pid in child.pid once it runs.
BACKGROUND = (
    f"sh -c '{OWN_PID} > child.tmp; mv child.tmp child.pid; exec sleep 60' & "
    "until [ -e child.pid ]; do sleep 0.01; done"
)


async def test_a_command_runs_in_the_workspace(ws: Path) -> None:
    assert await run_command(["pwd"], workspace=ws, profile=profile(ws), sandbox=None) == Result(f"{ws}\n")


async def test_a_failing_command_says_its_exit_status(ws: Path) -> None:
    result = await run_command(
        ["sh", "-c", "echo out; echo err >&2; exit 3"], workspace=ws, profile=profile(ws), sandbox=None
    )
    assert result == Result("out\nerr\n[exit status 3]", True, "exit status 3")


async def test_a_missing_program_fails_saying_so(ws: Path) -> None:
    result = await run_command(["no-such-tool"], workspace=ws, profile=profile(ws), sandbox=None)
    assert result == Result("no-such-tool: command not found (PATH is /usr/local/bin:/usr/bin:/bin)", True)


async def test_the_environment_is_scrubbed(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    result = await run_command(["env"], workspace=ws, profile=profile(ws), sandbox=None)
    assert sorted(result.text.splitlines()) == sorted(
        [f"HOME={ws}", "LANG=C.UTF-8", "PATH=/usr/local/bin:/usr/bin:/bin", "TERM=dumb", *GUEST_GIT]
    )


async def test_stdin_is_closed(ws: Path) -> None:
    result = await run_command(["sh", "-c", "cat; echo end"], workspace=ws, profile=profile(ws), sandbox=None)
    assert result == Result("end\n")


async def test_output_past_the_cap_is_cut_with_a_note(ws: Path) -> None:
    result = await run_command(
        ["sh", "-c", "printf '%0100d' 0"], workspace=ws, profile=profile(ws, output_bytes_max=10), sandbox=None
    )
    assert result == Result(
        "0000000000\n[output cut at 10 bytes (output_bytes_max): the rest was not read, and the output was closed "
        "there, as `| head -c 10` would]"
    )


async def test_output_past_the_cap_is_not_read_so_an_endless_writer_ends_at_once(ws: Path) -> None:
    # It was read and thrown away on the event loop until the command ended: `yes` ran to the timeout, 3.3 GB in 3 s.
    started = time.monotonic()
    result = await run_command(["yes"], workspace=ws, profile=profile(ws, output_bytes_max=10), sandbox=None)
    assert (result, time.monotonic() - started < 5.0) == (
        Result(
            "y\ny\ny\ny\ny\n[output cut at 10 bytes (output_bytes_max): the rest was not read, and the output was "
            "closed there, as `| head -c 10` would]\n[exit status 141]",
            True,
            "exit status 141",
        ),
        True,
    )


async def test_a_timeout_kills_the_whole_process_group(ws: Path) -> None:
    script = f"{BACKGROUND}; wait"
    result = await run_command(
        ["sh", "-c", script], workspace=ws, profile=profile(ws, exec_timeout_s=0.5), sandbox=None
    )
    child = int((ws / "child.pid").read_text())
    assert (result, await gone(child)) == (
        Result("[timed out after 0.5 s; the command and all it started were killed]", True, "timed out after 0.5 s"),
        True,
    )


async def test_what_a_command_leaves_running_is_killed_when_it_exits(ws: Path) -> None:
    await run_command(["sh", "-c", BACKGROUND], workspace=ws, profile=profile(ws), sandbox=None)
    assert await gone(int((ws / "child.pid").read_text())) is True


def test_a_command_under_the_daemons_event_loop_holds_no_descriptor_of_the_daemons(ws: Path) -> None:
    # uvloop's spawn, which started commands before subprocess.Popen's vfork did, left some five of the daemon's
    # descriptors open in every command run under sandbox = "none" (duplicates of its /dev/null, stdout and stderr,
    # and a pipe of uvloop's): a command could write into the daemon's log.
    async def listing() -> Result:
        return await run_command(["ls", "/proc/self/fd"], workspace=ws, profile=profile(ws), sandbox=None)

    assert anyio.run(listing, backend_options={"use_uvloop": True}) == Result("0\n1\n2\n3\n")  # 3: ls's directory


@pytest.mark.parametrize("confined", [True, False], ids=["bubblewrap", "none"])
async def test_a_command_starts_with_no_signal_ignored_though_the_daemon_ignores_some(ws: Path, confined: bool) -> None:
    # subprocess.Popen leaves a signal the daemon ignores ignored in the command (all but SIGPIPE and SIGXFSZ), where
    # uvloop's spawn reset every one: a daemon started by nohup (SIGHUP) or from a script's `&` (SIGINT, SIGQUIT) gave
    # its commands signals they could not be stopped with, and a shell cannot even trap them back.
    chosen = choose(profile(Path("/"))) if confined else None
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        result = await run_command(
            ["grep", "SigIgn", "/proc/self/status"], workspace=ws, profile=profile(ws), sandbox=chosen
        )
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    # Of the signals a program can set: glibc's own two (32, 33) it cannot, and a full suite's worker had 32 ignored.
    assert int(result.text.split()[1], 16) & ~GLIBC_RESERVED == 0


@pytest.mark.parametrize("pidfd", [True, False])
async def test_a_commands_exit_status_is_waited_for_with_a_pidfd_or_without(pidfd: bool) -> None:
    command = Command(subprocess.Popen(["sh", "-c", "sleep 0.1; exit 3"]), pidfd=pidfd)
    assert await command.wait() == 3


REUSED = """
import anyio, os, subprocess
from devd.agent.tools import Command, _kill

async def main() -> None:
    command = Command(subprocess.Popen(["true"], start_new_session=True))
    await command.wait()
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # the next process gets the reaped command's pid
        f.write(str(command.pid - 1))
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    assert other.pid == command.pid, (other.pid, command.pid)
    await _kill(command)  # a cancel landing once the command was reaped
    print(other.poll())
    other.kill()

anyio.run(main)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own, whose next pid it sets, needs root")
def test_a_reaped_commands_group_is_never_killed_by_its_pid_given_to_another_group() -> None:
    # A command's group is killed by its pid (the group's id), which, once the command is reaped and the rest of its
    # group gone, the kernel may give to another process: a cancel landing after the reap killed that process's group
    # (another session's command, started in a session of its own). Shown in a pid namespace of its own, whose next
    # pid the test sets (ns_last_pid).
    run = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", REUSED], capture_output=True, text=True, timeout=30
    )
    assert (run.stdout, run.stderr) == ("None\n", "")


def _zombies() -> list[int]:
    """This process's children that have exited and wait to be reaped."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            found.append(int(pid))
    return found


@pytest.mark.parametrize(("pidfd", "confined"), [(True, False), (False, False), (True, True)])
async def test_commands_ended_every_way_leave_the_daemon_no_descriptor_and_no_zombie(
    ws: Path, pidfd: bool, confined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each command holds a pipe and a pidfd of the daemon's, and is reaped by it alone: whether it exits, fails, times
    # out, is cut at its output cap, leaves children holding its output, or is cancelled before or while it runs.
    if not pidfd:
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(38, "no pidfd")))
    ways = [
        (["true"], {}),
        (["sh", "-c", "exit 3"], {}),
        (["sleep", "30"], {"exec_timeout_s": 0.2}),
        (["yes"], {"output_bytes_max": 1000}),
        (["sh", "-c", "(setsid sleep 30 &); (sleep 30 &); echo left"], {}),
    ]
    chosen = choose(profile(Path("/"))) if confined else None  # bubblewrap: the workspace's and seccomp's too
    await run_command(["true"], workspace=ws, profile=profile(ws), sandbox=chosen)  # what a first command sets up
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        for argv, fields in ways:
            await run_command(argv, workspace=ws, profile=profile(ws, **fields), sandbox=chosen)
        for after_s in (0.0, 0.1):
            with anyio.move_on_after(after_s):
                await run_command(["sleep", "30"], workspace=ws, profile=profile(ws), sandbox=chosen)
    assert (sorted(os.listdir("/proc/self/fd")), _zombies()) == (before, [])


async def test_a_command_reaped_elsewhere_is_waited_for_without_a_pidfd_as_popen_would() -> None:
    # Where there is no pidfd its exit is polled for with waitid, which, for a child already reaped, raises ECHILD
    # (Popen's own poll takes it as an exit status of 0).
    popen = subprocess.Popen(["true"])
    os.waitpid(popen.pid, 0)
    assert await Command(popen, pidfd=False).wait() == 0


async def test_a_command_killed_by_a_signal_has_the_signals_negative_number_as_its_exit_status() -> None:
    command = Command(subprocess.Popen(["sleep", "60"]))
    os.kill(command.pid, 9)
    assert await command.wait() == -9


async def test_cancelling_kills_the_command_and_raises(ws: Path) -> None:
    os.mkfifo(
        ws / "started"
    )  # the command's write of its pid blocks until the test reads it: an event across processes
    cancelled = False

    async def run() -> None:
        nonlocal cancelled
        try:
            await run_command(
                ["sh", "-c", f"{OWN_PID} > started; sleep 60"], workspace=ws, profile=profile(ws), sandbox=None
            )
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            pid = int(await anyio.to_thread.run_sync((ws / "started").read_text))
            tg.cancel_scope.cancel()
    assert (cancelled, await gone(pid)) == (True, True)
