"""The store contract (devd.storage.store), checked against every implementation: SQLite, memory and PostgreSQL alike (a
real PostgreSQL, started by tests/postgres.py)."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import psycopg
import pytest

from devd import failpoints
from devd.errors import StoreError
from devd.storage.postgres import PostgresStore
from devd.storage.sqlite import LARGE_ROW_BYTES, SQLiteStore
from devd.storage.store import Counter, Health, Keyed, Over, Record, Row, Step, Store, Stored, Tally
from tests.stores import CONFIG, DURABLE, LIMITS, append_all, big, row, running, snapshot_files, sqlite_at, step

Factory = Callable[..., Awaitable[Store]]  # the `store_factory` fixture (tests/conftest.py): a store of each backend


@pytest.fixture
async def store(store_factory: Factory) -> AsyncIterator[Store]:
    async with running(await store_factory()) as opened:
        yield opened


# -- the contract, for every implementation --------------------------------------------------------------------------


async def test_a_new_session_loads_as_its_config_with_no_snapshot_at_seq_0(store: Store) -> None:
    await store.create("a", CONFIG)
    assert await store.load("a") == Stored("a", CONFIG, None, 0, Health.OK, None, [])


async def test_a_session_created_from_a_snapshot_loads_that_snapshot_at_seq_0(store: Store) -> None:
    await store.create("a", CONFIG, b"SNAP")
    assert await store.load("a") == Stored("a", CONFIG, b"SNAP", 0, Health.OK, None, [])


async def test_appended_steps_load_back_in_order(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2), step(3))
    assert await store.load("a") == Stored("a", CONFIG, None, 0, Health.OK, None, [row(1), row(2), row(3)])


async def test_a_load_is_the_latest_snapshot_and_only_the_journal_after_it(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2, snapshot=b"S2"), step(3), step(4, snapshot=b"S4"), step(5), step(6))
    assert await store.load("a") == Stored("a", CONFIG, b"S4", 4, Health.OK, None, [row(5), row(6)])


async def test_a_keyed_step_is_found_by_its_key_and_an_unknown_key_is_none(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1, key="k1"), step(2), step(3, key="k3"))
    assert (await store.keyed("a", "k3"), await store.keyed("a", "k2"), await store.keyed("b", "k1")) == (
        Keyed(3, b"d3", b"a3", b"h3"),
        None,
        None,
    )


async def test_steps_since_gives_at_most_limit_steps_after_since(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, *(step(n) for n in range(1, 6)))
    assert [await store.steps_since("a", since, limit) for since, limit in ((1, 2), (3, 10), (5, 10))] == [
        [row(2), row(3)],
        [row(4), row(5)],
        [],
    ]


async def test_journalled_gives_when_each_step_after_since_was_journalled(store: Store) -> None:
    await store.create("a", CONFIG)
    before = time.time()
    await append_all(store, *(step(n) for n in range(1, 4)))
    times = await store.journalled("a", 1, 10)
    assert (list(times), all(before <= t <= time.time() for t in times.values())) == ([2, 3], True)


async def test_health_round_trips_through_the_session_list(store: Store) -> None:
    await store.create("b", CONFIG)
    await store.create("a", CONFIG)
    await store.append(step(1))
    await store.set_health("a", Health.ENDED, "its deadline passed")
    await store.set_health("b", Health.POISONED, "it trapped")
    await store.set_health("b", Health.OK, None)
    assert [(r.name, r.health, r.reason, r.seq) for r in await store.sessions()] == [
        ("a", Health.ENDED, "its deadline passed", 1),
        ("b", Health.OK, None, 0),
    ]


async def test_a_session_lists_when_it_was_made_and_last_stepped(store: Store) -> None:
    before = time.time()
    await store.create("a", CONFIG)
    made = time.time()
    await append_all(store, step(1))
    (row,) = await store.sessions()
    assert before <= row.created <= made <= row.last_used <= time.time()


async def test_a_saved_snapshot_of_the_head_step_loads_with_nothing_to_replay(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2, snapshot=b"S2"), step(3), step(4))
    await store.save_snapshot("a", 4, b"S4")
    await store.flush()
    assert await store.load("a") == Stored("a", CONFIG, b"S4", 4, Health.OK, None, [])


async def test_a_saved_snapshot_behind_a_later_one_or_of_a_gone_session_is_dropped(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2, snapshot=b"S2"), step(3))
    await store.save_snapshot("a", 1, b"S1")  # behind S2: a rebuild from it would replay what S2 already holds
    await store.save_snapshot("gone", 1, b"G1")
    await store.flush()
    # Step 1 is still rebuilt from the config: a snapshot written there behind S2 would show here.
    assert (await store.load_at("a", 1), await store.load("a"), await store.load("gone")) == (
        Stored("a", CONFIG, None, 0, Health.OK, None, [row(1)]),
        Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3)]),
        None,
    )


async def test_delete_removes_the_session_and_all_its_history(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1, key="k1"), step(2, snapshot=b"S2"))
    await store.delete("a")
    gone = (await store.load("a"), await store.keyed("a", "k1"), await store.steps_since("a", 0, 10))
    assert gone == (None, None, [])


async def test_creating_an_existing_name_replaces_its_history_and_health(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1, key="k1"), step(2, snapshot=b"S2"))
    await store.set_health("a", Health.POISONED, "it trapped")
    await store.create("a", b"{}")
    assert (await store.load("a"), await store.keyed("a", "k1")) == (
        Stored("a", b"{}", None, 0, Health.OK, None, []),
        None,
    )


async def forked(store: Store) -> None:
    """Source "a": keys at 1 and 4, a snapshot at 3; "f" forked from it at step 2 with snapshot F2."""
    await store.create("a", CONFIG)
    await append_all(store, step(1, key="k1"), step(2), step(3, snapshot=b"S3"), step(4, key="k4"))
    await store.fork("a", 2, "f", b"F2")


async def test_a_fork_has_the_source_journal_and_keys_up_to_its_step(store: Store) -> None:
    await forked(store)
    assert (await store.steps_since("f", 0, 10), await store.keyed("f", "k1"), await store.keyed("f", "k4")) == (
        [row(1), row(2)],
        Keyed(1, b"d1", b"a1", b"h1"),
        None,
    )


async def test_a_fork_loads_as_its_snapshot_at_its_step_with_nothing_to_replay(store: Store) -> None:
    await forked(store)
    assert await store.load("f") == Stored("f", CONFIG, b"F2", 2, Health.OK, None, [])


async def test_a_fork_leaves_its_source_as_it_was(store: Store) -> None:
    await forked(store)
    assert (await store.load("a"), await store.keyed("a", "k4")) == (
        Stored("a", CONFIG, b"S3", 3, Health.OK, None, [row(4)]),
        Keyed(4, b"d4", b"a4", b"h4"),
    )


async def test_a_fork_at_0_without_a_snapshot_loads_from_the_config(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2, snapshot=b"S2"))
    await store.fork("a", 0, "f", None)
    assert await store.load("f") == Stored("f", CONFIG, None, 0, Health.OK, None, [])


async def test_add_records_keeps_each_in_order_as_add_record_would(store: Store) -> None:
    await store.create("a", CONFIG)
    await store.add_record(Record("a", 1, "trace", 1, b"1"))
    await store.add_records(
        [Record("a", 2, "effect", 2, b"2"), Record("a", 2, "trace", 2, b"3"), Record("x", 2, "t", 0, b"")]
    )
    assert [(r.n, r.kind, r.action, r.body) for r in await store.records("a")] == [
        (1, "trace", 1, b"1"),
        (2, "effect", 2, b"2"),
        (3, "trace", 2, b"3"),
    ]


async def test_truncate_moves_a_session_back_to_a_step_dropping_the_steps_and_records_of_those_kinds_after_it(
    store: Store,
) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2, snapshot=b"S2"), step(3, key="k3"), step(4, snapshot=b"S4"), step(5))
    for seq, kind in [(1, "claim"), (3, "claim"), (3, "ledger"), (5, "claim")]:
        await store.add_record(Record("a", seq, kind, 0, kind.encode()))
    await store.truncate("a", 2, ("claim",))
    await store.append(step(3))  # the step after it is its next step again
    kept = [(r.seq, r.kind) for r in await store.records("a")]
    assert (await store.load("a"), await store.keyed("a", "k3"), kept) == (
        Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3)]),
        None,
        [(1, "claim"), (3, "ledger")],
    )


async def test_load_at_gives_the_state_as_of_an_earlier_step(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2, snapshot=b"S2"), step(3), step(4, snapshot=b"S4"), step(5))
    assert [await store.load_at("a", at) for at in (1, 3, 4, 5, 6)] == [
        Stored("a", CONFIG, None, 0, Health.OK, None, [row(1)]),
        Stored("a", CONFIG, b"S2", 2, Health.OK, None, [row(3)]),
        Stored("a", CONFIG, b"S4", 4, Health.OK, None, []),
        Stored("a", CONFIG, b"S4", 4, Health.OK, None, [row(5)]),
        None,
    ]


async def test_a_duplicate_step_is_a_store_error_and_nothing_of_it_is_visible(store: Store) -> None:
    await store.create("a", CONFIG)
    await store.append(step(1))
    with pytest.raises(StoreError):
        await store.append(Step("a", 1, b"other", b"other", "dup", b"dd", b"SNAP"))
    assert (await store.load("a"), await store.keyed("a", "dup")) == (
        Stored("a", CONFIG, None, 0, Health.OK, None, [row(1)]),
        None,
    )


async def test_statistics_count_the_commits(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2))
    assert store.statistics().commits == 3


async def test_flush_commits_what_is_pending_when_run_is_not_running(store_factory: Factory) -> None:
    store = await store_factory()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.create, "a", CONFIG)  # queued: no `run` commits it (as at shutdown, after run ends)
            await anyio.wait_all_tasks_blocked()
            with anyio.fail_after(5):
                await store.flush()
        assert await store.load("a") == Stored("a", CONFIG, None, 0, Health.OK, None, [])
    finally:
        store.close()


# -- durable stores: SQLite and PostgreSQL ---------------------------------------------------------------------------


@DURABLE
async def test_data_survives_closing_and_reopening_the_store(store_factory: Factory) -> None:
    async with running(await store_factory()) as before:
        await before.create("a", CONFIG)
        await append_all(before, step(1, key="k1"), step(2, snapshot=b"S2"), step(3))
        await before.set_health("a", Health.ENDED, "its deadline passed")
    async with running(await store_factory()) as after:
        listed = [(r.name, r.health, r.reason, r.seq) for r in await after.sessions()]
        assert (await after.load("a"), await after.keyed("a", "k1"), listed) == (
            Stored("a", CONFIG, b"S2", 2, Health.ENDED, "its deadline passed", [row(3)]),
            Keyed(1, b"d1", b"a1", b"h1"),
            [("a", Health.ENDED, "its deadline passed", 3)],
        )


# -- SQLite only -----------------------------------------------------------------------------------------------------


async def test_sqlite_a_failed_commit_is_a_store_error_not_a_sqlite3_one(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1))
        with pytest.raises(StoreError) as failed:
            await store.append(step(1))
    assert str(failed.value) == (
        "the state could not be made durable and nothing of it was applied: UNIQUE constraint failed: "
        "journal.session, journal.seq"
    )


async def test_sqlite_a_failed_commit_fails_every_write_in_its_batch(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await store.append(step(1))
    store = sqlite_at(tmp_path / "db.sqlite3")
    failed: list[type[BaseException]] = []

    async def write(op: Callable[[], Awaitable[None]]) -> None:
        try:
            await op()
        except StoreError as e:
            failed.append(type(e))

    try:
        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as writers:
                writers.start_soon(write, lambda: store.create("b", CONFIG))
                writers.start_soon(write, lambda: store.append(step(1)))
                await anyio.wait_all_tasks_blocked()  # both wait, queued: nothing commits before `run`
                tg.start_soon(store.run)  # so its first commit holds both, and the duplicate fails it
            outcome = (failed, await store.load("b"), store.statistics().commits)
            tg.cancel_scope.cancel()
    finally:
        store.close()
    assert outcome == ([StoreError, StoreError], None, 1)


# -- durable stores: pruning -----------------------------------------------------------------------------------------


@DURABLE
async def test_pruning_keeps_the_newest_keys_and_what_derives_the_steps_promised(store_factory: Factory) -> None:
    # Two steps are promised behind the latest snapshot (7 and 8); the snapshot before them (S4) derives them, so it and
    # every step after it stay, and the older keyed steps beyond the two newest keys go.
    async with running(await store_factory(keys_kept=2, steps_kept=2, prune_every_steps=1)) as store:
        await store.create("a", CONFIG)
        await append_all(
            store,
            step(1, key="k1"),
            step(2, key="k2"),
            step(3),
            step(4, snapshot=b"S4"),
            step(5, key="k5"),
            step(6),
            step(7),
            step(8, snapshot=b"S8"),
            step(9),
        )
        kept = [r.seq for r in await store.steps_since("a", 0, 100)]
        keys = [await store.keyed("a", k) is not None for k in ("k1", "k2", "k5")]
        assert (kept, keys, await store.load("a"), await store.load_at("a", 6)) == (
            [2, 4, 5, 6, 7, 8, 9],
            [False, True, True],
            Stored("a", CONFIG, b"S8", 8, Health.OK, None, [row(9)]),
            Stored("a", CONFIG, b"S4", 4, Health.OK, None, [row(5), row(6)]),
        )


@DURABLE
async def test_pruning_moves_on_once_a_later_snapshot_derives_the_steps_promised(store_factory: Factory) -> None:
    async with running(await store_factory(keys_kept=1, steps_kept=2, prune_every_steps=1)) as store:
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2, snapshot=b"S2"), step(3), step(4, snapshot=b"S4"), step(5))
        await append_all(store, step(6), step(7, snapshot=b"S7"))
        kept = [r.seq for r in await store.steps_since("a", 0, 100)]
        assert (kept, await store.load_at("a", 3)) == ([4, 5, 6, 7], None)


@DURABLE
async def test_a_name_created_again_is_pruned_as_a_new_session(store_factory: Factory) -> None:
    async with running(await store_factory(keys_kept=1, steps_kept=1, prune_every_steps=4)) as store:
        await store.create("a", CONFIG)
        await append_all(store, *(step(n) for n in range(1, 8)), step(8, snapshot=b"S8"))
        await store.delete("a")
        await store.create("a", CONFIG)
        await append_all(store, step(1), step(2, snapshot=b"S2"), step(3), step(4, snapshot=b"S4"), step(5))
        assert await store.steps_since("a", 0, 100) == [row(2), row(3), row(4), row(5)]


async def test_an_answer_kept_as_its_digest_loads_back_as_its_digest(store: Store) -> None:
    await store.create("a", CONFIG)
    await store.append(Step("a", 1, b"e1", None, "k1", b"d1", None, b"h1"))
    assert (await store.load("a"), await store.keyed("a", "k1")) == (
        Stored("a", CONFIG, None, 0, Health.OK, None, [Row(1, b"e1", None, b"h1")]),
        Keyed(1, b"d1", None, b"h1"),
    )


# -- durable stores: a fork of a long history ----------------------------------------------------------------------


def large(seq: int) -> Step:
    """Step `seq` of session a with a 1 MiB event."""
    return Step("a", seq, b"x" * (1 << 20), f"a{seq}".encode(), None, None, None, f"h{seq}".encode())


@DURABLE
async def test_a_fork_copies_a_long_history_a_few_mib_a_commit_so_other_steps_commit_in_between(
    store_factory: Factory,
) -> None:
    async with running(await store_factory()) as store:
        await store.create("a", CONFIG)
        await append_all(store, *(large(seq) for seq in range(1, 13)))
        before = store.statistics().commits
        await store.fork("a", 12, "f", None)
        commits = store.statistics().commits - before
        forked = await store.load("f")
    assert forked is not None
    # The claim (SQLite's note, PostgreSQL's unmade row), three copies of 4 MiB (FORK_COPY_BYTES), and the session:
    # never one commit of all 12 MiB.
    assert (commits, forked.seq, len(forked.journal)) == (5, 12, 12)


def _commit_thread_reads() -> Callable[[], int]:
    """The bytes the store's commit thread reads (from the database and its log) from now: what a commit costs beside
    another session's rows, with no clock."""
    (thread,) = [t for t in threading.enumerate() if t.name == "devd-commit"]

    def rchar() -> int:
        with open(f"/proc/self/task/{thread.native_id}/io") as f:
            return int(f.read().split("rchar:")[1].split()[0])

    start = rchar()
    return lambda: rchar() - start


