"""The daemon's handlers: one for each method of the protocol's table (`devd.protocol.METHODS`), and nothing else.

A handler takes a `Call` (the daemon's services and the calling connection) and the method's decoded params, and
returns its result Struct; it raises `devd.errors` classes, which the dispatcher turns into JSON-RPC errors in one
place. The types, docs and flags of a method live in `devd.protocol`; `@method(name)` gives a method of that table its
handler, and importing this module checks that every method of the table has exactly one handler and that no handler
is for a method the table lacks. `METHODS` binds the two, for dispatch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import structlog
from msgspec import Raw

from devd import ABI, __version__, protocol
from devd.agent import effects, instructions, records, rewind
from devd.agent.oversight import APPROVAL_NOTICE
from devd.config import Settings, backup_dir
from devd.errors import BusyError, ExistsError, HandleError, InvalidParamsError, MethodNotFoundError, NullError
from devd.messages import Config, decode_actions, encode, encode_actions
from devd.protocol import (
    AgentResult,
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
    SessionMcpServer,
    SessionParams,
    SessionResult,
    SnapshotResult,
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
    WatchParams,
    decode_params,
    rfc3339,
)
from devd.server.rpc import Request, notification
from devd.sessions.entry import Answered, Info
from devd.sessions.port import SessionPort
from devd.sessions.watchers import Sink, Subscription
from devd.storage.store import Store

if TYPE_CHECKING:
    from devd.agent.oversight import Oversight
    from devd.agent.records import Binding
    from devd.agent.runner import OwnServers, Runtime

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
    sessions: SessionPort  # what handlers call: never the registry itself
    store: Store
    connections: Callable[[], int]
    started: float = msgspec.field(default_factory=time.monotonic)
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # answers by error kind
    agents: Runtime | None = None  # the agent runtime (devd.agent.runner): the sessions the daemon drives
    oversight: Oversight | None = None  # approvals, spend and trace of the sessions the daemon drives


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
    decoder: msgspec.json.Decoder[Any]


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
    return {
        n: Method(n, s.params, s.result, handlers[n], s.doc, s.during_shutdown, s.decoder) for n, s in specs.items()
    }


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
    broker = None if call.app.agents is None else call.app.agents.mcp
    return McpResult([] if broker is None else broker.statuses())


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
    binding, config = agent_binding(call.app, params)
    own = _own_mcp(call.app, binding, params.mcp_servers)
    name = await call.app.sessions.new(params.session, encode(config))
    if call.app.agents is not None:
        await call.app.agents.bind(name, binding)
        call.app.agents.bring_mcp(name, own)
    if params.budget is not None:
        await _oversight(call.app).set_budget(name, params.budget.tokens)
    if binding is None:
        log.info("session.created", session=name)
    else:
        log.info("session.created", session=name, agent=binding.agent, workspace=binding.workspace)
    return SessionResult(name)


@method("session/step")
async def session_step(call: Call, params: StepParams) -> StepResult:
    event = bytes(params.event)
    oversight = call.app.oversight
    step: Callable[[SessionPort], Awaitable[Answered]] = lambda r: r.step(  # noqa: E731
        params.session, event, params.timeout_ms, params.key
    )
    if oversight is None or not event.lstrip().startswith(b'{"Cancel"'):
        answered = await patient(call.app, params.session, step)
    else:  # apart, so that no other step pays for it
        with _cancelling(oversight, params.session, call.peer.who()):
            answered = await patient(call.app, params.session, step)
    ignored = None if answered.ignored is None else [answered.ignored]
    return StepResult(Raw(answered.actions), answered.replayed, ignored)


@contextlib.contextmanager
def _cancelling(oversight: Oversight, session: str, client: str | None) -> Iterator[None]:
    """Around a Cancel step: its client kept as who withdrew the turn's approvals (read when the driver withdraws
    them, after the step). A step that fails (no such session, a malformed Cancel) leaves what was kept as it was,
    so that no bad request leaves an entry behind."""
    before = oversight.cancelling.get(session)
    oversight.cancelling[session] = client or "unknown"
    try:
        yield
    except BaseException:
        if before is None:
            oversight.cancelling.pop(session, None)
        else:
            oversight.cancelling[session] = before
        raise


@method("session/snapshot")
async def session_snapshot(call: Call, params: SessionParams) -> SnapshotResult:
    return SnapshotResult(await patient(call.app, params.session, lambda r: r.snapshot(params.session)))


@method("session/restore")
async def session_restore(call: Call, params: RestoreParams) -> SessionResult:
    name = await call.app.sessions.restore(params.snapshot, params.session)
    log.info("session.restored", session=name)
    return SessionResult(name)


@method("session/fork")
async def session_fork(call: Call, params: ForkParams) -> SessionResult:
    name = await patient(call.app, params.session, lambda r: r.fork(params.session, params.at, params.as_))
    if call.app.agents is not None:
        call.app.agents.titles.made(name)  # the fork carries the source's title record
    log.info("session.forked", session=name, source=params.session, at=params.at)
    return SessionResult(name)


@method("session/pending")
async def session_pending(call: Call, params: SessionParams) -> PendingResult:
    actions = await patient(call.app, params.session, lambda r: r.pending(params.session))
    return PendingResult(Raw(await awaiting_approval(call.app, params.session, actions)))


@method("session/transcript")
async def session_transcript(call: Call, params: TranscriptParams) -> TranscriptResult:
    seq, messages = await patient(
        call.app, params.session, lambda r: r.transcript(params.session, params.from_, params.whole)
    )
    return TranscriptResult(seq, params.from_, Raw(messages))


@method("session/recover")
async def session_recover(call: Call, params: SessionParams) -> SessionResult:
    await call.app.sessions.recover(params.session)
    log.info("session.recovered", session=params.session)
    return SessionResult(params.session)


@method("session/close")
async def session_close(call: Call, params: SessionParams) -> Empty:
    await call.app.sessions.close(params.session)
    if call.app.oversight is not None:
        call.app.oversight.forget(params.session)
    log.info("session.closed", session=params.session)
    call.peer.watches.pop(params.session, None)
    return Empty()


def _entry(i: Info, stalled: Mapping[str, str] | None = None, titles: Mapping[str, str] | None = None) -> SessionInfo:
    return SessionInfo(
        i.name,
        i.state.value,  # type: ignore[arg-type]
        i.seq,
        rfc3339(i.created),
        rfc3339(i.last_used),
        i.watchers,
        i.reason,
        i.held,
        stalled.get(i.name) if stalled is not None else None,
        titles.get(i.name) if titles is not None else None,
    )


LIST_CHUNK = 1000  # sessions of a list page built between two turns of the event loop (a few ms)


@method("session/list")
async def session_list(call: Call, params: ListParams) -> ListResult:
    port = call.app.sessions
    stalled = call.app.agents.stalled if call.app.agents is not None else None
    names, after = port.page_names(params.limit, params.cursor)
    sessions: list[SessionInfo] = []
    for start in range(0, len(names), LIST_CHUNK):
        if start:
            await anyio.lowlevel.checkpoint()  # a page of 100,000 must not stall every other call for a second
        infos = port.infos(names[start : start + LIST_CHUNK])
        titles = await call.app.agents.titles.of([i.name for i in infos]) if call.app.agents is not None else None
        sessions += [_entry(i, stalled, titles) for i in infos]
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
        waits = protocol.waiting(decode_actions(await patient(call.app, name, lambda r: r.pending(name))))
    i = sessions.info(name)  # after pending, which may have woken or adopted it
    stalled = call.app.agents.stalled if call.app.agents is not None else None
    titles = await call.app.agents.titles.of([name]) if call.app.agents is not None else None
    files = await instructions.used_by(call.app.agents, name) if call.app.agents is not None else None
    return InfoResult(**msgspec.structs.asdict(_entry(i, stalled, titles)), waiting=waits, instructions=files)


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
    await announce(call, params.session)
    return Empty()


@method("session/unwatch")
async def session_unwatch(call: Call, params: SessionParams) -> Empty:
    sub = call.peer.watches.pop(params.session, None)
    if sub is not None:
        call.app.sessions.unwatch(sub)
    return Empty()


# -- the agent runtime, and its approvals, spend and trace (devd.agent) ----------------------------------------------


PATIENCE_S = 2.0  # the longest a call waits for the daemon's own driver of its session to let go of it
T = TypeVar("T")


def agent_binding(app: App, params: NewParams) -> tuple[Binding | None, Config]:
    """A new session's agent and workspace, checked (INVALID_PARAMS naming what is wrong), and its config: the
    profile's model, unless the config names one."""
    config = params.config or Config()
    agent = params.agent
    if agent is None and params.workspace is None:
        return None, config
    runtime = _runtime(app)
    if agent is None:  # a workspace alone: the daemon's only agent, when it has exactly one
        if len(runtime.profiles) != 1:
            known = ", ".join(sorted(runtime.profiles)) or "none: start the daemon with --agents FILE"
            raise InvalidParamsError(f"a workspace is given without an agent; name one of the agents: {known}")
        agent = next(iter(runtime.profiles))
    binding = runtime.check(agent, params.workspace)
    if config.model is None:
        config = Config(model=runtime.profiles[agent].model, asks=config.asks)
    return binding, config


