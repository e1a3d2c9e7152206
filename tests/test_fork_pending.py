"""`session/fork` and `session/pending` end to end: a real daemon, its client and its CLI."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import msgspec
import pytest

from devd import errors
from devd.client import Client
from devd.messages import Action, Call, Event, Exec, Output, Read, answer, turn
from tests.daemon import Daemon
from tests.harness import InProcess


class PendingActions(msgspec.Struct):
    actions: list[Action]


CALLS = [Call(Exec=Exec(argv=["make"])), Call(Read=Read(path="build.log"))]


def waiting_for_calls(client: Client, name: str) -> list[Action]:
    """A session at step 2: a turn whose model asked for an Exec and a Read; the two call actions."""
    client.new(session=name)
    client.step(name, turn(1, "fix the build"))
    return client.step(name, answer(1, calls=CALLS))


def cli(daemon: InProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devd", *args, "--connect", str(daemon.socket)], capture_output=True, text=True
    )


def test_pending_is_every_call_the_core_still_waits_for(client: Client) -> None:
    calls = waiting_for_calls(client, "s")
    assert client.pending("s") == calls


def test_pending_after_one_result_is_the_other_call(client: Client) -> None:
    calls = waiting_for_calls(client, "s")
    client.step("s", Event(Exec=Output(id=calls[0].id, text="ok")))
    assert client.pending("s") == calls[1:]


def test_pending_of_a_finished_turn_is_empty(client: Client) -> None:
    calls = waiting_for_calls(client, "s")
    client.step("s", Event(Exec=Output(id=calls[0].id, text="ok")))
    client.step("s", Event(File=Output(id=calls[1].id, text="log")))
    client.step("s", answer(4, text="done"))
    assert client.pending("s") == []


def test_pending_survives_a_restart(daemon: InProcess) -> None:
    with daemon.client() as c:
        calls = waiting_for_calls(c, "s")
    daemon.stop()
    daemon.start()
    with daemon.client() as c:
        assert c.pending("s") == calls


def test_a_fork_at_the_latest_step_continues_as_its_source_would(client: Client) -> None:
    calls = waiting_for_calls(client, "s")
    assert client.fork("s", name="f") == "f"
    result = Event(Exec=Output(id=calls[0].id, text="ok"))
    assert client.step("f", result) == client.step("s", result)


def test_a_fork_at_an_earlier_step_owes_what_was_owed_then(client: Client) -> None:
    calls = waiting_for_calls(client, "s")
    client.step("s", Event(Exec=Output(id=calls[0].id, text="ok")))
    client.fork("s", at=2, name="f")
    assert (client.pending("f"), client.pending("s")) == (calls, calls[1:])


def test_a_fork_leaves_its_source_untouched(client: Client) -> None:
    waiting_for_calls(client, "s")
    client.fork("s", at=1, name="f")
    sessions = {s["session"]: s["seq"] for s in client.call("session/list")["sessions"]}
    assert sessions == {"s": 2, "f": 1}


def test_a_fork_replays_its_sources_keys(client: Client) -> None:
    client.new(session="s")
    first = client.step("s", turn(1, "fix the build"), key="turn-1")
    client.fork("s", name="f")
    assert client.step_result("f", turn(1, "fix the build"), key="turn-1")["replayed"] is True
    assert client.step("f", turn(1, "fix the build"), key="turn-1") == first


def test_a_fork_survives_a_restart_and_continues(process_daemon: Daemon) -> None:
    with process_daemon.client() as c:
        calls = waiting_for_calls(c, "s")
        c.fork("s", name="f")
    process_daemon.kill()
    process_daemon.start()
    with process_daemon.client() as c:
        result = Event(Exec=Output(id=calls[0].id, text="ok"))
        assert c.step("f", result) == c.step("s", result)


def test_forking_past_the_last_step_is_invalid_params(client: Client) -> None:
    waiting_for_calls(client, "s")
    with pytest.raises(errors.InvalidParamsError, match="fork at 2 or earlier"):
        client.fork("s", at=3)


def test_forking_an_unknown_session_is_handle(client: Client) -> None:
    with pytest.raises(errors.HandleError):
        client.fork("nobody")


def test_a_fork_cannot_take_a_name_in_use(client: Client) -> None:
    waiting_for_calls(client, "s")
    client.new(session="taken")
    with pytest.raises(errors.ExistsError):
        client.fork("s", name="taken")


def test_the_cli_forks_and_prints_the_forks_name(daemon: InProcess) -> None:
    with daemon.client() as c:
        waiting_for_calls(c, "s")
    assert cli(daemon, "fork", "s", "--at", "1", "--as", "f").stdout == "f\n"


def test_the_cli_prints_pending_actions(daemon: InProcess) -> None:
    with daemon.client() as c:
        calls = waiting_for_calls(c, "s")
    out = cli(daemon, "pending", "s").stdout
    assert msgspec.json.decode(out, type=PendingActions).actions == calls


def test_an_ignored_result_is_journalled_without_its_text_so_no_fork_or_rebuild_carries_it(daemon: Daemon) -> None:
    with daemon.client() as c:
        calls = waiting_for_calls(c, "s")
        ignored = c.step_answer("s", Event(Exec=Output(id=99, text="x" * (1 << 20))))  # never dispatched
        c.fork("s", name="f")
    daemon.stop()
    db = sqlite3.connect(daemon.state / "devd.sqlite3")
    try:
        longest = db.execute("SELECT max(length(event)) FROM journal").fetchone()[0]
    finally:
        db.close()
    daemon.start()
    with daemon.client() as c:
        result = Event(Exec=Output(id=calls[0].id, text="ok"))
        carried_on = c.step("f", result) == c.step("s", result)
    assert (ignored.ignored, longest < 1024, carried_on) == ([99], True, True)
