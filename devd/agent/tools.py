"""The tools, confined to a session's workspace: Read, Write, Exec and Git, and Browse.

Every tool answers a `Result` (text, failed); what goes wrong (a refused path, a missing file, a command that fails
or runs too long) is a failed Result that says so, never an exception. Cancellation is the one thing that is
raised: a cancelled command's process group is killed first.

The workspace is pinned: a `Workspace` carries the identity (device, inode) its directory had when the session was
made, and every Read, Write, Exec and Git first opens it from / one component at a time without following a link
and checks that identity. A workspace, or a directory above it, swapped for a link or for another directory since
(by another session's command, say) is refused, saying so, and nothing is done; every call then starts from that
checked descriptor, never from the path again.

Paths: relative to the workspace, resolved with every symlink (parents and the last component); one that leads
outside the workspace's real path is refused, and nothing outside is read or written. The file is then reached from
the workspace's descriptor one directory at a time without following links, so a directory swapped for a link in
between (by a command running at the same time) is refused too. A path in one of the daemon's own paths (its state
directory with the token and the database, its socket, its backups) is refused, whatever the workspace holds. Read
gives only what the workspace's commands could read themselves (a file linked in from outside that they cannot read
is refused), and of a directory, at most its first LISTING_READ_MAX entries are read. A write is atomic (a temporary
file in the same directory, created exclusively and without following links, fsynced, renamed over the target, the
directory fsynced), creating missing directories inside the workspace; what it makes in a user's directory is given
to that user by its descriptor, never by name.

Commands: the checked workspace as working directory (under bubblewrap, the checked directory is what is bound),
an environment of only PATH, HOME (the workspace), LANG and TERM, stdin from /dev/null, a process group of their own
(killed whole at the timeout, at cancellation, and when the command exits, so nothing it started outlives it), stdout
and stderr interleaved and capped: past `output_bytes_max` nothing more is read and the pipe is closed, so the
command's next write fails, as under `| head -c N`. Never as root: under a daemon run as root, as the user
`devd.agent.runas` picks (a command's environment then also tells Git to trust repositories it does not own), within
the profile's limits, under bubblewrap or, with `sandbox = "none"`, in a pid namespace of its own
(`devd.agent.sandbox`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import shutil
import signal
import stat
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import structlog

from devd.agent import addresses, cgroups, http, runas, seccomp
from devd.agent import sandbox as sandboxes
from devd.agent.profiles import Profile
from devd.agent.sandbox import Sandbox

log = structlog.get_logger("devd.agent")

ENV_PATH = "/usr/local/bin:/usr/bin:/bin"
DRAIN_AFTER_EXIT_S = 2.0  # how long output is still read once the command has exited and its group was killed
KILL_WAIT_S = 5.0


class Result(msgspec.Struct, frozen=True):
    """What the model is told (`text`), whether the call failed, and when its text holds output (a command's, a
    page's), `why` it failed as a description for the trace (`exit status 1`): the trace never holds output."""

    text: str
    failed: bool = False
    why: str | None = None


class Refused(Exception):
    """A path the tools will not touch; `why` says why (and is what the model is told)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# -- the workspace ------------------------------------------------------------------------------------------------

Identity = tuple[int, int]  # a directory's (st_dev, st_ino): which directory it is, wherever a path now leads


class Workspace(msgspec.Struct, frozen=True):
    """A session's workspace as its tools reach it: its real path, the identity of the directory that was there when
    the session was made, and the daemon's own paths (real paths), which Read and Write never touch."""

    path: Path
    identity: Identity
    private: tuple[Path, ...] = ()

    def open(self) -> int:
        """An O_PATH descriptor of the workspace, reached from / without following a link and checked to be the
        directory the session was made with; Refused otherwise. Every call starts from it, so a workspace (or a
        directory above it) swapped for a link or another directory since is never used."""
        try:
            fd = _reach(self.path)
        except Refused as e:
            raise Refused(_moved(self.path, e.why)) from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise Refused(_moved(self.path, "another directory is there now"))
        return fd


def pin(path: Path) -> Identity:
    """The identity of the directory at `path` (absolute, with no link in it) now, reached from / without following
    a link; Refused saying what is in the way."""
    fd = _reach(path)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def _pinned(workspace: Workspace | Path) -> Workspace:
    """A bare path is taken as the directory its real path names now (a caller that kept no identity)."""
    if isinstance(workspace, Workspace):
        return workspace
    real = Path(os.path.realpath(workspace))
    return Workspace(real, pin(real))


def _moved(path: Path, what: str) -> str:
    return (
        f"the workspace {path} was moved or replaced since the session was made ({what}); nothing was done: make a "
        "new session (session/new) with the workspace as it is now"
    )


_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # search permission is enough


def _reach(path: Path) -> int:
    """An O_PATH descriptor of the directory at the absolute `path`, opened from / one component at a time, each
    without following a link; Refused saying which component is in the way (a link, a file, nothing)."""
    fd = os.open("/", _PATH_DIR)
    try:
        for i, part in enumerate(path.parts[1:], start=2):
            try:
                inner = os.open(part, _PATH_DIR, dir_fd=fd)
            except OSError as e:
                raise Refused(_in_the_way(Path(*path.parts[:i]), part, fd, e)) from None
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def reach(path: Path) -> int:
    """An O_PATH descriptor of the directory at the absolute `path`, reached without following a link (see `_reach`);
    Refused saying what is in the way. The caller closes it."""
    return _reach(path)


def _in_the_way(where: Path, name: str, dir_fd: int, error: OSError) -> str:
    if error.errno == errno.ENOENT:
        return f"{where} does not exist"
    if error.errno == errno.ENOTDIR:  # O_NOFOLLOW with O_DIRECTORY: a link is "not a directory" too
        link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        return f"{where} is a symbolic link" if link else f"{where} is not a directory"
    return f"{where} cannot be opened: {error.strerror or error}"


# -- paths --------------------------------------------------------------------------------------------------------


def resolve(workspace: Path, path: str, *, for_write: bool) -> Path:
    """The real path `path` names inside the workspace (its real path, as recorded); Refused when it is absolute,
    climbs out, or leads outside through a symlink. For a write, a symlink as the last component is followed, and
    must stay inside too. A workspace whose own path now leads elsewhere leads every path outside."""
    if not path or "\x00" in path:
        raise Refused(f"{path!r} is not a usable path; give a path relative to the workspace")
    if os.path.isabs(path):
        raise Refused(f"{path} is absolute; give a path relative to the workspace")
    if os.path.normpath(path).split(os.sep)[0] == "..":
        raise Refused(f"{path} climbs out of the workspace; give a path inside it")
    real = Path(os.path.realpath(workspace / path))
    if real != workspace and not real.is_relative_to(workspace):
        raise Refused(f"{path} leads outside the workspace (to {real}) through a symbolic link")
    if for_write and real == workspace:
        raise Refused(f"{path} is the workspace itself, not a file in it")
    return real


def _reach_file(workspace: Workspace, path: str, *, for_write: bool) -> tuple[int, str]:
    """A descriptor of the directory the file `path` names is in, and its name there: reached from the checked
    workspace (see `Workspace.open`), never in one of the daemon's own paths."""
    root = workspace.open()
    try:
        real = resolve(workspace.path, path, for_write=for_write)
        for own in workspace.private:  # refused at session/new already; here whatever a workspace came to hold
            if real == own or real.is_relative_to(own):
                inside = "" if real == own else "inside "
                raise Refused(f"{path} is {inside}the daemon's own {own}, which no tool reads or writes; give another")
        return _walk(root, real.relative_to(workspace.path).parts, create=for_write)
    finally:
        os.close(root)


# -- Read and Write -----------------------------------------------------------------------------------------------


async def read_file(workspace: Workspace | Path, path: str, limit_bytes: int, *, profile: Profile) -> Result:
    """The file's text (invalid UTF-8 replaced), at most `limit_bytes` of it with a note saying what was cut; only
    what the user the profile's commands run as could read (see `_unreadable`)."""
    return await anyio.to_thread.run_sync(_read, workspace, path, limit_bytes, profile)


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk(workspace_fd: int, parts: Sequence[str], *, create: bool) -> tuple[int, str]:
    """A descriptor of the directory the last of `parts` is in, reached from the workspace's descriptor one directory
    at a time without following a link (made when `create`), and that last part (`.` for none). The parts come from
    a resolved path, which has no links, so a link met on the way was swapped in since: it is refused rather than
    followed out of the workspace."""
    fd = os.open(".", _DIR, dir_fd=workspace_fd)
    try:
        for part in parts[:-1]:
            made = False
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
                    made = True
            try:
                inner = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise Refused(f"{part} became a link while it was used; nothing was done") from None
                raise Refused(f"{part} is a file, not a directory; nothing was done") from None
            owner = _owner_of(fd) if made else None
            os.close(fd)
            fd = inner
            if owner is not None:
                _give(fd, part, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1] if parts else "."


def _read(workspace: Workspace | Path, path: str, limit_bytes: int, profile: Profile) -> Result:
    try:
        pinned = _pinned(workspace)
        dir_fd, name = _reach_file(pinned, path, for_write=False)
    except Refused as e:
        return Result(f"refused: {e.why}", failed=True)
    except FileNotFoundError:
        return Result(f"{path} does not exist", failed=True)
    except OSError as e:
        return Result(f"cannot read {path}: {e.strerror or e}", failed=True)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return Result(f"{path} does not exist", failed=True)
    except OSError as e:
        why = "it became a link while it was used" if e.errno == errno.ELOOP else e.strerror
        return Result(f"cannot read {path}: {why}", failed=True)
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    try:
        unreadable = _unreadable(pinned, profile, path, fd, st)
    except (Refused, runas.Unusable) as e:
        unreadable = f"cannot read {path}: {e.why}"
    if unreadable is not None:
        os.close(fd)
        return Result(unreadable, failed=True)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a directory with an exception
        try:
            if stat.S_ISDIR(st.st_mode):
                return Result(f"{path} is a directory; {_listing(fd)}", failed=True)
            return Result(f"{path} is not a regular file", failed=True)
        finally:
            os.close(fd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit_bytes + 1)
    if b"\x00" in data:
        return Result(f"{path} is a binary file ({st.st_size} bytes); it is not shown", failed=True)
    text = data[:limit_bytes].decode("utf-8", "replace")
    if len(data) > limit_bytes:
        text += f"\n[cut: {st.st_size - limit_bytes} more bytes of {path} were not read]"
    return Result(text)


def _unreadable(workspace: Workspace, profile: Profile, path: str, fd: int, st: os.stat_result) -> str | None:
    """Why Read refuses the file open at `fd` (what the model is told), or None. Read runs in the daemon, as root
    under a root daemon, and the model must not get from it what the workspace's commands could not read themselves:
    a command that hard-links /etc/shadow into the workspace (the kernel lets it where fs.protected_hardlinks is 0,
    its default), or moves a file it cannot read there, would have Read show it. So a file or directory that the
    commands' user (`devd.agent.runas`) neither owns nor may read by its mode and ACL is refused. Root's own files
    in root's workspace are not asked: those with a single link (and directories) are the user's to read by the
    grant made as its first command runs; a multi-link one, which the grant leaves alone, is asked like any other.
    Under a daemon that is not root, commands run as the daemon, and Read reads with their rights already."""
    if os.geteuid() != 0 or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return None
    root = workspace.open()
    try:
        owner = os.fstat(root).st_uid
        if owner == 0 and st.st_uid == 0 and (st.st_nlink == 1 or stat.S_ISDIR(st.st_mode)):
            return None
        # A workspace that is not root's runs its commands as its owner (runas.account gives nothing then).
        user = runas.account(profile, root, str(workspace.path)) if owner != 0 else runas.run_as(profile)
    finally:
        os.close(root)
    if user is None or st.st_uid == user.uid or runas.readable(fd, user):
        return None
    links = "one link" if st.st_nlink == 1 else f"{st.st_nlink} links"
    return (
        f"refused: {path} is uid {st.st_uid}'s (mode {stat.S_IMODE(st.st_mode):04o}, {links}), and uid {user.uid}, "
        "as whom this workspace's commands run, may not read it; Read shows only what those commands could read (a "
        f"hard link to a file outside the workspace reads nothing of it): make it readable to uid {user.uid} first "
        "if it should be read"
    )


LISTING_SHOWN = 50  # names a Read of a directory shows
LISTING_READ_MAX = 1000  # entries it reads at most: a directory of a million names took 5.9 s and 165 MiB to sort


def _listing(directory_fd: int) -> str:
    """What the directory holds: every name, sorted, when it has at most LISTING_SHOWN; else the first LISTING_SHOWN
    sorted and how many more, counted up to LISTING_READ_MAX entries; past that, the reading stops, and what is
    said is the first names read (in the directory's own order, sorted among themselves) of at least that many."""
    with os.scandir(directory_fd) as entries:
        read = [
            e.name + ("/" if e.is_dir(follow_symlinks=False) else "")
            for e in itertools.islice(entries, LISTING_READ_MAX + 1)
        ]
    if len(read) <= LISTING_SHOWN:
        return f"it holds: {', '.join(sorted(read)) or 'nothing'}"
    if len(read) <= LISTING_READ_MAX:
        return f"it holds: {', '.join(sorted(read)[:LISTING_SHOWN])} and {len(read) - LISTING_SHOWN} more"
    shown = ", ".join(sorted(read[:LISTING_SHOWN]))
    return (
        f"it holds more than {LISTING_READ_MAX} entries, too many to read here; the first {LISTING_SHOWN} entries "
        f"read, of at least {LISTING_READ_MAX + 1}: {shown}; list it with a command (Exec) to see more"
    )


async def write_file(workspace: Workspace | Path, path: str, text: str) -> Result:
    """Replace (or create) the file with `text`, atomically; missing directories inside the workspace are made."""
    return await anyio.to_thread.run_sync(_write, workspace, path, text)


def _write(workspace: Workspace | Path, path: str, text: str) -> Result:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        return Result(f"the text for {path} is not valid Unicode ({e.reason} at {e.start}); nothing was written", True)
    try:
        dir_fd, name = _reach_file(_pinned(workspace), path, for_write=True)
        try:
            _replace(dir_fd, name, data)
        finally:
            os.close(dir_fd)
    except Refused as e:
        return Result(f"refused: {e.why}", failed=True)
    except OSError as e:
        return Result(f"cannot write {path}: {e.strerror or e}; the file is as it was", failed=True)
    return Result(f"wrote {len(data)} bytes to {path}")


def _replace(dir_fd: int, name: str, data: bytes) -> None:
    """Write `name` in the directory whole or not at all: a temporary file, fsynced, renamed over it. A new file is
    made as open() makes one (0666, less the umask, or as a default ACL says), and belongs to whoever `_owner_of`
    says; one replaced keeps its permission bits and its owner, never set-user-ID, set-group-ID or sticky: the file
    replaced may be a hard link to a set-user-ID program of root's (/usr/bin/passwd) that a command made, and root
    writing it would keep the bit (writing clears it only for a writer without CAP_FSETID), leaving a set-user-ID
    root program of the model's text in the workspace."""
    mode, owner = 0o666, _owner_of(dir_fd)
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            raise Refused(f"{name} is a directory; a file cannot replace it")
        mode = stat.S_IMODE(st.st_mode) & 0o777
        owner = (st.st_uid, st.st_gid) if os.geteuid() == 0 and st.st_uid != 0 else None
    temp = f".{name}.devd-{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def _owner_of(dir_fd: int) -> tuple[int, int] | None:
    """Whom a file or directory the daemon makes in the directory is given to: under a daemon run as root, the
    directory's owner when that is not root, as that user's commands run as that user (`devd.agent.runas`) and must
    be able to use what the daemon wrote for them; else nobody (it stays as made)."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(dir_fd)
    return None if st.st_uid == 0 else (st.st_uid, st.st_gid)


def _give(made_fd: int, name: str, owner: tuple[int, int]) -> None:
    """Give the directory just made (`made_fd`, opened without following a link) to `owner`, by its descriptor: never
    by name, as the directory it is in is the owner's, who could swap the name for a hard link to any file between
    the mkdir and a chown by name (and would own /etc/passwd). What the descriptor holds is checked to be the
    directory made: the daemon's, empty (a directory the owner moved there instead stays as it is, refused)."""
    st = os.fstat(made_fd)
    with os.scandir(made_fd) as entries:
        empty = next(entries, None) is None
    if st.st_uid != os.geteuid() or st.st_nlink != 2 or not empty:
        raise Refused(f"{name} was replaced while it was made; nothing was done")
    os.fchown(made_fd, *owner)


# -- what a Write replaces, and putting it back (devd.agent.effects) ----------------------------------------------


class Found(msgspec.Struct, frozen=True):
    """A file a Write names, as it is now: `target`, its path relative to the workspace with every link resolved
    (what a write there replaces, and what a rewind puts back); `data`, its bytes (None: there is no file there, or
    it is larger than the limit it was read with); `size` in bytes (0 when there is none)."""

    target: str
    existed: bool
    size: int = 0
    data: bytes | None = None


def find(workspace: Workspace | Path, path: str, limit_bytes: int) -> Found:
    """The file at `path` as it is now, its bytes read when at most `limit_bytes`; Refused when the path is refused
    as a Write would refuse it, or names something that is not a regular file (a directory, a device). Reached as
    Read and Write reach files: from the checked workspace, without following a link out of it."""
    pinned = _pinned(workspace)
    target = str(resolve(pinned.path, path, for_write=True).relative_to(pinned.path))
    try:
        dir_fd, name = _reach_file(pinned, path, for_write=False)
    except FileNotFoundError:
        return Found(target, False)
    except NotADirectoryError:
        raise Refused(f"a directory on the way to {path} is a file") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return Found(target, False)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is not a regular file")
        if st.st_size > limit_bytes:
            return Found(target, True, st.st_size)
        data = f.read(limit_bytes + 1)
    return Found(target, True, len(data), data if len(data) <= limit_bytes else None)


def fingerprint(workspace: Workspace, target: str) -> str | None:
    """The hex SHA-256 of the file at `target` now (read whole, a block at a time), None when there is none;
    Refused when something else is there (a directory, a link: reached as `put_back` reaches it)."""
    root = workspace.open()
    try:
        dir_fd, name = _walk(root, _parts(target), create=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(root)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = "a link is there now" if e.errno == errno.ELOOP else e.strerror or str(e)
        raise Refused(f"{target} cannot be read: {why}") from None
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Refused(f"{target} is not a regular file now")
        return hashlib.file_digest(f, "sha256").hexdigest()


def _parts(target: str) -> tuple[str, ...]:
    """A recorded target's parts; Refused for one that could lead out of the workspace."""
    parts = Path(target).parts
    if not parts or os.path.isabs(target) or ".." in parts:
        raise Refused(f"{target!r} is not a path inside the workspace")
    return parts


def put_back(workspace: Workspace, target: str, data: bytes | None) -> None:
    """Make the file at `target` (relative to the workspace, its links resolved when it was recorded) hold `data`
    again, atomically as a Write does, or remove it (None). Reached from the checked workspace one directory at a time
    without following a link, and the last name is never followed either: a link put there since is replaced or
    removed itself, never what it points to. Refused or OSError when that cannot be done."""
    parts = _parts(target)
    real = workspace.path / target
    for own in workspace.private:
        if real == own or real.is_relative_to(own):
            raise Refused(f"{target} is in the daemon's own {own}, which no tool writes")
    root = workspace.open()
    try:
        dir_fd, name = _walk(root, parts, create=data is not None)
    except FileNotFoundError:
        if data is None:
            return  # its directory is gone: so is the file
        raise
    finally:
        os.close(root)
    try:
        if data is not None:
            _replace(dir_fd, name, data)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- Exec and Git -------------------------------------------------------------------------------------------------


def command_env(workspace: Path, *, guest: bool = False) -> dict[str, str]:
    """The whole environment a command gets: nothing of the daemon's (no API key can leak into it). A `guest` (a
    command that runs as `run_as` in root's workspace) is also told to trust repositories that are not its own:
    Git refuses them otherwise ("dubious ownership"), and that check guards a user against another's repository
    hooks, which a command that runs what it likes does not need (git reads this as command-line configuration)."""
    env = {"PATH": ENV_PATH, "HOME": str(workspace), "LANG": "C.UTF-8", "TERM": "dumb"}
    if guest:
        env |= {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}
    return env


async def run_command(
    argv: Sequence[str], *, workspace: Workspace | Path, profile: Profile, sandbox: Sandbox | None
) -> Result:
    """Run argv in the workspace (under `sandbox` when given) as the profile allows: its timeout, its output cap, its
    limits (in cgroups of its own where the daemon can make them: `devd.agent.cgroups`, removed when it is done).
    Git is `run_command(["git", *argv], ...)`. Cancelled: the process group is killed, then the cancel is raised."""
    if not argv:
        return Result("there is no command to run (argv is empty)", failed=True)
    made: list[cgroups.Group] = []  # the command's groups, put here as soon as they are made (by `_prepare`)
    try:
        return await _run(argv, workspace, profile, sandbox, made)
    finally:
        for group in made:
            with anyio.CancelScope(shield=True):  # a cancelled command's groups go too
                left = await anyio.to_thread.run_sync(group.remove)
            if left is not None:
                log.warning("agent.cgroup_left", why=left)


class _Unmade(Exception):
    """The command's cgroups could not be made (`error`, the kernel's refusal)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _prepare(
    profile: Profile, workspace_fd: int, workspace: Path, sandbox: Sandbox | None, made: list[cgroups.Group]
) -> tuple[cgroups.Group | None, runas.Account | None, bool, Path | None]:
    """The command's cgroups, where the daemon can make them (added to `made` as soon as they are, so that they are
    removed however the call ends), and its confinement (`confinement`): in one trip to a worker thread, as a thread's
    wake-up costs about as much as either (0.4 ms). _Unmade when the groups cannot be made."""
    where = cgroups.place()
    group = None
    if not isinstance(where, str):
        try:
            group = cgroups.make(where, profile.memory_bytes_max, profile.processes_max)
        except OSError as e:
            raise _Unmade(e) from None
        made.append(group)
    return (group, *confinement(profile, workspace_fd, workspace, sandbox, group))


async def _run(
    argv: Sequence[str],
    workspace: Workspace | Path,
    profile: Profile,
    sandbox: Sandbox | None,
    made: list[cgroups.Group],
) -> Result:
    try:
        pinned = _pinned(workspace)
        root = pinned.open()
    except Refused as e:
        return Result(f"refused: {e.why}", failed=True)
    filter_fd: int | None = None
    try:
        if "/" not in argv[0] and shutil.which(argv[0], path=ENV_PATH) is None:
            return Result(f"{argv[0]}: command not found (PATH is {ENV_PATH})", failed=True)
        try:
            group, who, alone, veil = await anyio.to_thread.run_sync(
                _prepare, profile, root, pinned.path, sandbox, made
            )
        except _Unmade as e:
            why = (
                f"its cgroup cannot be made ({e.error.strerror or e.error}); try again; if it persists, the daemon's "
                "cgroup (its `agent.cgroups` log line names it) is full or no longer writable"
            )
            return Result(f"cannot run {argv[0]}: {why}", failed=True)
        except runas.Unusable as e:
            return Result(f"cannot run {argv[0]}: {e.why}", failed=True)
        env = command_env(pinned.path, guest=who is not None and who.uid != os.fstat(root).st_uid)
        bounds = sandboxes.limits(profile)
        if sandbox is not None and sandbox.seccomp is not None:
            filter_fd = seccomp.descriptor(sandbox.seccomp)
        passed: tuple[int, ...] = ()
        if sandbox is None:
            command = sandboxes.contain(argv, account=who, limits=bounds, user_namespace=alone, group=group)
        else:
            # bubblewrap binds the directory checked (by its descriptor), never the path, which may lead elsewhere.
            command = sandbox.wrap(
                argv,
                pinned.path,
                profile.network,
                env,
                workspace_fd=root,
                account=who,
                limits=bounds,
                user_namespace=alone,
                veil=veil,
                seccomp_fd=filter_fd,
                group=group,
            )
            passed = (root,) if filter_fd is None else (root, filter_fd)
        try:
            # Shielded: cancelled half way, asyncio would kill the command but not what it already started; once it
            # is started, a cancel lands in the supervision below, which kills the whole group.
            with anyio.CancelScope(shield=True):
                process, output_fd = await _start(command, root, env, passed)
        except FileNotFoundError:
            return Result(f"{argv[0]}: command not found (PATH is {ENV_PATH})", failed=True)
        except OSError as e:
            return Result(f"{argv[0]}: cannot start: {e.strerror or e}", failed=True)
    finally:
        os.close(root)  # the command has its own (bwrap closes it once bound: the command never holds it)
        if filter_fd is not None:
            os.close(filter_fd)  # bwrap's own copy, which it reads to the end
    output = _Capped(profile.output_bytes_max, output_fd)
    try:
        timed_out = await _supervise(process, output, profile.exec_timeout_s)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _kill(process)
        raise
    return _outcome(process, output, timed_out, profile, group is not None and group.out_of_memory())


def confinement(
    profile: Profile, workspace_fd: int, workspace: Path, sandbox: Sandbox | None, group: cgroups.Group | None
) -> tuple[runas.Account | None, bool, Path | None]:
    """Who the command runs as (`runas.account`), whether in a user namespace of its own (`own_user_namespace` in
    devd.agent.sandbox says when), and the directory above the workspace it cannot search (`runas.veil`). Touches
    the file system and may probe once: off the event loop."""
    who = runas.account(profile, workspace_fd, str(workspace))
    if who is None:
        return None, False, None
    return who, sandboxes.own_user_namespace(sandbox, group), runas.veil(workspace, who)


async def _start(
    command: list[str], workspace_fd: int, env: dict[str, str], pass_fds: Sequence[int]
) -> tuple[Command, int]:
    """The started command, and the read end (non-blocking) of the pipe its stdout and stderr share: the daemon's own
    pipe, which it can close when it has read enough.

    Started by `subprocess.Popen`, which uses vfork here (no preexec_fn, no user or group to set: what the command
    runs as is set by the programs of its command line): the child shares the daemon's memory until it execs, so
    starting it takes well under a millisecond whatever the daemon's size, where the event loop's spawn (a fork, which
    copies the daemon's page tables) took 3 ms on a small daemon and 12-17 ms on one of 200 MB. Every descriptor but
    the three and `pass_fds` is closed in the child (close_fds). It starts with every signal at its default
    (`_reset_signals`)."""
    read, write = os.pipe()
    try:
        popen = subprocess.Popen(
            [*_reset_signals(), *command],
            stdin=subprocess.DEVNULL,
            stdout=write,
            stderr=subprocess.STDOUT,  # interleaved as written
            cwd=f"/proc/self/fd/{workspace_fd}",  # the checked directory: the child changes to it before it execs
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)  # the command holds its own
    os.set_blocking(read, False)
    return Command(popen), read


# What subprocess.Popen itself puts back to SIG_DFL in the child (restore_signals): Python ignores SIGPIPE and
# SIGXFSZ for its own sake.
_RESTORED_BY_POPEN = (1 << (signal.SIGPIPE - 1)) | (1 << (signal.SIGXFSZ - 1))
# Signals 32 and 33, glibc's own (thread cancellation, set*id across threads): no program can change them through
# glibc, `env --default-signal` included, and uvloop's spawn reset only 1 to 31. Seen ignored in a test worker of a
# full suite run, from none of its code: not a reason to put `env` before every command.
GLIBC_RESERVED = (1 << 31) | (1 << 32)


def _reset_signals() -> list[str]:
    """The program put first on a command line so that the command starts with every signal at its default: what
    the daemon ignores (SIG_IGN) an exec keeps, and Popen puts back only SIGPIPE and SIGXFSZ, where the event loop's
    spawn reset them all. A daemon started under nohup (SIGHUP) or by a script's `&` (SIGINT, SIGQUIT) would give its
    commands signals they could not be stopped by, nor a shell among them trap (POSIX forbids it). A preexec_fn
    would do it in the child but costs vfork (Popen forks then); coreutils' `env --default-signal` costs an exec, so
    it is put only where the daemon ignores such a signal, as the kernel says now (SigIgn, a mask of signal n at bit
    n - 1): nothing in the common case."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"SigIgn:"):
                if int(line.split()[1], 16) & ~(_RESTORED_BY_POPEN | GLIBC_RESERVED):
                    return [shutil.which("env", path=ENV_PATH) or "env", "--default-signal", "--"]
                break
    return []


class Command:
    """A started command: its pid (its process group's too) and, once it has exited, its exit status (negative: the
    signal that killed it), as `subprocess.Popen` gives it. Its exit is waited for on a pidfd, which the kernel
    makes readable when it exits: no SIGCHLD handler or thread involved, and only this object reaps it. Where the
    kernel has no pidfd (before Linux 5.3), its exit is polled for instead (`POLL_S`).

    Exited is not reaped: until it is reaped, a zombie keeps its pid, and so its process group's id, from being given
    to another process; its group is killed by that id (`_killpg`) only before (see `exited`)."""

    POLL_S = (0.001, 0.05)  # the first and the longest pause between polls, where there is no pidfd

    def __init__(self, popen: subprocess.Popen[bytes], *, pidfd: bool = True) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._pidfd: int | None = None
        if pidfd:
            with contextlib.suppress(OSError):  # ENOSYS before Linux 5.3: polled then (a zombie has one too)
                self._pidfd = os.pidfd_open(popen.pid)

    @property
    def returncode(self) -> int | None:
        """Its exit status once reaped; None before."""
        return self._popen.returncode

    async def exited(self) -> None:
        """Wait until it has exited, without reaping it (a zombie, its pid still its own)."""
        pause = self.POLL_S[0]
        while self._popen.returncode is None:
            if self._pidfd is not None:
                await anyio.wait_readable(self._pidfd)  # readable once the whole process has exited
                return
            try:
                if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return
            except ChildProcessError:
                return  # reaped already (not by this object): Popen then takes its status as 0
            await anyio.sleep(pause)
            pause = min(pause * 2, self.POLL_S[1])

    async def wait(self) -> int:
        """Its exit status, once it has exited (and is reaped)."""
        while True:
            await self.exited()
            if (code := self.release()) is not None:
                return code

    async def aclose(self) -> None:
        """Wait for it to exit (it was killed, or has exited), reap it and let go of its pidfd."""
        try:
            await self.wait()
        finally:
            self.release()

    def release(self) -> int | None:
        """Reap it if it has exited (its status; else None, and `subprocess` reaps it later); let go of its pidfd."""
        code = self._popen.poll()
        if self._pidfd is not None and code is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code

    def close(self) -> None:
        """Let go of its pidfd, exited or not (a command SIGKILL has not ended yet: `subprocess` reaps it later)."""
        self.release()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class _Capped:
    """The first `limit` bytes of a command's output, read from `fd` (which it owns), and whether there was more: past
    the cap nothing more is read (it once was, and thrown away on the event loop: gigabytes a second, a whole core),
    and the pipe is closed, so the command's next write fails (EPIPE, or SIGPIPE), as under `| head -c N`."""

    def __init__(self, limit: int, fd: int) -> None:
        self.limit = limit
        self.fd: int | None = fd
        self.kept = bytearray()
        self.cut = False

    async def read_all(self) -> None:
        """Read until the end of the output or the cap; either way, close the pipe."""
        try:
            while self.fd is not None:
                await anyio.wait_readable(self.fd)
                try:
                    # Never more than one byte past the cap: that byte says there was more.
                    chunk = os.read(self.fd, min(65536, self.limit + 1 - len(self.kept)))
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                self.kept += chunk
                if len(self.kept) > self.limit:
                    del self.kept[self.limit :]
                    self.cut = True
                    break
        finally:
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


async def _supervise(process: Command, output: _Capped, timeout_s: float) -> bool:
    """Read the output until the command exits or its time is up (past the cap, no more: see _Capped); then kill its
    group. True when it timed out."""
    eof = anyio.Event()

    async def read_all() -> None:
        try:
            await output.read_all()
        finally:
            eof.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all)
            with anyio.move_on_after(timeout_s) as deadline:
                await process.exited()
            # Whatever of its group is still alive goes now: at the timeout, the command too; after it exited, what
            # it left behind (which would hold the output pipe open). Not reaped yet, it keeps its group's id its own.
            _killpg(process)
            with anyio.move_on_after(DRAIN_AFTER_EXIT_S):
                await process.exited()
                await eof.wait()
            tg.cancel_scope.cancel()
    finally:
        output.close()  # when read_all never ran: cancelled before it started
    await process.aclose()
    return deadline.cancelled_caught


def _killpg(process: Command) -> None:
    if process.returncode is not None:
        return  # reaped: its pid, and its group's id with it, may be another process's now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def _kill(process: Command) -> None:
    """Kill the command's group and wait (up to KILL_WAIT_S) until none of it runs: a cancel is answered "its
    process group was killed", which must be so when it is said. SIGKILL is not instant, and what the command started
    dies apart from it. The command is reaped only then: until it is, its group's id stays its own."""
    try:
        _killpg(process)
        with anyio.move_on_after(KILL_WAIT_S):
            await process.exited()
            while _group_running(process.pid):
                await anyio.sleep(0.005)
    finally:
        process.close()


def _group_running(pgid: int) -> bool:
    """Whether a process of group pgid runs still (a zombie does not: it waits for its parent or init to reap it,
    which a container's init may never do, so `killpg(pgid, 0)` would wait on it for ever)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _outcome(process: Command, output: _Capped, timed_out: bool, profile: Profile, out_of_memory: bool) -> Result:
    text = output.kept.decode("utf-8", "replace")
    notes = []
    if output.cut:
        notes.append(
            f"[output cut at {output.limit} bytes (output_bytes_max): the rest was not read, and the output was "
            f"closed there, as `| head -c {output.limit}` would]"
        )
    code = process.returncode
    why = None
    if timed_out:
        why = f"timed out after {profile.exec_timeout_s:g} s"
        notes.append(f"[{why}; the command and all it started were killed]")
    elif out_of_memory:
        # Its largest process was killed (SIGKILL): the command itself, or one it started (its exit status then says
        # so, 137 from a shell, or nothing when the command went on without it), or bubblewrap once what holds the
        # memory is a file in its tmpfs, which only the end of the sandbox frees.
        over = (
            "the kernel killed a process of the command, whose processes together used more than memory_bytes_max "
            f"({profile.memory_bytes_max} bytes, shared memory and files in /tmp and /dev/shm included)"
        )
        if code:
            ended = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            why = f"out of memory (memory_bytes_max, {profile.memory_bytes_max} bytes)"
            notes.append(f"[{ended}: {over}]")
        else:
            notes.append(f"[exit status 0, but {over}]")
    elif code is not None and code < 0:
        why = f"killed by signal {signal.Signals(-code).name}"
        notes.append(f"[{why}]")
    elif code:
        why = f"exit status {code}"
        notes.append(f"[{why}]")
    if notes:
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(notes)
    return Result(text, failed=why is not None, why=why)


# -- Browse -------------------------------------------------------------------------------------------------------


BROWSE_REDIRECTS_MAX = 5  # a page that moved is found in one or two; a longer chain is a loop or a detour
BROWSE_DEADLINE_S = 60.0  # a whole Browse call: every lookup, connection, redirect and read
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


async def browse(
    url: str,
    profile: Profile,
    *,
    policy: addresses.Policy | None = None,
    resolve: addresses.Resolver = addresses.resolve,
) -> Result:
    """GET the page and give its text (as sent: HTML stays HTML), capped at the profile's output_bytes_max with a
    note. Browse runs in the daemon, not in the sandbox, so `network` does not apply to it: it reaches public
    addresses only, at the URL and at every redirect, unless the profile has `browse_private = true` (`policy`, when
    given, decides instead). A name is resolved once (by `resolve`), and the address checked is the one connected
    to. At most BROWSE_REDIRECTS_MAX redirects are followed, all within BROWSE_DEADLINE_S, on connections of the
    call's own (never the model's, never kept)."""
    if (why := http.valid_url(url)) is not None:
        return Result(f"cannot fetch {url!r}: {why}", failed=True)
    allowed = policy or (addresses.anywhere if profile.browse_private else addresses.public_only)
    try:
        with anyio.fail_after(BROWSE_DEADLINE_S):
            async with http.new_client(read_timeout_s=30.0) as client:
                return await _browse(client, url, profile, allowed, resolve)
    except TimeoutError:
        why = f"no answer within {BROWSE_DEADLINE_S:g} s (its lookups, connections, redirects and reads in all)"
        return Result(f"cannot fetch {url}: {why}; try again later, or another address", failed=True)


async def _browse(
    client: http.Client, url: str, profile: Profile, policy: addresses.Policy, resolve: addresses.Resolver
) -> Result:
    here, came_from, redirects = url, "", 0
    while True:
        what = f"fetch {here}" if not came_from else f"follow the redirect from {came_from} to {here}"
        host, port = http.host_port(here)
        try:
            reachable = await anyio.to_thread.run_sync(
                addresses.check, host, port, resolve, policy, abandon_on_cancel=True
            )
        except addresses.Unreachable as e:
            if not e.private:
                return Result(f"cannot {what}: {e.why}", failed=True)
            allow = f"browse_private = true in [agent.{profile.name}]"
            why = f"Browse reaches only public addresses unless the agent's profile allows private ones ({allow})"
            return Result(f"refused to {what}: {e.why}; {why}", failed=True)
        try:
            async with http.get(client, here, [str(address) for address in reachable]) as response:
                location = response.headers.get("location") if response.status in _REDIRECTS else None
                if location is None:
                    data, cut = await response.read(profile.output_bytes_max)
                    kind = response.headers.get("content-type", "")
                    return _page(here, response.status, kind, data, cut, profile.output_bytes_max)
        except http.TransportError as e:
            return Result(f"cannot {what}: {e.why}", failed=True)
        following = http.join(here, location)
        if following is None or (unusable := http.valid_url(following)) is not None:
            reason = "it is not a URL" if following is None else unusable
            return Result(f"refused to follow the redirect from {here} to {location!r}: {reason}", failed=True)
        if redirects == BROWSE_REDIRECTS_MAX:
            return Result(
                f"cannot fetch {url}: it redirects more than {BROWSE_REDIRECTS_MAX} times (the next, from {here}, "
                f"to {following}); Browse follows at most {BROWSE_REDIRECTS_MAX}: browse {following} itself if it "
                "is the page you want",
                failed=True,
            )
        here, came_from, redirects = following, here, redirects + 1


def _page(url: str, status: int, kind: str, data: bytes, cut: int, limit_bytes: int) -> Result:
    if kind and not _textual(kind):
        return Result(f"{url} is {kind.split(';')[0]}, not text; it is not shown", failed=True)
    charset = kind.partition("charset=")[2].split(";")[0].strip() or "utf-8"
    try:
        text = data.decode(charset, "replace")
    except LookupError:
        text = data.decode("utf-8", "replace")
    if cut:
        text += f"\n[cut: the page is longer than {limit_bytes} bytes; the rest was not read]"
    if status >= 400:
        return Result(f"GET {url}: HTTP {status}\n{text}", failed=True, why=f"HTTP {status}")
    return Result(text)


def _textual(content_type: str) -> bool:
    kind = content_type.split(";")[0].strip().lower()
    return kind.startswith("text/") or kind.endswith(("json", "xml", "javascript")) or "+xml" in kind or "+json" in kind
