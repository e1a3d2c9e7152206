"""A state directory written by the first release opens with this one, and its sessions continue, seq and keys intact;
so does one written by the release before core ABI 2 (its core built from its source, b69a352's core/), every session
with the exact actions that release answers.

The fixture is made here, from a pinned copy of the first release's schema (which set no `user_version` and had no
`meta` table), filled with a session as that release journalled it: every step's event and actions, its keys and
digests, and the snapshot taken when the core asked to Save.
"""

from __future__ import annotations

import io
import sqlite3
import subprocess
import tarfile
import time
from contextlib import closing
from pathlib import Path

import msgspec
import pytest

from devd.host import Core
from devd.messages import (
    Action,
    Call,
    Config,
    Event,
    Exec,
    Op,
    Output,
    Read,
    ToolCall,
    answer,
    decode_actions,
    encode,
    turn,
)
from devd.sessions.history import digest
from devd.storage.sqlite import FILE_SNAPSHOT_BYTES, MIGRATIONS
from devd.storage.store import Counter, Health, Step, Stored, Tally
from hatch_build import build_core
from tests.agents import conversation, next_notice, start, until_done, watch_raw
from tests.daemon import ROOT, Daemon
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.stores import running, sqlite_at

__all__ = ["standin_fixture"]

INTERRUPTED = (
    "interrupted: the daemon stopped while this command ran, so it may have partly run; it was not run again "
    "(check the workspace before you run it again)"
)

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


# -- the previous release's core (ABI 1) --------------------------------------------------------------------------

# The core of the release before ABI 2, built here from core/ as that release had it (b69a352, taken from the
# repository's history: a built module is never committed; reproducible, sha256 2815b4a3...77c7f3), once per worker.
# A daemon of this version still opens it (`--core`: ABI 2 extends ABI 1), so a state directory is written here just
# as the previous release wrote it: the same store, the same snapshots and journal rows.
ABI1_RELEASE = "b69a352"


