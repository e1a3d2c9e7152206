"""Where the daemon listens and keeps its state: the state directory, the TCP token, the Unix and TCP sockets.

Where to listen is a value: `UnixListen` or `TcpListen` (`devd.addresses`, shared with the clients) or
`ActivatedListen` (a socket systemd passed). `bind` makes it a `Listening`, and `accepted` readies a connection by
its kind's peer rule.

What it promises: the state directory, the backup directory and a `--store` database (with its directory) are refused
when they are not this user's or others can write them, and one daemon at a time holds the state directory; the token
file is created 0600 atomically and refused when others can read it or it is too short; the Unix socket is 0600 in a
directory of this user's that no one else can swap it in, a live daemon's socket is never taken over, and a path that
is not a socket is never removed; peers are identified by uid, and named in records by `origin`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import socket
import stat
import struct
from pathlib import Path

import msgspec
import structlog

from devd.addresses import TcpListen, UnixListen, peer_uid
from devd.files import write_atomically

log = structlog.get_logger("devd.server.listeners")


class StartupError(Exception):
    """The daemon cannot start as configured; the message says why and what to change."""


def prepare_state_dir(path: Path, what: str = "the state directory", flag: str = "--state-dir") -> None:
    """Make the state directory (or another of the daemon's own: `what`, set by `flag`) 0700, or refuse one that is
    not this user's or that others can write."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path, what, flag)


def check_private_dir(path: Path, what: str, flag: str) -> None:
    """Refuse a directory of the daemon's that is not this user's, or that group or others can write."""
    st = path.stat()
    if st.st_uid != os.getuid():
        # Whoever owns it can plant a token or a database there: refuse, as OpenSSH refuses files owned by others.
        raise StartupError(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); pass a {flag} of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise StartupError(
            f"{what} {path} is writable by group or others (mode {mode:04o}); "
            f"run `chmod go-w {path}` (0700 is best) and start again"
        )


def check_database(path: Path) -> None:
    """Refuse a `--store sqlite:PATH` others could tamper with, as the state directory is refused: the directory
    holding it (where SQLite makes its log beside it) must be this user's and not writable by group or others, and
    the database and its log, when there, this user's and writable by no one else."""
    parent = path.parent
    try:
        check_private_dir(parent, "the directory of the database", "--store sqlite:PATH")
    except FileNotFoundError:
        raise StartupError(
            f"the directory of the database {path} does not exist; make it (`mkdir -m 700 {parent}`) or pass "
            "another --store"
        ) from None
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            st = file.stat()
        except FileNotFoundError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.getuid():
            raise StartupError(
                f"the database file {file} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                "serve a database of your own (copy it: `cp` makes the copy yours)"
            )
        if mode & 0o022:
            raise StartupError(
                f"the database file {file} is writable by group or others (mode {mode:04o}): anyone could change "
                f"the sessions in it; run `chmod 600 {file}` and start again"
            )


def lock_state_dir(path: Path, socket_path: Path | None) -> int:
    """Hold STATE_DIR/lock for the daemon's life (the kernel lets go when it dies, SIGKILL included), so that a
    second daemon on the same state directory refuses to start instead of serving the same sessions."""
    lock = path / "lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"another daemon holds the state directory {path} ({holder}); stop it, or pass another --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, socket {socket_path}\n".encode(), 0)
    return fd


TOKEN_CHARS_MIN = 32
BACKLOG = 512  # connections the kernel queues for accept, on every JSON-RPC listener


def read_token(state_dir: Path) -> str:
    """The TCP token: created on first use, atomically (a crash leaves no token or a whole one); a token file that
    others can read, that is not this user's, or that is too short to be secret is refused."""
    path = state_dir / "token"
    try:
        st = path.stat()
    except FileNotFoundError:
        return _write_token(path)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 or st.st_uid != os.getuid():
        raise StartupError(
            f"the token file {path} is readable by others or not this user's (mode {mode:04o}, uid {st.st_uid}); "
            f"run `chmod 600 {path}`, or delete it to make a new token"
        )
    token = path.read_text().strip()
    if len(token) < TOKEN_CHARS_MIN or any(c.isspace() for c in token):
        raise StartupError(
            f"the token file {path} holds no usable token (at least {TOKEN_CHARS_MIN} characters, no spaces); "
            "delete it and start again to make a new one"
        )
    return token


def made_up_token() -> str:
    """A new TCP token: 256 random bits, URL-safe, never starting with "-" (`--token -x…` is read as a flag with no
    value, and one token in 64 started so)."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def _write_token(path: Path) -> str:
    token = made_up_token()
    write_atomically(path, token)
    return token


def bind_unix(path: Path) -> tuple[socket.socket, int]:
    """A listening Unix socket at path, and its inode: the directory made 0700 before binding (and refused when it is
    not this user's or anyone may write it), the socket 0600 from birth. An existing socket is taken over only when
    no daemon answers on it; an existing path that is not a socket is never removed."""
    parent = path.parent
    parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # made 0700 before binding when it is ours to make
    st = parent.stat()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid():
        # Its owner could replace our socket with theirs: refuse, as OpenSSH refuses files owned by others.
        raise StartupError(
            f"the socket directory {parent} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
            "pass a --socket in a directory of your own (0700 is best)"
        )
    if mode & 0o002 and not mode & stat.S_ISVTX:
        # Anyone could replace the socket with their own: refuse, as git's credential-cache daemon does.
        raise StartupError(
            f"the socket directory {parent} is writable by anyone (mode {mode:04o}); "
            "pass a --socket in a directory of your own (0700 is best)"
        )
    if mode & 0o077:
        # The socket is 0600 and peers are checked by uid, so this is safe, but not what was asked for.
        log.warning("socket.directory_open", directory=str(parent), mode=f"{mode:04o}")
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISSOCK(existing.st_mode):
            raise StartupError(f"{path} exists and is not a socket; remove it yourself or pass another --socket")
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
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock, os.lstat(path).st_ino


def unlink_socket(path: Path, inode: int) -> None:
    """Remove the socket this daemon bound, unless someone has put something else there since."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
            path.unlink()


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a warning when it listens on every address, judged by the address it was bound to (so
    `0`, `0.0`, `[::0]` and any other spelling of it warn as `0.0.0.0` does)."""
    sock = listen_tcp(host, port, backlog=BACKLOG)
    bound = sock.getsockname()[0]
    if bound in ("0.0.0.0", "::"):
        log.warning(
            "tcp.exposed",
            address=f"{host}:{port}",
            bound=bound,
            note="the token crosses in clear text: listen on loopback and tunnel (ssh -L), or put TLS in front",
        )
    return sock


def listen_tcp(host: str, port: int, *, backlog: int) -> socket.socket:
    """A non-blocking socket listening on host:port (an IPv6 host has a colon in it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


class ActivatedListen(msgspec.Struct, frozen=True):
    """A listening socket systemd passed (LISTEN_FDS), with its LISTEN_FDNAMES name: already bound, and served as
    what its family makes it (`served`), Unix or TCP, with that kind's peer rule."""

    sock: socket.socket
    name: str

    @property
    def served(self) -> UnixListen | TcpListen:
        return bound_as(self.sock)

    def __str__(self) -> str:
        return f"{self.served} (activated: {self.name})"


Listen = UnixListen | TcpListen | ActivatedListen


def bound_as(sock: socket.socket) -> UnixListen | TcpListen:
    """What a listening socket is bound to, as its clients address it (a port 0 asked for is the port given)."""
    if sock.family == socket.AF_UNIX:
        return UnixListen(Path(os.fsdecode(sock.getsockname())))  # an abstract name (systemd's @name) is bytes
    host, port = sock.getsockname()[:2]
    return TcpListen(host, port)


class Listening(msgspec.Struct, frozen=True):
    """A listening socket and what it was bound as; `inode` is that of a Unix socket this daemon made, which
    `close` removes (unless someone has put something else there since)."""

    listen: Listen
    sock: socket.socket
    inode: int | None = None

    @property
    def served(self) -> UnixListen | TcpListen:
        """Where clients reach it (the port given for a port 0), and so its kind and peer rule."""
        return bound_as(self.sock)

    def close(self) -> None:
        self.sock.close()
        if self.inode is not None:
            assert isinstance(self.listen, UnixListen)
            unlink_socket(self.listen.path, self.inode)


def bind(where: Listen) -> Listening:
    """Listen where the daemon was asked to: bind a Unix socket or a TCP port, or take a socket systemd bound."""
    if isinstance(where, UnixListen):
        sock, inode = bind_unix(where.path)
        return Listening(where, sock, inode)
    if isinstance(where, TcpListen):
        return Listening(where, bind_tcp(where.host, where.port))
    return Listening(where, where.sock)


def origin(sock: socket.socket) -> str:
    """Where a connection comes from, as records name it beside the client's chosen name: `uid U, pid P` of a Unix
    peer (the kernel's credentials of the process that connected, which it cannot choose), `HOST:PORT` of a TCP one."""
    if sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        return f"uid {uid}, pid {pid}"
    try:
        host, port = sock.getpeername()[:2]
    except OSError:  # it closed before it was accepted: nothing it asks will be answered anyway
        return "gone"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def accepted(served: UnixListen | TcpListen, sock: socket.socket) -> int | None:
    """A connection accepted on sock, readied by its kind's peer rule: the uid of a Unix peer to be turned away
    (not this user, nor root, who can read the state directory anyway), else None. A TCP peer is judged by its
    token, later; its answers go out at once (no Nagle delay)."""
    if isinstance(served, TcpListen):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return None
    uid = peer_uid(sock)
    return None if uid in (os.getuid(), 0) else uid
