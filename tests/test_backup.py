"""`daemon/backup`: a consistent copy of a running daemon's sessions, from which another daemon carries on exactly;
written only into the operator's backup directory, by a plain file name, never over or through anything there."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from devd import errors
from devd.messages import answer, turn
from tests.daemon import Daemon
from tests.harness import InProcess
from tests.helpers import devd

NAME_REFUSED = "a backup is named by a plain file name (no /, no leading ., no control characters)"


def test_a_daemon_started_on_a_backup_carries_on_from_the_moment_it_was_taken(tmp_path: Path) -> None:
    copy = tmp_path / "a" / "state" / "backups" / "backup.sqlite3"
    with InProcess(tmp_path / "a") as d, d.client() as c:
        c.new(session="s")
        c.step_answer("s", turn(1, "x"), key="t1")
        made = c.call("daemon/backup", {"name": "backup.sqlite3"})
        c.step("s", answer(1, "after the backup"))
    restored = tmp_path / "b" / "state"
    restored.mkdir(parents=True, mode=0o700)
    shutil.copy(copy, restored / "devd.sqlite3")
    with InProcess(tmp_path / "b") as d, d.client() as c:
        listed = [(s["session"], s["seq"]) for s in c.call("session/list")["sessions"]]
        again = c.step_answer("s", turn(1, "x"), key="t1")
        assert (made, listed, again.replayed) == ({"path": str(copy), "bytes": copy.stat().st_size}, [("s", 1)], True)


def test_a_backup_goes_into_the_directory_the_operator_configured(tmp_path: Path) -> None:
    chosen = tmp_path / "elsewhere"
    with InProcess(tmp_path / "d", "--backup-dir", str(chosen)) as d, d.client() as c:
        c.call("daemon/backup", {"name": "nightly.sqlite3"})
    assert (sorted(p.name for p in chosen.iterdir()), oct(chosen.stat().st_mode & 0o777)) == (
        ["nightly.sqlite3"],
        "0o700",
    )


@pytest.mark.parametrize(
    "name",
    [
        "/home/user/.ssh/authorized_keys",
        "../devd.sqlite3",
        "..",
        ".hidden",
        "sub/backup.sqlite3",
        "back\nup",
    ],
)
def test_a_backup_name_that_is_not_a_plain_file_name_is_refused_saying_why(tmp_path: Path, name: str) -> None:
    with InProcess(tmp_path) as d, d.client() as c, pytest.raises(errors.InvalidParamsError) as refused:
        c.call("daemon/backup", {"name": name})
    assert str(refused.value).startswith(NAME_REFUSED)


def test_a_path_is_refused_alike_whether_or_not_it_exists(tmp_path: Path) -> None:
    """No existence oracle: the answer is decided by the name alone."""
    (tmp_path / "there").write_text("x")
    answers = []
    with InProcess(tmp_path / "d") as d, d.client() as c:
        for path in (tmp_path / "there", tmp_path / "not-there", tmp_path / "no-dir" / "x"):
            with pytest.raises(errors.InvalidParamsError) as refused:
                c.call("daemon/backup", {"path": str(path)})
            # The name as quoted (a long one is cut short in the message, so it is matched, not replaced).
            answers.append(re.sub(r"not '[^']*'", "not 'PATH'", str(refused.value)))
    assert len(set(answers)) == 1


def test_a_backup_never_overwrites_a_file(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        kept = d.state / "backups" / "kept"
        kept.write_text("mine")
        with pytest.raises(errors.ExistsError, match="kept exists; choose a new name"):
            c.call("daemon/backup", {"name": "kept"})
    assert kept.read_text() == "mine"


def test_a_backup_never_writes_through_a_symlink_at_its_name(tmp_path: Path) -> None:
    target = tmp_path / "authorized_keys"
    with InProcess(tmp_path / "d") as d, d.client() as c:
        (d.state / "backups" / "planted").symlink_to(target)
        with pytest.raises(errors.ExistsError, match="planted exists"):
            c.call("daemon/backup", {"name": "planted"})
    assert not target.exists()


def test_a_backup_that_fails_leaves_nothing_behind_and_the_daemon_serving(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_TESTING": "1", "DEVD_FAILPOINTS": "backup=eio"}) as d, d.client() as c:
        c.new(session="s")
        with pytest.raises(errors.InternalError, match="the backup to .*/backups/b.sqlite3 failed"):
            c.call("daemon/backup", {"name": "b.sqlite3"})
        assert (c.step("s", turn(1, "x"))[0].id, os.listdir(d.state / "backups")) == (1, [])


def test_the_partial_file_of_a_killed_backup_is_removed_at_the_next_start(tmp_path: Path) -> None:
    d = Daemon(tmp_path, env={"DEVD_TESTING": "1", "DEVD_FAILPOINTS": "backup=kill"})
    with d, d.client() as c:
        with pytest.raises(ConnectionError):  # killed while it copies
            c.call("daemon/backup", {"name": "b.sqlite3"})
    left = os.listdir(d.state / "backups")
    d.env = {}
    with d:
        assert (len(left), os.listdir(d.state / "backups")) == (1, [])


def test_a_backup_directory_others_may_write_is_refused_at_start(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    d = Daemon(tmp_path / "d", "--backup-dir", str(shared))
    with pytest.raises(RuntimeError, match=f"the backup directory {shared} is writable by group or others"):
        d.start()


def test_devd_backup_writes_the_named_copy_in_the_backup_directory(daemon: Daemon) -> None:
    done = devd("backup", "--connect", str(daemon.socket), "copy.sqlite3")
    written = daemon.state / "backups" / "copy.sqlite3"
    assert done.stdout == f"{written}: {written.stat().st_size} bytes\n"


@pytest.mark.parametrize("key", ["a\nb", "tab\there", "nul\x00", "esc\x1b[2J", "c1\x85"])
def test_a_key_with_a_control_character_is_refused_saying_why(tmp_path: Path, key: str) -> None:
    with InProcess(tmp_path) as d, d.client() as c, pytest.raises(errors.InvalidParamsError) as refused:
        c.new(session="s")
        c.step("s", turn(1, "x"), key=key)
    assert str(refused.value) == (
        "the key must not hold control characters (U+0000-U+001F, U+007F-U+009F: newlines, tabs, escapes)"
    )