async def patient(app: App, session: str, call: Callable[[SessionPort], Awaitable[T]]) -> T:
    """call(sessions); a BUSY that comes from the daemon's own driver of the session (it holds the session while it
    steps a result, a millisecond or so) is waited out briefly rather than answered: a client of a driven session
    should not have to retry the daemon's own steps. BUSY from another client's call is answered as ever."""
    waited = 0.0
    while True:
        try:
            return await call(app.sessions)
        except BusyError:
            if app.agents is None or not app.agents.driving(session) or waited >= PATIENCE_S:
                raise
        await anyio.sleep(0.002)
        waited += 0.002


def _runtime(app: App) -> Runtime:
    if app.agents is None:
        raise InvalidParamsError("this daemon runs no agents; start it with --agents FILE")
    return app.agents


def _oversight(app: App) -> Oversight:
    if app.oversight is None:
        raise InvalidParamsError(
            "this daemon runs no agents, so it has no approvals, spend or trace; start it with --agents FILE"
        )
    return app.oversight


def _known(app: App, session: str) -> None:
    app.sessions.info(session)  # HANDLE, naming it, when there is no such session


async def awaiting_approval(app: App, session: str, actions: bytes) -> bytes:
    """The pending actions, those waiting for a client's decision marked `awaiting: "approval"`."""
    if app.oversight is None:
        return actions
    waiting = {a.action for a in await app.oversight.awaiting(session)}
    if not waiting:
        return actions
    marked = [
        msgspec.structs.replace(a, awaiting="approval") if a.id in waiting else a for a in decode_actions(actions)
    ]
    return encode_actions(marked)


