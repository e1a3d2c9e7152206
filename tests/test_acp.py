"""`devd acp` end to end, as an editor runs it: spawned by the Agent Client Protocol's own Python SDK
(`agent-client-protocol`: `spawn_agent_process`, `ClientSideConnection`), against the real daemon started with an
agents file whose profile asks the stand-in model server, and a real workspace on disk."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acp
import anyio
import pytest
from acp.connection import StreamDirection
from acp.schema import (
    AgentMessageChunk,
    AllowedOutcome,
    AvailableCommandsUpdate,
    Implementation,
    RequestPermissionResponse,
    TextContentBlock,
    ToolCallProgress,
    ToolCallStart,
    UsageUpdate,
    UserMessageChunk,
)

from tests import modules
from tests.daemon import ROOT, Daemon
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (the `standin` fixture)

WAIT_S = 30.0


# -- the daemon, its agents file and a workspace ---------------------------------------------------------------------


@dataclass
class Setup:
    daemon: Daemon | InProcess
    workspace: Path
    standin: Standin
    logs: Path
    spawned: int = 0


def agents_toml(url: str, root: Path, exec: str, *extra: str) -> str:
    return "\n".join(
        [
            "[agent.coder]",
            f'base_url = "{url}"',
            'model = "standin-model"',
            f'workspace_roots = ["{root}"]',
            f'exec = "{exec}"',
            "exec_timeout_s = 60",
            *extra,
            "",
        ]
    )


def setup(
    tmp_path: Path,
    standin: Standin,
    exec: str = "allow",
    process: bool = False,
    *extra: str,
    flags: tuple[str, ...] = (),
) -> Iterator[Setup]:
    """The daemon with agents (and `flags`): in this process, or (`process`) as a process of its own, for a test that
    kills it."""
    workspace = tmp_path / "roots" / "app"
    workspace.mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", exec, *extra))
    with (Daemon if process else InProcess)(tmp_path / "d", "--agents", str(agents), *flags) as daemon:
        yield Setup(daemon, workspace.resolve(), standin, tmp_path)


@pytest.fixture
def devd(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    yield from setup(tmp_path, standin)


@pytest.fixture
def devd_process(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    yield from setup(tmp_path, standin, process=True)


@pytest.fixture
def asking(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    """A daemon whose profile asks before every command."""
    yield from setup(tmp_path, standin, exec="ask")


# -- an editor -------------------------------------------------------------------------------------------------------


@dataclass
class Editor:
    """The editor's side of ACP (the SDK's Client): what it was told, and how it answers permission requests
    (`answer`: the option it picks; None: it never answers, and waits)."""

    answer: str | None = None
    updates: list[Any] = field(default_factory=list)
    asked: list[Any] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    raw: list[dict[str, Any]] = field(default_factory=list)  # every message from devd acp, as it came

    def observe(self, event: Any) -> None:
        if event.direction == StreamDirection.INCOMING:
            self.raw.append(event.message)

    def permission_requests(self) -> list[Any]:
        return [m["id"] for m in self.raw if m.get("method") == "session/request_permission"]

    def withdrawn(self) -> list[Any]:
        return [m["params"]["requestId"] for m in self.raw if m.get("method") == "$/cancel_request"]

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update)
        self.changed.set()

    async def request_permission(
        self, session_id: str, tool_call: Any, options: list[Any], **kwargs: Any
    ) -> RequestPermissionResponse:
        self.asked.append((tool_call, [o.kind for o in options]))
        self.changed.set()
        if self.answer is None:
            await asyncio.Event().wait()  # another editor answers: this request is withdrawn
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=self.answer or ""))

    async def until(self, predicate: Callable[[], bool]) -> None:
        with anyio.fail_after(WAIT_S):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    def text(self) -> str:
        return "".join(u.content.text for u in self.updates if isinstance(u, AgentMessageChunk))

    def chunks(self) -> int:
        return sum(isinstance(u, AgentMessageChunk) for u in self.updates)

    def statuses(self) -> list[tuple[str, str | None, str | None]]:
        """Each tool call update in order: (its kind, `tool_call` or `tool_call_update`, its status)."""
        return [
            (u.tool_call_id, u.session_update, u.status)
            for u in self.updates
            if isinstance(u, ToolCallStart | ToolCallProgress)
        ]


@contextlib.asynccontextmanager
async def editor_on(
    setup: Setup, editor: Editor, *args: str, capabilities: acp.schema.ClientCapabilities | None = None
) -> AsyncIterator[acp.ClientSideConnection]:
    """`devd acp` spawned as an editor spawns it, initialized (saying `capabilities`, when given)."""
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
            "--log-level",
            "info",
            *args,
            env={"PYTHONPATH": str(ROOT)},
            transport_kwargs={"stderr": log.fileno()},
            observers=[editor.observe],
            use_unstable_protocol=capabilities is not None,  # ACP's elicitation is in its unstable part
        ) as (conn, _process):
            hello = Implementation(name="test-editor", version="1")
            await conn.initialize(protocol_version=1, client_capabilities=capabilities, client_info=hello)
            yield conn


def text(t: str) -> list[TextContentBlock]:
    return [TextContentBlock(type="text", text=t)]


async def test_initialize_answers_protocol_1_with_load_list_resume_and_close(devd: Setup) -> None:
    with open(devd.logs / "acp-init.log", "ab") as log:
        async with acp.spawn_agent_process(
            Editor(),  # type: ignore[arg-type]
            sys.executable,
            "-m",
            "devd",
            "acp",
            "--connect",
            str(devd.daemon.socket),
            env={"PYTHONPATH": str(ROOT)},
            transport_kwargs={"stderr": log.fileno()},
        ) as (conn, _process):
            hello = await conn.initialize(protocol_version=1)
    caps = hello.agent_capabilities
    assert caps is not None and caps.session_capabilities is not None
    sessions = caps.session_capabilities
    assert (hello.protocol_version, caps.load_session, sessions.list, sessions.resume, sessions.close) == (
        1,
        True,
        acp.schema.SessionListCapabilities(),
        acp.schema.SessionResumeCapabilities(),
        acp.schema.SessionCloseCapabilities(),
    )


WRITE_THEN_CAT = [
    Scripted(text="I will write it.", tool_calls=[("write", {"path": "hello.txt", "text": "hi\n"})]),
    Scripted(tool_calls=[("exec", {"argv": ["cat", "hello.txt"]})]),
    # Streamed over time, as a model does: fragments that come in one read of the daemon are told as one delta.
    Scripted(text="hello.txt says hi.", split=2, delay_s=0.005),
]


# -- a whole turn ----------------------------------------------------------------------------------------------------


async def test_a_whole_turn_streams_its_text_tool_calls_and_updates_and_writes_the_file(devd: Setup) -> None:
    devd.standin.script(*WRITE_THEN_CAT)
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=text("write hello.txt and show it"))
    kinds = [u.kind for u in editor.updates if isinstance(u, ToolCallStart)]
    assert (
        answer.stop_reason,
        editor.text(),
        editor.chunks() > 2,
        kinds,
        [s for _, _, s in editor.statuses()],
        (devd.workspace / "hello.txt").read_text(),
    ) == (
        "end_turn",
        "I will write it.hello.txt says hi.",
        True,
        ["edit", "execute"],
        ["pending", "in_progress", "completed", "pending", "in_progress", "completed"],
        "hi\n",
    )


async def test_a_write_is_completed_with_a_diff_at_its_absolute_path(devd: Setup) -> None:
    devd.standin.script(*WRITE_THEN_CAT)
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("write hello.txt"))
    done = next(u for u in editor.updates if isinstance(u, ToolCallProgress) and u.status == "completed")
    diff = done.content[0]
    assert (diff.type, diff.path, diff.new_text) == ("diff", str(devd.workspace / "hello.txt"), "hi\n")


async def test_a_command_line_is_the_title_of_its_tool_call_and_its_output_the_content(devd: Setup) -> None:
    devd.standin.script(*WRITE_THEN_CAT)
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("write hello.txt"))
    start = next(u for u in editor.updates if isinstance(u, ToolCallStart) and u.kind == "execute")
    done = [u for u in editor.updates if isinstance(u, ToolCallProgress) and u.tool_call_id == start.tool_call_id]
    assert (start.title, done[-1].content[0].content.text) == ("cat hello.txt", "hi\n")


async def test_the_prompts_answer_carries_the_turns_token_usage(devd: Setup) -> None:
    devd.standin.script(
        # 6 output tokens: no fewer than devd's estimate of the call streamed (22 characters), which is charged.
        Scripted(tool_calls=[("exec", {"argv": ["true"]})], usage=(10, 6, None)),
        Scripted(text="ok", usage=(20, 7, 3)),
    )
    async with editor_on(devd, Editor()) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=text("go"))
    usage = answer.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.cached_read_tokens, usage.total_tokens) == (30, 13, 3, 43)


async def test_a_stalled_session_answers_the_prompt_refusal_with_the_reason(devd: Setup) -> None:
    devd.standin.script(Scripted(status=400, message="no such model"))
    async with editor_on(devd, Editor()) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=text("go"))
    assert (answer.stop_reason, "no such model" in answer.field_meta["devd"]["stalled"]) == ("refusal", True)


@pytest.fixture
def ending(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    """A daemon whose core ends an agent session mid-turn (`tests.modules.ENDS_MID_TURN`: DEADLINE after 1 s)."""
    core = tmp_path / "ends-mid-turn.wasm"
    core.write_bytes(modules.ENDS_MID_TURN)
    yield from setup(tmp_path, standin, flags=("--core", str(core), "--call-timeout", "1"))


async def test_a_session_that_ends_under_the_turn_answers_the_prompt_refusal_saying_why(ending: Setup) -> None:
    """Before, the prompt was never answered: the daemon told its watchers nothing."""
    editor = Editor()
    async with editor_on(ending, editor) as conn:
        session = await conn.new_session(cwd=str(ending.workspace), mcp_servers=[])
        with anyio.fail_after(WAIT_S):
            answer = await conn.prompt(session_id=session.session_id, prompt=text("go"))
    name = session.session_id
    told = "devd: the session ended while its turn ran (DEADLINE: the call ran past its deadline and was stopped; "
    told += f"session '{name}' ended: `devd recover {name}` brings it back from its last step); after `devd recover "
    told += f"{name}`, `devd resume {name}` carries the turn on. Prompt again to recover it and go on."
    assert (answer.stop_reason, editor.text()) == ("refusal", told)


async def test_prompting_a_session_that_ended_under_its_turn_recovers_it_and_carries_the_turn_on(
    ending: Setup,
) -> None:
    """Before, the next prompt was refused with the daemon's 'recover it' error, which an editor's user cannot do.
    This core ends its session at every try of the turn: the turn carried on ends it again, and says so."""
    async with editor_on(ending, Editor()) as conn:
        session = await conn.new_session(cwd=str(ending.workspace), mcp_servers=[])
        with anyio.fail_after(WAIT_S):
            await conn.prompt(session_id=session.session_id, prompt=text("go"))
            again = await conn.prompt(session_id=session.session_id, prompt=text("go on"))
    ended = again.field_meta["devd"]["ended"]  # the carried-on turn's end, or this prompt's: whichever came first
    assert (again.stop_reason, "the call ran past its deadline" in ended) == ("refusal", True)


@pytest.fixture
def poisoning(tmp_path: Path, standin: Standin) -> Iterator[Setup]:
    """A daemon whose core poisons an agent session mid-turn (`tests.modules.POISONED_MID_TURN`)."""
    core = tmp_path / "poisoned-mid-turn.wasm"
    core.write_bytes(modules.POISONED_MID_TURN)
    yield from setup(tmp_path, standin, flags=("--core", str(core)))


async def test_prompting_a_session_poisoned_under_its_turn_recovers_it_and_answers_refusal_when_it_is_again(
    poisoning: Setup,
) -> None:
    """This core poisons its session as soon as the turn carried on is driven: by the time this prompt's turn would
    start, the session is poisoned again, and the prompt is answered as that end (before, the daemon's POISON error
    was the prompt's answer: only HANDLE was taken as the session ending again)."""
    async with editor_on(poisoning, Editor()) as conn:
        session = await conn.new_session(cwd=str(poisoning.workspace), mcp_servers=[])
        with anyio.fail_after(WAIT_S):
            first = await conn.prompt(session_id=session.session_id, prompt=text("go"))
            again = await conn.prompt(session_id=session.session_id, prompt=text("go on"))
    ended = again.field_meta["devd"]["ended"]
    assert (first.stop_reason, again.stop_reason, "trapped inside the core" in ended) == ("refusal", "refusal", True)


async def test_prompting_a_stalled_session_again_tries_its_model_again(devd: Setup) -> None:
    devd.standin.script(Scripted(status=400, message="no such model"), Scripted(text="one"), Scripted(text="two"))
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("go"))
        answer = await conn.prompt(session_id=session.session_id, prompt=text("again"))
    assert (answer.stop_reason, editor.text().endswith("onetwo")) == ("end_turn", True)


