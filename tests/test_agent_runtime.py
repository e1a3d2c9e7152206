"""The daemon carries out a session's actions itself (issue 17): end to end against the real daemon, the stand-in
model server, real files and real bubblewrap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from devd import errors, failpoints
from devd.client import Client
from devd.messages import Call, Cancel, Event, ToolCall, Turn, answer
from tests import modules
from tests.agents import (
    NOTICE_TIMEOUT_S,
    SECRET,
    SYSTEM,
    Agentd,
    _agents_file,
    agentd,
    agentd_process_fixture,  # noqa: F401 (the fixture)
    agents_toml,
    conversation,
    next_notice,
    run_turn,
    start,
    until_done,
    watch_raw,
)
from tests.daemon import ROOT
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["agentd", "standin_fixture"]

INTERRUPTED = (
    "interrupted: the daemon stopped while this {what} ran, so it may have partly run; it was not run again "
    "(check the workspace before you run it again)"
)


def results(c: Client, session: str) -> list[tuple[int, str, bool]]:
    """Every call's result in the session's conversation: (action id, text, failed)."""
    return [
        (m["Tool"]["id"], m["Tool"]["text"], m["Tool"].get("failed", False))
        for m in conversation(c, session)
        if "Tool" in m
    ]


def tool_messages(standin: Standin, request: int) -> list[str]:
    return [m["content"] for m in standin.requests[request].body["messages"] if m["role"] == "tool"]


def wait_for(predicate: object, what: str, timeout_s: float = 20.0) -> None:
    """Poll a condition outside the daemon's protocol (a file, a process): a deadline, never a bare sleep."""
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


# -- a whole turn -------------------------------------------------------------------------------------------------


def test_a_turn_writes_a_file_runs_a_command_reads_it_and_finishes(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(text="Writing the note.", tool_calls=[("write", {"path": "notes.txt", "text": "hello\n"})]),
        Scripted(tool_calls=[("exec", {"argv": ["wc", "-c", "notes.txt"]})]),
        Scripted(tool_calls=[("read", {"path": "notes.txt"})]),
        Scripted(text="notes.txt holds hello."),
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "write a note")
        assert conversation(c, session) == [
            {"User": "write a note"},
            {
                "Agent": {
                    "text": "Writing the note.",
                    "calls": [{"id": 2, "call": {"Write": {"path": "notes.txt", "text": "hello\n"}}}],
                }
            },
            {"Tool": {"id": 2, "text": "wrote 6 bytes to notes.txt"}},
            {"Agent": {"calls": [{"id": 4, "call": {"Exec": {"argv": ["wc", "-c", "notes.txt"]}}}]}},
            {"Tool": {"id": 4, "text": "6 notes.txt\n"}},
            {"Agent": {"calls": [{"id": 6, "call": {"Read": {"path": "notes.txt"}}}]}},
            {"Tool": {"id": 6, "text": "hello\n"}},
            {"Agent": {"text": "notes.txt holds hello."}},
        ]


def test_each_request_carries_the_system_prompt_the_key_and_the_conversation(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[("read", {"path": "missing.txt"})]), Scripted(text="none"))
    with agentd.client() as c:
        run_turn(c, agentd.session(c), "read it")
    second = agentd.standin.requests[1]
    assert (second.headers["authorization"], second.body["messages"][:2], tool_messages(agentd.standin, 1)) == (
        f"Bearer {SECRET}",
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "read it"}],
        ["error: missing.txt does not exist"],
    )


def test_the_secret_reaches_neither_the_journal_the_log_nor_the_list_nor_a_command(agentd_process: Agentd) -> None:
    agentd_process.standin.script(Scripted(tool_calls=[("exec", {"argv": ["env"]})]), Scripted(text="ok"))
    with agentd_process.client() as c:
        session = agentd_process.session(c)
        run_turn(c, session, "show the environment")
        seen = json.dumps(conversation(c, session)) + c.call_raw("session/list").decode()
    assert SECRET not in seen + agentd_process.daemon.log.read_text() + (
        agentd_process.daemon.state / "devd.sqlite3"
    ).read_text(errors="replace")


