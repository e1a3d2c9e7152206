"""Fixtures shared by the tests: one Core for every test that does not close its own (a compile costs ~0.1 s)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devd.host import Core, Instance
from devd.messages import Config


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