# -- permissions -----------------------------------------------------------------------------------------------------

RUN_THEN_END = [
    Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo ran >> ran.txt"]})]),
    Scripted(text="Finished."),
]


async def test_a_permission_request_allowed_runs_the_command_once(asking: Setup) -> None:
    asking.standin.script(*RUN_THEN_END)
    editor = Editor(answer="allow_once")
    async with editor_on(asking, editor) as conn:
        session = await conn.new_session(cwd=str(asking.workspace), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=text("run it"))
    assert (answer.stop_reason, [kinds for _, kinds in editor.asked], (asking.workspace / "ran.txt").read_text()) == (
        "end_turn",
        [["allow_once", "allow_always", "reject_once", "reject_always"]],
        "ran\n",
    )


async def test_a_permission_request_rejected_fails_the_call_and_runs_nothing(asking: Setup) -> None:
    asking.standin.script(*RUN_THEN_END)
    editor = Editor(answer="reject_once")
    async with editor_on(asking, editor) as conn:
        session = await conn.new_session(cwd=str(asking.workspace), mcp_servers=[])
        answer = await conn.prompt(session_id=session.session_id, prompt=text("run it"))
    assert (answer.stop_reason, editor.statuses()[-1][2], (asking.workspace / "ran.txt").exists()) == (
        "end_turn",
        "failed",
        False,
    )