def test_a_second_connection_sees_the_text_stream_before_the_model_step(agentd: Agentd) -> None:
    text = "Streaming this reply in many small pieces."
    agentd.standin.script(Scripted(text=text, split=4, delay_s=0.01))
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        seen = until_done(ui, c.prompt(session, "stream"))
    deltas = [n.params["text"] for n in seen if n.method == "session/delta"]
    model_step = next(i for i, n in enumerate(seen) if n.method == "session/actions" and "Model" in n.params["event"])
    last_delta = max(i for i, n in enumerate(seen) if n.method == "session/delta")
    assert ("".join(deltas), last_delta < model_step) == (text, True)


def test_a_watcher_that_joins_mid_stream_is_first_sent_the_text_so_far(agentd: Agentd) -> None:
    text, held = "Streaming this reply in many small pieces.", threading.Event()
    agentd.standin.script(Scripted(text=text, split=4, held=held, held_after=4))
    with agentd.client() as c, agentd.client() as early, agentd.client() as late:
        session = agentd.session(c)
        watch_raw(early, session)
        turn = c.prompt(session, "stream")
        told = ""
        while len(told) < 12:  # the three fragments of 4 sent before the stand-in holds the rest (in 1 to 3 deltas)
            notice = early.wait_notification(NOTICE_TIMEOUT_S)
            told += notice.params["text"] if notice.method == "session/delta" else ""
        watch_raw(late, session)
        held.set()
        seen = until_done(late, turn)
    assert "".join(n.params["text"] for n in seen if n.method == "session/delta") == text


def test_a_stream_cut_and_retried_tells_its_watchers_the_reply_once(agentd: Agentd) -> None:
    text = "Streaming this reply in many small pieces."
    agentd.standin.script(Scripted(text=text, split=4, cut_after=5), Scripted(text=text, split=4))
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        seen = until_done(ui, c.prompt(session, "stream"))
    told = "".join(n.params["text"] for n in seen if n.method == "session/delta")
    assert (told, agentd.standin.count) == (text, 2)


def test_text_written_beside_tool_calls_is_streamed_too(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(text="Let me look.", tool_calls=[("read", {"path": "a.txt"})]), Scripted(text="Done.")
    )
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        seen = until_done(ui, c.prompt(session, "look"))
    assert "".join(n.params["text"] for n in seen if n.method == "session/delta") == "Let me look.Done."


# -- sessions of an agent --------------------------------------------------------------------------------------------


def test_an_unknown_agent_is_invalid_params_naming_the_agents_there_are(agentd: Agentd) -> None:
    with agentd.client() as c, pytest.raises(errors.InvalidParamsError) as refused:
        c.new(agent="nobody", workspace=agentd.workspace)
    assert str(refused.value) == "there is no agent 'nobody'; the agents are coder"


def test_a_workspace_outside_the_roots_is_invalid_params(agentd: Agentd, tmp_path: Path) -> None:
    with agentd.client() as c, pytest.raises(errors.InvalidParamsError) as refused:
        c.new(agent="coder", workspace=tmp_path)
    assert str(refused.value).startswith(f"workspace {tmp_path} is not inside a workspace root of agent 'coder'")


def test_prompt_on_a_session_without_an_agent_is_invalid_params(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = c.new()
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.prompt(session, "hello")
    assert str(refused.value).startswith(f"session {session!r} was not made with an agent")


def test_a_prompt_retried_with_its_key_answers_the_same_turn_and_starts_nothing(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="once"))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "hello", key="k1")
        until_done(c, turn)
        again = c.prompt(session, "hello", key="k1")
    assert (again, agentd.standin.count) == (turn, 1)


def test_a_prompt_key_reused_for_another_prompt_is_conflict_and_starts_nothing(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="once"))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "hello", key="k1")
        until_done(c, turn)
        with pytest.raises(errors.ConflictError) as refused:
            c.prompt(session, "delete everything", key="k1")
    assert (refused.value.kind, str(refused.value), agentd.standin.count) == (
        "CONFLICT",
        f"key 'k1' was used for another prompt (turn {turn}); use a new key for a new prompt",
        1,
    )


def test_turns_are_numbered_above_every_turn_the_session_had(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="one"), Scripted(text="two"))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        first = c.prompt(session, "one")
        until_done(c, first)
        second = c.prompt(session, "two")
        until_done(c, second)
    assert (first, second) == (1, 3)


def test_the_agent_and_workspace_survive_a_restart_and_a_fork_carries_them(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="before"), Scripted(text="in the fork"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "first")
    agentd.daemon.stop()
    agentd.daemon.start()
    with agentd.client() as c:
        fork = c.fork(session)
        run_turn(c, fork, "second")
        assert conversation(c, fork)[-1] == {"Agent": {"text": "in the fork"}}


