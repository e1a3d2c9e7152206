"""The `devd` command as a user runs it: what it says when the daemon is not there, flags passed through as given,
and `devd watch` following a session for as long as it lasts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devd.client import Client, NotRunningError
from devd.messages import turn
from tests.daemon import Daemon


def devd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devd", *args], capture_output=True, text=True, timeout=timeout)


def test_without_a_daemon_the_cli_says_how_to_start_one(tmp_path: Path) -> None:
    run = devd("ls", "--connect", str(tmp_path / "none.sock"))
    assert (run.returncode, run.stderr.startswith(f"devd: no daemon is listening at {tmp_path / 'none.sock'}")) == (
        3,
        True,
    )
    assert "start one with `devd serve`" in run.stderr


def test_without_a_daemon_the_client_raises_not_running(tmp_path: Path) -> None:
    with pytest.raises(NotRunningError, match="start one with `devd serve`"):
        Client.connect(tmp_path / "none.sock")


def test_an_empty_key_is_sent_and_refused_not_dropped(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{"Timer":true}', "--key", "", "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (1, "devd: INVALID_PARAMS: the key must be 1-256 bytes of UTF-8\n")


def test_a_zero_timeout_is_sent_and_refused_not_dropped(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
    run = devd("step", "s", '{"Timer":true}', "--timeout-ms", "0", "--connect", str(daemon.socket))
    assert (run.returncode, run.stderr) == (
        1,
        "devd: INVALID_PARAMS: timeout_ms must be a positive number of milliseconds\n",
    )


def test_watch_follows_a_session_and_exits_0_when_it_closes(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.new(session="s")
        watch = subprocess.Popen(
            [sys.executable, "-m", "devd", "watch", "s", "--connect", str(daemon.socket)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        c.step("s", turn(1, "x"))
        time.sleep(0.5)
        c.call("session/close", {"session": "s"})
        out, err = watch.communicate(timeout=30)
    methods = [line.split('"method":"')[1].split('"')[0] for line in out.splitlines()]
    assert (watch.returncode, methods, err) == (0, ["session/actions", "session/unwatched"], "")


def test_the_blocking_client_waits_for_a_notification_past_its_own_timeout(daemon: Daemon) -> None:
    with daemon.client() as stepper, Client.connect(daemon.socket, timeout=0.3) as watcher:
        stepper.new(session="s")
        watcher.call("session/watch", {"session": "s"})
        started = time.monotonic()
        later = threading.Timer(1.0, lambda: stepper.step("s", turn(1, "x")))
        later.start()
        notice = watcher.wait_notification()
        later.join()
    assert (notice.method, time.monotonic() - started >= 1.0) == ("session/actions", True)
