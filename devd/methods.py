"""Every JSON-RPC method of the daemon, each registered once: its params, its result, its handler and its doc.

Dispatch (`devd.dispatch`), `devd schema` and the client are derived from `METHODS`; adding a method is adding one
`@method` here. Params refuse unknown members and state their constraints as msgspec `Meta`, so the schema shows
them; what a type cannot state (a key's length in bytes) is checked by `check`. Handlers take a `Call` (the daemon's
services and the calling connection) and return a result Struct; they raise `devd.errors` classes, which the
dispatcher turns into JSON-RPC errors in one place.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import anyio
import msgspec
import structlog
from msgspec import Meta, Raw

from devd import ABI, __version__
from devd.agent import records
from devd.agent.oversight import APPROVAL_NOTICE
from devd.agent.trace import TraceRecord
from devd.config import Settings
from devd.errors import BusyError, ExistsError, HandleError, InvalidParamsError, MethodNotFoundError, NullError
from devd.messages import Config, decode_actions, encode, encode_actions
from devd.registry import Registry
from devd.rpc import Request, notification
from devd.store import Store
from devd.watchers import Sink, Subscription

if TYPE_CHECKING:
    from devd.agent.oversight import Oversight
    from devd.agent.records import Binding
    from devd.agent.runner import Runtime

# Logged at info: the daemon's own acts (a backup) and a session's lifecycle (new, restored, forked, recovered,
# closed), one line each; never a step, whose path stays free of log calls.
log = structlog.get_logger("devd.methods")

SESSION_NAME_PATTERN = r"^(?!\.\.?$)[A-Za-z0-9._-]{1,64}$"
KEY_BYTES_MAX = 256
SEQ_MAX = (1 << 63) - 1  # what SQLite's INTEGER (and PostgreSQL's bigint) holds

SessionName = Annotated[
    str, Meta(pattern=SESSION_NAME_PATTERN, description="1-64 of A-Z a-z 0-9 . _ -, and not . or ..")
]
TRANSCRIPT_INDEX_MAX = (1 << 31) - 1  # the core counts messages in 32 bits
Seq = Annotated[int, Meta(ge=0, le=SEQ_MAX, description="a step number: the seq of a session's nth answered step")]

# Messages for the constraints above, as the daemon has always worded them (the protocol document shows them).
_NAME_RULE = "session names are 1-64 of A-Z a-z 0-9 . _ - and not . or .."
_RULES: dict[str, Callable[[str | None], str]] = {
    "session": lambda v: f"{_NAME_RULE}; {v[:80]!r} is not one" if v is not None else _NAME_RULE,
    "as": lambda v: f"{_NAME_RULE}; {v[:80]!r} is not one" if v is not None else _NAME_RULE,
    "timeout_ms": lambda v: "timeout_ms must be a positive number of milliseconds",
    "key": lambda v: f"the key must be 1-{KEY_BYTES_MAX} bytes of UTF-8",
    "since": lambda v: f"since must be a step number, 0 to {SEQ_MAX}",
    "at": lambda v: f"at must be a step number, 0 to {SEQ_MAX}",
    "from": lambda v: f"from must be a message index, 0 to {TRANSCRIPT_INDEX_MAX}",
}
_ASKS_RULE = (
    'config.asks must be "full" (every Model ask carries the whole conversation: the default) or "delta" (only the '
    "messages added since the previous ask)"
)


class _Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


# -- the services a handler sees ----------------------------------------------------------------------------------


@dataclass
class Peer:
    """The calling connection: how it came in, where its notifications go, what it watches."""

    transport: str
    sink: Sink
    watches: dict[str, Subscription] = field(default_factory=dict)
    closed: bool = False  # its subscriptions have been ended: a watch that finishes now must not outlive it
    client: str | None = None  # the client's name from `initialize`: who decided an approval


@dataclass
class App:
    """The daemon's services, as handlers use them."""

    settings: Settings
    registry: Registry
    store: Store
    connections: Callable[[], int]
    started: float = field(default_factory=time.monotonic)
    errors: dict[str, int] = field(default_factory=dict)  # answers by error kind
    agents: Runtime | None = None  # the agent runtime (devd.agent.runner): the sessions the daemon drives
    oversight: Oversight | None = None  # approvals, spend and trace of the sessions the daemon drives


