"""SQLite's journal keeps its rows in the order they were written and indexes them by session in bulk, between batches
(MIGRATIONS' 10): every read of a session sees the rows not yet indexed (the tail) exactly as indexed ones, and a
crash or a failure while indexing loses and duplicates nothing."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest

from devd import failpoints
from devd.errors import StoreError
from devd.storage import sqlite as sqlite_store
from devd.storage.sqlite import MARK, MIGRATIONS, SQLiteStore
from devd.storage.store import Health, Keyed, Stored
from tests.stores import CONFIG, append_all, row, running, sqlite_at, step

ROOT = Path(__file__).resolve().parent.parent


def where(store: SQLiteStore) -> tuple[int, int]:
    """(rows indexed, rows in the tail), read through the store's own connection (it holds the file exclusively)."""
    db = store._db
    indexed = db.execute("SELECT COUNT(*) FROM journal_index").fetchone()[0]
    tail = db.execute(f"SELECT COUNT(*) FROM journal WHERE id > {MARK}").fetchone()[0]
    return indexed, tail


async def test_steps_in_the_tail_are_read_as_indexed_ones(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.create("b", CONFIG)
        await append_all(store, step(1, key="k1"), step(1, session="b"), step(2, snapshot=b"S2"), step(3, key="k3"))
        seen = (
            where(store),
            await store.load("a"),
            await store.keyed("a", "k3"),
            await store.keyed("b", "k1"),
            await store.steps_since("a", 0, 2),
            sorted(await store.journalled("a", 1, 10)),
            [(r.name, r.seq) for r in await store.sessions()],
        )
    assert seen == (
        (0, 4),
        Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3)]),
        Keyed(3, b"d3", b"a3", b"h3"),
        None,
        [row(1), row(2)],
        [2, 3],
        [("a", 3), ("b", 1)],
    )


async def test_keyed_steps_committed_together_are_each_found_by_their_key(tmp_path: Path) -> None:
    sessions = [f"s{n}" for n in range(8)]
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        for name in sessions:
            await store.create(name, CONFIG)
        async with anyio.create_task_group() as tg:  # started together: they share commits
            for name in sessions:
                for seq in (1, 2):
                    tg.start_soon(store.append, step(seq, key=f"{name}-{seq}" if seq == 2 else None, session=name))
        found = [await store.keyed(name, f"{name}-2") for name in sessions]
        commits = store.statistics().commits
    assert (found, commits < len(sessions) * 3) == ([Keyed(2, b"d2", b"a2", b"h2")] * len(sessions), True)


async def test_a_read_merges_indexed_rows_and_the_tail_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store, "TAIL_ROWS", 4)
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, *(step(seq, key=f"k{seq}") for seq in range(1, 7)))
        seen = (
            where(store),
            await store.steps_since("a", 2, 10),
            (await store.keyed("a", "k2"), await store.keyed("a", "k6")),
            await store.load_at("a", 5),
        )
    assert seen == (
        (4, 2),
        [row(3), row(4), row(5), row(6)],
        (Keyed(2, b"d2", b"a2", b"h2"), Keyed(6, b"d6", b"a6", b"h6")),
        Stored("a", CONFIG, None, 0, Health.OK, None, [row(1), row(2), row(3), row(4), row(5)]),
    )


async def test_a_restart_indexes_the_tail_and_keeps_every_step_once(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    async with running(sqlite_at(path)) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1, key="k1"), step(2), step(3, key="k3"))
        before = where(store)
    async with running(sqlite_at(path)) as store:
        after = where(store)
        await append_all(store, step(4))
        seen = (before, after, await store.steps_since("a", 0, 10), await store.keyed("a", "k3"))
    assert seen == ((0, 3), (3, 0), [row(1), row(2), row(3), row(4)], Keyed(3, b"d3", b"a3", b"h3"))


@pytest.mark.parametrize("indexed", [False, True], ids=["in-the-tail", "indexed"])
async def test_a_step_already_kept_is_refused_whether_indexed_or_in_the_tail(tmp_path: Path, indexed: bool) -> None:
    path = tmp_path / "db.sqlite3"
    async with running(sqlite_at(path)) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2))
    if not indexed:  # a new store: only its own appends are in the tail
        path = tmp_path / "again.sqlite3"
    async with running(sqlite_at(path)) as store:
        if not indexed:
            await store.create("a", CONFIG)
            await append_all(store, step(1), step(2))
        with pytest.raises(StoreError) as refused:
            await store.append(step(1))
        kept = (where(store), await store.steps_since("a", 0, 10))
    assert (str(refused.value), kept) == (
        "the state could not be made durable and nothing of it was applied: UNIQUE constraint failed: "
        "journal.session, journal.seq",
        ((2, 0) if indexed else (0, 2), [row(1), row(2)]),
    )


