"""The broker: every MCP server connection of the daemon, and which session may call which tool.

What it promises:
- One `Connection` per server configuration: a digest of its command (or URL), its environment's values, the
  workspace and network it runs with, the profile's sandbox, and its owner when it is not shared (`share =
  "session"`, or a session's own server). Sessions of one profile and workspace so share one process.
- Each session sees the tools of its profile's servers and of its own, as the profile allows (`tools`), named
  `SERVER__TOOL` (`devd.agent.mcp.names`); a name taken twice is refused with a log line (`mcp.tool_refused`). A
  server that cannot start or list is left out of what the model is offered, with a log line, and fails the calls
  that name it, saying why.
- A session's own servers (`session/new` `mcp_servers`) live with it: `forget` closes them when it ends.
- `statuses` is what `daemon/mcp` answers.
- A server's question during a call is asked of the session's clients (`devd.agent.questions`), and its answer sent
  back; a call whose kept question carries a sealed state (MCP 2026-07-28) is sent again from it, with the answer
  (waited for, when none was given yet), after a restart. A question its call leaves open is withdrawn with it.
Supervisors run in the broker's task group (`run`): cancelled, every server process is stopped.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import mcp_types as types
import msgspec
import structlog

from devd.agent import sandbox as sandboxes
from devd.agent import tools
from devd.agent.kinds.named import NamedTool
from devd.agent.mcp import launch, names, results
from devd.agent.mcp.connection import Ask, Connection, Round, Served, Unavailable
from devd.agent.mcp.http import Endpoint
from devd.agent.profiles import McpServer, Profile
from devd.agent.questions import Answered, Questions, schema_problem
from devd.errors import DevdError
from devd.protocol import McpServerStatus

log = structlog.get_logger("devd.mcp")

MESSAGE_BYTES_MAX = 8 * 1024 * 1024  # a server's JSON-RPC message past this ends its connection
DESCRIPTION_CHARS_MAX = 2000  # of a tool's description, as the model is offered it

Workspace = Callable[[], Awaitable[tools.Workspace]]
Sandbox = Callable[[], Awaitable[sandboxes.Sandbox | sandboxes.Refusal | None]]


class _Entry(msgspec.Struct, frozen=True):
    connection: Connection
    tool: str
    read_only: bool = False  # its server is trusted to say which tools only read (trust_read_only), and it says so
    output_bytes_max: int | None = None  # its server's cap on a result, within the profile's


class Broker:
    """The daemon's MCP connections and each session's tool table."""

    def __init__(self, environ: Mapping[str, str], questions: Questions | None = None) -> None:
        self.environ = environ  # where a server's variables are read from, when it starts
        self.questions = questions  # where a server's questions are asked (None: each is declined)
        self._connections: dict[str, Connection] = {}
        self._tables: dict[str, dict[str, _Entry]] = {}
        self._down: dict[str, dict[str, str]] = {}  # per session: why each server that could not list its tools
        self._own: dict[str, tuple[tuple[McpServer, dict[str, str]], ...]] = {}  # a session's servers, their values
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The supervisors' home, until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            await anyio.sleep_forever()

    def own(self, session: str, servers: tuple[tuple[McpServer, dict[str, str]], ...]) -> None:
        """The session brings these servers (with their variables' values), kept in memory for its life."""
        self.forget(session)
        if servers:
            self._own[session] = servers

    def forget(self, session: str) -> None:
        """The session ended: its table goes, and so do the connections no one else may use."""
        self._own.pop(session, None)
        self._tables.pop(session, None)
        self._down.pop(session, None)
        for key, connection in list(self._connections.items()):
            connection.sessions.discard(session)
            if key.startswith(f"{session}\0"):
                connection.close()
                del self._connections[key]

    def statuses(self) -> list[McpServerStatus]:
        return [
            McpServerStatus(
                c.server.name,
                c.agent,
                c.state,
                c.pid,
                len(c.sessions),
                len(c.listed or ()),
                c.restarts,
                c.last_error,
                c.mode,
            )
            for c in self._connections.values()
        ]

    def processes(self) -> int:
        """The server processes running now."""
        return sum(1 for c in self._connections.values() if c.pid is not None)

    # -- a session's tools ----------------------------------------------------------------------------------------

    async def offered(self, session: str, profile: Profile, workspace: Workspace, sandbox: Sandbox) -> list[NamedTool]:
        """The MCP tools the session's model is offered now (servers started as needed), and its table kept."""
        table: dict[str, _Entry] = {}
        down: dict[str, str] = {}
        offered: list[NamedTool] = []
        taken = names.Names()
        for server, variables, agent, owner in self._servers(session, profile):
            connection = await self._connection(server, variables, agent, owner, profile, workspace, sandbox)
            connection.sessions.add(session)
            try:
                listed = await connection.tools()
            except Unavailable as e:
                log.warning("mcp.unavailable", session=session, server=server.name, why=e.why[:500])
                down[server.name] = e.why
                continue
            for tool in listed:
                if server.tools is not None and tool.name not in server.tools:
                    continue
                name = taken.take(server.name, tool.name)
                if isinstance(name, tuple):
                    log.warning(
                        "mcp.tool_refused",
                        session=session,
                        server=server.name,
                        tool=tool.name[:200],
                        why=f"its name {name[0]} is {name[1][0]}'s {name[1][1][:200]}'s",
                    )
                    continue
                hinted = tool.annotations is not None and tool.annotations.read_only_hint is True
                table[name] = _Entry(connection, tool.name, server.trust_read_only and hinted, server.output_bytes_max)
                description = (tool.description or tool.title or tool.name)[:DESCRIPTION_CHARS_MAX]
                offered.append(NamedTool(name, description, tool.input_schema))
        self._tables[session], self._down[session] = table, down
        return offered

    def read_only(self, session: str, name: str) -> str | None:
        """Why the session's MCP tool `name` is a read (its server's `trust_read_only` and its `readOnlyHint`, as last
        listed), or None: its calls are effects."""
        entry = self._tables.get(session, {}).get(name)
        if entry is None or not entry.read_only:
            return None
        server = entry.connection.server.name
        return f"{entry.tool} says it only reads (readOnlyHint), and the MCP server {server} is trusted to say so"

    def down(self, session: str) -> dict[str, str]:
        """Why each of the session's servers that could not list its tools when they were last offered could not."""
        return dict(self._down.get(session, {}))

    async def call(
        self,
        session: str,
        profile: Profile,
        workspace: Workspace,
        sandbox: Sandbox,
        name: str,
        arguments: bytes,
        action: int | None = None,
    ) -> tools.Result:
        """Carry out a call of the session's MCP tool `name` (for its action `action`, whose questions are asked of
        the session's clients); what goes wrong is a failed Result, never an exception (but a cancellation: the call
        is then cancelled at the server, and its open questions are left to the caller)."""
        if session not in self._tables:  # after a restart: the table is made again (servers started as needed)
            await self.offered(session, profile, workspace, sandbox)
        entry = self._tables[session].get(name)
        if entry is None:
            known = ", ".join(sorted(self._tables[session])) or "none"
            return tools.Result(f"no tool is named {name} (this session's MCP tools: {known})", failed=True)
        try:
            args = json.loads(arguments)
        except (ValueError, RecursionError):
            return tools.Result(f"the input of {name} is not a JSON object that can be read", failed=True)
        questions = self.questions
        if questions is None or action is None:
            ask, state, responses, sending = None, None, None, None
        else:
            ask = _asker(questions, session, action, entry.connection.server.name)
            sending = functools.partial(questions.sending, session, action)
            kept = await questions.kept(session, action)  # a call sent again after a restart, from its kept round
            state = kept[0].state if kept else None
            answers: types.InputResponses = {}
            for q in kept:
                answers[q.key or ""] = _elicited(await questions.wait(session, action, q.request))
            responses = answers or None
        try:
            done = results.result_text(
                await entry.connection.call(entry.tool, args, ask, state, responses, sending),
                min(entry.output_bytes_max or profile.output_bytes_max, profile.output_bytes_max),
            )
        except Unavailable as e:
            done = tools.Result(e.why, failed=True)
        if questions is not None and action is not None:  # a question its call left open goes with it
            await questions.withdraw(session, action, "devd (its call ended)")
        return done

    # -- connections ----------------------------------------------------------------------------------------------

    def _servers(
        self, session: str, profile: Profile
    ) -> list[tuple[McpServer, dict[str, str] | None, str | None, str | None]]:
        """(server, its variables' values (None: read from the daemon's environment), profile, owner) of each server
        the session may call."""
        mine: list[tuple[McpServer, dict[str, str] | None, str | None, str | None]] = [
            (s, None, profile.name, session if s.share == "session" else None) for s in profile.mcp
        ]
        mine += [(s, values, None, session) for s, values in self._own.get(session, ())]
        return mine

    async def _connection(
        self,
        server: McpServer,
        variables: dict[str, str] | None,
        agent: str | None,
        owner: str | None,
        profile: Profile,
        workspace: Workspace,
        sandbox: Sandbox,
    ) -> Connection:
        try:
            values = launch.server_env(server, agent, self.environ) if variables is None else variables
            why = None
        except Unavailable as e:
            values, why = {}, e.why
        ws = await workspace()
        key = _key(server, values, agent, owner, profile, ws)
        connection = self._connections.get(key)
        if connection is None:

            async def made() -> Served:
                if why is not None:
                    raise Unavailable(why)
                if server.command is None:
                    assert server.url is not None, "a server has a command or a url (devd.agent.profiles)"
                    headers = {header: values[header] for header, _ in server.headers}
                    return Endpoint(server.url, headers, body_bytes_max=MESSAGE_BYTES_MAX)
                return await launch.stdio_process(
                    server.command,
                    values,
                    name=server.name,
                    network=server.network,
                    profile=profile,
                    workspace=await workspace(),
                    sandbox=await sandbox(),
                    line_bytes_max=MESSAGE_BYTES_MAX,
                )

            connection = Connection(key, server, agent, made, line_bytes_max=MESSAGE_BYTES_MAX)
            self._connections[key] = connection
            assert self._tg is not None, "the broker runs before sessions are driven"
            self._tg.start_soon(connection.run)
        return connection


def _asker(questions: Questions, session: str, action: int, server: str) -> Ask:
    """The hook that asks the session's clients a question of the action's server, and gives the server their
    answer; a question that cannot be asked (a schema that is none) is declined, with a log line."""

    async def ask(params: types.ElicitRequestFormParams, round: Round | None) -> types.ElicitResult:
        schema: Any = params.requested_schema
        why = schema_problem(schema)
        if why is not None:
            log.warning("mcp.question_declined", session=session, server=server, why=why)
            return types.ElicitResult(action="decline")
        number, key, state = (0, None, None) if round is None else (round.number, round.key, round.state)
        try:
            answered = await questions.ask(session, action, params.message, schema, round=number, key=key, state=state)
        except DevdError as e:  # the session was closed meanwhile: nobody will answer
            log.warning("mcp.question_unasked", session=session, server=server, why=f"{e.kind}: {e}"[:300])
            return types.ElicitResult(action="cancel")
        return _elicited(answered)

    return ask


def _elicited(answered: Answered) -> types.ElicitResult:
    return types.ElicitResult(action=answered.decision, content=answered.answer)


def _key(
    server: McpServer,
    values: Mapping[str, str],
    agent: str | None,
    owner: str | None,
    profile: Profile,
    workspace: tools.Workspace,
) -> str:
    """`OWNER\\0DIGEST` (an owner of none: shared): the digest of what makes the server's process what it is."""
    made: list[Any] = [
        server.command,
        server.url,
        sorted(values.items()),
        sorted(server.headers),
        server.network,
        agent,
        profile.sandbox,
        str(workspace.path),
        list(workspace.identity) if workspace.identity else None,
        server.name,
        server.protocol,
    ]
    digest = hashlib.sha256(json.dumps(made).encode()).hexdigest()
    return f"{owner or ''}\0{digest}"
