"""Approvals any client can answer, spend ceilings refused before dispatch, and one trace record per call (issue 18):
end to end against the real daemon, the stand-in model server, real files and real bubblewrap."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devd import errors
from devd.agent.cli import Screen, approval_lines, call_line, decision_of, prompt_line
from devd.client import Client, Reply
from devd.messages import Action, Cancel, Event, Exec, Op, Write
from devd.protocol import ApprovalNotice, DecidedNotice, Remembered, client_name_problem
from tests.agents import next_notice
from tests.daemon import Daemon, free_port
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.terminal import Terminal

__all__ = ["standin_fixture"]

NOTICE_TIMEOUT_S = 30.0
PEER = f"(uid {os.getuid()}, pid {os.getpid()})"  # this process, as the daemon knows it over its Unix socket
T = TypeVar("T")
MARK = ["sh", "-c", "echo ran >> marker"]  # a command whose every run leaves a line


def agents_toml(url: str, root: Path, **extra: str) -> str:
    """One profile, `coder`, whose commands need a decision; extra keys are TOML values as written."""
    lines = [
        "[agent.coder]",
        f'base_url = "{url}"',
        'model = "standin-model"',
        f'workspace_roots = ["{root}"]',
        *(f"{key} = {value}" for key, value in {"exec": '"ask"', **extra}.items()),
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Agentd:
    daemon: Daemon | InProcess
    workspace: Path
    standin: Standin

    def client(self, name: str) -> Client:
        c = self.daemon.client()
        c.initialize(name=name)
        return c

    def marks(self) -> int:
        marker = self.workspace / "marker"
        return len(marker.read_text().splitlines()) if marker.exists() else 0


def start(tmp_path: Path, standin: Standin, **extra: str) -> Agentd:
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", **extra))
    daemon = Daemon(tmp_path / "d", "--agents", str(agents))
    return Agentd(daemon.start(), workspace, standin)


@pytest.fixture
def agentd(tmp_path: Path, standin: Standin) -> Iterator[Agentd]:
    """The daemon with agents, in this process."""
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots"))
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon:
        yield Agentd(daemon, tmp_path / "roots" / "ws", standin)


@pytest.fixture
def agentd_process(tmp_path: Path, standin: Standin) -> Iterator[Agentd]:
    """The daemon with agents as a process of its own, for a test that kills it or runs `devd run` against it."""
    running = start(tmp_path, standin)
    with running.daemon:
        yield running


def watch(c: Client, session: str) -> None:
    c.call("session/watch", {"session": session})


def until_done(c: Client) -> list[Reply]:
    """The notices up to the step whose actions end a turn."""
    seen = []
    while True:
        notice = c.wait_notification(NOTICE_TIMEOUT_S)
        seen.append(notice)
        if notice.method == "session/actions" and any("Done" in a["op"] for a in notice.params["actions"]):
            return seen


def approval(c: Client, session: str, prompt: str) -> dict[str, Any]:
    """Prompt the session (c watches it) and wait for the approval its command needs: the notice's params."""
    c.prompt(session, prompt)
    params: dict[str, Any] = next_notice(c, "session/approval").params
    return params


def answer(c: Client, params: dict[str, Any], decision: str, **extra: Any) -> None:
    c.call("session/approve", {**_named(params), "decision": decision, **extra})


def _named(params: dict[str, Any]) -> dict[str, Any]:
    return {k: params[k] for k in ("session", "action", "digest")}


def unbusy(call: Callable[[], T]) -> T:
    """call(), sent again while it is answered BUSY (the daemon's own driver is inside a call on the session, as
    after a restart): what the protocol tells a client to do."""
    for _ in range(200):
        try:
            return call()
        except errors.BusyError:
            time.sleep(0.01)
    return call()


def tool_texts(standin: Standin, request: int) -> list[str]:
    return [m["content"] for m in standin.requests[request].body["messages"] if m["role"] == "tool"]


def mark_then_finish(standin: Standin) -> None:
    standin.script(Scripted(tool_calls=[("exec", {"argv": MARK})]), Scripted(text="done"))


