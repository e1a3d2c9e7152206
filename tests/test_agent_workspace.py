"""A session's workspace is pinned (issue 29): its identity is recorded when the session is made and checked at every
Read, Write, Exec and Git by walking from / without following a link; a workspace holding the daemon's own paths is
refused, and Read and Write never touch those paths. On real directories, real bubblewrap and the real daemon."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from devd import errors
from devd.agent import records
from devd.agent.profiles import Profile
from devd.agent.records import Binding
from devd.agent.sandbox import Sandbox, choose, wrap
from devd.agent.tools import Result, Workspace, _read, _write, pin, read_file, run_command, write_file
from tests.agents import SECRET, Agentd, agentd, agents_toml, conversation, run_turn
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["agentd", "standin_fixture"]


def moved(workspace: Path, what: str) -> str:
    return (
        f"refused: the workspace {workspace} was moved or replaced since the session was made ({what}); nothing was "
        "done: make a new session (session/new) with the workspace as it is now"
    )


PROFILE = Profile(name="p", base_url="http://h/v1", model="m", workspace_roots=())  # Read's: commands run as nobody


def profile(root: Path) -> Profile:
    return Profile(name="p", base_url="http://h/v1", model="m", workspace_roots=(str(root),))


def sandbox(root: Path) -> Sandbox:
    chosen = choose(profile(root))
    assert isinstance(chosen, Sandbox), chosen  # bubblewrap is a prerequisite of the suite
    return chosen


@pytest.fixture
def outside_marker() -> Iterator[Path]:
    """A file name at the host's / that no test may ever create (removed should one appear)."""
    marker = Path("/") / f"devd-outside-{uuid.uuid4().hex[:12]}"
    yield marker
    marker.unlink(missing_ok=True)


@pytest.fixture
def swapped(tmp_path: Path) -> Workspace:
    """Session C's workspace root/c, pinned; then what session P's command does: `mv c c.old && ln -s / c`."""
    c = tmp_path / "root" / "c"
    c.mkdir(parents=True)
    workspace = Workspace(c, pin(c))
    c.rename(tmp_path / "root" / "c.old")
    c.symlink_to("/")
    return workspace


# -- the tools ------------------------------------------------------------------------------------------------------


async def test_a_write_into_a_workspace_swapped_for_a_link_to_root_is_refused(
    swapped: Workspace, outside_marker: Path
) -> None:
    result = await write_file(swapped, outside_marker.name, "planted")
    assert (result, outside_marker.exists()) == (
        Result(moved(swapped.path, f"{swapped.path} is a symbolic link"), True),
        False,
    )


async def test_a_read_in_a_workspace_swapped_for_a_link_to_root_is_refused(swapped: Workspace) -> None:
    assert await read_file(swapped, "etc/hostname", 1000, profile=PROFILE) == Result(
        moved(swapped.path, f"{swapped.path} is a symbolic link"), True
    )


async def test_a_command_in_a_workspace_swapped_for_a_link_to_root_is_refused_and_root_stays_unwritten(
    swapped: Workspace, outside_marker: Path
) -> None:
    # Both ways out: through the workspace's path (bound over the sandbox's private /tmp) and at the sandbox's /.
    touch = ["sh", "-c", f"touch {outside_marker.name} {outside_marker}"]
    root = swapped.path.parent
    result = await run_command(touch, workspace=swapped, profile=profile(root), sandbox=sandbox(root))
    assert (result, outside_marker.exists()) == (
        Result(moved(swapped.path, f"{swapped.path} is a symbolic link"), True),
        False,
    )


async def test_a_workspace_replaced_by_another_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    workspace = Workspace(tmp_path / "c", pin(tmp_path / "c"))
    (tmp_path / "c").rename(tmp_path / "c.old")
    (tmp_path / "c").mkdir()
    assert await write_file(workspace, "a.txt", "x") == Result(
        moved(tmp_path / "c", "another directory is there now"), True
    )


async def test_a_directory_above_the_workspace_swapped_for_a_link_is_refused_even_to_the_same_place(
    tmp_path: Path,
) -> None:
    (tmp_path / "a" / "c").mkdir(parents=True)
    workspace = Workspace(tmp_path / "a" / "c", pin(tmp_path / "a" / "c"))
    (tmp_path / "a").rename(tmp_path / "a.old")
    (tmp_path / "a").symlink_to(tmp_path / "a.old")  # the same directory, now reached through a link
    assert await read_file(workspace, ".", 100, profile=PROFILE) == Result(
        moved(workspace.path, f"{tmp_path / 'a'} is a symbolic link"), True
    )


