"""After a write fault the store reopens itself and serves again, without a restart by hand, and still acknowledges
nothing that is not durable (devd.storage.sqlite, devd.sessions.registry): the real daemon with a failure point, and
the store on a real SQLite file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import anyio
import pytest
from structlog.testing import capture_logs

from devd import errors, failpoints
from devd.errors import StoreError
from devd.messages import Call, Event, Exec, Output, answer, turn
from devd.storage.sqlite import REOPEN_DELAY_S, SQLiteStore
from devd.storage.store import Keyed
from tests.daemon import Daemon, log_events
from tests.stores import CONFIG, running, sqlite_at, step

T = TypeVar("T")


def _turn(n: int) -> list[Event]:
    """A turn's two steps: the prompt, and the model's text answer (the ask is id 1 of the first turn, then +4)."""
    return [turn(n, f"prompt {n}"), answer(4 * n - 3, f"reply {n}")]


def test_after_a_failed_write_the_daemon_answers_errors_then_heals_and_a_restart_shows_what_was_acknowledged(
    tmp_path: Path,
) -> None:
    # Commit 1 makes the session, 2 and 3 are its first turn; commit 4, the second turn's prompt, fails.
    d = Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@4"}).start()
    acknowledged = []
    with d.client() as c:
        c.new(session="a")
        for n, event in enumerate(_turn(1), start=1):
            c.step("a", event, key=f"k{n}")
            acknowledged.append(n)
        with pytest.raises(errors.InternalError, match="may or may not be on disk"):
            c.step("a", _turn(2)[0], key="k3")
        for n, event in enumerate(_turn(2), start=3):  # the failed step sent again, then the next: both acknowledged
            c.step("a", event, key=f"k{n}")
            acknowledged.append(n)
        reopened = c.call("daemon/status")["store_reopened"]
    d.env = {}
    d.stop()
    with d.start(), d.client() as c:
        listed = c.call("session/list")["sessions"]
    assert (reopened, acknowledged, [(s["session"], s["seq"]) for s in listed]) == (1, [1, 2, 3, 4], [("a", 4)])


def test_a_reopen_is_logged_and_counted_in_the_metrics(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@2"}) as d, d.client() as c:
        c.new(session="a")
        with pytest.raises(errors.InternalError):
            c.new(session="b")
        c.new(session="c")
        status = c.call("daemon/status")
    events = [json.loads(line)["event"] for line in d.log.read_text().splitlines() if line.startswith("{")]
    assert (status["store_reopened"], events.count("store.reopened")) == (1, 1)


def test_a_session_stepped_after_a_fault_continues_from_its_last_acknowledged_step(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@3"}) as d, d.client() as c:
        c.new(session="a")
        c.step("a", turn(1, "fix the build"))  # commit 2
        with pytest.raises(errors.InternalError):
            c.step("a", answer(1, "Let me look.", []))  # commit 3 fails
        actions = c.step("a", answer(1, "Let me look.", []))  # rebuilt from disk: step 2 again
    assert [a.id for a in actions] == [2, 3, 4]  # its Emit, Save and Done, as if the fault had not been


async def test_the_store_fails_the_faulted_write_then_reopens_and_commits_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    second = failpoints._passes.get("commit.before", 0) + 2  # passes are counted for the process: from here on
    monkeypatch.setitem(failpoints._POINTS, "commit.before", ("eio", second))
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        with pytest.raises(StoreError, match="may or may not be on disk"):
            await store.append(step(1))
        await store.append(step(1))
        loaded = await store.load("a")
        reopened = store.reopened
    assert (reopened, [r.seq for r in loaded.journal]) == (1, [1])  # type: ignore[union-attr]


async def test_a_deleted_database_is_never_made_again_by_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    async with running(sqlite_at(path)) as store:
        await store.create("a", CONFIG)
        path.unlink()
        for _ in range(2):  # the fault, then a reopen that finds no database
            with pytest.raises(StoreError):
                await store.append(step(1))
        exists = path.exists()
    assert (exists, store.reopened) == (False, 0)


def _arm(monkeypatch: pytest.MonkeyPatch, point: str, action: str, after: int | None = None) -> None:
    """Arm `point` in this process: on its `after`-th pass from now, or (None) on every pass."""
    nth = None if after is None else failpoints._passes.get(point, 0) + after  # passes are counted for the process
    monkeypatch.setitem(failpoints._POINTS, point, (action, nth))


async def _wait_for(done: Callable[[], bool], within_s: float) -> None:
    with anyio.fail_after(within_s):
        while not done():
            await anyio.sleep(0.01)


async def test_a_store_whose_reopens_keep_failing_serves_again_once_the_fault_clears_with_no_call_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _arm(monkeypatch, "commit.before", "eio", after=3)
    _arm(monkeypatch, "reopen", "eio")
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        with capture_logs() as logs:
            await store.create("a", CONFIG)
            await store.append(step(1, key="k1"))
            with pytest.raises(StoreError):
                await store.append(step(2, key="k2"))  # the fault
            await _wait_for(lambda: [e["event"] for e in logs].count("store.reopen_failed") >= 3, 10)
            monkeypatch.delitem(failpoints._POINTS, "reopen")  # the disk takes writes again; nobody calls
            await _wait_for(lambda: store.reopened == 1, 2 * REOPEN_DELAY_S[1])
        await store.append(step(2, key="k2"))
        keyed = await store.keyed("a", "k2")
    assert keyed == Keyed(2, b"d2", b"a2", b"h2")


async def _served(call: Callable[[], Awaitable[T]]) -> T:
    """What `call` answers once it no longer fails (the store is broken until it reopens: retried, within the most
    two backoffs can take)."""
    with anyio.fail_after(2 * REOPEN_DELAY_S[1]):
        while True:
            with contextlib.suppress(StoreError):
                return await call()
            await anyio.sleep(0.02)


@asynccontextmanager
async def _broken_then_stopped(store: SQLiteStore, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Inside: `store` running, with every reopen failing. After: the store broken, a reopen of it failed (its
    connection closed), `run` (and with it the healer) stopped, and the reopens no longer failing: only a call can
    reopen it now."""
    _arm(monkeypatch, "reopen", "eio")
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.run)
            yield
            await _wait_for(lambda: any(e["event"] == "store.reopen_failed" for e in logs), 10)
            tg.cancel_scope.cancel()
    monkeypatch.delitem(failpoints._POINTS, "reopen")


