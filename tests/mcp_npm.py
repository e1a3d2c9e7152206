"""The reference MCP server, `@modelcontextprotocol/server-everything` from npm, for the tests: installed by `npm ci`
in tests/npm (its package-lock.json pins it) once, and again only when the lock file changes (as `make
prerequisites` does too), so a fresh checkout needs only Node.js 20+ and npm. Where the sandbox's unprivileged user
cannot read the checkout (under /tmp, or /root), the installed packages are laid out under /var/tmp, as
tests/mcp_place.py does for the Python server."""

from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.mcp_place import _link, _reachable

HERE = Path(__file__).resolve().with_name("npm")
INSTALLED = HERE / "node_modules" / ".devd-lock-sha256"  # the lock file `npm ci` last installed
ENTRY = Path("@modelcontextprotocol", "server-everything", "dist", "index.js")
NPM_TIMEOUT_S = 600


def install(directory: Path = HERE) -> Path:
    """directory/node_modules as its package-lock.json pins it (`npm ci`, only when the lock changed); one process
    installs at a time (pytest-xdist's workers share the checkout)."""
    lock = hashlib.sha256((directory / "package-lock.json").read_bytes()).hexdigest()
    marker = directory / "node_modules" / ".devd-lock-sha256"
    with open(directory / "package.json") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not marker.exists() or marker.read_text() != lock:
            npm = shutil.which("npm")
            if npm is None:
                pytest.fail("npm is not on PATH: the MCP tests need Node.js 20 or later, and npm (make prerequisites)")
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"],
                cwd=directory,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT_S,
            )
            if done.returncode != 0:
                pytest.fail(f"npm ci in {directory} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
            marker.write_text(lock)
    return directory / "node_modules"


@functools.cache
def everything() -> Path:
    """server-everything's entry point (`node PATH stdio` or `node PATH streamableHttp`), where the sandbox's user
    reaches it."""
    modules = install()
    if _reachable(modules / ENTRY):
        return modules / ENTRY
    home = Path(tempfile.mkdtemp(prefix="devd-test-npm-", dir="/var/tmp"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    home.chmod(0o755)
    shutil.copytree(modules, home / "node_modules", copy_function=_link, symlinks=True)
    return home / "node_modules" / ENTRY