async def announce(call: Call, session: str) -> None:
    """Tell a new watcher of every approval the session waits for (it was told before it watched, or never)."""
    if call.app.oversight is None:
        return
    for params in await call.app.oversight.announcements(session):
        call.peer.sink.offer(notification(APPROVAL_NOTICE, Raw(params)))


def _own_mcp(app: App, binding: Binding | None, given: list[SessionMcpServer] | None) -> OwnServers:
    if not given:
        return ()
    if binding is None:
        raise InvalidParamsError("mcp_servers are for a session of an agent: give an agent and a workspace too")
    return _runtime(app).own_mcp(binding.agent, given)


@method("session/mcp")
async def session_mcp(call: Call, params: McpParams) -> Empty:
    runtime = _runtime(call.app)
    _known(call.app, params.session)
    binding = await runtime.binding(params.session)
    own = _own_mcp(call.app, binding, params.mcp_servers or None)
    runtime.bring_mcp(params.session, own)
    return Empty()


@method("session/prompt")
async def session_prompt(call: Call, params: PromptParams) -> PromptResult:
    return PromptResult(await _runtime(call.app).prompt(params.session, params.prompt, params.key))


@method("session/resume")
async def session_resume(call: Call, params: SessionParams) -> Empty:
    await _runtime(call.app).resume(params.session)
    return Empty()


@method("session/model")
async def session_model(call: Call, params: ModelParams) -> ModelResult:
    return await _runtime(call.app).set_model(params.session, params.model)


@method("session/compact")
async def session_compact(call: Call, params: SessionParams) -> CompactResult:
    return await _runtime(call.app).compact(params.session)


@method("session/agent")
async def session_agent(call: Call, params: SessionParams) -> AgentResult:
    _known(call.app, params.session)
    if call.app.agents is None:
        return AgentResult(None, None)
    # Read from the record log, not through the runtime's cache, which keeps no session of no agent (there may be a
    # million, and an editor's `session/list` asks of each).
    found = await call.app.agents.sessions.records(params.session, (records.AGENT,))
    bound = [records.decode(r.body, records.Binding) for r in found if r.kind == records.AGENT]
    return AgentResult(bound[-1].agent, bound[-1].workspace) if bound else AgentResult(None, None)


@method("session/approve")
async def session_approve(call: Call, params: ApproveParams) -> Empty:
    _known(call.app, params.session)
    by = call.peer.who()
    await _oversight(call.app).answer(
        params.session, params.action, params.digest, params.decision, by, params.remember
    )
    return Empty()


@method("session/budget")
async def session_budget(call: Call, params: BudgetParams) -> Empty:
    _known(call.app, params.session)
    await _oversight(call.app).set_budget(params.session, params.tokens)
    return Empty()


@method("session/usage")
async def session_usage(call: Call, params: SessionParams) -> UsageResult:
    _known(call.app, params.session)
    return await _oversight(call.app).usage(params.session)


@method("session/trace")
async def session_trace(call: Call, params: TraceParams) -> TraceResult:
    _known(call.app, params.session)
    page, following = await _oversight(call.app).traces(params.session, params.since, params.limit)
    return TraceResult(page, following)


@method("session/title")
async def session_title(call: Call, params: TitleParams) -> Empty:
    _known(call.app, params.session)
    await _runtime(call.app).titles.set(params.session, params.title)
    return Empty()


@method("session/effects")
async def session_effects(call: Call, params: EffectsParams) -> EffectsResult:
    _known(call.app, params.session)
    return EffectsResult(await effects.ledger(_runtime(call.app), params.session, params.since))


@method("session/rewind")
async def session_rewind(call: Call, params: RewindParams) -> RewindResult:
    return await rewind.rewind(_runtime(call.app), params.session, params.turn, force=params.force)


METHODS: dict[str, Method] = bind(protocol.METHODS, _HANDLERS)  # import fails if a method lacks its one handler
