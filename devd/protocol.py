"""The wire protocol as data: every method's params and result, the notices, the error data, and the method table.

What it promises: this module imports only `devd.messages`, `devd.errors`, msgspec and the standard library, so a
client (`devd.client`, or any tool that reads `devd schema`) loads the protocol without the daemon (no registry, no
wasm host, no wasmtime). `METHODS` maps each method's name to its `Spec`: its params and result types (with their
constraints, as msgspec `Meta`, so the schema shows them), its doc, the name of the client method that calls it, and
its flags (whether it names a session, whether a draining daemon still answers it). The daemon's handlers
(`devd.server.methods`), dispatch, `devd schema`, both Python clients and the CLI derive from it: a method is added here
first, then given its one handler in `devd.server.methods` (checked when that module is imported).

Params refuse unknown members; what a type cannot state (a key's length in bytes) is checked by `check`, and
`decode_params` words a broken constraint as the daemon always has (the protocol document shows those messages).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Protocol
from unicodedata import category

import msgspec
from msgspec import Meta, Raw

from devd.errors import InvalidParamsError
from devd.messages import Action, Config, Event, Op

SESSION_NAME_PATTERN = r"^(?!\.\.?$)[A-Za-z0-9._-]{1,64}$"
KEY_BYTES_MAX = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
SEQ_MAX = (1 << 63) - 1  # what SQLite's INTEGER (and PostgreSQL's bigint) holds
TRACE_PAGE = 1_000  # the trace records `session/trace` answers unless asked for fewer or more
TRACE_PAGE_MAX = 10_000  # the most it answers at once (about 2 MB of JSON)

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


# -- decoding params ------------------------------------------------------------------------------------------------


class Decodes(Protocol):
    """What decoding a method's params needs of it: a `Spec`, or the daemon's `Method` bound from one."""

    @property
    def name(self) -> str: ...

    @property
    def params(self) -> type[msgspec.Struct]: ...


@functools.cache
def _decoder(params: type[msgspec.Struct]) -> msgspec.json.Decoder[Any]:
    """A params type's decoder, made at its method's first call: making each method's as the table was built (its
    params' types resolved) took about 6 ms of every start of the daemon and of each `devd` command."""
    return msgspec.json.Decoder(params)


def decode_params(m: Decodes, raw: bytes) -> Any:
    """The method's params, or InvalidParamsError naming what is wrong."""
    if raw.strip() == b"null":
        raw = b"{}"
    try:
        params = _decoder(m.params).decode(raw)
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
        if _CONTROL.search(key):
            # A key is echoed into messages and logs: a newline in it could forge a line of either.
            raise InvalidParamsError(
                "the key must not hold control characters (U+0000-U+001F, U+007F-U+009F: newlines, tabs, escapes)"
            )
    title = getattr(params, "title", None)
    if isinstance(title, str):
        # A title is shown on one line of a terminal and in editors: nothing in it may move the cursor or reorder text.
        bad = next((c for c in title if not c.isprintable()), None)
        if bad is not None:
            raise InvalidParamsError(
                f"the title holds {bad!r}, which is not printable (a control, format or line-breaking character); "
                "send it without"
            )


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


CLIENT_NAME_CHARS_MAX = 64
CLIENT_NAME_FORGING = frozenset("()[]{}<>")  # `by` is `NAME (ORIGIN)`: a name with these could write an origin
# and any other opening or closing bracket (Unicode's Ps and Pe: `（` U+FF08, `﹙`, `⁽`), which reads as one
_BRACKETS = ("Ps", "Pe")


def client_name_problem(name: str) -> str | None:
    """Why `name` cannot name a client (None: it can). A name is written into an approval's `by` beside the origin
    the daemon found (`NAME (uid U, pid P)`), so it is one short line of printable text without the brackets an
    origin is written in: else a client could write a second origin, or a line, of its choosing."""
    if not name or len(name) > CLIENT_NAME_CHARS_MAX:
        return f"it has {len(name)} characters"
    forging = (c for c in name if not c.isprintable() or c in CLIENT_NAME_FORGING or category(c) in _BRACKETS)
    bad = next(forging, None)
    return None if bad is None else f"it holds {bad!r}"


class Client(msgspec.Struct, frozen=True):
    """Who is calling, for the daemon's log and an approval's `by`: `name` is 1 to 64 printable characters without
    `( ) [ ] { } < >` (`client_name_problem`), else `initialize` is INVALID_PARAMS."""

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


class NoParams(_Params, frozen=True):
    """This method takes no params."""


