"""`devd acp` and child sessions (issue 34), as an editor sees them through the Agent Client Protocol's own Python SDK:
an editor that opts in with `clientCapabilities.subagents` is told of each child with `subagent_update` on its
parent before any update of the child's own (under the child's `sessionId`), and of its one terminal state after
them; an editor without subagents sees the child as its delegate call's progress. Against the real daemon with
`coder` delegating to `reviewer`, both asking the stand-in model."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import acp
import anyio
import pytest

from tests.children import delegation
from tests.daemon import ROOT, Daemon
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.test_acp import Editor, Setup, agents_toml, setup, text

__all__ = ["standin_fixture"]

REVIEWER = ['delegates = ["reviewer"]', "", "[agent.reviewer]"]


def reviewer_lines(url: str, root: Path, *extra: str) -> tuple[str, ...]:
    return (
        *REVIEWER,
        f'base_url = "{url}"',
        'model = "standin-model"',
        f'workspace_roots = ["{root}"]',
        'sandbox = "none"',
        *extra,
    )


@pytest.fixture
def kin(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    """`coder` delegates to `reviewer` (commands allowed)."""
    yield from setup(tmp_path, standin, "allow", False, *reviewer_lines(standin.url, tmp_path / "roots"))


@pytest.fixture
def kin_asking(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    """`coder` delegates to `reviewer`, which asks before each command."""
    lines = reviewer_lines(standin.url, tmp_path / "roots", 'exec = "ask"')
    yield from setup(tmp_path, standin, "allow", False, *lines)


@contextlib.asynccontextmanager
async def editor_on(setup: Setup, editor: Editor, subagents: bool = True) -> AsyncIterator[acp.ClientSideConnection]:
    """`devd acp` spawned as an editor spawns it, initialized with `clientCapabilities.subagents` (or without)."""
    setup.spawned += 1
    with open(setup.logs / f"acp-{setup.spawned}.log", "ab") as log:
        async with acp.spawn_agent_process(
            editor,  # type: ignore[arg-type]
            sys.executable,
            "-m",
            "devd",
            "acp",
            "--connect",
            str(setup.daemon.socket),
            "--agent",
            "coder",
            env={"PYTHONPATH": str(ROOT)},
            transport_kwargs={"stderr": log.fileno()},
            observers=[editor.observe],
        ) as (conn, _process):
            capabilities: dict[str, Any] = {"subagents": {}} if subagents else {}
            hello = {
                "protocolVersion": 1,
                "clientCapabilities": capabilities,
                "clientInfo": {"name": "t", "version": "1"},
            }
            await conn._conn.send_request("initialize", hello)
            yield conn


def told(editor: Editor, parent: str, child: str) -> list[tuple[str, str, str | None]]:
    """The parent's `subagent_update`s of the child and the child's own `session/update`s, in order: (whose, kind,
    state), a run of the same kind told once."""
    seen = []
    for m in editor.raw:
        if m.get("method") != "session/update":
            continue
        session, update = m["params"]["sessionId"], m["params"]["update"]
        kind = update["sessionUpdate"]
        if session == parent and kind == "subagent_update" and update["subagentSessionId"] == child:
            seen.append(("parent", kind, update.get("state")))
        elif session == child and kind != "usage_update" and seen[-1:] != [("child", kind, None)]:
            seen.append(("child", kind, None))
    return seen


def subagent_updates(editor: Editor) -> list[dict[str, Any]]:
    """The params of each `subagent_update` sent, in order."""
    return [
        m["params"]
        for m in editor.raw
        if m.get("method") == "session/update" and m["params"]["update"]["sessionUpdate"] == "subagent_update"
    ]


REVIEW = [
    delegation("reviewer", "review the change"),
    Scripted(text="it looks right", usage=(10, 20, 0)),
    Scripted(text="reviewed"),
]


async def test_initialize_says_devd_acp_has_subagents(kin: Setup) -> None:
    editor = Editor()
    async with editor_on(kin, editor):
        pass
    hello = next(m for m in editor.raw if m.get("id") == 0 and "result" in m)
    assert hello["result"]["agentCapabilities"]["sessionCapabilities"]["subagents"] == {}


async def test_a_child_is_announced_on_its_parent_before_its_updates_and_ends_once_after_them(kin: Setup) -> None:
    kin.standin.script(*REVIEW)
    editor = Editor()
    async with editor_on(kin, editor) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        answer = await conn.prompt(session_id=session, prompt=text("review it"))
        answered_at = len(editor.raw)
    child = f"{session}.d2"
    first = subagent_updates(editor)[0]["update"]
    ended_at = max(
        i
        for i, m in enumerate(editor.raw)
        if m.get("method") == "session/update" and m["params"]["update"].get("state") == "completed"
    )
    assert (answer.stop_reason, told(editor, session, child), first, ended_at < answered_at) == (
        "end_turn",
        [
            ("parent", "subagent_update", "running"),
            ("child", "user_message_chunk", None),
            ("child", "agent_message_chunk", None),
            ("parent", "subagent_update", "completed"),
        ],
        {
            "sessionUpdate": "subagent_update",
            "subagentSessionId": child,
            "name": "reviewer",
            "task": "review the change",
            "capabilities": {"cancel": True},
            "state": "running",
        },
        True,
    )


async def test_an_editor_without_subagents_sees_the_child_as_its_delegate_calls_progress(kin: Setup) -> None:
    kin.standin.script(*REVIEW)
    editor = Editor()
    async with editor_on(kin, editor, subagents=False) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("review it"))
    progress = [
        (u["params"]["update"].get("status"), u["params"]["update"]["content"][0]["content"]["text"])
        for u in editor.raw
        if u.get("method") == "session/update"
        and u["params"]["update"].get("toolCallId") == "call_2"
        and u["params"]["update"].get("content")
    ]
    assert (subagent_updates(editor), progress) == (
        [],
        [
            (None, f"delegated run {session}.d2 (reviewer): running, 0 tokens in 0 calls"),
            (None, f"delegated run {session}.d2 (reviewer): running, 30 tokens in 1 call"),
            (None, f"delegated run {session}.d2 (reviewer): completed, 30 tokens in 1 call"),
            ("completed", "it looks right"),
        ],
    )


async def test_an_editor_may_not_prompt_load_resume_or_close_a_child(kin: Setup) -> None:
    kin.standin.script(*REVIEW)
    refused = []
    async with editor_on(kin, Editor()) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("review it"))
        child = f"{session}.d2"
        asks = [
            ("session/prompt", {"sessionId": child, "prompt": [{"type": "text", "text": "hi"}]}),
            ("session/load", {"sessionId": child, "cwd": str(kin.workspace), "mcpServers": []}),
            ("session/resume", {"sessionId": child, "cwd": str(kin.workspace), "mcpServers": []}),
            ("session/close", {"sessionId": child}),
        ]
        for method, params in asks:
            with pytest.raises(acp.RequestError) as e:
                await conn._conn.send_request(method, params)
            refused.append((e.value.code, str(e.value).split(": an editor")[0]))
    said = f"session {child!r} is a subagent of session {session!r} (a delegated run)"
    assert refused == [(-32602, said)] * 4


async def test_loading_a_parent_announces_its_children_with_their_history_and_end(kin: Setup) -> None:
    kin.standin.script(*REVIEW)
    async with editor_on(kin, Editor()) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("review it"))
    editor = Editor()
    async with editor_on(kin, editor) as conn:
        await conn.load_session(cwd=str(kin.workspace), session_id=session, mcp_servers=[])
    assert told(editor, session, f"{session}.d2") == [
        ("parent", "subagent_update", "running"),
        ("child", "user_message_chunk", None),
        ("child", "agent_message_chunk", None),
        ("parent", "subagent_update", "completed"),
    ]


async def test_loading_a_parent_whose_child_is_gone_ends_it_disconnected(kin: Setup) -> None:
    kin.standin.script(*REVIEW)
    async with editor_on(kin, Editor()) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("review it"))
    with kin.daemon.client() as c:
        c.call("session/close", {"session": f"{session}.d2"})
    editor = Editor()
    async with editor_on(kin, editor) as conn:
        await conn.load_session(cwd=str(kin.workspace), session_id=session, mcp_servers=[])
    assert told(editor, session, f"{session}.d2") == [
        ("parent", "subagent_update", "running"),
        ("parent", "subagent_update", "disconnected"),
    ]


async def test_cancelling_the_parent_ends_its_child_cancelled_before_the_prompt_answers(kin: Setup) -> None:
    kin.standin.script(delegation("reviewer", "review the change"), Scripted(text="thinking", hang=True))
    editor = Editor()
    async with editor_on(kin, editor) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        child = f"{session}.d2"

        async def cancel_once_child_runs() -> None:
            await editor.until(lambda: any(m["params"]["sessionId"] == child for m in subagent_raw(editor)))
            await conn.cancel(session_id=session)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_child_runs)
            answer = await conn.prompt(session_id=session, prompt=text("review it"))
    states = [u["update"].get("state") for u in subagent_updates(editor)]
    assert (answer.stop_reason, states) == ("cancelled", ["running", "cancelled"])


def subagent_raw(editor: Editor) -> list[dict[str, Any]]:
    return [m for m in editor.raw if m.get("method") == "session/update"]


async def test_a_childs_permission_request_comes_under_the_childs_own_session(kin_asking: Setup) -> None:
    kin_asking.standin.script(
        delegation("reviewer", "make it"),
        Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})]),
        Scripted(text="made"),
        Scripted(text="done"),
    )
    editor = Editor(answer="allow_once")
    async with editor_on(kin_asking, editor) as conn:
        session = (await conn.new_session(cwd=str(kin_asking.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("make it"))
    asked = [m["params"]["sessionId"] for m in editor.raw if m.get("method") == "session/request_permission"]
    assert (asked, (kin_asking.workspace / "made").exists()) == ([f"{session}.d2"], True)


async def test_without_subagents_a_childs_permission_request_is_asked_on_its_parent(kin_asking: Setup) -> None:
    kin_asking.standin.script(
        delegation("reviewer", "make it"),
        Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})]),
        Scripted(text="made"),
        Scripted(text="done"),
    )
    editor = Editor(answer="allow_once")
    async with editor_on(kin_asking, editor, subagents=False) as conn:
        session = (await conn.new_session(cwd=str(kin_asking.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("make it"))
    asked = [
        (m["params"]["sessionId"], m["params"]["toolCall"]["toolCallId"])
        for m in editor.raw
        if m.get("method") == "session/request_permission"
    ]
    assert (asked, (kin_asking.workspace / "made").exists()) == ([(session, f"{session}.d2/call_2")], True)


async def test_cancelling_a_child_ends_it_alone_and_its_parents_turn_goes_on(kin: Setup) -> None:
    kin.standin.script(
        delegation("reviewer", "review the change"),
        Scripted(text="thinking", hang=True),
        Scripted(text="the review was cancelled"),
    )
    editor = Editor()
    async with editor_on(kin, editor) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        child = f"{session}.d2"

        async def cancel_the_child_once_it_writes() -> None:
            await editor.until(lambda: any(m["params"]["sessionId"] == child for m in subagent_raw(editor)))
            await conn.cancel(session_id=child)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_the_child_once_it_writes)
            answer = await conn.prompt(session_id=session, prompt=text("review it"))
    states = [u["update"].get("state") for u in subagent_updates(editor)]
    assert (answer.stop_reason, states, text_of(editor, session)) == (
        "end_turn",
        ["running", "cancelled"],
        "the review was cancelled",
    )


def text_of(editor: Editor, session: str) -> str:
    """The agent's text the editor was sent for that session."""
    return "".join(
        m["params"]["update"]["content"]["text"]
        for m in subagent_raw(editor)
        if m["params"]["sessionId"] == session and m["params"]["update"]["sessionUpdate"] == "agent_message_chunk"
    )


