"""ACP's wire, without I/O: JSON-RPC 2.0 frames as newline-delimited JSON, and the messages `devd acp` reads and
writes, as msgspec Structs named and shaped as the Agent Client Protocol v1 schema names them.

What it promises: `decode` turns one line from the editor into a `Request`, a `Notification` or a `Response`, or
raises the `devd.errors` error to answer it with (ParseError, InvalidRequestError); `params` decodes a request's
params into its Struct or raises InvalidParamsError saying which member is wrong; the line builders write exactly
one JSON object and a newline. Fields the editor sends that are not read here (`_meta`, capabilities we do not use)
are ignored, never refused: editors send more than the schema's minimum.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Raw, UnsetType

from devd.errors import DevdError, InvalidParamsError, InvalidRequestError, ParseError

PROTOCOL_VERSION = 1
REQUEST_CANCELLED = -32800  # ACP's code for a request withdrawn by `$/cancel_request` or by its sender

Id = int | str

# -- frames ---------------------------------------------------------------------------------------------------------


class _Frame(msgspec.Struct):
    """Any JSON-RPC message, each member still undecoded."""

    jsonrpc: str | UnsetType = UNSET
    id: Id | None | UnsetType = UNSET
    method: str | UnsetType = UNSET
    params: Raw | UnsetType = UNSET
    result: Raw | UnsetType = UNSET
    error: dict[str, Any] | UnsetType = UNSET


class Request(msgspec.Struct, frozen=True):
    id: Id
    method: str
    params: Raw


class Notification(msgspec.Struct, frozen=True):
    method: str
    params: Raw


class Response(msgspec.Struct, frozen=True):
    """The editor's answer to a request of ours: `result`, or `error` (`{code, message, data?}`)."""

    id: Id
    result: Raw | None
    error: dict[str, Any] | None


Incoming = Request | Notification | Response

_frame = msgspec.json.Decoder(_Frame)
_encoder = msgspec.json.Encoder()
_EMPTY = Raw(b"{}")


def decode(line: bytes) -> Incoming:
    """One line from the editor. ParseError when it is not JSON, InvalidRequestError when it is not JSON-RPC."""
    try:
        frame = _frame.decode(line)
    except msgspec.DecodeError as e:
        raise ParseError(f"the line is not JSON ({e}); send one JSON-RPC message per line") from None
    except msgspec.ValidationError as e:
        raise InvalidRequestError(f"the line is not a JSON-RPC 2.0 message ({e})") from None
    if frame.jsonrpc != "2.0":
        raise InvalidRequestError('a JSON-RPC message needs "jsonrpc": "2.0"')
    params = _EMPTY if isinstance(frame.params, UnsetType) else frame.params
    if not isinstance(frame.method, UnsetType):
        if isinstance(frame.id, UnsetType):
            return Notification(frame.method, params)
        if frame.id is None:
            raise InvalidRequestError("a request's id must be a number or a string, not null")
        return Request(frame.id, frame.method, params)
    if isinstance(frame.id, UnsetType) or frame.id is None:
        raise InvalidRequestError("a message with no method must be an answer, with the id of our request")
    error = None if isinstance(frame.error, UnsetType) else frame.error
    result = None if isinstance(frame.result, UnsetType) else frame.result
    return Response(frame.id, result, error)


P = TypeVar("P")


def params(raw: Raw, kind: type[P], method: str) -> P:
    """A request's params as their Struct; InvalidParamsError naming what is wrong."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise InvalidParamsError(f"{method}: {e}") from None


def request_line(id: Id, method: str, params: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "id": id, "method": method, "params": params}) + b"\n"


def notification_line(method: str, params: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "method": method, "params": params}) + b"\n"


def result_line(id: Id | None, result: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "id": id, "result": result}) + b"\n"


def error_line(id: Id | None, error: DevdError) -> bytes:
    """The error as JSON-RPC: its code, its message, and devd's kind in `data` for programs."""
    body = {"code": error.code, "message": str(error), "data": {"kind": error.kind}}
    return _encoder.encode({"jsonrpc": "2.0", "id": id, "error": body}) + b"\n"


# -- what the editor sends ------------------------------------------------------------------------------------------


class _In(msgspec.Struct, frozen=True, rename="camel"):
    """Params from the editor: ACP's camelCase names; members we do not read are ignored."""


class Implementation(_In, frozen=True):
    name: str
    version: str | None = None
    title: str | None = None


class InitializeParams(_In, frozen=True):
    # Some editors have sent a date string here; any value is answered with the version we speak.
    protocol_version: int | str = PROTOCOL_VERSION
    client_capabilities: dict[str, Any] | None = None
    client_info: Implementation | None = None


class NewSessionParams(_In, frozen=True):
    cwd: str
    mcp_servers: list[dict[str, Any]] = msgspec.field(default_factory=list)


class LoadSessionParams(_In, frozen=True):
    """`session/load` and `session/resume`."""

    session_id: str
    cwd: str | None = None
    mcp_servers: list[dict[str, Any]] = msgspec.field(default_factory=list)


class PromptParams(_In, frozen=True):
    session_id: str
    prompt: list[dict[str, Any]]


class SessionIdParams(_In, frozen=True):
    """`session/cancel` and `session/close`."""

    session_id: str


class ListSessionsParams(_In, frozen=True):
    cwd: str | None = None
    cursor: str | None = None


class PermissionOutcome(_In, frozen=True):
    outcome: Literal["selected", "cancelled"]
    option_id: str | None = None


class PermissionResult(_In, frozen=True):
    outcome: PermissionOutcome