class McpServerStatus(msgspec.Struct, frozen=True):
    """One MCP server connection of the daemon: its name; its profile (`agent`, null for a session's own server); its
    state (`stopped`: not running, started at its next use; `starting`; `ready`; `failed`: its last start or life
    failed, `last_error` says why, and it is tried again at its next use after a backoff); its process's pid while it
    runs (null for an HTTP server); how many sessions use it; how many tools it lists; how many times it was started
    again; why it last failed; the protocol era it speaks (`mode`: "2026-07-28" for a Streamable HTTP server that took
    `server/discover`, "legacy" for one spoken to with `initialize` and for every stdio server; null until it first
    answered)."""

    name: str
    agent: str | None
    state: Literal["stopped", "starting", "ready", "failed"]
    pid: int | None
    sessions: int
    tools: int
    restarts: int
    last_error: str | None
    mode: Literal["2026-07-28", "legacy"] | None = None


class McpResult(msgspec.Struct, frozen=True):
    """Every MCP server connection the daemon holds (none when no profile names a server)."""

    servers: list[McpServerStatus]


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
    store_reopened: int  # times the store reopened its database after a write fault, and went on serving
    commit_ms_p50: float
    commit_ms_p99: float
    memory_rss_bytes: int


class BackupParams(_Params, frozen=True):
    """The name of the copy to write in the daemon's backup directory (`devd serve --backup-dir`): a plain file name
    that is not there yet. `path` is its older spelling and takes a plain name too."""

    name: Annotated[str, Meta(min_length=1, description="a file name: no /, not . or .., no leading .")] | None = None
    path: Annotated[str, Meta(min_length=1, description="the same as name (its older spelling)")] | None = None


class BackupResult(msgspec.Struct, frozen=True):
    """The copy written: where, and its size."""

    path: str
    bytes: int


class DrainResult(msgspec.Struct, frozen=True):
    """How many sessions this daemon gave back to the fleet."""

    sessions: int


# -- sessions -----------------------------------------------------------------------------------------------------


class TokenBudget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A session's own spend ceiling: at most `tokens` (input + output) over all its model calls."""

    tokens: Annotated[int, Meta(ge=1, le=SEQ_MAX, description="a number of tokens, at least 1")]


class NameValue(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A variable or header of a session's own MCP server: its name and its value."""

    name: str
    value: str


class SessionMcpServer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An MCP server a session brings, in ACP's shape: stdio `{name, command, args, env}` (the process gets `env`'s
    values), or Streamable HTTP `{type: "http", name, url, headers}`. Its calls are always asked about."""

    name: Annotated[str, Meta(description="letters, digits, - and single _, at most 32")]
    command: str | None = None
    args: list[str] = msgspec.field(default_factory=list)
    env: list[NameValue] = msgspec.field(default_factory=list)
    type: Literal["stdio", "http"] | None = None
    url: str | None = None
    headers: list[NameValue] = msgspec.field(default_factory=list)


class NewParams(_Params, frozen=True):
    """A new session, from a config (default `{}`), under a name (default: chosen by the daemon); with `agent` (a
    profile of the daemon's agents file) and `workspace` (an absolute directory inside the profile's roots), a session
    the daemon drives itself (`session/prompt`), with `budget` its own spend ceiling, and `mcp_servers` MCP servers
    of its own (where the profile has `session_mcp = true`), kept in the daemon's memory for the session's life in
    this daemon (after a restart, `session/mcp` gives them again)."""

    config: Config | None = None
    session: SessionName | None = None
    agent: Annotated[str, Meta(description="the name of an agent profile")] | None = None
    workspace: Annotated[str, Meta(description="an absolute directory inside the profile's roots")] | None = None
    budget: TokenBudget | None = None
    mcp_servers: list[SessionMcpServer] | None = None


class McpParams(_Params, frozen=True):
    """The MCP servers a session brings (replacing those it brought before; `[]`: none)."""

    session: SessionName
    mcp_servers: list[SessionMcpServer]


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


class SnapshotResult(msgspec.Struct, frozen=True):
    """The session's state, base64, for `session/restore`."""

    snapshot: str


class RestoreParams(_Params, frozen=True):
    """A snapshot from `session/snapshot`, and the name of the session it starts (default: chosen)."""

    snapshot: str
    session: SessionName | None = None


class ForkParams(_Params, frozen=True):
    """The session to fork, the step to fork at (default: its latest) and the fork's name (default: chosen)."""

    session: SessionName
    at: Seq | None = None
    as_: SessionName | None = msgspec.field(default=None, name="as")


class PendingResult(msgspec.Struct, frozen=True):
    """The actions the core dispatched and still waits for (a model ask, or calls without a result), in id order,
    exactly as they were answered."""

    actions: Raw


class TranscriptParams(_Params, frozen=True):
    """The session, and the index of the first message wanted (0, the default: the whole conversation). The
    conversation is the one the model is sent, a `Summary` first once one replaced its start; with `whole: true`, the
    whole conversation, the messages summaries replaced in their place (kept by the daemon) and no `Summary`."""

    session: SessionName
    from_: Annotated[int, Meta(ge=0, le=TRANSCRIPT_INDEX_MAX, description="a message index, from 0")] = msgspec.field(
        default=0, name="from"
    )
    whole: Annotated[
        bool, Meta(description="the whole conversation: what summaries replaced in their place, and no Summary")
    ] = False