# -- confinement and policy ------------------------------------------------------------------------------------------


def test_a_symlink_that_leaves_the_workspace_is_refused_and_nothing_outside_is_read(agentd: Agentd) -> None:
    outside = agentd.workspace.parent.parent / "secret.txt"
    outside.write_text("do not read\n")
    (agentd.workspace / "link").symlink_to(outside)
    agentd.standin.script(Scripted(tool_calls=[("read", {"path": "link"})]), Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "read the link")
        assert results(c, session) == [
            (2, f"refused: link leads outside the workspace (to {outside}) through a symbolic link", True)
        ]


def test_dotdot_and_absolute_paths_are_refused_before_anything_is_touched(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("write", {"path": "../escaped.txt", "text": "x"}), ("read", {"path": "/etc/hostname"})]),
        Scripted(text="ok"),
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "escape")
        refused = results(c, session)
    assert ([failed for _, _, failed in refused], (agentd.workspace.parent / "escaped.txt").exists()) == (
        [True, True],
        False,
    )


def test_a_command_cannot_write_outside_the_workspace_under_the_sandbox(agentd: Agentd) -> None:
    # Outside the workspace and not under /tmp (which the sandbox makes a private one), wherever the checkout is.
    outside = Path("/var/tmp") / f".devd-outside-{os.getpid()}.txt"
    agentd.standin.script(
        Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", f"echo x > {outside}"]})]), Scripted(text="ok")
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "write outside")
        ((_, text, failed),) = results(c, session)
    assert (failed, "Read-only file system" in text, outside.exists()) == (True, True, False)


def test_a_command_cannot_reach_the_network_under_the_sandbox(agentd: Agentd) -> None:
    port = agentd.standin.url.split(":")[2].split("/")[0]
    # bash from the read-only root: this interpreter may live under /tmp, which the sandbox makes a private one.
    connect = ["/bin/bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": connect})]), Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "connect")
        ((_, text, failed),) = results(c, session)
    assert (failed, "Connection refused" in text, agentd.standin.count) == (True, True, 2)


DENY_TOUCH = '[ { prefix = ["touch"], decision = "deny" } ]'


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["touch", "marker"], ""),
        (["env", "touch", "marker"], " (the command runs touch marker)"),
        (["sh", "-c", "timeout 5 /usr/bin/touch marker"], " (the command runs /usr/bin/touch marker)"),
    ],
)
def test_a_call_the_policy_denies_never_runs_even_through_a_wrapper(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, argv: list[str], why: str
) -> None:
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    standin.script(Scripted(tool_calls=[("exec", {"argv": argv})]), Scripted(text="ok"))
    agents = _agents_file(tmp_path, standin, rules=DENY_TOUCH)
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon, daemon.client() as c:
        session = c.new(agent="coder", workspace=tmp_path / "roots" / "ws")
        run_turn(c, session, "touch it")
        assert (results(c, session), (tmp_path / "roots" / "ws" / "marker").exists()) == (
            [(2, f"denied by the policy: the rule prefix = ['touch'] of agent 'coder' says deny{why}", True)],
            False,
        )


def test_at_most_max_calls_per_reply_calls_of_one_reply_run_and_the_rest_are_answered_as_one_refused_call(
    agentd: Agentd,
) -> None:
    (agentd.workspace / "a.txt").write_text("a\n")
    agentd.standin.script(Scripted(tool_calls=[("read", {"path": "a.txt"})] * 150), Scripted(text="read"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "read it 150 times")
        runs = [text for _, text, failed in results(c, session) if (text, failed) == ("a\n", False)]
    request = agentd.standin.requests[1].body["messages"]
    calls = [call["id"] for m in request if m["role"] == "assistant" for call in m.get("tool_calls") or []]
    refused = [(m["tool_call_id"], m["content"]) for m in request if m["role"] == "tool" and "not run" in m["content"]]
    assert (len(runs), len(calls), refused) == (
        100,
        101,
        [
            (
                "call_standin_100",
                "error: not run: the reply made 150 tool calls and at most 100 of one reply are carried out (agent "
                "'coder' has max_calls_per_reply = 100); this call and the 49 after it were not run, and are left out "
                "of the conversation; make the calls still needed in your next reply",
            )
        ],
    )


def test_a_tool_call_the_core_cannot_take_is_answered_to_the_model_as_a_failed_call(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[("delete_everything", {})]), Scripted(text="sorry"))
    with agentd.client() as c:
        run_turn(c, agentd.session(c), "go")
    assert tool_messages(agentd.standin, 1) == [
        'error: there is no tool named "delete_everything"; the tools are exec, read, write, git, browse, delegate'
    ]


