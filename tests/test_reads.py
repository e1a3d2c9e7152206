"""A store's reads on one thread of their own, batched (devd.storage.reads)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio

from devd.storage.reads import ReadThread


def _held(gate: threading.Event, value: int) -> Callable[[], int]:
    def read() -> int:
        gate.wait(10)
        return value

    return read


def _failing() -> int:
    raise ValueError("no such row")


async def _outcome(reads: ReadThread, job: Callable[[], int]) -> int | str:
    try:
        return await reads.read(job)
    except ValueError as e:
        return f"ValueError: {e}"


async def test_reads_queued_while_one_runs_are_all_run_when_the_thread_next_wakes() -> None:
    reads, gate, got = ReadThread("test-read"), threading.Event(), dict[int, int | str]()
    try:
        async with anyio.create_task_group() as tg:

            async def one(n: int, job: Callable[[], int]) -> None:
                got[n] = await _outcome(reads, job)

            tg.start_soon(one, 0, _held(gate, 0))
            while not reads.batches:  # the first read is running, held
                await anyio.sleep(0.001)
            for n in range(1, 21):
                tg.start_soon(one, n, (lambda n=n: n) if n != 7 else _failing)
            await anyio.sleep(0.05)
            gate.set()
    finally:
        reads.stop()
    assert (reads.batches, got) == (2, {n: n if n != 7 else "ValueError: no such row" for n in range(21)})


async def test_a_reader_that_stops_waiting_leaves_the_reads_queued_behind_it_answered() -> None:
    reads, gate = ReadThread("test-read"), threading.Event()
    try:
        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(0.05):
                await reads.read(_held(gate, 1))  # given up on while it runs
            tg.start_soon(lambda: reads.read(lambda: 2))
            gate.set()
            with anyio.fail_after(10):
                answered = await reads.read(lambda: 3)
    finally:
        reads.stop()
    assert answered == 3


async def test_a_read_after_the_thread_stopped_still_runs_and_starts_no_thread() -> None:
    reads = ReadThread("test-read")
    first = await reads.read(lambda: 1)
    reads.stop()
    answered = await reads.read(lambda: 2)
    assert (first, answered, [t.name for t in threading.enumerate() if t.name == "test-read"]) == (1, 2, [])


def _stops() -> int:
    raise StopIteration  # as `next()` of an empty iterator inside a read does


async def test_a_read_raising_stopiteration_is_raised_to_its_reader_and_leaves_its_batch_answered() -> None:
    reads, gate, got = ReadThread("test-read"), threading.Event(), dict[int, int | str]()
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def one(n: int, job: Callable[[], int]) -> None:
                    try:
                        got[n] = await reads.read(job)
                    except RuntimeError as e:
                        got[n] = f"RuntimeError: {e}"

                tg.start_soon(one, 0, _held(gate, 0))
                while not reads.batches:  # the first read is running, held: the next three come in one batch
                    await anyio.sleep(0.001)
                tg.start_soon(one, 1, _stops)
                tg.start_soon(one, 2, lambda: 2)
                await anyio.sleep(0.05)
                gate.set()
    finally:
        reads.stop()
    assert got == {0: 0, 1: "RuntimeError: a read raised StopIteration", 2: 2}


def test_a_read_that_comes_as_another_thread_stops_the_thread_is_still_run() -> None:
    """stop() from another thread between a read's look at the thread and its hand-over (here: as the read makes its
    future, where a loop of another thread may be at that moment): the read must run, not wait for ever."""
    reads, armed = ReadThread("test-read"), [False]

    class Loop(asyncio.SelectorEventLoop):
        def create_future(self) -> asyncio.Future[Any]:
            if armed[0] and sys._getframe(1).f_code.co_name == "read":
                stopping = threading.Thread(target=reads.stop)
                stopping.start()
                stopping.join()
            return super().create_future()

    async def read_once() -> int | str:
        await reads.read(lambda: 0)  # the thread runs
        armed[0] = True
        with anyio.move_on_after(5):
            return await reads.read(lambda: 1)
        return "waited for ever"

    loop = Loop()
    try:
        answered = loop.run_until_complete(read_once())
    finally:
        loop.close()
    assert answered == 1
