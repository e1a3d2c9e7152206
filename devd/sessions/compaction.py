"""Log compaction: what a step journals, when a snapshot is due, and the snapshots a clean stop takes.

What it promises: what a step writes is a function of the step, not of the session's history. An answer as large as
the transcript is journalled as its digest (and derived again when asked for, see `devd.sessions.history`); a
snapshot is taken once the journal since the last has grown past a fraction of its size, preferably where the core
asked to `Save`, so a rebuild replays at most that much.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import structlog

from devd.errors import BusyError, DevdError
from devd.messages import without_payload
from devd.sessions.calls import WHOLE_STATE_INLINE_BYTES, saved
from devd.sessions.entry import Entry

if TYPE_CHECKING:
    from devd.sessions.registry import Registry

log = structlog.get_logger("devd.sessions.compaction")
SHUTDOWN_SNAPSHOT_BYTES = 16 << 10  # journal since its snapshot past which a stopping daemon snapshots a session


IGNORED_KEPT_BYTES = 1024  # an ignored event larger than this is journalled without its text


def journalled(event: bytes, ignored: int | None) -> bytes:
    """The event as journalled: whole, but for a large one the session took no notice of (a result or an answer for
    an action it did not dispatch), which a replay ignores without its text just the same, so a client that sends
    megabytes the session never asked for does not make every fork and rebuild carry them."""
    if ignored is None or len(event) <= IGNORED_KEPT_BYTES:
        return event
    return without_payload(event) or event


def kept_answer(event: bytes, actions: bytes) -> bytes | None:
    """The answer as journalled: whole when it is about as large as its event (calls, text, Save, Done), else None,
    for a digest alone (a Model ask: the whole transcript, which the events already hold)."""
    return actions if len(actions) <= 4 * len(event) + 256 else None


def snapshot_due(since_bytes: int, snapshot_bytes: int, floor_bytes: int, actions: bytes) -> bool:
    """A snapshot once the journal since the last one has grown past a quarter of its size (and past the floor, below
    which a replay is cheap anyway), at a Save (the end of a turn); past twice that, at any step (so one long turn is
    not one long replay). A rebuild then replays at most half a snapshot's worth, and snapshots add at most four
    times the journal's bytes to what is written."""
    threshold = max(floor_bytes, snapshot_bytes // 4)
    return since_bytes >= 2 * threshold or (since_bytes >= threshold and saved(actions))


async def save_all(registry: Registry) -> int:
    """At a clean stop, once no call runs: snapshot every live session with more than a few steps since its last
    snapshot, so the next start resumes it without replaying them. How many were; a failure only costs a replay
    after the restart. The snapshots are taken one by one (a small one inline) and handed to the store together, so
    its group commit writes them in a few commits rather than one each."""
    if not registry.core.has_snapshots:
        return 0
    taken: list[Entry] = []
    async with anyio.create_task_group() as tg:
        for entry in registry.entries():
            if entry.busy or entry.instance is None or entry.since_bytes < SHUTDOWN_SNAPSHOT_BYTES:
                continue
            # A turn of the loop a session: the stop's time limit can end this, and the saves run meanwhile.
            await anyio.lowlevel.checkpoint()
            tg.start_soon(_save_snapshot, registry, entry, taken)
    return len(taken)


async def _save_snapshot(registry: Registry, entry: Entry, taken: list[Entry]) -> None:
    try:
        with registry.held(entry):
            if entry.instance is None:  # dropped meanwhile: nothing to snapshot
                return
            take = functools.partial(entry.instance.snapshot, timeout=registry.call_timeout_s)
            snapshot = await registry.runner.off_loop(take) if entry.memory >= WHOLE_STATE_INLINE_BYTES else take()
            await registry.store.save_snapshot(entry.name, entry.seq, snapshot)
    except BusyError:
        return  # a call entered it meanwhile: its own commit keeps what it does
    except DevdError as e:
        log.warning("session.snapshot_failed", session=entry.name, error=str(e))
        return
    entry.snapshot_bytes, entry.since_bytes = len(snapshot), 0
    taken.append(entry)
