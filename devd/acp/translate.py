"""The daemon's notices of one session as ACP `session/update`s: pure, no I/O, one `SessionView` per session.

The daemon says what happened (`session/actions` for each step, `session/delta` while the model writes,
`session/approval` and `session/decided` for approvals); this says it as an editor shows it:

- a turn's prompt is a `user_message_chunk` (not for the prompts this editor sent itself: it shows those already);
- the model's text is `agent_message_chunk`s, from the deltas as they stream, else from the reply in the step that
  answers the model (only what the deltas did not already say, so a reply streamed in part before a reconnect is
  finished, not repeated; the core emits a reply's text only when it has no calls, so the reply is the source);
- the model's reasoning streamed beside its answer, and a summary it writes as the conversation is compacted, are
  `agent_thought_chunk`s (deltas of kind "reasoning" and "summary"), never the answer's text;
- each call the core dispatches is a `tool_call` (`pending`, its kind, a title, absolute `locations` for files),
  its title shown safely (devd.render: a command's words as a shell takes them, a control or bidi character in a
  path or URL escaped: editors show titles in a terminal-like panel), its raw input as the model gave it;
  then `tool_call_update`s: `in_progress` once it runs (at once for reads and fetches, which are never asked
  about; after an approval, or with its result, for the others), and `completed` or `failed` with its output (and
  a diff for a write);
- a turn's `Done` ends it (`end_turn` or `cancelled`); a cancelled turn's calls still open are marked `failed`.

`collapse` folds a replayed history into the shape `session/load` sends: each tool call once, with its final state.
The view keeps only what it derives from the notices (the last step seen, the calls and turns still open).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from devd.acp.wire import (
    AgentMessageChunk,
    AgentThoughtChunk,
    ContentItem,
    DiffItem,
    Location,
    PermissionToolCall,
    TextBlock,
    ToolCall,
    ToolCallUpdate,
    ToolContent,
    ToolKind,
    ToolStatus,
    Update,
    UserMessageChunk,
)
from devd.agent import kinds
from devd.client import ActionsNotice
from devd.deltas import Stream
from devd.messages import Call as CoreCall
from devd.messages import Message, Op, Output
from devd.render import inline

StopReason = Literal["end_turn", "cancelled"]


# -- the daemon's notices beside session/actions ----------------------------------------------------------------------


class DeltaNotice(msgspec.Struct, frozen=True):
    """`session/delta`: text the model wrote for the `Model` action `action`, not journalled; `kind` "reasoning" (its
    reasoning beside the answer) or "summary" (a summary compacting the conversation) is no part of the answer."""

    session: str
    action: int
    text: str
    kind: str = "text"


class ApprovalNotice(msgspec.Struct, frozen=True):
    """`session/approval`: the action `action` (its `op`) waits for a decision; `digest` names it exactly."""

    session: str
    action: int
    op: Op
    digest: str


class DecidedNotice(msgspec.Struct, frozen=True):
    """`session/decided`: how the approval of `action` was decided (`allow`, `deny`, `cancelled`), and by whom."""

    session: str
    action: int
    decision: str
    by: str = "unknown"


class StalledNotice(msgspec.Struct, frozen=True):
    """`session/stalled`: the session cannot go on until it is resumed, and why."""

    session: str
    why: str
    action: int | None = None


class InputNotice(msgspec.Struct, frozen=True):
    """`session/input`: question `request` of the call `action`, from its MCP server: a message, and the JSON Schema
    of the object it asks for."""

    session: str
    action: int
    request: int
    message: str
    schema: dict[str, Any]


class AnsweredNotice(msgspec.Struct, frozen=True):
    """`session/answered`: question `request` of `action` was decided (by an answer anywhere, or withdrawn)."""

    session: str
    action: int
    request: int
    decision: str
    by: str = "unknown"


Notice = ActionsNotice | DeltaNotice | ApprovalNotice | DecidedNotice | StalledNotice | InputNotice | AnsweredNotice

NOTICE_TYPES: dict[str, type[Any]] = {
    "session/actions": ActionsNotice,
    "session/delta": DeltaNotice,
    "session/approval": ApprovalNotice,
    "session/decided": DecidedNotice,
    "session/stalled": StalledNotice,
    "session/input": InputNotice,
    "session/answered": AnsweredNotice,
}


def notice(method: str, params: Any) -> Notice | None:
    """A daemon notification as its typed notice; None for one this layer has nothing to say about."""
    kind = NOTICE_TYPES.get(method)
    if kind is None:
        return None
    # Through JSON, not convert: a Tool call's input is msgspec.Raw, which convert does not make from a dict.
    converted: Notice = msgspec.json.decode(msgspec.json.encode(params), type=kind)
    return converted


# -- calls ---------------------------------------------------------------------------------------------------------


def tool_call_id(action: int) -> str:
    """The ACP id of the call dispatched as `action`: the id the model sees it under, too."""
    return f"call_{action}"


@dataclass
class Call:
    """A dispatched call as the editor sees it."""

    action: int
    kind: ToolKind
    title: str
    locations: list[Location] | None
    raw_input: dict[str, Any]
    new_text: str | None = None  # a write's text, for its diff
    status: ToolStatus = "pending"
    asked: bool = False  # reads and fetches are never asked about: they run as soon as they are dispatched

    def start(self) -> ToolCall:
        return ToolCall(
            tool_call_id(self.action),
            self.title,
            kind=self.kind,
            status="pending",
            locations=self.locations,
            raw_input=self.raw_input,
        )


def call_of(action: int, op: Op, workspace: str | None) -> Call | None:
    """The call an action dispatches, or None when the action is not a call (Model, Emit, Save, Done)."""

    def where(path: str) -> list[Location]:
        full = os.path.normpath(os.path.join(workspace, path)) if workspace else path
        return [Location(full)]

    found = kinds.of(op)
    if found is None:
        return None
    shown = found[0].shown(found[1])
    locations = None if shown.path is None else where(shown.path)
    return Call(action, shown.kind, shown.title, locations, shown.raw_input, new_text=shown.new_text, asked=shown.asked)


def _text(text: str) -> list[ToolContent]:
    return [ContentItem(TextBlock(text))]


def _result_content(call: Call, output: Output) -> list[ToolContent]:
    if call.new_text is not None and not output.failed and call.locations:
        return [DiffItem(call.locations[0].path, call.new_text), *(_text(output.text) if output.text else [])]
    return _text(output.text)


def _output(event: Any) -> Output | None:
    return kinds.result_of(event)


# -- one session ---------------------------------------------------------------------------------------------------


@dataclass
class SessionView:
    """What the editor has been told of one session, derived from its notices in order."""

    session: str
    workspace: str | None = None
    last_seq: int = 0  # the last step seen: a watch after a reconnect goes on from here
    calls: dict[int, Call] = field(default_factory=dict)  # calls not yet finished, by action id
    said: dict[int, Stream] = field(default_factory=dict)  # per Model action: the text the editor was sent
    own_prompts: list[str] = field(default_factory=list)  # prompts this editor sent, not yet seen as a Turn
    running: set[int] = field(default_factory=set)  # turns begun and not done
    outcomes: dict[int, StopReason] = field(default_factory=dict)  # turns done, and how

    def expect_prompt(self, text: str) -> None:
        """This editor sent `text` as a prompt: its Turn is not echoed back to it."""
        self.own_prompts.append(text)

    def take(self, n: Notice) -> list[Update]:
        """The updates a notice means for the editor (StalledNotice: none; the bridge answers the prompt)."""
        if isinstance(n, ActionsNotice):
            return self._step(n)
        if isinstance(n, DeltaNotice):
            return self._delta(n)
        if isinstance(n, DecidedNotice):
            return self._decided(n)
        if isinstance(n, ApprovalNotice):
            return self._approval(n)
        return []

    def reconnected(self) -> None:
        """The connection was lost: a model answer streamed again starts from its beginning."""
        for stream in self.said.values():
            stream.again()

    def permission_call(self, n: ApprovalNotice) -> PermissionToolCall:
        """The tool call of a permission request (as ACP's request has it: the fields, no `sessionUpdate`)."""
        call = self.calls.get(n.action) or call_of(n.action, n.op, self.workspace)
        if call is None:
            return PermissionToolCall(tool_call_id(n.action), title="an action", kind="other", status="pending")
        return PermissionToolCall(
            tool_call_id(call.action),
            status="pending",
            title=call.title,
            kind=call.kind,
            locations=call.locations,
            raw_input=call.raw_input,
        )

    def permission_call_of(self, action: int) -> PermissionToolCall:
        """The tool call `action` as a permission request names it (a call this view has not seen: by its id)."""
        call = self.calls.get(action)
        if call is None:
            return PermissionToolCall(tool_call_id(action), title="a tool call", kind="other", status="pending")
        return PermissionToolCall(
            tool_call_id(action),
            status="pending",
            title=call.title,
            kind=call.kind,
            locations=call.locations,
            raw_input=call.raw_input,
        )

    # -- the notices

    def _step(self, n: ActionsNotice) -> list[Update]:
        if n.seq <= self.last_seq:
            return []  # seen already (a watch after a reconnect may begin with it)
        self.last_seq = n.seq
        updates: list[Update] = []
        event = n.event
        if event.Turn is not None:
            self.running.add(event.Turn.id)
            if event.Turn.prompt in self.own_prompts:
                self.own_prompts.remove(event.Turn.prompt)
            else:
                updates.append(UserMessageChunk(TextBlock(event.Turn.prompt)))
        output = _output(event)
        if output is not None:
            updates += self._finished(output)
        answered = event.Model.id if event.Model is not None else None
        if event.Model is not None and event.Model.reply.text:
            # The reply's text (the core emits it only when there are no calls: text beside calls is in the reply).
            updates += self._emit(event.Model.reply.text, answered)
        for action in n.actions:
            updates += self._action(action.id, action.op, answered)
        return updates

    def _action(self, action: int, op: Op, answered: int | None) -> list[Update]:
        if op.Emit is not None:  # a model's answer was said from its reply, above
            return [] if answered is not None else self._emit(op.Emit, None)
        if op.Done is not None:
            return self._done(op.Done.turn, op.Done.outcome.Cancelled is not None)
        call = call_of(action, op, self.workspace)
        if call is None:
            return []
        self.calls[action] = call
        updates: list[Update] = [call.start()]
        if not call.asked:
            updates.append(self._status(call, "in_progress"))
        return updates

    def _emit(self, text: str, answered: int | None) -> list[Update]:
        stream = self.said.pop(answered, None) if answered is not None else None
        said = stream.text() if stream is not None else ""
        rest = text[len(said) :] if text.startswith(said) else text
        return [AgentMessageChunk(TextBlock(rest))] if rest else []

    def _delta(self, n: DeltaNotice) -> list[Update]:
        if n.kind != "text":  # the model's reasoning, or a summary it writes: a thought, never the answer's text
            return [AgentThoughtChunk(TextBlock(n.text))] if n.text else []
        # Streamed anew after a reconnect, only what goes past what was said is said (else it differs: as it comes).
        fresh = self.said.setdefault(n.action, Stream()).add(n.text)
        return [AgentMessageChunk(TextBlock(fresh))] if fresh else []

    def _finished(self, output: Output) -> list[Update]:
        call = self.calls.pop(output.id, None)
        if call is None:
            return []
        updates: list[Update] = []
        if call.status == "pending":
            updates.append(self._status(call, "in_progress"))
        call.status = "failed" if output.failed else "completed"
        updates.append(
            ToolCallUpdate(tool_call_id(call.action), status=call.status, content=_result_content(call, output))
        )
        return updates

    def _done(self, turn: int, cancelled: bool) -> list[Update]:
        self.running.discard(turn)
        self.outcomes[turn] = "cancelled" if cancelled else "end_turn"
        if not cancelled:
            return []
        open_calls, self.calls = list(self.calls.values()), {}
        return [
            ToolCallUpdate(tool_call_id(c.action), status="failed", content=_text("cancelled with its turn"))
            for c in open_calls
        ]

    def _approval(self, n: ApprovalNotice) -> list[Update]:
        if n.action in self.calls:
            return []
        call = call_of(n.action, n.op, self.workspace)  # attached without its history: announce the call first
        if call is None:
            return []
        self.calls[n.action] = call
        return [call.start()]

    def _decided(self, n: DecidedNotice) -> list[Update]:
        call = self.calls.get(n.action)
        if call is None:
            return []
        if n.decision == "allow":
            return [self._status(call, "in_progress")] if call.status == "pending" else []
        if n.decision == "deny":
            return [ToolCallUpdate(tool_call_id(call.action), content=_text(f"denied by {inline(n.by)}"))]
        return []

    @staticmethod
    def _status(call: Call, status: ToolStatus) -> ToolCallUpdate:
        call.status = status
        return ToolCallUpdate(tool_call_id(call.action), status=status)


def collapse(updates: list[Update]) -> list[Update]:
    """A replayed history as `session/load` sends it: each tool call once, with its last status and content, where
    it first appeared; the message chunks as they were."""
    out: list[Update] = []
    where: dict[str, int] = {}
    for update in updates:
        if isinstance(update, ToolCall):
            where[update.tool_call_id] = len(out)
            out.append(update)
        elif isinstance(update, ToolCallUpdate) and update.tool_call_id in where:
            i = where[update.tool_call_id]
            start = out[i]
            assert isinstance(start, ToolCall)
            out[i] = msgspec.structs.replace(
                start,
                status=update.status or start.status,
                content=update.content if update.content is not None else start.content,
            )
        else:
            out.append(update)
    return out


def replay(session: str, workspace: str | None, history: list[ActionsNotice]) -> tuple[SessionView, list[Update]]:
    """The updates that tell a session's whole history, collapsed, and the view that goes on from its last step."""
    view = SessionView(session, workspace)
    updates: list[Update] = []
    for n in history:
        updates += view.take(n)
    return view, collapse(updates)


def _op(call: CoreCall) -> Op:
    found = kinds.of(call)
    assert found is not None, "a Call has a member"  # Call's own check
    kind, member = found
    return Op(**{kind.member: member})


def transcript_updates(messages: Any, workspace: str | None) -> list[Update]:
    """A conversation (`session/transcript`'s messages) as `session/load` sends it, for a session whose oldest steps
    the journal no longer keeps: prompts, the model's text, and each call with its result."""
    conversation = msgspec.json.decode(msgspec.json.encode(messages), type=list[Message])  # Raw inputs: see notice
    results = {m.Tool.id: m.Tool for m in conversation if m.Tool is not None}
    updates: list[Update] = []
    for m in conversation:
        if m.User is not None:
            updates.append(UserMessageChunk(TextBlock(m.User)))
        elif m.Summary is not None:  # what the start of the conversation came to, once summarised
            updates.append(AgentMessageChunk(TextBlock(m.Summary.text)))
        elif m.Agent is not None:
            if m.Agent.text:
                updates.append(AgentMessageChunk(TextBlock(m.Agent.text)))
            for dispatch in m.Agent.calls or []:
                call = call_of(dispatch.id, _op(dispatch.call), workspace)
                if call is None:
                    continue
                start = call.start()
                result = results.get(dispatch.id)
                if result is not None:
                    output = Output(id=result.id, text=result.text, failed=result.failed)
                    status: ToolStatus = "failed" if result.failed else "completed"
                    start = msgspec.structs.replace(start, status=status, content=_result_content(call, output))
                updates.append(start)
    return updates
