"""`bench daemon`'s durable floors (benchmarks.bench): a request is answered only once its row is committed, so a
SIGKILL after the answers leaves every answered request on disk; the floor with the core answers each step with what
the core answers, as devd does."""

from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from devd.host import Core
from tests.daemon import daemon_env
from tests.helpers import seed_turn

REQUESTS = 5


@contextlib.contextmanager
def floor(tmp_path: Path, *flags: str) -> Iterator[socket.socket]:
    """A durable floor serving on a connected socket; SIGKILLed when the block ends."""
    sock = tmp_path / "floor.sock"
    argv = [sys.executable, "-m", "benchmarks.bench", "_durable_floor", str(sock), str(tmp_path / "floor.sqlite3")]
    proc = subprocess.Popen([*argv, *flags], stdout=subprocess.PIPE, env=daemon_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            yield s
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def answers(s: socket.socket, requests: list[bytes]) -> list[bytes]:
    s.sendall(b"".join(requests))
    answered = b""
    while answered.count(b"\n") < len(requests):
        answered += s.recv(65536)
    return answered.splitlines()


def rows(tmp_path: Path) -> int:
    with contextlib.closing(sqlite3.connect(tmp_path / "floor.sqlite3")) as db:
        return int(db.execute("SELECT COUNT(*) FROM requests").fetchone()[0])


def test_every_request_the_durable_floor_answered_is_a_row_after_a_sigkill(tmp_path: Path) -> None:
    with floor(tmp_path) as s:
        answers(s, [b'{"jsonrpc":"2.0","id":%d,"method":"session/step","params":{}}\n' % i for i in range(REQUESTS)])
    assert rows(tmp_path) == REQUESTS


def _seed_requests() -> list[bytes]:
    new = b'{"jsonrpc":"2.0","id":0,"method":"session/new","params":{"session":"a"}}\n'
    steps = [
        b'{"jsonrpc":"2.0","id":%d,"method":"session/step","params":{"session":"a","event":%s}}\n' % (i + 1, event)
        for i, event in enumerate(seed_turn(1, 1))
    ]
    return [new, *steps]


def test_the_durable_floor_with_the_core_answers_each_step_with_the_cores_actions(tmp_path: Path) -> None:
    session = Core.open().new()
    expected = [b'{"jsonrpc":"2.0","id":0,"result":{"actions":[]}}'] + [
        b'{"jsonrpc":"2.0","id":%d,"result":{"actions":%s}}' % (i + 1, session.step_raw(event))
        for i, event in enumerate(seed_turn(1, 1))
    ]
    with floor(tmp_path, "--core") as s:
        assert answers(s, _seed_requests()) == expected


def test_every_step_the_durable_floor_with_the_core_answered_is_a_row_after_a_sigkill(tmp_path: Path) -> None:
    with floor(tmp_path, "--core") as s:
        answers(s, _seed_requests())
    assert rows(tmp_path) == len(_seed_requests())


def test_bench_daemon_refuses_the_baseline_servers_without_a_checkout_to_run(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "daemon", "--servers", "devd,devd-baseline", "--baseline"]
    done = subprocess.run([*argv, str(tmp_path)], capture_output=True, env=daemon_env(), timeout=60)
    assert (done.returncode, b"devd-baseline needs --baseline PATH" in done.stderr) == (2, True)


def test_bench_rows_gives_each_table_its_cpu_and_log_pages_a_row(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "benchmarks.bench", "rows", "--rows", "64", "--batch", "8", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, env=daemon_env(), timeout=120, check=True)
    result = json.loads(done.stdout)
    keys = {table: sorted(result[table]) for table in ("journal", "floor", "journal_without_index")}
    each = ["cpu_us_per_row", "cpu_us_per_row_by_round", "frames_per_row", "wall_us_per_row"]
    assert keys == dict.fromkeys(keys, each)
