"""Project instructions: the files a profile's `instructions` names (default `AGENTS.md`), read for every model call
and sent to the model as a system message after the profile's own system prompt, before the conversation.

What it promises:
- The files are looked for in the session's workspace and in each directory above it up to and including the
  workspace root (of the profile's `workspace_roots`) that holds it, outermost first (a root's AGENTS.md before the
  project's); nothing above that root is read. In each directory, the names in the order the profile gives them.
- They are read at each ask, so an edit is seen at the next model call, and never through a link: each directory is
  reached from / one component at a time without following one, and a file that is a symbolic link, is not a
  regular file, has more than one link (a hard link to a file elsewhere, which a command may make), is larger than
  FILE_BYTES_MAX, is not UTF-8 or cannot be read is skipped, saying why (`Found.skipped`); a missing file is skipped
  silently. Together they are cut at TOTAL_BYTES_MAX: the files past it are skipped, saying so.
- The message names each file by its path relative to the root, so the model knows which directory it is about.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread
import msgspec

from devd.agent import records, tools
from devd.agent.profiles import Profile
from devd.protocol import SkippedFile

if TYPE_CHECKING:
    from devd.agent.runner import Runtime

FILE_BYTES_MAX = 64 * 1024  # a larger instruction file is skipped
TOTAL_BYTES_MAX = 256 * 1024  # of all of them together; the files past it are skipped


class Used(msgspec.Struct, frozen=True):
    """An instruction file sent: its absolute path, its path relative to the workspace root, and its text."""

    path: str
    shown: str
    text: str


class Found(msgspec.Struct, frozen=True):
    """The instruction files for one model call: those sent, and those skipped with why."""

    used: list[Used]
    skipped: list[SkippedFile]

    def message(self) -> str | None:
        """The system message the files make, None when there is none."""
        if not self.used:
            return None
        parts = [f"Project instructions from {u.shown}:\n\n{u.text.rstrip()}" for u in self.used]
        return "\n\n".join(parts)


def root_of(profile: Profile, workspace: Path) -> Path:
    """The profile's workspace root that holds the workspace (the deepest, when roots nest); the workspace itself when
    none does (the agents file changed since the session was made)."""
    roots = [Path(os.path.realpath(r)) for r in profile.workspace_roots]  # as the workspace is recorded: real
    holding = [r for r in roots if workspace == r or workspace.is_relative_to(r)]
    return max(holding, key=lambda p: len(p.parts)) if holding else workspace


def directories(root: Path, workspace: Path) -> list[Path]:
    """The root, each directory between, and the workspace: outermost first."""
    parts = workspace.relative_to(root).parts
    return [root.joinpath(*parts[:i]) for i in range(len(parts) + 1)]


def find(profile: Profile, workspace: Path) -> Found:
    """The instruction files for a model call of a session in `workspace` (blocking: run on a worker thread)."""
    root = root_of(profile, workspace)
    used: list[Used] = []
    skipped: list[SkippedFile] = []
    total = 0
    for directory in directories(root, workspace):
        try:
            dir_fd = tools.reach(directory)
        except tools.Refused as e:
            skipped += [SkippedFile(str(directory / name), e.why) for name in profile.instructions]
            continue
        try:
            for name in profile.instructions:
                path = directory / name
                text = _read(dir_fd, name)
                if text is None:
                    continue
                if isinstance(text, SkippedFile):
                    skipped.append(SkippedFile(str(path), text.why))
                elif total + len(text.encode()) > TOTAL_BYTES_MAX:
                    why = f"the instruction files before it fill the {TOTAL_BYTES_MAX} bytes sent of them"
                    skipped.append(SkippedFile(str(path), why))
                else:
                    total += len(text.encode())
                    used.append(Used(str(path), str(path.relative_to(root.parent)), text))
        finally:
            os.close(dir_fd)
    return Found(used, skipped)


def _read(dir_fd: int, name: str) -> str | SkippedFile | None:
    """The file's text; None when there is none; a SkippedFile (its `why`) when it is there and not to be sent."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = "it is a symbolic link, which is not followed" if e.errno == errno.ELOOP else e.strerror or str(e)
        return SkippedFile(name, f"not read: {why}")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return SkippedFile(name, "not read: it is not a regular file")
        if st.st_nlink > 1:
            return SkippedFile(name, f"not read: it has {st.st_nlink} links, so it may be a file from elsewhere")
        if st.st_size > FILE_BYTES_MAX:
            return SkippedFile(name, f"not read: it has {st.st_size} bytes, more than the {FILE_BYTES_MAX} sent")
        try:
            data = f.read(FILE_BYTES_MAX + 1)
        except OSError as e:
            return SkippedFile(name, f"not read: {e.strerror or e}")
    if len(data) > FILE_BYTES_MAX:
        return SkippedFile(name, f"not read: it has more than the {FILE_BYTES_MAX} bytes sent")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return SkippedFile(name, "not read: it is not UTF-8 text")


async def used_by(runtime: Runtime, session: str) -> list[str] | None:
    """The instruction files the session's next model call sends (absolute paths); None for a session the daemon
    does not drive, or whose profile is gone."""
    # From the record log, not through the runtime's cache, which keeps no session of no agent (there may be a million,
    # and `session/info` may be asked of each).
    bound = await runtime.sessions.records(session, (records.AGENT,))
    binding = records.decode(bound[-1].body, records.Binding) if bound else None
    profile = None if binding is None else runtime.profiles.get(binding.agent)
    if binding is None or profile is None:
        return None
    found = await anyio.to_thread.run_sync(find, profile, Path(binding.workspace))
    return [u.path for u in found.used]