# -- cancel ----------------------------------------------------------------------------------------------------------


async def test_cancel_mid_stream_answers_the_prompt_cancelled(devd: Setup) -> None:
    devd.standin.script(Scripted(text="word " * 400, split=5, delay_s=0.02))
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        async with anyio.create_task_group() as tg:
            answers: list[Any] = []

            async def prompt() -> None:
                answers.append(await conn.prompt(session_id=session.session_id, prompt=text("talk")))

            tg.start_soon(prompt)
            await editor.until(lambda: editor.chunks() > 0)
            await conn.cancel(session_id=session.session_id)
    assert answers[0].stop_reason == "cancelled"


async def test_cancel_withdraws_a_pending_permission_request_and_runs_nothing(asking: Setup) -> None:
    asking.standin.script(*RUN_THEN_END)
    editor = Editor(answer=None)
    async with editor_on(asking, editor) as conn:
        session = await conn.new_session(cwd=str(asking.workspace), mcp_servers=[])
        async with anyio.create_task_group() as tg:
            answers: list[Any] = []

            async def prompt() -> None:
                answers.append(await conn.prompt(session_id=session.session_id, prompt=text("run it")))

            tg.start_soon(prompt)
            await editor.until(lambda: bool(editor.asked))
            await conn.cancel(session_id=session.session_id)
    assert (answers[0].stop_reason, editor.withdrawn(), (asking.workspace / "ran.txt").exists()) == (
        "cancelled",
        editor.permission_requests(),
        False,
    )


