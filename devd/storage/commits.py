"""The group commit both SQL stores share, and its statistics.

A write handed to `GroupCommit.write` waits until the batch holding it has been committed by the backend (its commit,
fsync included, returned) or has failed; writes that arrive while a batch commits share the next one. Nothing is
acknowledged before its commit returns, and nothing is retried here: the backend says, for each write of a batch,
the error it failed with or None.

The backend supplies only how to commit a batch on its connection, and runs it one of two ways:

- on a thread of its own (`start_thread`, SQLite's): a write reaches the thread through a `queue.SimpleQueue` without
  a turn of the event loop, and the thread answers on the loop with `call_soon_threadsafe`. The writer waits on a
  plain asyncio future, not an anyio Event: one is made and awaited per step, and that is the step's hot path. The
  batch's follow-up (maintenance) runs on the thread once the batch is answered, between batches, so it holds up no
  step already answered.
- on the event loop (`serve`, PostgreSQL's, whose driver is async): each commit is shielded from cancellation, so no
  write is left between the two at shutdown; the batch's follow-up runs before its writers are answered.

A fork's copy of a long history is cut into commits of about `FORK_COPY_BYTES` (`spans`), so other sessions' steps
commit in between rather than wait behind one commit of the whole history.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Generic, TypeVar

import anyio
import anyio.to_thread
import structlog

from devd.storage.store import StoreStats, percentile_ms

__all__ = ["FORK_COPY_BYTES", "CommitTimes", "GroupCommit", "spans", "taken"]

log = structlog.get_logger("devd.storage.commits")

OpT = TypeVar("OpT")
ItemT = TypeVar("ItemT")
TIMES_KEPT = 1024  # the commits whose durations the percentiles are taken over: the latest ones
FORK_COPY_BYTES = 4 << 20  # a fork copies its source's journal a commit of about this much at a time
MAINTENANCE_POLL_S = 0.001  # how often a wait for idle looks again while only a batch's follow-up runs

Errors = Sequence[BaseException | None]  # what each write of a batch failed with, in order (None: committed)
# Thread: the batch's errors, and what to do on the thread once it is answered (None: nothing).
ThreadCommit = Callable[[list[OpT]], tuple[Errors, Callable[[], None] | None]]
# Loop: the batch's errors, and what to do once it is committed, before its writers hear of it (None: nothing).
LoopCommit = Callable[[list[OpT]], Awaitable[tuple[Errors, Callable[[], Awaitable[None]] | None]]]


class CommitTimes:
    """How many commits there were and how long the latest took: a store's `statistics()`."""

    def __init__(self) -> None:
        self.commits = 0
        self._seconds: list[float] = []

    def add(self, seconds: float) -> None:
        self.commits += 1
        self._seconds.append(seconds)
        del self._seconds[:-TIMES_KEPT]

    def statistics(self, *, reopened: int = 0) -> StoreStats:
        s = self._seconds
        return StoreStats(self.commits, percentile_ms(s, 0.5), percentile_ms(s, 0.99), reopened)


class _Pending(Generic[OpT]):
    """A write waiting for its commit: the answer comes back on the loop as the future's result."""

    __slots__ = ("op", "done", "error")

    def __init__(self, op: OpT, done: asyncio.Future[None]) -> None:
        self.op = op
        self.done = done
        self.error: BaseException | None = None