async def test_sqlite_making_stepping_and_deleting_a_session_reads_none_of_another_sessions_large_step(
    tmp_path: Path,
) -> None:
    """A commit reads the rows it touches, not its neighbours': with the journal a WITHOUT ROWID table, a row was its
    b-tree's key, and a seek that compared against an 8 MiB row loaded all of it (issue 29: session/new's p99 went from
    0.06 to 2.2 s beside one client stepping 8 MiB turns); here 50 MiB read for these three writes."""
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        await append_all(store, Step("a", 1, b"x" * (8 << 20), None, answer=b"h1"))
        read = _commit_thread_reads()
        await store.create("b", CONFIG)
        await store.append(step(1, session="b"))
        await store.delete("b")
        await store.flush()
        assert read() < 1 << 20


async def test_sqlite_a_large_rows_step_is_one_commit_that_names_its_snapshots_file(tmp_path: Path) -> None:
    """A large row's snapshot file is written before its step's commit, which names it: pointed at by a commit of its
    own afterwards, the whole row was written again (SQLite rewrites a row to change a column), 60 to 75 ms for 16
    MiB on the commit thread, and the log's checkpoint copied it once more."""
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("a", CONFIG)
        before = store.statistics().commits
        await append_all(store, Step("a", 1, b"x" * LARGE_ROW_BYTES, None, snapshot=big(1), answer=b"h1"))
        commits = store.statistics().commits - before
        loaded = await store.load("a")
    assert loaded is not None
    assert (commits, loaded.snapshot_seq, loaded.snapshot == big(1), len(snapshot_files(tmp_path))) == (1, 1, True, 1)


