"""The agent beside the wire: `AgentPort`, the sessions as the wire's handlers call them (`WirePort`) in a daemon
that drives sessions. It wraps the registry's port (`SessionPort`) and the runtime (`devd.agent.runner.Runtime`), so
that the handlers (`devd.server.methods`) only decode, call one method, and encode.

What it adds around the sessions' calls:
- `new` checks and keeps a session's agent and workspace (the profile's model, unless the config names one) and its
  budget;
- a call answered BUSY while the daemon's own driver holds the session (it steps a result, a millisecond or so) waits
  for the session to be free (`SessionPort.wait_free`, for PATIENCE_S at most) and is tried again: a client of a
  driven session should not have to retry the daemon's own steps. BUSY from another client's call is answered;
- a `Cancel` step keeps who stepped it, as who withdrew the turn's approvals (`Oversight.cancelling`);
- `pending` marks the actions waiting for a client's decision `awaiting: "approval"` (for an answer to their MCP
  server's question, `awaiting: "input"`), and a new watcher is told of
  every approval and every MCP server's question the session waits for (`welcome`);
- `new` and `mcp` give a session its own MCP servers (`mcp_servers`, checked against its agent's profile);
- the methods the runtime answers (`prompt`, `resume`, `mcp`, `mcp_servers`, `model`, `compact`, `agent`, `approve`,
  `answer`, `budget`, `usage`, `trace`), each taking its method's params and who calls, and returning its result.

Adding a method the runtime answers: its line in `devd.protocol.METHODS`, its signature in `WirePort`
(`devd.sessions.port`), its body here (calling the runtime or its oversight), and a one-line handler in
`devd.server.methods`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import structlog
from msgspec import Raw

from devd.agent import effects, instructions, records, rewind
from devd.agent.children import cancel_turn
from devd.agent.kinds.delegate import DelegateInput
from devd.agent.oversight import APPROVAL_NOTICE, Oversight
from devd.agent.port import ObservedFanout
from devd.agent.questions import INPUT_NOTICE
from devd.agent.records import Binding
from devd.agent.runner import OwnServers, Runtime
from devd.errors import BusyError, HandleError, InvalidParamsError
from devd.messages import Config, decode_actions, encode, encode_actions
from devd.protocol import (
    AgentResult,
    AnswerParams,
    ApproveParams,
    BudgetParams,
    CompactResult,
    EffectsParams,
    EffectsResult,
    Empty,
    McpParams,
    McpResult,
    ModelParams,
    ModelResult,
    NewParams,
    NoParams,
    PromptParams,
    PromptResult,
    RewindParams,
    RewindResult,
    SessionMcpServer,
    SessionParams,
    SpawnParams,
    SpawnResult,
    StepParams,
    TitleParams,
    TraceParams,
    TraceResult,
    UsageResult,
    Waiting,
    WaitParams,
    WaitResult,
    waiting,
)
from devd.sessions.entry import Answered, Family, Info, Statistics
from devd.sessions.port import SessionPort
from devd.sessions.watchers import Sink, Subscription
from devd.storage.store import Fleet

# Logged at info, as the wire logs a session's other lifecycle steps (devd.server.methods): a new session, with its
# agent and workspace when it has them.
log = structlog.get_logger("devd.agent.wire")

PATIENCE_S = 2.0  # the longest a client's call waits for the daemon's own driver of its session to let go of it
T = TypeVar("T")


class AgentPort:
    """`WirePort` over the registry's port, with the agent runtime beside it."""

    def __init__(self, sessions: SessionPort, runtime: Runtime) -> None:
        assert isinstance(sessions.fanout, ObservedFanout), "the daemon builds its registry with an ObservedFanout"
        self.sessions = sessions
        self.runtime = runtime
        self.notify = sessions.fanout.notify  # a notice as the wire's notification line

    @property
    def oversight(self) -> Oversight:
        return self.runtime.oversight

    @property
    def fleet(self) -> Fleet | None:
        return self.sessions.fleet

    # -- the runtime's life, as the daemon runs it (`Beside`) -----------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.runtime.run(task_status=task_status)

    def stop(self) -> None:
        self.runtime.stop()

    def in_use(self, session: str) -> bool:
        return self.runtime.driving(session)

    async def flush(self) -> None:
        if self.oversight.spans is not None:
            await anyio.to_thread.run_sync(self.oversight.spans.shutdown)  # the spans still queued are sent

    # -- the sessions' calls ----------------------------------------------------------------------------------------

    async def new(self, params: NewParams) -> str:
        binding, config = self._binding(params)
        own = self._own_mcp(binding, params.mcp_servers)
        name = await self.sessions.new(params.session, encode(config))
        await self.runtime.bind(name, binding)
        self.runtime.bring_mcp(name, own)
        if params.budget is not None:
            await self.oversight.set_budget(name, params.budget.tokens)
        if binding is None:
            log.info("session.created", session=name)
        else:
            log.info("session.created", session=name, agent=binding.agent, workspace=binding.workspace)
        return name

    def _binding(self, params: NewParams) -> tuple[Binding | None, Config]:
        """A new session's agent and workspace, checked (INVALID_PARAMS naming what is wrong), and its config: the
        profile's model, unless the config names one."""
        config = params.config or Config()
        agent = params.agent
        if agent is None and params.workspace is None:
            return None, config
        profiles = self.runtime.profiles
        if agent is None:  # a workspace alone: the daemon's only agent, when it has exactly one
            if len(profiles) != 1:
                known = ", ".join(sorted(profiles)) or "none: start the daemon with --agents FILE"
                raise InvalidParamsError(f"a workspace is given without an agent; name one of the agents: {known}")
            agent = next(iter(profiles))
        binding = self.runtime.check(agent, params.workspace)
        if config.model is None:
            config = Config(model=profiles[agent].model, asks=config.asks)
        return binding, config

    def _own_mcp(self, binding: Binding | None, given: list[SessionMcpServer] | None) -> OwnServers:
        """A session's own MCP servers (`mcp_servers`), checked against its agent's profile."""
        if not given:
            return ()
        if binding is None:
            raise InvalidParamsError("mcp_servers are for a session of an agent: give an agent and a workspace too")
        return self.runtime.own_mcp(binding.agent, given)

    async def step(self, params: StepParams, by: str) -> Answered:
        name, event = params.session, bytes(params.event)

        def step() -> Awaitable[Answered]:
            return self.sessions.step(name, event, params.timeout_ms, params.key)

        head = event.lstrip() if event[:1].isspace() else event  # not copied when, as almost always, it starts at {
        if head.startswith(b'{"Turn"') and await self.runtime.children.held_parent(name) is not None:
            await self._not_a_child(name, "stepped a Turn")
        if not head.startswith(b'{"Cancel"') or not self._here(name):
            return await self._patient(name, step)
        # Its running descendants are cancelled first, deepest first, each ending before the parent's turn does.
        why = f"the turn of its parent {name} was cancelled"
        await self.runtime.children.cascade(name, why, cancel_turn(event))
        with self.oversight.cancelling(name, by):  # apart, so that no other step pays for it
            return await self._patient(name, step)

    async def _not_a_child(self, name: str, what: str) -> None:
        """INVALID_PARAMS when the session is a child: its one turn is its parent's task."""
        link = await self.runtime.children.parent_link(name)
        if link is not None:
            raise InvalidParamsError(
                f"session {name!r} is a delegated run of session {link.parent!r}: it may not be {what} (its one turn "
                f"is the task it was given); watch it, approve its calls, or cancel it or its parent's turn instead"
            )

    def _here(self, name: str) -> bool:
        """Whether the session is known here (a Cancel of one that is not leaves nothing kept of who stepped it)."""
        try:
            self.sessions.info(name)
        except HandleError:
            return False
        return True

    async def restore(self, snapshot_b64: str, name: str | None) -> str:
        return await self.sessions.restore(snapshot_b64, name)

    async def snapshot(self, name: str) -> str:
        return await self._patient(name, lambda: self.sessions.snapshot(name))

    async def fork(self, source: str, at: int | None, name: str | None) -> str:
        if self._here(source):
            await self._not_a_child(source, "forked")
        forked = await self._patient(source, lambda: self.sessions.fork(source, at, name))
        self.runtime.titles.made(forked)  # the fork carries the source's title record
        return forked

    async def pending(self, name: str) -> bytes:
        actions = await self._patient(name, lambda: self.sessions.pending(name))
        asked = {a.action for a in await self.oversight.awaiting(name)}
        inputs = await self.runtime.questions.awaiting(name)
        if not asked and not inputs:
            return actions
        marked = [
            msgspec.structs.replace(a, awaiting="approval" if a.id in asked else "input")
            if a.id in asked or a.id in inputs
            else a
            for a in decode_actions(actions)
        ]
        return encode_actions(marked)

    async def waiting(self, name: str) -> list[Waiting]:
        return waiting(decode_actions(await self._patient(name, lambda: self.sessions.pending(name))))

    async def transcript(self, name: str, start: int, whole: bool = False) -> tuple[int, bytes]:
        return await self._patient(name, lambda: self.sessions.transcript(name, start, whole))

    async def recover(self, name: str) -> None:
        await self.sessions.recover(name)

    async def close(self, name: str) -> None:
        if self._here(name):  # its running descendants are cancelled first
            await self.runtime.children.cascade(name, f"its parent {name} was closed", close=True)
        await self.sessions.close(name)  # the runtime forgets it as its watchers are told it ended

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription:
        return await self.sessions.watch(name, sink, since)

    async def welcome(self, name: str, sink: Sink) -> None:
        for notice in await self.oversight.announcements(name):  # told before it watched, or never
            sink.offer(self.notify(APPROVAL_NOTICE, Raw(notice)))
        for notice in await self.runtime.questions.announcements(name):  # the MCP servers' questions, likewise
            sink.offer(self.notify(INPUT_NOTICE, Raw(notice)))
        known = self.runtime.table.find(name)
        if known is None or known.binding is None:  # no agent's session has children (read nothing for a raw one)
            return
        for child in await self.runtime.children.running_below(name):  # a parent's watcher may decide its children's
            for notice in await self.oversight.announcements(child):
                sink.offer(self.notify(APPROVAL_NOTICE, Raw(notice)))

    def unwatch(self, sub: Subscription) -> None:
        self.sessions.unwatch(sub)

    def info(self, name: str) -> Info:
        return self.sessions.info(name)

    def stalled(self, name: str) -> str | None:
        return self.runtime.stalled(name)

    async def titles(self, names: list[str]) -> dict[str, str]:
        return dict(await self.runtime.titles.of(names))

    async def instructions_used(self, name: str) -> list[str] | None:
        return await instructions.used_by(self.runtime, name)

    def page_names(self, limit: int | None = None, after: str | None = None) -> tuple[list[str], str | None]:
        return self.sessions.page_names(limit, after)

    def infos(self, names: list[str]) -> list[Info]:
        return self.sessions.infos(names)

    def counts(self) -> dict[str, int]:
        return self.sessions.counts()

    def statistics(self) -> Statistics:
        return self.sessions.statistics()

    async def drain(self) -> int:
        return await self.sessions.drain()

    async def _patient(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        """call(); a BUSY that comes from the daemon's own driver of the session is waited out (woken as the
        driver's call ends), for PATIENCE_S at most; BUSY from another client's call is answered as ever."""
        deadline = None  # set at the first BUSY: the call that is not refused (almost every one) reads no clock
        while True:
            try:
                return await call()
            except BusyError:
                if deadline is None:
                    deadline = anyio.current_time() + PATIENCE_S
                ours = self.runtime.driving(name) or self.runtime.children.holds(name)  # a child being made, say
                if not ours or anyio.current_time() >= deadline:
                    raise
            with anyio.move_on_after(deadline - anyio.current_time()):
                await self.sessions.wait_free(name)

    # -- answered by the runtime --------------------------------------------------------------------------------------

    async def prompt(self, params: PromptParams, by: str) -> PromptResult:
        if self._here(params.session):
            await self._not_a_child(params.session, "prompted")
        return PromptResult(await self.runtime.prompt(params.session, params.prompt, params.key))

    async def resume(self, params: SessionParams, by: str) -> Empty:
        await self.runtime.resume(params.session)
        return Empty()

    async def mcp(self, params: McpParams, by: str) -> Empty:
        self.sessions.info(params.session)  # HANDLE, naming it, when there is no such session
        binding = await self.runtime.binding(params.session)
        self.runtime.bring_mcp(params.session, self._own_mcp(binding, params.mcp_servers or None))
        return Empty()

    async def mcp_servers(self, params: NoParams, by: str) -> McpResult:
        broker = self.runtime.mcp
        return McpResult([] if broker is None else broker.statuses())

    async def model(self, params: ModelParams, by: str) -> ModelResult:
        return await self.runtime.set_model(params.session, params.model)

    async def compact(self, params: SessionParams, by: str) -> CompactResult:
        return await self.runtime.compact(params.session)

    async def agent(self, params: SessionParams, by: str) -> AgentResult:
        self.sessions.info(params.session)  # HANDLE, naming it, when there is no such session
        # Read from the record log, not through the runtime's records, which keep no session of no agent (there may
        # be a million, and an editor's `session/list` asks of each).
        found = await self.runtime.sessions.records(params.session, (records.AGENT,))
        bound = [records.decode(r.body, Binding) for r in found if r.kind == records.AGENT]
        return AgentResult(bound[-1].agent, bound[-1].workspace) if bound else AgentResult(None, None)

    async def approve(self, params: ApproveParams, by: str) -> Empty:
        self.sessions.info(params.session)
        await self.oversight.answer(params.session, params.action, params.digest, params.decision, by, params.remember)
        return Empty()

    async def answer(self, params: AnswerParams, by: str) -> Empty:
        self.sessions.info(params.session)
        questions = self.runtime.questions
        await questions.answer(params.session, params.action, params.request, params.answer, params.decline, by)
        return Empty()

    async def budget(self, params: BudgetParams, by: str) -> Empty:
        self.sessions.info(params.session)
        await self.oversight.set_budget(params.session, params.tokens)
        return Empty()

    async def usage(self, params: SessionParams, by: str) -> UsageResult:
        self.sessions.info(params.session)
        used = await self.oversight.usage(params.session)
        children = await self.runtime.children.usage(params.session)
        return msgspec.structs.replace(used, window=await self.runtime.window(params.session), children=children)

    async def spawn(self, params: SpawnParams, by: str) -> SpawnResult:
        ask = DelegateInput(params.agent, params.task, params.context, params.output_schema, params.budget)
        name, turn = await self.runtime.children.spawn(params.parent, params.id, ask)
        log.info("session.spawned", session=name, parent=params.parent, agent=params.agent, by=by)
        return SpawnResult(name, turn)

    async def wait(self, params: WaitParams, by: str) -> WaitResult:
        self.sessions.info(params.session)  # HANDLE, naming it, when there is no such session
        timeout = None if params.timeout_ms is None else params.timeout_ms / 1000
        done, outcome, answer, why = await self.runtime.children.wait(params.session, params.turn, timeout)
        return WaitResult(done, outcome, answer, why)  # type: ignore[arg-type]

    async def family(self, names: list[str]) -> dict[str, Family]:
        return await self.runtime.children.family(names)

    async def children_of(self, parent: str) -> list[str]:
        self.sessions.info(parent)
        return [link.child for _, link in await self.runtime.children.links(parent)]

    async def trace(self, params: TraceParams, by: str) -> TraceResult:
        self.sessions.info(params.session)
        page, following = await self.oversight.traces(params.session, params.since, params.limit)
        return TraceResult(page, following)

    async def title(self, params: TitleParams, by: str) -> Empty:
        self.sessions.info(params.session)
        await self.runtime.titles.set(params.session, params.title)
        return Empty()

    async def effects(self, params: EffectsParams, by: str) -> EffectsResult:
        self.sessions.info(params.session)
        return EffectsResult(await effects.ledger(self.runtime, params.session, params.since))

    async def rewind(self, params: RewindParams, by: str) -> RewindResult:
        return await rewind.rewind(self.runtime, params.session, params.turn, force=params.force)
