"""Where the daemon listens and keeps its state: the state directory, the TCP token, the Unix and TCP sockets.

What it promises: the state directory is refused when others can write it; the token file is created 0600 and
refused when others can read it; the Unix socket is 0600 in a 0700 directory it made (or one the user chose, unless
anyone could swap the socket), and a live daemon's socket is never taken over; peers are identified by uid.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import struct
from pathlib import Path

import structlog

log = structlog.get_logger("devd.listeners")


class StartupError(Exception):
    """The daemon cannot start as configured; the message says why and what to change."""


def prepare_state_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode
    if mode & 0o022:
        raise StartupError(
            f"the state directory {path} is writable by group or others (mode {stat.S_IMODE(mode):04o}); "
            f"run `chmod go-w {path}` (0700 is best) and start again"
        )


def read_token(state_dir: Path) -> str:
    """The TCP token, created 0600 on first use; a token file others can read is refused."""
    path = state_dir / "token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise StartupError(
                f"the token file {path} is readable by others (mode {mode:04o}); run `chmod 600 {path}` or delete it"
            ) from None
        return path.read_text().strip()
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at path: its directory made 0700 before binding, the socket 0600 from birth."""
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # made 0700 before binding when it is ours to make
    st = parent.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        # Anyone could replace the socket with their own: refuse, as git's credential-cache daemon does.
        raise StartupError(
            f"the socket directory {parent} is writable by anyone (mode {mode:04o}); "
            "pass a --socket in a directory of your own (0700 is best)"
        )
    if st.st_uid != os.getuid() or mode & 0o077:
        # The socket is 0600 and peers are checked by uid, so this is safe, but not what was asked for.
        log.warning("socket.directory_open", directory=str(parent), mode=f"{mode:04o}", owner=st.st_uid)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise StartupError(f"another daemon is listening on {path}; stop it or pass another --socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # a stale socket from a daemon that died
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.setblocking(False)
    return sock


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])