@dataclass(frozen=True)
class Call:
    app: App
    peer: Peer


Handler = Callable[[Call, Any], Awaitable[msgspec.Struct]]


@dataclass(frozen=True)
class Method:
    name: str
    params: type[msgspec.Struct]
    result: type[msgspec.Struct]
    handler: Handler
    doc: str
    during_shutdown: bool  # answered while the daemon drains (status), or refused as BUSY
    decoder: msgspec.json.Decoder[Any]


METHODS: dict[str, Method] = {}


def method(
    name: str, params: type[msgspec.Struct], result: type[msgspec.Struct], *, during_shutdown: bool = False
) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        assert name not in METHODS, name
        doc = " ".join((handler.__doc__ or "").split())
        METHODS[name] = Method(name, params, result, handler, doc, during_shutdown, msgspec.json.Decoder(params))
        return handler

    return register


def resolve(methods: Mapping[str, Method], request: Request) -> tuple[Method, Any]:
    """The request's method and its decoded params, or MethodNotFoundError / InvalidParamsError."""
    m = methods.get(request.method)
    if m is None:
        raise MethodNotFoundError(f"there is no method {request.method!r}; see `devd schema` for the methods")
    return m, decode_params(m, bytes(request.params))


def decode_params(m: Method, raw: bytes) -> Any:
    """The method's params, or InvalidParamsError naming what is wrong."""
    if raw.strip() == b"null":
        raw = b"{}"
    try:
        params = m.decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise InvalidParamsError(_explain(m.name, raw, e)) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise InvalidParamsError(f"the params of {m.name} cannot be read: {e}") from None
    check(params)
    return params


def _explain(name: str, raw: bytes, error: msgspec.ValidationError) -> str:
    """A constraint broken (not a wrong type) is said in the rule's own words."""
    message = str(error)
    if message.endswith(" - at `$.config.asks`"):
        return _ASKS_RULE
    # msgspec words a broken constraint "Expected `str` matching regex ... - at `$.session`"; a wrong type says
    # ", got `...`", and an unknown member "Object contains unknown field ...": those keep msgspec's words.
    for member, explain in _RULES.items():
        if message.startswith("Expected `") and message.endswith(f" - at `$.{member}`") and ", got `" not in message:
            return explain(_string_member(raw, member))
    return f"bad params for {name}: {message}"


class _Named(msgspec.Struct):
    session: str | None = None
    as_: str | None = msgspec.field(default=None, name="as")


_named = msgspec.json.Decoder(_Named)


def _string_member(raw: bytes, member: str) -> str | None:
    """The string value of a session-name member, for the message; None if it cannot be read as one."""
    try:
        named = _named.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return named.as_ if member == "as" else named.session


def check(params: Any) -> None:
    """Rules msgspec's types cannot state."""
    key = getattr(params, "key", None)
    if key is not None:
        try:
            encoded = key.encode()
        except UnicodeEncodeError:
            raise InvalidParamsError("the key must be valid Unicode text") from None
        if not 0 < len(encoded) <= KEY_BYTES_MAX:
            raise InvalidParamsError(f"the key must be 1-{KEY_BYTES_MAX} bytes of UTF-8")


# -- shared results -----------------------------------------------------------------------------------------------


class Empty(msgspec.Struct, frozen=True):
    """Nothing to report: the call did what it says."""


class SessionResult(msgspec.Struct, frozen=True):
    """The session the call started or brought back."""

    session: str


class SessionParams(_Params, frozen=True):
    """The session to act on."""

    session: SessionName


# -- initialize and status ----------------------------------------------------------------------------------------


class Client(msgspec.Struct, frozen=True):
    """Who is calling, for the daemon's log."""

    name: str
    version: str | None = None


class InitializeParams(_Params, frozen=True):
    """The first call of a connection; on TCP it must carry the token from the daemon's state directory."""

    client: Client | None = None
    token: str | None = None


class Server(msgspec.Struct, frozen=True):
    """The daemon's name and version."""

    name: str
    version: str