# -- approvals ------------------------------------------------------------------------------------------------------


def test_the_approval_every_watcher_gets_names_the_action_its_op_and_a_digest(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        params = approval(c, session, "mark it")
    assert (params["session"], params["action"], params["op"], len(params["digest"])) == (
        session,
        2,
        {"Exec": {"argv": MARK}},
        64,
    )


def test_a_command_the_rules_cannot_see_into_is_asked_about_saying_why_though_exec_allows(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin, exec='"allow"', rules='[ { prefix = ["rm"], decision = "deny" } ]')
    standin.script(Scripted(tool_calls=[("exec", {"argv": ["python3", "-c", "print(1)"]})]), Scripted(text="done"))
    with agentd.daemon, agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        params = approval(c, session, "run it")
        answer(c, params, "deny")
        until_done(c)
    assert params["why"] == (
        "python3 runs code that its arguments do not show as a command, and agent 'coder' has rules that deny or ask "
        "(prefix = ['rm']) which what it runs could match: a person decides"
    )


def test_a_deny_rule_sees_through_a_shells_valued_options_and_asks_about_setpriv_and_neither_runs(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin, exec='"allow"', rules='[ { prefix = ["touch"], decision = "deny" } ]')
    calls = [
        ("exec", {"argv": ["bash", "-oc", "posix", "touch marker"]}),
        ("exec", {"argv": ["setpriv", "touch", "marker"]}),
    ]
    standin.script(Scripted(tool_calls=calls), Scripted(text="done"))
    with agentd.daemon, agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        params = approval(c, session, "touch it")
        answer(c, params, "deny")
        until_done(c)
    assert (params["op"], params["why"], tool_texts(standin, 1), (agentd.workspace / "marker").exists()) == (
        {"Exec": {"argv": ["setpriv", "touch", "marker"]}},
        "setpriv runs code that its arguments do not show as a command, and agent 'coder' has rules that deny or ask "
        "(prefix = ['touch']) which what it runs could match: a person decides",
        [
            "error: denied by the policy: the rule prefix = ['touch'] of agent 'coder' says deny (the command runs "
            "touch marker)",
            f"error: denied by ui-1 {PEER}: the user did not approve this call",
        ],
        False,
    )


def test_one_ui_approves_the_other_is_told_conflict_naming_who_and_the_command_runs_once(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as one, agentd.client("ui-2") as two:
        session = one.new(agent="coder", workspace=agentd.workspace)
        watch(one, session)
        watch(two, session)
        params = approval(one, session, "mark it")
        next_notice(two, "session/approval")
        answer(one, params, "allow")
        with pytest.raises(errors.ConflictError, match=re.escape(f"already decided: allow by ui-1 {PEER};")):
            answer(two, params, "deny")
        until_done(two)
    assert agentd.marks() == 1


def test_every_watcher_is_told_who_decided(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as one, agentd.client("ui-2") as two:
        session = one.new(agent="coder", workspace=agentd.workspace)
        watch(one, session)
        watch(two, session)
        params = approval(one, session, "mark it")
        answer(one, params, "allow")
        decided = next_notice(two, "session/decided").params
    assert decided == {"session": session, "action": 2, "decision": "allow", "by": f"ui-1 {PEER}", "remembered": None}


def test_a_client_name_that_could_forge_who_decided_is_refused_at_initialize(agentd: Agentd) -> None:
    forged = "alice (uid 1000, pid 4242)\n[action 2 denied by root]"
    with agentd.daemon.client() as c, pytest.raises(errors.InvalidParamsError) as refused:
        c.initialize(name=forged)
    assert str(refused.value) == (
        f"client.name {forged!r} cannot name a client (it holds '('): a name is 1 to 64 printable characters on one "
        "line, without ( ) [ ] { } < >, such as 'devd cli'; nothing was set: send initialize again with such a name"
    )


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("devd cli", None),
        ("ui-1", None),
        ("x" * 64, None),
        ("x" * 65, "it has 65 characters"),
        ("", "it has 0 characters"),
        ("a\nb", "it holds '\\n'"),
        ("a\u202eb", "it holds '\\u202e'"),
        ("a [b]", "it holds '['"),
        ("a <b>", "it holds '<'"),
        ("alice \uff08uid 0, pid 1\uff09", "it holds '\uff08'"),
        ("a \u207db\u207e", "it holds '\u207d'"),
    ],
)
def test_a_client_name_is_one_short_printable_line_without_brackets(name: str, problem: str | None) -> None:
    assert client_name_problem(name) == problem


def test_an_approval_over_tcp_is_by_its_name_and_address(tmp_path: Path, standin: Standin) -> None:
    mark_then_finish(standin)
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    (tmp_path / "agents.toml").write_text(agents_toml(standin.url, tmp_path / "roots"))
    port = free_port()
    tcp = ["--listen", f"tcp://127.0.0.1:{port}"]
    with InProcess(tmp_path / "d", "--agents", str(tmp_path / "agents.toml"), *tcp) as daemon:
        token = (daemon.state / "token").read_text().strip()
        with daemon.client() as c, socket.create_connection(("127.0.0.1", port)) as raw:
            session = c.new(agent="coder", workspace=workspace)
            watch(c, session)
            params = approval(c, session, "mark it")
            lines = raw.makefile("rwb")
            hello = {"client": {"name": "ui-tcp"}, "token": token}
            approve = {**_named(params), "decision": "allow"}
            for n, (method, call_params) in enumerate([("initialize", hello), ("session/approve", approve)], 1):
                lines.write(json.dumps({"jsonrpc": "2.0", "id": n, "method": method, "params": call_params}).encode())
                lines.write(b"\n")
                lines.flush()
                assert "result" in json.loads(lines.readline())
            decided = next_notice(c, "session/decided").params
            assert decided["by"] == f"ui-tcp (127.0.0.1:{raw.getsockname()[1]})"


def test_a_denied_command_never_runs_and_the_model_is_told_who_denied_it(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as one, agentd.client("ui-2") as two:
        session = one.new(agent="coder", workspace=agentd.workspace)
        watch(one, session)
        params = approval(one, session, "mark it")
        answer(two, params, "deny")
        until_done(one)
    assert (agentd.marks(), tool_texts(agentd.standin, 1)) == (
        0,
        [f"error: denied by ui-2 {PEER}: the user did not approve this call"],
    )


def test_a_wrong_digest_is_invalid_params_and_decides_nothing(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        params = approval(c, session, "mark it")
        with pytest.raises(errors.InvalidParamsError, match="does not name action 2"):
            answer(c, {**params, "digest": "0" * 64}, "allow")
        pending = c.call("session/pending", {"session": session})["actions"]
    assert [(a["id"], a.get("awaiting")) for a in pending] == [(2, "approval")]


def test_an_approval_pending_across_a_sigkill_is_announced_again_and_runs_once_when_answered(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin)
    mark_then_finish(standin)
    with agentd.daemon:
        with agentd.client("ui-1") as c:
            session = c.new(agent="coder", workspace=agentd.workspace)
            watch(c, session)
            params = approval(c, session, "mark it")
        agentd.daemon.kill()
        agentd.daemon.start()
        with agentd.client("ui-2") as c:
            watch(c, session)
            again = next_notice(c, "session/approval").params
            answer(c, again, "allow")
            until_done(c)
    assert (again, agentd.marks()) == (params, 1)


def test_session_pending_shows_the_action_awaiting_approval_after_a_restart(tmp_path: Path, standin: Standin) -> None:
    agentd = start(tmp_path, standin)
    mark_then_finish(standin)
    with agentd.daemon:
        with agentd.client("ui-1") as c:
            session = c.new(agent="coder", workspace=agentd.workspace)
            watch(c, session)
            approval(c, session, "mark it")
        agentd.daemon.kill()
        agentd.daemon.start()
        with agentd.client("ui-2") as c:
            pending = unbusy(lambda: c.call("session/pending", {"session": session}))["actions"]
    assert pending == [{"id": 2, "op": {"Exec": {"argv": MARK}}, "awaiting": "approval"}]


def test_an_approval_pending_while_its_session_hibernates_runs_once_when_answered(
    tmp_path: Path, standin: Standin
) -> None:
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    (tmp_path / "agents.toml").write_text(agents_toml(standin.url, tmp_path / "roots"))
    daemon = Daemon(tmp_path / "d", "--agents", str(tmp_path / "agents.toml"), "--max-live", "1")
    agentd = Agentd(daemon.start(), workspace, standin)
    mark_then_finish(standin)
    with agentd.daemon, agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        params = approval(c, session, "mark it")
        c.new()  # a second live session: the first, idle while it waits, hibernates
        hibernated = next(s.state for s in c.list().sessions if s.session == session)
        answer(c, params, "allow")
        until_done(c)
    assert (hibernated, agentd.marks()) == ("stored", 1)


def test_cancel_withdraws_the_pending_approval(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as one, agentd.client("ui-2") as two:
        session = one.new(agent="coder", workspace=agentd.workspace)
        watch(one, session)
        approval(one, session, "mark it")
        two.step(session, Event(Cancel=Cancel(turn=1)))
        decided = next_notice(one, "session/decided").params
    assert (decided, agentd.marks()) == (
        {"session": session, "action": 2, "decision": "cancelled", "by": f"ui-2 {PEER}", "remembered": None},
        0,
    )


def test_remember_lets_the_same_command_run_again_without_asking(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("exec", {"argv": MARK})]),
        Scripted(tool_calls=[("exec", {"argv": MARK})]),
        Scripted(text="done"),
    )
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        answer(c, approval(c, session, "mark twice"), "allow", remember=True)
        seen = until_done(c)
    assert (agentd.marks(), [n.method for n in seen].count("session/approval")) == (2, 0)


def test_remember_true_lets_only_that_exact_command_run_again_without_asking(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("exec", {"argv": MARK})]),
        Scripted(tool_calls=[("exec", {"argv": [*MARK, "-rf"]})]),
        Scripted(text="done"),
    )
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        answer(c, approval(c, session, "mark twice"), "allow", remember=True)
        decided = next_notice(c, "session/decided").params
        again = next_notice(c, "session/approval").params
        answer(c, again, "deny")
        until_done(c)
    assert (decided["remembered"], again["action"], agentd.marks()) == ({"scope": "exact", "argv": MARK}, 4, 1)


