"""The sessions' faces: `SessionPort`, what a client of the sessions calls (the registry is its one implementation),
and `WirePort`, what the wire's handlers call (`devd.server.methods`).

`WirePort` is the seam between the wire and what runs beside it: a handler decodes, calls one method of the port,
and encodes; it knows nothing of what the port does around the sessions. The daemon's port is the agent runtime's
(`devd.agent.wire.AgentPort`): it wraps a `SessionPort` (the registry) and adds what the runtime answers (prompts,
approvals, budgets, usage, traces), the bookkeeping of a `Cancel` step, the `awaiting` marks of pending actions, and
the wait a client's call makes while the daemon's own driver holds its session. The daemon's own jobs on the
sessions (loading them, expiry, the shutdown's snapshots) use the registry itself.

Adding a method that a runtime beside the sessions answers (say `session/compact`): its line in `protocol.METHODS`
(params, result, doc), a method of the same name here in `WirePort`, taking the params and who calls (`by`, the
peer's name as `Peer.who` gives it) and returning the result, its body in `AgentPort`, and the handler in
`devd.server.methods`, one line that calls it.
"""

from __future__ import annotations

from typing import Protocol

import anyio
import anyio.abc

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
)
from devd.sessions.entry import Answered, Family, Info, Statistics
from devd.sessions.watchers import Fanout, Sink, Subscription
from devd.storage.store import Fleet


class SessionPort(Protocol):
    fanout: Fanout  # who watches which session: a component that tells watchers more than steps sends through it
    fleet: Fleet | None  # the store shared with other daemons, when the sessions live in a fleet

    async def new(self, name: str | None, config: bytes) -> str: ...

    async def restore(self, snapshot_b64: str, name: str | None) -> str: ...

    async def step(self, name: str, event: bytes, timeout_ms: int | None, key: str | None) -> Answered: ...

    async def pending(self, name: str) -> bytes: ...

    async def transcript(self, name: str, start: int, whole: bool = False) -> tuple[int, bytes]: ...

    async def snapshot(self, name: str) -> str: ...

    async def fork(self, source: str, at: int | None, name: str | None) -> str: ...

    async def recover(self, name: str) -> None: ...

    async def back(self, name: str, at: int, kinds: tuple[str, ...]) -> None:
        """Move the session back to step `at` (see `Registry.back`)."""

    async def close(self, name: str) -> None: ...

    async def wait_free(self, name: str) -> None:
        """Return once no call holds the session: woken as the holding call ends (a call answered BUSY waits here
        before it tries again, instead of polling)."""

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription: ...

    def unwatch(self, sub: Subscription) -> None: ...

    def info(self, name: str) -> Info: ...

    def page(self, limit: int | None = None, after: str | None = None) -> tuple[list[Info], str | None]: ...

    def page_names(self, limit: int | None = None, after: str | None = None) -> tuple[list[str], str | None]: ...

    def infos(self, names: list[str]) -> list[Info]: ...

    def counts(self) -> dict[str, int]: ...

    def statistics(self) -> Statistics: ...

    async def drain(self) -> int:
        """Give the sessions no call is inside back to the fleet (in a fleet only)."""