class Limits(msgspec.Struct, frozen=True):
    """The limits this daemon enforces."""

    line_bytes_max: int
    sessions_max: int
    connections_max: int
    call_timeout_ms: int
    memory_bytes_per_session: int
    keys_kept_per_session: int


class InitializeResult(msgspec.Struct, frozen=True):
    """Who the daemon is, the protocol and core ABI it speaks, and its limits."""

    server: Server
    protocol: int
    abi: int
    limits: Limits


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


@method("initialize", InitializeParams, InitializeResult)
async def initialize(call: Call, params: InitializeParams) -> InitializeResult:
    """Say hello; optional on the Unix socket, required first (with the token) on TCP."""
    if params.client is not None:
        call.peer.client = params.client.name
    return initialize_result(call.app.settings)


class NoParams(_Params, frozen=True):
    """This method takes no params."""


class StatusResult(msgspec.Struct, frozen=True):
    """The daemon's health and counters."""

    server: Server
    uptime_s: float
    sessions: dict[str, int]
    connections: int
    steps: int
    durable_writes: int
    errors: dict[str, int]
    deadline_hits: int
    offloaded: int  # calls run on a worker thread: past their inline budget, or of a session whose calls grew past it
    rebuilt: int  # sessions rebuilt from their snapshot and journal: woken, recovered, or after an inline call stopped
    hibernated: int  # idle sessions whose instance was dropped to stay within --max-live or --live-memory
    live_memory_bytes: int  # the memory of the sessions' instances together
    expired: int  # sessions deleted by --expire-after
    commit_ms_p50: float
    commit_ms_p99: float
    memory_rss_bytes: int