def test_a_tool_action_is_answered_at_once_as_a_failed_call_naming_it(agentd: Agentd) -> None:
    """No kind of tool answers to a name yet: a Tool call another client's answer dispatched is never left waiting."""
    held = threading.Event()
    agentd.standin.script(Scripted(text="late", held=held, held_after=1), Scripted(text="done"))
    search = Call(Tool=ToolCall(name="search", input=msgspec.Raw(b'{"q": 1}')))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "search")
        wait_for(lambda: agentd.standin.count == 1, "the model's stream")
        c.step(session, answer(1, calls=[search]))
        held.set()
        until_done(c, turn)
        assert conversation(c, session) == [
            {"User": "search"},
            {"Agent": {"calls": [{"id": 2, "call": {"Tool": {"name": "search", "input": {"q": 1}}}}]}},
            {"Tool": {"id": 2, "text": "no tool is named search", "failed": True}},
            {"Agent": {"text": "done"}},
        ]


def test_a_rejected_call_stays_in_every_later_request(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("read", {"path": "a"}), ("exec", "not json")]),
        Scripted(text="one"),
        Scripted(text="two"),
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "first")
        run_turn(c, session, "second")
    first, last = agentd.standin.requests[1].body["messages"], agentd.standin.requests[2].body["messages"]
    assert last[: len(first)] == first


# -- stalls ----------------------------------------------------------------------------------------------------------


def test_an_unreachable_model_stalls_the_session_until_it_is_resumed(agentd: Agentd) -> None:
    agentd.standin.script(*[Scripted(status=500)] * 4)
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        c.prompt(session, "hello")
        stalled = next_notice(ui, "session/stalled")
        listed = c.list().sessions[0].stalled
        agentd.standin.script(Scripted(text="back again"))
        c.resume(session)
        until_done(ui, 1)
        why = stalled.params["why"]
        said = (why.startswith("the model cannot be reached: "), why.endswith("; `session/resume` tries again"))
        assert (stalled.params["action"], listed, c.list().sessions[0].stalled, conversation(c, session)[-1], said) == (
            1,
            why,
            None,
            {"Agent": {"text": "back again"}},
            (True, True),
        )


def test_a_cancel_ends_a_stall_and_the_next_prompt_is_carried_out_without_a_resume(agentd: Agentd) -> None:
    agentd.standin.script(*[Scripted(status=500)] * 4)
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        turn = c.prompt(session, "hello")
        next_notice(ui, "session/stalled")
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        agentd.standin.script(Scripted(text="back again"))
        again = c.prompt(session, "again")
        until_done(ui, again)
        assert (c.info(session).stalled, conversation(c, session)[-1]) == (None, {"Agent": {"text": "back again"}})