async def test_a_workspace_removed_is_refused_saying_it_does_not_exist(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    workspace = Workspace(tmp_path / "c", pin(tmp_path / "c"))
    (tmp_path / "c").rmdir()
    assert await read_file(workspace, "a.txt", 100, profile=PROFILE) == Result(
        moved(tmp_path / "c", f"{tmp_path / 'c'} does not exist"), True
    )


async def test_the_sandbox_binds_the_directory_checked_not_where_the_path_leads_now(
    tmp_path: Path, outside_marker: Path
) -> None:
    """The race left after the check: the path swapped for a link to / between the check and bubblewrap's bind.
    bubblewrap is given the checked directory's descriptor; it refuses the bind (or binds that directory), and / is
    never writable."""
    bwrap = sandbox(tmp_path).bwrap
    (tmp_path / "c").mkdir()
    fd = os.open(tmp_path / "c", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        (tmp_path / "c").rename(tmp_path / "c.old")
        (tmp_path / "c").symlink_to("/")
        touch = ["sh", "-c", f"touch {outside_marker.name} {outside_marker}"]
        command = wrap(touch, tmp_path / "c", False, bwrap=bwrap, workspace_fd=fd)
        subprocess.run(command, pass_fds=(fd,), capture_output=True, check=False, timeout=30)
    finally:
        os.close(fd)
    assert outside_marker.exists() is False


async def test_reading_the_token_through_a_workspace_holding_the_state_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "token").write_text("the token")
    workspace = Workspace(tmp_path, pin(tmp_path), private=(tmp_path / "state",))
    assert await read_file(workspace, "state/token", 100, profile=PROFILE) == Result(
        f"refused: state/token is inside the daemon's own {tmp_path}/state, which no tool reads or writes; give "
        "another",
        True,
    )


async def test_a_write_naming_the_daemons_socket_is_refused_and_leaves_it(tmp_path: Path) -> None:
    (tmp_path / "devd.sock").write_text("")
    workspace = Workspace(tmp_path, pin(tmp_path), private=(tmp_path / "devd.sock",))
    result = await write_file(workspace, "devd.sock", "x")
    assert (result, (tmp_path / "devd.sock").read_text()) == (
        Result(
            f"refused: devd.sock is the daemon's own {tmp_path}/devd.sock, which no tool reads or writes; give another",
            True,
        ),
        "",
    )


async def test_a_link_in_the_workspace_to_the_state_directory_reads_nothing_of_it(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "token").write_text("the token")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "st").symlink_to(tmp_path / "state")
    workspace = Workspace(tmp_path / "ws", pin(tmp_path / "ws"), private=(tmp_path / "state",))
    assert await read_file(workspace, "st/token", 100, profile=PROFILE) == Result(
        f"refused: st/token leads outside the workspace (to {tmp_path}/state/token) through a symbolic link", True
    )


def test_a_directory_write_makes_swapped_for_a_hard_link_to_roots_file_leaves_that_file_roots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write makes `d/new` in `d`, which is uid 65534's, and gives it to that user. d's owner may swap the new
    directory for a hard link to any file between the mkdir and the owner change (as root, a command that won the
    race owned a root 0600 file after 52 writes, and could have owned /etc/passwd): the swap is done here in the
    mkdir itself, so the window is hit every time. Root's file keeps its owner, and the write is refused."""
    (tmp_path / "vault").mkdir()
    secret = tmp_path / "vault" / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    os.chown(ws / "d", 65534, 65534)
    mkdir = os.mkdir

    def mkdir_then_swapped(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        mkdir(path, mode, dir_fd=dir_fd)
        os.rename(path, f"{path}.made", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.link(secret, path, dst_dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swapped)
    result = _write(Workspace(ws, pin(ws)), "d/new/f", "x")
    monkeypatch.undo()
    assert (os.stat(secret).st_uid, result) == (
        0,
        Result("refused: new is a file, not a directory; nothing was done", failed=True),
    )


# A command racing the tools: it swaps each pair of names atomically (renameat2's RENAME_EXCHANGE), for ever; a pair
# one of whose names is gone meanwhile (inside a workspace swapped away) is skipped.
SWAPPER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
pairs = [(a.encode(), b.encode()) for a, b in zip(sys.argv[1::2], sys.argv[2::2])]
while True:
    for a, b in pairs:
        libc.renameat2(-100, a, -100, b, 2)
"""


def test_reads_and_writes_racing_1500_swaps_for_links_out_stay_inside(tmp_path: Path) -> None:
    """While a command swaps `dir` (in the workspace) and the workspace itself with links out, 1,500 writes and reads
    of `dir/f` write nothing outside and read nothing of it."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "dir").mkdir(parents=True)
    outside.mkdir()
    (outside / "f").write_text("the secret")
    (ws / "other").symlink_to(outside)
    (tmp_path / "ws-link").symlink_to(outside)
    workspace = Workspace(ws, pin(ws))
    pairs = [str(ws / "dir"), str(ws / "other"), str(ws), str(tmp_path / "ws-link")]
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, *pairs])
    seen = []
    try:
        for i in range(1500):
            seen.append(_write(workspace, "dir/f", f"inside {i}").text)
            seen.append(_read(workspace, "dir/f", 100, PROFILE).text)
    finally:
        swapper.kill()
        swapper.wait()
    assert (sorted(os.listdir(outside)), (outside / "f").read_text(), [t for t in seen if "secret" in t]) == (
        ["f"],
        "the secret",
        [],
    )