class TranscriptResult(msgspec.Struct, frozen=True):
    """The conversation as it stands after step `seq`, from message `from` on (none past its end)."""

    seq: int
    from_: int = msgspec.field(name="from")
    messages: Raw


class ListParams(_Params, frozen=True):
    """A page of the sessions: at most `limit` (default: all of them) whose names sort after `cursor`."""

    limit: Annotated[int, Meta(ge=1, le=100_000, description="at most this many sessions")] | None = None
    cursor: Annotated[str, Meta(description="the `next` of the page before")] | None = None
    parent: SessionName | None = None  # only the children of this session


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
    # In a fleet only: whether this daemon holds the session. When false, `state` and `seq` are what this daemon
    # last knew (another daemon may have stepped it since); a call naming the session takes it, or answers MOVED.
    held: bool | None = None
    stalled: str | None = None  # the daemon drives it and cannot carry out what it waits for: why (`session/resume`)
    title: str | None = None  # what the session is about: its first prompt cut to 60 characters, or `session/title`
    parent: str | None = None  # a child session (a delegated run): the session that delegated it
    children: list[str] | None = None  # the child sessions it delegated to, in the order they were made


class ListResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sessions by name; `next` is the cursor for the following page, when there is one."""

    sessions: list[SessionInfo]
    next: str | None = None


def rfc3339(seconds: float) -> str:
    """Wall-clock seconds as RFC 3339 in UTC, to the millisecond."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class WatchParams(_Params, frozen=True):
    """The session to watch, and the step after which to start (default: from now on)."""

    session: SessionName
    since: Seq | None = None


class Waiting(msgspec.Struct, frozen=True):
    """An action the session's turn waits for: its id, and what it asks for (the `Op` member it carries: "Model",
    "Exec", "Read", "Write", "Git", "Browse" or "Tool")."""

    id: int
    kind: str


class InfoResult(SessionInfo, frozen=True, omit_defaults=True, kw_only=True):
    """One session, as `session/list` shows it, and what its turn waits for: the pending actions' ids and kinds, in
    id order (none when the turn is over, or the session ended or was poisoned)."""

    waiting: list[Waiting]
    # Of a session the daemon drives: the project instruction files its next model call sends (absolute paths).
    instructions: list[str] | None = None


def waiting(actions: list[Action]) -> list[Waiting]:
    """The id and kind of each pending action."""
    return [Waiting(a.id, next(f for f in a.op.__struct_fields__ if getattr(a.op, f) is not None)) for a in actions]


# -- errors ---------------------------------------------------------------------------------------------------------


class Owner(msgspec.Struct, frozen=True):
    """The daemon of a fleet that holds a session: its name, and the address its clients reach it at."""

    node: str
    address: str


class ErrorData(msgspec.Struct, frozen=True, omit_defaults=True):
    kind: str
    owner: Owner | None | msgspec.UnsetType = msgspec.UNSET  # MOVED only: the daemon that holds the session, or null


class Error(msgspec.Struct, frozen=True):
    code: int
    message: str
    data: ErrorData


# -- notifications -------------------------------------------------------------------------------------------------


# -- the agent runtime: prompts, approvals, spend and trace ---------------------------------------------------------


class PromptParams(_Params, frozen=True):
    """A prompt for a session the daemon drives, with an optional idempotency key (a retry with the same key answers
    the same turn, and starts nothing)."""

    session: SessionName
    prompt: str
    key: Annotated[str, Meta(min_length=1, max_length=KEY_BYTES_MAX, description="1-256 bytes of UTF-8")] | None = None


class PromptResult(msgspec.Struct, frozen=True):
    """The turn the prompt started (or, for a key answered before, started then)."""

    turn: int


class AgentResult(msgspec.Struct, frozen=True):
    """The agent profile and workspace a session was made with; both null for a session the daemon does not drive."""

    agent: str | None
    workspace: str | None


Remember = Literal["exact", "prefix"]


class ApproveParams(_Params, frozen=True):
    """A client's decision on an action that waits for approval, naming it by its `digest` (from its
    `session/approval`); `remember`: the same decision for later calls of this session without asking: `true` or
    `"exact"` for calls of exactly this argv (Exec, Git) or path (Write), `"prefix"` for calls of this argv followed
    by more words, none of which starts with `-` (a remembered denial covers every such extension)."""

    session: SessionName
    action: Annotated[int, Meta(ge=0, le=SEQ_MAX, description="the action's id")]
    digest: Annotated[str, Meta(min_length=1, max_length=128, description="the hex SHA-256 of its session/approval")]
    decision: Literal["allow", "deny"]
    remember: bool | Remember = False


ANSWER_BYTES_MAX = 64 * 1024  # of a `session/answer`'s answer, as JSON


