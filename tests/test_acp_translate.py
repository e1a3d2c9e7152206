"""The translation of the daemon's notices into ACP `session/update`s, and ACP's wire: pure, no daemon, no editor."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from devd.acp import wire
from devd.acp.bridge import _decision
from devd.acp.translate import (
    ApprovalNotice,
    DecidedNotice,
    DeltaNotice,
    SessionView,
    notice,
    replay,
    transcript_updates,
)
from devd.client import ActionsNotice
from devd.errors import InvalidParamsError, ParseError
from devd.messages import (
    Action,
    Agent,
    Call,
    Cancel,
    Dispatch,
    Event,
    Exec,
    Message,
    Op,
    Output,
    Read,
    Tool,
    Write,
    answer,
    done,
    turn,
)

WS = "/home/me/src/app"


def step(seq: int, event: Event, *ops: tuple[int, Op]) -> ActionsNotice:
    return ActionsNotice("s", seq, event, [Action(id=i, op=op) for i, op in ops])


def plain(updates: list[wire.Update]) -> list[dict[str, Any]]:
    return [wire.to_builtins(u) for u in updates]


def result(kind: str, id: int, text: str, failed: bool = False) -> Event:
    return Event(**{kind: Output(id=id, text=text, failed=failed)})


def test_a_turn_another_client_started_is_a_user_message_chunk() -> None:
    view = SessionView("s", WS)
    updates = view.take(step(1, turn(1, "fix the build")))
    assert plain(updates) == [
        {"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": "fix the build"}}
    ]


def test_a_prompt_this_editor_sent_is_not_echoed_back() -> None:
    view = SessionView("s", WS)
    view.expect_prompt("fix the build")
    assert view.take(step(1, turn(1, "fix the build"))) == []


def test_deltas_are_agent_message_chunks_and_the_streamed_answers_emit_adds_nothing() -> None:
    view = SessionView("s", WS)
    chunks = view.take(DeltaNotice("s", 2, "Hel")) + view.take(DeltaNotice("s", 2, "lo."))
    chunks += view.take(step(3, answer(2, "Hello."), (3, Op(Emit="Hello.")), (4, done(1))))
    assert [u.content.text for u in chunks] == ["Hel", "lo."]  # type: ignore[union-attr]


def test_the_emit_of_an_answer_that_did_not_stream_is_one_chunk() -> None:
    view = SessionView("s", WS)
    updates = view.take(step(3, answer(2, "Declare x."), (3, Op(Emit="Declare x.")), (4, done(1))))
    assert plain(updates) == [
        {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "Declare x."}}
    ]


def test_an_emit_finishes_an_answer_whose_stream_was_cut_short() -> None:
    view = SessionView("s", WS)
    view.take(DeltaNotice("s", 2, "Hello, "))
    updates = view.take(step(3, answer(2, "Hello, world."), (3, Op(Emit="Hello, world."))))
    assert [u.content.text for u in updates] == ["world."]  # type: ignore[union-attr]


def test_a_dispatched_exec_is_a_pending_execute_tool_call_titled_by_its_command_line() -> None:
    view = SessionView("s", WS)
    updates = view.take(step(2, answer(1, calls=[]), (2, Op(Exec=Exec(argv=["make", "-C", "my dir"])))))
    assert plain(updates) == [
        {
            "sessionUpdate": "tool_call",
            "toolCallId": "call_2",
            "title": "make -C 'my dir'",
            "kind": "execute",
            "status": "pending",
            "rawInput": {"argv": ["make", "-C", "my dir"]},
        }
    ]


def test_a_read_has_its_absolute_location_and_runs_at_once() -> None:
    view = SessionView("s", WS)
    updates = view.take(step(2, answer(1, calls=[]), (2, Op(Read=Read(path="src/../Makefile")))))
    assert plain(updates) == [
        {
            "sessionUpdate": "tool_call",
            "toolCallId": "call_2",
            "title": "src/../Makefile",
            "kind": "read",
            "status": "pending",
            "locations": [{"path": f"{WS}/Makefile"}],
            "rawInput": {"path": "src/../Makefile"},
        },
        {"sessionUpdate": "tool_call_update", "toolCallId": "call_2", "status": "in_progress"},
    ]


def test_a_write_that_succeeded_is_completed_with_a_diff() -> None:
    view = SessionView("s", WS)
    view.take(step(2, answer(1, calls=[]), (2, Op(Write=Write(path="todo.txt", text="buy milk\n")))))
    updates = view.take(step(3, result("File", 2, "wrote 9 bytes")))
    assert plain(updates)[-1] == {
        "sessionUpdate": "tool_call_update",
        "toolCallId": "call_2",
        "status": "completed",
        "content": [
            {"type": "diff", "path": f"{WS}/todo.txt", "newText": "buy milk\n"},
            {"type": "content", "content": {"type": "text", "text": "wrote 9 bytes"}},
        ],
    }


def test_a_failed_command_goes_in_progress_then_failed_with_its_output() -> None:
    view = SessionView("s", WS)
    view.take(step(2, answer(1, calls=[]), (2, Op(Exec=Exec(argv=["make"])))))
    updates = view.take(step(3, result("Exec", 2, "cc: x undeclared", failed=True)))
    assert [(u.status, u.content) for u in updates] == [  # type: ignore[union-attr]
        ("in_progress", None),
        ("failed", [wire.ContentItem(wire.TextBlock("cc: x undeclared"))]),
    ]


def test_a_cancelled_turn_marks_its_calls_still_open_failed() -> None:
    view = SessionView("s", WS)
    view.take(step(1, turn(1, "go")))
    view.take(step(2, answer(1, calls=[]), (2, Op(Exec=Exec(argv=["sleep", "60"])))))
    updates = view.take(step(3, Event(Cancel=Cancel(turn=1)), (3, done(1, cancelled=True))))
    assert ([u.status for u in updates], view.outcomes[1]) == (["failed"], "cancelled")  # type: ignore[union-attr]


def test_a_turns_done_is_its_outcome() -> None:
    view = SessionView("s", WS)
    view.take(step(1, turn(1, "go")))
    view.take(step(2, answer(1, "ok"), (2, Op(Emit="ok")), (3, done(1))))
    assert (view.outcomes, view.running) == ({1: "end_turn"}, set())


def test_a_step_seen_already_says_nothing_again() -> None:
    view = SessionView("s", WS)
    view.take(step(1, turn(1, "go")))
    assert view.take(step(1, turn(1, "go"))) == []


def test_an_answer_streamed_again_after_a_reconnect_says_only_what_is_new() -> None:
    view = SessionView("s", WS)
    view.take(DeltaNotice("s", 2, "Hello, "))
    view.reconnected()
    said = [view.take(DeltaNotice("s", 2, t)) for t in ("Hel", "lo, ", "wor", "ld")]
    assert [[u.content.text for u in chunk] for chunk in said] == [[], [], ["wor"], ["ld"]]  # type: ignore[union-attr]


def test_an_allow_decided_elsewhere_puts_the_call_in_progress() -> None:
    view = SessionView("s", WS)
    view.take(step(2, answer(1, calls=[]), (2, Op(Exec=Exec(argv=["make"])))))
    updates = view.take(DecidedNotice("s", 2, "allow", "zed"))
    assert plain(updates) == [{"sessionUpdate": "tool_call_update", "toolCallId": "call_2", "status": "in_progress"}]


def test_an_approval_of_a_call_not_seen_announces_the_call_first() -> None:
    view = SessionView("s", WS)
    updates = view.take(ApprovalNotice("s", 7, Op(Exec=Exec(argv=["rm", "-r", "build"])), "ab" * 32))
    assert plain(updates) == [
        {
            "sessionUpdate": "tool_call",
            "toolCallId": "call_7",
            "title": "rm -r build",
            "kind": "execute",
            "status": "pending",
            "rawInput": {"argv": ["rm", "-r", "build"]},
        }
    ]


def test_a_permission_request_for_a_forged_command_is_titled_by_the_words_that_would_run() -> None:
    view = SessionView("s", WS)
    forged = ["sh", "-c", "echo PWNED > pwned.txt #\r\x1b[2K$ ls -la"]
    asked = view.permission_call(ApprovalNotice("s", 7, Op(Exec=Exec(argv=forged)), "ab" * 32))
    assert asked.title == "sh -c $'echo PWNED > pwned.txt #\\r\\x1b[2K$ ls -la'"


def test_a_bidi_override_in_a_titled_path_is_escaped_and_its_location_kept() -> None:
    view = SessionView("s", WS)
    updates = view.take(step(2, answer(1, calls=[]), (2, Op(Read=Read(path="invoice\u202efdp.exe")))))
    start = plain(updates)[0]
    assert (start["title"], start["locations"]) == ("invoice\\u202efdp.exe", [{"path": f"{WS}/invoice\u202efdp.exe"}])


def test_a_permission_request_names_the_call_without_a_session_update_tag() -> None:
    view = SessionView("s", WS)
    asked = view.permission_call(ApprovalNotice("s", 7, Op(Write=Write(path="a.txt", text="x")), "ab" * 32))
    assert wire.to_builtins(asked) == {
        "toolCallId": "call_7",
        "status": "pending",
        "title": "a.txt",
        "kind": "edit",
        "locations": [{"path": f"{WS}/a.txt"}],
        "rawInput": {"path": "a.txt"},
    }


def test_a_replayed_history_tells_each_call_once_with_its_final_status() -> None:
    history = [
        step(1, turn(1, "count the lines")),
        step(2, answer(1, "Let me look.", calls=[]), (2, Op(Emit="Let me look.")), (3, Op(Exec=Exec(argv=["wc"])))),
        step(3, result("Exec", 3, "2")),
        step(4, answer(4, "2 lines."), (5, Op(Emit="2 lines.")), (6, done(1))),
    ]
    _, updates = replay("s", WS, history)
    assert [(type(u).__name__, getattr(u, "status", None)) for u in updates] == [
        ("UserMessageChunk", None),
        ("AgentMessageChunk", None),
        ("ToolCall", "completed"),
        ("AgentMessageChunk", None),
    ]


def test_a_transcript_tells_the_conversation_with_each_calls_result() -> None:
    messages = [
        Message(User="read it"),
        Message(Agent=Agent(text="Reading.", calls=[Dispatch(id=2, call=Call(Read=Read(path="a")))])),
        Message(Tool=Tool(id=2, text="no such file", failed=True)),
    ]
    updates = transcript_updates(msgspec.to_builtins(messages), WS)
    assert [(type(u).__name__, getattr(u, "status", None)) for u in updates] == [
        ("UserMessageChunk", None),
        ("AgentMessageChunk", None),
        ("ToolCall", "failed"),
    ]


# -- the wire --------------------------------------------------------------------------------------------------------


def test_a_prompts_text_blocks_links_and_embedded_text_become_its_text() -> None:
    blocks = [
        {"type": "text", "text": "explain"},
        {"type": "resource_link", "uri": "file:///w/a.py", "name": "a.py"},
        {"type": "resource", "resource": {"uri": "file:///w/b.py", "text": "x = 1"}},
        {"type": "image", "data": "...", "mimeType": "image/png"},
    ]
    assert wire.prompt_text(blocks) == "explain\n\n@file:///w/a.py\n\n@file:///w/b.py\nx = 1"


def test_a_line_that_is_not_json_is_a_parse_error() -> None:
    with pytest.raises(ParseError):
        wire.decode(b"{nope")


def test_a_line_with_an_id_and_a_result_is_an_answer_to_our_request() -> None:
    assert wire.decode(b'{"jsonrpc":"2.0","id":3,"result":{}}') == wire.Response(3, msgspec.Raw(b"{}"), None)


def test_params_with_a_wrong_member_are_invalid_params_naming_it() -> None:
    with pytest.raises(InvalidParamsError, match=r"\$\.sessionId"):
        wire.params(msgspec.Raw(b'{"sessionId": 5, "prompt": []}'), wire.PromptParams, "session/prompt")


@pytest.mark.parametrize(
    ("option", "decision"),
    [
        ("allow_once", ("allow", False)),
        ("allow_always", ("allow", True)),
        ("reject_once", ("deny", False)),
        ("reject_always", ("deny", False)),
    ],
)
def test_each_permission_option_is_its_approval(option: str, decision: tuple[str, bool]) -> None:
    body = msgspec.json.encode({"outcome": {"outcome": "selected", "optionId": option}})
    assert _decision(wire.Response(1, msgspec.Raw(body), None)) == decision


def test_a_cancelled_permission_request_decides_nothing() -> None:
    body = msgspec.json.encode({"outcome": {"outcome": "cancelled"}})
    assert _decision(wire.Response(1, msgspec.Raw(body), None)) is None


def test_text_the_model_wrote_beside_its_calls_is_a_chunk_when_it_did_not_stream() -> None:
    view = SessionView("s", WS)
    reply = answer(1, "Let me look.", calls=[Call(Read=Read(path="a"))])
    updates = view.take(step(2, reply, (2, Op(Read=Read(path="a")))))
    assert [type(u).__name__ for u in updates] == ["AgentMessageChunk", "ToolCall", "ToolCallUpdate"]


def test_a_deny_decided_elsewhere_says_who_denied_it() -> None:
    view = SessionView("s", WS)
    view.take(step(2, answer(1, calls=[]), (2, Op(Exec=Exec(argv=["make"])))))
    updates = view.take(DecidedNotice("s", 2, "deny", "zed"))
    assert plain(updates) == [
        {
            "sessionUpdate": "tool_call_update",
            "toolCallId": "call_2",
            "content": [{"type": "content", "content": {"type": "text", "text": "denied by zed"}}],
        }
    ]


def test_a_notice_this_layer_does_not_know_says_nothing() -> None:
    assert notice("session/unknown", {"session": "s"}) is None