TOUCH = ["touch", "a"]  # a command that runs no other: one a prefix grant may be kept for


def test_a_prefix_grant_covers_more_words_but_never_one_starting_with_a_dash(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("exec", {"argv": TOUCH})]),
        Scripted(tool_calls=[("exec", {"argv": [*TOUCH, "more"]})]),
        Scripted(tool_calls=[("exec", {"argv": [*TOUCH, "more", "-rf"]})]),
        Scripted(text="done"),
    )
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        answer(c, approval(c, session, "touch thrice"), "allow", remember="prefix")
        asked = next_notice(c, "session/approval").params
        answer(c, asked, "deny")
        until_done(c)
    assert (asked["action"], asked["op"], (agentd.workspace / "more").exists()) == (
        6,
        {"Exec": {"argv": [*TOUCH, "more", "-rf"]}},
        True,
    )


def test_a_prefix_grant_of_a_command_runner_is_kept_exact_saying_why_so_what_it_runs_is_asked_again(
    agentd: Agentd,
) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("exec", {"argv": ["env"]})]),
        Scripted(tool_calls=[("exec", {"argv": ["env", "touch", "marker"]})]),
        Scripted(text="done"),
    )
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        answer(c, approval(c, session, "show the environment"), "allow", remember="prefix")
        decided = next_notice(c, "session/decided").params
        asked = next_notice(c, "session/approval").params
        answer(c, asked, "deny")
        until_done(c)
    assert (decided["remembered"], asked["op"], (agentd.workspace / "marker").exists()) == (
        {
            "scope": "exact",
            "argv": ["env"],
            "narrowed": "kept exact, not as a prefix: env runs a command given in its arguments",
        },
        {"Exec": {"argv": ["env", "touch", "marker"]}},
        False,
    )


