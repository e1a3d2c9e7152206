"""`bench daemon`'s durable floor (benchmarks.bench): a request is answered only once its row is committed, so a SIGKILL
after the answers leaves every answered request on disk."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.daemon import daemon_env

REQUESTS = 5


def test_every_request_the_durable_floor_answered_is_a_row_after_a_sigkill(tmp_path: Path) -> None:
    sock, db = tmp_path / "floor.sock", tmp_path / "floor.sqlite3"
    argv = [sys.executable, "-m", "benchmarks.bench", "_durable_floor", str(sock), str(db)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=daemon_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            s.sendall(
                b"".join(
                    b'{"jsonrpc":"2.0","id":%d,"method":"session/step","params":{}}\n' % i for i in range(REQUESTS)
                )
            )
            answered = b""
            while answered.count(b"\n") < REQUESTS:
                answered += s.recv(65536)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    with contextlib.closing(sqlite3.connect(db)) as rows:
        assert rows.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == REQUESTS
