"""The daemon's handlers: one for each method of the protocol's table (`devd.protocol.METHODS`), and nothing else.

A handler takes a `Call` (the daemon's services and the calling connection) and the method's decoded params, and
returns its result Struct; it raises `devd.errors` classes, which the dispatcher turns into JSON-RPC errors in one
place. The types, docs and flags of a method live in `devd.protocol`; `@method(name)` gives a method of that table its
handler, and importing this module checks that every method of the table has exactly one handler and that no handler
is for a method the table lacks. `METHODS` binds the two, for dispatch.

Handlers call the sessions through `App.sessions`, a `WirePort` (`devd.sessions.port`), and nothing else of what
runs beside the wire: in the daemon that port is the agent runtime's (`devd.agent.wire.AgentPort`), which adds the
agent's methods, approvals and the rest around the sessions' calls. A new method is its line in `protocol.METHODS`
and a handler here; a method the runtime answers is a method of `WirePort` too (taking the params and who calls),
and its handler is one line: `return await call.app.sessions.NAME(params, call.peer.who())`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import structlog
from msgspec import Raw

from devd import ABI, __version__, protocol
from devd.config import Settings, backup_dir
from devd.errors import ExistsError, HandleError, InvalidParamsError, MethodNotFoundError, NullError
from devd.protocol import (
    AgentResult,
    AnswerParams,
    ApproveParams,
    BackupParams,
    BackupResult,
    BudgetParams,
    CompactResult,
    DrainResult,
    EffectsParams,
    EffectsResult,
    Empty,
    ForkParams,
    InfoResult,
    InitializeParams,
    InitializeResult,
    Limits,
    ListParams,
    ListResult,
    McpParams,
    McpResult,
    ModelParams,
    ModelResult,
    NewParams,
    NoParams,
    PendingResult,
    PromptParams,
    PromptResult,
    RestoreParams,
    RewindParams,
    RewindResult,
    Server,
    SessionInfo,
    SessionParams,
    SessionResult,
    SnapshotResult,
    SpawnParams,
    SpawnResult,
    Spec,
    StatusResult,
    StepParams,
    StepResult,
    TitleParams,
    TraceParams,
    TraceResult,
    TranscriptParams,
    TranscriptResult,
    UsageResult,
    WaitParams,
    WaitResult,
    WatchParams,
    decode_params,
    rfc3339,
)
from devd.server.rpc import Request
from devd.sessions.entry import Family, Info
from devd.sessions.port import Beside, WirePort
from devd.sessions.watchers import Sink, Subscription
from devd.storage.store import Store

# Logged at info: the daemon's own acts (a backup) and a session's lifecycle (new, restored, forked, recovered,
# closed), one line each; never a step, whose path stays free of log calls.
log = structlog.get_logger("devd.server.methods")


# -- the services a handler sees -----------------------------------------------------------------------------------


class Peer(msgspec.Struct):
    """The calling connection: how it came in, where its notifications go, what it watches."""

    transport: str
    sink: Sink
    watches: dict[str, Subscription] = msgspec.field(default_factory=dict)
    closed: bool = False  # its subscriptions have been ended: a watch that finishes now must not outlive it
    client: str | None = None  # the client's name from `initialize`: who decided an approval
    origin: str | None = None  # where it connected from (`uid U, pid P`, `HOST:PORT`): a name it cannot choose

    def who(self) -> str:
        """Who this peer is, for the records: the name it chose beside where it connected from."""
        name = self.client or "unknown"
        return name if self.origin is None else f"{name} ({self.origin})"


class App(msgspec.Struct):
    """The daemon's services, as handlers use them."""

    settings: Settings
    sessions: WirePort  # what handlers call: never the registry itself, nor the runtime beside it
    store: Store
    connections: Callable[[], int]
    started: float = msgspec.field(default_factory=time.monotonic)
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # answers by error kind
    beside: Beside | None = None  # what runs beside the wire (the agent runtime), as the daemon runs it


class Call(msgspec.Struct, frozen=True):
    app: App
    peer: Peer


Handler = Callable[[Call, Any], Awaitable[msgspec.Struct]]


class Method(msgspec.Struct, frozen=True):
    """A method of the protocol bound to its handler: what dispatch looks up."""

    name: str
    params: type[msgspec.Struct]
    result: type[msgspec.Struct]
    handler: Handler
    doc: str
    during_shutdown: bool  # answered while the daemon drains (status), or refused as BUSY


_HANDLERS: dict[str, Handler] = {}