def test_devd_approve_answers_from_the_command_line(agentd: Agentd) -> None:
    from devd.cli import main

    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        approval(c, session, "mark it")
        status = main(["approve", "--connect", str(agentd.daemon.socket), session, "2"])
        until_done(c)
    assert (status, agentd.marks()) == (0, 1)


@pytest.mark.parametrize(("flag", "scope"), [("--remember", "exact"), ("--remember-prefix", "prefix")])
def test_devd_approve_remembers_what_its_flag_says(agentd: Agentd, flag: str, scope: str) -> None:
    from devd.cli import main

    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": TOUCH})]), Scripted(text="done"))
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        approval(c, session, "touch it")
        main(["approve", "--connect", str(agentd.daemon.socket), session, "2", flag])
        remembered = next_notice(c, "session/decided").params["remembered"]
        until_done(c)
    assert remembered == {"scope": scope, "argv": TOUCH}


def test_devd_approve_of_an_action_decided_already_is_conflict_naming_who_decided(
    agentd: Agentd, capsys: pytest.CaptureFixture[str]
) -> None:
    from devd.cli import main

    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        approval(c, session, "mark it")
        assert main(["approve", "--connect", str(agentd.daemon.socket), session, "2"]) == 0
        until_done(c)
    status = main(["deny", "--connect", str(agentd.daemon.socket), session, "2"])
    assert (status, "CONFLICT" in capsys.readouterr().err) == (1, True)