def status(app: App) -> StatusResult:
    stats, store = app.registry.stats, app.store.statistics()
    return StatusResult(
        server=Server("devd", __version__),
        uptime_s=round(time.monotonic() - app.started, 3),
        sessions=app.registry.counts(),
        connections=app.connections(),
        steps=stats.steps,
        durable_writes=store.commits,
        errors=dict(app.errors),
        deadline_hits=stats.deadline_hits,
        offloaded=app.registry.runner.offloaded,
        rebuilt=stats.rebuilt,
        hibernated=stats.hibernated,
        live_memory_bytes=app.registry.memory,
        expired=stats.expired,
        commit_ms_p50=store.commit_ms_p50,
        commit_ms_p99=store.commit_ms_p99,
        memory_rss_bytes=_rss_bytes(),
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@method("daemon/status", NoParams, StatusResult, during_shutdown=True)
async def daemon_status(call: Call, params: NoParams) -> StatusResult:
    """The daemon's counters: sessions by state, steps, errors by kind, commit latency, memory."""
    return status(call.app)


class BackupParams(_Params, frozen=True):
    """Where the daemon writes a copy of its database: an absolute path to a file that does not exist yet."""

    path: Annotated[str, Meta(min_length=1, description="an absolute path; its directory must exist")]


class BackupResult(msgspec.Struct, frozen=True):
    """The copy written: where, and its size."""

    path: str
    bytes: int


@method("daemon/backup", BackupParams, BackupResult)
async def daemon_backup(call: Call, params: BackupParams) -> BackupResult:
    """A consistent copy of every session, taken while the daemon serves (steps wait while pages are copied)."""
    path = Path(params.path)
    if not path.is_absolute():
        raise InvalidParamsError(f"the backup path must be absolute (the daemon's directory is not yours): {path}")
    if not path.parent.is_dir():
        raise InvalidParamsError(f"{path.parent} is not a directory; make it first, or choose another path")
    if path.exists():
        raise ExistsError(f"{path} exists; choose a new path (a backup never overwrites a file)")
    size = await call.app.store.backup(str(path))
    log.info("daemon.backup", path=str(path), bytes=size)
    return BackupResult(str(path), size)


class DrainResult(msgspec.Struct, frozen=True):
    """How many sessions this daemon gave back to the fleet."""

    sessions: int


@method("daemon/drain", NoParams, DrainResult)
async def daemon_drain(call: Call, params: NoParams) -> DrainResult:
    """Give every session this daemon of a fleet holds back to the fleet, so other daemons take them at once (before
    a restart, say); a session called here again is taken back. Calls in flight keep their session."""
    if call.app.registry.fleet is None:
        raise NullError("this daemon is not in a fleet (its store is its own): there is nothing to give back")
    return DrainResult(await call.app.registry.drain())


# -- sessions -----------------------------------------------------------------------------------------------------


class TokenBudget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A session's own spend ceiling: at most `tokens` (input + output) over all its model calls."""

    tokens: Annotated[int, Meta(ge=1, le=SEQ_MAX, description="a number of tokens, at least 1")]


class NewParams(_Params, frozen=True):
    """A new session, from a config (default `{}`), under a name (default: chosen by the daemon); with `agent` (a
    profile of the daemon's agents file) and `workspace` (an absolute directory inside the profile's roots), a session
    the daemon drives itself (`session/prompt`)."""

    config: Config | None = None
    session: SessionName | None = None
    agent: Annotated[str, Meta(description="the name of an agent profile")] | None = None
    workspace: Annotated[str, Meta(description="an absolute directory inside the profile's roots")] | None = None
    budget: TokenBudget | None = None


@method("session/new", NewParams, SessionResult)
async def session_new(call: Call, params: NewParams) -> SessionResult:
    """Start a session; it is durable before this answers."""
    binding, config = agent_binding(call.app, params)
    name = await call.app.registry.new(params.session, encode(config))
    if call.app.agents is not None:
        await call.app.agents.bind(name, binding)
    if params.budget is not None:
        await _oversight(call.app).set_budget(name, params.budget.tokens)
    if binding is None:
        log.info("session.created", session=name)
    else:
        log.info("session.created", session=name, agent=binding.agent, workspace=binding.workspace)
    return SessionResult(name)


class StepParams(_Params, frozen=True):
    """One event for a session, with an optional deadline and idempotency key."""

    session: SessionName
    event: Raw
    timeout_ms: Annotated[int, Meta(gt=0, description="the call's deadline in milliseconds")] | None = None
    key: Annotated[str, Meta(min_length=1, max_length=KEY_BYTES_MAX, description="1-256 bytes of UTF-8")] | None = None


class StepResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """The actions the core answered; `replayed` when a keyed step was answered before and is answered again;
    `ignored`, the action id of a result or a Model answer the session took no notice of (it never dispatched that
    action, or already had its answer): the core answers it `[]` and changes nothing, so a client bug cannot stall a
    turn in silence."""

    actions: Raw
    replayed: bool = False
    ignored: list[int] | None = None


@method("session/step", StepParams, StepResult)
async def session_step(call: Call, params: StepParams) -> StepResult:
    """Step a session with one event; answered once the step is durable."""
    event = bytes(params.event)
    if call.app.oversight is not None and event.lstrip().startswith(b'{"Cancel"'):
        call.app.oversight.cancelling[params.session] = call.peer.client or "unknown"  # who withdraws approvals
    answered = await patient(
        call.app, params.session, lambda r: r.step(params.session, event, params.timeout_ms, params.key)
    )
    ignored = None if answered.ignored is None else [answered.ignored]
    return StepResult(Raw(answered.actions), answered.replayed, ignored)


class SnapshotResult(msgspec.Struct, frozen=True):
    """The session's state, base64, for `session/restore`."""

    snapshot: str


@method("session/snapshot", SessionParams, SnapshotResult)
async def session_snapshot(call: Call, params: SessionParams) -> SnapshotResult:
    """The session's state as the core encodes it."""
    return SnapshotResult(await patient(call.app, params.session, lambda r: r.snapshot(params.session)))


class RestoreParams(_Params, frozen=True):
    """A snapshot from `session/snapshot`, and the name of the session it starts (default: chosen)."""

    snapshot: str
    session: SessionName | None = None


@method("session/restore", RestoreParams, SessionResult)
async def session_restore(call: Call, params: RestoreParams) -> SessionResult:
    """Start a session from a snapshot; it is durable before this answers."""
    name = await call.app.registry.restore(params.snapshot, params.session)
    log.info("session.restored", session=name)
    return SessionResult(name)


class ForkParams(_Params, frozen=True):
    """The session to fork, the step to fork at (default: its latest) and the fork's name (default: chosen)."""

    session: SessionName
    at: Seq | None = None
    as_: SessionName | None = msgspec.field(default=None, name="as")


@method("session/fork", ForkParams, SessionResult)
async def session_fork(call: Call, params: ForkParams) -> SessionResult:
    """Start a session whose history is the source's up to step `at`, with its own name, journal and keys; the
    source is untouched."""
    name = await patient(call.app, params.session, lambda r: r.fork(params.session, params.at, params.as_))
    log.info("session.forked", session=name, source=params.session, at=params.at)
    return SessionResult(name)


class PendingResult(msgspec.Struct, frozen=True):
    """The actions the core dispatched and still waits for (a model ask, or calls without a result), in id order,
    exactly as they were answered."""

    actions: Raw


@method("session/pending", SessionParams, PendingResult)
async def session_pending(call: Call, params: SessionParams) -> PendingResult:
    """What the session still waits for, from the core itself: what a client that reconnects still owes."""
    actions = await patient(call.app, params.session, lambda r: r.pending(params.session))
    return PendingResult(Raw(await awaiting_approval(call.app, params.session, actions)))


class TranscriptParams(_Params, frozen=True):
    """The session, and the index of the first message wanted (0, the default: the whole conversation)."""

    session: SessionName
    from_: Annotated[int, Meta(ge=0, le=TRANSCRIPT_INDEX_MAX, description="a message index, from 0")] = msgspec.field(
        default=0, name="from"
    )


class TranscriptResult(msgspec.Struct, frozen=True):
    """The conversation as it stands after step `seq`, from message `from` on (none past its end)."""

    seq: int
    from_: int = msgspec.field(name="from")
    messages: Raw


@method("session/transcript", TranscriptParams, TranscriptResult)
async def session_transcript(call: Call, params: TranscriptParams) -> TranscriptResult:
    """The session's conversation, as a Model ask would carry it whole: what a client of a session whose asks carry
    only new messages (config `asks: "delta"`) reads when it starts, or has lost count."""
    seq, messages = await patient(call.app, params.session, lambda r: r.transcript(params.session, params.from_))
    return TranscriptResult(seq, params.from_, Raw(messages))


@method("session/recover", SessionParams, SessionResult)
async def session_recover(call: Call, params: SessionParams) -> SessionResult:
    """Bring an ended or poisoned session back from its durable state."""
    await call.app.registry.recover(params.session)
    log.info("session.recovered", session=params.session)
    return SessionResult(params.session)


@method("session/close", SessionParams, Empty)
async def session_close(call: Call, params: SessionParams) -> Empty:
    """End a session and delete its state; its watchers get `session/unwatched` with reason "closed"."""
    await call.app.registry.close(params.session)
    if call.app.oversight is not None:
        call.app.oversight.forget(params.session)
    log.info("session.closed", session=params.session)
    call.peer.watches.pop(params.session, None)
    return Empty()


class ListParams(_Params, frozen=True):
    """A page of the sessions: at most `limit` (default: all of them) whose names sort after `cursor`."""

    limit: Annotated[int, Meta(ge=1, le=100_000, description="at most this many sessions")] | None = None
    cursor: Annotated[str, Meta(description="the `next` of the page before")] | None = None


class SessionInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One session: its state, its last step, when it was made and last used (RFC 3339, UTC), how many
    connections watch it, and why it ended."""

    session: str
    state: Literal["live", "stored", "ended", "poisoned"]
    seq: int
    created: str
    last_used: str
    watchers: int = 0
    reason: str | None = None
    stalled: str | None = None  # the daemon drives it and cannot reach its model: why (`session/resume` tries again)


class ListResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sessions by name; `next` is the cursor for the following page, when there is one."""

    sessions: list[SessionInfo]
    next: str | None = None


def rfc3339(seconds: float) -> str:
    """Wall-clock seconds as RFC 3339 in UTC, to the millisecond."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@method("session/list", ListParams, ListResult)
async def session_list(call: Call, params: ListParams) -> ListResult:
    """The sessions the daemon holds, by name, a page at a time when `limit` is given."""
    infos, after = call.app.registry.page(params.limit, params.cursor)
    stalled = call.app.agents.stalled if call.app.agents is not None else {}
    return ListResult(
        [
            SessionInfo(
                i.name,
                i.state.value,  # type: ignore[arg-type]
                i.seq,
                rfc3339(i.created),
                rfc3339(i.last_used),
                i.watchers,
                i.reason,
                stalled.get(i.name),
            )
            for i in infos
        ],
        after,
    )


class WatchParams(_Params, frozen=True):
    """The session to watch, and the step after which to start (default: from now on)."""

    session: SessionName
    since: Seq | None = None


@method("session/watch", WatchParams, Empty)
async def session_watch(call: Call, params: WatchParams) -> Empty:
    """Receive `session/actions` for every step of the session after `since` (or from now) on this connection."""
    peer, registry = call.peer, call.app.registry
    sub = await registry.watch(params.session, peer.sink, params.since)
    # Whatever the connection did while the history was being sent (closed, or watched the same session again)
    # is settled now, after the await: one subscription per session and connection, none after it closes.
    if peer.closed:
        registry.unwatch(sub)
        return Empty()
    old = peer.watches.pop(params.session, None)
    if old is not None:
        registry.unwatch(old)
    peer.watches[params.session] = sub
    await announce(call, params.session)
    return Empty()


@method("session/unwatch", SessionParams, Empty)
async def session_unwatch(call: Call, params: SessionParams) -> Empty:
    """Stop receiving the session's steps on this connection."""
    sub = call.peer.watches.pop(params.session, None)
    if sub is not None:
        call.app.registry.unwatch(sub)
    return Empty()


# -- the agent runtime ----------------------------------------------------------------------------------------------


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


async def patient(app: App, session: str, call: Callable[[Registry], Awaitable[T]]) -> T:
    """call(registry); a BUSY that comes from the daemon's own driver of the session (it holds the session while it
    steps a result, a millisecond or so) is waited out briefly rather than answered: a client of a driven session
    should not have to retry the daemon's own steps. BUSY from another client's call is answered as ever."""
    waited = 0.0
    while True:
        try:
            return await call(app.registry)
        except BusyError:
            if app.agents is None or not app.agents.driving(session) or waited >= PATIENCE_S:
                raise
        await anyio.sleep(0.002)
        waited += 0.002


def _runtime(app: App) -> Runtime:
    if app.agents is None:
        raise InvalidParamsError("this daemon runs no agents; start it with --agents FILE")
    return app.agents


class PromptParams(_Params, frozen=True):
    """A prompt for a session the daemon drives, with an optional idempotency key (a retry with the same key answers
    the same turn, and starts nothing)."""

    session: SessionName
    prompt: str
    key: Annotated[str, Meta(min_length=1, max_length=KEY_BYTES_MAX, description="1-256 bytes of UTF-8")] | None = None


class PromptResult(msgspec.Struct, frozen=True):
    """The turn the prompt started (or, for a key answered before, started then)."""

    turn: int


@method("session/prompt", PromptParams, PromptResult)
async def session_prompt(call: Call, params: PromptParams) -> PromptResult:
    """Start a turn of a session made with an agent; answered once its Turn step is durable, after which the daemon
    carries out every action of the turn itself (watchers see each step as `session/actions`, the model's text as it
    streams as `session/delta`)."""
    return PromptResult(await _runtime(call.app).prompt(params.session, params.prompt, params.key))


@method("session/resume", SessionParams, Empty)
async def session_resume(call: Call, params: SessionParams) -> Empty:
    """Try a stalled session's model again (and drive a session of an agent that owes work)."""
    await _runtime(call.app).resume(params.session)
    return Empty()


class AgentResult(msgspec.Struct, frozen=True):
    """The agent profile and workspace a session was made with; both null for a session the daemon does not drive."""

    agent: str | None
    workspace: str | None


@method("session/agent", SessionParams, AgentResult)
async def session_agent(call: Call, params: SessionParams) -> AgentResult:
    """Which agent drives the session, in which workspace (what an editor lists and attaches sessions by)."""
    _known(call.app, params.session)
    if call.app.agents is None:
        return AgentResult(None, None)
    # Read from the record log, not through the runtime's cache, which keeps no session of no agent (there may be a
    # million, and an editor's `session/list` asks of each).
    found = await call.app.agents.sessions.records(params.session, (records.AGENT,))
    bound = [records.decode(r.body, records.Binding) for r in found if r.kind == records.AGENT]
    return AgentResult(bound[-1].agent, bound[-1].workspace) if bound else AgentResult(None, None)


# -- approvals, spend and trace (devd.agent.oversight) -------------------------------------------------------------


def _oversight(app: App) -> Oversight:
    if app.oversight is None:
        raise InvalidParamsError(
            "this daemon runs no agents, so it has no approvals, spend or trace; start it with --agents FILE"
        )
    return app.oversight


def _known(app: App, session: str) -> None:
    infos, _ = app.registry.page(1, _just_before(session))
    if not infos or infos[0].name != session:
        raise HandleError(f"no session is named {session!r}; `session/list` shows the sessions there are")


def _just_before(name: str) -> str:
    """A `session/list` cursor whose page starts at `name`."""
    return name[:-1] + chr(ord(name[-1]) - 1) + "z" * (64 - len(name))


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


class ApproveParams(_Params, frozen=True):
    """A client's decision on an action that waits for approval, naming it by its `digest` (from its
    `session/approval`); `remember`: the same decision for later calls of that argv prefix (Exec, Git) or path
    (Write) in this session."""

    session: SessionName
    action: Annotated[int, Meta(ge=0, le=SEQ_MAX, description="the action's id")]
    digest: Annotated[str, Meta(min_length=1, max_length=128, description="the hex SHA-256 of its session/approval")]
    decision: Literal["allow", "deny"]
    remember: bool = False


@method("session/approve", ApproveParams, Empty)
async def session_approve(call: Call, params: ApproveParams) -> Empty:
    """Decide an action that waits for approval: the first valid answer wins (durable before every watcher gets
    `session/decided`), a later one is CONFLICT naming who decided, a digest that does not match is INVALID_PARAMS and
    decides nothing. `allow` runs the action once; `deny` steps it as a failed call saying who denied it."""
    _known(call.app, params.session)
    by = call.peer.client or "unknown"
    await _oversight(call.app).answer(
        params.session, params.action, params.digest, params.decision, by, params.remember
    )
    return Empty()


class BudgetParams(_Params, frozen=True):
    """The session's own spend ceiling in tokens; null removes it."""

    session: SessionName
    tokens: Annotated[int, Meta(ge=1, le=SEQ_MAX, description="a number of tokens, at least 1")] | None


@method("session/budget", BudgetParams, Empty)
async def session_budget(call: Call, params: BudgetParams) -> Empty:
    """Set (or raise, or remove) the session's spend ceiling; durable before it applies. A session stalled by it
    carries on with `session/resume`."""
    _known(call.app, params.session)
    await _oversight(call.app).set_budget(params.session, params.tokens)
    return Empty()


class UsageResult(msgspec.Struct, frozen=True):
    """What the session's model calls used (the provider's counts, else devd's estimate), how many calls were made,
    and how many a spend ceiling refused. A fork counts from zero."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int
    calls: int
    refused: int


@method("session/usage", SessionParams, UsageResult)
async def session_usage(call: Call, params: SessionParams) -> UsageResult:
    """The session's spend so far."""
    _known(call.app, params.session)
    t = _oversight(call.app).usage(params.session)
    return UsageResult(t.input_tokens, t.output_tokens, t.cached_tokens, t.calls, t.refused)


class TraceParams(_Params, frozen=True):
    """The session, and the number of the last trace record already seen (default 0: all of them)."""

    session: SessionName
    since: Annotated[int, Meta(ge=0, le=SEQ_MAX, description="a trace record's `n`")] = 0


class TraceResult(msgspec.Struct, frozen=True):
    """The session's trace records after `since`, in order: one per model call attempt and per tool run."""

    records: list[TraceRecord]


@method("session/trace", TraceParams, TraceResult)
async def session_trace(call: Call, params: TraceParams) -> TraceResult:
    """What the daemon did for the session, one durable record per model call attempt and tool run, success or
    failure: `{n, action, kind, started, duration_ms, outcome, error?, attempt?, model?, input_tokens?,
    output_tokens?, cached_tokens?, name?}`."""
    _known(call.app, params.session)
    return TraceResult(await _oversight(call.app).records(params.session, params.since))
