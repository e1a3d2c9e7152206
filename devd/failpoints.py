"""Named failure points, for tests: make the Nth pass through a point fail, or kill the process there.

The model is etcd's gofail and SQLite's crash tests: the code says where it can fail (`hit("commit.after")`), and a
test says what happens there through the environment, so the real daemon is tested, not a copy of it:

    DEVD_FAILPOINTS="commit.after=kill@3;read=eio"

Each entry is `point=action[@N]`: the action fires on the Nth pass (default: every pass). Actions: `kill` (SIGKILL
this process, as a power cut would stop it), `eio`, `enospc`, `eperm` (raise that OSError). Unset, `hit` costs one
dictionary lookup on an empty dict.

Points: `commit.before` (a batch is about to be written), `commit.snapshot` (a batch that carries a snapshot, or
points a step at a snapshot's file, is about to be written), `snapshot.file` (a large snapshot's file is written and
fsync'd, not yet renamed into place), `commit.after` (a batch is durable and nobody has been told), `prune` (history
is about to be pruned), `read` (a read of the store is about to run), `hibernate` (an idle session's instance is
about to be dropped to make room), `backup` (a backup is about to copy the database), `agent.claimed` (the agent
runtime's claim of an Exec, Write or Git is durable and the effect has not started), `agent.done` (the effect is done
and its result not yet stepped).
"""

from __future__ import annotations

import errno
import os
import signal
import threading

_ERRORS = {"eio": errno.EIO, "enospc": errno.ENOSPC, "eperm": errno.EPERM}


def _parse(spec: str) -> dict[str, tuple[str, int | None]]:
    points: dict[str, tuple[str, int | None]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        point, _, action = entry.partition("=")
        action, _, nth = action.partition("@")
        if action != "kill" and action not in _ERRORS:
            raise ValueError(f"DEVD_FAILPOINTS: unknown action {action!r} in {entry!r}")
        points[point.strip()] = (action, int(nth) if nth else None)
    return points


_POINTS = _parse(os.environ.get("DEVD_FAILPOINTS", ""))
_passes: dict[str, int] = {}
_lock = threading.Lock()


def hit(point: str) -> None:
    """Pass through `point`: nothing, unless a test armed it."""
    armed = _POINTS.get(point)
    if armed is None:
        return
    action, nth = armed
    with _lock:
        _passes[point] = n = _passes.get(point, 0) + 1
    if nth is not None and n != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    code = _ERRORS[action]
    raise OSError(code, f"{os.strerror(code)} (failpoint {point})")