class WirePort(Protocol):
    """What the wire's handlers call. The sessions' calls are `SessionPort`'s, taking the method's params where the
    port does more than pass them on; the calls after them are answered by the runtime beside the sessions."""

    @property
    def fleet(self) -> Fleet | None: ...

    async def new(self, params: NewParams) -> str:
        """A new session (with its agent, workspace and budget, when given), durable; its name."""

    async def step(self, params: StepParams, by: str) -> Answered: ...

    async def restore(self, snapshot_b64: str, name: str | None) -> str: ...

    async def snapshot(self, name: str) -> str: ...

    async def fork(self, source: str, at: int | None, name: str | None) -> str: ...

    async def pending(self, name: str) -> bytes:
        """The pending actions, those waiting for a client's decision marked `awaiting: "approval"`."""

    async def waiting(self, name: str) -> list[Waiting]:
        """The id and kind of each pending action."""

    async def transcript(self, name: str, start: int, whole: bool = False) -> tuple[int, bytes]: ...

    async def recover(self, name: str) -> None: ...

    async def close(self, name: str) -> None: ...

    async def watch(self, name: str, sink: Sink, since: int | None) -> Subscription: ...

    async def welcome(self, name: str, sink: Sink) -> None:
        """Tell a new watcher, once its subscription is settled, what it must know beside the session's steps (in the
        daemon: every approval and MCP server's question the session waits for, told before it watched or never)."""

    def unwatch(self, sub: Subscription) -> None: ...

    def info(self, name: str) -> Info: ...

    def stalled(self, name: str) -> str | None:
        """Why the daemon's driver of the session stopped, until it is resumed (None: it has not)."""

    async def titles(self, names: list[str]) -> dict[str, str]:
        """The title of each of the sessions named that has one."""

    async def instructions_used(self, name: str) -> list[str] | None:
        """The project instruction files the session's last model call was sent (None: a session of no agent)."""

    def page_names(self, limit: int | None = None, after: str | None = None) -> tuple[list[str], str | None]: ...

    def infos(self, names: list[str]) -> list[Info]: ...

    def counts(self) -> dict[str, int]: ...

    def statistics(self) -> Statistics: ...

    async def drain(self) -> int: ...

    # -- answered by the runtime beside the sessions: each takes its method's params and who calls ------------------

    async def prompt(self, params: PromptParams, by: str) -> PromptResult: ...

    async def resume(self, params: SessionParams, by: str) -> Empty: ...

    async def mcp(self, params: McpParams, by: str) -> Empty: ...

    async def mcp_servers(self, params: NoParams, by: str) -> McpResult:
        """`daemon/mcp`: the MCP servers the daemon runs, and how each stands."""

    async def model(self, params: ModelParams, by: str) -> ModelResult: ...

    async def compact(self, params: SessionParams, by: str) -> CompactResult: ...

    async def agent(self, params: SessionParams, by: str) -> AgentResult: ...

    async def approve(self, params: ApproveParams, by: str) -> Empty: ...

    async def answer(self, params: AnswerParams, by: str) -> Empty:
        """`session/answer`: a client's answer to an MCP server's question (`session/input`)."""

    async def budget(self, params: BudgetParams, by: str) -> Empty: ...

    async def usage(self, params: SessionParams, by: str) -> UsageResult: ...

    async def trace(self, params: TraceParams, by: str) -> TraceResult: ...

    async def title(self, params: TitleParams, by: str) -> Empty: ...

    async def effects(self, params: EffectsParams, by: str) -> EffectsResult: ...

    async def rewind(self, params: RewindParams, by: str) -> RewindResult: ...

    async def spawn(self, params: SpawnParams, by: str) -> SpawnResult:
        """`session/spawn`: a child session of `parent`, made once per id and started (devd.agent.children)."""

    async def wait(self, params: WaitParams, by: str) -> WaitResult: ...

    async def family(self, names: list[str]) -> dict[str, Family]:
        """The parent and children of each named session that has either (for `session/list` and `session/info`)."""

    async def children_of(self, parent: str) -> list[str]:
        """The names of the session's children, in the order they were made (HANDLE when there is no session)."""


class Beside(Protocol):
    """What runs beside the wire on the sessions (the agent runtime), as the daemon runs it."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run in the daemon's task group until cancelled; started once ready to take calls."""

    def stop(self) -> None:
        """Start nothing more: the daemon is draining."""

    def in_use(self, session: str) -> bool:
        """Whether it carries out the session's turn now (a model call, a tool, a child or a decision waited for):
        such a session is used, however long since its last call, and is not expired."""

    async def flush(self) -> None:
        """After the daemon's last write: send what is still queued elsewhere (spans)."""
