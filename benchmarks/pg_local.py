"""A throwaway PostgreSQL on loopback, for the tests and the fleet benchmark: made by initdb and started by pg_ctl in
a temporary directory on a free port, stopped and removed by `stop()`. Not for production: trust authentication.

PostgreSQL refuses to run as root, so when this runs as root the cluster runs as the `postgres` user (or `nobody`),
in a directory that user owns; otherwise as the current user. Every failure, missing binaries included, raises
`RuntimeError` saying what to do.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(os.environ.get("DEVD_PG_BIN", "/usr/lib/postgresql/15/bin"))
START_TIMEOUT_S = 60
START_ATTEMPTS = 3  # a free port can be taken between finding it and binding it


@dataclass
class Cluster:
    """A running cluster on loopback, its superuser `postgres` trusted from there."""

    root: Path
    run_as: list[str]
    port: int = 0
    database_prefix: str = "t"
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def query(self, sql: str, database: str = "postgres") -> list[tuple[Any, ...]]:
        """One statement as the superuser, outside any transaction (CREATE DATABASE needs that); its rows."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            cursor = conn.execute(sql.encode())
            return list(cursor.fetchall()) if cursor.description else []

    def create_database(self) -> str:
        name = f"{self.database_prefix}{os.getpid()}_{next(self._names)}"
        self.query(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        self.query(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def restart(self) -> None:
        """As a crash would: stopped without a checkpoint (`-m immediate`), then started again on the same port."""
        _check(
            self._pg_ctl("restart", "-m", "immediate", "-l", str(self.log), "-t", str(START_TIMEOUT_S)),
            "pg_ctl restart",
            self.log,
        )

    def stop(self) -> None:
        self._pg_ctl("stop", "-m", "fast")
        shutil.rmtree(self.root, ignore_errors=True)

    def _pg_ctl(self, command: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.run_as, str(BIN / "pg_ctl"), command, "-D", str(self.data), "-w", *args],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 10,
        )


def start(settings: Mapping[str, str], *, prefix: str = "devd-pg-", database_prefix: str = "t") -> Cluster:
    """A new cluster with `settings` in its postgresql.conf, running; the caller stops it."""
    missing = [name for name in ("initdb", "pg_ctl", "postgres") if not (BIN / name).exists()]
    if missing:
        raise RuntimeError(
            f"PostgreSQL's {', '.join(missing)} not found in {BIN}: install PostgreSQL 15 (Debian: apt-get install "
            "postgresql-15) or point DEVD_PG_BIN at its bin directory"
        )
    run_as, user = _run_as()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if user is not None:
        shutil.chown(root, user)
    cluster = Cluster(root, run_as, database_prefix=database_prefix)
    try:
        _start(cluster, settings)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start(cluster: Cluster, settings: Mapping[str, str]) -> None:
    """initdb, then pg_ctl start on a free port (another, if that one was taken meanwhile)."""
    initdb = subprocess.run(
        # --no-sync: the new cluster's files need not reach the disk first; the server itself runs with fsync on.
        [*cluster.run_as, str(BIN / "initdb"), "-D", str(cluster.data), "-U", "postgres", "-A", "trust"]
        + ["-E", "UTF8", "--no-locale", "--no-sync"],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    _check(initdb, "initdb")
    conf = cluster.data / "postgresql.conf"
    base = conf.read_text() + "".join(f"{k} = {v}\n" for k, v in settings.items())
    for attempt in range(START_ATTEMPTS):
        cluster.port = _free_port()
        conf.write_text(base + f"port = {cluster.port}\n")
        started = cluster._pg_ctl("start", "-l", str(cluster.log), "-t", str(START_TIMEOUT_S))
        if started.returncode == 0:
            return
        if attempt == START_ATTEMPTS - 1:
            _check(started, "pg_ctl start", cluster.log)


def _run_as() -> tuple[list[str], str | None]:
    """The command prefix that runs PostgreSQL as a user it accepts, and that user (None: the current one)."""
    if os.geteuid() != 0:
        return [], None
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue
        return ["runuser", "-u", user, "--"], user
    raise RuntimeError("running as root, and there is no `postgres` or `nobody` user to run PostgreSQL as")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(result: subprocess.CompletedProcess[str], what: str, log: Path | None = None) -> None:
    if result.returncode != 0:
        tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {result.stdout}{result.stderr}{tail}")