class AnswerParams(_Params, frozen=True):
    """A client's answer to question `request` of action `action` (from its `session/input`): `answer`, the JSON
    object its `schema` asks for, or `decline: true`; exactly one of the two."""

    session: SessionName
    action: Annotated[int, Meta(ge=0, le=SEQ_MAX, description="the action's id")]
    request: Annotated[int, Meta(ge=1, le=SEQ_MAX, description="the question's number, from its session/input")]
    answer: dict[str, Any] | None = None
    decline: bool = False


class BudgetParams(_Params, frozen=True):
    """The session's own spend ceiling in tokens; null removes it."""

    session: SessionName
    tokens: Annotated[int, Meta(ge=1, le=SEQ_MAX, description="a number of tokens, at least 1")] | None


class UsageTotals(msgspec.Struct, frozen=True):
    """Usage summed over sessions: tokens, calls made and calls a spend ceiling refused."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    calls: int = 0
    refused: int = 0

    def plus(self, other: UsageTotals | UsageResult) -> UsageTotals:
        """These counts and the other's, summed."""
        return UsageTotals(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cached_tokens + other.cached_tokens,
            self.calls + other.calls,
            self.refused + other.refused,
        )


class SpawnParams(_Params, frozen=True):
    """Start a delegated run from outside: a child session of `parent` (a session of an agent) running `agent` on
    `task`, held to the parent as the `delegate` tool's children are. `id`, the caller's: the same id answers the same
    child and starts nothing. `context`: "task" (the task alone, the default) or "fork" (the parent's conversation so
    far too); `output_schema`: a JSON Schema its final answer must satisfy; `budget`: its own token ceiling."""

    parent: SessionName
    id: Annotated[str, Meta(min_length=1, max_length=128, description="the caller's id of this run")]
    agent: Annotated[str, Meta(min_length=1, description="one of the parent's agent's delegates")]
    task: Annotated[str, Meta(min_length=1, description="what the child is to do")]
    context: Literal["task", "fork"] = "task"
    output_schema: dict[str, Any] | None = None
    budget: Annotated[int, Meta(ge=1, le=SEQ_MAX)] | None = None


class SpawnResult(msgspec.Struct, frozen=True):
    """The child session and its turn (`session/wait` waits for it)."""

    session: str
    turn: int


class WaitParams(_Params, frozen=True):
    """Wait for turn `turn` of the session to end, for `timeout_ms` at most (default: until it does)."""

    session: SessionName
    turn: Annotated[int, Meta(ge=1)]
    timeout_ms: Annotated[int, Meta(ge=0, le=86_400_000)] | None = None


class WaitResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """Whether the turn has ended; if so, how (`outcome`): `completed` or `cancelled`, and for a child session its
    terminal state (`failed`, `disconnected` too), its final answer (`answer`) or why it did not complete (`why`)."""

    done: bool
    outcome: Literal["completed", "failed", "cancelled", "disconnected"] | None = None
    answer: str | None = None
    why: str | None = None


class UsageResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the session's model calls used (the provider's counts, else devd's estimate: then `estimated`), how many
    calls were made, and how many a spend ceiling refused. A fork counts from zero."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int
    calls: int
    refused: int
    estimated: bool = False  # some of the counts are devd's estimate: a server sent no usage for a call
    window: int | None = None  # the context window of the model the session's next call names, when devd knows it
    children: UsageTotals | None = None  # its descendants' (delegated runs') usage, summed; none when it has none


class ModelParams(_Params, frozen=True):
    """The session, and the model its next calls name: one of its agent profile's `models`."""

    session: SessionName
    model: Annotated[str, Meta(min_length=1, max_length=256, description="a model's name, 1-256 characters")]


class ModelResult(msgspec.Struct, frozen=True):
    """The model the session's next calls name, and the models its agent profile offers."""

    model: str
    models: list[str]


class CompactResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """How many messages of the transcript a summary replaced (`session/compact`); 0 and `why` when none was."""

    replaced: int
    why: str | None = None


class TraceParams(_Params, frozen=True):
    """The session, the number of the last trace record already seen (default 0: from the first), and the most
    records to answer (default 1,000, at most 10,000)."""

    session: SessionName
    since: Annotated[int, Meta(ge=0, le=SEQ_MAX, description="a trace record's `n`")] = 0
    limit: Annotated[int, Meta(ge=1, le=TRACE_PAGE_MAX, description="1 to 10,000 records")] = TRACE_PAGE


Kind = Literal["model", "exec", "read", "write", "git", "browse", "delegate", "tool"]
Outcome = Literal["ok", "error", "denied", "refused", "interrupted"]


