"""The backends the store conformance suite (tests/test_store.py) runs against, and what its cases share.

A backend joins in one place, `BACKENDS`: how to find a place for its data in a test and how to open a store there
with given pruning limits, and whether what it keeps outlives the store (`durable`). The `backend` and
`store_factory` fixtures (tests/conftest.py) are parametrized over this table, so a new backend gets every case;
the cases for durable stores run over `DURABLE`. PostgreSQL's place is a fresh database on the cluster
tests/postgres.py starts (missing binaries fail its cases, as they do today: a skip would hide them). Also here: the
steps and snapshots the store tests write, and a registry wired over a store as the daemon wires it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest

from devd.config import Settings
from devd.host import Core
from devd.server.daemon import build
from devd.sessions.registry import Registry
from devd.storage.memory import MemoryStore
from devd.storage.postgres import PostgresStore
from devd.storage.sqlite import FILE_SNAPSHOT_BYTES, SQLiteStore
from devd.storage.store import Row, Step, Store

S = TypeVar("S", bound=Store)
CONFIG = b'{"model":"m"}'
LIMITS = {"keys_kept": 1000, "steps_kept": 1000, "prune_every_steps": 256}  # unless a case says otherwise


@dataclass(frozen=True)
class Backend:
    name: str
    durable: bool  # what it keeps outlives the store: a store opened again on the same place finds it
    place: Callable[[pytest.FixtureRequest, Path], str]  # where a test's store keeps its data
    open: Callable[..., Awaitable[Store]]  # (place, **limits): a store on that place, not yet running


def sqlite_at(path: Path, **limits: int) -> SQLiteStore:
    return SQLiteStore(path, **(LIMITS | limits))


async def postgres_at(url: str, **limits: int) -> PostgresStore:
    return await PostgresStore.open(url, **(LIMITS | limits), node="test")


async def _sqlite(place: str, **limits: int) -> Store:
    return sqlite_at(Path(place), **limits)


async def _memory(place: str, **limits: int) -> Store:
    return MemoryStore()


BACKENDS = {
    b.name: b
    for b in (
        Backend("sqlite", True, lambda request, tmp: str(tmp / "db.sqlite3"), _sqlite),
        Backend("memory", False, lambda request, tmp: "", _memory),
        Backend("postgres", True, lambda request, tmp: str(request.getfixturevalue("postgres_url")), postgres_at),
    )
}
DURABLE = pytest.mark.parametrize(
    "backend", [b for b in BACKENDS.values() if b.durable], ids=lambda b: str(b.name)
)  # overrides the `backend` fixture


@asynccontextmanager
async def running(store: S) -> AsyncIterator[S]:
    """The store with its group-commit task running (writes complete only then); closed at the end."""
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.run)
            yield store
            tg.cancel_scope.cancel()
    finally:
        store.close()


def step(seq: int, *, key: str | None = None, snapshot: bytes | None = None, session: str = "a") -> Step:
    """Step `seq` of a session, with bytes that name it (the store never reads them)."""
    digest = f"d{seq}".encode() if key is not None else None
    return Step(session, seq, f"e{seq}".encode(), f"a{seq}".encode(), key, digest, snapshot, f"h{seq}".encode())


def row(seq: int) -> Row:
    """Step `seq` as the journal gives it back."""
    return Row(seq, f"e{seq}".encode(), f"a{seq}".encode(), f"h{seq}".encode())


async def append_all(store: Store, *steps: Step) -> None:
    """The steps, one after another, then a flush: the pruning they call for is done before the test reads (SQLite
    prunes on its commit thread after answering the commit)."""
    for s in steps:
        await store.append(s)
    await store.flush()


def big(n: int) -> bytes:
    """A snapshot just large enough for a file, named by its first byte."""
    return bytes([n]) * FILE_SNAPSHOT_BYTES


def kept(state: Path) -> list[int]:
    """The snapshots in files, by the byte that names them."""
    return sorted((state / "snapshots" / name).read_bytes()[0] for name in snapshot_files(state))


def snapshot_files(state: Path) -> list[str]:
    """The snapshots a SQLite store in `state` keeps in files, by name."""
    directory = state / "snapshots"
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def open_store(kind: str, tmp_path: Path, settings: Settings) -> Store:
    if kind == "memory":
        return MemoryStore()
    return SQLiteStore(
        tmp_path / "devd.sqlite3",
        keys_kept=settings.keys_kept_per_session,
        steps_kept=settings.steps_kept_per_session,
        prune_every_steps=settings.prune_every_steps,
    )


@asynccontextmanager
async def opened(kind: str, tmp_path: Path, core: Core, **limits: Any) -> AsyncIterator[Registry]:
    """A registry as `devd.server.daemon.build` wires it, over a running store of that kind in tmp_path."""
    settings = Settings(state_dir=tmp_path, socket_path=None, **limits)
    async with running(open_store(kind, tmp_path, settings)) as store:
        registry, _ = build(settings, core, store)
        try:
            yield registry
        finally:
            registry.close_all()