def test_a_binding_recorded_before_identities_decodes_with_none() -> None:
    assert records.decode(b'{"agent":"coder","workspace":"/w"}', Binding) == Binding("coder", "/w", None)


# -- through the daemon -----------------------------------------------------------------------------------------------


def test_a_session_whose_workspace_another_session_swapped_for_a_link_to_root_is_refused_every_tool(
    agentd: Agentd, outside_marker: Path
) -> None:
    """Session P's workspace is the profile's root; its command swaps session C's workspace for a link to /. C's
    Write, Read and Exec are each refused, and nothing appears at /."""
    root, ws = agentd.workspace.parent, agentd.workspace
    agentd.standin.script(
        Scripted(
            tool_calls=[
                ("exec", {"argv": ["mv", ws.name, f"{ws.name}.old"]}),
                ("exec", {"argv": ["ln", "-s", "/", ws.name]}),
            ]
        ),
        Scripted(text="swapped"),
        Scripted(
            tool_calls=[
                ("write", {"path": outside_marker.name, "text": "planted"}),
                ("read", {"path": "etc/hostname"}),
                ("exec", {"argv": ["tee", outside_marker.name, str(outside_marker)]}),  # through the path, and at /
            ]
        ),
        Scripted(text="done"),
    )
    with agentd.client() as c:
        p = c.new(agent="coder", workspace=root)
        session = agentd.session(c)
        run_turn(c, p, "swap it")
        run_turn(c, session, "escape")
        results = [(m["Tool"]["text"], m["Tool"].get("failed", False)) for m in conversation(c, session) if "Tool" in m]
    assert (results, ws.is_symlink(), outside_marker.exists()) == (
        [(moved(ws, f"{ws} is a symbolic link"), True)] * 3,
        True,
        False,
    )


def test_a_workspace_holding_the_daemons_state_directory_is_refused_saying_why(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path))
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon, daemon.client() as c:
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.new(agent="coder", workspace=tmp_path)
    assert str(refused.value) == (
        f"workspace {tmp_path} holds the daemon's own {daemon.state}, which no session may reach; use a directory "
        "that does not hold it"
    )


def _bindings(state: Path, session: str) -> list[dict[str, Any]]:
    with contextlib.closing(sqlite3.connect(state / "devd.sqlite3")) as db:
        rows = db.execute("SELECT body FROM records WHERE session = ? AND kind = ? ORDER BY n", (session, "agent"))
        return [msgspec.json.decode(body) for (body,) in rows]


def test_a_session_made_before_identities_is_pinned_at_its_first_call_durably(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[("write", {"path": "a.txt", "text": "x"})]), Scripted(text="written"))
    with agentd.client() as c:
        session = agentd.session(c)
    agentd.daemon.stop()
    legacy = msgspec.json.encode({"agent": "coder", "workspace": str(agentd.workspace)})  # as daemons wrote it before
    with contextlib.closing(sqlite3.connect(agentd.daemon.state / "devd.sqlite3")) as db, db:
        db.execute("UPDATE records SET body = ? WHERE session = ? AND kind = ?", (legacy, session, "agent"))
    agentd.daemon.start()
    with agentd.client() as c:
        run_turn(c, session, "write")
    agentd.daemon.stop()  # it holds the database locked while it runs
    st = agentd.workspace.stat()
    assert _bindings(agentd.daemon.state, session) == [
        {"agent": "coder", "workspace": str(agentd.workspace)},
        {"agent": "coder", "workspace": str(agentd.workspace), "identity": [st.st_dev, st.st_ino]},
    ]
