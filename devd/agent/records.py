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

Issue 18's approvals, usage and traces are meant to be kinds of their own in the same log.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

AGENT = "agent"
TURN = "turn"
CLAIM = "claim"
INSERTED = "inserted"
MODEL = "model"
REASONING = "reasoning"


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


T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def encode(body: msgspec.Struct) -> bytes:
    return _encoder.encode(body)


def decode(body: bytes, kind: type[T]) -> T:
    return msgspec.json.decode(body, type=kind)
