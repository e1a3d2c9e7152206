"""Spend: what each model call used, and the ceilings a call is checked against before it is sent.

Pure (no I/O, no clock: the day is given): the counters themselves are kept by the store (`devd.storage.store`,
`reserve`, `charge`), shared by every daemon of it, so a restart, a second daemon of a fleet or a session taken over
by another daemon spends nothing twice. A call is admitted only if, for every ceiling that applies, what is spent plus
what is reserved by calls in flight plus this call's own reservation (the estimate of its request plus its
`max_tokens`, MAX_TOKENS_DEFAULT when the profile sets none) stays within the limit; the reservation is held until the
call settles (what its attempts used charged, a cut or cancelled one's too) or is released (the server took none of
its attempts, so nothing is charged). A reservation covers one attempt: a
call is reserved again before each retry, what its attempts so far cost charged first. So calls running at once, in
one session or in many sessions of a profile, in one daemon or in several, cannot pass a ceiling together: the second
is refused while the first holds its share. A refusal changes nothing but the session's `refused` count.

Tokens are `input_tokens + output_tokens` (cached tokens are part of the input, as providers count them). The
ceilings: a profile's `tokens_per_turn`, `tokens_per_session` and `tokens_per_day` (UTC days, shared by every
session of the profile), and the session's own `budget.tokens` (`session/new`, `session/budget`).
"""

from __future__ import annotations

import math

import msgspec

from devd.storage.store import Counter

USAGE = "usage"  # record kinds in the session's record log
REFUSAL = "refusal"
BUDGET = "budget"
CHARS_PER_TOKEN = 4  # devd's estimate when a provider reports no usage: about four characters of JSON a token
# What a call of a profile without `max_tokens` is sent as its max_tokens, and reserves for its reply, under a ceiling
# (less when less is left): a reply of some pages, not the whole headroom of a day, which would hold every other
# session of the profile back while it streams.
MAX_TOKENS_DEFAULT = 4096


def estimate_tokens(text: bytes | str) -> int:
    """devd's estimate of the tokens of a request or a reply: its length over four, rounded up."""
    return tokens_of(len(text))


def tokens_of(chars: int) -> int:
    """devd's estimate of the tokens of `chars` characters."""
    return math.ceil(chars / CHARS_PER_TOKEN)


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one model call used: the provider's counts, or devd's estimate (`estimated`) when it gave none."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    estimated: bool = False

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class Charged(msgspec.Struct, frozen=True, omit_defaults=True):
    """A usage record's body: the usage of the call `action` of turn `turn` in session `session` (a fork carries its
    source's records, and counts only its own), charged to `profile` on UTC `day`."""

    session: str
    profile: str
    turn: int
    day: str
    usage: Usage


class Ceilings(msgspec.Struct, frozen=True, omit_defaults=True):
    """The limits on a call, in tokens; None: no such limit."""

    tokens_per_turn: int | None = None
    tokens_per_session: int | None = None
    tokens_per_day: int | None = None
    session_budget: int | None = None


class Refusal(msgspec.Struct, frozen=True):
    """Why a call was not sent: the ceiling, its limit, what was spent, reserved by calls in flight, and needed."""

    ceiling: str
    limit: int
    spent: int
    reserved: int
    needed: int
    fix: str
    estimate: int | None = None  # of `needed`, devd's estimate of the request (the rest: what its reply may take)

    @property
    def message(self) -> str:
        in_flight = f" and {self.reserved} reserved by calls in flight" if self.reserved else ""
        how = ""
        if self.estimate is not None:  # the request is never counted before it is sent: say that it was estimated
            how = (
                f" (~{self.estimate} for its request, by devd's estimate of {CHARS_PER_TOKEN} characters a token, "
                f"and {self.needed - self.estimate} for its reply)"
            )
        return (
            f"spend ceiling reached: {self.ceiling} is {self.limit} tokens, {self.spent} spent{in_flight}, and the "
            f"next model call needs up to {self.needed}{how}; the call was not sent: {self.fix}, then session/resume"
        )


class Scope(msgspec.Struct, frozen=True):
    """Where a call's tokens count: its session, turn, profile and UTC day (YYYY-MM-DD)."""

    session: str
    profile: str
    turn: int
    day: str


class Reservation(msgspec.Struct, frozen=True):
    """A call's tokens held on its scope's counters until it settles: `number` is the store's."""

    number: int
    scope: Scope
    tokens: int
    also: tuple[Counter, ...] = ()  # the counters of the session's ancestors (a child's call), held and charged too


class Check(msgspec.Struct, frozen=True):
    """One ceiling that applies to a call: its name, limit, the counter it limits, and how to raise it."""

    ceiling: str
    limit: int
    counter: Counter
    fix: str


def counters(scope: Scope) -> tuple[Counter, Counter, Counter]:
    """Where a call's tokens count: its turn, its session, its profile's day."""
    return (
        Counter("turn", scope.session, str(scope.turn)),
        Counter("session", scope.session, ""),
        Counter("day", scope.profile, scope.day),
    )


def checks(scope: Scope, c: Ceilings) -> list[Check]:
    """The ceilings set, the session's own budget first."""
    turn, session, day = counters(scope)
    agent = f"agent {scope.profile!r}"
    raise_profile = f"raise it in [agent.{scope.profile}] budget of agents.toml and restart the daemon"
    each = [
        ("the session's budget", c.session_budget, session, "raise it with session/budget"),
        (f"tokens_per_turn of {agent}", c.tokens_per_turn, turn, f"{raise_profile}, or start a new turn"),
        (f"tokens_per_session of {agent}", c.tokens_per_session, session, raise_profile),
        (f"tokens_per_day of {agent} (UTC day {scope.day})", c.tokens_per_day, day, f"{raise_profile}, or wait"),
    ]
    return [Check(name, limit, counter, fix) for name, limit, counter, fix in each if limit is not None]
