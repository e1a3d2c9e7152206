"""What the agent runtime keeps in a session's record log (`devd.storage.store.Record`), and the notices it sends
watchers.

Kinds, each a msgspec Struct encoded as the record's body:
- `agent` (`Binding`, action 0): the profile and workspace a session was made with, and the workspace's identity;
  a fork carries it. The last one is the session's.
- `turn` (`TurnStarted`, action 0): a turn the daemon started with `session/prompt`.
- `claim` (`Claim`, the action's id): an Exec, Write or Git is about to start. Written durably before it starts, so a
  restart that finds it without the action's result knows the effect may have happened, and never runs it again. A
  Write's says what the file was before (`Before`), for `session/rewind`.
- `model` (`ModelChosen`, action 0): the model `session/model` set for the session's next calls; the last one is the
  session's (none: the profile's `model`).
- `reasoning` (`Thought`, the Model action's id): the reasoning a model streamed with its answer, kept (with
  `send_reasoning`) to go back with that answer, message `at` of the whole conversation, in later requests.
- `inserted` (`Exchange`, the Model action's id): a reply whose tool calls the core could not take, and the failed
  results the model was answered with, sent again in every later request at the same place of the conversation.

- `child` (`ChildLink`, the delegating action's id; 0 for `session/spawn`), in the parent's log: a delegated run, its
  session's name, agent, task digest and limits; durable before the child session is made.
- `parent` (`ParentLink`, action 0), in the child's log: its parent, the delegating action, its depth, and the
  parent's effective profile it is held to; durable before the child's first model call.
- `ended` (`ChildEnded`), in both logs (the parent's under the delegating action): the child's one terminal state.
- `cascade` (`Cascade`, action 0), in the parent's log: a cancel of its descendants, journalled before it starts
  (a daemon killed mid-cascade finishes it at start), and `cascaded` once it is done.

Issue 18's approvals, usage and traces are meant to be kinds of their own in the same log.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from devd.agent.profiles import Profile

AGENT = "agent"
TURN = "turn"
CLAIM = "claim"
INSERTED = "inserted"
MODEL = "model"
REASONING = "reasoning"
CHILD = "child"
PARENT = "parent"
ENDED = "ended"
CASCADE = "cascade"
CASCADED = "cascaded"


class Binding(msgspec.Struct, frozen=True):
    """The session's agent profile (by name), its workspace (a real, absolute path), and the workspace directory's
    identity (st_dev, st_ino) when the session was made, which every tool call checks. None: a session made before
    identities were recorded; the runtime records the directory found at its first call (another `agent` record)."""

    agent: str
    workspace: str
    identity: tuple[int, int] | None = None


class TurnStarted(msgspec.Struct, frozen=True):
    """A turn `session/prompt` started."""

    turn: int


class ModelChosen(msgspec.Struct, frozen=True):
    """The model a session's calls name from now on (one of its profile's `models`)."""

    model: str


class Thought(msgspec.Struct, frozen=True):
    """The reasoning streamed with the answer that is message `at` of the whole conversation."""

    at: int
    text: str


class Before(msgspec.Struct, frozen=True, omit_defaults=True):
    """A file as a Write found it: `target` (relative to the workspace, links resolved: what the write replaced),
    whether it `existed`, its size and digest (hex SHA-256), and its content: `content` inline, or `stored` in a
    `content` record of the same action; neither, with `existed`, when it was not kept (`why` says why)."""

    target: str
    existed: bool
    size: int = 0
    digest: str | None = None
    content: bytes | None = None
    stored: bool = False
    why: str | None = None

    @property
    def kept(self) -> bool:
        return not self.existed or self.content is not None or self.stored


class Claim(msgspec.Struct, frozen=True, omit_defaults=True):
    """An effect about to start: its kind (`exec`, `write` or `git`), the turn it is part of, and for a Write the
    file's previous state (`devd.agent.effects`)."""

    op: str
    turn: int
    before: Before | None = None


class Exchange(msgspec.Struct, frozen=True):
    """Chat messages (OpenAI's wire form) inserted before message `before` of the conversation."""

    before: int
    messages: list[dict[str, Any]]


ChildState = Literal["running", "completed", "failed", "cancelled", "disconnected"]


class ChildLink(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """A delegated run, as its parent keeps it: the parent's name, the child session's name, its agent, the SHA-256
    of its task, its depth (the parent's + 1), the parent's turn it was made in, the limits it was made under, the
    spawn `id` (for `session/spawn`), the JSON Schema its answer must satisfy and the budget it was given."""

    parent: str  # the session it was made by (a fork of the parent carries the record, naming its source)
    child: str
    agent: str
    task_digest: str
    depth: int
    turn: int
    max_depth: int
    max_children: int | None = None
    max_children_per_turn: int | None = None
    budget: int | None = None
    id: str | None = None
    output_schema: dict[str, Any] | None = None


class ParentLink(msgspec.Struct, frozen=True, kw_only=True):
    """A child session's link to the session that delegated it: its name, the delegating action (0: spawned by a
    client), the child's depth, the parent's turn, and the parent's effective profile (`ceiling`) it is held to."""

    parent: str
    action: int
    depth: int
    turn: int
    ceiling: Profile


class ChildEnded(msgspec.Struct, frozen=True, omit_defaults=True):
    """A child's terminal state, and why (failed, cancelled, disconnected) or its final answer (completed)."""

    child: str
    state: ChildState
    why: str | None = None
    answer: str | None = None


class Cascade(msgspec.Struct, frozen=True, omit_defaults=True):
    """A cancel of every running descendant of the session: why, and what is done after it (the turn to cancel, or
    the session to close)."""

    why: str
    turn: int | None = None
    close: bool = False


T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def encode(body: msgspec.Struct) -> bytes:
    return _encoder.encode(body)


def decode(body: bytes, kind: type[T]) -> T:
    return msgspec.json.decode(body, type=kind)
