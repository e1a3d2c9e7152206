"""Who a command runs as: never root. Under a daemon run as root, Exec and Git run as an unprivileged user, and that
user is given write access to a root-owned workspace with a POSIX ACL; no file's owner is ever changed.

Why not root: uid 0 is more than capabilities. A command that is still uid 0 after `--cap-drop ALL` can write
`/proc/sys/kernel/core_pattern` (bubblewrap's fresh /proc leaves /proc/sys writable) and have the kernel run its
script as full root on the host; it can also connect to any root-owned socket on the file system. A user-namespace
mapping to 0 does not help: the kernel still sees the global root.

Who, under a root daemon (a non-root daemon's commands run as itself; nothing here applies):
- the workspace's owner, when that is not root: the command writes its workspace as its owner would, with the
  owner's primary group and no supplementary groups;
- else the profile's `run_as` (a user name or a uid; never root), by default `nobody`. `nobody` is on every system and
  is mapped in every user namespace; it owns nothing by convention. What it trades: every command of every profile
  that runs as `nobody` shares that uid with each other and with any service of the host that runs as `nobody` (what
  one may write, another may; and where a command has no pids cgroup of its own, the `processes_max` count, see
  `devd.agent.sandbox`); a host that runs such services should make a user of its own for devd (`useradd --system
  --no-create-home devd-run`) and name it in `run_as`.

Writing a root-owned workspace as `run_as`: the first time it is needed, the workspace's tree is given an ACL entry
for that user (`user:U:rwX`, and on directories the same as a default entry, so what is made there later is the
user's to write too), written directly as the kernel's `system.posix_acl_access` and `system.posix_acl_default`
extended attributes (no `acl` package needed). The workspace directory is done last, so its entry says the tree is
done. What it trades: the owners stay as they were, but `ls -l` shows a `+` and the group bits show the ACL mask
(`rw-rw-r--+`; the owning group's own entry is unchanged). Only root's own files are given the entry (another
user's file in the workspace stays theirs), and a file with more than one hard link is left alone (its other name
may be outside the workspace), as is whatever is mounted below the workspace (another file system, or a bind mount
of a directory from elsewhere: the mount table says which). A mask an ACL already has is never widened (it bounds
the named entries and the owning group: widening it for the user would give them more too), so on such a file the
user gets what that mask allows. A directory without a default ACL is given one that grants its group and others
nothing: any default ACL makes the kernel ignore the umask of whoever makes a file there, and one copied from the
directory's bits made root's `umask 077` secrets readable to every local user; so files made later in the
workspace are their owner's and the user's only (`chmod` shares one). A file made there later takes the default
entry as its mode allows: the Write tool makes files as open() does (0666), so they are the user's to write; one
another program makes 0644 is read-only to the user (who may still replace it, as it may write the directory).
A file system without ACLs (mounted `noacl`) is refused, saying so. An id-mapped mount would need no ACL, but
bubblewrap 0.8 cannot make one and the kernel's mount API for it is not reachable from here without a helper.

The workspace's parent directories are the host's, and the user may not be able to search one (a workspace under
/root, 0700, run as `nobody`). `veil` finds the highest such directory; under bubblewrap it is covered by an empty
tmpfs holding only the way to the workspace (the user could see nothing under it anyway), so the workspace is
reached by its path. Under `sandbox = "none"` nothing can be mounted: such a workspace is reached by relative paths
only (the command starts inside it); put it where its parents are searchable (/srv, /var/lib).
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import stat
import struct
from pathlib import Path

import msgspec

from devd.agent.profiles import Profile

ACCESS = "system.posix_acl_access"
DEFAULT = "system.posix_acl_default"
# The kernel's ACL format (include/uapi/linux/posix_acl_xattr.h): a version, then (tag, perm, id) entries sorted by
# tag and id, little-endian. The id of an entry that names nobody in particular is -1.
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF
_ENTRY = struct.Struct("<HHI")
_READ_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

Acl = dict[tuple[int, int], int]  # (tag, id) -> permission bits (4 read, 2 write, 1 execute/search)


class Account(msgspec.Struct, frozen=True):
    """The unprivileged user and group a command runs as (no supplementary groups)."""

    uid: int
    gid: int


class Unusable(Exception):
    """A command cannot run as it should here; `why` says why and what to do (it is what the model is told)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def account(profile: Profile, workspace_fd: int, workspace: str) -> Account | None:
    """Who a command of `profile` in the workspace (its checked descriptor, and its path for messages) runs as: None
    when the daemon is not root (as itself), else the workspace's owner when not root, else `run_as`, after giving
    it the workspace (see the module's docstring). Unusable when `run_as` names no user here, or the workspace's
    file system takes no ACL. Touches the file system: call it off the event loop."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(workspace_fd)
    if st.st_uid != 0:
        return Account(st.st_uid, _primary_gid(st.st_uid, st.st_gid))
    user = run_as(profile)
    grant(workspace_fd, workspace, user.uid)
    return user


def run_as(profile: Profile) -> Account:
    """The profile's `run_as` user; Unusable when it is not a user of this machine (a uid need not be), or is root."""
    name = profile.run_as
    if isinstance(name, int):
        user = Account(name, _primary_gid(name, name))
    else:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise Unusable(
                f"[agent.{profile.name}] sets run_as = {name!r}, and there is no such user on this machine; make it "
                f"(useradd --system --no-create-home {name}) or name another unprivileged user or a uid"
            ) from None
        user = Account(entry.pw_uid, entry.pw_gid)
    if user.uid == 0:
        raise Unusable(
            f"[agent.{profile.name}] sets run_as = {name!r}, which is uid 0 (root) here; commands never run as root: "
            "name an unprivileged user"
        )
    return user