# -- load, list, resume, close ---------------------------------------------------------------------------------------


async def test_session_load_in_a_fresh_process_replays_the_conversation_before_it_answers(devd: Setup) -> None:
    devd.standin.script(*WRITE_THEN_CAT)
    async with editor_on(devd, Editor()) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("write hello.txt and show it"))
    later = Editor()
    async with editor_on(devd, later) as conn:
        await conn.load_session(cwd=str(devd.workspace), session_id=session.session_id, mcp_servers=[])
        replayed = list(later.updates)
    assert [
        (type(u).__name__, getattr(u, "status", None) or getattr(getattr(u, "content", None), "text", None))
        for u in replayed
        if not isinstance(u, AvailableCommandsUpdate)  # told after the load, not part of what it replays
    ] == [
        ("UserMessageChunk", "write hello.txt and show it"),
        ("AgentMessageChunk", "I will write it."),
        ("ToolCallStart", "completed"),
        ("ToolCallStart", "completed"),
        ("AgentMessageChunk", "hello.txt says hi."),
    ]


async def test_session_list_lists_the_daemons_sessions_of_that_cwd(devd: Setup, tmp_path: Path) -> None:
    other = tmp_path / "roots" / "other"
    other.mkdir()
    async with editor_on(devd, Editor()) as conn:
        mine = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.new_session(cwd=str(other), mcp_servers=[])
        listed = await conn.list_sessions(cwd=str(devd.workspace))
    assert [(s.session_id, s.cwd) for s in listed.sessions] == [(mine.session_id, str(devd.workspace))]