async def test_a_keyed_read_of_a_store_whose_reopen_failed_reopens_it_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It read the closed connection inline instead: a client of keyed steps (which read their key before they
    # write) was answered 'Cannot operate on a closed database' for ever.
    store = sqlite_at(tmp_path / "db.sqlite3")
    try:
        async with _broken_then_stopped(store, monkeypatch):
            await store.create("a", CONFIG)
            await store.append(step(1, key="k1"))
            _arm(monkeypatch, "commit.before", "eio", after=1)
            with pytest.raises(StoreError):
                await store.append(step(2))  # the fault
        keyed = await _served(lambda: store.keyed("a", "k1"))
        await anyio.sleep(0)  # the event loop is told of the reopen
    finally:
        store.close()
    assert (keyed, store.reopened) == (Keyed(1, b"d1", b"a1", b"h1"), 1)


async def test_a_store_whose_reopen_failed_heals_at_a_read_once_the_file_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, held = tmp_path / "db.sqlite3", tmp_path / "held"
    store = sqlite_at(path)
    try:
        async with _broken_then_stopped(store, monkeypatch):
            await store.create("a", CONFIG)
            await store.append(step(1))
            path.rename(held)
            with pytest.raises(StoreError):
                await store.append(step(2))  # the fault: the file is gone
        held.rename(path)
        loaded = await _served(lambda: store.load("a"))  # no write comes: the read reopens
        await anyio.sleep(0)  # the event loop is told of the reopen
    finally:
        store.close()
    assert ([r.seq for r in loaded.journal], store.reopened) == ([1], 1)  # type: ignore[union-attr]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("chattr") is None, reason="chattr +i needs root")
def test_a_daemon_whose_database_was_immutable_for_a_while_serves_keyed_steps_again_without_a_restart(
    tmp_path: Path,
) -> None:
    with Daemon(tmp_path) as d, d.client() as c:
        c.new(session="a")
        c.step("a", _turn(1)[0], key="k1")
        files = [str(d.state / "devd.sqlite3"), str(d.state / "devd.sqlite3-wal")]
        if subprocess.run(["chattr", "+i", *files], capture_output=True).returncode != 0:
            pytest.skip("this file system has no immutable flag")
        try:
            failed = 0
            for _ in range(5):  # the first fault breaks the store, the reopens after it fail
                with contextlib.suppress(errors.InternalError):
                    c.step("a", _turn(1)[1], key="k2")
                    break
                failed += 1
                time.sleep(0.3)
        finally:
            subprocess.run(["chattr", "-i", *files], check=True)
        deadline = time.monotonic() + 2 * REOPEN_DELAY_S[1]
        while True:
            try:
                answered = c.step_answer("a", _turn(1)[1], key="k2")
                break
            except errors.InternalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        served = c.step_answer("a", _turn(2)[0], key="k3")
    events = [e["event"] for e in log_events(d.log)]
    assert (failed, answered.replayed, served.replayed, events.count("store.reopened")) == (5, False, False, 1)


def test_tool_output_after_a_fault_is_taken_once(tmp_path: Path) -> None:
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.before=eio@4"}) as d, d.client() as c:
        c.new(session="a")
        c.step("a", turn(1, "build it"))
        c.step("a", answer(1, None, [Call(Exec=Exec(argv=["make"]))]))
        with pytest.raises(errors.InternalError):
            c.step("a", Event(Exec=Output(id=2, text="ok")), key="exec-2")
        c.step("a", Event(Exec=Output(id=2, text="ok")), key="exec-2")
        replayed = c.step_answer("a", Event(Exec=Output(id=2, text="ok")), key="exec-2").replayed
    assert replayed is True


def test_a_step_whose_commit_failed_after_it_landed_is_answered_replayed_when_sent_again(tmp_path: Path) -> None:
    # Commit 4 is durable, then fails (as an fsync that reports an error for writes that reached the disk).
    with Daemon(tmp_path, env={"DEVD_FAILPOINTS": "commit.after=eio@4"}) as d, d.client() as c:
        c.new(session="a")
        for n, event in enumerate(_turn(1), start=1):
            c.step("a", event, key=f"k{n}")
        with pytest.raises(errors.InternalError, match="may or may not be on disk"):
            c.step("a", _turn(2)[0], key="k3")
        again = c.step_answer("a", _turn(2)[0], key="k3")  # the store reopened and found it on disk
        c.step("a", _turn(2)[1], key="k4")  # and the session goes on from it, rebuilt from disk
        listed = c.call("session/list")["sessions"]
    assert (again.replayed, [(s["session"], s["seq"]) for s in listed]) == (True, [("a", 4)])


def test_a_log_deleted_under_the_daemon_loses_no_acknowledged_step_across_a_kill(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    acknowledged = 0
    with d.client() as c:
        c.new(session="a")
        events = _turn(1) + _turn(2) + _turn(3)
        for n, event in enumerate(events[:2], start=1):
            c.step("a", event, key=f"k{n}")
            acknowledged += 1
        (d.state / "devd.sqlite3-wal").unlink()
        for n, event in enumerate(events[2:], start=3):
            try:
                c.step("a", event, key=f"k{n}")  # the first after the deletion is refused; the store then reopens
            except errors.InternalError:
                c.step("a", event, key=f"k{n}")
            acknowledged += 1
    d.kill()
    with d.start(), d.client() as c:
        listed = [(s["session"], s["seq"]) for s in c.call("session/list")["sessions"]]
    assert (acknowledged, listed) == (6, [("a", 6)])
