"""Where a sandboxed MCP test server runs from: tests/mcp_server.py and the SDK's packages, where the sandbox's
unprivileged user can read them.

The server runs as that user under bubblewrap, whose /tmp is a private one: a checkout under /tmp (as CI's may be),
or under a directory that user may not enter (/root), is out of its reach. Then the script and the virtualenv's
packages are laid out once per test process in a directory of their own under /var/tmp (hard links: under a second),
removed when the process exits. It runs under the system's python3 of the same version as this one (the virtualenv's
interpreter may be out of reach too), with the packages on its PYTHONPATH.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import msgspec

SERVER = Path(__file__).resolve().with_name("mcp_server.py")
PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


class Placed(msgspec.Struct, frozen=True):
    server: Path  # the server's script
    site: str  # the PYTHONPATH that finds the SDK's packages


@functools.cache
def placed() -> Placed:
    """The server and its packages, where the sandbox's user reaches them."""
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "mcp").is_dir())
    if _reachable(SERVER) and _reachable(Path(site)):
        return Placed(SERVER, site)
    home = Path(tempfile.mkdtemp(prefix="devd-test-mcp-", dir="/var/tmp"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    home.chmod(0o755)
    shutil.copytree(site, home / "site", copy_function=_link)
    shutil.copy2(SERVER, home / SERVER.name)
    return Placed(home / SERVER.name, str(home / "site"))


def _reachable(path: Path) -> bool:
    """Whether a user of no group of its owner can read path in the sandbox (outside /tmp, each parent enterable)."""
    if path.is_relative_to("/tmp"):
        return False
    return all(p.stat().st_mode & 0o001 for p in path.parents) and bool(path.stat().st_mode & 0o004)


def _link(source: str, target: str) -> object:
    try:
        os.link(source, target)
    except OSError:  # another file system: copied
        shutil.copy2(source, target)
    return target
