"""An MCP server's questions (elicitations) end to end: the real daemon, the stand-in model, and the test MCP server
(tests/mcp_server.py, the official SDK) whose `careful` tool asks a person before it writes, over the 2026-07-28
revision (`input_required`, a sealed `request_state`) or the legacy `elicitation/create` request."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devd import errors
from devd.client import Client
from devd.messages import Cancel, Event
from tests.agents import Agentd, conversation, next_notice, run_turn, until_done, watch_raw
from tests.daemon import ROOT, Daemon
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (a fixture)
from tests.test_agent_mcp import PYTHON, SERVER, offered_names, server_table, start
from tests.test_chat import completed, devd, lines, session_of

STATE_KEY = "a-key-of-the-test-servers-sealed-request-states-0123456789"
QUESTION = {
    "message": "May I write x.txt?",
    "schema": {
        "properties": {
            "ok": {"title": "Ok", "type": "boolean"},
            "note": {"default": "", "title": "Note", "type": "string"},
        },
        "required": ["ok"],
        "type": "object",
    },
}


def question_of(protocol: str) -> dict[str, Any]:
    """The question as the server words it: its legacy request's schema keeps its model's title."""
    if protocol == "auto":
        return QUESTION
    return {**QUESTION, "schema": {**QUESTION["schema"], "title": "Confirm"}}  # type: ignore[dict-item]


def careful(protocol: str = "auto", *extra: str) -> str:
    """The test server, its calls allowed, speaking `protocol`, its states sealed under a key that outlives it."""
    command = ", ".join(f'"{a}"' for a in (PYTHON, str(SERVER)))
    env = 'env = { PYTHONPATH = "DEVD_TEST_MCP_PATH", MCP_STATE_KEY = "DEVD_TEST_MCP_STATE_KEY" }'
    lines = ["[agent.coder.mcp.demo]", f"command = [{command}]", env, 'decision = "allow"', f'protocol = "{protocol}"']
    return "\n".join([*lines, *extra]) + "\n"


def started(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, protocol: str = "auto", *extra: str
) -> Agentd:
    monkeypatch.setenv("DEVD_TEST_MCP_STATE_KEY", STATE_KEY)
    standin.script(Scripted(tool_calls=[("demo__careful", {"name": "x.txt"})]), Scripted(text="done"))
    return start(tmp_path, standin, monkeypatch, careful(protocol, *extra))


def asked(c: Client, agentd: Agentd) -> tuple[str, int, dict[str, Any]]:
    """A session whose turn's call waits for the server's question: the session, the turn, and the question."""
    session = agentd.session(c)
    watch_raw(c, session, since=0)
    turn = c.prompt(session, "write x")
    return session, turn, next_notice(c, "session/input").params


def result(c: Client, session: str) -> Any:
    return conversation(c, session)[2]["Tool"]


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
def test_a_servers_question_goes_to_every_watcher_and_a_second_client_answers_it(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    with started(tmp_path, standin, monkeypatch, protocol).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c, agentd.client() as other:
            session, turn, question = asked(c, agentd)
            watch_raw(other, session)  # told the open question as it starts watching
            told = next_notice(other, "session/input").params
            other.answer(session, question["action"], question["request"], {"ok": True, "note": "from the other"})
            decided = next_notice(c, "session/answered").params["decision"]
            until_done(c, turn)
            assert (told, decided, result(c, session), (agentd.workspace / "x.txt").read_text()) == (
                {"session": session, "action": 2, "request": 1, **question_of(protocol)},
                "accept",
                {"id": 2, "text": "wrote x.txt (from the other)"},
                "written from the other\n",
            )


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
def test_the_time_a_question_waits_for_a_person_is_not_counted_in_call_timeout_s(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    with started(tmp_path, standin, monkeypatch, protocol, "call_timeout_s = 0.5").daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, _ = asked(c, agentd)
            time.sleep(1.0)  # a person taking longer than the call's timeout to answer
            c.answer(session, 2, 1, {"ok": True, "note": "late"})
            until_done(c, turn)
            assert result(c, session) == {"id": 2, "text": "wrote x.txt (late)"}


def test_two_questions_of_one_round_are_asked_at_once_and_both_answers_sent(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVD_TEST_MCP_STATE_KEY", STATE_KEY)
    standin.script(Scripted(tool_calls=[("demo__survey", {})]), Scripted(text="done"))
    with start(tmp_path, standin, monkeypatch, careful()).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session = agentd.session(c)
            watch_raw(c, session, since=0)
            turn = c.prompt(session, "ask me")
            asked = [next_notice(c, "session/input").params for _ in range(2)]
            for question in asked:
                field = next(iter(question["schema"]["properties"]))
                c.answer(session, 2, question["request"], {field: {"name": "Ada", "color": "green"}[field]})
            until_done(c, turn)
            assert (sorted((q["request"], q["message"]) for q in asked), result(c, session)["text"]) == (
                [(1, "Who are you?"), (2, "Which color?")],
                "Ada likes green",
            )


def test_the_first_answer_wins_and_a_later_one_is_a_conflict_naming_who_answered(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c, agentd.client() as other:
            other.initialize(name="second-ui")
            session, turn, question = asked(c, agentd)
            other.answer(session, 2, 1, {"ok": True, "note": "first"})
            with pytest.raises(errors.ConflictError) as late:
                c.answer(session, 2, 1, decline=True)
            until_done(c, turn)
            assert (str(late.value).split(" (")[0], result(c, session)["text"]) == (
                "question 1 of action 2 was already answered by second-ui",
                "wrote x.txt (first)",
            )


def test_session_answer_on_the_wire_takes_decline_true_and_answers_an_empty_object(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, question = asked(c, agentd)
            params = {"session": session, "action": question["action"], "request": question["request"], "decline": True}
            answered = c.call("session/answer", params)
            until_done(c, turn)
            assert answered == {}


def test_a_declined_question_is_told_to_the_server_as_declined(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, _ = asked(c, agentd)
            c.answer(session, 2, 1, decline=True)
            until_done(c, turn)
            assert (result(c, session), (agentd.workspace / "x.txt").exists()) == (
                {"id": 2, "text": "not written: the question was declined"},
                False,
            )


def test_an_answer_its_schema_does_not_admit_is_refused_and_decides_nothing(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, _ = asked(c, agentd)
            with pytest.raises(errors.InvalidParamsError) as refused:
                c.answer(session, 2, 1, {"ok": "yes"})
            c.answer(session, 2, 1, {"ok": True})
            until_done(c, turn)
            assert (str(refused.value), result(c, session)["text"]) == (
                "the answer does not fit question 1's schema: at ok, 'yes' is not of type 'boolean'; nothing was "
                "decided",
                "wrote x.txt ()",
            )


def test_a_question_open_when_its_turn_is_cancelled_is_withdrawn(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, _ = asked(c, agentd)
            c.step(session, Event(Cancel=Cancel(turn=turn)))
            withdrawn = next_notice(c, "session/answered").params["decision"]  # the turn's Done may come before it
            with pytest.raises(errors.ConflictError) as late:
                c.answer(session, 2, 1, {"ok": True})
            assert (withdrawn, str(late.value).split(" (by")[0], (agentd.workspace / "x.txt").exists()) == (
                "cancel",
                "question 1 of action 2 is no longer asked: it was withdrawn",
                False,
            )


def restartable(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, protocol: str) -> Daemon:
    agentd = started(tmp_path, standin, monkeypatch, protocol)
    return Daemon(tmp_path / "d", *agentd.daemon.args, env=dict(os.environ))  # type: ignore[union-attr]


def test_a_kept_request_state_lets_the_call_be_answered_after_a_restart_and_run_once(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = restartable(tmp_path, standin, monkeypatch, "auto")
    agentd = Agentd(daemon, tmp_path / "roots" / "ws", standin)
    with daemon, daemon.client() as c:  # killed on the way out, whatever fails before the kill
        session, turn, _ = asked(c, agentd)
    daemon.kill()
    with daemon, daemon.client() as c:
        watch_raw(c, session, since=0)
        again = next_notice(c, "session/input").params
        c.answer(session, 2, 1, {"ok": True, "note": "after the restart"})
        until_done(c, turn)
        assert (again, result(c, session), (agentd.workspace / "x.txt").read_text()) == (
            {"session": session, "action": 2, "request": 1, **QUESTION},
            {"id": 2, "text": "wrote x.txt (after the restart)"},
            "written after the restart\n",
        )


def test_a_legacy_question_is_declined_after_a_restart_saying_so(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = restartable(tmp_path, standin, monkeypatch, "legacy")
    agentd = Agentd(daemon, tmp_path / "roots" / "ws", standin)
    with daemon, daemon.client() as c:
        session, turn, _ = asked(c, agentd)
    daemon.kill()
    with daemon, daemon.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, turn)
        with pytest.raises(errors.ConflictError) as late:
            c.answer(session, 2, 1, {"ok": True})
        assert (str(late.value), result(c, session)) == (
            "question 1 of action 2 was already decided: declined: the daemon restarted while this question waited, "
            "and its MCP server asked it with the legacy elicitation request, which cannot be answered after a "
            "restart (its call ended with the daemon)",
            {
                "id": 2,
                "text": "interrupted: the daemon stopped while this tool call ran, so it may have partly run; it was "
                "not run again (check the workspace before you run it again); its server's question was declined: "
                "the daemon restarted while this question waited, and its MCP server asked it with the legacy "
                "elicitation request, which cannot be answered after a restart (its call ended with the daemon)",
                "failed": True,
            },
        )


# -- devd chat, devd run and devd attach ------------------------------------------------------------------------------


def test_chat_shows_a_servers_question_with_its_fields_and_a_line_typed_answers_it(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with devd(agentd, "chat") as t:
            t.wait_for("/help")
            t.type("write x\r")
            t.wait_for("Enter declines:")
            t.type("ok=y note='typed here'\r")
            shown = t.wait_for(completed(1))
            t.type("\x04")
            assert t.exit_status() == 0
    assert [line for line in lines(shown) if line.startswith(("[question", "  ok", "  note", "  wrote"))] == [
        "[question 1 of action 2, from its MCP server: May I write x.txt?]",
        "  ok: boolean, required",
        "  note: string",
        f"[question 1 of action 2 answered by devd cli: root (uid 0, pid {t.proc.pid})]",
        "  wrote x.txt (typed here)",
    ]


def test_attach_shows_a_question_asked_before_it_attached_and_answers_it(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with devd(agentd, "run", "write x") as run:
            session = session_of(run.wait_for("Enter declines:"))
            with devd(agentd, "attach", session) as attach:
                attach.wait_for("Enter declines:")
                attach.type("\r")  # an empty line declines
                assert attach.exit_status() == 0
                shown = attach.shown()
            assert run.exit_status() == 0
    assert lines(shown) == [
        'tool demo__careful {"name": "x.txt"}  [dispatched before this terminal attached]',
        "[question 1 of action 2, from its MCP server: May I write x.txt?]",
        "  ok: boolean, required",
        "  note: string",
        f"[question 1 of action 2 declined by devd cli: root (uid 0, pid {attach.proc.pid})]",
        '↳ tool demo__careful {"name": "x.txt"}',
        "  not written: the question was declined",
        "done",
        "[turn 1 complete]",
    ]


# -- the protocol a server is spoken to with ---------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["legacy", "auto"])
def test_a_server_is_listed_again_when_its_tools_change_in_either_protocol(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    table = server_table("demo", 'decision = "allow"', f'protocol = "{protocol}"')
    standin.script(
        Scripted(tool_calls=[("demo__relist", {})]), Scripted(text="relisted"), Scripted(text="the second turn")
    )
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session = agentd.session(c)
            run_turn(c, session, "change your tools")
            run_turn(c, session, "again")
        before = "demo__fresh" in offered_names(standin, 0)
        assert (before, "demo__fresh" in offered_names(standin, 2)) == (False, True)


def test_devd_answer_answers_a_question_from_a_shell_with_field_value_words(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, _ = asked(c, agentd)
            said = subprocess.run(
                [sys.executable, "-m", "devd", "answer", "--connect", str(d.socket), session, "2", "1", "ok=true"]
                + ["note=from a shell"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=False,
            )
            until_done(c, turn)
            assert (said.returncode, said.stdout, result(c, session)["text"]) == (
                0,
                f"question 1 of action 2 of {session}: answered\n",
                "wrote x.txt (from a shell)",
            )


def test_pending_marks_a_call_waiting_for_an_answer_and_devd_info_says_how_to_give_it(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with started(tmp_path, standin, monkeypatch).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session, turn, _ = asked(c, agentd)
            awaiting = [(a.id, a.awaiting) for a in c.pending(session)]
            info = subprocess.run(
                [sys.executable, "-m", "devd", "info", "--connect", str(d.socket), session],
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=False,
            )
            c.answer(session, 2, 1, decline=True)
            until_done(c, turn)
        assert (awaiting, info.stdout.splitlines()[-1]) == (
            [(2, "input")],
            "waiting for an answer: action 2 Tool demo__careful: its MCP server asks a question "
            f"(`devd answer {session} 2 REQUEST field=value ...`; `devd watch` or `devd attach` shows it)",
        )


def test_a_call_sent_with_its_answer_is_not_sent_again_after_a_restart(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = restartable(tmp_path, standin, monkeypatch, "auto")
    agentd = Agentd(daemon, tmp_path / "roots" / "ws", standin)
    with daemon, daemon.client() as c:
        session, turn, _ = asked(c, agentd)
    daemon.kill()
    daemon.env = {**daemon.env, "DEVD_FAILPOINTS": "agent.done=kill@1"}  # killed once the resent call is done
    with daemon.start(), daemon.client() as c:
        watch_raw(c, session, since=0)
        next_notice(c, "session/input")
        c.answer(session, 2, 1, {"ok": True, "note": "once"})
        daemon.proc.wait(20)  # type: ignore[union-attr]
    daemon.env = {k: v for k, v in daemon.env.items() if k != "DEVD_FAILPOINTS"}
    with daemon.start(), daemon.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, turn)
        assert (result(c, session)["text"], (agentd.workspace / "x.txt").read_text()) == (
            "interrupted: the daemon stopped while this tool call ran, so it may have partly run; it was not run "
            "again (check the workspace before you run it again)",
            "written once\n",
        )