def test_a_driver_that_fails_stalls_the_session_saying_why_and_a_resume_carries_on(
    agentd: Agentd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the failed driver left the turn waiting for a command no one ran, and no one was told: an editor's
    prompt waited for ever (seen once in a full run, where the interpreter raised a SystemError in the driver)."""
    claimed = failpoints._passes.get("agent.claimed", 0) + 1  # passes are counted for the process: the next one
    monkeypatch.setitem(failpoints._POINTS, "agent.claimed", ("eio", claimed))
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs"]})]), Scripted())
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        c.prompt(session, "run it")
        stalled = next_notice(ui, "session/stalled")
        c.resume(session)
        until_done(ui, 1)
        assert (stalled.params, results(c, session), (agentd.workspace / "runs").exists()) == (
            {
                "session": session,
                "action": 2,
                "why": "the daemon failed carrying out action 2 (OSError: [Errno 5] Input/output error (failpoint "
                "agent.claimed)); `session/resume` retries",
            },
            [(2, INTERRUPTED.format(what="command"), True)],
            False,
        )


# -- a session that ends under its turn ------------------------------------------------------------------------------


@pytest.fixture
def ending(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agentd]:
    """A daemon whose core ends an agent session mid-turn: its turn runs `sleep 1`, and stepping the result spins
    until the call's deadline (1 s), as a core that loops for ever does."""
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    agents = _agents_file(tmp_path, standin)
    core = tmp_path / "ends-mid-turn.wasm"
    core.write_bytes(modules.ENDS_MID_TURN)
    with InProcess(tmp_path / "d", "--agents", str(agents), "--core", str(core), "--call-timeout", "1") as daemon:
        yield Agentd(daemon, tmp_path / "roots" / "ws", standin)


def ended_why(session: str) -> str:
    return (
        "ended while its turn ran (DEADLINE: the call ran past its deadline and was stopped; session "
        f"'{session}' ended: `session/recover` brings it back from its last step); after `session/recover`, "
        "`session/resume` carries the turn on"
    )


def test_a_session_that_ends_under_its_turn_tells_its_watchers_once_why_and_what_carries_it_on(
    ending: Agentd,
) -> None:
    """Before, the daemon only logged `agent.driver_stopped`: a watcher got nothing, and a client that prompted
    waited for ever (issue 35: seen at 300 sessions)."""
    with ending.client() as c, ending.client() as ui:
        session = ending.session(c)
        watch_raw(ui, session)
        c.prompt(session, "run it")
        told = next_notice(ui, "session/unwatched").params
        assert told == {"session": session, "seq": 1, "reason": ended_why(session)}


def test_a_wait_on_a_turn_whose_session_ends_under_it_answers_that_it_ended(ending: Agentd) -> None:
    with ending.client() as c:
        session = ending.session(c)
        turn = c.prompt(session, "run it")
        with pytest.raises(errors.HandleError, match=f"^session '{session}' ended \\(the call ran past its deadline"):
            c.wait(session, turn, timeout_ms=10_000)  # asked while the command runs, before the session ends


# -- crashes: nothing run twice, nothing acknowledged lost, every turn ends -------------------------------------------


def test_a_command_the_daemon_was_killed_during_is_not_run_again_and_is_stepped_interrupted(
    agentd_process: Agentd,
) -> None:
    marker = agentd_process.workspace / "runs"
    agentd_process.standin.script(
        Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs; sleep 60"]})]), Scripted(text="after")
    )
    with agentd_process.client() as c:
        session = agentd_process.session(c)
        c.prompt(session, "run it")
    # Its line, not the file alone: the shell makes the file before it writes, and the command dies with the daemon.
    wait_for(lambda: marker.exists() and marker.read_text() == "run\n", "the command's first line")
    agentd_process.daemon.kill()
    agentd_process.daemon.start()
    with agentd_process.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        assert (marker.read_text(), results(c, session)) == (
            "run\n",
            [(2, INTERRUPTED.format(what="command"), True)],
        )


@pytest.mark.parametrize(
    ("point", "what"),
    [("agent.claimed", "write"), ("agent.done", "write")],
)
def test_a_write_the_daemon_was_killed_around_is_not_done_again(
    tmp_path: Path, standin: Standin, point: str, what: str
) -> None:
    running = start(tmp_path, standin, env={"DEVD_FAILPOINTS": f"{point}=kill@1"})
    standin.script(Scripted(tool_calls=[("write", {"path": "w.txt", "text": "once"})]), Scripted(text="after"))
    with running.client() as c:
        session = running.session(c)
        c.prompt(session, "write")
    running.daemon.proc.wait(20)  # type: ignore[union-attr]
    running.daemon.env = {k: v for k, v in running.daemon.env.items() if k != "DEVD_FAILPOINTS"}
    with running.daemon.start(), running.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        assert results(c, session) == [(2, INTERRUPTED.format(what=what), True)]


def test_a_model_stream_the_daemon_was_killed_during_is_asked_again(agentd_process: Agentd) -> None:
    agentd_process.standin.script(Scripted(text="never finished", hang=True), Scripted(text="asked again"))
    with agentd_process.client() as c:
        session = agentd_process.session(c)
        c.prompt(session, "think")
    wait_for(lambda: agentd_process.standin.count == 1, "the first request")
    agentd_process.daemon.kill()
    agentd_process.daemon.start()
    with agentd_process.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        assert (conversation(c, session)[-1], agentd_process.standin.count) == ({"Agent": {"text": "asked again"}}, 2)


def test_a_result_whose_commit_the_daemon_was_killed_before_is_stepped_interrupted_not_run_again(
    tmp_path: Path, standin: Standin
) -> None:
    # As below, killed as the Exec result's commit (the 11th) is about to be written: the result was never durable.
    running = start(tmp_path, standin, env={"DEVD_FAILPOINTS": "commit.before=kill@11"})
    standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs"]})]), Scripted(text="after"))
    with running.client() as c:
        session = running.session(c)
        c.prompt(session, "run")
    running.daemon.proc.wait(20)  # type: ignore[union-attr]
    running.daemon.env = {k: v for k, v in running.daemon.env.items() if k != "DEVD_FAILPOINTS"}
    with running.daemon.start(), running.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        assert ((running.workspace / "runs").read_text(), results(c, session)) == (
            "run\n",
            [(2, INTERRUPTED.format(what="command"), True)],
        )


def test_browse_is_refused_unless_the_profile_lists_it(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[("browse", {"url": "http://127.0.0.1:1/"})]), Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "browse")
        assert results(c, session) == [
            (2, "denied by the policy: agent 'coder' does not list \"browse\" in its tools", True)
        ]