async def test_session_list_leaves_out_child_sessions(kin: Setup) -> None:
    kin.standin.script(*REVIEW)
    async with editor_on(kin, Editor()) as conn:
        session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("review it"))
        listed = await conn.list_sessions(cwd=str(kin.workspace))
    assert [s.session_id for s in listed.sessions] == [session]


async def test_a_child_ended_as_the_daemon_was_killed_is_still_told_ended_once(
    tmp_path: Path, standin: Standin
) -> None:
    """Killed after the child's end was kept and before its notice was sent: once the daemon is back, the editor is
    told the child's end (once), before its parent's prompt is answered."""
    (tmp_path / "roots" / "app").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(
        agents_toml(standin.url, tmp_path / "roots", "allow", *reviewer_lines(standin.url, tmp_path / "roots"))
    )
    daemon = Daemon(tmp_path / "d", "--agents", str(agents), env={"DEVD_FAILPOINTS": "children.ended=kill@1"})
    kin = Setup(daemon.start(), (tmp_path / "roots" / "app").resolve(), standin, tmp_path)
    standin.script(*REVIEW)
    editor = Editor()
    with daemon:
        async with editor_on(kin, editor) as conn:
            session = (await conn.new_session(cwd=str(kin.workspace), mcp_servers=[])).session_id
            async with anyio.create_task_group() as tg:
                answers: list[Any] = []

                async def prompt() -> None:
                    answers.append(await conn.prompt(session_id=session, prompt=text("review it")))

                tg.start_soon(prompt)
                await anyio.to_thread.run_sync(lambda: daemon.proc.wait(30))  # type: ignore[union-attr]
                daemon.env = {}
                await anyio.to_thread.run_sync(daemon.start)
            answered_at = len(editor.raw)
    states = [
        (i, u["params"]["update"].get("state"))
        for i, u in enumerate(editor.raw)
        if u.get("method") == "session/update" and u["params"]["update"]["sessionUpdate"] == "subagent_update"
    ]
    assert (answers[0].stop_reason, [s for _, s in states], states[-1][0] < answered_at) == (
        "end_turn",
        ["running", "completed"],
        True,
    )


