"""SQLite keeps a large snapshot in a file of its own (devd.storage.sqlite), written after its step is acknowledged and
pointed at by a commit of its own; the files go when no row names them, and a backup carries them inline."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from devd import failpoints
from devd.errors import StoreError
from devd.storage.sqlite import FILE_SNAPSHOT_BYTES
from devd.storage.store import Health, Stored
from tests.stores import CONFIG, append_all, big, kept, row, running, snapshot_files, sqlite_at, step


@asynccontextmanager
async def writer_held_back() -> AsyncIterator[None]:
    """Every worker thread of anyio's default limiter taken, so the snapshot writer (which writes on one) waits, while
    the commit thread and the reads (each a thread of its own) go on."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for holder in holders:
        limiter.acquire_on_behalf_of_nowait(holder)
    try:
        yield
    finally:
        for holder in holders:
            limiter.release_on_behalf_of(holder)


async def test_a_large_snapshot_loads_back_from_its_file_once_flushed(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2, snapshot=big(2)), step(3))
        await store.flush()
        assert (await store.load("a"), kept(tmp_path)) == (
            Stored("a", CONFIG, big(2), 2, Health.OK, None, [row(3)]),
            [2],
        )


async def test_a_large_snapshot_saved_at_a_stop_goes_to_a_file_and_loads_with_nothing_to_replay(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2))
        await store.save_snapshot("a", 2, big(2))
        await store.flush()
        assert (await store.load("a"), kept(tmp_path)) == (Stored("a", CONFIG, big(2), 2, Health.OK, None, []), [2])


async def test_a_large_snapshot_a_session_is_restored_from_is_in_its_file_once_created(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG, big(5))
        on_disk = kept(tmp_path)  # no flush: the file is written before the commit that names it
        assert (on_disk, await store.load("a")) == ([5], Stored("a", CONFIG, big(5), 0, Health.OK, None, []))


async def test_a_forks_large_snapshot_is_a_file_of_its_own_that_outlives_the_source(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2), step(3))
        await store.fork("a", 2, "f", big(6))
        await store.delete("a")
        assert (kept(tmp_path), await store.load("f")) == ([6], Stored("f", CONFIG, big(6), 2, Health.OK, None, []))


async def test_a_large_snapshots_step_is_acknowledged_before_its_file_is_written(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        async with writer_held_back():
            with anyio.fail_after(5):
                await store.append(step(1, snapshot=big(1)))
            committed = (await store.load("a"), snapshot_files(tmp_path))
        assert committed == (Stored("a", CONFIG, None, 0, Health.OK, None, [row(1)]), [])


async def test_a_snapshot_below_the_file_size_stays_in_the_database(tmp_path: Path) -> None:
    small = b"s" * (FILE_SNAPSHOT_BYTES - 1)
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=small))
        await store.flush()
        assert (await store.load("a"), snapshot_files(tmp_path)) == (
            Stored("a", CONFIG, small, 1, Health.OK, None, []),
            [],
        )


async def test_a_large_snapshot_appended_just_before_the_store_stops_is_written_as_it_stops(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=big(1)))
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        assert await store.load("a") == Stored("a", CONFIG, big(1), 1, Health.OK, None, [])


async def test_pruning_removes_the_files_of_the_snapshots_it_clears(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3", keys_kept=1, steps_kept=1, prune_every_steps=1)) as store:
        await store.create("a", CONFIG)
        for n in (2, 4, 6):  # each flushed, so each lands (a newer one queued would replace it)
            await append_all(store, step(n - 1), step(n, snapshot=big(n)))
            await store.flush()
    assert kept(tmp_path) == [4, 6]  # 4 anchors the step promised behind 6; 2 is cleared


async def test_deleting_a_session_removes_its_snapshot_files(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=big(1)))
        await store.flush()
        await store.delete("a")
    assert snapshot_files(tmp_path) == []