def veil(workspace: Path, user: Account) -> Path | None:
    """The highest directory above the workspace (a real path) that `user` cannot search, or None."""
    for depth in range(2, len(workspace.parts)):
        directory = Path(*workspace.parts[:depth])
        try:
            st = os.stat(directory)
            acl = _read_path(directory)
        except OSError:
            return None  # gone or swapped meanwhile: the workspace's own check refuses the call
        if not _searchable(st, acl, user):
            return directory
    return None


def _searchable(st: os.stat_result, acl: Acl | None, user: Account) -> bool:
    """Whether `user` (with no supplementary group) may search the directory, as the kernel decides (acl(5))."""
    return _permits(st, acl, user, 1)


def readable(fd: int, user: Account) -> bool:
    """Whether `user` (with no supplementary group, as commands run) may read the file open at `fd`, by its mode and
    ACL, as the kernel decides (acl(5)); a file system without ACLs has only the mode."""
    try:
        acl = _read(fd, ACCESS)
    except OSError as e:
        if e.errno != errno.EOPNOTSUPP:
            raise
        acl = None
    return _permits(os.fstat(fd), acl, user, 4)


def _permits(st: os.stat_result, acl: Acl | None, user: Account, perm: int) -> bool:
    """Whether the file's mode and ACL give `user` (no supplementary group) `perm` (4 read, 1 execute/search)."""
    if st.st_uid == user.uid:
        return bool(st.st_mode >> 6 & perm)
    if acl is None:
        return bool(st.st_mode >> (3 if st.st_gid == user.gid else 0) & perm)
    mask = acl.get((_MASK, _NO_ID), 7)
    if (_USER, user.uid) in acl:
        return bool(acl[(_USER, user.uid)] & mask & perm)
    groups = [
        bits
        for (tag, ident), bits in acl.items()
        if (tag == _GROUP_OBJ and st.st_gid == user.gid) or (tag == _GROUP and ident == user.gid)
    ]
    if groups:
        return any(bits & mask & perm for bits in groups)
    return bool(acl.get((_OTHER, _NO_ID), 0) & perm)


def _primary_gid(uid: int, otherwise: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return otherwise


def grant(workspace_fd: int, workspace: str, uid: int) -> None:
    """Give `uid` read, write and search of root's own files in the workspace tree (rwX), and the same as a default
    entry on its directories; once: a workspace whose directory holds the entry is done."""
    top = os.open(".", _READ_DIR, dir_fd=workspace_fd)
    try:
        if _entry(_read(top, ACCESS), uid) == 7:
            return
        if os.statvfs(top).f_flag & os.ST_RDONLY:
            return  # nothing a command could write there, whoever it runs as
        try:
            _grant_tree(top, uid, _mounts_below(workspace))
            _grant(top, uid, directory=True)  # last: its entry says the whole tree is done
        except OSError as e:
            if e.errno == errno.EOPNOTSUPP:
                raise Unusable(
                    f"the workspace {workspace} is root's and its file system takes no ACLs, so a command running as "
                    f"uid {uid} could not write it; give the workspace to that user (or any other, then commands "
                    "run as its owner), or mount the file system with ACLs"
                ) from None
            raise Unusable(f"cannot give uid {uid} write access to the workspace {workspace}: {e.strerror or e}") from e
    finally:
        os.close(top)


def _grant_tree(top: int, uid: int, mounts: frozenset[str]) -> None:
    """Grant every directory and file below `top` (not `top` itself), depth first, holding a descriptor per level
    only; each reached without following a link, so a link swapped in meanwhile is never followed. What is mounted
    below it (`mounts`: paths relative to `top`; or on another device) is not the workspace's and is left alone."""
    device = os.fstat(top).st_dev
    stack = [(os.dup(top), "", _grant_files(top, "", uid, mounts, device))]
    try:
        while stack:
            fd, where, subdirectories = stack[-1]
            if not subdirectories:
                os.close(fd)
                stack.pop()
                continue
            name = subdirectories.pop()
            inside = f"{where}{name}"
            if inside in mounts:
                continue
            try:
                inner = os.open(name, _READ_DIR, dir_fd=fd)
            except OSError:
                continue  # gone or swapped meanwhile: nothing to grant
            try:
                st = os.fstat(inner)
                if st.st_uid == 0 and st.st_dev == device:
                    _grant_one(inner, uid, directory=True)
                    stack.append((inner, f"{inside}/", _grant_files(inner, f"{inside}/", uid, mounts, device)))
                    continue
            except BaseException:
                os.close(inner)
                raise
            os.close(inner)  # another user's directory (theirs, and all below it), or another file system's
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _grant_files(directory: int, where: str, uid: int, mounts: frozenset[str], device: int) -> list[str]:
    """Grant the root-owned regular files (and named pipes) of the directory (at `where` below the workspace) that
    have a single link and are the workspace's own (not mounted there, on its device); never a device node (a disk's
    node made in a workspace would be the whole disk's). The directory's subdirectories' names."""
    subdirectories = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirectories.append(entry.name)
            elif entry.is_file(follow_symlinks=False) or stat.S_ISFIFO(entry.stat(follow_symlinks=False).st_mode):
                if f"{where}{entry.name}" in mounts:
                    continue
                try:
                    fd = os.open(entry.name, _READ_FILE, dir_fd=directory)
                except OSError:
                    continue  # gone, or swapped for a link, meanwhile
                try:
                    st = os.fstat(fd)
                    kind_ok = stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)
                    if kind_ok and st.st_uid == 0 and st.st_nlink == 1 and st.st_dev == device:
                        _grant_one(fd, uid, directory=False)
                finally:
                    os.close(fd)
    return subdirectories