# -- spend ----------------------------------------------------------------------------------------------------------


def stalled(c: Client, session: str) -> str | None:
    return next(s.stalled for s in c.list().sessions if s.session == session)


def test_a_ceiling_reached_stops_the_next_call_before_it_is_sent(tmp_path: Path, standin: Standin) -> None:
    agentd = start(tmp_path, standin, exec='"allow"')
    standin.script(Scripted(tool_calls=[("exec", {"argv": ["true"]})], usage=(3000, 2000, None)), Scripted(text="ok"))
    with agentd.daemon, agentd.client("ui-1") as c:
        session = c.call(
            "session/new", {"agent": "coder", "workspace": str(agentd.workspace), "budget": {"tokens": 5000}}
        )["session"]
        watch(c, session)
        c.prompt(session, "go")
        why = next_notice(c, "session/stalled").params["why"]
        assert (standin.count, why.split(",")[0], stalled(c, session)) == (
            1,
            "spend ceiling reached: the session's budget is 5000 tokens",
            why,
        )


def test_raising_the_budget_and_resuming_carries_on(tmp_path: Path, standin: Standin) -> None:
    agentd = start(tmp_path, standin, exec='"allow"')
    standin.script(Scripted(tool_calls=[("exec", {"argv": ["true"]})], usage=(3000, 2000, None)), Scripted(text="ok"))
    with agentd.daemon, agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace, budget=5000)
        watch(c, session)
        c.prompt(session, "go")
        next_notice(c, "session/stalled")
        c.set_budget(session, 100_000)
        c.resume(session)
        until_done(c)
        usage = c.call("session/usage", {"session": session})
    assert (standin.count, usage["calls"], usage["refused"]) == (2, 2, 1)


def test_usage_is_the_providers_counts(tmp_path: Path, standin: Standin) -> None:
    agentd = start(tmp_path, standin, exec='"allow"')
    standin.script(
        Scripted(tool_calls=[("exec", {"argv": ["true"]})], usage=(120, 30, 100)),
        Scripted(text="ok", usage=(200, 5, 150)),
    )
    with agentd.daemon, agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        c.prompt(session, "go")
        until_done(c)
        usage = c.call("session/usage", {"session": session})
        fork = c.fork(session)
        forked = c.call("session/usage", {"session": fork})
    assert (usage, forked) == (
        {"input_tokens": 320, "output_tokens": 35, "cached_tokens": 250, "calls": 2, "refused": 0},
        {"input_tokens": 0, "output_tokens": 0, "cached_tokens": 0, "calls": 0, "refused": 0},
    )


