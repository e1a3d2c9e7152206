"""Nothing a client was answered is lost: clients step sessions while the daemon is SIGKILLed at random moments.

Each client runs turns (turn, answer) on a session of its own, every step under an idempotency key, and keeps a
model of what the core must answer next. After each kill the daemon restarts; a client whose step got no reply sends
it again with the same key. Every answer, replayed or fresh, must be exactly what the model expects: the ids carry on
where the last answer left them, and no answered turn runs again.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import msgspec
import pytest

from devd.messages import decode_actions
from tests.daemon import Daemon
from tests.helpers import Conversation

KILLS = 25
CLIENTS = 4


def drive(daemon: Daemon, conv: Conversation, stop: threading.Event, wrong: list[str]) -> None:
    while not stop.is_set():
        try:
            with daemon.client() as c:
                while not stop.is_set():
                    key, event, expected = conv.next_step()
                    result = c.step_result(conv.name, event, key=key)  # type: ignore[arg-type]
                    actions = decode_actions(msgspec.json.encode(result["actions"]))
                    if actions != expected:
                        wrong.append(f"{conv.name} {key}: got {actions}, want {expected}")
                        stop.set()
                        return
                    conv.replays += bool(result.get("replayed"))
                    conv.acknowledged()
        except (OSError, ConnectionError):
            time.sleep(0.02)


def test_no_answered_step_is_lost_across_random_sigkills(tmp_path: Path) -> None:
    rng = random.Random(1330)
    # Fewer live instances than clients, and no snapshot floor: kills land in hibernations and snapshot writes too.
    daemon = Daemon(tmp_path, "--max-live", "2", "--snapshot-floor", "0").start()
    names = [f"c{i}" for i in range(CLIENTS)]
    with daemon.client() as c:
        for name in names:
            c.new(session=name)
    conversations = [Conversation(n) for n in names]
    wrong: list[str] = []
    stop = threading.Event()
    threads = [threading.Thread(target=drive, args=(daemon, conv, stop, wrong)) for conv in conversations]
    for t in threads:
        t.start()
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.05, 0.3))
            daemon.kill()
            daemon.start()
            if wrong:
                break
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        daemon.stop()
    acked = sum(c.acked for c in conversations)
    assert (wrong, acked > KILLS * 2) == ([], True)


def step_until_killed(daemon: Daemon, conv: Conversation, steps: int) -> bool:
    """Step conv with keyed steps until it has `steps` acknowledged or the daemon dies; whether it died."""
    try:
        with daemon.client() as c:
            while conv.acked < steps:
                key, event, expected = conv.next_step()
                result = c.step_result(conv.name, event, key=key)  # type: ignore[arg-type]
                assert decode_actions(msgspec.json.encode(result["actions"])) == expected
                conv.acknowledged()
    except (OSError, ConnectionError):
        return True
    return False


@pytest.mark.parametrize(
    ("point", "nth", "answer_bytes"),
    [
        ("commit.before", 7, 0),
        ("commit.snapshot", 3, 0),
        ("commit.after", 7, 0),
        ("commit.after", 8, 0),
        ("prune", 1, 0),
        # Answers of 64 KB: a few turns in, snapshots pass FILE_SNAPSHOT_BYTES and are written to files of their own.
        ("snapshot.file", 1, 64 << 10),
    ],
)
def test_a_kill_at_every_named_point_loses_no_answered_step_and_half_applies_none(
    tmp_path: Path, point: str, nth: int, answer_bytes: int
) -> None:
    """SIGKILL exactly at a named point (devd.failpoints); after a restart, the step that got no answer is either
    wholly there (its keyed retry is replayed) or not at all (it runs fresh), and everything answered is there."""
    # No floor: snapshots (and so pruning) as often as the log-compaction rule allows, for the points inside them.
    daemon = Daemon(tmp_path, "--snapshot-floor", "0", env={"DEVD_FAILPOINTS": f"{point}=kill@{nth}"}).start()
    try:
        with daemon.client() as c:
            c.new(session="s")
        conv = Conversation("s", answer_bytes)
        died = step_until_killed(daemon, conv, 600)
        assert daemon.proc is not None and daemon.proc.wait(10) == -9 and died
        daemon.env = {}
        daemon.start()
        acked_before = conv.acked
        assert step_until_killed(daemon, conv, acked_before + 4) is False
        with daemon.client() as c:
            assert c.call("session/list")["sessions"][0]["seq"] == conv.acked
    finally:
        daemon.stop()  # a failed assertion must not leave a daemon running