class TraceRecord(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One model call attempt or tool run. `n` is its number in the session's record log, increasing but not
    consecutive (other records are numbered between; old trace records go): `session/trace` pages by it;
    `started` is RFC 3339 in UTC to the millisecond; `attempt` counts a model call's attempts from 1."""

    n: int = 0
    action: int
    kind: Kind
    started: str
    duration_ms: float
    outcome: Outcome
    error: str | None = None
    attempt: int | None = None
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    estimated: bool = False  # the token counts are devd's estimate: the server sent none (a stream cut short, say)
    name: str | None = None  # a tool run's command (argv[0]) or path; "summary" for a model call that compacted
    instructions: str | None = None  # a model call's: the hex SHA-256 of the project instructions it sent


class TraceResult(msgspec.Struct, frozen=True):
    """The session's trace records after `since`, in order, at most `limit`: one per model call attempt and per tool
    run. `next`: the `since` of the next page; null when there are no more records (yet)."""

    records: list[TraceRecord]
    next: int | None = None


TITLE_CHARS_MAX = 200  # of a title set with `session/title`; one taken from a first prompt is cut to 60


class TitleParams(_Params, frozen=True):
    """The session and its new title: 1-200 characters, no control characters (a title is shown on one line)."""

    session: SessionName
    title: Annotated[str, Meta(min_length=1, max_length=TITLE_CHARS_MAX, description="1-200 characters")]


class EffectsParams(_Params, frozen=True):
    """The session, and the first turn whose effects are wanted (default: every turn's)."""

    session: SessionName
    since: Annotated[int, Meta(ge=0, le=SEQ_MAX, description="a turn id")] = 0


class Effect(msgspec.Struct, frozen=True):
    """One effect the daemon carried out for the session, or a rewind: its turn, its action (0 for a rewind), its `kind`
    (`Exec`, `Write`, `Git`, a named tool's name, or `Rewind`), its `subject` (a command's argv, a path, a named
    tool's input, or for a rewind the files it put back and removed), when it started (RFC 3339, UTC), its `outcome`
    (`ok`, `error`, `interrupted`: it may have partly run; for a rewind `ok`, or `interrupted` while one a stopped
    daemon left is not finished yet) and whether `session/rewind` can put back what it changed (not once a rewind
    has)."""

    turn: int
    action: int
    kind: str
    subject: str | list[str]
    at: str
    outcome: Outcome
    undoable: bool


class EffectsResult(msgspec.Struct, frozen=True):
    """The session's effects, in the order they ran."""

    effects: list[Effect]


class RewindParams(_Params, frozen=True):
    """The session, the turn to rewind to (the conversation goes back to before it; every file its Writes and the
    later turns' changed is put back), and `force`: put the files back even where someone else changed them since."""

    session: SessionName
    turn: Annotated[int, Meta(ge=1, le=SEQ_MAX, description="a turn id, as `session/prompt` answered it")]
    force: Annotated[bool, Meta(description="put every file back, even those someone else changed since")] = False


class NotUndone(msgspec.Struct, frozen=True):
    """An effect a rewind cannot put back (a command, a git call): it stays as it was."""

    action: int
    kind: str
    subject: str | list[str]


class RewindResult(msgspec.Struct, frozen=True):
    """What a rewind did: the files it put back (`restored`) and those the Writes had made, which it removed, both
    relative to the workspace; the effects it could not undo; and `kept_as`, a fork holding the conversation as it
    was before the rewind (its turns after the rewound one included), still readable."""

    restored: list[str]
    removed: list[str]
    not_undone: list[NotUndone]
    kept_as: str


class StepNotice(msgspec.Struct, frozen=True):
    """`session/actions`: one answered step of a watched session, and `at`, when it was answered (RFC 3339, UTC, to
    the millisecond; for a step of the history a watch catches up on, when it was journalled)."""

    session: str
    seq: int
    event: Raw
    actions: Raw
    at: str


class UnwatchedNotice(msgspec.Struct, frozen=True, omit_defaults=True):
    """`session/unwatched`: the subscription ended after step `seq` ("closed", "expired", "moved" to the daemon
    `owner`: watch it there with `since` = `seq`, "rewound to step N", "ended while its turn ran (...)": kept until
    `session/recover`, or "fell too far behind")."""

    session: str
    seq: int
    reason: str
    owner: Owner | None = None


DeltaKind = Literal["text", "reasoning", "summary"]


class DeltaNotice(msgspec.Struct, frozen=True, omit_defaults=True):
    """`session/delta`: a fragment of the text the model is writing for the Model action `action`; not journalled.
    The fragments of one action, in order, are its reply's text (a watcher that joins mid-stream is first sent the
    text so far as one fragment). `kind` (left out for "text"): "reasoning" is the model's reasoning streamed beside
    its answer (never part of the reply), "summary" the summary it writes when the conversation is compacted; those
    are told to the watchers watching as they stream, not kept for those that join later."""

    session: str
    action: int
    text: str
    kind: DeltaKind = "text"


class StalledNotice(msgspec.Struct, frozen=True):
    """`session/stalled`: the daemon cannot carry out action `action` by itself (`why`: the model could not be reached
    after its retries, a spend ceiling refused the call, or carrying it out failed); it stays pending until
    `session/resume`."""

    session: str
    action: int
    why: str


class SkippedFile(msgspec.Struct, frozen=True):
    """A project instruction file that was there and was not sent: its absolute path, and why."""

    path: str
    why: str


class InstructionsNotice(msgspec.Struct, frozen=True):
    """`session/instructions`: at the model call of action `action`, project instruction files (the profile's
    `instructions`) were there and were not sent to the model (unreadable, too large, a link): each, and why. The
    turn went on without them."""

    session: str
    action: int
    skipped: list[SkippedFile]


class ApprovalNotice(msgspec.Struct, frozen=True):
    """`session/approval`: action `action` of the session (`op`, what it would do) waits for a client's decision;
    answer it with `session/approve` and this `digest`. `why`: why the policy asks (the profile says `ask`, a rule
    does, or the command may run what its argv does not show)."""

    session: str
    action: int
    op: Op
    digest: str
    why: str | None = None


class Remembered(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a remembered decision settles in the rest of the session without asking: calls of exactly this `argv`
    (`scope` "exact"), or of this `argv` followed by more words none of which starts with `-` (`scope` "prefix"; a
    remembered denial covers every extension); or writes of exactly this `path`; or calls of the MCP tool `tool` (its
    model name) with exactly the input whose canonical JSON (members sorted) has the SHA-256 `input_sha256`.
    `narrowed` says why a "prefix" asked for was kept "exact" (the argv runs a command given in its arguments: `env`,
    `timeout 60`, `ssh host`; an MCP tool's call is remembered by its input)."""

    scope: Remember
    argv: list[str] | None = None
    path: str | None = None
    narrowed: str | None = None
    tool: str | None = None
    input_sha256: str | None = None


class DecidedNotice(msgspec.Struct, frozen=True):
    """`session/decided`: action `action` was decided: `allow` or `deny` by `by`, the client's name from `initialize`
    (or "unknown") and the peer it spoke from (`NAME (uid U, pid P)` on a Unix socket, `NAME (HOST:PORT)` on TCP), or
    `cancelled` (its turn was cancelled); `remembered`: what the decision settles later without asking, if anything."""

    session: str
    action: int
    decision: Literal["allow", "deny", "cancelled"]
    by: str
    remembered: Remembered | None = None


class ChildNotice(msgspec.Struct, frozen=True, omit_defaults=True):
    """`session/child`, to the parent's watchers: child session `child` (of agent `agent`, delegated by action
    `action` of `session`; 0: by `session/spawn`) is now in `state` (`running`, then exactly one of `completed`,
    `failed`, `cancelled`, `disconnected`), having used `usage`; `why` says why a child did not complete."""

    session: str
    action: int
    child: str
    agent: str
    state: Literal["running", "completed", "failed", "cancelled", "disconnected"]
    usage: UsageTotals
    why: str | None = None


class InputNotice(msgspec.Struct, frozen=True):
    """`session/input`: the MCP server of the tool call `action` asks a person a question (an MCP elicitation) before
    it goes on: `message`, and `schema`, the JSON Schema of the object it asks for. Answer it with `session/answer`
    naming `request` (its number among the action's questions); the first answer wins."""

    session: str
    action: int
    request: int
    message: str
    schema: dict[str, Any]


class AnsweredNotice(msgspec.Struct, frozen=True, omit_defaults=True):
    """`session/answered`: question `request` of action `action` was decided: `accept` (answered) or `decline` by `by`
    (a client, as `session/decided` names it), or `cancel` (withdrawn: its turn was cancelled, or its call ended);
    `why` says why when devd decided it (a restart the server's protocol cannot resume a question across)."""

    session: str
    action: int
    request: int
    decision: Literal["accept", "decline", "cancel"]
    by: str
    why: str | None = None


NOTIFICATIONS: dict[str, type[msgspec.Struct]] = {
    "session/actions": StepNotice,
    "session/unwatched": UnwatchedNotice,
    "session/delta": DeltaNotice,  # the agent runtime's, sent by devd.agent.port
    "session/stalled": StalledNotice,
    "session/approval": ApprovalNotice,  # approvals (devd.agent.oversight), sent through the agent runtime's port
    "session/decided": DecidedNotice,
    "session/instructions": InstructionsNotice,  # project instruction files skipped (devd.agent.instructions)
    "session/child": ChildNotice,  # a delegated run's state and usage (devd.agent.children)
    "session/input": InputNotice,  # an MCP server's question (devd.agent.questions)
    "session/answered": AnsweredNotice,
}


class ActionsNotice(msgspec.Struct, frozen=True):
    """`session/actions` as a client reads it: step `seq` of a watched session, its event, the actions it was
    answered, and when (`at`, RFC 3339)."""

    session: str
    seq: int
    event: Event
    actions: list[Action]
    at: str = ""  # always sent by the daemon; empty only in a notice made by hand (a test's, a renderer's)


# -- the method table -----------------------------------------------------------------------------------------------


class Spec(msgspec.Struct, frozen=True):
    """One method of the protocol, as data (a Struct: a dataclass was about 0.5 ms of every start to build)."""

    name: str
    params: type[msgspec.Struct]
    result: type[msgspec.Struct]
    doc: str
    call: str  # the method of `devd.client`'s clients that calls it
    session: bool  # its params name one session (`session`), which the call acts on
    during_shutdown: bool = False  # answered while the daemon drains (status), or refused as BUSY


def _spec(
    name: str,
    params: type[msgspec.Struct],
    result: type[msgspec.Struct],
    call: str,
    doc: str,
    *,
    during_shutdown: bool = False,
) -> Spec:
    required = params.__struct_fields__[: len(params.__struct_fields__) - len(params.__struct_defaults__)]
    return Spec(name, params, result, " ".join(doc.split()), call, "session" in required, during_shutdown)


METHODS: dict[str, Spec] = {
    s.name: s
    for s in [
        _spec(
            "initialize",
            InitializeParams,
            InitializeResult,
            "initialize",
            "Say hello; optional on the Unix socket, required first (with the token) on TCP.",
        ),
        _spec(
            "daemon/status",
            NoParams,
            StatusResult,
            "status",
            "The daemon's counters: sessions by state, steps, errors by kind, commit latency, memory.",
            during_shutdown=True,
        ),
        _spec(
            "daemon/mcp",
            NoParams,
            McpResult,
            "mcp",
            """The MCP servers the daemon's broker holds: one connection per server configuration, shared by the
            sessions that may use it, with its state, process, sessions, tools, restarts and last error.""",
        ),
        _spec(
            "daemon/backup",
            BackupParams,
            BackupResult,
            "backup",
            "A consistent copy of every session, taken while the daemon serves (steps wait while pages are copied).",
        ),
        _spec(
            "daemon/drain",
            NoParams,
            DrainResult,
            "drain",
            """Give every session this daemon of a fleet holds back to the fleet, so other daemons take them at once
            (before a restart, say); a session called here again is taken back. Calls in flight keep their session.""",
        ),
        _spec("session/new", NewParams, SessionResult, "new", "Start a session; it is durable before this answers."),
        _spec(
            "session/mcp",
            McpParams,
            Empty,
            "bring_mcp",
            """Give a session of an agent the MCP servers it brings (as `session/new` `mcp_servers` does), replacing
            those it brought before: after a daemon restart, which forgets them, or when an editor reloads it.""",
        ),
        _spec(
            "session/step",
            StepParams,
            StepResult,
            "step_answer",
            "Step a session with one event; answered once the step is durable.",
        ),
        _spec(
            "session/snapshot", SessionParams, SnapshotResult, "snapshot", "The session's state as the core encodes it."
        ),
        _spec(
            "session/restore",
            RestoreParams,
            SessionResult,
            "restore",
            "Start a session from a snapshot; it is durable before this answers.",
        ),
        _spec(
            "session/fork",
            ForkParams,
            SessionResult,
            "fork",
            """Start a session whose history is the source's up to step `at`, with its own name, journal and keys; the
            source is untouched.""",
        ),
        _spec(
            "session/pending",
            SessionParams,
            PendingResult,
            "pending",
            "What the session still waits for, from the core itself: what a client that reconnects still owes.",
        ),
        _spec(
            "session/transcript",
            TranscriptParams,
            TranscriptResult,
            "transcript",
            """The session's conversation, as a Model ask would carry it whole: what a client of a session whose asks
            carry only new messages (config `asks: "delta"`) reads when it starts, or has lost count.""",
        ),
        _spec(
            "session/recover",
            SessionParams,
            SessionResult,
            "recover",
            "Bring an ended or poisoned session back from its durable state.",
        ),
        _spec(
            "session/close",
            SessionParams,
            Empty,
            "close_session",  # `close` closes the connection
            'End a session and delete its state; its watchers get `session/unwatched` with reason "closed".',
        ),
        _spec(
            "session/list",
            ListParams,
            ListResult,
            "list",
            """The sessions the daemon holds, by name, a page at a time when `limit` is given; with `parent`, only that
            session's children (its delegated runs), in the order they were made. Each carries `parent` (a child's)
            and `children` (a parent's).""",
        ),
        _spec(
            "session/info",
            SessionParams,
            InfoResult,
            "info",
            """One session, as `session/list` shows it, and what its turn waits for (the pending actions' ids and
            kinds): what a UI shows of one session without listing them all.""",
        ),
        _spec(
            "session/watch",
            WatchParams,
            Empty,
            "watch",
            """Receive `session/actions` for every step of the session after `since` (or from now) on this
            connection.""",
        ),
        _spec(
            "session/unwatch",
            SessionParams,
            Empty,
            "unwatch",
            "Stop receiving the session's steps on this connection.",
        ),
        _spec(
            "session/prompt",
            PromptParams,
            PromptResult,
            "prompt",
            """Start a turn of a session made with an agent; answered once its Turn step is durable, after which the
            daemon carries out every action of the turn itself (watchers see each step as `session/actions`, the
            model's text as it streams as `session/delta`).""",
        ),
        _spec(
            "session/resume",
            SessionParams,
            Empty,
            "resume",
            "Try a stalled session's action again (and drive a session of an agent that owes work).",
        ),
        _spec(
            "session/model",
            ModelParams,
            ModelResult,
            "set_model",
            """Set the model a session made with an agent names in its next model calls (one of the profile's
            `models`), durably: across restarts, and in a fork. Each call's trace record says its model.""",
        ),
        _spec(
            "session/compact",
            SessionParams,
            CompactResult,
            "compact",
            """Compact a session made with an agent now: the model summarises the start of its conversation (a model
            call like any other: traced, charged, under the ceilings, its text streamed as `session/delta` of kind
            "summary"), and the Summary replaces it; answered with how many messages were replaced.""",
        ),
        _spec(
            "session/agent",
            SessionParams,
            AgentResult,
            "agent",
            "Which agent drives the session, in which workspace (what an editor lists and attaches sessions by).",
        ),
        _spec(
            "session/approve",
            ApproveParams,
            Empty,
            "approve",
            """Decide an action that waits for approval: the first valid answer wins (durable before every watcher
            gets `session/decided`), a later one is CONFLICT naming who decided, a digest that does not match is
            INVALID_PARAMS and decides nothing. `allow` runs the action once; `deny` steps it as a failed call saying
            who denied it.""",
        ),
        _spec(
            "session/answer",
            AnswerParams,
            Empty,
            "answer",
            """Answer an MCP server's question (`session/input`) with `answer`, the JSON object its schema asks for, or
            decline it (`decline: true`): the first answer wins (durable before it is sent to the server and every
            watcher gets `session/answered`), a later one is CONFLICT naming who answered; an answer its schema does
            not admit is INVALID_PARAMS and decides nothing.""",
        ),
        _spec(
            "session/budget",
            BudgetParams,
            Empty,
            "set_budget",
            """Set (or raise, or remove) the session's spend ceiling; durable before it applies. A session stalled by
            it carries on with `session/resume`.""",
        ),
        _spec(
            "session/usage",
            SessionParams,
            UsageResult,
            "usage",
            "The session's spend so far, and its descendants' (delegated runs') summed as `children`.",
        ),
        _spec(
            "session/trace",
            TraceParams,
            TraceResult,
            "trace",
            """What the daemon did for the session, one durable record per model call attempt and tool run, success
            or failure: `{n, action, kind, started, duration_ms, outcome, error?, attempt?, model?, input_tokens?,
            output_tokens?, cached_tokens?, estimated?, name?}`.""",
        ),
        _spec(
            "session/title",
            TitleParams,
            Empty,
            "set_title",
            """Set what the session is called (shown by `session/list` and `session/info` as `title`); durable before
            it answers. A session of an agent is titled with its first prompt, cut to 60 characters, until set.""",
        ),
        _spec(
            "session/effects",
            EffectsParams,
            EffectsResult,
            "effects",
            """Every effect the daemon ran for the session (commands, git calls and writes), from turn `since` on, in
            order, and every rewind: `{turn, action, kind, subject, at, outcome, undoable}`.""",
        ),
        _spec(
            "session/rewind",
            RewindParams,
            RewindResult,
            "rewind",
            """Put back every file the session's Writes changed since turn `turn` began, newest first, and move the
            conversation back to before that turn; the conversation as it was is kept as a fork (`kept_as`).
            Commands and git calls are not undone: they are named in `not_undone`. CONFLICT, with nothing done, when
            a file was changed since by someone else (each is named); `force: true` puts every file back regardless.
            Journalled before it starts: a rewind a stopped daemon left unfinished is finished at its next start.""",
        ),
        _spec(
            "session/spawn",
            SpawnParams,
            SpawnResult,
            "spawn",
            """Start a delegated run: a child session of `parent` running `agent` (one of the parent's agent's
            `delegates`) on `task`, linked durably to its parent before it asks the model and held to the parent's
            policy, limits and budget, as a `delegate` call's child is. Idempotent by `id`: the same id answers the
            same child and starts nothing. INVALID_PARAMS naming the rule for a parent that does not exist or a run
            that would widen anything.""",
        ),
        _spec(
            "session/wait",
            WaitParams,
            WaitResult,
            "wait",
            """Wait for turn `turn` of the session to end: `{done: true, outcome}` (at once when it has ended
            already: a waiter cannot miss the end), or `{done: false}` when `timeout_ms` passes first. For a child
            session, `outcome` is its terminal state, with its final answer or why it did not complete.""",
        ),
    ]
}
