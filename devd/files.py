"""Files written whole or not at all: the TCP token, the database's identity, a backup."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """`text` and a newline at `path`, mode 0600: written to a temporary file, fsync'd, renamed over `path`, and the
    directory fsync'd, so a crash leaves the old file or the new one, never a part of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)
    publish(tmp, path)


def publish(written: Path, path: Path) -> None:
    """Make the file `written` (closed, beside `path`) durable as `path`: fsync it, rename it into place, fsync the
    directory, so a crash leaves no file or the whole one at `path`."""
    with open(written, "rb") as f:
        os.fsync(f.fileno())
    os.rename(written, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
