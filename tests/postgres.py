"""A real PostgreSQL for the tests: one cluster per test session, made by initdb and started by pg_ctl in a temporary
directory on a free loopback port, stopped and removed at the end; a fresh database for each test that asks for one.

PostgreSQL refuses to run as root, so when the tests run as root the cluster runs as the `postgres` user (or
`nobody`), in a directory that user owns; otherwise it runs as the current user. `fsync` stays on (durability is what
the store tests), with small buffers. Missing binaries fail every test that needs them, saying what to install: CI has
them, and a skip would hide a test that no longer runs.

Import the fixtures into a test module to use them: `from tests.postgres import postgres, postgres_url  # noqa: F401`.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

BIN = Path(os.environ.get("DEVD_PG_BIN", "/usr/lib/postgresql/15/bin"))
START_TIMEOUT_S = 60
START_ATTEMPTS = 3  # a free port can be taken between finding it and binding it
SETTINGS = """
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
fsync = on
synchronous_commit = on
full_page_writes = on
shared_buffers = 16MB
max_connections = 60
log_min_messages = warning
"""


@dataclass
class Cluster:
    """A running PostgreSQL cluster on loopback, its superuser `postgres` trusted from there."""

    root: Path
    port: int
    run_as: list[str]
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def execute(self, sql: str, database: str = "postgres") -> None:
        """One statement as the superuser, outside any transaction (CREATE DATABASE needs that)."""
        with psycopg.connect(self.url(database), autocommit=True) as conn:
            conn.execute(sql.encode())

    def create_database(self) -> str:
        name = f"t{os.getpid()}_{next(self._names)}"
        self.execute(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def restart(self) -> None:
        """As a crash would: stopped without a checkpoint (`-m immediate`), then started again on the same port."""
        result = subprocess.run(
            [*self.run_as, str(BIN / "pg_ctl"), "restart", "-D", str(self.data), "-m", "immediate", "-w"]
            + ["-l", str(self.root / "postgres.log"), "-t", str(START_TIMEOUT_S)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 10,
        )
        _check(result, "pg_ctl restart", self.root / "postgres.log")

    def stop(self) -> None:
        subprocess.run(
            [*self.run_as, str(BIN / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w"],
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )
        shutil.rmtree(self.root, ignore_errors=True)


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
    pytest.fail("the tests run as root and there is no `postgres` or `nobody` user to run PostgreSQL as")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(result: subprocess.CompletedProcess[str], what: str, log: Path | None = None) -> None:
    if result.returncode != 0:
        tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
        pytest.fail(f"{what} failed (exit {result.returncode}): {result.stdout}{result.stderr}{tail}")


def start_cluster() -> Cluster:
    """A new cluster in a temporary directory, running; the caller stops it."""
    missing = [name for name in ("initdb", "pg_ctl", "postgres") if not (BIN / name).exists()]
    if missing:
        pytest.fail(
            f"PostgreSQL's {', '.join(missing)} not found in {BIN}: install PostgreSQL 15 (Debian: apt-get install "
            "postgresql-15) or point DEVD_PG_BIN at its bin directory; the PostgreSQL store's tests need a real server"
        )
    run_as, user = _run_as()
    root = Path(tempfile.mkdtemp(prefix="devd-pg-"))
    if user is not None:
        shutil.chown(root, user)
    cluster = Cluster(root, 0, run_as)
    try:
        initdb = subprocess.run(
            # --no-sync: the new cluster's files need not reach the disk before the tests start; the server itself
            # runs with fsync on.
            [*run_as, str(BIN / "initdb"), "-D", str(cluster.data), "-U", "postgres", "-A", "trust"]
            + ["-E", "UTF8", "--no-locale", "--no-sync"],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        _check(initdb, "initdb")
        log = root / "postgres.log"
        conf = cluster.data / "postgresql.conf"
        base = conf.read_text() + SETTINGS
        for attempt in range(START_ATTEMPTS):
            cluster.port = _free_port()
            conf.write_text(base + f"port = {cluster.port}\n")
            started = subprocess.run(
                [*run_as, str(BIN / "pg_ctl"), "start", "-D", str(cluster.data), "-l", str(log), "-w"]
                + ["-t", str(START_TIMEOUT_S)],
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S + 10,
            )
            if started.returncode == 0:
                return cluster
            if attempt == START_ATTEMPTS - 1:
                _check(started, "pg_ctl start", log)
    except BaseException:
        cluster.stop()
        raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """One PostgreSQL cluster for the whole test session."""
    cluster = start_cluster()
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
