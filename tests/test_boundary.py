"""devd.storage.boundary: a backend's faults cross as StoreError saying what failed; anything else passes as it is."""

from __future__ import annotations

import sqlite3

import pytest

from devd.errors import StoreError
from devd.storage.boundary import map_exceptions


def test_a_fault_of_the_backend_becomes_a_store_error_saying_what_failed() -> None:
    with pytest.raises(StoreError) as failed, map_exceptions((sqlite3.Error,), lambda e: f"reading failed: {e}"):
        raise sqlite3.OperationalError("disk I/O error")
    assert (str(failed.value), failed.value.__cause__, failed.value.__suppress_context__) == (
        "reading failed: disk I/O error",
        None,
        True,
    )


def test_an_exception_that_is_not_a_fault_of_the_backend_passes_unchanged() -> None:
    with pytest.raises(KeyError), map_exceptions((sqlite3.Error,), str):
        raise KeyError("k")
