"""Sessions whose asks carry only what is new (`Config(asks="delta")`), and `session/transcript`, through the real
daemon: the asks add up to the conversation across restarts, hibernation, forks and keyed retries."""

from __future__ import annotations

from pathlib import Path

import pytest

from devd import errors
from devd.client import Client
from devd.messages import Action, Agent, Ask, Call, Config, Event, Exec, Message, Output, answer, turn
from tests.harness import InProcess

DELTA = Config(model="m", asks="delta")


def the_ask(actions: list[Action]) -> Ask:
    asks = [a.op.Model for a in actions if a.op.Model is not None]
    assert len(asks) == 1, actions
    return asks[0]


def one_turn(c: Client, session: str, n: int, kept: list[Message]) -> None:
    """Turn n: a prompt, an Exec, its result, a text answer; every ask's messages are appended to `kept` after
    checking that they start where `kept` ends."""
    first = the_ask(c.step(session, turn(n, f"step {n}")))
    assert first.from_ == len(kept)
    kept.extend(first.messages)
    actions = c.step(session, answer(c_id(c, session), calls=[Call(Exec=Exec(argv=["make", str(n)]))]))
    second = the_ask(c.step(session, Event(Exec=Output(id=actions[0].id, text=f"out {n}"))))
    assert second.from_ == len(kept)
    kept.extend(second.messages)
    c.step(session, answer(c_id(c, session), text=f"done {n}"))


def c_id(c: Client, session: str) -> int:
    """The id of the Model ask the session waits for."""
    (pending,) = c.pending(session)
    return pending.id


def test_a_delta_sessions_asks_add_up_to_its_transcript_across_restarts_and_hibernation(tmp_path: Path) -> None:
    kept: list[Message] = []
    d = InProcess(tmp_path, "--max-live", "1", "--snapshot-floor", "0").start()
    try:
        with d.client() as c:
            c.new(DELTA, session="a")
            one_turn(c, "a", 1, kept)
            c.new(session="other")  # "a" hibernates: it comes back from its snapshot (layout 2) and journal
            one_turn(c, "a", 2, kept)
        d.stop()
        d.start()
        with d.client() as c:
            one_turn(c, "a", 3, kept)
            assert c.transcript("a") == [*kept, Message(Agent=Agent(text="done 3"))]
    finally:
        d.stop()


def test_a_delta_ask_names_the_model_and_starts_at_the_first_message_not_sent(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(DELTA, session="a")
        c.step("a", turn(1, "one"))
        c.step("a", answer(1, text="first"))
        assert the_ask(c.step("a", turn(2, "two"))) == Ask(
            model="m",
            from_=1,
            messages=[Message(Agent=Agent(text="first")), Message(User="two")],
        )


def test_a_keyed_retry_of_a_delta_ask_after_a_restart_derives_the_same_bytes(tmp_path: Path) -> None:
    d = InProcess(tmp_path).start()
    try:
        with d.client() as c:
            c.new(DELTA, session="a")
            c.step("a", turn(1, "one"))
            c.step("a", answer(1, calls=[Call(Exec=Exec(argv=["echo", "x" * 20_000]))]))
            # The ask carries the 20 KB call back: far larger than this event, so journalled as its digest alone.
            event = Event(Exec=Output(id=2, text="ok"))
            first = c.step_answer("a", event, key="result-2")
        d.stop()
        d.start()
        with d.client() as c:
            again = c.step_answer("a", event, key="result-2")
        assert (again.actions, again.replayed, len(the_ask(first.actions).messages)) == (first.actions, True, 2)
    finally:
        d.stop()


def test_a_fork_of_a_delta_session_owes_the_ask_the_source_owed_at_that_step(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(DELTA, session="a")
        c.step("a", turn(1, "one"))
        c.step("a", answer(1, calls=[Call(Exec=Exec(argv=["make"]))]))
        asked = c.step("a", Event(Exec=Output(id=2, text="built")))
        c.step("a", answer(3, text="done"))
        c.fork("a", at=3, name="b")
        assert c.pending("b") == asked


def test_a_transcript_from_past_its_end_is_empty_and_from_a_negative_index_is_refused(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(DELTA, session="a")
        c.step("a", turn(1, "one"))
        assert c.transcript("a", 1) == []
        with pytest.raises(errors.InvalidParamsError, match="^from must be a message index, 0 to 2147483647$"):
            c.transcript("a", -1)


def test_a_default_session_gives_its_transcript_too(tmp_path: Path) -> None:
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(session="a")
        c.step("a", turn(1, "one"))
        c.step("a", answer(1, text="first"))
        assert c.transcript("a") == [Message(User="one"), Message(Agent=Agent(text="first"))]


def test_a_delta_sessions_transcript_too_large_for_its_cap_is_still_given_whole(tmp_path: Path) -> None:
    """A delta client recovers its conversation from session/transcript: past ~10 MiB of tool output the transcript
    no longer fits beside the session's state in its 64 MiB, while its steps go on; it is built outside the cap."""
    with InProcess(tmp_path) as d, d.client() as c:
        c.new(DELTA, session="a")
        (ask,) = c.step("a", turn(1, "go"))
        for _ in range(12):
            (call,) = c.step("a", answer(ask.id, calls=[Call(Exec=Exec(argv=["cat"]))]))
            (ask,) = c.step("a", Event(Exec=Output(id=call.id, text="x" * (1 << 20))))
        messages = c.transcript("a")
    tools = [m.Tool for m in messages if m.Tool is not None]
    assert (len(messages), [len(t.text) for t in tools]) == (25, [1 << 20] * 12)
