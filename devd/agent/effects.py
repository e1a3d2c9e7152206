"""The effect ledger: every effect the daemon ran for a session (a command, a git call, a write), durable in the
session's record log, and what a Write replaced, so that `session/rewind` (`devd.agent.rewind`) can put it back.

What it promises:
- Before a Write starts, its claim (`devd.agent.records.Claim`) records the file's previous state (`Before`): that
  there was none, or its content: inline when at most INLINE_BYTES_MAX, else by digest with the content in a record
  of its own (kind `content`, written before the claim), as long as the session's kept content stays within
  CONTENT_BYTES_MAX and the file within FILE_BYTES_MAX. A file past either bound is recorded by size alone, and its
  write is not undoable; so is one whose previous state could not be read (a directory in the way, say).
- Once an effect has its outcome, and before its result is stepped, an `effect` record says what ran: its turn,
  action, kind, subject (a command's argv, a write's path), when it started, its outcome, and for a Write its
  `Before` (the content inline, as in the claim, which goes once the result is stepped) and the digest of what it
  wrote. An effect found
  claimed without its result after a restart is recorded `interrupted` (it may have partly run).
- `ledger` answers them in order, with the session's rewinds (`devd.agent.rewind`) among them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import msgspec

from devd.agent import records
from devd.agent.records import Before
from devd.protocol import Effect, Outcome
from devd.storage.store import Record

if TYPE_CHECKING:
    from devd.agent import tools
    from devd.agent.port import Sessions
    from devd.agent.runner import Runtime

EFFECT = "effect"  # the record kinds
CONTENT = "content"
INLINE_BYTES_MAX = 4096  # a previous content this small is kept in the claim and the effect record themselves
FILE_BYTES_MAX = 16 << 20  # a file larger than this is not kept: writing over it cannot be undone
CONTENT_BYTES_MAX = 64 << 20  # of previous contents kept per session; past it, a write cannot be undone


class Content(msgspec.Struct, frozen=True):
    """A previous content kept apart from its claim (kind `content`, the Write's action)."""

    digest: str
    data: bytes


class EffectRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """An effect that ran (kind `effect`, the action's id): see the module's docstring."""

    turn: int
    kind: str
    subject: str | list[str]
    at: float
    outcome: Outcome
    before: Before | None = None
    wrote: str | None = None  # a Write's new content's digest (hex SHA-256)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def named(kind: str, call: Any) -> str:
    """The effect's kind as the ledger names it: its tool kind, or a named (MCP) tool's own name."""
    return str(call.name) if kind == "Tool" else kind


def subject(kind: str, call: Any) -> str | list[str]:
    """What the ledger names the effect by: a command's argv, a path, or a named tool's input (its JSON)."""
    if kind == "Tool":
        return bytes(call.input).decode()
    argv = getattr(call, "argv", None)
    if argv is not None:
        return list(argv)
    path: str | None = getattr(call, "path", None)
    return path if path is not None else kind


class Ledger:
    """Writes the ledger's records for the runner (`devd.agent.runner.Driver`), and keeps, per session, how much
    previous content it keeps (read from its effect records once a daemon's life)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self._kept: dict[str, int] = {}

    async def before(
        self, session: str, action: int, workspace: Callable[[], Awaitable[tools.Workspace]], path: str
    ) -> Before:
        """The previous state of the file a Write is about to replace, its content kept as the module says (a
        `content` record written, durably, when it is kept apart)."""
        from devd.agent import tools

        try:
            found = await anyio.to_thread.run_sync(tools.find, await workspace(), path, FILE_BYTES_MAX)
        except (tools.Refused, OSError) as e:
            why = e.why if isinstance(e, tools.Refused) else (e.strerror or str(e))
            return Before(path, True, why=f"what was there could not be read: {why}")
        if session not in self._kept:
            self._kept[session] = await self._kept_now(session)
        before = before_of(found.target, found.existed, found.data, found.size, CONTENT_BYTES_MAX - self._kept[session])
        if before.stored and found.data is not None:
            seq = self.sessions.seq(session) or 0
            await self.sessions.add_record(content_record(session, seq, action, before, found.data))
        if before.kept:
            self._kept[session] += before.size
        return before

    async def _kept_now(self, session: str) -> int:
        found = await self.sessions.records(session, (EFFECT,))
        befores = [records.decode(r.body, EffectRecord).before for r in found]
        return sum(b.size for b in befores if b is not None and b.kept)

    def entry(
        self,
        session: str,
        action: int,
        turn: int,
        kind: str,
        call: Any,
        started: float,
        outcome: Outcome,
        before: Before | None,
    ) -> Record:
        """The effect's ledger record, for the caller to keep durably (beside its trace record, before its result is
        stepped)."""
        text: str | None = getattr(call, "text", None)
        wrote = digest(text.encode("utf-8", "surrogatepass")) if text is not None and before is not None else None
        entry = EffectRecord(turn, named(kind, call), subject(kind, call), started, outcome, before, wrote)
        return Record(session, self.sessions.seq(session) or 0, EFFECT, action, records.encode(entry))

    async def claimed(self, session: str, action: int) -> Before | None:
        """The previous state the action's claim recorded (a Write found claimed after a restart)."""
        found = await self.sessions.records(session, (records.CLAIM,))
        claims = [records.decode(r.body, records.Claim) for r in found if r.action == action]
        return claims[-1].before if claims else None

    def forget(self, session: str) -> None:
        self._kept.pop(session, None)