def test_a_result_whose_commit_the_daemon_was_killed_after_is_kept_and_not_run_again(
    tmp_path: Path, standin: Standin
) -> None:
    # Commits, in order: the session, its agent record, the turn record, the Turn step, the title, the model call's
    # trace and usage records, the Model answer, the claim, the command's ledger and trace records (one write), the
    # Exec result (the 11th): killed once it is durable, before anyone is told.
    running = start(tmp_path, standin, env={"DEVD_FAILPOINTS": "commit.after=kill@11"})
    standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs"]})]), Scripted(text="after"))
    with running.client() as c:
        session = running.session(c)
        c.prompt(session, "run")
    running.daemon.proc.wait(20)  # type: ignore[union-attr]
    running.daemon.env = {k: v for k, v in running.daemon.env.items() if k != "DEVD_FAILPOINTS"}
    with running.daemon.start(), running.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        assert ((running.workspace / "runs").read_text(), results(c, session)) == ("run\n", [(2, "", False)])


# -- cancel ----------------------------------------------------------------------------------------------------------


def _sleepers(tag: str) -> list[int]:
    """The processes (not zombies) whose command line is tag."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline.strip() == tag and state != "Z":
            found.append(int(pid))
    return found


def _outliving(tag: str, within_s: float = 10.0) -> list[int]:
    """The processes `_sleepers` finds still there within_s after they were killed: a SIGKILLed process ends a moment
    after the kill (its pid namespace emptied by the kernel, then reaped), and a first look under load raced it."""
    deadline = time.monotonic() + within_s
    while (found := _sleepers(tag)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_cancel_kills_the_running_commands_process_group_and_steps_it_cancelled(agentd_process: Agentd) -> None:
    tag = f"sleep {3000 + os.getpid() % 1000}"
    agentd_process.standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", f"{tag} & {tag}; wait"]})]))
    with agentd_process.client() as c:
        session = agentd_process.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "sleep")
        wait_for(lambda: len(_sleepers(tag)) == 2, "both sleeps")
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        until_done(c, turn)
        stepped = c.wait_notification(30).params["event"]
        assert (stepped, _outliving(tag)) == (
            {
                "Exec": {
                    "id": 2,
                    "text": "cancelled: the turn was cancelled while this command ran; its process group was killed",
                    "failed": True,
                }
            },
            [],
        )


# -- for people ------------------------------------------------------------------------------------------------------


def test_devd_run_shows_the_turn_and_exits_0(agentd_process: Agentd) -> None:
    agentd_process.standin.script(
        Scripted(text="Reading.", tool_calls=[("read", {"path": "a.txt"})]), Scripted(text="a.txt says hi.")
    )
    (agentd_process.workspace / "a.txt").write_text("hi\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devd",
            "run",
            "--connect",
            str(agentd_process.daemon.socket),
            "--agent",
            "coder",
            "--workspace",
            str(agentd_process.workspace),
            "what does a.txt say?",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (done.returncode, done.stdout) == (0, "Reading.\nread a.txt\n  hi\na.txt says hi.\n[turn 1 complete]\n")


def test_devd_run_whose_session_ends_under_its_turn_exits_1_saying_why_and_the_devd_verbs_that_carry_it_on(
    ending: Agentd,
) -> None:
    """Before, `devd run` waited for ever: the daemon told its watch nothing."""
    argv = [sys.executable, "-m", "devd", "run", "--connect", str(ending.daemon.socket), "--session", "spun"]
    done = subprocess.run(
        [*argv, "--agent", "coder", "--workspace", str(ending.workspace), "run it"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (done.returncode, done.stdout.splitlines()[-1]) == (
        1,
        "[the watch ended: ended while its turn ran (DEADLINE: the call ran past its deadline and was stopped; session "
        "'spun' ended: `devd recover spun` brings it back from its last step); after `devd recover spun`, "
        "`devd resume spun` carries the turn on]",
    )


def test_a_bad_agents_file_refuses_to_start_naming_its_line(tmp_path: Path) -> None:
    agents = tmp_path / "agents.toml"
    agents.write_text(
        f'[agent.coder]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = 3\nworkspace_roots = ["{tmp_path}"]\n'
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devd",
            "serve",
            "--agents",
            str(agents),
            "--state-dir",
            str(tmp_path / "s"),
            "--socket",
            str(tmp_path / "s.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"devd: cannot start: {agents}:3: agent.coder.model is 3; it must be a string\n",
    )


def test_a_stall_survives_a_restart_and_the_daemon_asks_again_at_start(agentd: Agentd) -> None:
    agentd.standin.script(*[Scripted(status=503)] * 4)
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        c.prompt(session, "hello")
        next_notice(ui, "session/stalled")
    agentd.daemon.stop()
    agentd.standin.script(Scripted(text="asked at start"))
    agentd.daemon.start()
    with agentd.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        assert conversation(c, session)[-1] == {"Agent": {"text": "asked at start"}}


def test_cancel_during_the_model_stream_closes_it_and_nothing_of_the_turn_starts(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="thinking hard", hang=True))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "think")
        wait_for(lambda: agentd.standin.count == 1, "the request")
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        until_done(c, turn)
        assert (agentd.standin.wait_closed(), c.pending(session), agentd.standin.count) == (True, [], 1)


def test_a_write_the_profile_asks_about_is_not_run_until_a_client_allows_it(tmp_path: Path, standin: Standin) -> None:
    running = start(tmp_path, standin, write='"ask"')
    standin.script(Scripted(tool_calls=[("write", {"path": "w.txt", "text": "x"})]), Scripted(text="ok"))
    with running.daemon, running.client() as c:
        session = running.session(c)
        watch_raw(c, session)
        c.prompt(session, "write")
        asked = next_notice(c, "session/approval")
        written_before = (running.workspace / "w.txt").exists()
        c.call("session/approve", {k: asked.params[k] for k in ("session", "action", "digest")} | {"decision": "allow"})
        until_done(c, 1)
        assert (written_before, (running.workspace / "w.txt").read_text()) == (False, "x")


def test_devd_run_ctrl_c_cancels_the_turn_and_exits_130(agentd_process: Agentd) -> None:
    agentd_process.standin.script(Scripted(text="never done", hang=True))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devd",
            "run",
            "--connect",
            str(agentd_process.daemon.socket),
            "--session",
            "ctrl-c",
            "--workspace",
            str(agentd_process.workspace),
            "think",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wait_for(lambda: agentd_process.standin.count == 1, "the request")
    run.send_signal(signal.SIGINT)
    out, _ = run.communicate(timeout=30)
    with agentd_process.client() as c:
        assert (run.returncode, out.decode().splitlines()[-1], c.pending("ctrl-c")) == (130, "[turn 1 cancelled]", [])


def test_devd_attach_shows_a_turn_someone_else_prompted_until_it_ends(agentd_process: Agentd) -> None:
    agentd_process.standin.script(Scripted(text="slowly written", split=1, delay_s=0.3))
    with agentd_process.client() as c:
        session = agentd_process.session(c)
        c.prompt(session, "go")
        wait_for(lambda: agentd_process.standin.count == 1, "the request")
        # "--": a name the daemon makes up may begin with "-"
        attach = subprocess.Popen(
            [sys.executable, "-m", "devd", "attach", "--connect", str(agentd_process.daemon.socket), "--", session],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        out, _ = attach.communicate(timeout=60)
    assert (attach.returncode, out.decode().splitlines()[-2:]) == (0, ["slowly written", "[turn 1 complete]"])


def test_a_clients_calls_on_a_driven_session_wait_out_the_daemons_own_steps_rather_than_busy(agentd: Agentd) -> None:
    (agentd.workspace / "a.txt").write_text("a\n")
    agentd.standin.script(*[Scripted(tool_calls=[("read", {"path": "a.txt"})])] * 20, Scripted(text="ok"))
    with agentd.client() as c, agentd.client() as other:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "read it often")
        answered = 0
        while other.pending(session):  # every call answered, none BUSY, until the turn is over
            answered += 1
        until_done(c, turn)
    assert (answered > 0, agentd.standin.count) == (True, 21)


def test_a_prompt_after_a_restart_numbers_its_turn_above_one_a_client_stepped_itself(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="client turn"), Scripted(text="prompted"))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        c.step(session, Event(Turn=Turn(id=100, prompt="mine")))
        until_done(c, 100)
    agentd.daemon.stop()
    agentd.daemon.start()
    with agentd.client() as c:
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "yours")
        until_done(c, turn)
        assert (turn, conversation(c, session)[-1]) == (101, {"Agent": {"text": "prompted"}})


def test_a_command_cannot_reach_the_daemons_socket_nor_its_state_directory(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both outside /tmp (whose sandbox copy is private anyway), as a daemon's are: a command that reached the socket
    # could approve its own actions and drive any session; the state directory holds the token and the database.
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots"))
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="devd-test-") as root:
        with InProcess(Path(root) / "d", "--agents", str(agents)) as daemon:
            # ls's complaint aside: under a root daemon the command, never root, cannot even pass the 0700 directories
            # above them; what it must never print is what they hold.
            probe = f"test -S {daemon.socket} && echo socket; ls -A {daemon.state} 2>/dev/null; echo looked"
            standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", probe]})]), Scripted(text="Done."))
            with daemon.client() as c:
                session = c.new(agent="coder", workspace=tmp_path / "roots" / "ws")
                run_turn(c, session, "look around")
                assert results(c, session) == [(2, "looked\n", False)]


def test_a_session_whose_turn_runs_past_expire_after_expires_only_once_the_turn_has_ended(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The model answers over about 3 s, three times --expire-after, and nothing calls the session meanwhile: its turn
    # is what uses it. It once expired mid-turn, deleted under its own driver (a parent waiting for its children too).
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    agents = _agents_file(tmp_path, standin)
    standin.script(Scripted(text="slowly", split=1, delay_s=0.5))
    with InProcess(tmp_path / "d", "--agents", str(agents), "--expire-after", "1s") as daemon, daemon.client() as c:
        session = c.new(agent="coder", workspace=tmp_path / "roots" / "ws")
        watch_raw(c, session)
        seen = [n.method for n in until_done(c, c.prompt(session, "hi"))]
        after = next_notice(c, "session/unwatched").params["reason"]
    assert ("session/unwatched" in seen, after) == (False, "expired")


def test_devd_run_whose_daemon_dies_mid_turn_says_so_in_a_line_and_how_to_follow_the_turn_again(
    agentd_process: Agentd,
) -> None:
    agentd_process.standin.script(Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs; sleep 60"]})]))
    socket = str(agentd_process.daemon.socket)
    argv = [sys.executable, "-m", "devd", "run", "--connect", socket, "--session", "gone", "--workspace"]
    run = subprocess.Popen(
        [*argv, str(agentd_process.workspace), "run it"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wait_for((agentd_process.workspace / "runs").exists, "the command's start")
    agentd_process.daemon.kill()
    _, err = run.communicate(timeout=30)
    assert (run.returncode, err.decode().splitlines()[1:]) == (  # the first: the session's name, said at its start
        3,
        [
            f"devd: cannot reach the daemon at {socket}: the connection was lost while watching session 'gone'; the "
            "turn is the daemon's: once it answers again, `devd attach -- gone` shows it"
        ],
    )


def test_a_workspace_inside_the_daemons_state_directory_is_refused_saying_why(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path))  # a root holding the daemon's state directory too
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon, daemon.client() as c:
        inside = daemon.state / "ws"
        inside.mkdir()
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.new(agent="coder", workspace=inside)
    assert str(refused.value) == (
        f"workspace {inside} is inside the daemon's own {daemon.state}, which its commands cannot see; use a "
        "directory outside it"
    )