async def test_a_name_deleted_and_made_again_keeps_none_of_its_old_rows_from_the_tail(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1, key="k1"), step(2, key="k2"), step(3))
        await store.delete("a")
        await store.create("a", b"{}")
        await append_all(store, step(1, key="k9"))
        seen = (
            where(store),
            await store.load("a"),
            await store.keyed("a", "k1"),
            await store.keyed("a", "k9"),
        )
    assert seen == (
        (0, 1),
        Stored("a", b"{}", None, 0, Health.OK, None, [row(1)]),
        None,
        Keyed(1, b"d1", b"a1", b"h1"),
    )


async def test_sessions_made_deleted_and_rewound_beside_rows_in_the_tail_leave_those_rows_found(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1, key="k1"), step(2, key="k2"))
        await store.create("b", CONFIG)
        await append_all(store, step(1, key="k1", session="b"), step(2, session="b"))
        await store.truncate("b", 1, ())
        await store.create("c", CONFIG, b"C")
        await store.delete("c")
        await append_all(store, step(3, key="k3"), step(2, key="k2b", session="b"))
        seen = (
            where(store),
            [await store.keyed("a", k) for k in ("k1", "k2", "k3")],
            [await store.keyed("b", k) for k in ("k1", "k2b")],
            await store.steps_since("b", 0, 10),
        )
    assert seen == (
        (0, 5),
        [Keyed(1, b"d1", b"a1", b"h1"), Keyed(2, b"d2", b"a2", b"h2"), Keyed(3, b"d3", b"a3", b"h3")],
        [Keyed(1, b"d1", b"a1", b"h1"), Keyed(2, b"d2", b"a2", b"h2")],
        [row(1), row(2)],
    )


async def test_a_fork_and_a_rewind_of_a_session_with_rows_in_the_tail(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1, key="k1"), step(2, snapshot=b"S2"), step(3, key="k3"), step(4))
        await store.fork("a", 3, "f", None)
        await store.truncate("a", 2, ())
        await append_all(store, step(3, key="k3b"))
        seen = (
            await store.load("f"),
            await store.keyed("f", "k3"),
            await store.load("a"),
            (await store.keyed("a", "k3"), await store.keyed("a", "k3b")),
        )
    assert seen == (
        Stored("f", CONFIG, b"S2", 2, Health.OK, None, [row(3)]),
        Keyed(3, b"d3", b"a3", b"h3"),
        Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3)]),
        (None, Keyed(3, b"d3", b"a3", b"h3")),
    )


async def _history(path: Path, monkeypatch: pytest.MonkeyPatch, tail_rows: int) -> list[Any]:
    """A session pruned, forked and rewound, with every row indexed at once (tail_rows 1) or none (a large tail):
    what each read gives."""
    monkeypatch.setattr(sqlite_store, "TAIL_ROWS", tail_rows)
    seen: list[Any] = []
    async with running(sqlite_at(path, keys_kept=2, steps_kept=2, prune_every_steps=3)) as store:
        await store.create("a", CONFIG)
        for seq in range(1, 25):
            await store.append(step(seq, key=f"k{seq}" if seq % 3 else None, snapshot=b"S" if seq % 4 == 0 else None))
        await store.flush()
        await store.fork("a", 22, "f", b"F")
        await store.truncate("a", 23, ())
        await append_all(store, step(24, key="again"))
        for name in ("a", "f"):
            seen += [
                await store.load(name),
                await store.steps_since(name, 0, 100),
                [await store.keyed(name, f"k{seq}") for seq in range(1, 25)],
            ]
        seen.append([(r.name, r.seq) for r in await store.sessions()])
    return seen


async def test_a_pruned_forked_and_rewound_history_reads_the_same_whether_indexed_or_in_the_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    indexed = await _history(tmp_path / "indexed.sqlite3", monkeypatch, 1)
    tailed = await _history(tmp_path / "tailed.sqlite3", monkeypatch, 1 << 20)
    assert tailed == indexed


async def test_a_backup_of_a_session_with_rows_in_the_tail_restores_them(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1, key="k1"), step(2, snapshot=b"S2"), step(3))
        await store.backup(str(tmp_path / "copy.sqlite3"))
    restored = tmp_path / "restored"
    restored.mkdir()
    (tmp_path / "copy.sqlite3").rename(restored / "db.sqlite3")
    async with running(sqlite_at(restored / "db.sqlite3")) as store:
        seen = (where(store), await store.load("a"), await store.keyed("a", "k1"))
    assert seen == ((3, 0), Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3)]), Keyed(1, b"d1", b"a1", b"h1"))


