"""`python -m benchmarks.bench rows`: what one journal row costs the commit thread, against the durable floor's row.

Rows of `bench daemon`'s conversation (16 sessions, each stepped through it by the core, their rows interleaved as
16 clients interleave them) are committed in batches of `--batch`, one INSERT statement a batch, each its own
transaction, with devd's connection settings (WAL, `synchronous=FULL`, exclusive locking, the log checkpointed
past `WAL_BYTES_KEPT` as devd's commit thread does), into three tables, alternated round by round:

- `journal`: devd's own journal, made by its migrations and written by its own `_insert_steps`;
- `floor`: the durable floor with the core's table (`bench daemon`): one row a request, its line and the answer as
  the journal keeps it (whole, or its digest), keyed by an integer that only grows;
- `journal_without_index`: devd's journal's columns in a table without its (session, seq) key.

Reported: CPU (the thread's) and wall time a row, medians of the rounds, and the log's pages written a row (frames:
SQLite writes every page a commit changed whole). What separates `journal` from `journal_without_index` is the
index; from `floor`, the index and the columns.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SESSIONS = 16
_FLOOR = "CREATE TABLE requests (id INTEGER PRIMARY KEY, line BLOB NOT NULL)"
_UNINDEXED = (
    "CREATE TABLE journal (session TEXT NOT NULL, seq INTEGER NOT NULL, key TEXT, digest BLOB, at REAL, answer BLOB, "
    "snapshot_file TEXT, snapshot BLOB, actions BLOB NOT NULL, event BLOB NOT NULL)"
)
TABLES = ("journal", "floor", "journal_without_index")


def _rows() -> list[tuple[str, int, bytes, bytes]]:
    """(session, seq, event, actions) of 16 sessions stepped through the conversation, interleaved."""
    from benchmarks.bench import _conversation
    from devd.host import Core
    from devd.sessions.registry import made_up_name

    core = Core.open()
    events = _conversation()
    per_session = []
    for _ in range(SESSIONS):
        instance, name = core.new(), made_up_name()
        per_session.append([(name, seq, e, instance.step_raw(e)) for seq, e in enumerate(events, 1)])
        instance.close()
    return [row for steps in zip(*per_session, strict=True) for row in steps]


def _open(path: Path, table: str) -> sqlite3.Connection:
    from devd.storage.sqlite import SQLiteStore, _connect

    if table == "journal":
        SQLiteStore(path, keys_kept=1000, steps_kept=1000, prune_every_steps=256).close()  # devd's migrations
        return _connect(path)
    db = _connect(path)
    db.execute(_FLOOR if table == "floor" else _UNINDEXED)
    return db


def _round(table: str, rows: list[tuple[str, int, bytes, bytes]], count: int, batch: int) -> dict[str, float]:
    from devd.sessions.compaction import kept_answer
    from devd.storage.sqlite import WAL_BYTES_KEPT, _insert_steps
    from devd.storage.store import Step, answer_digest

    root = Path(tempfile.mkdtemp(prefix="devd-bench-rows-"))
    path = root / "db.sqlite3"
    db = _open(path, table)
    wal = Path(f"{path}-wal")
    # Built before the clock starts: what the loop hands the commit thread, not the thread's own work.
    steps = []
    for i in range(count):
        session, seq, event, actions = rows[i % len(rows)]
        seq += (i // len(rows)) * 1000  # past the conversation: the same rows again, under seqs not yet used
        kept = kept_answer(event, actions)
        steps.append(Step(session, seq, event, kept, None, None, None, answer_digest(actions)))
    frames = 0
    cpu, wall = time.thread_time(), time.perf_counter()
    for start in range(0, count, batch):
        chunk = steps[start : start + batch]
        if table == "floor":
            db.execute(
                "INSERT INTO requests (line) VALUES " + ",".join(["(?)"] * len(chunk)),
                [s.event + (s.actions or s.answer or b"") for s in chunk],
            )
        else:
            _insert_steps(db, [(s, None) for s in chunk])
        if wal.stat().st_size > WAL_BYTES_KEPT:
            frames += db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()[1]
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    frames += db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()[1]
    db.close()
    for f in root.iterdir():
        f.unlink()
    root.rmdir()
    return {
        "cpu_us_per_row": cpu / count * 1e6,
        "wall_us_per_row": wall / count * 1e6,
        "frames_per_row": frames / count,
    }


def bench_rows(count: int, batch: int, rounds: int) -> dict[str, Any]:
    from devd import log

    log.configure(None, "warning")  # the migrations' info lines would go to stdout, before the result
    rows = _rows()
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in TABLES}
    for _ in range(rounds):
        for table in TABLES:
            runs[table].append(_round(table, rows, count, batch))
    result: dict[str, Any] = {"rows": count, "batch": batch, "rounds": rounds}
    for table, measured in runs.items():
        result[table] = {k: round(statistics.median(m[k] for m in measured), 2) for k in measured[0]}
        result[table]["cpu_us_per_row_by_round"] = [round(m["cpu_us_per_row"], 1) for m in measured]
    floor = result["floor"]["cpu_us_per_row"]
    result["journal_over_floor"] = round(result["journal"]["cpu_us_per_row"] / floor, 2)
    result["journal_without_index_over_floor"] = round(result["journal_without_index"]["cpu_us_per_row"] / floor, 2)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=6000)
    p.add_argument("--batch", type=int, default=8, help="rows a commit (16 clients give devd about 4 to 8)")
    p.add_argument("--rounds", type=int, default=3)