def _mounts_below(workspace: str) -> frozenset[str]:
    """The mount points below the workspace in the daemon's mount namespace, relative to it (a bind mount of another
    directory of the same file system has the same device: only the mount table tells). Only root mounts, so none
    appears or goes meanwhile that a command could have made."""
    top = os.path.realpath(workspace).rstrip("/") + "/"
    found = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            # Field 5 is the mount point, with space, tab, newline and backslash escaped as octal (\040).
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
            if point.startswith(top):
                found.add(point[len(top) :])
    return frozenset(found)


def _grant_one(fd: int, uid: int, *, directory: bool) -> None:
    """Grant one file below the workspace; one the kernel will not change (immutable, say) stays as it is, unwritable
    to the user as it would be anyway. A file system without ACLs fails the whole grant."""
    try:
        _grant(fd, uid, directory=directory)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            raise


def _grant(fd: int, uid: int, *, directory: bool) -> None:
    mode = os.fstat(fd).st_mode
    perm = 7 if directory or mode & 0o111 else 6
    os.setxattr(fd, ACCESS, _encode(_with_user(_read(fd, ACCESS), mode, uid, perm)))
    if directory:
        # Any default ACL makes the kernel ignore the umask of whoever later makes a file there: one made from the
        # directory's bits would make root's `umask 077; echo KEY > .env` world-readable. So a directory without one
        # gets a default that gives its group and others nothing (its owner's bits, and the user's rwx, only).
        os.setxattr(fd, DEFAULT, _encode(_with_user(_read(fd, DEFAULT), mode & 0o700, uid, 7)))


def _with_user(acl: Acl | None, mode: int, uid: int, perm: int) -> Acl:
    """acl (or the one the mode stands for, when there is none) with `uid` given `perm`. The mask is never widened
    where the ACL has one: it bounds the named entries and the owning group, which would gain what it gained (a
    file's mask r-- with group staff and users rw- made both writable). So the user gets `perm` as far as that mask
    allows (read, say), and nobody else gains anything. Without an ACL, the mask made is the owning group's bits and
    `perm`: it bounds no entry but the user's and the group's own, which it does not narrow."""
    entries = dict(acl) if acl else {}
    if not entries:
        entries = {(_USER_OBJ, _NO_ID): mode >> 6 & 7, (_GROUP_OBJ, _NO_ID): mode >> 3 & 7, (_OTHER, _NO_ID): mode & 7}
    entries[(_USER, uid)] = perm
    entries.setdefault((_MASK, _NO_ID), entries[(_GROUP_OBJ, _NO_ID)] | perm)
    return entries


def _read_path(directory: Path) -> Acl | None:
    try:
        return _decode(os.getxattr(directory, ACCESS))
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return None
        raise


def _read(fd: int, name: str) -> Acl | None:
    try:
        data = os.getxattr(fd, name)
    except OSError as e:
        if e.errno == errno.ENODATA:
            return None
        raise
    return _decode(data)


def _decode(data: bytes) -> Acl | None:
    (version,) = struct.unpack_from("<I", data)
    if version != _VERSION:
        return None
    return {(tag, ident): perm for tag, perm, ident in _ENTRY.iter_unpack(data[4:])}


def _entry(acl: Acl | None, uid: int) -> int | None:
    return None if acl is None else acl.get((_USER, uid))


def _encode(acl: Acl) -> bytes:
    entries = b"".join(_ENTRY.pack(tag, perm, ident) for (tag, ident), perm in sorted(acl.items()))
    return struct.pack("<I", _VERSION) + entries
