"""What the agent runtime keeps in memory of each session it knows, as one record per session (`Known`) in one
table (`Table`): its binding, turns, model, driver, stall, its oversight (approvals, budget, trace count, who
stepped its last Cancel) and its MCP servers' questions. Forgetting a session (closed, expired, moved away, or made
again under its name) is one removal: nothing of it is left in another map.

A record is made when the runtime first needs one (a prompt, a driver, an approval, a budget); code that runs after
a session may have been forgotten (a driver stopping, a write that answered after a close) holds its record, or
looks with `find`, so that it never makes one again for a session that is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from devd.agent.approvals import Ledger
from devd.agent.records import Binding, ParentLink

if TYPE_CHECKING:
    from devd.agent.runner import Driver


class Overseen(msgspec.Struct):
    """A session's approvals and budget, read from its record log the first time they are needed."""

    ledger: Ledger = msgspec.field(default_factory=Ledger)
    budget: int | None = None
    lock: anyio.Lock = msgspec.field(default_factory=anyio.Lock)
    decided: dict[int, anyio.Event] = msgspec.field(default_factory=dict)  # a waiter for each pending approval


class Questioned(msgspec.Struct):
    """A session's questions from MCP servers (`devd.agent.questions`), read from its record log the first time they
    are needed: each by (action, request), how each decided one was, and a waiter for each open one."""

    asked: dict[tuple[int, int], Any] = msgspec.field(default_factory=dict)  # questions.Question
    answered: dict[tuple[int, int], Any] = msgspec.field(default_factory=dict)  # questions.Answered
    lock: anyio.Lock = msgspec.field(default_factory=anyio.Lock)
    waiters: dict[tuple[int, int], anyio.Event] = msgspec.field(default_factory=dict)
    sent: set[tuple[int, str]] = msgspec.field(default_factory=set)  # (action, digest of a state) sent with answers


class Known(msgspec.Struct, eq=False):
    """Everything the runtime keeps in memory of one session."""

    binding: Binding | None = None
    bound: bool = False  # `binding` was read from the record log, or set: None is then a session of no agent
    turn: int = 0  # the highest turn id known of the session
    scanned: bool = False  # its kept journal was read for turn ids (once per daemon life)
    lock: anyio.Lock = msgspec.field(default_factory=anyio.Lock)  # one prompt at a time
    driver: Driver | None = None  # the task carrying out its actions, while one does
    stalled: str | None = None  # why its driver stopped, until `resume`
    model: str | None = None  # the model `session/model` set (read with the binding)
    overseen: Overseen | None = None  # approvals and budget, once read
    loading: anyio.Event | None = None  # set once `overseen` has been read, while it is being read
    traced: int = 0  # trace records kept by this daemon: the log is trimmed every so many
    cancelling: str | None = None  # who last stepped a Cancel of it: who withdrew its turn's approvals
    link: ParentLink | None = None  # a child session's link to its parent (read with the binding)
    questioned: Questioned | None = None  # its MCP servers' questions, once read


class Table:
    """The records of the sessions the runtime knows, by name."""

    def __init__(self) -> None:
        self._known: dict[str, Known] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, session: str) -> Known:
        """The session's record, made empty if there is none."""
        known = self._known.get(session)
        if known is None:
            known = self._known[session] = Known()
        return known

    def find(self, session: str) -> Known | None:
        """The session's record, if it has one (never made here)."""
        return self._known.get(session)

    def forget(self, session: str) -> Known | None:
        """Remove the session's record (the one removal that forgets it); the record it had, if any."""
        return self._known.pop(session, None)

    def driving(self) -> int:
        """How many sessions a driver carries out now."""
        return sum(1 for known in self._known.values() if known.driver is not None)