async def test_session_list_carries_each_sessions_title(devd: Setup) -> None:
    devd.standin.script(Scripted(text="ok"))
    async with editor_on(devd, Editor()) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("fix the flaky test"))
        listed = await conn.list_sessions(cwd=str(devd.workspace))
    assert [s.title for s in listed.sessions] == ["fix the flaky test"]


# -- slash commands and usage ----------------------------------------------------------------------------------------


async def test_a_new_session_is_told_the_slash_commands_an_editor_may_offer(devd: Setup) -> None:
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await editor.until(lambda: any(isinstance(u, AvailableCommandsUpdate) for u in editor.updates))
    offered = next(u for u in editor.updates if isinstance(u, AvailableCommandsUpdate))
    assert [(c.name, None if c.input is None else c.input.root.hint) for c in offered.available_commands] == [
        ("rewind", "[TURN] [force]"),
        ("title", "TEXT"),
        ("effects", None),
        ("usage", None),
    ]


async def test_a_usage_update_follows_each_model_call_with_its_tokens_and_the_models_window(
    tmp_path: Path, standin: Standin
) -> None:
    standin.script(*WRITE_THEN_CAT)
    editor = Editor()
    for devd in setup(tmp_path, standin, "allow", False, "context_tokens = 8000"):
        async with editor_on(devd, editor) as conn:
            session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
            await conn.prompt(session_id=session.session_id, prompt=text("write hello.txt and show it"))
            await editor.until(lambda: sum(isinstance(u, UsageUpdate) for u in editor.updates) == 3)
        with devd.daemon.client() as c:
            calls = [r for r in c.trace(session.session_id) if r.kind == "model"]
    assert [(u.used, u.size) for u in editor.updates if isinstance(u, UsageUpdate)] == [
        ((r.input_tokens or 0) + (r.output_tokens or 0), 8000) for r in calls
    ]


async def test_slash_rewind_puts_back_the_turns_files_and_says_what_it_did(devd: Setup) -> None:
    devd.standin.script(*WRITE_THEN_CAT)
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("write hello.txt and show it"))
        editor.updates.clear()
        answer = await conn.prompt(session_id=session.session_id, prompt=text("/rewind"))
    said = editor.text().splitlines()
    assert (answer.stop_reason, said[:3], (devd.workspace / "hello.txt").exists(), len(said)) == (
        "end_turn",
        ["Rewound to before turn 1.", "removed hello.txt", "not undone: Exec cat hello.txt"],
        False,
        4,
    )


async def test_slash_title_names_the_session(devd: Setup) -> None:
    editor = Editor()
    async with editor_on(devd, editor) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.prompt(session_id=session.session_id, prompt=text("/title the build"))
        listed = await conn.list_sessions(cwd=str(devd.workspace))
    assert (editor.text(), [s.title for s in listed.sessions]) == ("The session is called the build.", ["the build"])