def before_of(target: str, existed: bool, data: bytes | None, size: int, room_bytes: int) -> Before:
    """A Write's previous state from what was found (`devd.agent.tools.find`), given the room left in the session's
    bound for kept content."""
    if not existed:
        return Before(target, False)
    if data is None:
        why = f"it is larger than {FILE_BYTES_MAX} bytes, which a rewind does not keep"
        return Before(target, True, size, why=why)
    if len(data) > room_bytes:
        why = f"the session keeps {CONTENT_BYTES_MAX} bytes of what its writes replaced, and that is used up"
        return Before(target, True, len(data), digest(data), why=why)
    inline = data if len(data) <= INLINE_BYTES_MAX else None
    return Before(target, True, len(data), digest(data), content=inline, stored=inline is None)


def content_record(session: str, seq: int, action: int, before: Before, data: bytes) -> Record:
    assert before.digest is not None
    return Record(session, seq, CONTENT, action, records.encode(Content(before.digest, data)))


async def contents(sessions: Sessions, session: str, actions: Sequence[int]) -> dict[int, bytes]:
    """The previous contents kept apart for these Writes, by action."""
    wanted = set(actions)
    if not wanted:
        return {}
    found = await sessions.records(session, (CONTENT,))
    return {r.action: records.decode(r.body, Content).data for r in found if r.action in wanted}


async def ledger(runtime: Runtime, session: str, since: int) -> list[Effect]:
    """The session's effects and rewinds from turn `since` on, in the order they were recorded. An effect a rewind
    undid (recorded before it, of its turn or later) is no longer undoable."""
    from devd.agent import rewind, trace

    found = await runtime.sessions.records(session, (EFFECT, rewind.REWIND, rewind.REWOUND))
    done = {records.decode(r.body, rewind.Rewound).started for r in found if r.kind == rewind.REWOUND}
    listed: list[Effect] = []
    for r in found:
        at = trace.rfc3339(r.at)
        if r.kind == EFFECT:
            e = records.decode(r.body, EffectRecord)
            undoable = e.before is not None and e.before.kept and e.outcome != "error"
            listed.append(Effect(e.turn, r.action, e.kind, e.subject, trace.rfc3339(e.at), e.outcome, undoable))
        elif r.kind == rewind.REWOUND:
            w = records.decode(r.body, rewind.Rewound)
            listed = [_undone(e, w.turn) for e in listed]
            listed.append(Effect(w.turn, 0, "Rewind", [*w.restored, *w.removed], at, "ok", False))
        elif r.n not in done:  # a plan journalled and not finished: the next start (or rewind) finishes it
            plan = records.decode(r.body, rewind.Plan)
            if plan.session == session:
                paths = [p.target for p in plan.files]
                listed.append(Effect(plan.turn, 0, "Rewind", paths, at, "interrupted", False))
    return [e for e in listed if e.turn >= since]


def _undone(effect: Effect, turn: int) -> Effect:
    if effect.turn < turn or not effect.undoable:
        return effect
    return msgspec.structs.replace(effect, undoable=False)
