"""devd.storage.postgres's fleet: several nodes (PostgresStore instances) on one real PostgreSQL database. Ownership,
leases,
fencing, drain, retries on serialization failures, migrations."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import pq

from devd.config import Settings
from devd.errors import ExistsError, MovedError, NullError, StoreError
from devd.host import Core
from devd.messages import encode, turn
from devd.server.daemon import build
from devd.storage.postgres import MIGRATIONS, VERSIONS, Owner, PostgresStore
from devd.storage.store import Counter, Health, Step, Stored, Tally
from tests import postgres as pg
from tests.stores import CONFIG, row, running, step

postgres, postgres_url = pg.postgres, pg.postgres_url  # the fixtures


async def node(url: str, name: str, *, ttl: float = 10.0, isolation: str = "read committed") -> PostgresStore:
    """A daemon's store, as node `name` advertising tcp://NAME:7000."""
    return await PostgresStore.open(
        url,
        keys_kept=1000,
        steps_kept=1000,
        prune_every_steps=256,
        node=name,
        advertise=f"tcp://{name}:7000",
        lease_ttl_s=ttl,
        isolation=isolation,
    )


@asynccontextmanager
async def idle(store: PostgresStore) -> AsyncIterator[PostgresStore]:
    """The store without `run`: no lease renewal (as in a paused daemon); writes commit on `committed`."""
    try:
        yield store
    finally:
        store.close()


async def committed(store: PostgresStore, *writes: Callable[[], Awaitable[None]]) -> list[str | None]:
    """Queue the writes together, commit them as one batch (no `run`), and give each one's error kind, or None."""
    outcomes: list[str | None] = [None] * len(writes)

    async def write(i: int, op: Callable[[], Awaitable[None]]) -> None:
        try:
            await op()
        except (MovedError, StoreError) as e:
            outcomes[i] = e.kind

    async with anyio.create_task_group() as tg:
        for i, op in enumerate(writes):
            tg.start_soon(write, i, op)
        await anyio.wait_all_tasks_blocked()  # all queued, none committed: `run` is not running
        await store.flush()
    return outcomes


async def committed_or_raise(store: PostgresStore, write: Awaitable[None]) -> None:
    """One write committed by `flush` (the store is not running), raising what it raised."""
    async with anyio.create_task_group() as tg:
        failed: list[BaseException] = []

        async def run() -> None:
            try:
                await write
            except Exception as e:
                failed.append(e)

        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        await store.flush()
    if failed:
        raise failed[0]


def sql(url: str, query: str) -> list[tuple[object, ...]]:
    """One statement on a connection of its own: the rows it gives (none for a statement that gives none)."""
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(query.encode())
        return cursor.fetchall() if cursor.description is not None else []


def rows_by_epoch(url: str, session: str) -> dict[int, int]:
    """How many journal rows of the session each epoch wrote."""
    found = sql(url, f"SELECT epoch, count(*) FROM journal WHERE session = '{session}' GROUP BY epoch")
    return {int(str(epoch)): int(str(count)) for epoch, count in found}


def end_lease_in_database(url: str, name: str) -> None:
    """The node's lease ends for the database while the node itself still believes in it: a pause, seen from
    outside (its own deadline is on its clock, which a real pause also moves)."""
    sql(url, f"UPDATE nodes SET lease_until = now() - interval '1 second' WHERE id = '{name}'")


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():
            await anyio.sleep(0.02)


# -- forks -------------------------------------------------------------------------------------------------------------


