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
from devd.sessions.history import digest
from devd.storage.sqlite import FILE_SNAPSHOT_BYTES, MIGRATIONS
from devd.storage.store import Counter, Health, Step, Stored, Tally
from tests.daemon import Daemon
from tests.harness import InProcess
from tests.stores import running, sqlite_at

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
    with InProcess(tmp_path) as d, d.client() as c:
        listed = [(s["session"], s["state"], s["seq"]) for s in c.call("session/list")["sessions"]]
        assert listed == [("old", "stored", 3)]
        replay = c.step_result("old", EVENTS[1], key=KEYS[1])
        assert (replay["replayed"], replay["actions"]) == (True, msgspec.json.decode(answered[1]))
        assert c.step("old", answer(4, "tests pass")) == decode_actions(expected_next)


def test_the_upgrade_records_the_format_it_brought_the_database_to(tmp_path: Path, core: Core) -> None:
    first_release_state(tmp_path / "state", core)
    with InProcess(tmp_path):
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


def test_a_database_refused_for_its_identity_is_not_migrated_first(tmp_path: Path) -> None:
    """Another state directory's database, of an older format, put in place of ours: refused, and left exactly as it
    was (the message says so), not brought to this devd's format on the way."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with closing(sqlite3.connect(state / "devd.sqlite3", isolation_level=None)) as db:
        for version, migration in enumerate(MIGRATIONS[:2], start=1):
            db.executescript(f"BEGIN; {migration} PRAGMA user_version = {version}; COMMIT;")
        db.execute("INSERT INTO meta (key, value) VALUES ('id', 'theirs')")
    (state / "devd.sqlite3.id").write_text("mine\n")
    d = Daemon(tmp_path)
    with pytest.raises(RuntimeError, match="is not the database this state directory was made with"):
        d.start()
    with closing(sqlite3.connect(state / "devd.sqlite3")) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2


async def test_a_format_4_database_keeps_its_snapshots_and_takes_large_ones_in_files(tmp_path: Path) -> None:
    """Format 5 adds where a snapshot file is named: a format-4 row's inline snapshot still loads, and the next large
    snapshot goes to a file."""
    path = tmp_path / "devd.sqlite3"
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        for version, migration in enumerate(MIGRATIONS[:4], start=1):
            db.executescript(f"BEGIN; {migration} PRAGMA user_version = {version}; COMMIT;")
        db.execute("INSERT INTO sessions (name, config, created) VALUES ('old', x'7b7d', 0)")
        db.execute(
            "INSERT INTO journal (session, seq, event, actions, snapshot, answer, at) "
            "VALUES ('old', 1, x'01', x'', x'5331', x'02', 0)"
        )
    large = b"L" * FILE_SNAPSHOT_BYTES
    async with running(sqlite_at(path)) as store:
        before = await store.load("old")
        await store.append(Step("old", 2, b"e2", None, None, None, large, b"h2"))
        await store.flush()
        after = await store.load("old")
    assert (before, after) == (
        Stored("old", b"{}", b"S1", 1, Health.OK, None, []),
        Stored("old", b"{}", large, 2, Health.OK, None, []),
    )


async def test_a_format_7_database_counts_the_spend_its_usage_records_kept(tmp_path: Path) -> None:
    """Format 8 keeps spend in counters: a format-7 database's usage and refusal records are counted into them once,
    a fork's copies for its source only, so a day's ceiling still refuses after the upgrade."""
    path = tmp_path / "devd.sqlite3"
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        for version, migration in enumerate(MIGRATIONS[:7], start=1):
            db.executescript(f"BEGIN; {migration} PRAGMA user_version = {version}; COMMIT;")
        for name in ("a", "f"):
            db.execute("INSERT INTO sessions (name, config, created) VALUES (?, x'7b7d', 0)", (name,))
        used = (
            b'{"session":"a","profile":"coder","turn":2,"day":"2026-12-01",'
            b'"usage":{"input_tokens":%d,"output_tokens":5}}'
        )
        refused = b'{"session":"a","turn":2,"ceiling":"c","limit":1,"spent":0,"reserved":0,"needed":9,"message":"m"}'
        rows = [("a", 1, "usage", used % 100), ("a", 2, "usage", used % 200), ("a", 3, "refusal", refused)]
        rows += [("f", 1, "usage", used % 100)]  # the fork's copy of a's first
        db.executemany(
            "INSERT INTO records (session, n, seq, kind, action, body, at) VALUES (?, ?, 0, ?, 0, ?, 0)", rows
        )
    async with running(sqlite_at(path)) as store:
        counted = await store.counted(
            [Counter("turn", "a", "2"), Counter("session", "a", ""), Counter("day", "coder", "2026-12-01")]
        )
        tallies = (await store.tally("a"), await store.tally("f"))
    assert (counted, tallies) == ([(310, 0), (310, 0), (310, 0)], (Tally(300, 10, 0, 2, 1), Tally()))