@pytest.fixture
def three_deep(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    """`coder` delegates to `reviewer`, which delegates to `tester`."""
    roots = tmp_path / "roots"
    tester = ["", "[agent.tester]", f'base_url = "{standin.url}"', 'model = "standin-model"']
    tester += [f'workspace_roots = ["{roots}"]', 'sandbox = "none"']
    yield from setup(
        tmp_path, standin, "allow", False, *reviewer_lines(standin.url, roots, 'delegates = ["tester"]'), *tester
    )


async def test_a_grandchild_is_announced_on_its_parent_and_ends_before_it(three_deep: Setup) -> None:
    three_deep.standin.script(
        delegation("reviewer", "review the change"),
        delegation("tester", "test the change"),
        Scripted(text="tests pass"),
        Scripted(text="it looks right"),
        Scripted(text="reviewed"),
    )
    editor = Editor()
    async with editor_on(three_deep, editor) as conn:
        session = (await conn.new_session(cwd=str(three_deep.workspace), mcp_servers=[])).session_id
        await conn.prompt(session_id=session, prompt=text("review it"))
    child, grandchild = f"{session}.d2", f"{session}.d2.d2"
    announced = [
        (m["params"]["sessionId"], m["params"]["update"]["subagentSessionId"], m["params"]["update"]["state"])
        for m in subagent_raw(editor)
        if m["params"]["update"]["sessionUpdate"] == "subagent_update"
    ]
    assert announced == [
        (session, child, "running"),
        (child, grandchild, "running"),
        (child, grandchild, "completed"),
        (session, child, "completed"),
    ]


async def test_a_cancelled_childs_permission_request_is_withdrawn_before_its_end(kin_asking: Setup) -> None:
    kin_asking.standin.script(
        delegation("reviewer", "make it"), Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})])
    )
    editor = Editor()  # it never answers
    async with editor_on(kin_asking, editor) as conn:
        session = (await conn.new_session(cwd=str(kin_asking.workspace), mcp_servers=[])).session_id

        async def cancel_once_asked() -> None:
            await editor.until(lambda: bool(editor.permission_requests()))
            await conn.cancel(session_id=session)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_asked)
            answer = await conn.prompt(session_id=session, prompt=text("make it"))
    order = [
        "withdrawn" if m.get("method") == "$/cancel_request" else m["params"]["update"]["state"]
        for m in editor.raw
        if m.get("method") == "$/cancel_request"
        or (m.get("method") == "session/update" and m["params"]["update"]["sessionUpdate"] == "subagent_update")
    ]
    assert (answer.stop_reason, order, (kin_asking.workspace / "made").exists()) == (
        "cancelled",
        ["running", "withdrawn", "cancelled"],
        False,
    )
