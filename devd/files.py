"""Files written whole or not at all: the TCP token, the database's identity, a backup.

A backup is never written over anything: its partial file is made new (`O_CREAT|O_EXCL|O_NOFOLLOW`, a name no one can
guess) and it is published under a name only if nothing, not even a dangling symlink, has that name yet.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PARTIAL_PREFIX = ".devd-partial-"  # a backup being written; one left by a killed daemon is removed at its next start


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
    fsync_dir(path.parent)


def new_partial(beside: Path) -> Path:
    """A new empty file, mode 0600, in the directory of `beside`, named unpredictably and opened
    `O_CREAT|O_EXCL|O_NOFOLLOW`: nothing planted in advance (a symlink, a file) is ever written through."""
    path = beside.with_name(f"{PARTIAL_PREFIX}{secrets.token_hex(16)}")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    return path


def publish_new(written: Path, path: Path) -> None:
    """Make the file `written` (closed, beside `path`) durable as `path`, which must not exist: fsync it, link it
    into place (FileExistsError when anything has that name, a symlink included: nothing is replaced or followed),
    drop the partial name, fsync the directory."""
    with open(written, "rb") as f:
        os.fsync(f.fileno())
    os.link(written, path, follow_symlinks=False)
    os.unlink(written)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries durable: a file created, renamed or removed in it survives a crash only then."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partials(directory: Path) -> int:
    """Remove the partial files a killed daemon left in `directory`; how many there were."""
    removed = 0
    for entry in directory.glob(f"{PARTIAL_PREFIX}*"):
        entry.unlink(missing_ok=True)
        removed += 1
    return removed