def test_two_sessions_sharing_a_daily_ceiling_cannot_pass_it_together(tmp_path: Path, standin: Standin) -> None:
    # The first call reserves the whole day (its request and as much of its max_tokens as the ceiling leaves).
    agentd = start(tmp_path, standin, max_tokens="5000", budget="{ tokens_per_day = 5000 }")
    first_in_flight, release = threading.Event(), threading.Event()

    def held(body: dict[str, Any]) -> Scripted:
        first_in_flight.set()
        release.wait(NOTICE_TIMEOUT_S)  # answered only once the other session's call was refused
        return Scripted(text="one", usage=(100, 50, None))

    standin.script(held, Scripted(text="two"))
    with agentd.daemon, agentd.client("ui-1") as c:
        a = c.new(agent="coder", workspace=agentd.workspace)
        b = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, b)
        c.prompt(a, "first")
        assert first_in_flight.wait(NOTICE_TIMEOUT_S)
        c.prompt(b, "second")
        why = next_notice(c, "session/stalled").params["why"]
        release.set()
        assert (standin.count, why.split(" is ")[0]) == (
            1,
            "spend ceiling reached: tokens_per_day of agent 'coder' (UTC day "
            + why.split("UTC day ")[1].split(")")[0]
            + ")",
        )


# -- trace ----------------------------------------------------------------------------------------------------------


def test_a_failed_then_retried_model_call_is_two_trace_records_that_survive_a_restart(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin)
    standin.script(Scripted(status=503, message="overloaded"), Scripted(text="hello", usage=(10, 2, None)))
    with agentd.daemon:
        with agentd.client("ui-1") as c:
            session = c.new(agent="coder", workspace=agentd.workspace)
            watch(c, session)
            c.prompt(session, "hi")
            until_done(c)
        agentd.daemon.kill()
        agentd.daemon.start()
        with agentd.client("ui-2") as c:
            records = c.call("session/trace", {"session": session})["records"]
    assert [(r["action"], r["kind"], r["attempt"], r["outcome"], r.get("input_tokens")) for r in records] == [
        (1, "model", 1, "error", None),
        (1, "model", 2, "ok", 10),
    ]


def test_a_tool_run_and_a_denied_one_each_leave_a_trace_record(agentd: Agentd) -> None:
    mark_then_finish(agentd.standin)
    with agentd.client("ui-1") as c:
        session = c.new(agent="coder", workspace=agentd.workspace)
        watch(c, session)
        answer(c, approval(c, session, "mark it"), "deny")
        until_done(c)
        first = c.call("session/trace", {"session": session, "limit": 1})
        records = c.call("session/trace", {"session": session, "since": first["next"]})["records"]
    assert [(r["kind"], r["outcome"], r.get("error")) for r in records] == [
        ("exec", "denied", f"denied by ui-1 {PEER}: the user did not approve this call"),
        ("model", "ok", None),
    ]


# -- for people -----------------------------------------------------------------------------------------------------


def test_devd_run_at_a_terminal_asks_y_n_a_and_a_y_runs_the_command_once(agentd_process: Agentd) -> None:
    mark_then_finish(agentd_process.standin)
    argv = ["--connect", str(agentd_process.daemon.socket), "--agent", "coder"]
    with Terminal("run", *argv, "--workspace", str(agentd_process.workspace), "mark it") as t:
        shown = t.wait_for("[y/N/a/p]")
        t.type("y\r")
        assert (t.exit_status(), agentd_process.marks()) == (0, 1)
    asked = ApprovalNotice("s", 2, Op(Exec=Exec(argv=MARK)), "0" * 64)
    lines = shown.splitlines()  # the command, why it asks, the status line, the question
    assert (lines[-4:-2], lines[-2].startswith(" waiting for approval of action 2"), lines[-1]) == (
        [call_line(Action(id=2, op=asked.op)), "[approval needed for action 2: agent 'coder' has exec = \"ask\"]"],
        True,
        prompt_line(asked).rstrip(),
    )