def method(
    name: str,
    params: type[msgspec.Struct] | None = None,
    result: type[msgspec.Struct] | None = None,
    *,
    during_shutdown: bool | None = None,
) -> Callable[[Handler], Handler]:
    """The handler of the protocol's method `name`; the types and flags, when given, must be the table's."""
    # Raised, not asserted: the check holds under `python -O` too, at import, before any call is served.
    spec = protocol.METHODS.get(name)
    if spec is None:
        raise RuntimeError(f"{name!r} is not in devd.protocol.METHODS: add it there first")
    if params not in (None, spec.params) or result not in (None, spec.result):
        raise RuntimeError(f"{name}: not the table's types")
    if during_shutdown not in (None, spec.during_shutdown):
        raise RuntimeError(f"{name}: not the table's during_shutdown")

    def register(handler: Handler) -> Handler:
        if name in _HANDLERS:
            raise RuntimeError(f"{name} has two handlers")
        _HANDLERS[name] = handler
        return handler

    return register


def bind(specs: Mapping[str, Spec], handlers: Mapping[str, Handler]) -> dict[str, Method]:
    """Each method of the table with its handler; RuntimeError if one lacks a handler or a handler lacks a method."""
    missing, extra = sorted(set(specs) - set(handlers)), sorted(set(handlers) - set(specs))
    if missing or extra:
        raise RuntimeError(f"methods without a handler: {missing}; handlers without a method: {extra}")
    return {n: Method(n, s.params, s.result, handlers[n], s.doc, s.during_shutdown) for n, s in specs.items()}


def resolve(methods: Mapping[str, Method], request: Request) -> tuple[Method, Any]:
    """The request's method and its decoded params, or MethodNotFoundError / InvalidParamsError."""
    m = methods.get(request.method)
    if m is None:
        raise MethodNotFoundError(f"there is no method {request.method!r}; see `devd schema` for the methods")
    return m, decode_params(m, bytes(request.params))


# -- initialize and status ----------------------------------------------------------------------------------------


def initialize_result(settings: Settings) -> InitializeResult:
    s = settings
    return InitializeResult(
        server=Server("devd", __version__),
        protocol=1,
        abi=ABI,
        limits=Limits(
            line_bytes_max=s.line_bytes_max,
            sessions_max=s.sessions_max,
            connections_max=s.connections_max,
            call_timeout_ms=int(s.call_timeout_s * 1000),
            memory_bytes_per_session=s.memory_bytes_per_session,
            keys_kept_per_session=s.keys_kept_per_session,
        ),
    )


@method("initialize")
async def initialize(call: Call, params: InitializeParams) -> InitializeResult:
    if params.client is not None:
        problem = protocol.client_name_problem(params.client.name)
        if problem is not None:
            raise InvalidParamsError(
                f"client.name {params.client.name[:80]!r} cannot name a client ({problem}): a name is 1 to "
                f"{protocol.CLIENT_NAME_CHARS_MAX} printable characters on one line, without ( ) [ ] {{ }} < >, "
                "such as 'devd cli'; nothing was set: send initialize again with such a name"
            )
        call.peer.client = params.client.name
    return initialize_result(call.app.settings)