class GroupCommit(Generic[OpT]):
    """Writes batched into commits (see the module). `write` on the event loop; one of `start_thread` or `serve`
    commits them."""

    def __init__(self) -> None:
        self.times = CommitTimes()
        self._queue: queue.SimpleQueue[_Pending[OpT] | None] = queue.SimpleQueue()
        self._queued: anyio.Event | None = None  # set by a write while `serve` waits for one (loop mode only)
        self._serving = False
        self._outstanding = 0  # writes handed in and not yet answered
        self._maintaining = False  # set by the thread while an answered batch's follow-up runs
        self._settled = anyio.Event()  # set when none is outstanding
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the commit thread's (its writers'), while it runs

    @property
    def outstanding(self) -> int:
        return self._outstanding

    async def write(self, op: OpT) -> BaseException | None:
        """Hand `op` to the next commit and wait for it: None once it is committed, else what it failed with."""
        # The commit thread's loop when it runs (its writers' loop, which it answers on), found once: on Python 3.11
        # each `asyncio.get_running_loop()` is a getpid system call, and a write is the step path.
        loop = self._loop if self._loop is not None else asyncio.get_running_loop()
        pending = _Pending(op, loop.create_future())
        self._outstanding += 1
        self._queue.put(pending)
        if self._queued is not None:
            self._queued.set()
        await pending.done
        return pending.error

    async def wait_idle(self) -> None:
        """Return once every write handed in has been answered and what its commit called for is done (a prune
        that follows it: a read after this sees it)."""
        while self._outstanding or self._maintaining:
            if not self._outstanding:
                # Only a follow-up is left, on the thread: it tells no one when it ends (that would wake the loop
                # once more a batch, on the step path), so look again soon; this is for a flush, not a step.
                await anyio.sleep(MAINTENANCE_POLL_S)
                continue
            if self._settled.is_set():
                self._settled = anyio.Event()
            await self._settled.wait()

    def _batch(self) -> tuple[list[_Pending[OpT]], bool]:
        """The writes queued now, from the first (waited for), and whether the queue was told to stop."""
        return taken(self._queue)

    def _answer(self, batch: list[_Pending[OpT]], errors: Errors, seconds: float) -> None:
        """On the loop: tell each writer of the batch how its write went."""
        self.times.add(seconds)
        for p, error in zip(batch, errors, strict=True):
            p.error = error
            if not p.done.done():  # cancelled meanwhile: its writer is gone, the write is committed anyway
                p.done.set_result(None)
        self._outstanding -= len(batch)
        if not self._outstanding:
            self._settled.set()

    # -- on a thread of its own -----------------------------------------------------------------------------------

    def start_thread(self, commit: ThreadCommit[OpT], *, name: str) -> None:
        """Commit on a new thread until `stop_thread`; call on the event loop the writers run on."""
        loop = self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._commit_loop, args=(commit, loop), name=name, daemon=True)
        self._thread.start()

    async def stop_thread(self) -> None:
        """Commit what is queued, then end the thread and wait for it."""
        self._queue.put(None)
        if self._thread is not None:
            await anyio.to_thread.run_sync(self._thread.join)
            self._thread = None
        self._loop = None

    def _commit_loop(self, commit: ThreadCommit[OpT], loop: asyncio.AbstractEventLoop) -> None:
        stop = False
        while not stop:
            batch, stop = self._batch()
            if not batch:
                break
            started = time.perf_counter()
            then: Callable[[], None] | None = None
            try:
                errors, then = commit([p.op for p in batch])
            except Exception as e:  # a bug, not a fault: the batch fails, and the thread lives on for the next
                log.error("store.commit_failed", error=f"{type(e).__name__}: {e}"[:500])
                errors = [e] * len(batch)
            self._maintaining = then is not None  # before the answer: a flush it lets through waits for this too
            loop.call_soon_threadsafe(self._answer, batch, errors, time.perf_counter() - started)
            if then is not None:
                _maintain(then)
                self._maintaining = False

    # -- on the event loop --------------------------------------------------------------------------------------

    async def serve(self, commit: LoopCommit[OpT]) -> None:
        """Commit for ever, on the event loop; a commit under way when this is cancelled finishes first."""
        self._serving = True
        try:
            while True:
                if self._queue.empty():
                    self._queued = anyio.Event()
                    await self._queued.wait()
                batch, _ = self._batch()
                with anyio.CancelScope(shield=True):
                    await self._commit(commit, batch)
        finally:
            self._queued, self._serving = None, False

    async def drain(self, commit: LoopCommit[OpT]) -> None:
        """Return once every write handed in is answered; when no `serve` runs (it ended, or never ran), commit them
        here, or their writers wait for ever."""
        while not self._serving and not self._queue.empty():
            batch, _ = self._batch()
            await self._commit(commit, batch)
        await self.wait_idle()

    async def _commit(self, commit: LoopCommit[OpT], batch: list[_Pending[OpT]]) -> None:
        started = time.perf_counter()
        then: Callable[[], Awaitable[None]] | None = None
        try:
            errors, then = await commit([p.op for p in batch])
        except Exception as e:  # a bug, not a fault: the batch fails, and its writers hear so rather than wait
            log.error("store.commit_failed", error=f"{type(e).__name__}: {e}"[:500])
            errors = [e] * len(batch)
        seconds = time.perf_counter() - started
        if then is not None:
            try:
                await then()
            except Exception as e:  # the batch is committed: a failed follow-up is logged, not the writers' error
                log.error("store.maintenance_failed", error=f"{type(e).__name__}: {e}"[:500])
        self._answer(batch, errors, seconds)


def taken(items: queue.SimpleQueue[ItemT | None]) -> tuple[list[ItemT], bool]:
    """What a worker thread takes from its queue at once: the first item (waited for) and every one queued behind it,
    and whether the end (None) came among them (nothing after it is taken)."""
    first = items.get()
    if first is None:
        return [], True
    batch = [first]
    while True:
        try:
            item = items.get_nowait()
        except queue.Empty:
            return batch, False
        if item is None:
            return batch, True
        batch.append(item)


def _maintain(then: Callable[[], None]) -> None:
    """What follows a commit on the commit thread; a failure is logged, and the thread lives on for the next batch
    (were it to end, every later write would wait for ever)."""
    try:
        then()
    except Exception as e:
        log.error("store.maintenance_failed", error=f"{type(e).__name__}: {e}"[:500])


def spans(sizes: Iterable[tuple[int, int]], at: int, bytes_max: int) -> list[tuple[int, int]]:
    """A journal up to step `at`, given as (seq, bytes) in order, as ranges of seqs (first, last) of about
    `bytes_max` each: what a fork copies one commit at a time."""
    cut: list[tuple[int, int]] = []
    size, lo = 0, None
    for seq, n in sizes:
        lo = seq if lo is None else lo
        size += n
        if size >= bytes_max:
            cut.append((lo, seq))
            size, lo = 0, None
    if lo is not None:
        cut.append((lo, at))
    return cut