def test_y_allows_a_remembers_the_exact_call_p_the_prefix_anything_else_denies() -> None:
    answers = [decision_of(a) for a in ("y\n", "a\n", "p\n", "\n", "no\n")]
    assert answers == [("allow", False), ("allow", "exact"), ("allow", "prefix"), ("deny", False), ("deny", False)]


def test_the_question_says_what_a_and_p_would_remember() -> None:
    asked = [
        prompt_line(ApprovalNotice("s", 2, op, "0" * 64))
        for op in (Op(Exec=Exec(argv=["rm", "a.o"])), Op(Write=Write(path="a.txt", text="")))
    ]
    assert asked == [
        "allow action 2? [y/N/a/p] (a: always, this exact command; p: always, also followed by more words not "
        'starting with "-") ',
        "allow action 2? [y/N/a] (a: always, writes to a.txt) ",
    ]


def test_devd_run_says_why_the_policy_asks() -> None:
    screen = Screen(out=io.StringIO())
    screen.show(ApprovalNotice("s", 2, Op(Exec=Exec(argv=["python3", "-c", "x"])), "0" * 64, "python3 runs code"))
    assert screen.out.getvalue() == "[approval needed for action 2: python3 runs code]\n$ python3 -c x\n"


def test_the_decided_line_says_what_is_remembered() -> None:
    screen = Screen(out=io.StringIO())
    screen.show(DecidedNotice("s", 2, "allow", "ui (uid 0, pid 7)", Remembered("prefix", argv=["rm", "a.o"])))
    assert screen.out.getvalue() == (
        "[action 2 allowed by ui (uid 0, pid 7); remembered: $ rm a.o, also followed by more words not starting "
        'with "-"]\n'
    )


def test_a_write_waiting_for_approval_is_shown_as_a_diff_of_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    notice = ApprovalNotice("s", 2, Op(Write=Write(path="a.txt", text="one\n2\n")), "0" * 64)
    assert approval_lines(notice, str(tmp_path)) == [
        "write a.txt (6 bytes)",
        "  --- a/a.txt",
        "  +++ b/a.txt",
        "  @@ -1,2 +1,2 @@",
        "   one",
        "  -two",
        "  +2",
    ]


def test_with_otel_endpoint_a_turn_arrives_as_genai_spans_at_a_collector(tmp_path: Path, standin: Standin) -> None:
    received: list[ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(request)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    collector = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    try:
        workspace = tmp_path / "roots" / "ws"
        workspace.mkdir(parents=True)
        (tmp_path / "agents.toml").write_text(agents_toml(standin.url, tmp_path / "roots", exec='"allow"'))
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        daemon = Daemon(tmp_path / "d", "--agents", str(tmp_path / "agents.toml"), "--otel-endpoint", endpoint)
        mark_then_finish(standin)
        with daemon.start(), daemon.client() as c:
            session = c.new(agent="coder", workspace=workspace)
            watch(c, session)
            c.prompt(session, "mark it")
            until_done(c)
            assert daemon.stop() == 0  # a clean stop sends the spans still queued
    finally:
        collector.shutdown()
        thread.join()
        collector.server_close()
    spans = [s for r in received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    conversation = {a.value.string_value for s in spans for a in s.attributes if a.key == "gen_ai.conversation.id"}
    assert ([s.name for s in spans], conversation) == (
        ["chat standin-model", "execute_tool exec", "chat standin-model"],
        {session},
    )


def test_a_session_expired_and_made_again_under_its_name_spends_from_zero(tmp_path: Path, standin: Standin) -> None:
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    (tmp_path / "agents.toml").write_text(agents_toml(standin.url, tmp_path / "roots", exec='"allow"'))
    daemon = Daemon(tmp_path / "d", "--agents", str(tmp_path / "agents.toml"), "--expire-after", "3s")
    standin.script(Scripted(text="hello", usage=(10, 2, None)))
    with daemon.start(), daemon.client() as c:
        session = c.new(agent="coder", workspace=workspace, session="again")
        watch(c, session)
        c.prompt(session, "hi")
        until_done(c)
        assert next_notice(c, "session/unwatched").params["reason"] == "expired"
        c.new(agent="coder", workspace=workspace, session="again")
        assert c.usage("again").calls == 0
