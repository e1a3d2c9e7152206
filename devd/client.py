"""Clients of the daemon: `AsyncClient` (anyio), and `Client`, the same client for blocking code (scripts, the CLI).

What they promise:

- Every method of the protocol's table (`devd.protocol.METHODS`) has a typed method on both clients, the one the
  table names (`METHOD_NAMES`): keyword arguments in, with messages as Structs (`Event`, `Config`), and
  Structs out. A method answers its result Struct from `devd.protocol` (`ListResult`, `StatusResult`, ...), or the
  one member that is all the result holds (a session's name, a snapshot, a list of `Action`s), or None for `{}`.
  `request(method, params)` takes any method's params Struct and answers its result Struct.
- `step()` answers the actions; `step_answer()` answers a `StepAnswer`, which keeps `replayed` (a keyed step that
  was answered before, answered again from the journal: nothing ran).
- Watching is iterating: `for notice in client.watch(session, since=0)` (`async for` on `AsyncClient`) yields an
  `ActionsNotice` for each step and, last, the `UnwatchedNotice` that ends the subscription (the session was closed
  or expired, or this client fell behind). The subscription is made when the iteration starts; leaving the loop
  early unsubscribes.
- The address defaults to the daemon's own rule (`default_address()`). A Unix socket served by another user is
  refused before anything is sent. When no daemon listens, `NotRunningError` says how to start one.
- Errors the daemon answers are raised as the `devd.errors` class of their kind; a lost connection is a
  `ConnectionError` on both clients, a reply cut in the middle of its line too. Exceptions come out of
  `AsyncClient.connect` as themselves, not in an ExceptionGroup. `AsyncClient.reconnect()` opens a new connection to
  the same address (after a daemon restart).
- Importing this module loads the protocol (`devd.protocol`, `devd.messages`, `devd.errors`), never the daemon: no
  registry, no wasm host, no wasmtime.

One client, written once: `Client` is `AsyncClient` driven from blocking code, on an event loop of its own that runs
in the calling thread while a call waits (the line rules, MOVED, notices and watching are the async client's). Not
anyio's blocking portal, whose hop to a second thread costs more: `python -m benchmarks.bench client` measured a
`daemon/status` call at 2.2x a bare blocking socket's round trip through `Client`, 2.0x through `AsyncClient` itself
and 3.7x through a portal (0.52, 0.49 and 0.88 ms against 0.24 ms, on a shared 2-core machine). The blocking socket
`Client` used to be was 1.13x: a blocking caller pays about a quarter of a millisecond a call for there being one
client.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Generator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from devd import errors
from devd.addresses import TcpListen, UnixListen, peer_uid
from devd.addresses import address as parse_address
from devd.config import default_socket_path
from devd.messages import Action, Config, Event, Message, decode_actions, decode_messages, encode
from devd.protocol import (
    METHODS,
    TRACE_PAGE_MAX,
    ActionsNotice,
    AgentResult,
    AnsweredNotice,
    AnswerParams,
    ApprovalNotice,
    ApproveParams,
    BackupParams,
    BackupResult,
    BudgetParams,
    ChildNotice,
    CompactResult,
    DecidedNotice,
    DeltaNotice,
    DrainResult,
    Effect,
    EffectsParams,
    EffectsResult,
    ForkParams,
    InfoResult,
    InitializeParams,
    InitializeResult,
    InputNotice,
    InstructionsNotice,
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
    Remember,
    RestoreParams,
    RewindParams,
    RewindResult,
    SessionMcpServer,
    SessionParams,
    SessionResult,
    SnapshotResult,
    SpawnParams,
    SpawnResult,
    StalledNotice,
    StatusResult,
    StepParams,
    StepResult,
    TitleParams,
    TokenBudget,
    TraceParams,
    TraceRecord,
    TraceResult,
    TranscriptParams,
    TranscriptResult,
    UnwatchedNotice,
    UsageResult,
    WaitParams,
    WaitResult,
    WatchParams,
)
from devd.protocol import Client as ClientInfo


def _classes_by_kind() -> dict[str, type[errors.DevdError]]:
    """Each error kind, and the most general `devd.errors` class of that kind (PanicError for PANIC, not its
    OutOfMemoryError; InternalError for INTERNAL, not StoreError): a kind added there is raised as its class here."""
    found: dict[str, type[errors.DevdError]] = {}
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.DevdError) and cls is not errors.DevdError:
            known = found.get(cls.kind)
            if known is None or len(cls.__mro__) < len(known.__mro__):
                found[cls.kind] = cls
    return found


_KINDS = _classes_by_kind()
MOVED_HOPS = 4  # calls sent for one request that meets MOVED: the first, then up to three daemons it names

# Each method of the table, and the client method that calls it (the same name on both clients).
METHOD_NAMES: dict[str, str] = {name: spec.call for name, spec in METHODS.items()}

NOTICES_BUFFERED = 1 << 16  # notices of no watch() kept for `notifications`; past it, reading waits for a reader
T = TypeVar("T")
N = TypeVar("N")
WATCH_BUFFERED = 1024  # notices kept for one watch() loop; past it, reading waits for the loop


def default_address() -> str:
    """Where a client looks for the daemon: `$DEVD_SOCKET` when it is set, else where `devd serve` puts its socket
    by default (`$RUNTIME_DIRECTORY/devd.sock`, else `$XDG_RUNTIME_DIR/devd/devd.sock`, else
    `/tmp/devd-UID/devd.sock`: `devd.config.default_socket_path`)."""
    return os.environ.get("DEVD_SOCKET") or str(default_socket_path())


class Reply(msgspec.Struct):
    """One line from the daemon: an answer (`id` and `result` or `error`) or a notification (`method`, `params`)."""

    id: Any = None
    result: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))
    error: dict[str, Any] | None = None
    method: str | None = None
    params: Any = None


class StepAnswer(msgspec.Struct, frozen=True):
    """A step's answer: the actions to carry out, whether it was `replayed` (the key was answered before, and
    this is that answer again from the journal: nothing ran), and the action ids the session `ignored` (a result or
    a model answer for an action it never dispatched, or already had the answer of: a bug on the client's side)."""

    actions: list[Action]
    replayed: bool = False
    ignored: list[int] = msgspec.field(default_factory=list)


Notice = (
    ActionsNotice
    | UnwatchedNotice
    | DeltaNotice
    | StalledNotice
    | ApprovalNotice
    | DecidedNotice
    | InstructionsNotice
    | ChildNotice
    | InputNotice
    | AnsweredNotice
)

# Each notification the daemon sends, and its type here.
NOTICES: dict[str, type[Notice]] = {
    "session/actions": ActionsNotice,
    "session/unwatched": UnwatchedNotice,
    "session/delta": DeltaNotice,  # the agent runtime's: the model's text as it streams, and a stall
    "session/stalled": StalledNotice,
    "session/approval": ApprovalNotice,
    "session/decided": DecidedNotice,
    "session/instructions": InstructionsNotice,
    "session/child": ChildNotice,  # a delegated run's state and usage, to its parent's watchers
    "session/input": InputNotice,  # an MCP server's question, and how it was decided
    "session/answered": AnsweredNotice,
}


class _Notification(msgspec.Struct, Generic[N]):
    """A notification line's params, typed (its other members are the envelope's)."""

    params: N


def notice_of(reply: Reply, line: bytes | bytearray | None = None) -> Notice:
    """A notification line as its typed notice; InternalError for a notification this client does not know. From
    the `line` it was read from when given: a Tool call's input (msgspec.Raw) then keeps the bytes it was sent in."""
    kind = NOTICES.get(reply.method or "")
    if kind is None:
        raise errors.InternalError(f"the daemon sent {reply.method!r}, a notification this client does not know")
    if line is not None:
        typed: Notice = msgspec.json.decode(line, type=_Notification[kind]).params  # type: ignore[valid-type]
        return typed
    # Through JSON, not convert: convert does not make a msgspec.Raw from a dict.
    notice: Notice = msgspec.json.decode(_encoder.encode(reply.params), type=kind)
    return notice


_reply = msgspec.json.Decoder(Reply)
_encoder = msgspec.json.Encoder()


def _raise(error: dict[str, Any]) -> None:
    kind = (error.get("data") or {}).get("kind", "INTERNAL")
    cls = _KINDS.get(kind, errors.DevdError)
    if cls is errors.MovedError:
        owner = (error.get("data") or {}).get("owner") or {}
        raise errors.MovedError(error.get("message", ""), owner.get("node"), owner.get("address"))
    raise cls(error.get("message", ""))


def _request(id: int | None, method: str, params: Any) -> bytes:
    if id is None:  # a JSON-RPC notification: carried out, never answered
        return _encoder.encode({"jsonrpc": "2.0", "method": method, "params": params}) + b"\n"
    return _encoder.encode({"jsonrpc": "2.0", "id": id, "method": method, "params": params}) + b"\n"


# -- params and results, shared by both clients ---------------------------------------------------------------------


def _hello(token: str | None, name: str | None = None) -> InitializeParams:
    return InitializeParams(ClientInfo(name or "devd.client"), token)


def _step(session: str, event: Event | bytes, timeout_ms: int | None, key: str | None) -> StepParams:
    raw = one_line(event) if isinstance(event, bytes) else encode(event)
    return StepParams(session, msgspec.Raw(raw), timeout_ms, key)


def one_line(event: bytes) -> bytes:
    """An event given as bytes, as the wire carries it: one JSON value, on one line. Anything else is refused
    (ValueError) before it is sent: a newline in it would end the request there, and what followed would be read as
    a request of its own (an event could carry a `session/close` of another session)."""
    try:
        msgspec.json.decode(event, type=msgspec.Raw)  # checked, not built: a long tool output costs little
    except msgspec.DecodeError as e:
        raise ValueError(f'the event is not one JSON value ({e}); give it as JSON, such as {{"Timer":true}}') from None
    if b"\n" not in event and b"\r" not in event:
        return event
    return msgspec.json.encode(msgspec.json.decode(event))  # JSON over several lines, written again on one


def _answer(result: StepResult) -> StepAnswer:
    return StepAnswer(decode_actions(bytes(result.actions)), result.replayed, result.ignored or [])


def _greets(address: str, token: str | None) -> bool:
    """TCP connections must begin with `initialize` and the token; a Unix one does when a token is given."""
    return parse_address(address).needs_token or token is not None


class NotRunningError(ConnectionRefusedError):
    """No daemon listens at the address: says so, and how to start one."""

    def __init__(self, address: str, cause: OSError) -> None:
        super().__init__(
            cause.errno,
            f"no daemon is listening at {address} ({cause.strerror}); start one with `devd serve` (or `make run` in "
            "a checkout), or point at yours with --connect or DEVD_SOCKET",
        )


def check_peer(sock: socket.socket, address: str) -> None:
    """Refuse a Unix socket served by anyone but this user or root: whoever could create the socket's directory first
    could otherwise stand in for the daemon, and take our events and hand us their actions (Exec included)."""
    uid = peer_uid(sock)
    if uid not in (os.getuid(), 0):
        raise PermissionError(
            f"the socket {address} is served by uid {uid}, not by this user (uid {os.getuid()}) or root, so it is not "
            "your daemon; nothing was sent. Check who owns its directory, or use --connect with your own socket"
        )


def _refused(address: str, error: OSError) -> NotRunningError | None:
    """The NotRunningError an OSError of connecting means, if it means one (anyio wraps TCP's refusal)."""
    if isinstance(error, FileNotFoundError | ConnectionRefusedError):
        return NotRunningError(address, error)
    if isinstance(error.__cause__, ConnectionRefusedError):
        return NotRunningError(address, error.__cause__)
    return None


def _endpoint(address: str) -> UnixListen | TcpListen:
    """An address as what it reaches, so that `unix:PATH` and PATH, or `tcp://[::1]:P` and `tcp://::1:P`, compare
    equal. Raises ValueError for a tcp:// address that is not HOST:PORT."""
    return parse_address(address).canonical()


@dataclass(frozen=True)
class MoveTrust:
    """Where following MOVED may take a client, and whether its token goes along. The address MOVED names comes from
    the fleet's database, so whoever can write that database chooses it: following must not extend trust. A client
    follows only to the address it was given first, the `peers` it was configured with, or, on that first host, a
    daemon it can check: a Unix socket (its server's uid is checked before anything is sent) or, with `share_token`,
    another TCP port. The token goes only to the first address and the peers, or with `share_token` to that host."""

    origin: str
    peers: frozenset[UnixListen | TcpListen] = frozenset()
    share_token: bool = False

    @classmethod
    def of(cls, origin: str, peers: Iterable[str | Path] = (), share_token: bool = False) -> MoveTrust:
        return cls(origin, frozenset(_endpoint(str(p)) for p in peers), share_token)

    def token_for(self, moved: errors.MovedError, token: str | None) -> str | None:
        """The token to give the daemon `moved` names (None: give none), or the MovedError itself, saying why it was
        not followed, when this client may not go there."""
        assert moved.address is not None
        try:
            target, origin = _endpoint(moved.address), _endpoint(self.origin)
        except ValueError:
            raise self._refuse(moved) from None
        if target == origin or target in self.peers:
            return token
        if isinstance(target, UnixListen) and isinstance(origin, UnixListen):
            return None  # the same machine, and check_peer refuses a socket another user serves
        same_host = isinstance(target, TcpListen) and isinstance(origin, TcpListen) and target.host == origin.host
        if same_host and self.share_token:
            return token
        raise self._refuse(moved)

    def _refuse(self, moved: errors.MovedError) -> errors.MovedError:
        return errors.MovedError(
            f"{moved} (not followed: {moved.address} is not an address this client was given; connect to it "
            "yourself, or pass it in peers= to follow MOVED there)",
            moved.node,
            moved.address,
        )


async def _open_stream(address: str) -> anyio.abc.ByteStream:
    stream: anyio.abc.SocketStream
    where = parse_address(address)
    try:
        if isinstance(where, TcpListen):
            return await anyio.connect_tcp(where.host, where.port)
        stream = await anyio.connect_unix(where.path)
    except OSError as e:
        refused = _refused(address, e)
        if refused is None:
            raise
        raise refused from e
    try:
        check_peer(stream.extra(anyio.abc.SocketAttribute.raw_socket), address)
    except BaseException:
        await stream.aclose()
        raise
    return stream


# -- the blocking client --------------------------------------------------------------------------------------------


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's when it is installed (a blocking call through it costs about a tenth less), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _drive(loop: asyncio.AbstractEventLoop, call: Awaitable[T]) -> T:
    """Run the client's loop until call is done: in this thread, or, when this thread runs an event loop already (a
    blocking call from async code, in a notebook say), in a thread of its own while this one waits, as a blocking
    call does."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return loop.run_until_complete(call)
    result: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(loop.run_until_complete(call))
        except BaseException as e:
            failed.append(e)

    worker = threading.Thread(target=run, name="devd.client")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return result[0]


async def _bounded(call: Awaitable[T], timeout: float | None) -> T:
    with anyio.fail_after(timeout):
        return await call


def _new_params(
    config: Config | None, session: str | None, agent: str | None, workspace: str | Path | None, budget: int | None
) -> NewParams:
    """`session/new`'s params as both clients' `new` take them."""
    where = None if workspace is None else str(workspace)
    return NewParams(config, session, agent, where, None if budget is None else TokenBudget(budget))


class Client:
    """The blocking client: `AsyncClient` driven on an event loop of its own, which runs in the calling thread only
    while a call waits for its answer (no second thread, no hop between threads). One call at a time; notices no
    `watch()` loop takes are kept for `wait_notification`. Called from async code, it blocks that code's loop as any
    blocking call does (its own loop then runs on a thread for the call); async code is better served by
    `AsyncClient`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: asyncio.Task[None],
        stop: asyncio.Event,
        client: AsyncClient,
        timeout: float | None,
    ) -> None:
        self._loop = loop
        self._host = host  # the task that holds AsyncClient.connect's context for the life of this client
        self._stop = stop
        self._client = client
        self._timeout = timeout
        self._kept: builtins.list[Reply] = []

    @classmethod
    def connect(
        cls,
        address: str | Path | None = None,
        *,
        token: str | None = None,
        timeout: float | None = 30.0,
        follow_moved: bool = True,
        peers: Iterable[str | Path] = (),
        share_token: bool = False,
    ) -> Client:
        """A client of the daemon at address (default: `default_address()`); `timeout` bounds each answer
        (TimeoutError). MOVED is followed only as `MoveTrust` allows (`peers`: the fleet's other daemons this client
        may follow it to and give its token; `share_token`: also another port of the first host).
        Raises NotRunningError when no daemon listens there, PermissionError when another user serves the socket."""
        loop = _new_loop()
        opened: asyncio.Future[AsyncClient] = loop.create_future()
        stop = asyncio.Event()

        async def hold() -> None:
            try:
                async with AsyncClient.connect(
                    address, token=token, follow_moved=follow_moved, peers=peers, share_token=share_token
                ) as client:
                    opened.set_result(client)
                    await stop.wait()
            except Exception as e:
                if opened.done():
                    raise
                opened.set_exception(e)

        host = loop.create_task(hold())
        try:
            client = _drive(loop, _bounded(opened, timeout))
        except BaseException:
            stop.set()
            _drive(loop, asyncio.gather(host, return_exceptions=True))
            loop.close()
            raise
        return cls(loop, host, stop, client, timeout)

    def close(self) -> None:
        """Close the connection (`close_session` closes a session)."""
        if self._loop.is_closed():
            return
        self._stop.set()
        try:
            _drive(self._loop, self._host)
        finally:
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: Awaitable[T], timeout: float | None) -> T:
        return _drive(self._loop, _bounded(call, timeout))

    def call_raw(self, method: str, params: Any = None) -> bytes:
        """The result's raw JSON; raises the error the daemon answered, ConnectionError if the connection is lost,
        TimeoutError past `timeout`. A session that lives on another daemon of a fleet (MOVED) is followed there, a
        few hops at most: this client then talks to that daemon."""
        return self._run(self._client.call_raw(method, params), self._timeout)

    def call(self, method: str, params: Any = None) -> Any:
        return msgspec.json.decode(self.call_raw(method, params))

    def request(self, method: str, params: msgspec.Struct) -> Any:
        """Call method with its params Struct; the result comes back as the method's result Struct."""
        return msgspec.json.decode(self.call_raw(method, params), type=METHODS[method].result)

    @property
    def notifications(self) -> builtins.list[Reply]:
        """The notices received and not yet taken by `wait_notification` or a `watch()` loop, oldest first."""
        while True:
            try:
                self._kept.append(self._client.notifications.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return self._kept

    def wait_notification(self, timeout: float | None = None) -> Reply:
        """The next notice no `watch()` loop takes, waiting up to `timeout` seconds for it (None: for as long as it
        takes; the connection's own timeout is for answers, not for a session that is quiet). ConnectionError once
        the connection is lost and none is left."""
        if self.notifications:
            return self._kept.pop(0)
        return self._run(self._client.notification(), timeout)

    # -- the method table, typed

    def initialize(self, *, token: str | None = None, name: str | None = None) -> InitializeResult:
        """Say hello (with the token, on TCP), as the client `name` (default "devd.client": who decides approvals);
        the daemon's version, protocol, ABI and limits."""
        result: InitializeResult = self.request("initialize", _hello(token, name))
        return result

    def status(self) -> StatusResult:
        """The daemon's counters."""
        result: StatusResult = self.request("daemon/status", NoParams())
        return result

    def mcp(self) -> McpResult:
        """The MCP servers the daemon's broker holds."""
        result: McpResult = self.request("daemon/mcp", NoParams())
        return result

    def backup(self, name: str) -> BackupResult:
        """A consistent copy of the daemon's sessions, written by the daemon as the new file `name` (a plain file
        name) of its backup directory."""
        result: BackupResult = self.request("daemon/backup", BackupParams(name))
        return result

    def drain(self) -> int:
        """Give this fleet daemon's sessions back to the fleet; how many."""
        result: DrainResult = self.request("daemon/drain", NoParams())
        return result.sessions

    def new(
        self,
        config: Config | None = None,
        session: str | None = None,
        *,
        agent: str | None = None,
        workspace: str | Path | None = None,
        budget: int | None = None,
    ) -> str:
        """Start a session (named `session`, else the daemon chooses); its name. With `agent` (a profile) and
        `workspace`, a session the daemon drives itself (`prompt`), with its own spend ceiling of `budget` tokens."""
        result: SessionResult = self.request("session/new", _new_params(config, session, agent, workspace, budget))
        return result.session

    # -- the agent runtime: sessions the daemon drives

    def prompt(self, session: str, prompt: str, *, key: str | None = None) -> int:
        """Start a turn of a session made with an agent (once per `key`); its turn id, once it is durable. The daemon
        carries out the turn: watch the session to see it."""
        result: PromptResult = self.request("session/prompt", PromptParams(session, prompt, key))
        return result.turn

    def resume(self, session: str) -> None:
        """Try a stalled session's model again."""
        self.request("session/resume", SessionParams(session))

    def bring_mcp(self, session: str, servers: builtins.list[SessionMcpServer]) -> None:
        """Give the agent session the MCP servers it brings, replacing those it brought before."""
        self.request("session/mcp", McpParams(session, servers))

    def set_model(self, session: str, model: str) -> ModelResult:
        """Set the model the session's next calls name (one of its profile's `models`)."""
        result: ModelResult = self.request("session/model", ModelParams(session, model))
        return result

    def compact(self, session: str) -> CompactResult:
        """Compact the session's conversation now: how many messages a summary replaced."""
        result: CompactResult = self.request("session/compact", SessionParams(session))
        return result

    def agent(self, session: str) -> AgentResult:
        """The agent profile and workspace the session was made with (nulls: the daemon does not drive it)."""
        result: AgentResult = self.request("session/agent", SessionParams(session))
        return result

    def step(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> list[Action]:
        """Step session with event (a Struct, or its JSON); the actions it was answered."""
        return self.step_answer(session, event, timeout_ms=timeout_ms, key=key).actions

    def step_answer(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> StepAnswer:
        """Step session with event; the actions, and whether the key's answer was replayed."""
        result: StepResult = self.request("session/step", _step(session, event, timeout_ms, key))
        return _answer(result)

    def step_result(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> dict[str, Any]:
        """The step's result as the daemon wrote it, decoded as plain JSON (`step_answer` is the typed one)."""
        return self.call("session/step", _step(session, event, timeout_ms, key))  # type: ignore[no-any-return]

    def snapshot(self, session: str) -> str:
        """The session's state, base64, for `restore`."""
        result: SnapshotResult = self.request("session/snapshot", SessionParams(session))
        return result.snapshot

    def restore(self, snapshot: str, session: str | None = None) -> str:
        """A new session from a snapshot (named `session`, else the daemon chooses); its name."""
        result: SessionResult = self.request("session/restore", RestoreParams(snapshot, session))
        return result.session

    def fork(self, session: str, *, at: int | None = None, name: str | None = None) -> str:
        """A new session whose history is session's up to step `at` (default: its latest); its name."""
        result: SessionResult = self.request("session/fork", ForkParams(session, at, name))
        return result.session

    def pending(self, session: str) -> list[Action]:
        """The actions session's core dispatched and still waits for."""
        result: PendingResult = self.request("session/pending", SessionParams(session))
        return decode_actions(bytes(result.actions))

    def transcript(self, session: str, start: int = 0, *, whole: bool = False) -> list[Message]:
        """The session's conversation from message `start` on: what a client of a session made with
        `Config(asks="delta")` reads when it starts, or when an ask's `from` is not the count of messages it holds.
        With `whole`, the whole conversation, what Summary events replaced in its place (see TranscriptParams)."""
        result: TranscriptResult = self.request("session/transcript", TranscriptParams(session, start, whole))
        return decode_messages(bytes(result.messages))

    def recover(self, session: str) -> str:
        """Bring an ended or poisoned session back from its durable state; its name."""
        result: SessionResult = self.request("session/recover", SessionParams(session))
        return result.session

    def close_session(self, session: str) -> None:
        """End the session and delete its state."""
        self.request("session/close", SessionParams(session))

    def list(self, limit: int | None = None, cursor: str | None = None) -> ListResult:
        """Sessions by name: all of them, or a page of `limit` after `cursor` (the `next` of the page before)."""
        result: ListResult = self.request("session/list", ListParams(limit, cursor))
        return result

    def info(self, session: str) -> InfoResult:
        """The session's `list` entry, and what its turn waits for (`waiting`: the pending actions' ids and kinds)."""
        result: InfoResult = self.request("session/info", SessionParams(session))
        return result

    def watch(
        self, session: str, since: int | None = None, *, timeout: float | None = None
    ) -> Generator[Notice, None, None]:
        """Every step of session after `since` (default: from when the iteration starts), then the notice that ends
        the subscription. `timeout` bounds the wait for each notice (TimeoutError); None waits for as long as the
        session is quiet. Leaving the loop early unsubscribes."""
        notices = self._client.watch(session, since)
        try:
            while True:
                try:
                    notice = self._run(anext(notices), timeout)
                except StopAsyncIteration:
                    return
                yield notice
        finally:
            if not self._loop.is_closed():
                _drive(self._loop, notices.aclose())

    def unwatch(self, session: str) -> None:
        """Stop receiving session's steps on this connection; a `watch()` loop of it ends."""
        self._run(self._client.unwatch(session), self._timeout)

    def approve(
        self,
        session: str,
        action: int,
        digest: str,
        decision: Literal["allow", "deny"],
        *,
        remember: bool | Remember = False,
    ) -> None:
        """Decide an action that waits for approval (`digest` from its `session/approval`)."""
        self.request("session/approve", ApproveParams(session, action, digest, decision, remember))

    def answer(
        self, session: str, action: int, request: int, answer: dict[str, Any] | None = None, *, decline: bool = False
    ) -> None:
        """Answer an MCP server's question (from its `session/input`), or decline it."""
        self.request("session/answer", AnswerParams(session, action, request, answer, decline))

    def set_budget(self, session: str, tokens: int | None) -> None:
        """Set the session's own spend ceiling in tokens (None: remove it)."""
        self.request("session/budget", BudgetParams(session, tokens))

    def usage(self, session: str) -> UsageResult:
        """What the session's model calls used, how many were made and how many were refused."""
        result: UsageResult = self.request("session/usage", SessionParams(session))
        return result

    def spawn(
        self,
        parent: str,
        id: str,
        agent: str,
        task: str,
        *,
        context: Literal["task", "fork"] = "task",
        output_schema: dict[str, Any] | None = None,
        budget: int | None = None,
    ) -> SpawnResult:
        """Start a delegated run: a child session of `parent` running `agent` on `task` (once per `id`)."""
        params = SpawnParams(parent, id, agent, task, context, output_schema, budget)
        result: SpawnResult = self.request("session/spawn", params)
        return result

    def wait(self, session: str, turn: int, timeout_ms: int | None = None) -> WaitResult:
        """Wait for the session's turn to end (`done: false` when `timeout_ms` passes first)."""
        result: WaitResult = self.request("session/wait", WaitParams(session, turn, timeout_ms))
        return result

    def list_children(self, parent: str) -> ListResult:
        """The children of `parent` (its delegated runs), as `list` shows sessions."""
        result: ListResult = self.request("session/list", ListParams(parent=parent))
        return result

    def set_title(self, session: str, title: str) -> None:
        """Set what the session is called (`title` in `session/list` and `session/info`)."""
        self.request("session/title", TitleParams(session, title))

    def effects(self, session: str, since: int = 0) -> builtins.list[Effect]:
        """The effects the daemon ran for the session from turn `since` on, and its rewinds, in order."""
        result: EffectsResult = self.request("session/effects", EffectsParams(session, since))
        return result.effects

    def rewind(self, session: str, turn: int, *, force: bool = False) -> RewindResult:
        """Put back the files the session's Writes changed since turn `turn` began, and its conversation to before
        it (CONFLICT when someone else changed one of those files since, unless `force`)."""
        result: RewindResult = self.request("session/rewind", RewindParams(session, turn, force))
        return result

    def trace(self, session: str, since: int = 0) -> builtins.list[TraceRecord]:
        """The session's trace records after record `since`, in order (asked for a page at a time)."""
        found: builtins.list[TraceRecord] = []
        while True:
            result: TraceResult = self.request("session/trace", TraceParams(session, since, TRACE_PAGE_MAX))
            found += result.records
            if result.next is None:
                return found
            since = result.next


# -- the async client -----------------------------------------------------------------------------------------------


class _Connection:
    """One connection of an AsyncClient: its stream, the calls waiting for answers, where its notices go."""

    def __init__(self, stream: anyio.abc.ByteStream, unrouted: MemoryObjectSendStream[Reply]) -> None:
        self.stream = stream
        self.waiting: dict[int, tuple[anyio.Event, list[Reply]]] = {}
        self.watches: dict[str, MemoryObjectSendStream[Notice]] = {}
        self.left: set[str] = set()  # sessions whose watch() was left early: their notices in flight are dropped
        self.unrouted = unrouted
        self.lost = False
        self.cut = False  # it ended in the middle of a line: a daemon that died mid-reply
        self.gone = anyio.Event()  # set when lost: what `wait_lost()` waits for

    def lose(self) -> None:
        """The connection is gone: every call waiting fails, every watch loop ends."""
        self.lost = True
        self.gone.set()
        for event, _ in self.waiting.values():
            event.set()
        self.waiting.clear()
        for route in self.watches.values():
            route.close()

    async def deliver(self, reply: Reply, line: bytes | bytearray | None = None) -> None:
        if reply.method is None:
            waiter = self.waiting.pop(reply.id, None) if isinstance(reply.id, int) else None
            if waiter is not None:
                event, slot = waiter
                slot.append(reply)
                event.set()
            return
        session = reply.params.get("session") if isinstance(reply.params, dict) else None
        route = self.watches.get(session) if isinstance(session, str) else None
        if route is not None:
            with contextlib.suppress(anyio.BrokenResourceError):  # its loop has just ended
                await route.send(notice_of(reply, line))
        elif session not in self.left:
            with contextlib.suppress(anyio.BrokenResourceError):  # no one reads `notifications` any more
                await self.unrouted.send(reply)


class AsyncClient:
    """An anyio client: many requests in flight, replies matched by id, notices routed to their `watch()` loop. The
    rest go to `notifications` (kept across reconnects, closed with the client), so a notice no loop takes waits
    there, up to NOTICES_BUFFERED of them, for whoever reads it."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        *,
        address: str | None = None,
        token: str | None = None,
        tasks: anyio.abc.TaskGroup | None = None,
    ) -> None:
        self._unrouted, self.notifications = anyio.create_memory_object_stream[Reply](NOTICES_BUFFERED)
        self._conn = _Connection(stream, self._unrouted)
        self._ids = itertools.count(1)
        self._address = address
        self._token = token  # given to the daemon at _address (the first address's, or none after some MOVED)
        self._given_token = token  # the token this client was given, for the addresses MoveTrust lets have it
        self._follow = False  # follow MOVED to the daemon it names (set by connect, which knows how to reconnect)
        self._trust: MoveTrust | None = None
        self._tasks = tasks

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        address: str | Path | None = None,
        *,
        token: str | None = None,
        follow_moved: bool = True,
        peers: Iterable[str | Path] = (),
        share_token: bool = False,
    ) -> AsyncIterator[AsyncClient]:
        """A client of the daemon at address (default: `default_address()`) for the life of the context.
        MOVED is followed only as `MoveTrust` allows (`peers`: the fleet's other daemons this client may follow it
        to and give its token; `share_token`: also another port of the first host).
        Raises NotRunningError when no daemon listens there, PermissionError when another user serves the socket."""
        address = default_address() if address is None else str(address)
        stream = await _open_stream(address)
        failed: BaseException | None = None
        async with anyio.create_task_group() as tg:
            client = cls(stream, address=address, token=token, tasks=tg)
            client._follow = follow_moved
            client._trust = MoveTrust.of(address, peers, share_token)
            tg.start_soon(client._read, client._conn)
            try:
                if _greets(address, token):
                    await client.initialize(token=token)
                yield client
            except BaseException as e:
                # Raised again below, once the task group is left: from inside it, anyio would wrap it in an
                # ExceptionGroup, and the caller's `except NotRunningError` (or UnauthorizedError) would miss it.
                failed = e
            finally:
                with anyio.CancelScope(shield=True):
                    await client._conn.stream.aclose()
                client._conn.lose()
                client._unrouted.close()
                client.notifications.close()
                tg.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def reconnect(self) -> None:
        """Drop this connection and open a new one to the same address (after the daemon restarted, say). Calls and
        watch loops of the old one have failed with ConnectionError; subscriptions are not carried over. Raises
        NotRunningError while no daemon listens there."""
        if self._address is None or self._tasks is None:
            raise RuntimeError("only a client made by AsyncClient.connect() knows where to reconnect")
        stream = await _open_stream(self._address)
        old, self._conn = self._conn, _Connection(stream, self._unrouted)
        old.lose()
        with anyio.CancelScope(shield=True):
            await old.stream.aclose()
        self._tasks.start_soon(self._read, self._conn)
        if _greets(self._address, self._token):
            await self.initialize(token=self._token)

    async def wait_lost(self) -> None:
        """Return once this client's connection is lost (the daemon stopped, or closed it); then `reconnect()`.
        For a client that must notice a daemon going away while it has no call in flight (it only listens)."""
        await self._conn.gone.wait()

    async def _read(self, conn: _Connection) -> None:
        # What has come of a line is held and split only once a read brings a newline: joining and splitting it at
        # every read made a long reply (a large session's ask or snapshot) cost the square of its length.
        partial = bytearray()
        try:
            while True:
                chunk = await conn.stream.receive(65536)
                partial += chunk
                if b"\n" not in chunk:
                    continue
                *lines, partial = partial.split(b"\n")
                for line in lines:
                    await conn.deliver(_reply.decode(line), line)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, msgspec.DecodeError):
            # A line that is not JSON is no daemon's: the connection is as good as lost (and the task group, which
            # would otherwise raise the error out of `connect`, stays whole). Half a line is no reply at all.
            conn.cut = bool(partial)
            conn.lose()

    async def call_raw(self, method: str, params: Any = None) -> bytes:
        """The result's raw JSON; raises the error the daemon answered, or ConnectionError if the connection is lost.
        A session that lives on another daemon of a fleet (MOVED) is followed there, a few hops at most."""
        for hop in range(MOVED_HOPS):
            try:
                return await self._call_once(method, params)
            except errors.MovedError as e:
                # Following moves the whole connection: only when nothing else uses it (other calls in flight, watch
                # loops), which would otherwise fail mid-way with an outcome unknown.
                busy = bool(self._conn.waiting or self._conn.watches)
                if self._tasks is None or self._trust is None or not self._follow or busy or hop == MOVED_HOPS - 1:
                    raise
                if e.address:  # no owner: nobody holds it now, and the same daemon takes it when asked again
                    token = self._trust.token_for(e, self._given_token)
                    here, self._address, self._token = (self._address, self._token), e.address, token
                    try:
                        await self.reconnect()
                    except NotRunningError:
                        self._address, self._token = here  # the owner is gone, its lease not yet ended: ask later
                        raise e from None
        raise AssertionError("unreachable")

    async def _call_once(self, method: str, params: Any) -> bytes:
        conn = self._conn
        if conn.lost:
            raise ConnectionError("the connection to the daemon is lost; reconnect() opens a new one")
        id = next(self._ids)
        event, slot = anyio.Event(), list[Reply]()
        conn.waiting[id] = (event, slot)
        try:
            await conn.stream.send(_request(id, method, params if params is not None else {}))
            await event.wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            raise ConnectionError(f"the connection to the daemon is lost ({type(e).__name__})") from e
        finally:
            conn.waiting.pop(id, None)
        if not slot:
            raise ConnectionError(
                "the daemon closed the connection" + (" in the middle of a reply" if conn.cut else "")
            )
        reply = slot[0]
        if reply.error is not None:
            _raise(reply.error)
        return bytes(reply.result)

    async def call(self, method: str, params: Any = None) -> Any:
        return msgspec.json.decode(await self.call_raw(method, params))

    async def notification(self) -> Reply:
        """The next notice no `watch()` loop takes (as `notifications` gives them); ConnectionError once the
        connection is lost and none is left."""
        conn = self._conn
        if not conn.lost:
            async with anyio.create_task_group() as tg:

                async def until_lost() -> None:
                    await conn.gone.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(until_lost)
                with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
                    reply = await self.notifications.receive()
                    tg.cancel_scope.cancel()
                    return reply
        try:
            return self.notifications.receive_nowait()  # one that came just before the end
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            raise ConnectionError("the connection to the daemon is lost; reconnect() opens a new one") from None

    async def request(self, method: str, params: msgspec.Struct) -> Any:
        """Call method with its params Struct; the result comes back as the method's result Struct."""
        return msgspec.json.decode(await self.call_raw(method, params), type=METHODS[method].result)

    # -- the method table, typed

    async def initialize(self, *, token: str | None = None, name: str | None = None) -> InitializeResult:
        """Say hello (with the token, on TCP), as the client `name` (default "devd.client": who decides approvals);
        the daemon's version, protocol, ABI and limits."""
        result: InitializeResult = await self.request("initialize", _hello(token, name))
        return result

    async def status(self) -> StatusResult:
        """The daemon's counters."""
        result: StatusResult = await self.request("daemon/status", NoParams())
        return result

    async def mcp(self) -> McpResult:
        """The MCP servers the daemon's broker holds."""
        result: McpResult = await self.request("daemon/mcp", NoParams())
        return result

    async def backup(self, name: str) -> BackupResult:
        """A consistent copy of the daemon's sessions, written by the daemon as the new file `name` (a plain file
        name) of its backup directory."""
        result: BackupResult = await self.request("daemon/backup", BackupParams(name))
        return result

    async def drain(self) -> int:
        """Give this fleet daemon's sessions back to the fleet; how many."""
        result: DrainResult = await self.request("daemon/drain", NoParams())
        return result.sessions

    async def new(
        self,
        config: Config | None = None,
        session: str | None = None,
        *,
        agent: str | None = None,
        workspace: str | Path | None = None,
        budget: int | None = None,
    ) -> str:
        """Start a session (named `session`, else the daemon chooses); its name. With `agent` (a profile) and
        `workspace`, a session the daemon drives itself (`prompt`), with its own spend ceiling of `budget` tokens."""
        params = _new_params(config, session, agent, workspace, budget)
        result: SessionResult = await self.request("session/new", params)
        return result.session

    # -- the agent runtime: sessions the daemon drives

    async def prompt(self, session: str, prompt: str, *, key: str | None = None) -> int:
        """Start a turn of a session made with an agent (once per `key`); its turn id, once it is durable. The daemon
        carries out the turn: watch the session to see it."""
        result: PromptResult = await self.request("session/prompt", PromptParams(session, prompt, key))
        return result.turn

    async def resume(self, session: str) -> None:
        """Try a stalled session's model again."""
        await self.request("session/resume", SessionParams(session))

    async def bring_mcp(self, session: str, servers: list[SessionMcpServer]) -> None:
        """Give the agent session the MCP servers it brings, replacing those it brought before."""
        await self.request("session/mcp", McpParams(session, servers))

    async def set_model(self, session: str, model: str) -> ModelResult:
        """Set the model the session's next calls name (one of its profile's `models`)."""
        result: ModelResult = await self.request("session/model", ModelParams(session, model))
        return result

    async def compact(self, session: str) -> CompactResult:
        """Compact the session's conversation now: how many messages a summary replaced."""
        result: CompactResult = await self.request("session/compact", SessionParams(session))
        return result

    async def agent(self, session: str) -> AgentResult:
        """The agent profile and workspace the session was made with (nulls: the daemon does not drive it)."""
        result: AgentResult = await self.request("session/agent", SessionParams(session))
        return result

    async def step(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> list[Action]:
        """Step session with event (a Struct, or its JSON); the actions it was answered."""
        return (await self.step_answer(session, event, timeout_ms=timeout_ms, key=key)).actions

    async def step_answer(
        self, session: str, event: Event | bytes, *, timeout_ms: int | None = None, key: str | None = None
    ) -> StepAnswer:
        """Step session with event; the actions, and whether the key's answer was replayed."""
        result: StepResult = await self.request("session/step", _step(session, event, timeout_ms, key))
        return _answer(result)

    async def snapshot(self, session: str) -> str:
        """The session's state, base64, for `restore`."""
        result: SnapshotResult = await self.request("session/snapshot", SessionParams(session))
        return result.snapshot

    async def restore(self, snapshot: str, session: str | None = None) -> str:
        """A new session from a snapshot (named `session`, else the daemon chooses); its name."""
        result: SessionResult = await self.request("session/restore", RestoreParams(snapshot, session))
        return result.session

    async def fork(self, session: str, *, at: int | None = None, name: str | None = None) -> str:
        """A new session whose history is session's up to step `at` (default: its latest); its name."""
        result: SessionResult = await self.request("session/fork", ForkParams(session, at, name))
        return result.session

    async def pending(self, session: str) -> list[Action]:
        """The actions session's core dispatched and still waits for."""
        result: PendingResult = await self.request("session/pending", SessionParams(session))
        return decode_actions(bytes(result.actions))

    async def transcript(self, session: str, start: int = 0, *, whole: bool = False) -> list[Message]:
        """The session's conversation from message `start` on: what a client of a session made with
        `Config(asks="delta")` reads when it starts, or when an ask's `from` is not the count of messages it holds.
        With `whole`, the whole conversation, what Summary events replaced in its place (see TranscriptParams)."""
        result: TranscriptResult = await self.request("session/transcript", TranscriptParams(session, start, whole))
        return decode_messages(bytes(result.messages))

    async def recover(self, session: str) -> str:
        """Bring an ended or poisoned session back from its durable state; its name."""
        result: SessionResult = await self.request("session/recover", SessionParams(session))
        return result.session

    async def close_session(self, session: str) -> None:
        """End the session and delete its state."""
        await self.request("session/close", SessionParams(session))

    async def list(self, limit: int | None = None, cursor: str | None = None) -> ListResult:
        """Sessions by name: all of them, or a page of `limit` after `cursor` (the `next` of the page before)."""
        result: ListResult = await self.request("session/list", ListParams(limit, cursor))
        return result

    async def info(self, session: str) -> InfoResult:
        """The session's `list` entry, and what its turn waits for (`waiting`: the pending actions' ids and kinds)."""
        result: InfoResult = await self.request("session/info", SessionParams(session))
        return result

    async def watch(
        self, session: str, since: int | None = None, *, subscribed: anyio.Event | None = None
    ) -> AsyncGenerator[Notice, None]:
        """Every step of session after `since` (default: from when the iteration starts), then the notice that ends
        the subscription. Raises ConnectionError if the connection is lost first; leaving the loop early
        unsubscribes. One loop per session and connection (a second one is refused: RuntimeError).

        `subscribed` is set once the daemon has the subscription: from then on every notice of the session comes to
        this loop, text streamed as `session/delta` included, which is not journalled and so never caught up on.
        A caller that starts a turn (`prompt`) and wants all of its text starts the loop first and waits for it."""
        conn = self._conn
        if session in conn.watches:
            raise RuntimeError(f"session {session!r} is already watched by a loop on this connection")
        send, receive = anyio.create_memory_object_stream[Notice](WATCH_BUFFERED)
        conn.watches[session] = send  # before the request: history may arrive ahead of its answer
        conn.left.discard(session)
        ended = False
        try:
            await self.request("session/watch", WatchParams(session, since))
            if subscribed is not None:
                subscribed.set()
            while not ended:
                try:
                    notice = await receive.receive()
                except anyio.EndOfStream:
                    if conn.lost:
                        raise ConnectionError(f"the connection was lost while watching session {session!r}") from None
                    return  # unwatch() ended it
                ended = isinstance(notice, UnwatchedNotice)
                yield notice
        finally:
            mine = conn.watches.get(session) is send  # else unwatch() ended this loop, and unsubscribed
            if mine:
                del conn.watches[session]
            send.close()
            receive.close()
            if mine and not ended and not conn.lost:
                conn.left.add(session)
                # Sent as a JSON-RPC notification, not a call: a loop being closed must not wait on an answer.
                with (
                    anyio.CancelScope(shield=True),
                    contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError),
                ):
                    await conn.stream.send(_request(None, "session/unwatch", SessionParams(session)))

    async def unwatch(self, session: str) -> None:
        """Stop receiving session's steps on this connection; a `watch()` loop of it ends."""
        conn = self._conn
        conn.left.add(session)  # notices already on their way are dropped
        route = conn.watches.pop(session, None)
        if route is not None:
            route.close()
        await self.request("session/unwatch", SessionParams(session))

    async def approve(
        self,
        session: str,
        action: int,
        digest: str,
        decision: Literal["allow", "deny"],
        *,
        remember: bool | Remember = False,
    ) -> None:
        """Decide an action that waits for approval (`digest` from its `session/approval`)."""
        await self.request("session/approve", ApproveParams(session, action, digest, decision, remember))

    async def answer(
        self, session: str, action: int, request: int, answer: dict[str, Any] | None = None, *, decline: bool = False
    ) -> None:
        """Answer an MCP server's question (from its `session/input`), or decline it."""
        await self.request("session/answer", AnswerParams(session, action, request, answer, decline))

    async def set_budget(self, session: str, tokens: int | None) -> None:
        """Set the session's own spend ceiling in tokens (None: remove it)."""
        await self.request("session/budget", BudgetParams(session, tokens))

    async def usage(self, session: str) -> UsageResult:
        """What the session's model calls used, how many were made and how many were refused."""
        result: UsageResult = await self.request("session/usage", SessionParams(session))
        return result

    async def spawn(
        self,
        parent: str,
        id: str,
        agent: str,
        task: str,
        *,
        context: Literal["task", "fork"] = "task",
        output_schema: dict[str, Any] | None = None,
        budget: int | None = None,
    ) -> SpawnResult:
        """Start a delegated run: a child session of `parent` running `agent` on `task` (once per `id`)."""
        params = SpawnParams(parent, id, agent, task, context, output_schema, budget)
        result: SpawnResult = await self.request("session/spawn", params)
        return result

    async def wait(self, session: str, turn: int, timeout_ms: int | None = None) -> WaitResult:
        """Wait for the session's turn to end (`done: false` when `timeout_ms` passes first)."""
        result: WaitResult = await self.request("session/wait", WaitParams(session, turn, timeout_ms))
        return result

    async def list_children(self, parent: str) -> ListResult:
        """The children of `parent` (its delegated runs), as `list` shows sessions."""
        result: ListResult = await self.request("session/list", ListParams(parent=parent))
        return result

    async def set_title(self, session: str, title: str) -> None:
        """Set what the session is called (`title` in `session/list` and `session/info`)."""
        await self.request("session/title", TitleParams(session, title))

    async def effects(self, session: str, since: int = 0) -> builtins.list[Effect]:
        """The effects the daemon ran for the session from turn `since` on, and its rewinds, in order."""
        result: EffectsResult = await self.request("session/effects", EffectsParams(session, since))
        return result.effects

    async def rewind(self, session: str, turn: int, *, force: bool = False) -> RewindResult:
        """Put back the files the session's Writes changed since turn `turn` began, and its conversation to before
        it (CONFLICT when someone else changed one of those files since, unless `force`)."""
        result: RewindResult = await self.request("session/rewind", RewindParams(session, turn, force))
        return result

    async def trace(self, session: str, since: int = 0) -> builtins.list[TraceRecord]:
        """The session's trace records after record `since`, in order (asked for a page at a time)."""
        found: builtins.list[TraceRecord] = []
        while True:
            result: TraceResult = await self.request("session/trace", TraceParams(session, since, TRACE_PAGE_MAX))
            found += result.records
            if result.next is None:
                return found
            since = result.next


__all__ = [
    "METHOD_NAMES",
    "NOTICES",
    "ActionsNotice",
    "AsyncClient",
    "Client",
    "DeltaNotice",
    "InstructionsNotice",
    "ChildNotice",
    "NotRunningError",
    "Notice",
    "Reply",
    "StalledNotice",
    "StepAnswer",
    "UnwatchedNotice",
    "check_peer",
    "default_address",
    "notice_of",
]
