"""The bounded conversation through the daemon (devd/sessions/summaries.py): a Summary event is journalled like every
event, a refused one changes nothing, and what summaries replaced stays readable with `session/transcript`'s `whole`,
after a restart and in a fork too; an agent session's requests after one keep what the transcript does not hold (a
rejected reply) where it was."""

from __future__ import annotations

import msgspec
import pytest

from devd import errors
from devd.client import Client
from devd.errors import InternalError
from devd.messages import Event, Message, Summarize, Summary, answer, decode_messages, turn
from devd.sessions import summaries
from tests.agents import Agentd, agentd, run_turn
from tests.harness import InProcess
from tests.helpers import agent, user
from tests.standin_model import Scripted, standin_fixture

__all__ = ["agentd", "standin_fixture"]

WHOLE = [user("p"), agent("a"), user("q"), agent("b"), user("r")]


def summary(upto: int, text: str) -> Event:
    return Event(Summary=Summarize(upto=upto, text=text))


def two_turns_summarised(c: Client) -> None:
    """Turns p and q answered, a Summary of both, then turn r asked."""
    c.new(session="s")
    for event in (turn(1, "p"), answer(1, "a"), turn(2, "q"), answer(5, "b"), summary(4, "p and q")):
        c.step("s", event)
    c.step("s", turn(3, "r"))


def test_the_whole_conversation_is_what_summaries_replaced_then_what_the_model_is_sent(daemon: InProcess) -> None:
    with daemon.client() as c:
        two_turns_summarised(c)
        assert (c.transcript("s"), c.transcript("s", whole=True), c.transcript("s", 3, whole=True)) == (
            [Message(Summary=Summary(text="p and q", replaced=4)), user("r")],
            WHOLE,
            WHOLE[3:],
        )


def test_a_summary_whose_name_is_written_with_a_json_escape_keeps_what_it_replaced(daemon: InProcess) -> None:
    """The core reads `"\\u0053ummary"` as "Summary" and took the event; the daemon, looking for the bytes
    `"Summary"`, kept nothing, and the whole conversation was lost (InternalError: 0 of 2 messages kept)."""
    with daemon.client() as c:
        c.new(session="s")
        for event in (turn(1, "p"), answer(1, "a"), turn(2, "q")):
            c.step("s", event)
        c.call("session/step", {"session": "s", "event": msgspec.Raw(b'{"\\u0053ummary":{"upto":2,"text":"p, a"}}')})
        assert c.transcript("s", whole=True) == WHOLE[:3]


def test_a_second_summary_adds_to_what_the_whole_conversation_keeps(daemon: InProcess) -> None:
    with daemon.client() as c:
        two_turns_summarised(c)
        c.step("s", answer(9, "c"))
        assert c.step("s", summary(2, "p, q and r")) == []
        assert (c.transcript("s"), c.transcript("s", whole=True)) == (
            [Message(Summary=Summary(text="p, q and r", replaced=5)), agent("c")],
            [*WHOLE, agent("c")],
        )


def test_the_whole_conversation_survives_a_restart_and_goes_with_a_fork(daemon: InProcess) -> None:
    with daemon.client() as c:
        two_turns_summarised(c)
    daemon.stop()
    daemon.start()
    with daemon.client() as c:
        forked = c.fork("s", name="f")
        assert (c.transcript("s", whole=True), c.transcript(forked, whole=True)) == (WHOLE, WHOLE)


def test_a_refused_summary_is_malformed_says_why_and_is_not_journalled(daemon: InProcess) -> None:
    with daemon.client() as c:
        c.new(session="s")
        c.step("s", turn(1, "p"))
        seq = c.call("session/list")["sessions"][0]["seq"]
        with pytest.raises(errors.MalformedError, match="the session refuses this Summary as it stands"):
            c.step("s", summary(2, "too far"))
        assert (c.call("session/list")["sessions"][0]["seq"], c.transcript("s", whole=True)) == (seq, [user("p")])


# -- the pure part --------------------------------------------------------------------------------------------------


def _encoded(*messages: Message) -> bytes:
    return msgspec.json.encode(list(messages))


def test_a_record_retried_with_its_step_is_read_once() -> None:
    record = summaries.replaced(_encoded(user("p"), agent("a")), msgspec.json.encode(summary(2, "s")))
    current = _encoded(Message(Summary=Summary(text="s", replaced=2)), user("q"))
    assert decode_messages(summaries.whole([record, record], current, 0)) == [user("p"), agent("a"), user("q")]


def test_a_summary_whose_record_was_lost_says_which_messages_are_missing() -> None:
    current = _encoded(Message(Summary=Summary(text="s", replaced=2)), user("q"))
    with pytest.raises(InternalError, match="the session's summary stands for 2 messages and 0 were kept"):
        summaries.whole([], current, 0)


def test_a_rejected_reply_is_sent_where_it_was_after_a_summary_replaced_the_start(agentd: Agentd) -> None:
    """The rejected reply of turn "first" is kept apart from the transcript, before its message 3 of the whole
    conversation; a Summary of the first two put it between the read call and its result, and the model server
    refused every later request (400: the call had no result), stalling the session for good."""
    (agentd.workspace / "a").write_text("A\n")
    agentd.standin.script(
        Scripted(text="z0"),
        Scripted(tool_calls=[("nope", {})]),
        Scripted(tool_calls=[("read", {"path": "a"})]),
        Scripted(text="one"),
        Scripted(text="two"),
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "zero")
        run_turn(c, session, "first")
        c.step(session, summary(2, "zero, then z0"))
        run_turn(c, session, "second")
    sent = [
        (m["role"], [t["function"]["name"] for t in m.get("tool_calls") or []])
        for m in agentd.standin.requests[4].body["messages"]
        if m["role"] != "system"
    ]
    assert sent == [
        ("user", []),
        ("user", []),
        ("assistant", ["nope"]),
        ("tool", []),
        ("assistant", ["read"]),
        ("tool", []),
        ("assistant", []),
        ("user", []),
    ]
