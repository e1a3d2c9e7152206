"""What `devd run` and `devd attach` show, from the notices alone (devd.agent.cli.Screen): no terminal, no daemon."""

from __future__ import annotations

import io

from devd.agent.cli import Screen
from devd.client import ActionsNotice
from devd.messages import Action, Answer, Call, Event, Exec, Message, Op, Output, Read, Reply, Turn, ask, done
from devd.protocol import DeltaNotice, StalledNotice


def shown(*notices: object, turn: int | None = 1) -> str:
    out = io.StringIO()
    screen = Screen(out, turn=turn)
    for notice in notices:
        screen.show(notice)  # type: ignore[arg-type]
    return out.getvalue()


def step(event: Event, *ops: Op) -> ActionsNotice:
    return ActionsNotice("s", 1, event, [Action(id=10 + i, op=op) for i, op in enumerate(ops)])


TURN = Event(Turn=Turn(id=1, prompt="go"))
EXEC = Op(Exec=Exec(argv=["make", "test"]))


def test_streamed_text_is_shown_once_and_each_call_and_its_result_on_lines_of_their_own() -> None:
    answered = Event(Model=Answer(id=1, reply=Reply(text="Let me run it.", calls=[Call(Exec=Exec(argv=["make"]))])))
    assert (
        shown(
            step(TURN, ask(Message(User="go"))),
            DeltaNotice("s", 1, "Let me "),
            DeltaNotice("s", 1, "run it."),
            ActionsNotice("s", 2, answered, [Action(id=2, op=Op(Emit="Let me run it.")), Action(id=3, op=EXEC)]),
            step(Event(Exec=Output(id=3, text="1 failed\n[exit status 1]", failed=True))),
            step(Event(Model=Answer(id=4, reply=Reply(text="Fixed."))), Op(Emit="Fixed."), done(1)),
        )
        == "Let me run it.\n$ make test\n  ✗ 1 failed\n  [exit status 1]\nFixed.\n[turn 1 complete]\n"
    )


def test_a_long_result_is_cut_to_its_first_lines_and_counted() -> None:
    output = Output(id=10, text="".join(f"line {n}\n" for n in range(12)))
    text = shown(step(TURN, Op(Read=Read(path="a.txt"))), step(Event(File=output)))
    assert text.splitlines()[-2:] == ["  line 7", "  … 4 more lines"]


def test_a_stall_is_shown_in_its_own_words() -> None:
    spend = (
        "spend ceiling reached: the turn's ceiling is 1000 tokens; the call was not sent: raise it, then session/resume"
    )
    assert shown(StalledNotice("s", 1, spend)) == f"[the turn waits: {spend}]\n"


def test_the_done_of_another_turn_does_not_end_this_one() -> None:
    assert shown(step(TURN, done(7)), turn=1) == ""
