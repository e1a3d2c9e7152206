"""`devd chat`, `devd run` and `devd attach` as a person sees them: each in a real pseudo-terminal read through a
terminal emulator (pyte, tests/terminal.py), against the real daemon driving sessions with the stand-in model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agents import Agentd, next_notice, run_turn, start, until_done, watch_raw
from tests.daemon import ROOT
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (the `standin` fixture)
from tests.terminal import Terminal

MARK = ["sh", "-c", "echo ran >> marker"]
ANSWER = "Let me look at the build first, then I will run the tests for you."


@pytest.fixture
def agentd(tmp_path: Path, standin: Standin) -> Iterator[Agentd]:
    """The daemon with agents as a process of its own; the profile asks before each command."""
    running = start(tmp_path, standin, exec='"ask"')
    with running.daemon:
        yield running


def devd(agentd: Agentd, command: str, *args: str, rows: int = 60) -> Terminal:
    """`devd COMMAND` against the daemon in a terminal of its own (a new session of `coder` unless args say)."""
    where = ["--connect", str(agentd.daemon.socket)]
    if command in ("run", "chat"):
        where += ["--agent", "coder", "--workspace", str(agentd.workspace)]
    history = agentd.workspace.parent.parent / "state"  # devd chat's history: here, not in this machine's home
    return Terminal(command, *where, *args, rows=rows, env={"XDG_STATE_HOME": str(history)})


def session_of(shown: str) -> str:
    found = re.search(r"\[session (\S+) ", shown)
    assert found is not None, shown
    return found[1]


def completed(n: int) -> Callable[[str], bool]:
    """Whether the screen shows n turns complete (a turn's number is its Turn step's, not a count)."""
    return lambda shown: len(re.findall(r"^\[turn \d+ complete\]$", shown, re.MULTILINE)) >= n


def lines(shown: str) -> list[str]:
    """What the screen shows, joined where a line was wrapped at the terminal's edge, as a list of lines."""
    return shown.splitlines()


# -- the screen never loses text -----------------------------------------------------------------------------------


def test_text_streamed_after_the_status_line_is_shown_whole(agentd: Agentd) -> None:
    # The model thinks (the status line is drawn), then writes slowly: before, `\r\e[K` erased the line's start.
    agentd.standin.script(Scripted(text=ANSWER, split=5, delay_s=0.15))
    with devd(agentd, "run", "build it") as t:
        t.wait_for("thinking (")
        assert (t.exit_status(), lines(t.shown())[-2:]) == (0, [ANSWER, "[turn 1 complete]"])


def test_the_status_line_is_below_the_text_while_it_streams(agentd: Agentd) -> None:
    held = threading.Event()
    agentd.standin.script(Scripted(text="first part, second part", split=12, held=held, held_after=2))
    with devd(agentd, "run", "go") as t:
        shown = t.wait_for(lambda s: "first part," in s and "writing (" in s)
        held.set()
        assert t.exit_status() == 0
    assert (lines(shown)[-2], lines(shown)[-1].startswith(" writing (")) == ("first part,", True)


# -- approvals -------------------------------------------------------------------------------------------------------