async def fork_cut_short(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session "a" of 12 large steps, forked as "f" with the third of the fork's writes failing (its row or note, a
    copy, then this copy): the fork raises StoreError."""
    await store.create("a", CONFIG)
    await append_all(store, *(large(seq) for seq in range(1, 13)))
    third = failpoints._passes.get("commit.before", 0) + 3
    monkeypatch.setitem(failpoints._POINTS, "commit.before", ("eio", third))
    with pytest.raises(StoreError):
        await store.fork("a", 12, "f", None)
    monkeypatch.delitem(failpoints._POINTS, "commit.before")


@DURABLE
async def test_a_fork_cut_short_is_no_session_and_keeps_none_of_what_it_copied(
    store_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(await store_factory()) as store:
        await fork_cut_short(store, monkeypatch)
    async with running(await store_factory()) as store:
        left = (await store.load("f"), await store.steps_since("f", 0, 100), [r.name for r in await store.sessions()])
    assert left == (None, [], ["a"])


async def test_sqlite_a_fork_cut_short_leaves_no_session_and_its_copied_rows_go_at_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "db.sqlite3"
    async with running(sqlite_at(path)) as store:
        await fork_cut_short(store, monkeypatch)
    async with running(sqlite_at(path)) as store:
        forked = await store.load("f")
    db = sqlite3.connect(path)
    try:
        left = db.execute("SELECT count(*) FROM journal WHERE session = 'f'").fetchone()[0]
        notes = db.execute("SELECT count(*) FROM meta WHERE key LIKE 'fork:%'").fetchone()[0]
    finally:
        db.close()
    assert (forked, left, notes) == (None, 0, 0)


# -- the record log ----------------------------------------------------------------------------------------------------


def record(seq: int, kind: str = "claim", action: int = 0, session: str = "a") -> Record:
    return Record(session, seq, kind, action, f'{{"at":{seq}}}'.encode())


def shown(records: list[Record]) -> list[tuple[str, int, int, str, int, bytes, int]]:
    """What a record log holds, without the time each was written."""
    return [(r.session, r.n, r.seq, r.kind, r.action, r.body, bool(r.at)) for r in records]


async def test_records_come_back_numbered_in_the_order_they_were_kept_with_their_time(store: Store) -> None:
    await store.create("a", CONFIG)
    for r in (record(0, "agent"), record(1, action=2), record(3, "result", action=2)):
        await store.add_record(r)
    assert shown(await store.records("a")) == [
        ("a", 1, 0, "agent", 0, b'{"at":0}', True),
        ("a", 2, 1, "claim", 2, b'{"at":1}', True),
        ("a", 3, 3, "result", 2, b'{"at":3}', True),
    ]


async def test_records_can_be_read_by_kind_and_sessions_found_by_a_kind_they_hold(store: Store) -> None:
    for name in ("b", "a", "c"):
        await store.create(name, CONFIG)
        await store.add_record(record(0, "agent" if name != "c" else "other", session=name))
        await store.add_record(record(1, "claim", 4, session=name))
    kept = await store.records("a", ("agent",))
    assert (shown(kept), await store.recorded("agent")) == ([("a", 1, 0, "agent", 0, b'{"at":0}', True)], ["a", "b"])


async def test_a_record_of_a_session_that_does_not_exist_is_dropped(store: Store) -> None:
    await store.add_record(record(0, session="nobody"))
    assert (await store.records("nobody"), await store.recorded("claim")) == ([], [])


async def test_records_go_with_their_session_when_it_is_deleted_or_made_again(store: Store) -> None:
    for name in ("a", "b"):
        await store.create(name, CONFIG)
        await store.add_record(record(0, session=name))
    await store.delete("a")
    await store.create("b", CONFIG)
    assert (await store.records("a"), await store.records("b"), await store.recorded("claim")) == ([], [], [])


async def test_a_fork_carries_the_records_written_up_to_its_step_and_the_source_keeps_its_own(store: Store) -> None:
    await store.create("a", CONFIG)
    await append_all(store, step(1), step(2), step(3))
    for r in (record(0, "agent"), record(2, action=3), record(3, action=4)):
        await store.add_record(r)
    await store.fork("a", 2, "f", None)
    await store.add_record(record(2, "result", 3, session="f"))
    assert ([r.n for r in await store.records("a")], shown(await store.records("f"))) == (
        [1, 2, 3],
        [
            ("f", 1, 0, "agent", 0, b'{"at":0}', True),
            ("f", 2, 2, "claim", 3, b'{"at":2}', True),
            ("f", 3, 2, "result", 3, b'{"at":2}', True),
        ],
    )


@DURABLE
async def test_records_survive_closing_and_reopening_the_store(store_factory: Factory) -> None:
    async with running(await store_factory()) as store:
        await store.create("a", CONFIG)
        await store.add_record(record(0, "agent"))
    async with running(await store_factory()) as store:
        assert shown(await store.records("a")) == [("a", 1, 0, "agent", 0, b'{"at":0}', True)]


async def _mixed_log(store: Store) -> None:
    """Session a's log: 1 agent, then 2 trace, 3 claim (action 5), 4 trace, 5 trace, 6 claim (action 6), 7 trace."""
    await store.create("a", CONFIG)
    for kind, action in (("agent", 0), ("trace", 1), ("claim", 5), ("trace", 2), ("trace", 3), ("claim", 6)):
        await store.add_record(record(action, kind, action))
    await store.add_record(record(4, "trace", 4))