async def test_indexing_that_fails_leaves_the_tail_as_it_was_and_the_next_indexes_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "db.sqlite3"
    monkeypatch.setattr(sqlite_store, "TAIL_ROWS", 3)
    async with running(sqlite_at(path)) as store:
        await store.create("a", CONFIG)
        failing = ("eio", failpoints._passes.get("journal.index", 0) + 1)
        monkeypatch.setitem(failpoints._POINTS, "journal.index", failing)
        await append_all(store, step(1, key="k1"), step(2), step(3, key="k3"))  # the indexing fails: the store breaks
        monkeypatch.delitem(failpoints._POINTS, "journal.index")
        await append_all(store, step(4), step(5), step(6, key="k6"))  # reopened (by this or the healer); indexed
        reads = (
            store.reopened,
            await store.steps_since("a", 0, 10),
            [await store.keyed("a", k) for k in ("k1", "k3", "k6")],
        )
    async with running(sqlite_at(path)) as store:  # what is left of the tail is indexed at open
        left = where(store)
    assert (reads, left) == (
        (
            1,
            [row(seq) for seq in range(1, 7)],
            [Keyed(1, b"d1", b"a1", b"h1"), Keyed(3, b"d3", b"a3", b"h3"), Keyed(6, b"d6", b"a6", b"h6")],
        ),
        (6, 0),
    )


# Killed (as a power cut stops it) inside the transaction that indexes the tail: between batches, or at open.
_KILLED = """
import sys
from pathlib import Path

import anyio

from devd import failpoints
from devd.storage import sqlite as sqlite_store
from tests.stores import CONFIG, running, sqlite_at, step


async def main(path: Path, at_open: bool) -> None:
    sqlite_store.TAIL_ROWS = 5
    if at_open:
        failpoints._POINTS["journal.index"] = ("kill", None)
    async with running(sqlite_at(path)) as store:
        failpoints._POINTS["journal.index"] = ("kill", None)
        await store.create("a", CONFIG)
        for seq in range(1, 6):
            await store.append(step(seq, key=f"k{seq}"))
        await store.flush()


anyio.run(main, Path(sys.argv[1]), sys.argv[2] == "open")
"""


@pytest.mark.parametrize("when", ["between-batches", "open"])
async def test_a_crash_while_indexing_loses_and_duplicates_nothing(tmp_path: Path, when: str) -> None:
    path = tmp_path / "db.sqlite3"
    if when == "open":  # a tail left by a daemon that stopped
        async with running(sqlite_at(path)) as store:
            await store.create("a", CONFIG)
            await append_all(store, *(step(seq, key=f"k{seq}") for seq in range(1, 6)))
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED, str(path), when], cwd=ROOT, capture_output=True, timeout=60, check=False
    )
    async with running(sqlite_at(path)) as store:
        seen = (
            killed.returncode,
            where(store),
            await store.steps_since("a", 0, 10),
            [await store.keyed("a", f"k{seq}") for seq in (1, 5)],
        )
    assert seen == (
        -9,
        (5, 0),
        [row(seq) for seq in range(1, 6)],
        [Keyed(1, b"d1", b"a1", b"h1"), Keyed(5, b"d5", b"a5", b"h5")],
    )


async def test_a_format_9_database_opens_with_its_journal_indexed(tmp_path: Path) -> None:
    path = tmp_path / "devd.sqlite3"
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        for version, migration in enumerate(MIGRATIONS[:9], start=1):
            db.executescript(f"BEGIN; {migration} PRAGMA user_version = {version}; COMMIT;")
        db.execute("INSERT INTO sessions (name, config, created) VALUES ('a', ?, 0)", (CONFIG,))
        db.executemany(
            "INSERT INTO journal (session, seq, key, digest, event, actions, snapshot, answer, at) "
            "VALUES ('a', ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (s.seq, s.key, s.digest, s.event, s.actions, s.snapshot, s.answer, float(s.seq))
                for s in (step(1, key="k1"), step(2, snapshot=b"S2"), step(3))
            ],
        )
    async with running(sqlite_at(path)) as store:
        await append_all(store, step(4))
        seen = (where(store), await store.load("a"), await store.keyed("a", "k1"))
    assert seen == (
        (3, 1),
        Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3), row(4)]),
        Keyed(1, b"d1", b"a1", b"h1"),
    )
