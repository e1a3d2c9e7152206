"""Named failure points, for tests: make the Nth pass through a point fail, or kill the process there.

The model is etcd's gofail and SQLite's crash tests: the code says where it can fail (`hit("commit.after")`), and a
test says what happens there through the environment, so the real daemon is tested, not a copy of it:

    DEVD_FAILPOINTS="commit.after=kill@3;read=eio"

Each entry is `point=action[@N]`: the action fires on the Nth pass (default: every pass). Actions: `kill` (SIGKILL
this process, as a power cut would stop it), `eio`, `enospc`, `eperm` (raise that OSError). Unset, `hit` costs one
dictionary lookup on an empty dict.

They are armed only in a test: `DEVD_FAILPOINTS` is obeyed only with `DEVD_TESTING=1` set as well (a production
daemon that inherits the variable ignores it, and says so), and `arm()`, called as `devd serve` starts, says at
warning which points are armed; a malformed value is a clear error there, never a traceback.

Points: `commit.before` (a batch is about to be written), `commit.snapshot` (a batch that carries a snapshot, or
points a step at a snapshot's file, is about to be written), `snapshot.file` (a large snapshot's file is written and
fsync'd, not yet renamed into place), `commit.after` (a batch is durable and nobody has been told), `prune` (history
is about to be pruned), `read` (a read of the store is about to run), `hibernate` (an idle session's instance is
about to be dropped to make room), `backup` (a backup is about to copy the database), `checkpoint` (the log is about
to be checkpointed, between commits), `reopen` (the store is about to reopen the database after a write fault),
`agent.claimed` (the agent runtime's claim of an Exec, Write or Git is durable and the effect has not started),
`agent.done` (the effect is done and its result not yet stepped), `children.parent_link` (a delegated run's link is
about to be kept in its parent's log), `children.child_link` (its link to its parent is about to be kept in its own
log), `children.ended` (a child's terminal state is kept in both logs, and its parent's call not yet answered),
`children.cascaded` (a cancel's descendants are cancelled, and the cascade not yet marked done).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Mapping

_ERRORS = {"eio": errno.EIO, "enospc": errno.ENOSPC, "eperm": errno.EPERM}


_FORM = "point=action[@N] entries separated by ; (actions: kill, eio, enospc, eperm)"


def _parse(spec: str) -> dict[str, tuple[str, int | None]]:
    points: dict[str, tuple[str, int | None]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        point, _, action = entry.partition("=")
        action, _, nth = action.partition("@")
        if not point.strip() or (action != "kill" and action not in _ERRORS):
            raise ValueError(f"DEVD_FAILPOINTS holds {entry!r}, which is not {_FORM}")
        if nth and not (nth.isdigit() and int(nth) > 0):
            raise ValueError(f"DEVD_FAILPOINTS holds {entry!r}: the pass after @ must be a number from 1")
        points[point.strip()] = (action, int(nth) if nth else None)
    return points


_POINTS: dict[str, tuple[str, int | None]] = {}  # armed by `arm` (or by a test in-process)
_passes: dict[str, int] = {}
_lock = threading.Lock()


def arm(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """Arm the points `DEVD_FAILPOINTS` names, if `DEVD_TESTING=1` says this is a test; what to log: ("armed",
    spec), ("ignored", spec) when the variable is set outside a test, or None. Raises ValueError, saying what is
    wrong, for a malformed value in a test."""
    spec = environ.get("DEVD_FAILPOINTS", "").strip()
    if not spec:
        return None
    if environ.get("DEVD_TESTING") != "1":
        return "ignored", spec
    _POINTS.clear()
    _POINTS.update(_parse(spec))
    return "armed", spec


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
