"""The migration runner both SQL stores share: their formats as ordered steps, and the one rule for applying them.

A database's format is the number of steps applied to it, counted in a version the backend keeps (SQLite's
`user_version`, PostgreSQL's `devd_schema`). Each step runs once, in a transaction of its own, in order; a database
from a newer devd (a version past the steps) is refused and left as it is. Never edit a step that has shipped: add
the next one. Sans-I/O: the backend reads the version and applies what `next` hands it.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
import structlog

from devd.errors import StoreError

__all__ = ["Migrations"]

log = structlog.get_logger("devd.storage.migrations")

StepT = TypeVar("StepT")


class Migrations(msgspec.Struct, Generic[StepT], frozen=True):
    steps: tuple[StepT, ...]

    @property
    def latest(self) -> int:
        """The format this devd writes."""
        return len(self.steps)

    def next(self, version: int, database: str) -> tuple[int, StepT] | None:
        """The step that brings a database at `version` one further, with the version it reaches; None when it is up
        to date. Raises StoreError for a database (named `database`) written by a newer devd."""
        if version > self.latest:
            raise StoreError(
                f"{database} was written by a newer devd (format {version}; this one knows up to {self.latest}); run "
                "that devd or a newer one; the database was left as it is"
            )
        if version == self.latest:
            return None
        return version + 1, self.steps[version]

    def applied(self, version: int, **where: str) -> None:
        """Say that a step was applied, reaching `version`."""
        log.info("store.migrated", **where, version=version)