@pytest.fixture(scope="session")
def abi1_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("core-abi1")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ABI1_RELEASE, "core"], capture_output=True, timeout=60, check=False
    )
    if archive.returncode != 0:
        pytest.fail(
            f"the previous release's core is built from commit {ABI1_RELEASE}'s core/, which this clone lacks "
            f"({archive.stderr.decode(errors='replace').strip()}): fetch the history (git fetch --unshallow)"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    build_core(root, root / "core-abi1.wasm")
    return root / "core-abi1.wasm"


BUILD, LIB, OUTSIDE = (
    Call(Exec=Exec(argv=["cargo", "build"])),
    Call(Read=Read(path="src/lib.rs")),
    Call(Read=Read(path="../x")),
)
# Each session of the previous release: its config, the events it was stepped with there, and those it is stepped with
# after the upgrade (each with the key it is sent under).
SESSIONS: dict[str, tuple[Config, list[Event], list[Event]]] = {
    "asking": (Config(model="zen5"), [turn(1, "fix the build")], [answer(1, "fixed")]),
    "calls": (
        Config(),
        [
            turn(1, "fix the build"),
            answer(1, "Let me look.", [BUILD, LIB, OUTSIDE]),
            Event(Exec=Output(id=2, text="error", failed=True)),
            turn(2, "and the tests"),
        ],
        [Event(File=Output(id=3, text="fn f() {}")), answer(6, "fixed"), answer(10, "tested")],
    ),
    "delta": (
        Config(asks="delta"),
        [turn(1, "p"), answer(1, calls=[Call(Read=Read(path="a"))]), Event(File=Output(id=2, text="x"))],
        [answer(3, "done"), turn(2, "q")],
    ),
    "done": (Config(), [turn(1, "hi"), answer(1, "hello")], [turn(2, "again"), answer(5, "hello again")]),
}
FORK_AT = 2  # "forked" is "calls" up to its step 2: both its calls still waited for
FORKED_AFTER = [Event(File=Output(id=3, text="lib")), Event(Exec=Output(id=2, text="built")), answer(5, "ok")]


def _answers(core: Core, config: Config, events: list[Event]) -> list[bytes]:
    instance = core.new(config)
    try:
        return [instance.step_raw(encode(e)) for e in events]
    finally:
        instance.close()


def test_a_state_directory_of_the_previous_release_continues_every_session_with_the_exact_actions(
    tmp_path: Path, core: Core, abi1_core: Path
) -> None:
    """Written by a daemon running the ABI-1 core (sessions asking, waiting for calls with a turn queued, a delta
    session, a finished one, a fork, one hibernated, and a client's snapshot), then opened by this daemon with the
    ABI-2 core: every session is rebuilt (the replay check passing), waits for what it waited for, replays a kept key,
    and answers every next step with exactly the actions the previous release answers, and a Tool call after."""
    previous = Core.open(abi1_core)
    with InProcess(tmp_path, "--core", str(abi1_core), "--max-live", "2") as d, d.client() as c:
        for name, (config, before, _) in SESSIONS.items():
            c.new(config, session=name)
            for n, event in enumerate(before):
                c.step(name, event, key=f"{name}-{n}")
        c.fork("calls", at=FORK_AT, name="forked")
        held = c.snapshot("calls")
        pending = {name: c.pending(name) for name in [*SESSIONS, "forked"]}
        hibernated = [s["session"] for s in c.call("session/list")["sessions"] if s["state"] == "stored"]
    assert hibernated != []

    want = {
        name: _answers(previous, config, before + after)[len(before) :]
        for name, (config, before, after) in SESSIONS.items()
    }
    want["forked"] = _answers(previous, Config(), SESSIONS["calls"][1][:FORK_AT] + FORKED_AFTER)[FORK_AT:]
    want_held = _answers(previous, Config(), SESSIONS["calls"][1] + SESSIONS["calls"][2])[4:]
    previous.close()
    with InProcess(tmp_path) as d, d.client() as c:
        assert {name: c.pending(name) for name in pending} == pending
        last = len(SESSIONS["calls"][1]) - 1
        replay = c.step_result("calls", SESSIONS["calls"][1][last], key=f"calls-{last}")
        assert (replay["replayed"], replay["actions"]) == (True, [{"id": 5, "op": {"Save": True}}])
        restored = c.restore(held)
        got = {name: [c.step(name, e) for e in after] for name, (_, _, after) in SESSIONS.items()}
        got["forked"] = [c.step("forked", e) for e in FORKED_AFTER]
        got_held = [c.step(restored, e) for e in SESSIONS["calls"][2]]
        assert (got, got_held) == (
            {name: [decode_actions(a) for a in answers] for name, answers in want.items()},
            [decode_actions(a) for a in want_held],
        )
        search = Call(Tool=ToolCall(name="search", input=msgspec.Raw(b'{"q": "x"}')))
        c.step("done", turn(3, "search"))
        assert c.step("done", answer(9, calls=[search])) == [Action(id=10, op=Op(Tool=search.Tool))]


def test_the_agents_approvals_and_claims_of_the_previous_release_carry_over(
    tmp_path: Path, standin: Standin, abi1_core: Path
) -> None:
    """A daemon of the previous release (the ABI-1 core) killed with a write awaiting approval in one session and a
    command claimed and running in another: this daemon asks for the same approval again and runs the write once it
    is given, steps the command `interrupted` without running it again, and both turns end."""
    previous = start(tmp_path, standin, "--core", str(abi1_core), write='"ask"')
    standin.script(
        Scripted(tool_calls=[("write", {"path": "w.txt", "text": "x"})]),
        Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs; sleep 60"]})]),
        Scripted(text="done"),
        Scripted(text="done"),
    )
    with previous.client() as c:
        asking, running = previous.session(c), previous.session(c)
        watch_raw(c, asking)
        c.prompt(asking, "write")
        asked = next_notice(c, "session/approval")
        c.prompt(running, "run it")
    deadline = time.monotonic() + 20
    while not (previous.workspace / "runs").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    previous.daemon.kill()

    current = previous.daemon
    current.args = tuple(a for a in current.args if a not in ("--core", str(abi1_core)))  # the packaged core
    current.start()
    try:
        with current.client() as c:
            watch_raw(c, asking, since=0)
            again = next_notice(c, "session/approval")
            approve = {k: again.params[k] for k in ("session", "action", "digest")}
            c.call("session/approve", approve | {"decision": "allow"})
            until_done(c, 1)
            watch_raw(c, running, since=0)
            until_done(c, 1)
            assert (
                again.params == asked.params,
                (previous.workspace / "w.txt").read_text(),
                (previous.workspace / "runs").read_text(),
                conversation(c, asking)[-2:],
                conversation(c, running)[-2:],
            ) == (
                True,
                "x",
                "run\n",
                [{"Tool": {"id": 2, "text": "wrote 1 bytes to w.txt"}}, {"Agent": {"text": "done"}}],
                [{"Tool": {"id": 2, "text": INTERRUPTED, "failed": True}}, {"Agent": {"text": "done"}}],
            )
    finally:
        current.stop()