async def test_session_new_outside_the_profiles_roots_is_refused_naming_the_cwd(devd: Setup, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    async with editor_on(devd, Editor()) as conn:
        with pytest.raises(acp.RequestError) as refused:
            await conn.new_session(cwd=str(outside), mcp_servers=[])
    assert (refused.value.code, str(outside) in str(refused.value)) == (-32602, True)


async def test_sessions_of_devd_acp_agent_name_are_driven_by_that_profile(devd: Setup) -> None:
    async with editor_on(devd, Editor(), "--agent", "coder") as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
    with devd.daemon.client() as client:
        bound = client.agent(session.session_id)
    assert (bound.agent, bound.workspace) == ("coder", str(devd.workspace))


async def test_an_agent_the_daemon_does_not_have_is_refused_naming_it(devd: Setup) -> None:
    async with editor_on(devd, Editor(), "--agent", "nobody") as conn:
        with pytest.raises(acp.RequestError) as refused:
            await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
    assert (refused.value.code, "'nobody'" in str(refused.value)) == (-32602, True)


async def test_an_editors_mcp_servers_a_profile_does_not_take_are_reported_not_connected_saying_why(
    devd: Setup,
) -> None:
    server = acp.schema.McpServerStdio(name="files", command="/bin/true", args=[], env=[])
    async with editor_on(devd, Editor()) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[server])
    assert session.field_meta["devd"]["mcpServers"] == [
        {
            "name": "files",
            "connected": False,
            "why": "the daemon did not take it: agent 'coder' does not take a session's own MCP servers (it has no "
            "session_mcp = true); leave out mcp_servers, or set session_mcp = true in its profile",
        }
    ]


async def test_an_editors_mcp_server_is_called_through_devd_acp_once_the_editor_allows_it(
    tmp_path: Path, standin: Standin
) -> None:
    from tests.mcp_place import PYTHON, placed

    env = [acp.schema.EnvVariable(name="PYTHONPATH", value=placed().site)]
    server = acp.schema.McpServerStdio(name="ed", command=PYTHON, args=[str(placed().server)], env=env)
    standin.script(Scripted(tool_calls=[("ed__echo", {"text": "from the editor's server"})]), Scripted(text="done"))
    for mcpd in setup(tmp_path, standin, "allow", False, "session_mcp = true"):
        editor = Editor(answer="allow_once")
        async with editor_on(mcpd, editor) as conn:
            session = await conn.new_session(cwd=str(mcpd.workspace), mcp_servers=[server])
            await conn.prompt(session_id=session.session_id, prompt=text("echo"))
        tool_results = [m["content"] for m in standin.requests[1].body["messages"] if m["role"] == "tool"]
        assert (session.field_meta["devd"]["mcpServers"][0]["connected"], len(editor.asked), tool_results) == (
            True,
            1,
            ["from the editor's server"],
        )


async def test_an_editors_http_mcp_server_is_called_through_devd_acp_which_advertises_http(
    tmp_path: Path, standin: Standin
) -> None:
    from tests.mcp_http import sdk_server

    standin.script(Scripted(tool_calls=[("web__header", {"name": "X-Editor"})]), Scripted(text="done"))
    with sdk_server() as url:
        headers = [acp.schema.HttpHeader(name="X-Editor", value="from-the-editor")]
        server = acp.schema.HttpMcpServer(type="http", name="web", url=url, headers=headers)
        for mcpd in setup(tmp_path, standin, "allow", False, "session_mcp = true"):
            editor = Editor(answer="allow_once")
            async with editor_on(mcpd, editor) as conn:
                hello = next(m for m in editor.raw if m.get("id") == 0 and "result" in m)["result"]
                session = await conn.new_session(cwd=str(mcpd.workspace), mcp_servers=[server])
                await conn.prompt(session_id=session.session_id, prompt=text("header"))
    tool_results = [m["content"] for m in standin.requests[1].body["messages"] if m["role"] == "tool"]
    assert (hello["agentCapabilities"]["mcpCapabilities"], tool_results) == (
        {"http": True, "sse": False},
        ["from-the-editor"],
    )


@dataclass
class FormEditor(Editor):
    """An editor that shows MCP servers' questions as forms (ACP's elicitation), and fills each with `content`."""

    content: dict[str, Any] = field(default_factory=dict)
    forms: list[tuple[str, Any]] = field(default_factory=list)

    async def create_elicitation(self, message: str, mode: Any, **kwargs: Any) -> Any:
        self.forms.append((message, mode.tool_call_id))
        return acp.schema.AcceptElicitationResponse(action="accept", content=self.content)


