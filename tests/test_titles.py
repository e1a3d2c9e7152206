"""Session titles kept by `devd.agent.titles.Titles` over a real store's record log."""

from __future__ import annotations

from pathlib import Path

import anyio

from devd.agent import records
from devd.agent.port import StoreRecordLog
from devd.agent.titles import TITLE, Title, Titles
from devd.storage.store import Record, Store
from tests.stores import CONFIG, running, sqlite_at


class _CountedLog(StoreRecordLog):
    """The store's record log, counting how often it was asked which sessions have a kind of record (a scan of
    every such record in the store)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.scans = 0

    async def recorded(self, kind: str) -> list[str]:
        self.scans += 1
        return await super().recorded(kind)


async def test_a_hundred_first_looks_at_once_read_which_sessions_are_titled_once(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("s7", CONFIG)
        await store.add_record(Record("s7", 0, TITLE, 0, records.encode(Title("seven"))))
        log = _CountedLog(store)
        titles = Titles(log, lambda session: 0)
        found: dict[str, str | None] = {}

        async def look(session: str) -> None:
            found[session] = await titles.get(session)

        async with anyio.create_task_group() as tg:
            for n in range(100):
                tg.start_soon(look, f"s{n}")
    assert (log.scans, {s: t for s, t in found.items() if t is not None}) == (1, {"s7": "seven"})


class _HeldLog(StoreRecordLog):
    """The store's record log, whose scan of the sessions with a kind of record answers only once released."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.reading, self.release = anyio.Event(), anyio.Event()

    async def recorded(self, kind: str) -> list[str]:
        found = await super().recorded(kind)
        self.reading.set()
        await self.release.wait()
        return found


async def test_a_fork_made_while_the_titled_sessions_are_read_is_seen_with_its_title(tmp_path: Path) -> None:
    async with running(sqlite_at(tmp_path / "db.sqlite3")) as store:
        await store.create("f", CONFIG)
        log = _HeldLog(store)
        titles = Titles(log, lambda session: 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(titles.get, "another")  # the first look: the scan starts
            await log.reading.wait()
            await store.add_record(Record("f", 0, TITLE, 0, records.encode(Title("forked"))))  # the fork's copy
            titles.made("f")
            log.release.set()
        assert await titles.get("f") == "forked"