def test_an_approval_decided_in_another_terminal_withdraws_the_question_and_run_exits_at_once(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": MARK})]), Scripted(text="done"))
    with devd(agentd, "run", "mark it") as t:
        session = session_of(t.wait_for("[y/N/a/p]"))
        with devd(agentd, "approve", session, "2") as other:
            assert other.exit_status() == 0
            by = f"devd cli: root (uid 0, pid {other.proc.pid})"
        # No key is pressed here: before, the reader thread kept `devd run` until Enter, and took that line.
        assert t.exit_status() == 0
        shown = t.shown()
    assert (f"[action 2 allowed by {by}]" in shown, "[y/N/a/p]" in shown, lines(shown)[-1]) == (
        True,
        False,
        "[turn 1 complete]",
    )


def test_attach_shows_a_call_dispatched_before_it_attached_asks_about_it_and_shows_its_result(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": MARK})]), Scripted(text="marked."))
    with devd(agentd, "run", "mark it") as run:
        session = session_of(run.wait_for("[y/N/a/p]"))
        with devd(agentd, "attach", session) as attach:
            attach.wait_for("[y/N/a/p]")
            attach.type("y\r")
            assert attach.exit_status() == 0
            shown = attach.shown()
        assert run.exit_status() == 0
    assert lines(shown) == [
        "$ sh -c 'echo ran >> marker'  [dispatched before this terminal attached]",
        "[approval needed for action 2: agent 'coder' has exec = \"ask\"]",
        f"[action 2 allowed by devd cli: root (uid 0, pid {attach.proc.pid})]",
        "↳ $ sh -c 'echo ran >> marker'",
        "  (no output)",
        "marked.",
        "[turn 1 complete]",
    ]


# -- chat -------------------------------------------------------------------------------------------------------------


def test_ctrl_c_cancels_the_running_turn_and_a_second_leaves_with_0_and_the_session_stays(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="thinking hard", hang=True))
    with devd(agentd, "chat") as t:
        session = session_of(t.wait_for("/help"))
        t.type("think\r")
        t.wait_for("writing (")
        t.type("\x03")
        t.wait_for(lambda shown: re.search(r"^\[turn \d+ cancelled\]$", shown, re.MULTILINE) is not None)
        t.type("\x03")
        status = t.exit_status()
    with agentd.client() as c:
        assert (status, [s.session for s in c.list().sessions]) == (0, [session])


def test_a_chat_of_three_turns_with_an_approval_and_a_stall(agentd: Agentd, tmp_path: Path) -> None:
    agentd.standin.script(
        Scripted(text="Hello! What shall we do?", usage=(900, 200, 0)),
        Scripted(text="I will mark it.", tool_calls=[("exec", {"argv": MARK})], usage=(1000, 100, 0)),
        Scripted(text="Marked.", usage=(1000, 100, 0)),
        Scripted(text="Still here, after the stall.", usage=(1000, 100, 0)),
    )
    with devd(agentd, "chat") as t:
        t.wait_for("/help")
        t.type("hello\r")
        t.wait_for(completed(1))
        t.type("mark it\r")
        t.wait_for("[y/N/a/p]")
        t.type("y\r")
        t.wait_for(completed(2))
        t.type("/budget 3500\r")
        t.wait_for("[spend ceiling: 3,500 tokens")
        t.type("and now?\r")
        stalled = t.wait_for("stalled: ")
        t.type("/budget 100000\r")
        t.wait_for("[spend ceiling: 100,000 tokens")
        t.type("/resume\r")
        done = t.wait_for(completed(3))
        t.type("\x04")
        assert t.exit_status() == 0
    (tmp_path / "chat.txt").write_text(done)
    assert [line for line in lines(done) if line.startswith(("› ", "[turn", "[action", "[resumed"))] == [
        "› hello",
        "[turn 1 complete]",
        "› mark it",
        f"[action 6 allowed by {_by(done)}]",
        "[turn 3 complete]",
        "› and now?",
        "[resumed: the action is tried again]",
        "[turn 7 complete]",
    ] and "`devd resume " in stalled


def _by(shown: str) -> str:
    found = re.search(r"allowed by (devd cli: \w+ \(uid \d+, pid \d+\))\]", shown)
    assert found is not None, shown
    return found[1]


def test_two_terminals_on_one_session_see_one_turn_and_either_answers(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("exec", {"argv": MARK})]), Scripted(text="marked."), Scripted(text="second turn")
    )
    with devd(agentd, "chat") as a:
        session = session_of(a.wait_for("/help"))
        with devd(agentd, "chat", "--session", session) as b:
            b.wait_for("/help")
            a.type("mark it\r")
            b.wait_for("[y/N/a/p]")
            a.wait_for("[y/N/a/p]")
            b.type("y\r")
            a.wait_for(completed(1))
            a.type("again\r")  # the question A had was withdrawn: this line is a prompt, not its answer
            shown_b = b.wait_for(completed(2))
            a.type("\x04")
            b.type("\x04")
            assert (a.exit_status(), b.exit_status()) == (0, 0)
    assert [line for line in lines(shown_b) if line.startswith(("› ", "[turn"))] == [
        "› mark it",
        "[turn 1 complete]",
        "› again",
        "[turn 5 complete]",
    ]


