"""A store's reads on a thread of their own, batched: what `ReadThread.read` promises.

A read is a plain function (the store's: it takes the connection's lock, reads, and lets go). It reaches the thread
through a `queue.SimpleQueue`, without a turn of the event loop; the thread takes every read queued when it wakes,
runs them one after another in the order they came, and answers the whole batch on each reader's loop with one
`call_soon_threadsafe`. A read's exception is raised to its reader (StopIteration as a RuntimeError, as
`anyio.to_thread` does: a future refuses it). One read runs at a time, as with one connection it must.

Why not a worker thread a read (`anyio.to_thread` under a limiter of one, as before): each read's hand-over to the
next then took turns of the event loop (the limiter released there, the next reader woken there), so reads ran at
most a few hundred a second on a busy loop. At 300 agent sessions starting their turns at once (about nine reads each,
mostly the session's records read once), a turn's first step waited up to 2 s for the read of its key, and every
turn's end as long again.

A reader cancelled while its read waits or runs stops waiting; the read still runs (it changes nothing) and its
answer is dropped.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread

from devd.storage.commits import taken

__all__ = ["ReadThread"]

T = TypeVar("T")


class _Read:
    __slots__ = ("job", "loop", "future", "value", "error")

    def __init__(self, job: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        self.job = job
        self.loop = loop
        self.future = future
        self.value: Any = None
        self.error: BaseException | None = None


class ReadThread:
    """One thread that runs reads handed to `read`, started at the first and ended by `stop` (a read after that runs
    on a worker thread of its own)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.batches = 0  # how many times the thread woke for reads (each answered with one loop callback)
        self._queue: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # the thread started or ended, and each read queued, under it
        self._stopped = False

    async def read(self, job: Callable[[], T]) -> T:
        """job()'s value, run on the read thread (its exception raised here)."""
        loop = asyncio.get_running_loop()
        pending = _Read(job, loop, loop.create_future())
        # Queued under the lock `stop` queues its end under: a read queued after the end would never run (a store
        # closed from another thread than its reader's loop).
        with self._starting:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            queued = self._thread is not None
            if queued:
                self._queue.put(pending)
        if not queued:  # stopped (the store closed): run where no thread is left behind
            return await anyio.to_thread.run_sync(job)
        value: T = await pending.future
        return value

    def stop(self) -> None:
        """Run what is queued, then end the thread and wait for it (from any thread but the read thread)."""
        with self._starting:
            thread, self._thread, self._stopped = self._thread, None, True
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            batch, stop = taken(self._queue)
            if not batch:
                return
            self.batches += 1
            by_loop: dict[asyncio.AbstractEventLoop, list[_Read]] = {}
            for pending in batch:
                try:
                    pending.value = pending.job()
                except BaseException as e:  # the reader's to raise, whatever it is
                    pending.error = e
                by_loop.setdefault(pending.loop, []).append(pending)
            for loop, answered in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_answer, answered)
                except RuntimeError:  # that loop is closed: nobody waits for these any more
                    pass
            if stop:
                return


def _answer(batch: list[_Read]) -> None:
    """On the readers' loop: each reader told its read's value or error (unless it stopped waiting)."""
    for pending in batch:
        if pending.future.done():  # cancelled meanwhile
            continue
        if pending.error is not None:
            error = pending.error
            if isinstance(error, StopIteration):  # a future refuses it (TypeError), which left the batch unanswered
                error = RuntimeError("a read raised StopIteration")
                error.__cause__ = pending.error
            pending.future.set_exception(error)
        else:
            pending.future.set_result(pending.value)
