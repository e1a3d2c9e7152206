"""Spend: what each model call used, and the ceilings a call is checked against before it is sent.

Pure (no I/O, no clock: the day is given). A call is admitted only if, for every ceiling that applies, what is spent
plus what is reserved by calls in flight plus this call's own reservation (the estimate of its request plus its
`max_tokens`) stays within the limit; the reservation is held until the call settles (its usage charged) or is
released (it failed, nothing charged). So calls running at once, in one session or in many sessions of a profile,
cannot pass a ceiling together: the second is refused while the first holds its share. A refusal changes nothing but
the session's `refused` count.

Tokens are `input_tokens + output_tokens` (cached tokens are part of the input, as providers count them). The
ceilings: a profile's `tokens_per_turn`, `tokens_per_session` and `tokens_per_day` (UTC days, shared by every
session of the profile), and the session's own `budget.tokens` (`session/new`, `session/budget`).
"""

from __future__ import annotations

import itertools
import math

import msgspec

USAGE = "usage"  # record kinds in the session's record log
REFUSAL = "refusal"
BUDGET = "budget"
CHARS_PER_TOKEN = 4  # devd's estimate when a provider reports no usage: about four characters of JSON a token


def estimate_tokens(text: bytes | str) -> int:
    """devd's estimate of the tokens of a request or a reply: its length over four, rounded up."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


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


class Totals(msgspec.Struct, omit_defaults=False):
    """A session's spend, as `session/usage` answers it."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    calls: int = 0
    refused: int = 0


class Refusal(msgspec.Struct, frozen=True):
    """Why a call was not sent: the ceiling, its limit, what was spent, reserved by calls in flight, and needed."""

    ceiling: str
    limit: int
    spent: int
    reserved: int
    needed: int
    fix: str

    @property
    def message(self) -> str:
        in_flight = f" and {self.reserved} reserved by calls in flight" if self.reserved else ""
        return (
            f"spend ceiling reached: {self.ceiling} is {self.limit} tokens, {self.spent} spent{in_flight}, and the "
            f"next model call needs up to {self.needed}; the call was not sent: {self.fix}, then session/resume"
        )


class Scope(msgspec.Struct, frozen=True):
    """Where a call's tokens count: its session, turn, profile and UTC day (YYYY-MM-DD)."""

    session: str
    profile: str
    turn: int
    day: str


class Reservation(msgspec.Struct, frozen=True):
    number: int
    scope: Scope
    tokens: int


class SpendLedger(msgspec.Struct):
    """Every session's spend and every call in flight, for one daemon."""

    sessions: dict[str, Totals] = msgspec.field(default_factory=dict)
    _spent: dict[tuple[str, ...], int] = msgspec.field(default_factory=dict)  # by counter (see `_counters`)
    _reserved: dict[tuple[str, ...], int] = msgspec.field(default_factory=dict)
    _open: dict[int, Reservation] = msgspec.field(default_factory=dict)
    _numbers: itertools.count[int] = msgspec.field(default_factory=itertools.count)

    def admit(self, scope: Scope, tokens: int, ceilings: Ceilings) -> Reservation | Refusal:
        """Reserve `tokens` for a call, or the refusal of the first ceiling it would pass (the call is not sent)."""
        for ceiling, limit, counter, fix in _checks(scope, ceilings):
            spent, reserved = self._spent.get(counter, 0), self._reserved.get(counter, 0)
            if spent + reserved + tokens > limit:
                self.totals(scope.session).refused += 1
                return Refusal(ceiling, limit, spent, reserved, tokens, fix)
        reservation = Reservation(next(self._numbers), scope, tokens)
        self._open[reservation.number] = reservation
        for counter in _counters(scope):
            self._reserved[counter] = self._reserved.get(counter, 0) + tokens
        return reservation

    def headroom(self, scope: Scope, ceilings: Ceilings) -> int:
        """The tokens a call could still reserve under the tightest ceiling (none set: a very large number)."""
        left = [limit - self._spent.get(c, 0) - self._reserved.get(c, 0) for _, limit, c, _ in _checks(scope, ceilings)]
        return min(left, default=1 << 62)

    def settle(self, reservation: Reservation, usage: Usage | None) -> None:
        """The call is over: its reservation is released, and its usage (None: it used nothing) charged."""
        if self._open.pop(reservation.number, None) is None:
            return
        for counter in _counters(reservation.scope):
            self._reserved[counter] -= reservation.tokens
        if usage is not None:
            self.charge(reservation.scope, usage)

    def charge(self, scope: Scope, usage: Usage) -> None:
        """Count a call's usage (settled now, or replayed from the record log at start)."""
        totals = self.totals(scope.session)
        totals.input_tokens += usage.input_tokens
        totals.output_tokens += usage.output_tokens
        totals.cached_tokens += usage.cached_tokens
        totals.calls += 1
        for counter in _counters(scope):
            self._spent[counter] = self._spent.get(counter, 0) + usage.tokens

    def totals(self, session: str) -> Totals:
        return self.sessions.setdefault(session, Totals())

    def forget(self, session: str) -> None:
        """A closed session's totals go; what it spent still counts for its profile's day."""
        self.sessions.pop(session, None)


def _counters(scope: Scope) -> tuple[tuple[str, ...], ...]:
    return (
        ("turn", scope.session, str(scope.turn)),
        ("session", scope.session),
        ("day", scope.profile, scope.day),
    )


def _checks(scope: Scope, c: Ceilings) -> list[tuple[str, int, tuple[str, ...], str]]:
    """(ceiling, limit, counter, how to raise it) of each ceiling set, the session's own budget first."""
    turn, session, day = _counters(scope)
    agent = f"agent {scope.profile!r}"
    raise_profile = f"raise it in [agent.{scope.profile}] budget of agents.toml and restart the daemon"
    checks = [
        ("the session's budget", c.session_budget, session, "raise it with session/budget"),
        (f"tokens_per_turn of {agent}", c.tokens_per_turn, turn, f"{raise_profile}, or start a new turn"),
        (f"tokens_per_session of {agent}", c.tokens_per_session, session, raise_profile),
        (f"tokens_per_day of {agent} (UTC day {scope.day})", c.tokens_per_day, day, f"{raise_profile}, or wait"),
    ]
    return [(name, limit, counter, fix) for name, limit, counter, fix in checks if limit is not None]
