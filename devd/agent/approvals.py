"""Approvals: which of a session's actions wait for a person, what each was decided, by whom, and what is remembered.

Pure (no I/O, no clock): the daemon writes each change the ledger makes into the session's record log before it tells
anyone, and a ledger rebuilt from those records (`replay`) is the one that was lost. What it promises:
- a digest names one exact action and its arguments (the action id and the op, canonically encoded);
- the first valid answer decides; a later one is `ConflictError` naming who decided, a digest that does not match is
  `InvalidParamsError`, and neither changes anything;
- a decision remembered (`remember`) settles later calls of the same argv prefix (Exec, Git) or path (Write) of the
  session without asking; a profile's `deny` is never overridden by it (the ledger is asked only about `ask` calls).
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from devd.errors import ConflictError, InvalidParamsError
from devd.messages import Call, Op

Verdict = Literal["allow", "deny", "cancelled"]
Answer = Literal["allow", "deny"]

# The record kinds the ledger's changes are kept under in the session's record log.
ASKED = "approval"
DECIDED = "decided"


class Asked(msgspec.Struct, frozen=True):
    """An action that waits for a decision: its id, what it would do, and the digest an answer must name."""

    action: int
    op: Op
    digest: str


class Decided(msgspec.Struct, frozen=True, omit_defaults=True):
    """How an action was decided: `allow`, `deny` (by a client) or `cancelled` (its turn was), and by whom."""

    action: int
    decision: Verdict
    by: str
    remember: bool = False


def action_digest(action: int, op: Op) -> str:
    """The hex SHA-256 of the action's id and op as canonical JSON (members sorted): it names this exact action."""
    canonical = msgspec.json.encode({"action": action, "op": msgspec.to_builtins(op)}, order="sorted")
    return hashlib.sha256(canonical).hexdigest()


def call_of(op: Op) -> Call | None:
    """The call an op asks for (None for Model, Emit, Save, Done)."""
    if op.Exec is not None:
        return Call(Exec=op.Exec)
    if op.Write is not None:
        return Call(Write=op.Write)
    if op.Git is not None:
        return Call(Git=op.Git)
    if op.Read is not None:
        return Call(Read=op.Read)
    if op.Browse is not None:
        return Call(Browse=op.Browse)
    return None


def _subject(op: Op) -> tuple[str, tuple[str, ...]] | None:
    """What a remembered decision is about: an argv (Git's as `git ...`) or a Write's path."""
    if op.Exec is not None:
        return "argv", tuple(op.Exec.argv)
    if op.Git is not None:
        return "argv", ("git", *op.Git.argv)
    if op.Write is not None:
        return "path", (op.Write.path,)
    return None


class Ledger(msgspec.Struct):
    """One session's approvals."""

    pending: dict[int, Asked] = msgspec.field(default_factory=dict)
    decided: dict[int, Decided] = msgspec.field(default_factory=dict)
    remembered: list[tuple[str, tuple[str, ...], Answer]] = msgspec.field(
        default_factory=list
    )  # (what, prefix, decision)

    def ask(self, action: int, op: Op) -> Asked:
        """The action's approval, asked now or before (the same one, so a restart asks nothing new)."""
        if action in self.pending:
            return self.pending[action]
        asked = Asked(action, op, action_digest(action, op))
        self.pending[action] = asked
        return asked

    def answer(self, action: int, digest: str, decision: Answer, by: str, remember: bool = False) -> Decided:
        """Decide a pending action, or raise: CONFLICT when it is decided already, INVALID_PARAMS when it never
        waited for a decision or the digest names another action."""
        self.check(action, digest)
        return self.settle(Decided(action, decision, by, remember))

    def check(self, action: int, digest: str) -> None:
        """Raise what an answer for this action and digest would be refused with; nothing changes."""
        done = self.decided.get(action)
        asked = self.pending.get(action)
        if asked is None and done is None:
            raise InvalidParamsError(
                f"action {action} awaits no approval; `session/pending` shows what the session waits for"
            )
        expected = asked.digest if asked is not None else None
        if expected is not None and digest != expected:
            raise InvalidParamsError(
                f"digest {digest[:80]!r} does not name action {action} as it stands (its digest is {expected}); "
                "nothing was decided: answer with the digest of its session/approval"
            )
        if done is not None:
            raise ConflictError(_conflict(done))

    def cancel(self, actions: list[int], by: str) -> list[Decided]:
        """Withdraw these actions' pending approvals (their turn was cancelled): each is decided `cancelled`."""
        return [self.settle(Decided(a, "cancelled", by)) for a in sorted(actions) if a in self.pending]

    def settle(self, decided: Decided) -> Decided:
        """Record a decision (made here, or replayed from the record log)."""
        asked = self.pending.pop(decided.action, None)
        self.decided[decided.action] = decided
        if decided.remember and asked is not None and decided.decision != "cancelled":
            subject = _subject(asked.op)
            if subject is not None:
                self.remembered.append((*subject, decided.decision))
        return decided

    def recall(self, op: Op) -> Answer | None:
        """What a remembered decision says of this op (the strictest that matches), or None: ask."""
        subject = _subject(op)
        if subject is None:
            return None
        what, value = subject
        found: Answer | None = None
        for kind, prefix, decision in self.remembered:
            if kind == what and value[: len(prefix)] == prefix and (kind == "argv" or value == prefix):
                if decision == "deny":
                    return "deny"
                found = decision
        return found

    def replay(self, kind: str, body: bytes) -> None:
        """Apply one record of the log, as written by the daemon (`ASKED` or `DECIDED`)."""
        if kind == ASKED:
            asked = _asked.decode(body)
            if asked.action not in self.decided:
                self.pending[asked.action] = asked
        elif kind == DECIDED:
            self.settle(_decided.decode(body))


def _conflict(done: Decided) -> str:
    if done.decision == "cancelled":
        return f"action {done.action} is no longer awaiting approval: its turn was cancelled (by {done.by})"
    return f"action {done.action} was already decided: {done.decision} by {done.by}; the first answer stands"


_asked = msgspec.json.Decoder(Asked)
_decided = msgspec.json.Decoder(Decided)
