"""devd.storage.commits: writes batched into commits, on a thread or on the loop; no write answered before its
commit returns; a fork's copy cut into spans. A list stands in for the database."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import anyio

from devd.errors import StoreError
from devd.storage.commits import GroupCommit, spans


async def test_writes_queued_while_a_thread_commit_runs_share_the_next_and_each_hears_its_own_error() -> None:
    commits: list[list[str]] = []
    first_started, release = threading.Event(), threading.Event()

    def commit(ops: list[str]) -> tuple[list[BaseException | None], None]:
        commits.append(ops)
        if len(commits) == 1:
            first_started.set()
            release.wait()
        return [StoreError(op) if op == "bad" else None for op in ops], None

    group: GroupCommit[str] = GroupCommit()
    group.start_thread(commit, name="test-commit")
    answers: dict[str, str | None] = {}

    async def write(op: str) -> None:
        error = await group.write(op)
        answers[op] = None if error is None else str(error)

    async with anyio.create_task_group() as tg:
        tg.start_soon(write, "first")
        await anyio.to_thread.run_sync(first_started.wait)
        for op in ("a", "bad", "b"):
            tg.start_soon(write, op)
        await anyio.wait_all_tasks_blocked()
        assert answers == {}  # nothing is answered before its commit returns
        release.set()
    await group.stop_thread()
    assert (commits, answers, group.times.statistics().commits) == (
        [["first"], ["a", "bad", "b"]],
        {"first": None, "a": None, "bad": "bad", "b": None},
        2,
    )


async def test_on_the_loop_what_follows_a_commit_runs_before_its_writers_hear_of_it() -> None:
    seen: list[str] = []

    async def commit(ops: list[str]) -> tuple[list[BaseException | None], Callable[[], Awaitable[None]]]:
        seen.append(f"commit {ops}")

        async def then() -> None:
            seen.append("then")

        return [None] * len(ops), then

    group: GroupCommit[str] = GroupCommit()

    async def write(op: str) -> None:
        await group.write(op)
        seen.append(f"answered {op}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(write, "a")
        tg.start_soon(write, "b")
        await anyio.wait_all_tasks_blocked()
        await group.drain(commit)  # no `serve` runs: committed here
    assert seen == ["commit ['a', 'b']", "then", "answered a", "answered b"]


def test_a_journal_is_cut_into_spans_of_about_the_bytes_given_the_last_reaching_the_step_forked_at() -> None:
    sizes = [(1, 3), (2, 3), (3, 3), (4, 1), (5, 5)]
    assert spans(sizes, 6, 5) == [(1, 2), (3, 5)] and spans(sizes[:4], 6, 5) == [(1, 2), (3, 6)]


async def test_a_thread_commit_whose_follow_up_fails_still_commits_the_next_batch() -> None:
    def commit(ops: list[str]) -> tuple[list[BaseException | None], Callable[[], None]]:
        def then() -> None:
            raise RuntimeError("a bug in the maintenance")

        return [None] * len(ops), then

    group: GroupCommit[str] = GroupCommit()
    group.start_thread(commit, name="test-commit")
    with anyio.fail_after(10):
        answers = [await group.write("a"), await group.write("b")]
    await group.stop_thread()
    assert answers == [None, None]


async def test_a_loop_commit_that_raises_answers_its_writers_with_the_error() -> None:
    async def commit(ops: list[str]) -> tuple[list[BaseException | None], None]:
        raise RuntimeError("a bug in the commit")

    group: GroupCommit[str] = GroupCommit()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(group.serve, commit)
            error = await group.write("a")
            tg.cancel_scope.cancel()
    assert (type(error), str(error)) == (RuntimeError, "a bug in the commit")