async def test_records_of_a_kind_are_paged_by_their_number(store: Store) -> None:
    await _mixed_log(store)
    first = await store.records("a", ("trace",), 0, 2)
    second = await store.records("a", ("trace",), first[-1].n, 2)
    last = await store.records("a", ("trace",), second[-1].n, 2)
    assert ([r.n for r in first], [r.n for r in second], [r.n for r in last]) == ([2, 4], [5, 7], [])


async def test_records_of_several_kinds_come_in_the_order_they_were_kept(store: Store) -> None:
    await _mixed_log(store)
    found = await store.records("a", ("claim", "agent"), 1)
    assert [(r.n, r.kind) for r in found] == [(3, "claim"), (6, "claim")]


async def test_forgotten_records_go_but_the_newest_stays_so_no_number_is_given_twice(store: Store) -> None:
    await _mixed_log(store)
    await store.forget_records("a", "claim", [5, 6])
    await store.forget_records("a", "trace", [4])  # the newest record: it stays
    await store.add_record(record(5, "trace", 8))
    assert [(r.n, r.kind) for r in await store.records("a")] == [
        (1, "agent"), (2, "trace"), (4, "trace"), (5, "trace"), (7, "trace"), (8, "trace"),
    ]  # fmt: skip


async def test_trimming_keeps_the_newest_records_of_the_kind_and_leaves_the_others(store: Store) -> None:
    await _mixed_log(store)
    trimmed = await store.trim_records("a", "trace", 2)
    assert (trimmed, [r.n for r in await store.records("a")]) == (2, [1, 3, 5, 6, 7])


