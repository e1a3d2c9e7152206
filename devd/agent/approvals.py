"""Approvals: which of a session's actions wait for a person, what each was decided, by whom, and what is remembered.

Pure (no I/O, no clock): the daemon writes each change the ledger makes into the session's record log before it tells
anyone, and a ledger rebuilt from those records (`replay`) is the one that was lost. What it promises:
- a digest names one exact action and its arguments (the action id and the op, canonically encoded);
- the first valid answer decides; a later one is `ConflictError` naming who decided, a digest that does not match is
  `InvalidParamsError`, and neither changes anything;
- a decision remembered (`remember`) settles later calls of the session without asking, and no others: by default
  (`"exact"`, or `true`) calls of exactly the argv (Exec; Git's as `git ...`) or path (Write) decided; a `"prefix"`
  grant also calls of that argv followed by more words, none of which starts with `-` (so `rm a.o` never grows into
  `rm a.o -rf src`), and never a call whose argv the policy cannot see through (`devd.agent.wrappers.see` is blind
  at it: `make 'x;rm -rf src'`), while a remembered denial covers every extension; a profile's `deny` is never
  overridden by it (the ledger is asked only about `ask` calls). A `"prefix"` allowance of an argv that runs a
  command given in its arguments (`env`, `timeout 60 make`, `ssh host`, `watch date`:
  `devd.agent.wrappers.runs_later_words`) is kept `"exact"`, saying why. A `true` kept before `"prefix"` existed is
  read as `"exact"`. An MCP tool's call is remembered by its tool and a digest of its exact input (canonical JSON),
  whatever the scope asked for.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from devd.agent import kinds, wrappers
from devd.agent.kinds.base import Subject
from devd.errors import ConflictError, InvalidParamsError
from devd.messages import Call, Op
from devd.protocol import Remember, Remembered

Verdict = Literal["allow", "deny", "cancelled"]
Answer = Literal["allow", "deny"]

# The record kinds the ledger's changes are kept under in the session's record log.
ASKED = "approval"
DECIDED = "decided"


class Asked(msgspec.Struct, frozen=True, omit_defaults=True):
    """An action that waits for a decision: its id, what it would do, the digest an answer must name, and why the
    policy asks (not part of the digest: the digest names the action, whatever the policy said)."""

    action: int
    op: Op
    digest: str
    why: str | None = None


class Decided(msgspec.Struct, frozen=True, omit_defaults=True):
    """How an action was decided: `allow`, `deny` (by a client) or `cancelled` (its turn was), by whom, and what of
    it is remembered (`remember`: False, or the scope; a `true` of an older record is read as "exact")."""

    action: int
    decision: Verdict
    by: str
    remember: bool | Remember = False

    @property
    def scope(self) -> Remember | None:
        """What the decision settles later: "exact", "prefix", or None (nothing)."""
        return scope_of(self.remember)


class Grant(msgspec.Struct, frozen=True):
    """A remembered decision: the argv or path it was about (`kind`, `words`), its scope, the decision, and why a
    "prefix" asked for was kept "exact" (`narrowed`)."""

    kind: Literal["argv", "path", "tool"]
    words: tuple[str, ...]
    scope: Remember
    decision: Answer
    narrowed: str | None = None

    def covers(self, kind: str, words: tuple[str, ...], watched: frozenset[str] = frozenset()) -> bool:
        """Whether this grant settles a call of these words: the same words, or (a prefix grant, or any remembered
        denial of an argv) those words followed by more; an allowance never by a word starting with `-`, nor when
        the argv cannot be seen through (`watched`: the programs the profile's deny and ask rules name)."""
        if kind != self.kind or words[: len(self.words)] != self.words:
            return False
        extra = words[len(self.words) :]
        if not extra:
            return True
        if kind in ("path", "tool") or self.scope == "exact":
            return False
        if self.decision == "deny":
            return True
        return not any(word.startswith("-") for word in extra) and wrappers.see(words, watched).blind is None

    def shown(self) -> Remembered:
        """The grant as `session/decided` states it."""
        if self.kind == "path":
            return Remembered(self.scope, path=self.words[0])
        if self.kind == "tool":
            return Remembered(self.scope, tool=self.words[0], input_sha256=self.words[1], narrowed=self.narrowed)
        return Remembered(self.scope, argv=list(self.words), narrowed=self.narrowed)


def scope_of(remember: bool | Remember) -> Remember | None:
    """The scope a `remember` asks for: `true` is "exact" (the safe reading), `false` none."""
    if remember is True:
        return "exact"
    return None if remember is False else remember


def action_digest(action: int, op: Op) -> str:
    """The hex SHA-256 of the action's id and op as canonical JSON (members sorted): it names this exact action."""
    canonical = msgspec.json.encode({"action": action, "op": msgspec.to_builtins(op, enc_hook=_raw)}, order="sorted")
    return hashlib.sha256(canonical).hexdigest()


def _raw(value: object) -> object:
    """A Tool call's input (msgspec.Raw, which to_builtins does not take) as the JSON value it holds."""
    if isinstance(value, msgspec.Raw):
        return msgspec.json.decode(value)
    raise NotImplementedError(f"{type(value).__name__} is not a message's type")


def call_of(op: Op) -> Call | None:
    """The call an op asks for that the policy decides (None for Model, Emit, Save, Done, and a kind answered at
    once: `Kind.gated`)."""
    found = kinds.of(op)
    if found is None or not found[0].gated:
        return None
    kind, member = found
    return Call(**{kind.member: member})


def _subject(op: Op) -> Subject | None:
    """What a remembered decision is about: an argv (Git's as `git ...`) or a Write's path (`Kind.remembered`)."""
    found = kinds.of(op)
    return None if found is None else found[0].remembered(found[1])


class Ledger(msgspec.Struct):
    """One session's approvals."""

    pending: dict[int, Asked] = msgspec.field(default_factory=dict)
    decided: dict[int, Decided] = msgspec.field(default_factory=dict)
    remembered: list[Grant] = msgspec.field(default_factory=list)

    def ask(self, action: int, op: Op, why: str | None = None) -> Asked:
        """The action's approval, asked now or before (the same one, so a restart asks nothing new)."""
        if action in self.pending:
            return self.pending[action]
        asked = Asked(action, op, action_digest(action, op), why)
        self.pending[action] = asked
        return asked

    def answer(self, action: int, digest: str, decision: Answer, by: str, remember: bool | Remember = False) -> Decided:
        """Decide a pending action, or raise: CONFLICT when it is decided already, INVALID_PARAMS when it never
        waited for a decision or the digest names another action."""
        self.check(action, digest)
        return self.settle(Decided(action, decision, by, scope_of(remember) or False))

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
        grant = None if asked is None else grant_of(asked.op, decided)
        if grant is not None:
            self.remembered.append(grant)
        return decided

    def recall(self, op: Op, watched: frozenset[str] = frozenset()) -> Answer | None:
        """What a remembered decision says of this op (the strictest that covers it), or None: ask. `watched`: the
        programs the profile's deny and ask rules name (`Grant.covers`)."""
        subject = _subject(op)
        if subject is None:
            return None
        found: Answer | None = None
        for grant in self.remembered:
            if grant.covers(*subject, watched):
                if grant.decision == "deny":
                    return "deny"
                found = grant.decision
        return found

    def replay(self, kind: str, body: bytes) -> None:
        """Apply one record of the log, as written by the daemon (`ASKED` or `DECIDED`)."""
        if kind == ASKED:
            asked = _asked.decode(body)
            if asked.action not in self.decided:
                self.pending[asked.action] = asked
        elif kind == DECIDED:
            self.settle(_decided.decode(body))


def grant_of(op: Op, decided: Decided) -> Grant | None:
    """What a decision on this op remembers, if anything (a cancellation, or a Read, remembers nothing)."""
    scope, subject = decided.scope, _subject(op)
    if scope is None or subject is None or decided.decision == "cancelled":
        return None
    kind, words = subject
    if kind == "tool" and scope == "prefix":  # a tool's call has no prefix: its exact input, or nothing
        why = "kept exact: an MCP tool's call is remembered by its input"
        return Grant(kind, words, "exact", decided.decision, why)
    runs = wrappers.runs_later_words(words) if kind == "argv" and scope == "prefix" else None
    if runs is not None and decided.decision == "allow":  # a prefix of it would allow any command given after it
        return Grant(kind, words, "exact", "allow", f"kept exact, not as a prefix: {runs}")
    return Grant(kind, words, scope, decided.decision)


def _conflict(done: Decided) -> str:
    if done.decision == "cancelled":
        return f"action {done.action} is no longer awaiting approval: its turn was cancelled (by {done.by})"
    return f"action {done.action} was already decided: {done.decision} by {done.by}; the first answer stands"


_asked = msgspec.json.Decoder(Asked)
_decided = msgspec.json.Decoder(Decided)
