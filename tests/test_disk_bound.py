"""A session's files stay bounded (devd.storage.sqlite): the snapshots its kept history no longer needs go with their
files, at the next commit and at open, and the write-ahead log is checkpointed by the commit thread and cut back, so
it stays within 8 MiB. Real SQLite files."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import msgspec

from devd.storage.sqlite import FILE_SNAPSHOT_BYTES, WAL_BYTES_KEPT
from tests.stores import CONFIG, append_all, big, kept, running, snapshot_files, sqlite_at, step

WAL_BOUND = 8 << 20


async def test_snapshots_between_the_oldest_and_the_latest_go_with_their_files(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        for n in (2, 4, 6, 8):  # each flushed, so each lands
            await append_all(store, step(n - 1), step(n, snapshot=big(n)))
            await store.flush()
    assert kept(tmp_path) == [2, 8]  # 2 is the next anchor once the kept window passes it; 8 is the newest


async def test_a_thinned_session_still_loads_every_kept_step(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        for n in (2, 4, 6, 8):
            await append_all(store, step(n - 1), step(n, snapshot=big(n)))
            await store.flush()
        await store.append(step(9))
        at_5 = await store.load_at("a", 5)
    assert (at_5.snapshot_seq, [r.seq for r in at_5.journal]) == (2, [3, 4, 5])  # type: ignore[union-attr]


async def test_snapshot_files_more_than_the_kept_history_needs_go_at_open(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        for n in (2, 4, 6, 8):
            await append_all(store, step(n - 1), step(n, snapshot=big(n)))
            await store.flush()
    # As a devd from before thinning left it: 4 and 6 in files of their own, named by their rows.
    directory = tmp_path / "snapshots"
    name = snapshot_files(tmp_path)[0]
    db = sqlite3.connect(tmp_path / "db.sqlite3")
    for n in (4, 6):
        extra = f"{name.split('-')[0]}-old{n}.snap"
        (directory / extra).write_bytes(big(n))
        db.execute("UPDATE journal SET snapshot = x'', snapshot_file = ? WHERE seq = ?", (extra, n))
    db.commit()
    db.close()
    async with running(sqlite_at(tmp_path / "db.sqlite3")):
        pass
    assert kept(tmp_path) == [2, 8]


async def test_the_log_is_checkpointed_and_stays_within_8_mib(tmp_path: Path) -> None:
    wal = tmp_path / "db.sqlite3-wal"
    largest = 0
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        for n in range(1, 81):  # 20 MiB of events, one commit each
            event = bytes([n]) * (FILE_SNAPSHOT_BYTES - 1)
            await store.append(msgspec.structs.replace(step(n), event=event))
            largest = max(largest, os.stat(wal).st_size)
        await store.flush()  # the checkpoint the last commit called for, if it did, is done
        checkpoints = store.checkpoints
    # 20 MiB of events, about 21 MiB of log with their rows' pages, through a log checkpointed each time it passes
    # 4 MiB: 5 checkpoints (a check that fired every commit: 80)
    assert (largest <= WAL_BOUND, checkpoints) == (True, 5)


async def test_after_a_checkpoint_the_log_is_written_again_over_the_blocks_its_file_has(tmp_path: Path) -> None:
    wal = tmp_path / "db.sqlite3-wal"
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        n = 0
        while store.checkpoints == 0:
            n += 1
            await store.append(msgspec.structs.replace(step(n), event=bytes([n]) * (FILE_SNAPSHOT_BYTES - 1)))
        await store.append(step(n + 1))
        size = os.stat(wal).st_size
    # Cut back to the size kept, not emptied: a log that grows from nothing makes every commit's fsync write the
    # file's metadata too (a single client's step 0.89 ms against 0.64 ms).
    assert size == WAL_BYTES_KEPT


async def test_a_session_restarted_after_thinning_loads_from_its_latest_snapshot(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        for n in (2, 4, 6):
            await append_all(store, step(n - 1), step(n, snapshot=big(n)))
            await store.flush()
    shutil.copytree(tmp_path / "snapshots", tmp_path / "copy")  # the store is closed: nothing moves
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        loaded = await store.load("a")
    assert (loaded.snapshot_seq, loaded.snapshot) == (6, big(6))  # type: ignore[union-attr]
