"""Fixtures shared by the tests: one Core for every test that does not close its own (a compile costs ~0.1 s), and a
real daemon (in this process) with a client of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devd.client import Client
from devd.host import Core, Instance
from devd.messages import Config
from tests.daemon import Daemon
from tests.harness import InProcess


@pytest.fixture
def anyio_backend() -> str:
    """The async tests' backend: asyncio, the one the daemon runs on."""
    return "asyncio"


@pytest.fixture(scope="session")
def core() -> Iterator[Core]:
    c = Core.open()
    yield c
    c.close()


@pytest.fixture
def session(core: Core) -> Iterator[Instance]:
    s = core.new(Config())
    yield s
    try:
        s.close()
    except Exception:
        pass


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[InProcess]:
    """The real daemon, in this process (`tests.harness`), on a socket and state directory in tmp_path."""
    with InProcess(tmp_path) as d:
        yield d


@pytest.fixture
def process_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """The real daemon as a process of its own (`tests.daemon`), for a test that kills it or reads its log."""
    with Daemon(tmp_path) as d:
        yield d


@pytest.fixture
def client(daemon: InProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c
