"""`daemon/backup`: a consistent copy of a running daemon's sessions, from which another daemon carries on exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devd import errors
from devd.messages import answer, turn
from tests.daemon import Daemon


def test_a_daemon_started_on_a_backup_carries_on_from_the_moment_it_was_taken(tmp_path: Path) -> None:
    copy = tmp_path / "backup.sqlite3"
    with Daemon(tmp_path / "a") as d, d.client() as c:
        c.new(session="s")
        c.step_answer("s", turn(1, "x"), key="t1")
        made = c.call("daemon/backup", {"path": str(copy)})
        c.step("s", answer(1, "after the backup"))
    restored = tmp_path / "b" / "state"
    restored.mkdir(parents=True, mode=0o700)
    shutil.copy(copy, restored / "devd.sqlite3")
    with Daemon(tmp_path / "b") as d, d.client() as c:
        listed = [(s["session"], s["seq"]) for s in c.call("session/list")["sessions"]]
        again = c.step_answer("s", turn(1, "x"), key="t1")
        assert (made, listed, again.replayed) == ({"path": str(copy), "bytes": copy.stat().st_size}, [("s", 1)], True)


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("backup.sqlite3", errors.InvalidParamsError, "the backup path must be absolute"),
        ("/nonexistent/dir/backup.sqlite3", errors.InvalidParamsError, "/nonexistent/dir is not a directory"),
    ],
)
def test_a_backup_path_that_cannot_be_written_is_refused_saying_why(
    tmp_path: Path, path: str, error: type[errors.DevdError], message: str
) -> None:
    with Daemon(tmp_path) as d, d.client() as c, pytest.raises(error, match=message):
        c.call("daemon/backup", {"path": path})


def test_a_backup_never_overwrites_a_file(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.write_text("mine")
    with Daemon(tmp_path / "d") as d, d.client() as c, pytest.raises(errors.ExistsError, match="exists; choose a new"):
        c.call("daemon/backup", {"path": str(kept)})
    assert kept.read_text() == "mine"


def test_a_backup_that_fails_leaves_nothing_behind_and_the_daemon_serving(tmp_path: Path) -> None:
    copy = tmp_path / "backup.sqlite3"
    with Daemon(tmp_path / "d", env={"DEVD_FAILPOINTS": "backup=eio"}) as d, d.client() as c:
        c.new(session="s")
        with pytest.raises(errors.InternalError, match=f"the backup to {copy} failed"):
            c.call("daemon/backup", {"path": str(copy)})
        assert (c.step("s", turn(1, "x"))[0].id, list(tmp_path.glob("*backup*"))) == (1, [])