async def test_a_fork_being_copied_is_neither_listed_loaded_nor_taken_by_another_node(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        await a.create("f", CONFIG)
        sql(postgres_url, "UPDATE sessions SET head_seq = -1 WHERE name = 'f'")  # as `fork` leaves it until its end
        end_lease_in_database(postgres_url, "a")
        assert (await b.sessions(), await b.load("f"), await b.acquire("f")) == ([], None, None)


async def test_a_fork_left_unmade_is_removed_when_a_daemon_connects_once_its_owner_lease_ended(
    postgres_url: str,
) -> None:
    async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        for name in ("f", "g"):
            await a.create(name, CONFIG)
            await a.append(step(1, session=name))
        await b.create("h", CONFIG)
        await b.append(step(1, session="h"))
        sql(postgres_url, "UPDATE sessions SET head_seq = -1")  # three forks cut short by a crash
        end_lease_in_database(postgres_url, "a")
        async with running(await node(postgres_url, "c")):
            left = sql(postgres_url, "SELECT name FROM sessions ORDER BY name")
            copied = sql(postgres_url, "SELECT session FROM journal ORDER BY session")
    assert (left, copied) == ([("h",)], [("h",)])  # b's lease is live: its fork may still be under way


# -- ownership ---------------------------------------------------------------------------------------------------------


async def test_a_session_owned_by_a_live_node_is_moved_to_it_for_every_other_node(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        await a.create("x", CONFIG)
        refused: list[MovedError] = []
        for attempt in (b.acquire("x"), b.append(step(1, session="x")), b.create("x", b"{}"), b.delete("x")):
            with pytest.raises(MovedError) as moved:
                await attempt
            refused.append(moved.value)
        assert [(e.node, e.address) for e in refused] == [("a", "tcp://a:7000")] * 4
        assert refused[0].data == {"kind": "MOVED", "owner": {"node": "a", "address": "tcp://a:7000"}}
        assert (await b.owner("x"), await a.load("x")) == (
            Owner("a", "tcp://a:7000"),
            Stored("x", CONFIG, None, 0, Health.OK, None, []),
        )


async def test_acquiring_a_session_that_does_not_exist_gives_none(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a:
        assert (await a.acquire("nobody"), a.held("nobody"), await a.owner("nobody")) == (None, None, None)


async def test_every_acquisition_draws_a_new_epoch_never_used_before(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a:
        await a.create("x", CONFIG)
        first = a.held("x")
        again = await a.acquire("x")
        await a.delete("x")
        await a.create("x", CONFIG)  # the same name made again: its epochs still go on
        assert first is not None and again is not None
        assert first < again < (a.held("x") or 0)


async def test_a_node_whose_lease_ended_loses_its_session_and_its_late_append_commits_nothing(
    postgres_url: str,
) -> None:
    async with idle(await node(postgres_url, "a", ttl=1.0)) as a, running(await node(postgres_url, "b")) as b:
        assert await committed(a, lambda: a.create("x", CONFIG), lambda: a.append(step(1, session="x"))) == [None, None]
        stale = a.held("x")
        await wait_until(lambda: not a.lease_valid())  # paused: no renewal for longer than its ttl
        await anyio.sleep(0.05)  # its lease in the database ends a round trip later than its own deadline
        taken = await b.acquire("x")
        await a.renew()  # it wakes, renews, and still believes it holds x
        assert a.lease_valid() and a.held("x") == stale
        with pytest.raises(MovedError) as moved:
            await committed_or_raise(a, a.append(step(2, session="x")))
        assert (moved.value.node, moved.value.address, a.held("x")) == ("b", "tcp://b:7000", None)
        assert rows_by_epoch(postgres_url, "x") == {stale: 1}
        await b.append(step(2, session="x"))
        assert rows_by_epoch(postgres_url, "x") == {stale: 1, taken: 1}
        assert (await b.load("x")) == Stored("x", CONFIG, None, 0, Health.OK, None, [row(1), row(2)])


async def test_a_fenced_row_fails_alone_and_the_rest_of_its_batch_commits(postgres_url: str) -> None:
    async with idle(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        await committed(a, lambda: a.create("x", CONFIG), lambda: a.create("y", CONFIG))
        end_lease_in_database(postgres_url, "a")
        await b.acquire("x")
        await a.renew()
        commits = a.statistics().commits
        outcomes = await committed(a, lambda: a.append(step(1, session="x")), lambda: a.append(step(1, session="y")))
        assert (outcomes, a.statistics().commits - commits) == (["MOVED", None], 1)
        assert (await a.steps_since("x", 0, 10), await a.steps_since("y", 0, 10)) == ([], [row(1)])


async def test_a_node_never_takes_a_session_from_a_live_owner_even_when_it_writes_first(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        await a.create("x", CONFIG)
        with pytest.raises(MovedError):
            await b.set_health("x", Health.POISONED, "it trapped")
        assert [(r.name, r.health) for r in await b.sessions()] == [("x", Health.OK)]


# -- drain -------------------------------------------------------------------------------------------------------------


async def test_release_all_hands_every_session_over_at_once(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        await a.create("x", CONFIG)
        await a.create("y", CONFIG)
        await a.release_all()
        assert a.lease_valid() and (a.held("x"), a.held("y"), await a.owner("x")) == (None, None, None)
        assert await b.acquire("x") is not None and await b.acquire("y") is not None
        assert (await a.owner("x"), await a.owner("y")) == (Owner("b", "tcp://b:7000"),) * 2
        with pytest.raises(MovedError) as moved:
            await a.append(step(1, session="x"))
        assert moved.value.node == "b"


async def test_release_hands_over_only_the_sessions_named(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
        await a.create("x", CONFIG)
        await a.create("y", CONFIG)
        await a.release(["x"])
        await b.acquire("x")
        with pytest.raises(MovedError):
            await b.acquire("y")
        await a.append(step(1, session="y"))
        assert (await b.owner("x"), await b.owner("y")) == (Owner("b", "tcp://b:7000"), Owner("a", "tcp://a:7000"))


# -- the lease ---------------------------------------------------------------------------------------------------------


async def test_a_node_that_cannot_renew_its_lease_refuses_writes_until_it_renews_again(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a", ttl=1.0)) as a:
        await a.create("x", CONFIG)
        async with await psycopg.AsyncConnection.connect(postgres_url) as blocker:
            # The node's row locked: its renewals wait, time out and try again, and none succeeds.
            await blocker.execute("SELECT * FROM nodes WHERE id = 'a' FOR UPDATE")
            await wait_until(lambda: not a.lease_valid())
            with pytest.raises(StoreError) as refused:
                await a.append(step(1, session="x"))
            await blocker.rollback()
        assert "lease in the fleet (node 'a') ended" in str(refused.value)
        assert await a.steps_since("x", 0, 10) == []
        await wait_until(a.lease_valid)
        await a.append(step(1, session="x"))
        assert await a.steps_since("x", 0, 10) == [row(1)]


async def test_a_node_registers_on_open_with_its_lease_on_the_database_clock(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a", ttl=5.0)):
        (left,) = sql(postgres_url, "SELECT address, extract(epoch FROM lease_until - now()) FROM nodes")
    assert left[0] == "tcp://a:7000" and 0 < float(str(left[1])) <= 5.0


# -- retries and failures ----------------------------------------------------------------------------------------------


async def test_a_serialization_failure_is_retried_and_the_write_commits(postgres_url: str) -> None:
    # SERIALIZABLE, as CockroachDB always runs (PostgreSQL runs READ COMMITTED by default, where this cannot happen).
    async with running(await node(postgres_url, "a", isolation="serializable")) as a:
        await a.create("x", CONFIG)
        async with await psycopg.AsyncConnection.connect(postgres_url) as other:
            await other.execute("UPDATE sessions SET reason = reason WHERE name = 'x'")  # holds the row, uncommitted
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.append, step(1, session="x"))
                await wait_until(lambda: waiting_on_locks(postgres_url) == 1)  # the append waits for that row
                await other.commit()  # the row changed under the append's snapshot: 40001, then the retry
        assert (a.retries, await a.steps_since("x", 0, 10)) == (1, [row(1)])


def waiting_on_locks(url: str) -> int:
    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
    return int(str(sql(url, query)[0][0]))


async def test_connections_the_server_ended_are_replaced_and_the_write_and_reads_go_through(
    postgres_url: str,
) -> None:
    async with running(await node(postgres_url, "a", ttl=60.0)) as a:  # no renewal during the test
        await a.create("x", CONFIG)
        await a.load("x")  # a read connection, idle from now on
        sql(
            postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'devd' AND datname = current_database()",
        )
        await a.append(step(1, session="x"))  # the server said it ran nothing (57P01): tried again, anew
        assert (await a.steps_since("x", 0, 10), a.retries) == ([row(1)], 2)


async def test_an_unreachable_database_is_a_store_error_at_open() -> None:
    with refused_port() as port:
        with pytest.raises(StoreError) as failed:
            await node(f"postgresql://postgres@127.0.0.1:{port}/nothing", "a")
    assert str(failed.value).startswith("bringing the database's format up to date failed: ")


@contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port bound but not listening, for as long as the block runs: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


# -- migrations --------------------------------------------------------------------------------------------------------


async def test_migrations_are_recorded_one_row_per_version(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")):
        versions = sql(postgres_url, "SELECT version FROM devd_schema ORDER BY version")
    assert versions == [(n,) for n in range(1, len(MIGRATIONS) + 1)]


async def test_a_database_from_a_newer_devd_is_refused_and_left_as_it_is(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")):
        pass
    newer = len(MIGRATIONS) + 1
    sql(postgres_url, f"INSERT INTO devd_schema (version) VALUES ({newer})")
    with pytest.raises(StoreError) as refused:
        await node(postgres_url, "b")
    assert f"written by a newer devd (format {newer}; this one knows up to {len(MIGRATIONS)})" in str(refused.value)
    assert sql(postgres_url, "SELECT id FROM nodes") == [("a",)]


async def test_nodes_opening_an_empty_database_at_once_all_find_it_migrated(postgres_url: str) -> None:
    opened: list[PostgresStore] = []

    async def open_one(name: str) -> None:
        opened.append(await node(postgres_url, name))

    try:
        async with anyio.create_task_group() as tg:
            for name in ("a", "b", "c"):
                tg.start_soon(open_one, name)
    finally:
        for store in opened:
            store.close()
    assert sorted(s.node for s in opened) == ["a", "b", "c"]
    assert sql(postgres_url, "SELECT version FROM devd_schema") == [(n,) for n in range(1, len(MIGRATIONS) + 1)]


async def test_a_format_3_database_counts_the_spend_its_usage_records_kept(postgres_url: str) -> None:
    """Format 4 keeps spend in shared counters: a format-3 database's usage and refusal records are counted into them
    once (a fork's copies for its source only), so the fleet's ceilings still refuse after the upgrade."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(VERSIONS)
        for version, statements in enumerate(MIGRATIONS[:3], start=1):
            with conn.transaction():
                conn.execute("INSERT INTO devd_schema (version) VALUES (%s)", (version,))
                for statement in statements:
                    conn.execute(statement.encode())
        used = (
            '{"session":"a","profile":"coder","turn":2,"day":"2026-12-01",'
            '"usage":{"input_tokens":%d,"output_tokens":5}}'
        )
        refused = '{"session":"a","turn":2,"ceiling":"c","limit":1,"spent":0,"reserved":0,"needed":9,"message":"m"}'
        rows = [("a", 1, "usage", used % 100), ("a", 2, "usage", used % 200), ("a", 3, "refusal", refused)]
        rows += [("f", 1, "usage", used % 100)]  # the fork's copy of a's first
        for session, n, kind, body in rows:
            conn.execute(
                "INSERT INTO records (session, n, seq, kind, action, body, at) VALUES (%s, %s, 0, %s, 0, %s, 0)",
                (session, n, kind, body.encode()),
            )
    async with running(await node(postgres_url, "a")) as store:
        counted = await store.counted(
            [Counter("turn", "a", "2"), Counter("session", "a", ""), Counter("day", "coder", "2026-12-01")]
        )
        tallies = (await store.tally("a"), await store.tally("f"))
    assert (counted, tallies) == ([(310, 0), (310, 0), (310, 0)], (Tally(300, 10, 0, 2, 1), Tally()))


# -- the append must be the next step ----------------------------------------------------------------------------------


async def test_an_append_that_is_not_the_next_step_is_refused_alone_and_its_batch_commits(postgres_url: str) -> None:
    async with idle(await node(postgres_url, "a")) as a:
        await committed(a, lambda: a.create("x", CONFIG), lambda: a.append(step(1, session="x")))
        outcomes = await committed(
            a,
            lambda: a.append(Step("x", 1, b"other", b"other", "dup", b"dd")),
            lambda: a.append(step(2, session="x")),
            lambda: a.create("y", CONFIG),
        )
        assert outcomes == ["INTERNAL", None, None]
        assert (await a.steps_since("x", 0, 10), await a.keyed("x", "dup"), [r.name for r in await a.sessions()]) == (
            [row(1), row(2)],
            None,
            ["x", "y"],
        )


async def test_a_duplicate_step_says_which_step_the_session_is_at(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a:
        await a.create("x", CONFIG)
        await a.append(step(1, session="x"))
        with pytest.raises(StoreError) as failed:
            await a.append(step(1, session="x"))
    assert str(failed.value) == "step 1 of 'x' is not its next step (it has answered 1); nothing was written"


async def test_a_backup_is_refused_and_points_at_the_databases_own_tools(postgres_url: str) -> None:
    async with running(await node(postgres_url, "a")) as a:
        with pytest.raises(NullError) as refused:
            await a.backup("/nonexistent/backup.sqlite3")
    assert "pg_dump" in str(refused.value)


# -- the registry over a fleet's store -----------------------------------------------------------------------------


async def test_a_session_taken_over_before_its_deadline_is_recorded_answers_moved_and_is_forgotten(
    postgres_url: str, tmp_path: Path
) -> None:
    core = Core.open()
    try:
        async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
            registry, _ = build(Settings(state_dir=tmp_path, socket_path=None), core, a, fleet=a)
            await registry.new("s", b"{}")
            await a.release(["s"])  # as after a drain: b takes it at its next call
            await b.acquire("s")
            # A deadline already passed ends the session: recording that is a write, fenced now that b holds it.
            with pytest.raises(MovedError) as moved:
                await registry.step("s", encode(turn(1, "x")), 0, None)
            assert (moved.value.node, [i.name for i in registry.page()[0]]) == ("b", [])
            registry.close_all()
    finally:
        core.close()


async def test_a_name_made_at_once_on_two_daemons_is_exists_on_the_one_that_lost_the_race(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = Core.open()
    try:
        async with running(await node(postgres_url, "a")) as a, running(await node(postgres_url, "b")) as b:
            settings = Settings(state_dir=tmp_path, socket_path=None)
            ra, _ = build(settings, core, a, fleet=a)
            rb, _ = build(settings, core, b, fleet=b)

            async def checked_before_a_made_it(name: str | None) -> None:
                return None  # b looked for the name just before a made it: the name was free then

            monkeypatch.setattr(rb.fleet_sessions, "refuse_if_in_fleet", checked_before_a_made_it)
            await ra.new("x", b"{}")
            with pytest.raises(ExistsError) as refused:
                await rb.new("x", b"{}")
            assert (str(refused.value), [i.name for i in rb.page()[0]]) == (
                "a session named 'x' exists in the fleet; choose another name or close it first",
                [],
            )
            ra.close_all()
            rb.close_all()
    finally:
        core.close()


def _largest_message_sent(conn: psycopg.AsyncConnection[Any], during: Path) -> Callable[[], int]:
    """The length of the largest message `conn` sends to PostgreSQL from now (libpq's trace of it, kept in `during`)."""
    trace = open(during, "w")  # noqa: SIM115 (closed by what this returns)
    conn.pgconn.trace(trace.fileno())
    conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def largest() -> int:
        conn.pgconn.untrace()
        trace.close()
        with open(during, "rb") as f:
            return max(int(line.split(b"\t")[1]) for line in f if line.startswith(b"F\t"))

    return largest


async def test_a_steps_bytes_go_to_postgresql_as_they_are_not_escaped_as_text(
    postgres_url: str, tmp_path: Path
) -> None:
    """An append sends its bytes in binary: written as a text array, psycopg escaped each byte in Python on the event
    loop (0.7 s for a step of 8 MiB with its 16 MiB answer, no connection served meanwhile) and sent twice as many
    (2,097,292 bytes for this 1 MiB)."""
    event = bytes(range(256)) * 4096  # 1 MiB of every byte value
    async with running(await node(postgres_url, "a")) as store:
        await store.create("s", CONFIG)
        (committer,) = store._committer._idle
        largest = _largest_message_sent(committer, tmp_path / "trace")
        await store.append(Step("s", 1, event, None, answer=b"h1"))
        assert largest() < len(event) * 5 // 4
