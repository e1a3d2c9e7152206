"""A cgroup of its own for each command, where the kernel gives the daemon one: what bounds a command's memory as a
whole (shared memory included) and its number of processes.

Limits set per process (RLIMIT_DATA, RLIMIT_NPROC: `devd.agent.sandbox`) do not bound a command: RLIMIT_DATA does
not count shared memory at all (a memfd written to, a MAP_SHARED|MAP_ANONYMOUS mapping, System V shared memory,
files in a tmpfs: an independent attack held 6 GiB under a 64 MiB limit), and it is per process. The kernel's memory
controller counts every page a command's processes are charged for, whichever way they came by it; the pids
controller counts its processes and threads, and nobody else's.

Where: a daemon run as root on cgroup v1 (the memory and pids hierarchies mounted, as systemd's "legacy" and
"hybrid" layouts and many container hosts do). Each command gets a child of the daemon's own cgroup in each
hierarchy, named `devd.PID.START.ID` (the daemon's pid and start time, then the command's own id), with
`memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`, where swap is accounted, so that a command cannot swap
past it) set to `memory_bytes_max`, and `pids.max` to `processes_max` (bubblewrap's own two processes, root's, count
in it too). A command past its memory is stopped by the
kernel's OOM killer inside its group (SIGKILL to its largest process), and the daemon, which reads the group's
count of OOM kills, says so; a fork past `pids.max` fails (EAGAIN). The command is in its groups from its first
instruction: a shell put before it moves itself into the groups (writing to their `tasks`) and then execs the command
(`prefix`), so nothing of it ran outside them. The groups are removed once the command and all it started are gone
(`Group.remove`, also after a timeout or a cancel), and the groups a daemon killed with SIGKILL left behind are
removed by the next daemon that starts in the same cgroup (`sweep`).

Not built:
- cgroup v2 (the unified hierarchy). A process may not both sit in a cgroup and give its children controllers there
  ("no internal processes"), so a daemon would first move itself into a leaf of its own cgroup, which it may do only
  where that cgroup is delegated to it (systemd's `Delegate=yes`); that could not be tried where this was written
  (its memory controller is bound to v1), and devd runs none of it untried. On v2 the bound stays the cgroup the
  daemon runs in (the shipped units' `MemoryMax=`, shared by its commands).
- A daemon not run as root: a v1 hierarchy is root's to write; a cgroup its own user could write, its commands (the
  same user, under `sandbox = "none"`) could write too, and lift their own limits.
Where there is none, `place` says why (the daemon logs it once, `devd doctor` shows it) and the per-process limits
are all a command has.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import time
import uuid

import msgspec

REMOVE_WAIT_S = 5.0  # how long a group's removal waits for the last of its processes to be gone
_PREFIX = "devd."
_NAME = re.compile(r"devd\.(\d+)\.(\d+)\.[0-9a-f]+")


class Place(msgspec.Struct, frozen=True):
    """The daemon's own cgroups, where its commands' groups are made: `memory` (a v1 memory cgroup directory),
    `pids` (a v1 pids one, or None where there is none), and whether swap is accounted (`memory.memsw.*`)."""

    memory: str
    pids: str | None
    swap: bool


class Group(msgspec.Struct, frozen=True):
    """One command's groups: their directories (memory first, then pids when there is one)."""

    directories: tuple[str, ...]

    @property
    def counts_processes(self) -> bool:
        """Whether a pids cgroup is among them (so RLIMIT_NPROC need not count the command's processes)."""
        return len(self.directories) > 1

    def prefix(self, data_bytes: int | None = None) -> list[str]:
        """The command line that puts itself in the groups, then execs the rest: the command is in them from its
        first instruction. Only the shell's own builtins run before (`echo` and `ulimit` are), and a group that
        cannot be entered (removed meanwhile) stops it there, saying so, before the command runs. With
        `data_bytes`, the shell also sets RLIMIT_DATA, soft and hard, to it (whole KiB, as `ulimit -d` counts, so
        rounded down), which the rest inherits and, once no longer root, cannot raise: one program fewer than
        prlimit after the drop.

        The shell moves itself, its one thread, by writing 0 (the writing thread) to each group's `tasks`, never its
        pid to `cgroup.procs`: a move of a whole process takes the kernel's global lock on every process's fork and
        exit (cgroup_threadgroup_rwsem), whose taking waits for an RCU grace period, 7-20 ms of every command on a
        quiet 2-core machine; a thread moving itself needs no such lock (where the kernel skips it for one, as 6.18
        does; an older kernel takes it either way). For a single-threaded program, as a shell is, the two are the
        same move: the thread is the whole process, and what it execs and forks after is in the groups."""
        tasks = [os.path.join(d, "tasks") for d in self.directories]
        steps = [f'echo 0 > "${i + 1}"' for i in range(len(tasks))]
        if data_bytes is not None:
            steps.append(f"ulimit -d {data_bytes // 1024}")
        script = " && ".join([*steps, f"shift {len(tasks)}", 'exec "$@"'])
        return ["/bin/sh", "-c", script, "sh", *tasks]

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the command for its memory (v1's `oom_kill` count, since 4.13)."""
        try:
            with open(os.path.join(self.directories[0], "memory.oom_control"), encoding="ascii") as f:
                counts = dict(line.split() for line in f if line.strip())
        except (OSError, ValueError):
            return False
        return int(counts.get("oom_kill", "0")) > 0

    def remove(self) -> str | None:
        """Remove the groups once nothing is left in them (the command's pid namespace is torn down by the kernel as
        its first process dies, which may take a moment past the command's own exit): up to REMOVE_WAIT_S. None when
        they are gone, else which is left and why (it is removed at the next start, by `sweep`). Blocks: call it off
        the event loop."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        pause = 0.001
        left = list(self.directories)
        while left:
            try:
                os.rmdir(left[-1])  # pids (made last) first
                left.pop()
                continue
            except FileNotFoundError:
                left.pop()
                continue
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    return f"{left[-1]}: {e.strerror}"
            time.sleep(pause)  # the kernel gives no word when the last process has left a v1 group
            pause = min(pause * 2, 0.05)
        return None


@functools.cache
def place() -> Place | str:
    """Where this daemon's commands get groups of their own, or why they cannot (see the module's docstring). Looked
    up once per process."""
    if os.geteuid() != 0:
        return "the daemon is not run as root (a cgroup v1 hierarchy is root's to write)"
    memory = _own("memory")
    if memory is None:
        if _own_unified():
            return "the memory controller is on cgroup v2, where devd makes no cgroups of its own (not built yet)"
        return "there is no cgroup v1 memory hierarchy mounted here"
    if not os.access(os.path.join(memory, "cgroup.procs"), os.W_OK):
        return f"the daemon's memory cgroup {memory} cannot be written (mounted read-only)"
    pids = _own("pids")
    if pids is not None and not os.access(os.path.join(pids, "cgroup.procs"), os.W_OK):
        pids = None
    return Place(memory, pids, os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")))


def make(where: Place, memory_bytes: int, processes: int) -> Group:
    """A command's groups, made with its limits. OSError when the kernel refuses (a limit below what the cgroup
    itself holds, a full hierarchy): the command is not run then."""
    name = f"{_PREFIX}{os.getpid()}.{_started(os.getpid())}.{uuid.uuid4().hex[:12]}"
    memory = os.path.join(where.memory, name)
    os.mkdir(memory)
    made = [memory]
    try:
        _write(memory, "memory.limit_in_bytes", memory_bytes)
        if where.swap:  # never below memory.limit_in_bytes: set after it
            _write(memory, "memory.memsw.limit_in_bytes", memory_bytes)
        if where.pids is not None:
            pids = os.path.join(where.pids, name)
            os.mkdir(pids)
            made.append(pids)
            _write(pids, "pids.max", processes)
    except BaseException:
        Group(tuple(made)).remove()
        raise
    return Group(tuple(made))


def sweep(where: Place) -> list[str]:
    """Remove the groups of daemons that are gone (killed with SIGKILL mid-command), in this daemon's own cgroups;
    those of a daemon still running are its own. The groups left (something still runs in them), each with why."""
    left = []
    for parent in (where.memory, where.pids):
        if parent is None:
            continue
        for entry in os.scandir(parent):
            found = _NAME.fullmatch(entry.name)
            if found is None or not entry.is_dir(follow_symlinks=False):
                continue
            if _started(int(found[1])) == int(found[2]):
                continue  # that daemon runs still
            try:
                os.rmdir(entry.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                left.append(f"{entry.path}: {e.strerror}")
    return left


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w", encoding="ascii") as f:
        f.write(str(value))


def _started(pid: int) -> int:
    """When the process started (clock ticks after boot: /proc/PID/stat's 22nd field), 0 when there is none: with its
    pid, which process it is (a pid is reused, a start time with it is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _own(controller: str) -> str | None:
    """The directory of this process's own cgroup in the v1 hierarchy of `controller`, where one is mounted and its
    cgroup is within what the mount shows."""
    path = next(
        (p for _, names, p in _memberships() if controller in names.split(",")),
        None,
    )
    if path is None:
        return None
    for root, point, kind, options in _mounts():
        if kind == "cgroup" and controller in options.split(","):
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return os.path.normpath(os.path.join(point, os.path.relpath(path, root)))
    return None


def _own_unified() -> bool:
    return any(names == "" for _, names, _ in _memberships()) and any(m[2] == "cgroup2" for m in _mounts())


def _memberships() -> list[tuple[str, str, str]]:
    """/proc/self/cgroup: (hierarchy id, controllers, path) a line."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            hierarchy, names, path = (line.rstrip("\n").split(":", 2) + ["", ""])[:3]
            found.append((hierarchy, names, path))
    return found


def _mounts() -> list[tuple[str, str, str, str]]:
    """/proc/self/mountinfo's (root, mount point, file system type, super options) a line: what a cgroup mount shows
    (its root) and where."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            after = fields.index("-")
            unescape = functools.partial(re.sub, r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)))
            found.append((unescape(fields[3]), unescape(fields[4]), fields[after + 1], fields[after + 3]))
    return found
