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
