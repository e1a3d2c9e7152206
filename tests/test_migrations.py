"""devd.storage.migrations: which step a database at a version gets next, and the refusal of a newer one."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from devd.errors import StoreError
from devd.storage.migrations import Migrations

FORMAT = Migrations(("one", "two", "three"))


def test_a_database_gets_the_step_after_its_version_and_the_version_it_reaches() -> None:
    assert [FORMAT.next(v, "db") for v in range(4)] == [(1, "one"), (2, "two"), (3, "three"), None]


def test_a_database_from_a_newer_devd_is_refused_saying_so() -> None:
    with pytest.raises(StoreError) as refused:
        FORMAT.next(4, "/x/devd.sqlite3")
    assert str(refused.value) == (
        "/x/devd.sqlite3 was written by a newer devd (format 4; this one knows up to 3); run that devd or a newer "
        "one; the database was left as it is"
    )


def test_a_step_applied_is_logged_with_the_version_reached() -> None:
    with capture_logs() as logs:
        FORMAT.applied(2, database="/x/devd.sqlite3")
    assert logs == [{"event": "store.migrated", "log_level": "info", "database": "/x/devd.sqlite3", "version": 2}]