def test_run_without_a_prompt_chats_and_a_command_typed_at_a_question_is_a_command_not_its_answer(
    agentd: Agentd,
) -> None:
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": MARK})]), Scripted(text="denied, so not marked."))
    with devd(agentd, "run") as t:
        t.wait_for("/help")
        t.type("mark it\r")
        t.wait_for("[y/N/a/p]")
        t.type("/deny 2\r")
        shown = t.wait_for(completed(1))
        t.type("/quit\r")
        assert (t.exit_status(), agentd.workspace.joinpath("marker").exists()) == (0, False)
    assert f"[action 2 denied by devd cli: root (uid 0, pid {t.proc.pid})]" in lines(shown)


def test_a_prompt_of_two_lines_and_the_history_sends_it_again(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="one"), Scripted(text="two"))
    with devd(agentd, "chat") as t:
        t.wait_for("/help")
        t.type("first line\\\r")  # `\` then Enter: a new line, not yet sent
        t.type("second line\r")
        t.wait_for(completed(1))
        t.type("\x1b[A\r")  # Up: the prompt before, sent again
        shown = t.wait_for(completed(2))
        t.type("\x04")
        assert t.exit_status() == 0
    prompts = [r.body["messages"][-1]["content"] for r in agentd.standin.requests]
    assert (prompts, [line for line in lines(shown) if line.startswith(("› ", "  second"))]) == (
        ["first line\nsecond line"] * 2,
        ["› first line", "  second line", "› first line", "  second line"],
    )


def test_sessions_lists_them_and_attach_moves_the_chat_to_another(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="from the other session"))
    with agentd.client() as c:
        other = c.new(session="other", agent="coder", workspace=agentd.workspace)
    with devd(agentd, "chat") as t:
        t.wait_for("/help")
        t.type("/sessions\r")
        listed = t.wait_for(lambda shown: re.search(r"^other +coder ", shown, re.MULTILINE) is not None)
        t.type(f"/attach {other}\r")
        t.wait_for(f"[session {other}]")
        t.type("hello there\r")
        shown = t.wait_for(completed(1))
        t.type("\x04")
        assert t.exit_status() == 0
    with agentd.client() as c:
        turns = [m for m in c.transcript(other) if m.User is not None]
    at = lines(shown).index("› hello there")
    assert (lines(shown)[at : at + 3], len(turns), "NAME" in listed) == (
        ["› hello there", "from the other session", "[turn 1 complete]"],
        1,
        True,
    )


def test_slash_title_names_the_session(agentd: Agentd) -> None:
    with devd(agentd, "chat") as t:
        shown = t.wait_for("/help")
        t.type("/title fixing the build\r")
        t.wait_for("[done]")
        t.type("/quit\r")
        assert t.exit_status() == 0
    with agentd.client() as c:
        assert c.info(session_of(shown)).title == "fixing the build"


def test_slash_model_sets_the_model_of_the_sessions_next_calls(tmp_path: Path, standin: Standin) -> None:
    running = start(tmp_path, standin, models='["standin-model", "other-model"]')
    with running.daemon, devd(running, "chat") as t:
        t.wait_for("/help")
        t.type("/model other-model\r")
        shown = t.wait_for("model: ")
        t.type("/quit\r")
        assert t.exit_status() == 0
    said = next(line for line in lines(shown) if line.startswith("model: "))
    assert said == 'model: "other-model"'


# -- the verbs: sessions that say what they are ----------------------------------------------------------------------


