"""A state directory written by the first release opens with this one, and its sessions continue, seq and keys intact.

The fixture is made here, from a pinned copy of the first release's schema (which set no `user_version` and had no
`meta` table), filled with a session as that release journalled it: every step's event and actions, its keys and
digests, and the snapshot taken when the core asked to Save.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import msgspec
import pytest

from devd.host import Core
from devd.messages import answer, decode_actions, encode, turn
from devd.registry import digest
from devd.sqlite_store import MIGRATIONS
from tests.daemon import Daemon

FIRST_RELEASE_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY,
    config BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'ok',
    reason TEXT
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS journal (
    session TEXT NOT NULL,
    seq INTEGER NOT NULL,
    key TEXT,
    digest BLOB,
    event BLOB NOT NULL,
    actions BLOB NOT NULL,
    snapshot BLOB,
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS journal_key ON journal (session, key) WHERE key IS NOT NULL;
"""

EVENTS = [turn(1, "fix the build"), answer(1, "done"), turn(2, "and the tests")]
KEYS = ["turn-1", "answer-1", "turn-2"]


def first_release_state(state: Path, core: Core) -> list[bytes]:
    """A state directory as the first release left it: one session 'old' at step 3; the actions it answered."""
    state.mkdir(mode=0o700)
    instance = core.new()
    answered = []
    with closing(sqlite3.connect(state / "devd.sqlite3")) as db, db:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(FIRST_RELEASE_SCHEMA)
        db.execute("INSERT INTO sessions (name, config) VALUES ('old', ?)", (b"{}",))
        for seq, (event, key) in enumerate(zip(EVENTS, KEYS, strict=True), start=1):
            data = encode(event)
            actions = instance.step_raw(data)
            snapshot = instance.snapshot() if b'{"Save":true}' in actions else None
            db.execute(
                "INSERT INTO journal (session, seq, key, digest, event, actions, snapshot) VALUES (?,?,?,?,?,?,?)",
                ("old", seq, key, digest(data), data, actions, snapshot),
            )
            answered.append(actions)
    instance.close()
    return answered


def test_a_first_release_state_directory_continues_where_it_stopped(tmp_path: Path, core: Core) -> None:
    answered = first_release_state(tmp_path / "state", core)
    reference = core.new()
    for event in EVENTS:
        reference.step_raw(encode(event))
    expected_next = reference.step_raw(encode(answer(4, "tests pass")))
    reference.close()
    with Daemon(tmp_path) as d, d.client() as c:
        listed = [(s["session"], s["state"], s["seq"]) for s in c.call("session/list")["sessions"]]
        assert listed == [("old", "stored", 3)]
        replay = c.step_result("old", EVENTS[1], key=KEYS[1])
        assert (replay["replayed"], replay["actions"]) == (True, msgspec.json.decode(answered[1]))
        assert c.step("old", answer(4, "tests pass")) == decode_actions(expected_next)


def test_the_upgrade_records_the_format_it_brought_the_database_to(tmp_path: Path, core: Core) -> None:
    first_release_state(tmp_path / "state", core)
    with Daemon(tmp_path):
        pass
    with closing(sqlite3.connect(tmp_path / "state" / "devd.sqlite3")) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_a_database_from_a_newer_devd_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with closing(sqlite3.connect(state / "devd.sqlite3")) as db:
        db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    d = Daemon(tmp_path)
    with pytest.raises(RuntimeError, match="written by a newer devd"):
        d.start()
    with closing(sqlite3.connect(state / "devd.sqlite3")) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) + 1
