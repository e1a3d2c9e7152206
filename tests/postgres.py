"""A real PostgreSQL for the tests: one cluster per test session (`benchmarks.pg_local`, on a free loopback port,
stopped
and removed at the end), and a fresh database for each test that asks for one.

`fsync` stays on (durability is what the store tests), with small buffers. Missing binaries fail every test that
needs them, saying what to install: CI has them, and a skip would hide a test that no longer runs.

Import the fixtures into a test module to use them: `from tests.postgres import postgres, postgres_url  # noqa: F401`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks import pg_local
from benchmarks.pg_local import Cluster

__all__ = ["Cluster", "postgres", "postgres_url"]

SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "shared_buffers": "16MB",
    "max_connections": "60",
    "log_min_messages": "warning",
}


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """One PostgreSQL cluster for the whole test session."""
    try:
        cluster = pg_local.start(SETTINGS)
    except RuntimeError as e:
        pytest.fail(f"{e}; the PostgreSQL store's tests need a real server")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres: Cluster) -> Iterator[str]:
    """The URL of a new, empty database of its own, dropped after the test."""
    name = postgres.create_database()
    try:
        yield postgres.url(name)
    finally:
        postgres.drop_database(name)