def cli(agentd: Agentd, *args: str) -> str:
    """`devd ARGS` without a terminal (as a script runs it): its output; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "devd", *args, "--connect", str(agentd.daemon.socket)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def stalled_and_asking(agentd: Agentd) -> tuple[str, str, str]:
    """Three sessions: one stalled by its spend ceiling, one waiting for approval, one idle (by name)."""
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": MARK})]))
    with agentd.client() as c:
        stalled = c.new(session="a-stalled", agent="coder", workspace=agentd.workspace, budget=1)
        asking = c.new(session="b-asking", agent="coder", workspace=agentd.workspace)
        idle = c.new(session="c-idle", agent="coder", workspace=agentd.workspace)
        for session in (stalled, asking):
            watch_raw(c, session)
            c.prompt(session, "mark it")
        next_notice(c, "session/stalled")
        next_notice(c, "session/approval")
    return stalled, asking, idle


def test_ls_shows_each_sessions_title_agent_workspace_and_what_it_does(agentd: Agentd) -> None:
    stalled_and_asking(agentd)
    rows = [re.split(r"\s{2,}", line.strip()) for line in cli(agentd, "ls").splitlines()]
    assert [row[:5] for row in rows] == [
        ["NAME", "TITLE", "AGENT", "WORKSPACE", "STATE"],
        ["a-stalled", "mark it", "coder", str(agentd.workspace), rows[1][4]],
        ["b-asking", "mark it", "coder", str(agentd.workspace), "waiting for approval"],
        ["c-idle", "-", "coder", str(agentd.workspace), "idle"],
    ] and rows[1][4].startswith("stalled: spend ceiling")


def test_info_and_inspect_say_what_waits_on_a_person_and_the_devd_command_for_it(agentd: Agentd) -> None:
    stalled, asking, _ = stalled_and_asking(agentd)
    info = cli(agentd, "info", stalled).splitlines()
    inspect = cli(agentd, "inspect", asking).splitlines()
    assert (info[-1], inspect[-1]) == (
        f"  `devd resume {stalled}` tries it again (after `devd budget {stalled} TOKENS` when a spend ceiling "
        "refused it)",
        f"waiting for approval: action 2 Exec sh -c 'echo ran >> marker' (`devd approve {asking} 2`, or `devd deny`)",
    )


def test_attach_to_a_stalled_session_says_why_and_the_devd_verbs_that_carry_it_on(agentd: Agentd) -> None:
    stalled, _, _ = stalled_and_asking(agentd)
    with devd(agentd, "attach", stalled) as t:
        shown = "".join(lines(t.wait_for("stalled: "))).replace(
            " ", ""
        )  # rows joined (a long line wraps, maybe at a space)
    advice = (
        f"[`devd resume {stalled}` tries it again (after `devd budget {stalled} TOKENS` when a spend ceiling "
        "refused it); in devd chat: /resume, /budget N]"
    )
    assert (
        shown.startswith("[theturnwaits:spendceilingreached:"),
        advice.replace(" ", "") in shown,
        "session/" in shown,
    ) == (
        True,
        True,
        False,
    )


def test_budget_then_resume_carry_a_stalled_session_on(agentd: Agentd) -> None:
    stalled, _, _ = stalled_and_asking(agentd)
    agentd.standin.script(Scripted(text="carried on"))
    said = cli(agentd, "budget", stalled, "100000") + cli(agentd, "resume", stalled)
    with agentd.client() as c:
        watch_raw(c, stalled, since=0)
        until_done(c, 1)
    assert said == (
        f"{stalled}: spend ceiling 100,000 tokens; `devd resume {stalled}` carries a stall it caused on\n"
        f"{stalled}: resumed\n"
    )


def test_usage_is_a_table_and_with_json_the_daemons_answer(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="hi", usage=(1200, 34, 5)))
    with agentd.client() as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        run_turn(c, session, "hello")
    assert (cli(agentd, "usage", session), cli(agentd, "usage", session, "--json")) == (
        "INPUT TOKENS  OUTPUT TOKENS  CACHED TOKENS  CALLS  REFUSED\n"
        "       1,200             34              5      1        0\n",
        '{"input_tokens":1200,"output_tokens":34,"cached_tokens":5,"calls":1,"refused":0}\n',
    )


def test_run_loads_neither_the_sessions_core_nor_the_agents_tools(agentd: Agentd) -> None:
    # What `devd run` imports is most of the time it takes to show a turn: wasmtime (the core) and the tools (with
    # the daemon's logging and sandbox) are the daemon's, and were about 45 ms of each run.
    agentd.standin.script(Scripted(text=ANSWER))
    argv = ["devd", "run", "--connect", str(agentd.daemon.socket), "--agent", "coder", "--workspace"]
    argv += [str(agentd.workspace), "build it"]
    script = (
        f"import sys; sys.argv = {argv!r}; from devd.cli import main; status = main(); "
        "print('loaded:', [m for m in ('wasmtime', 'devd.agent.tools', 'structlog') if m in sys.modules], status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.stdout.splitlines()[-1] == "loaded: [] 0", done.stdout + done.stderr
