"""The suite's own promises, each checked by running it in a subprocess as a user would: on a machine without what it
needs, `make test` stops before any test with one line saying what is missing (.ci/prerequisites); it is hermetic (no
test reads the user's devd configuration, tests/conftest.py); and a hung test fails the run in bounded time rather
than holding it (the timeouts in pyproject.toml)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.daemon import ROOT


def test_without_bubblewrap_node_and_postgresql_make_test_stops_first_with_one_line_saying_how_to_get_them() -> None:
    """.ci/prerequisites --check (what `make test` runs, without installing) in a bubblewrap sandbox where bwrap and
    node are empty files and DEVD_PG_BIN names no directory."""
    bwrap, node = shutil.which("bwrap"), shutil.which("node")
    assert bwrap is not None and node is not None
    argv = [bwrap, "--dev-bind", "/", "/", "--ro-bind", "/dev/null", bwrap, "--ro-bind", "/dev/null", node]
    argv += [
        "--setenv",
        "DEVD_PG_BIN",
        "/nowhere",
        "--",
        str(ROOT / ".ci" / "prerequisites"),
        "--check",
        sys.executable,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        "",
        "make test cannot run here; missing: [bubblewrap is not installed (no bwrap on the PATH); as root: apt-get "
        "install bubblewrap (or dnf install bubblewrap)] [Node.js 20 or later with npm (for clients/typescript): found "
        "no node; install it from nodejs.org or your distribution] [PostgreSQL 15's server programs (no "
        "/nowhere/initdb): as root, apt-get install postgresql-15, or set DEVD_PG_BIN to their directory]\n",
    )


# An agents file that stops any daemon that reads it (exit status 2): what a user's own file does to a test whose
# daemon finds it.
BROKEN_AGENTS = "[agents.mine\n"


# A test whose daemon process finds the agents file where devd looks by default.
STARTS_A_DAEMON = "tests/test_systemd.py::test_sockets_passed_to_another_pid_are_ignored"


def test_a_users_own_agents_file_and_devd_variables_reach_no_test(tmp_path: Path) -> None:
    """With an agents file where devd looks by default ($XDG_CONFIG_HOME/devd, ~/.config/devd) and DEVD_AGENTS
    naming it, a test whose daemon process would read it passes; without tests/conftest.py (--noconftest) the same
    run fails, so the file is one a daemon would have read (a docs test failed so once a user made agents.toml)."""
    home, config = tmp_path / "home", tmp_path / "config"
    for agents in (home / ".config" / "devd" / "agents.toml", config / "devd" / "agents.toml"):
        agents.parent.mkdir(parents=True)
        agents.write_text(BROKEN_AGENTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DEVD_"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(config), DEVD_AGENTS=str(config / "devd" / "agents.toml"))

    def run(*flags: str) -> int:
        argv = [sys.executable, "-m", "pytest", "-q", "-n", "0", *flags, STARTS_A_DAEMON]
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120).returncode

    assert (run("--noconftest"), run()) == (1, 0)


HANGS = """
import signal
import time


def test_sleeps():
    time.sleep(600)


def test_stuck_where_no_signal_reaches():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(600)
"""


def test_hung_tests_fail_a_parallel_run_within_their_timeout_and_a_minute(tmp_path: Path) -> None:
    """Under the suite's own settings (pyproject.toml, timeouts scaled from 180 and 240 s to 2 and 4 s) and
    `make test`'s scheduling, one test that sleeps and one stuck where SIGALRM cannot reach both fail, and the run
    ends: the thread method with pytest-xdist's loadgroup scheduler waited for ever once a worker was ended."""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-q"]
    argv += ["-n", "2", "--dist", "loadgroup", "-o", "timeout=2", "-o", "faulthandler_timeout=4", "test_hangs.py"]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    failed = sorted(re.findall(r"^FAILED (\S+) - .*?(Timeout|crash)", done.stdout, re.M))
    assert (done.returncode, failed, elapsed < 60) == (
        1,
        [("test_hangs.py::test_sleeps", "Timeout"), ("test_hangs.py::test_stuck_where_no_signal_reaches", "crash")],
        True,
    ), done.stdout


GROUPED = """
import os

import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("n", range(6))
def test_notes_its_worker(n):
    with open(f"{n}.worker", "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path: Path) -> None:
    """`make test`'s scheduling (--dist loadgroup) keeps a group on one worker, as tests/test_typescript.py needs (its
    tests share node_modules and dist/): with pytest 9.2 and pytest-xdist 3.8 every group was ignored."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-q"]
    argv += ["-n", "3", "--dist", "loadgroup", "test_grouped.py"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    workers = {path.read_text() for path in tmp_path.glob("*.worker")}
    assert (done.returncode, len(list(tmp_path.glob("*.worker"))), len(workers)) == (0, 6, 1), done.stdout