def _vm_steps(store: SQLiteStore) -> Callable[[], int]:
    """The SQLite virtual machine's steps on the store's connection from now: what a read costs, with no clock."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    store._db.set_progress_handler(count, 1)
    return lambda: steps[0]


async def test_sqlite_reading_a_binding_costs_the_same_beside_10_or_10000_trace_records(tmp_path: Path) -> None:
    costs = []
    for traces in (10, 10_000):
        path = tmp_path / f"{traces}.sqlite3"
        async with running(sqlite_at(path)) as store:
            await store.create("a", CONFIG)
            await store.add_record(record(0, "agent"))
        with sqlite3.connect(path) as db:
            db.executemany(
                "INSERT INTO records (session, n, seq, kind, action, body, at) VALUES ('a', ?, 0, 'trace', 1, x'', 0)",
                [(n,) for n in range(2, traces + 2)],
            )
        db.close()
        async with running(sqlite_at(path)) as store:
            steps = _vm_steps(store)
            found = await store.records("a", ("agent",))
            costs.append((len(found), steps()))
    assert costs[0] == costs[1]


# -- spend counters ----------------------------------------------------------------------------------------------------

DAY = Counter("day", "coder", "2026-12-01")
SESSION = Counter("session", "a", "")
TURN = Counter("turn", "a", "1")
COUNTERS = (TURN, SESSION, DAY)


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0, session: str = "a") -> tuple[Tally, Record]:
    """What a call used, and its usage record."""
    return Tally(input_tokens, output_tokens, cached_tokens, calls=1), record(1, "usage", 2, session)


async def test_a_reservation_within_every_limit_holds_its_tokens_on_every_counter(store: Store) -> None:
    await store.create("a", CONFIG)
    number = await store.reserve("a", COUNTERS, [(SESSION, 100), (DAY, 500)], 100)
    assert (isinstance(number, int), await store.counted(COUNTERS)) == (True, [(0, 100), (0, 100), (0, 100)])


async def test_a_reservation_that_would_pass_a_limit_is_refused_with_the_numbers_and_counted(store: Store) -> None:
    await store.create("a", CONFIG)
    await store.charge(None, COUNTERS, *usage(60, 30))
    over = await store.reserve("a", COUNTERS, [(DAY, 500), (SESSION, 100)], 20)
    assert (over, await store.counted(COUNTERS), await store.tally("a")) == (
        Over(1, 90, 0),
        [(90, 0), (90, 0), (90, 0)],
        Tally(60, 30, 0, 1, 1),
    )


async def test_calls_in_flight_hold_their_reservations_so_two_cannot_pass_a_limit_together(store: Store) -> None:
    for name in ("a", "b"):
        await store.create(name, CONFIG)
    await store.reserve("a", COUNTERS, [(DAY, 150)], 100)
    other = (Counter("turn", "b", "1"), Counter("session", "b", ""), DAY)
    assert await store.reserve("b", other, [(DAY, 150)], 100) == Over(0, 0, 100)


async def test_a_charge_releases_its_reservation_and_adds_its_usage(store: Store) -> None:
    await store.create("a", CONFIG)
    number = await store.reserve("a", COUNTERS, [(SESSION, 150)], 100)
    assert isinstance(number, int)
    await store.charge(number, COUNTERS, *usage(40, 10, 8))
    again = await store.reserve("a", COUNTERS, [(SESSION, 150)], 100)
    kept = [(r.kind, r.action) for r in await store.records("a")]
    assert (isinstance(again, int), await store.tally("a"), kept) == (True, Tally(40, 10, 8, 1, 0), [("usage", 2)])


async def test_an_unreserved_call_charges_nothing_and_a_second_unreserve_changes_nothing(store: Store) -> None:
    await store.create("a", CONFIG)
    first = await store.reserve("a", COUNTERS, [(TURN, 100)], 100)
    assert isinstance(first, int)
    await store.unreserve(first)
    second = await store.reserve("a", COUNTERS, [(TURN, 100)], 60)
    await store.unreserve(first)
    assert (isinstance(second, int), await store.counted(COUNTERS)) == (True, [(0, 60), (0, 60), (0, 60)])


async def test_a_days_spend_outlives_its_session_and_a_fork_or_a_name_made_again_spends_from_zero(store: Store) -> None:
    await store.create("a", CONFIG)
    await store.charge(None, COUNTERS, *usage(100, 50))
    await store.fork("a", 0, "f", None)
    await store.delete("a")
    await store.create("a", CONFIG)
    forked = (Counter("turn", "f", "1"), Counter("session", "f", ""), DAY)
    assert (await store.counted(COUNTERS), await store.counted(forked), await store.tally("f")) == (
        [(0, 0), (0, 0), (150, 0)],
        [(0, 0), (0, 0), (150, 0)],
        Tally(),
    )


@DURABLE
async def test_spend_survives_a_restart_and_what_stopped_calls_held_is_released(store_factory: Factory) -> None:
    async with running(await store_factory()) as store:
        await store.create("a", CONFIG)
        await store.charge(None, COUNTERS, *usage(100, 50))
        await store.reserve("a", COUNTERS, [(DAY, 1000)], 300)  # in flight as the daemon stops
    async with running(await store_factory()) as store:
        assert (await store.counted(COUNTERS), await store.tally("a")) == (
            [(150, 0), (150, 0), (150, 0)],
            Tally(100, 50, 0, 1, 0),
        )


async def test_postgres_two_daemons_reserving_at_once_cannot_both_pass_a_limit(postgres_url: str) -> None:
    stores = [await PostgresStore.open(postgres_url, **LIMITS, node=node) for node in ("one", "two")]
    admitted: list[int | Over] = []
    try:
        async with anyio.create_task_group() as tg:
            for store in stores:
                tg.start_soon(store.run)
            await stores[0].create("a", CONFIG)

            async def reserve(store: Store) -> None:
                admitted.append(await store.reserve("a", COUNTERS, [(DAY, 1000)], 100))

            async with anyio.create_task_group() as calls:
                for n in range(30):
                    calls.start_soon(reserve, stores[n % 2])
            counted = await stores[1].counted([DAY])
            tg.cancel_scope.cancel()
    finally:
        for store in stores:
            store.close()
    assert (sum(isinstance(a, int) for a in admitted), counted) == (10, [(0, 1000)])


async def test_a_charge_for_a_session_deleted_meanwhile_still_counts_for_its_day(store: Store) -> None:
    await store.create("a", CONFIG)
    number = await store.reserve("a", COUNTERS, [(DAY, 1000)], 300)
    await store.delete("a")
    await store.charge(number if isinstance(number, int) else None, COUNTERS, *usage(100, 50))
    assert (await store.counted(COUNTERS), await store.tally("a"), await store.records("a")) == (
        [(0, 0), (0, 0), (150, 0)],
        Tally(),
        [],
    )


async def test_a_late_release_of_a_call_of_a_session_made_again_since_takes_nothing_from_the_new_one(
    store: Store,
) -> None:
    await store.create("a", CONFIG)
    old = await store.reserve("a", COUNTERS, [(DAY, 1000)], 300)
    await store.create("a", CONFIG)
    await store.reserve("a", COUNTERS, [(DAY, 1000)], 100)
    await store.unreserve(old if isinstance(old, int) else 0)
    assert await store.counted(COUNTERS) == [(0, 100), (0, 100), (0, 100)]


async def test_postgres_what_a_stopped_daemons_calls_held_is_released_once_its_lease_lapsed_and_room_is_needed(
    postgres_url: str,
) -> None:
    async with running(await PostgresStore.open(postgres_url, **LIMITS, node="other")) as other:
        stopped = await PostgresStore.open(postgres_url, **LIMITS, node="stopped")
        async with running(stopped):
            await stopped.create("a", CONFIG)
            await stopped.reserve("a", COUNTERS, [(DAY, 1000)], 900)  # in flight as the daemon dies
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("UPDATE nodes SET lease_until = now() - interval '1 second' WHERE id = 'stopped'")
        await other.create("b", CONFIG)
        admitted = await other.reserve("b", (Counter("session", "b", ""), DAY), [(DAY, 1000)], 500)
        counted = await other.counted([DAY])
    assert (isinstance(admitted, int), counted) == (True, [(0, 500)])


# -- reads on their thread (devd.storage.reads): a failing read, a close while reads are queued ---------------------


async def _loads(store: SQLiteStore, n: int, meanwhile: Callable[[], Awaitable[object]] | None = None) -> list[str]:
    """n loads of session "a" at once, started while the test holds the connection (so that they queue behind the
    first), `meanwhile` awaited once they are queued, then the connection let go: each one's session name, or its
    StoreError's first words."""
    got = [""] * n

    async def one(i: int) -> None:
        try:
            loaded = await store.load("a")
            got[i] = loaded.name if loaded is not None else "none"
        except StoreError as e:
            got[i] = str(e).split(":")[0]

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
            await anyio.sleep(0.05)
            if meanwhile is not None:
                await meanwhile()
            store._lock.release()
    return got


async def _load_error(store: SQLiteStore) -> str:
    try:
        await store.load("a")
    except StoreError as e:
        return str(e).split(":")[0]
    return "loaded"


async def test_sqlite_reads_queued_behind_one_that_fails_are_each_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(sqlite_at(tmp_path / "s.sqlite3")) as store:
        await store.create("a", CONFIG)
        monkeypatch.setitem(failpoints._POINTS, "read", ("eio", failpoints._passes.get("read", 0) + 2))
        store._lock.acquire()
        got = await _loads(store, 4)
    assert got == ["a", "reading the database failed", "a", "a"]


async def test_sqlite_a_close_while_reads_are_queued_answers_them_and_a_read_after_it_fails(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "s.sqlite3")) as store:
        await store.create("a", CONFIG)
        store._lock.acquire()
        closing = threading.Thread(target=store.close)  # waits for the queued reads to run, then closes

        async def close_meanwhile() -> None:
            closing.start()
            await anyio.sleep(0.05)

        got = await _loads(store, 3, close_meanwhile)
        await anyio.to_thread.run_sync(closing.join)
        with anyio.fail_after(10):
            after = await _load_error(store)
    assert (got, after) == (["a", "a", "a"], "reading the database failed")