def careful_server(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The test MCP server as a profile's `demo` (its calls allowed), whose `careful` tool asks before it writes."""
    from tests.mcp_place import PYTHON, placed

    monkeypatch.setenv("DEVD_TEST_MCP_PATH", placed().site)
    return [
        "[agent.coder.mcp.demo]",
        f'command = ["{PYTHON}", "{placed().server}"]',
        'env = { PYTHONPATH = "DEVD_TEST_MCP_PATH" }',
        'decision = "allow"',
    ]


async def test_an_mcp_servers_question_is_a_form_for_an_editor_that_shows_forms(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(tool_calls=[("demo__careful", {"name": "x.txt"})]), Scripted(text="done"))
    forms = acp.schema.ClientCapabilities(
        elicitation=acp.schema.ElicitationCapabilities(form=acp.schema.ElicitationFormCapabilities())
    )
    for mcpd in setup(tmp_path, standin, "allow", False, *careful_server(monkeypatch)):
        editor = FormEditor(content={"ok": True, "note": "from the form"})
        async with editor_on(mcpd, editor, capabilities=forms) as conn:
            session = await conn.new_session(cwd=str(mcpd.workspace), mcp_servers=[])
            await conn.prompt(session_id=session.session_id, prompt=text("write x"))
        tool_results = [m["content"] for m in standin.requests[1].body["messages"] if m["role"] == "tool"]
        assert (editor.forms, editor.asked, tool_results) == (
            [("May I write x.txt?", "call_2")],
            [],
            ["wrote x.txt (from the form)"],
        )


async def test_a_yes_or_no_question_is_a_permission_request_for_an_editor_without_forms(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(tool_calls=[("demo__careful", {"name": "x.txt"})]), Scripted(text="done"))
    for mcpd in setup(tmp_path, standin, "allow", False, *careful_server(monkeypatch)):
        editor = Editor(answer="accept")
        async with editor_on(mcpd, editor) as conn:
            session = await conn.new_session(cwd=str(mcpd.workspace), mcp_servers=[])
            await conn.prompt(session_id=session.session_id, prompt=text("write x"))
        tool_results = [m["content"] for m in standin.requests[1].body["messages"] if m["role"] == "tool"]
        assert ([(call.title, kinds) for call, kinds in editor.asked], tool_results) == (
            [("May I write x.txt?", ["allow_once", "reject_once"])],
            ["wrote x.txt ()"],
        )


@pytest.fixture
def careful(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    """A daemon whose profile's MCP server `demo` asks before it writes (its calls allowed)."""
    standin.script(Scripted(tool_calls=[("demo__careful", {"name": "x.txt"})]), Scripted(text="done"))
    yield from setup(tmp_path, standin, "allow", False, *careful_server(monkeypatch))


async def test_a_question_answered_by_another_client_withdraws_the_editors_request(careful: Setup) -> None:
    editor = Editor(answer=None)  # never answers: the question is answered elsewhere
    async with editor_on(careful, editor) as conn:
        session = await conn.new_session(cwd=str(careful.workspace), mcp_servers=[])
        answers: list[Any] = []

        async def prompt() -> None:
            answers.append(await conn.prompt(session_id=session.session_id, prompt=text("write x")))

        def answer() -> None:
            with careful.daemon.client() as other:
                other.answer(session.session_id, 2, 1, {"ok": True})

        async with anyio.create_task_group() as tg:
            tg.start_soon(prompt)
            await editor.until(lambda: bool(editor.asked))
            await anyio.to_thread.run_sync(answer)
    assert (answers[0].stop_reason, editor.withdrawn(), (careful.workspace / "x.txt").read_text()) == (
        "end_turn",
        editor.permission_requests(),
        "written \n",
    )


async def test_a_prompt_to_a_session_that_does_not_exist_is_invalid_params_naming_it(devd: Setup) -> None:
    async with editor_on(devd, Editor()) as conn:
        with pytest.raises(acp.RequestError) as refused:
            await conn.prompt(session_id="no-such-session", prompt=text("hello"))
    assert (refused.value.code, "no-such-session" in str(refused.value)) == (-32602, True)


async def test_session_close_ends_the_session_in_the_daemon(devd: Setup) -> None:
    async with editor_on(devd, Editor()) as conn:
        session = await conn.new_session(cwd=str(devd.workspace), mcp_servers=[])
        await conn.close_session(session_id=session.session_id)
        with pytest.raises(acp.RequestError) as gone:
            await conn.load_session(cwd=str(devd.workspace), session_id=session.session_id, mcp_servers=[])
    assert gone.value.code == -32602


# -- shared sessions -------------------------------------------------------------------------------------------------


async def test_a_second_editor_sees_the_turn_another_drives_and_answers_its_permission(asking: Setup) -> None:
    asking.standin.script(*RUN_THEN_END)
    first, second = Editor(answer=None), Editor(answer="allow_once")
    async with editor_on(asking, first) as a, editor_on(asking, second) as b:
        session = await a.new_session(cwd=str(asking.workspace), mcp_servers=[])
        await b.resume_session(cwd=str(asking.workspace), session_id=session.session_id, mcp_servers=[])
        answer = await a.prompt(session_id=session.session_id, prompt=text("run it"))
        await second.until(lambda: "Finished." in second.text())
    seen = [u.content.text for u in second.updates if isinstance(u, UserMessageChunk)]
    assert (
        answer.stop_reason,
        seen,
        (len(first.asked), len(second.asked), first.withdrawn() == first.permission_requests()),
        first.statuses()[-1][2],
        (asking.workspace / "ran.txt").read_text(),
    ) == ("end_turn", ["run it"], (1, 1, True), "completed", "ran\n")


# -- the daemon going away -------------------------------------------------------------------------------------------


async def test_a_daemon_killed_and_restarted_mid_turn_still_answers_the_editors_prompt(devd_process: Setup) -> None:
    # The kill comes once the command has started (it says so in the workspace): killed before, the command would
    # rightly run after the restart, and the test would wait its 30 s out.
    ran = devd_process.workspace / "ran"
    devd_process.standin.script(
        Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo ran >> ran; exec sleep 30"]})]),
        Scripted(text="The command was cut short."),
    )
    editor = Editor()
    async with editor_on(devd_process, editor) as conn:
        session = await conn.new_session(cwd=str(devd_process.workspace), mcp_servers=[])
        async with anyio.create_task_group() as tg:
            answers: list[Any] = []

            async def prompt() -> None:
                answers.append(await conn.prompt(session_id=session.session_id, prompt=text("sleep")))

            tg.start_soon(prompt)
            with anyio.fail_after(WAIT_S):
                while not ran.exists():
                    await anyio.sleep(0.01)
            devd_process.daemon.kill()
            await anyio.to_thread.run_sync(devd_process.daemon.start)
    assert (answers[0].stop_reason, editor.text(), ran.read_text()) == (
        "end_turn",
        "The command was cut short.",
        "ran\n",
    )


async def test_a_reply_streamed_again_after_a_restart_is_told_once(devd_process: Setup) -> None:
    reply = " ".join(f"word{i}" for i in range(150))
    devd_process.standin.script(Scripted(text=reply, split=6, delay_s=0.02), Scripted(text=reply, split=6))
    editor = Editor()
    async with editor_on(devd_process, editor) as conn:
        session = await conn.new_session(cwd=str(devd_process.workspace), mcp_servers=[])
        async with anyio.create_task_group() as tg:
            answers: list[Any] = []

            async def prompt() -> None:
                answers.append(await conn.prompt(session_id=session.session_id, prompt=text("talk")))

            tg.start_soon(prompt)
            await editor.until(lambda: editor.chunks() > 3)
            devd_process.daemon.kill()
            await anyio.to_thread.run_sync(devd_process.daemon.start)
    assert (answers[0].stop_reason, editor.text()) == ("end_turn", reply)


# -- no daemon -------------------------------------------------------------------------------------------------------


def test_without_a_daemon_devd_acp_says_how_to_start_one_and_exits_non_zero(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "devd", "acp", "--connect", str(tmp_path / "none.sock")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    assert (done.returncode, "devd serve" in done.stderr, done.stdout) == (3, True, "")


def test_devd_acp_exits_0_when_the_editor_closes_its_input(devd: Setup) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "devd", "acp", "--connect", str(devd.daemon.socket)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    assert (done.returncode, done.stdout) == (0, b"")


def test_devd_acp_exits_0_when_the_editor_stops_reading(devd: Setup) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "devd", "acp", "--connect", str(devd.daemon.socket)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdout.close()  # the editor is gone: the answer below has nowhere to go
    proc.stdin.write(b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n')
    proc.stdin.flush()  # and its input stays open: only the broken pipe can end the process
    try:
        assert proc.wait(30) == 0
    finally:
        proc.stdin.close()