async def test_creating_a_name_again_removes_the_old_sessions_snapshot_files(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=big(1)))
        await store.flush()
        await store.create("a", CONFIG)
    assert snapshot_files(tmp_path) == []


async def test_a_fork_shares_its_sources_snapshot_file_and_keeps_it_when_the_source_is_deleted(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2, snapshot=big(2)), step(3))
        await store.flush()
        await store.fork("a", 3, "f", b"F3")
        await store.delete("a")
        assert (await store.load_at("f", 2), kept(tmp_path)) == (
            Stored("f", CONFIG, big(2), 2, Health.OK, None, []),
            [2],
        )


async def test_files_no_row_names_and_half_written_ones_are_removed_at_open(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=big(1)))
        await store.flush()
        ours, named = store.id, snapshot_files(tmp_path)
    # What a crash leaves: a file whose pointer never committed, and one never renamed into place; beside them, a
    # file of another database sharing the directory, which is not this one's to remove.
    for left in (f"{ours}-0123456789abcdef.snap", f".{ours}-0123456789abcdef.snap.partial", "other-0123.snap"):
        (tmp_path / "snapshots" / left).write_bytes(b"left")
    sqlite_at(tmp_path / "db.sqlite3").close()
    assert snapshot_files(tmp_path) == sorted([*named, "other-0123.snap"])


async def test_a_name_made_again_before_the_file_lands_does_not_get_the_old_snapshot(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        async with writer_held_back():
            await store.append(step(1, snapshot=big(1)))
            await store.create("a", CONFIG)
            await store.append(step(1))
        await store.flush()
        assert (await store.load("a"), snapshot_files(tmp_path)) == (
            Stored("a", CONFIG, None, 0, Health.OK, None, [row(1)]),
            [],
        )


async def test_a_file_landing_after_a_newer_snapshot_is_dropped(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        async with writer_held_back():  # no flush in here: it would wait for the file held back
            await store.append(step(1, snapshot=big(1)))
            await store.append(step(2, snapshot=b"S2"))
        await store.flush()
        assert (await store.load("a"), snapshot_files(tmp_path)) == (
            Stored("a", CONFIG, b"S2", 2, Health.OK, None, []),
            [],
        )


async def test_a_snapshot_file_that_cannot_be_written_is_dropped_and_the_store_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(failpoints._POINTS, "snapshot.file", ("enospc", 1))
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=big(1)))
        await store.flush()
        await store.append(step(2))
        assert (await store.load("a"), snapshot_files(tmp_path)) == (
            Stored("a", CONFIG, None, 0, Health.OK, None, [row(1), row(2)]),
            [],
        )


async def test_a_missing_snapshot_file_is_a_store_error_saying_what_to_do(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1, snapshot=big(1)))
        await store.flush()
        (name,) = snapshot_files(tmp_path)
        (tmp_path / "snapshots" / name).unlink()
        with pytest.raises(StoreError) as missing:
            await store.load("a")
    assert str(missing.value) == (
        f"the snapshot of session 'a' after step 1 is kept in {tmp_path / 'snapshots' / name}, which cannot be read "
        "(No such file or directory); the session cannot be rebuilt without it: put the file back (it is part of the "
        "state directory, like the database), or restore the state directory from a backup"
    )


async def test_a_backup_carries_the_snapshot_files_inline_and_loads_on_its_own(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1, snapshot=big(1)), step(2))
        await store.flush()
        await store.backup(str(tmp_path / "backup.sqlite3"))
    restored = tmp_path / "restored"
    restored.mkdir()
    shutil.copy(tmp_path / "backup.sqlite3", restored / "devd.sqlite3")
    async with running(sqlite_at(restored / "devd.sqlite3")) as copy:
        assert (await copy.load("a"), snapshot_files(restored)) == (
            Stored("a", CONFIG, big(1), 1, Health.OK, None, [row(2)]),
            [],
        )