def status(app: App) -> StatusResult:
    stats, store = app.sessions.statistics(), app.store.statistics()
    return StatusResult(
        server=Server("devd", __version__),
        uptime_s=round(time.monotonic() - app.started, 3),
        sessions=app.sessions.counts(),
        connections=app.connections(),
        steps=stats.steps,
        durable_writes=store.commits,
        errors=dict(app.errors),
        deadline_hits=stats.deadline_hits,
        offloaded=stats.offloaded,
        rebuilt=stats.rebuilt,
        hibernated=stats.hibernated,
        live_memory_bytes=stats.live_memory_bytes,
        expired=stats.expired,
        store_reopened=store.reopened,
        commit_ms_p50=store.commit_ms_p50,
        commit_ms_p99=store.commit_ms_p99,
        memory_rss_bytes=_rss_bytes(),
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@method("daemon/status")
async def daemon_status(call: Call, params: NoParams) -> StatusResult:
    return status(call.app)


@method("daemon/mcp")
async def daemon_mcp(call: Call, params: NoParams) -> McpResult:
    return await call.app.sessions.mcp_servers(params, call.peer.who())


@method("daemon/backup")
async def daemon_backup(call: Call, params: BackupParams) -> BackupResult:
    name = backup_name(params)
    path = backup_dir(call.app.settings) / name
    if os.path.lexists(path):
        raise ExistsError(f"{name} exists; choose a new name (a backup never overwrites a file)")
    size = await call.app.store.backup(str(path))
    log.info("daemon.backup", path=str(path), bytes=size)
    return BackupResult(str(path), size)


BACKUP_NAME_BYTES_MAX = 255  # what a file name may be on Linux


def backup_name(params: BackupParams) -> str:
    """The plain file name a backup is written as, or InvalidParamsError: a peer (on TCP, from anywhere) names a
    file in the operator's directory, never a path; the rule looks at the name alone, never at the disk, so the
    answer says nothing of what exists elsewhere."""
    if (params.name is None) == (params.path is None):
        raise InvalidParamsError("daemon/backup takes name: the file name of the copy in the daemon's backup directory")
    name = params.name if params.name is not None else params.path
    assert name is not None
    if "/" in name or name.startswith(".") or not name.isprintable():
        raise InvalidParamsError(
            f"a backup is named by a plain file name (no /, no leading ., no control characters), not {name[:80]!r}; "
            "it is written in the daemon's backup directory (devd serve --backup-dir)"
        )
    if len(name.encode(errors="surrogatepass")) > BACKUP_NAME_BYTES_MAX:
        raise InvalidParamsError(f"a backup's file name must be at most {BACKUP_NAME_BYTES_MAX} bytes")
    return name


@method("daemon/drain")
async def daemon_drain(call: Call, params: NoParams) -> DrainResult:
    if call.app.sessions.fleet is None:
        raise NullError("this daemon is not in a fleet (its store is its own): there is nothing to give back")
    return DrainResult(await call.app.sessions.drain())


# -- sessions -----------------------------------------------------------------------------------------------------


@method("session/new")
async def session_new(call: Call, params: NewParams) -> SessionResult:
    return SessionResult(await call.app.sessions.new(params))


@method("session/step")
async def session_step(call: Call, params: StepParams) -> StepResult:
    answered = await call.app.sessions.step(params, call.peer.who())
    ignored = None if answered.ignored is None else [answered.ignored]
    return StepResult(Raw(answered.actions), answered.replayed, ignored)


@method("session/snapshot")
async def session_snapshot(call: Call, params: SessionParams) -> SnapshotResult:
    return SnapshotResult(await call.app.sessions.snapshot(params.session))


@method("session/restore")
async def session_restore(call: Call, params: RestoreParams) -> SessionResult:
    name = await call.app.sessions.restore(params.snapshot, params.session)
    log.info("session.restored", session=name)
    return SessionResult(name)


@method("session/fork")
async def session_fork(call: Call, params: ForkParams) -> SessionResult:
    name = await call.app.sessions.fork(params.session, params.at, params.as_)
    log.info("session.forked", session=name, source=params.session, at=params.at)
    return SessionResult(name)


@method("session/pending")
async def session_pending(call: Call, params: SessionParams) -> PendingResult:
    return PendingResult(Raw(await call.app.sessions.pending(params.session)))


@method("session/transcript")
async def session_transcript(call: Call, params: TranscriptParams) -> TranscriptResult:
    seq, messages = await call.app.sessions.transcript(params.session, params.from_, params.whole)
    return TranscriptResult(seq, params.from_, Raw(messages))


@method("session/recover")
async def session_recover(call: Call, params: SessionParams) -> SessionResult:
    await call.app.sessions.recover(params.session)
    log.info("session.recovered", session=params.session)
    return SessionResult(params.session)


@method("session/close")
async def session_close(call: Call, params: SessionParams) -> Empty:
    await call.app.sessions.close(params.session)
    log.info("session.closed", session=params.session)
    call.peer.watches.pop(params.session, None)
    return Empty()


def _entry(i: Info, stalled: str | None, title: str | None, family: Family | None = None) -> SessionInfo:
    return SessionInfo(
        i.name,
        i.state.value,  # type: ignore[arg-type]
        i.seq,
        rfc3339(i.created),
        rfc3339(i.last_used),
        i.watchers,
        i.reason,
        i.held,
        stalled,
        title,
        None if family is None else family.parent,
        None if family is None or not family.children else family.children,
    )


LIST_CHUNK = 1000  # sessions of a list page built between two turns of the event loop (a few ms)


@method("session/list")
async def session_list(call: Call, params: ListParams) -> ListResult:
    port = call.app.sessions
    if params.parent is not None:  # its children, those that exist still, in the order they were made
        kept = set(port.page_names()[0])
        names, after = [n for n in await port.children_of(params.parent) if n in kept], None
    else:
        names, after = port.page_names(params.limit, params.cursor)
    sessions: list[SessionInfo] = []
    for start in range(0, len(names), LIST_CHUNK):
        if start:
            await anyio.lowlevel.checkpoint()  # a page of 100,000 must not stall every other call for a second
        infos = port.infos(names[start : start + LIST_CHUNK])
        titles = await port.titles([i.name for i in infos])
        families = await port.family([i.name for i in infos])
        sessions += [_entry(i, port.stalled(i.name), titles.get(i.name), families.get(i.name)) for i in infos]
    return ListResult(sessions, after)


@method("session/info")
async def session_info(call: Call, params: SessionParams) -> InfoResult:
    sessions, name = call.app.sessions, params.session
    try:
        state = sessions.info(name).state.value
    except HandleError:
        if sessions.fleet is None:
            raise
        state = "stored"  # not held here: pending takes it from the fleet, or answers MOVED naming its owner
    waits: list[protocol.Waiting] = []
    if state in ("live", "stored"):  # an ended or poisoned turn waits for nothing
        waits = await sessions.waiting(name)
    i = sessions.info(name)  # after pending, which may have woken or adopted it
    titles = await sessions.titles([name])
    files = await sessions.instructions_used(name)
    family = (await sessions.family([name])).get(name)
    return InfoResult(
        **msgspec.structs.asdict(_entry(i, sessions.stalled(name), titles.get(name), family)),
        waiting=waits,
        instructions=files,
    )


@method("session/watch")
async def session_watch(call: Call, params: WatchParams) -> Empty:
    peer, sessions = call.peer, call.app.sessions
    sub = await sessions.watch(params.session, peer.sink, params.since)
    # Whatever the connection did while the history was being sent (closed, or watched the same session again)
    # is settled now, after the await: one subscription per session and connection, none after it closes.
    if peer.closed:
        sessions.unwatch(sub)
        return Empty()
    old = peer.watches.pop(params.session, None)
    if old is not None:
        sessions.unwatch(old)
    peer.watches[params.session] = sub
    await sessions.welcome(params.session, peer.sink)  # after the settling: an unwatch meanwhile finds the sub
    return Empty()


@method("session/unwatch")
async def session_unwatch(call: Call, params: SessionParams) -> Empty:
    sub = call.peer.watches.pop(params.session, None)
    if sub is not None:
        call.app.sessions.unwatch(sub)
    return Empty()


# -- answered by the runtime beside the sessions (devd.agent.wire): one line each, calling its WirePort method ------


@method("session/mcp")
async def session_mcp(call: Call, params: McpParams) -> Empty:
    return await call.app.sessions.mcp(params, call.peer.who())


@method("session/prompt")
async def session_prompt(call: Call, params: PromptParams) -> PromptResult:
    return await call.app.sessions.prompt(params, call.peer.who())


@method("session/resume")
async def session_resume(call: Call, params: SessionParams) -> Empty:
    return await call.app.sessions.resume(params, call.peer.who())


@method("session/model")
async def session_model(call: Call, params: ModelParams) -> ModelResult:
    return await call.app.sessions.model(params, call.peer.who())


@method("session/compact")
async def session_compact(call: Call, params: SessionParams) -> CompactResult:
    return await call.app.sessions.compact(params, call.peer.who())


@method("session/agent")
async def session_agent(call: Call, params: SessionParams) -> AgentResult:
    return await call.app.sessions.agent(params, call.peer.who())


@method("session/approve")
async def session_approve(call: Call, params: ApproveParams) -> Empty:
    return await call.app.sessions.approve(params, call.peer.who())


@method("session/answer")
async def session_answer(call: Call, params: AnswerParams) -> Empty:
    return await call.app.sessions.answer(params, call.peer.who())


@method("session/budget")
async def session_budget(call: Call, params: BudgetParams) -> Empty:
    return await call.app.sessions.budget(params, call.peer.who())


@method("session/usage")
async def session_usage(call: Call, params: SessionParams) -> UsageResult:
    return await call.app.sessions.usage(params, call.peer.who())


@method("session/trace")
async def session_trace(call: Call, params: TraceParams) -> TraceResult:
    return await call.app.sessions.trace(params, call.peer.who())


@method("session/title")
async def session_title(call: Call, params: TitleParams) -> Empty:
    return await call.app.sessions.title(params, call.peer.who())


@method("session/effects")
async def session_effects(call: Call, params: EffectsParams) -> EffectsResult:
    return await call.app.sessions.effects(params, call.peer.who())


@method("session/rewind")
async def session_rewind(call: Call, params: RewindParams) -> RewindResult:
    return await call.app.sessions.rewind(params, call.peer.who())


@method("session/spawn")
async def session_spawn(call: Call, params: SpawnParams) -> SpawnResult:
    return await call.app.sessions.spawn(params, call.peer.who())


@method("session/wait")
async def session_wait(call: Call, params: WaitParams) -> WaitResult:
    return await call.app.sessions.wait(params, call.peer.who())


METHODS: dict[str, Method] = bind(protocol.METHODS, _HANDLERS)  # import fails if a method lacks its one handler