def prompt_text(blocks: list[dict[str, Any]]) -> str:
    """The prompt's text, as the turn's prompt: its text blocks, links (as their URI) and embedded text resources,
    in order, a blank line apart. Other blocks (images, audio) are not offered by `initialize`, and are skipped."""
    parts: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "resource_link" and isinstance(block.get("uri"), str):
            parts.append(f"@{block['uri']}")
        elif kind == "resource" and isinstance(resource := block.get("resource"), dict):
            if isinstance(resource.get("text"), str):
                parts.append(f"@{resource.get('uri', '')}\n{resource['text']}")
    return "\n\n".join(parts)


# -- what devd acp sends --------------------------------------------------------------------------------------------


class _Out(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    """What we send: ACP's camelCase names, absent members omitted (never null)."""


class TextBlock(_Out, frozen=True, tag_field="type", tag="text"):
    text: str


class ContentItem(_Out, frozen=True, tag_field="type", tag="content"):
    """Tool call content: a content block."""

    content: TextBlock


class DiffItem(_Out, frozen=True, tag_field="type", tag="diff"):
    """Tool call content: a file's new text (`old_text` omitted when it is not known)."""

    path: str
    new_text: str
    old_text: str | None = None


ToolContent = ContentItem | DiffItem
ToolKind = Literal["read", "edit", "delete", "move", "search", "execute", "think", "fetch", "other"]
ToolStatus = Literal["pending", "in_progress", "completed", "failed"]


class Location(_Out, frozen=True):
    path: str
    line: int | None = None


class UserMessageChunk(_Out, frozen=True, tag_field="sessionUpdate", tag="user_message_chunk"):
    content: TextBlock


class AgentMessageChunk(_Out, frozen=True, tag_field="sessionUpdate", tag="agent_message_chunk"):
    content: TextBlock


class AgentThoughtChunk(_Out, frozen=True, tag_field="sessionUpdate", tag="agent_thought_chunk"):
    content: TextBlock


class ToolCall(_Out, frozen=True, tag_field="sessionUpdate", tag="tool_call"):
    tool_call_id: str
    title: str
    kind: ToolKind  # no defaults: always sent, though ACP has defaults for them
    status: ToolStatus
    content: list[ToolContent] | None = None
    locations: list[Location] | None = None
    raw_input: dict[str, Any] | None = None


class ToolCallUpdate(_Out, frozen=True, tag_field="sessionUpdate", tag="tool_call_update"):
    tool_call_id: str
    status: ToolStatus | None = None
    title: str | None = None
    kind: ToolKind | None = None
    content: list[ToolContent] | None = None
    locations: list[Location] | None = None
    raw_input: dict[str, Any] | None = None


class PermissionToolCall(_Out, frozen=True):
    """The tool call a permission request is about (ACP's ToolCallUpdate, outside a `session/update`)."""

    tool_call_id: str
    status: ToolStatus | None = None
    title: str | None = None
    kind: ToolKind | None = None
    locations: list[Location] | None = None
    raw_input: dict[str, Any] | None = None


class CommandInput(_Out, frozen=True):
    """What a slash command takes after its name, as the editor's hint shows it."""

    hint: str


class AvailableCommand(_Out, frozen=True):
    name: str
    description: str
    input: CommandInput | None = None


class AvailableCommandsUpdate(_Out, frozen=True, tag_field="sessionUpdate", tag="available_commands_update"):
    """The slash commands the editor may offer (devd.acp.commands)."""

    available_commands: list[AvailableCommand]


class UsageUpdate(_Out, frozen=True, tag_field="sessionUpdate", tag="usage_update"):
    """After a model call: the tokens now in the conversation (its request and reply), and the model's window (0:
    devd does not know it: no `context_tokens` and not a model it knows)."""

    used: int
    size: int


SubagentState = Literal["running", "completed", "failed", "cancelled", "disconnected"]


class SubagentCapabilities(_Out, frozen=True):
    """What the editor may do with a subagent session: `cancel` it (`session/cancel` with its id)."""

    cancel: bool | None = None


class SubagentUpdate(_Out, frozen=True, tag_field="sessionUpdate", tag="subagent_update"):
    """ACP subagents (stable 2026-11-20): a child session of the session this update is sent on, announced (`running`,
    with its name, task and capabilities) before any update of its own, then its one terminal state."""

    subagent_session_id: str
    name: str | None = None
    task: str | None = None
    capabilities: SubagentCapabilities | None = None
    state: SubagentState | None = None


Update = (
    UserMessageChunk
    | AgentMessageChunk
    | AgentThoughtChunk
    | ToolCall
    | ToolCallUpdate
    | AvailableCommandsUpdate
    | UsageUpdate
    | SubagentUpdate
)


class PermissionOption(_Out, frozen=True):
    option_id: str
    name: str
    kind: Literal["allow_once", "allow_always", "reject_once", "reject_always"]


PERMISSION_OPTIONS = [
    PermissionOption("allow_once", "Allow once", "allow_once"),
    PermissionOption("allow_always", "Always allow", "allow_always"),
    PermissionOption("reject_once", "Reject", "reject_once"),
    PermissionOption("reject_always", "Always reject", "reject_always"),
]


# A yes-or-no MCP question asked as a permission request, for an editor that has no form (elicitation) to show.
QUESTION_OPTIONS = [
    PermissionOption("accept", "Yes", "allow_once"),
    PermissionOption("decline", "No", "reject_once"),
]


def session_update(session: str, update: Update) -> dict[str, Any]:
    """The params of a `session/update` notification."""
    return {"sessionId": session, "update": update}


def to_builtins(value: Any) -> Any:
    """A Struct (or anything msgspec encodes) as plain JSON values."""
    return msgspec.to_builtins(value)
