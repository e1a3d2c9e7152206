"""Oversight of the sessions the daemon drives: approvals any client can answer, spend ceilings checked before a
model call is sent, and one trace record per model call attempt and tool run, all kept in the session's record log.

What it promises:
- an action that needs a decision is announced (`session/approval`) only once its approval is durable, stays pending
  across restarts and hibernation (every new watcher is told again), and is decided once: the first valid answer is
  made durable before anyone is told (`session/decided`) or the action runs;
- a model call is reserved against every ceiling before it is sent, and again before each retry (what its attempts
  so far cost charged first), and a call a ceiling forbids is never sent: a refusal record and a `refused` trace
  record are written instead; a call stopped with the daemon is charged what it streamed as the daemon stops;
- a session's usage counts only the calls made in it (a fork starts from zero), and a profile's day counts every
  session of that profile, closed ones too; the counters are the store's, charged in the transaction that keeps the
  usage record, so a restart, another daemon of a fleet or a session it takes over counts what was spent;
- a session keeps its newest TRACE_RECORDS_KEPT trace records (older ones go, TRACE_TRIM_EVERY at a time), read a
  page at a time by their number in the record log.

The runner calls `gate` before a call starts (`withdraw` when a Cancel ends the wait), carries a model call in a
`ModelCall` (`admit` before it is sent, `attempt` for each attempt, `again` before a retry, `done` or `cancelled` at
its end: it calls `admit`, `settle` and `trace` here) and `trace` after every tool run; the port the wire calls
(`devd.agent.wire.AgentPort`) calls `answer`, `usage`, `traces`, `set_budget`, `awaiting`, `announcements` and
`cancelling` (around a Cancel step). What it keeps of a session in memory is in the session's record of the
runtime's table (`devd.agent.known`), so that forgetting the session forgets it too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

import anyio
import msgspec

from devd.agent import approvals, spend, trace
from devd.agent.approvals import Answer, Asked, Decided
from devd.agent.kinds import decide
from devd.agent.known import Overseen, Table
from devd.agent.port import RecordLog
from devd.agent.profiles import Budget, Profile, watched
from devd.agent.spend import Ceilings, Charged, Check, Refusal, Reservation, Scope, Usage
from devd.errors import HandleError
from devd.messages import Op
from devd.protocol import (
    TRACE_PAGE,
    ApprovalNotice,
    DecidedNotice,
    Outcome,
    Remember,
    Remembered,
    TraceRecord,
    UsageResult,
)
from devd.storage.store import Counter, Record, StoreError, Tally

if TYPE_CHECKING:
    from devd.agent.children import Ancestor
    from devd.agent.model import Attempt

TRACE_RECORDS_KEPT = 10_000  # a session's newest trace records kept; older ones go
TRACE_TRIM_EVERY = 1_000  # trace records kept between two trims of a session's
RELEASE_S = 5.0  # the most a stopping daemon waits to charge a call's attempts and release its reservation
APPROVAL_NOTICE = "session/approval"
DECIDED_NOTICE = "session/decided"
__all__ = ["ApprovalNotice", "DecidedNotice", "Oversight"]


class BudgetBody(msgspec.Struct, frozen=True):
    """A budget record: the session's own ceiling in tokens (None: none), set by `session/new` or `session/budget`."""

    session: str
    tokens: int | None


class RefusalBody(msgspec.Struct, frozen=True):
    """A refusal record: the model call of action `action` was not sent, and why."""

    session: str
    turn: int
    ceiling: str
    limit: int
    spent: int
    reserved: int
    needed: int
    message: str


class Keeper(RecordLog, Protocol):
    """What oversight needs of the daemon: the record log and spend counters, and a way to tell a session's
    watchers."""

    def seq(self, session: str) -> int | None: ...

    def tell(self, session: str, method: str, params: msgspec.Struct) -> None: ...


class Spans(Protocol):
    """Where trace records are exported as they are kept (devd.agent.otel)."""

    def export(self, session: str, record: TraceRecord) -> None: ...

    def shutdown(self) -> None: ...


class Gate(msgspec.Struct, frozen=True):
    """Whether a call may start, and why in words the model is shown when it may not."""

    allowed: bool
    reason: str
    by: str | None = None  # the client that decided, when one did


def today(now: float | None = None) -> str:
    """The UTC day a call's tokens count for."""
    return datetime.fromtimestamp(time.time() if now is None else now, UTC).date().isoformat()


def ceilings(profile: Profile, session_budget: int | None) -> Ceilings:
    budget = profile.budget or Budget()
    return Ceilings(budget.tokens_per_turn, budget.tokens_per_session, budget.tokens_per_day, session_budget)


class Oversight:
    """Every session's approvals, spend and trace, for one daemon."""

    def __init__(
        self,
        keeper: Keeper,
        clock: Callable[[], float] = time.time,
        spans: Spans | None = None,
        table: Table | None = None,
    ) -> None:
        self.keeper = keeper
        self.clock = clock
        self.spans = spans
        self.table = (
            Table() if table is None else table
        )  # what is kept of each session: the runtime's table, shared with it
        # A child session's ancestors (devd.agent.children): their ceilings hold its calls too, and their watchers
        # are told of its approvals.
        self.lineage: Callable[[str], Awaitable[list[Ancestor]]] | None = None
        self.ancestors: Callable[[str], list[str]] = lambda session: []

    async def _state(self, session: str) -> Overseen:
        """The session's approvals and budget, read from its record log the first time they are needed."""
        known = self.table.get(session)
        if known.overseen is not None:
            return known.overseen
        if known.loading is not None:
            await known.loading.wait()
            return await self._state(session)
        known.loading = done = anyio.Event()
        try:
            state = Overseen()
            kinds = (approvals.ASKED, approvals.DECIDED, spend.BUDGET)
            for record in await self.keeper.records(session, kinds):
                if record.kind == spend.BUDGET:  # a fork keeps its source's ceiling (and spends from zero)
                    state.budget = _budget.decode(record.body).tokens
                else:
                    state.ledger.replay(record.kind, record.body)
            known.overseen = state
        finally:
            known.loading = None
            done.set()
        return state

    @contextlib.contextmanager
    def cancelling(self, session: str, by: str) -> Iterator[None]:
        """Around a Cancel step of a session known here: `by` kept as who withdrew the turn's approvals (read when
        the driver withdraws them, after the step). A step that fails (a malformed Cancel) leaves what was kept as it
        was, so that no bad request leaves its client's name behind."""
        known = self.table.get(session)
        before, known.cancelling = known.cancelling, by
        try:
            yield
        except BaseException:
            known.cancelling = before
            raise

    # -- approvals ----------------------------------------------------------------------------------------------

    async def gate(self, session: str, action: int, op: Op, profile: Profile) -> Gate:
        """Whether the call may start: the profile's decision, a remembered one, or (for `ask`) a client's, waited
        for. A decision already made (before a restart) is not asked again."""
        call = approvals.call_of(op)
        if call is None:
            return Gate(True, "not a call")
        decision, reason = decide(profile, call)
        if decision != "ask":
            return Gate(decision == "allow", reason)
        state = await self._state(session)
        done = state.ledger.decided.get(action)
        if done is None:
            remembered = state.ledger.recall(op, watched(profile))
            if remembered is not None:
                return Gate(remembered == "allow", f"a decision remembered in this session says {remembered}")
            done = await self._wait(session, state, action, op, reason)
        if done.decision == "allow":
            return Gate(True, f"allowed by {done.by}", done.by)
        if done.decision == "cancelled":
            return Gate(False, "not run: its turn was cancelled while it waited for approval", done.by)
        return Gate(False, f"denied by {done.by}: the user did not approve this call", done.by)

    async def _wait(self, session: str, state: Overseen, action: int, op: Op, why: str) -> Decided:
        async with state.lock:
            done = state.ledger.decided.get(action)
            if done is not None:  # answered (from a record read at start) before this driver came to ask
                return done
            if action not in state.ledger.pending:
                asked = state.ledger.ask(action, op, why)
                await self._keep(session, approvals.ASKED, action, asked)
            asked = state.ledger.pending[action]
            event = state.decided.setdefault(action, anyio.Event())
        notice = ApprovalNotice(session, action, asked.op, asked.digest, asked.why)
        self.keeper.tell(session, APPROVAL_NOTICE, notice)
        for above in self.ancestors(session):  # a UI watching a parent may approve its child's call
            self.keeper.tell(above, APPROVAL_NOTICE, notice)
        await event.wait()
        return state.ledger.decided[action]

    async def answer(
        self, session: str, action: int, digest: str, decision: Answer, by: str, remember: bool | Remember = False
    ) -> Decided:
        """A client's answer: durable before anyone is told (with what it remembers, if anything); CONFLICT or
        INVALID_PARAMS decides nothing."""
        state = await self._state(session)
        async with state.lock:  # one answer at a time: the first is durable before a second is checked
            state.ledger.check(action, digest)
            done = Decided(action, decision, by, approvals.scope_of(remember) or False)
            grant = approvals.grant_of(state.ledger.pending[action].op, done)
            await self._keep(session, approvals.DECIDED, action, done)
            state.ledger.settle(done)
        self._told(session, state, done, None if grant is None else grant.shown())
        return done

    async def withdraw(self, session: str, actions: list[int], by: str | None = None) -> list[Decided]:
        """The turn of these actions was cancelled: their pending approvals are decided `cancelled`, by the client
        that stepped the Cancel when it is known."""
        known = self.table.find(session)
        by = by or (known.cancelling if known is not None else None) or "unknown"
        state = await self._state(session)
        async with state.lock:
            withdrawn = state.ledger.cancel(actions, by)
            for done in withdrawn:
                await self._keep(session, approvals.DECIDED, done.action, done)
        for done in withdrawn:
            self._told(session, state, done)
        return withdrawn

    def _told(self, session: str, state: Overseen, done: Decided, remembered: Remembered | None = None) -> None:
        notice = DecidedNotice(session, done.action, done.decision, done.by, remembered)
        self.keeper.tell(session, DECIDED_NOTICE, notice)
        for above in self.ancestors(session):
            self.keeper.tell(above, DECIDED_NOTICE, notice)
        event = state.decided.pop(done.action, None)
        if event is not None:
            event.set()

    async def awaiting(self, session: str) -> list[Asked]:
        """The session's actions waiting for a decision, in id order."""
        state = await self._state(session)
        return [state.ledger.pending[a] for a in sorted(state.ledger.pending)]

    async def announcements(self, session: str) -> list[bytes]:
        """The `session/approval` params of every pending approval, for a watcher that has just started watching."""
        return [
            msgspec.json.encode(ApprovalNotice(session, a.action, a.op, a.digest, a.why))
            for a in await self.awaiting(session)
        ]

    # -- spend ----------------------------------------------------------------------------------------------------

    async def set_budget(self, session: str, tokens: int | None) -> None:
        """The session's own ceiling, durable before it applies."""
        state = await self._state(session)
        await self._keep(session, spend.BUDGET, 0, BudgetBody(session, tokens))
        state.budget = tokens

    async def admit(
        self, session: str, profile: Profile, turn: int, action: int, request: bytes, *, exact: bool = False
    ) -> tuple[Reservation | None, int | None, Refusal | None]:
        """Reserve a model call before it is sent: (the reservation, the `max_tokens` to send, None), or (None, None,
        the refusal), durable as a refusal record and a `refused` trace record. With no ceiling, nothing is reserved.
        The `max_tokens` sent is the profile's (MAX_TOKENS_DEFAULT when it gives none), or the headroom the tightest
        ceiling leaves past the request's estimate when that is less, so that what it may write is bounded by what
        was reserved. `exact`: the profile's `max_tokens` is reserved as it is, or refused (a retry, whose request
        was sent with it already)."""
        state = await self._state(session)
        limits = ceilings(profile, state.budget)
        day = today(self.clock())
        above, also = await self._above(session, day)
        if limits == Ceilings() and not above:
            return None, profile.max_tokens, None
        estimate = spend.estimate_tokens(request)
        scope = Scope(session, profile.name, turn, day)
        checks = spend.checks(scope, limits) + above
        # The headroom under the tightest ceiling, as the store counts it now.
        counted = await self.keeper.counted([c.counter for c in checks])
        headroom = min(c.limit - spent - reserved for c, (spent, reserved) in zip(checks, counted, strict=True))
        max_tokens = max(1, min(profile.max_tokens or spend.MAX_TOKENS_DEFAULT, headroom - estimate))
        if exact and profile.max_tokens is not None:
            max_tokens = profile.max_tokens
        tokens = estimate + max_tokens
        limited = [(c.counter, c.limit) for c in checks]
        admitted = await self.keeper.reserve(session, [*spend.counters(scope), *also], limited, tokens)
        if isinstance(admitted, int):
            return Reservation(admitted, scope, tokens, tuple(also)), max_tokens, None
        check = checks[admitted.check]
        refusal = Refusal(check.ceiling, check.limit, admitted.spent, admitted.reserved, tokens, check.fix, estimate)
        body = RefusalBody(session, turn, *_refusal_fields(refusal), refusal.message)
        await self._keep(session, spend.REFUSAL, action, body)
        now = self.clock()
        refused = TraceRecord(
            action=action,
            kind="model",
            started=trace.rfc3339(now),
            duration_ms=0.0,
            outcome="refused",
            error=refusal.message,
            model=profile.model,
        )
        await self.trace(session, refused)
        return None, None, refusal

    async def settle(
        self,
        session: str,
        profile: Profile,
        turn: int,
        action: int,
        reservation: Reservation | None,
        used: Usage | None,
        calls: int = 1,
    ) -> None:
        """The model call is over: its usage (None: it used nothing) charged to its counters in the transaction that
        keeps its usage record, and its reservation released with it. `calls`: the model calls it counts as (0 for
        the rest of a call charged before a retry)."""
        if used is None:
            if reservation is not None:
                await self.keeper.unreserve(reservation.number)
            return
        scope = Scope(session, profile.name, turn, today(self.clock())) if reservation is None else reservation.scope
        also = list(reservation.also) if reservation is not None else (await self._above(session, scope.day))[1]
        seq = self.keeper.seq(session) or 0  # a session closed meanwhile: its record is dropped, its day charged
        record = Record(
            session,
            seq,
            spend.USAGE,
            action,
            _encoder.encode(Charged(session, scope.profile, scope.turn, scope.day, used)),
        )
        tally = Tally(used.input_tokens, used.output_tokens, used.cached_tokens, calls=calls)
        number = None if reservation is None else reservation.number
        try:
            await self.keeper.charge(number, [*spend.counters(scope), *also], tally, record)
        except BaseException:
            if number is not None:  # not charged: at least its tokens are not held for ever
                with anyio.CancelScope(shield=True), contextlib.suppress(StoreError):
                    await self.keeper.unreserve(number)
            raise

    async def _above(self, session: str, day: str) -> tuple[list[Check], list[Counter]]:
        """The turn and session ceilings of the session's ancestors (a child's), and their counters, where its calls
        are reserved and charged too: children running at once cannot pass an ancestor's ceiling together."""
        if self.lineage is None:
            return [], []
        checks: list[Check] = []
        counters: list[Counter] = []
        for a in await self.lineage(session):
            state = await self._state(a.session)
            scope = Scope(a.session, a.profile.name, a.turn, day)
            for c in spend.checks(scope, ceilings(a.profile, state.budget)):
                if c.counter.scope != "day":  # a day's is its agent's, whoever spends
                    named = f"{c.ceiling} of session {a.session!r}, which this run was delegated from"
                    checks.append(msgspec.structs.replace(c, ceiling=named))
            counters += spend.counters(scope)[:2]
        return checks, counters

    async def headroom(self, session: str, profile: Profile, turn: int) -> int | None:
        """The tokens the session may still spend under the tightest of its and its ancestors' ceilings (None: no
        ceiling holds it)."""
        state = await self._state(session)
        day = today(self.clock())
        above, _ = await self._above(session, day)
        checks = spend.checks(Scope(session, profile.name, turn, day), ceilings(profile, state.budget)) + above
        if not checks:
            return None
        counted = await self.keeper.counted([c.counter for c in checks])
        return max(0, min(c.limit - spent - reserved for c, (spent, reserved) in zip(checks, counted, strict=True)))

    async def usage(self, session: str) -> UsageResult:
        """The session's usage; `estimated` when any call kept in its record log was charged devd's estimate (its
        server counted none), so that no estimate is shown as a count."""
        t = await self.keeper.tally(session)
        kept = await self.keeper.records(session, (spend.USAGE,))
        estimated = any(_ESTIMATED in r.body for r in kept)  # omit_defaults: only an estimated usage says so
        return UsageResult(t.input_tokens, t.output_tokens, t.cached_tokens, t.calls, t.refused, estimated)

    # -- trace ----------------------------------------------------------------------------------------------------

    async def trace(self, session: str, record: TraceRecord, beside: Sequence[Record] = ()) -> None:
        """Keep one trace record (durable when this returns), in one write with the caller's records `beside` (an
        effect's ledger record); every TRACE_TRIM_EVERY of a session's, those older than its newest
        TRACE_RECORDS_KEPT go (what they say of usage stays counted: usage is kept apart)."""
        await self._keep(session, trace.TRACE, record.action, record, trace.encode(record), beside)
        if self.spans is not None:
            self.spans.export(session, record)
        if self.keeper.seq(session) is None:  # closed while the record was written: nothing is kept of it here
            return
        known = self.table.get(session)
        known.traced += 1
        if known.traced % TRACE_TRIM_EVERY == 0:  # usage records too: the store's counters hold what they add up to
            for kind in (trace.TRACE, spend.USAGE):
                await self.keeper.trim_records(session, kind, TRACE_RECORDS_KEPT)

    async def traces(
        self, session: str, since: int = 0, limit: int = TRACE_PAGE
    ) -> tuple[list[TraceRecord], int | None]:
        """Up to `limit` of the session's trace records numbered past `since`, in order, and the `since` of the page
        after them (None: there is none yet)."""
        found = await self.keeper.records(session, (trace.TRACE,), since, limit + 1)
        page = [trace.decode(r.body, r.n) for r in found[:limit]]
        return page, page[-1].n if len(found) > limit else None

    # -- the record log -------------------------------------------------------------------------------------------

    async def _keep(
        self,
        session: str,
        kind: str,
        action: int,
        body: msgspec.Struct,
        data: bytes | None = None,
        beside: Sequence[Record] = (),
    ) -> None:
        seq = self.keeper.seq(session)
        if seq is None:
            raise HandleError(f"no session is named {session!r}; `session/list` shows the sessions there are")
        record = Record(session, seq, kind, action, data or msgspec.json.encode(body))
        if beside:
            await self.keeper.add_records([*beside, record])
        else:
            await self.keeper.add_record(record)


def _refusal_fields(r: Refusal) -> tuple[str, int, int, int, int]:
    return r.ceiling, r.limit, r.spent, r.reserved, r.needed


_budget = msgspec.json.Decoder(BudgetBody)
_ESTIMATED = b'"estimated":true'
_encoder = msgspec.json.Encoder()


_OUTCOMES: dict[str, Outcome] = {"ok": "ok", "retry": "error", "failed": "error", "cancelled": "interrupted"}
TRACE_ERROR_CHARS = 500  # of a failed run's text kept as its trace record's error


class ModelCall(msgspec.Struct):
    """One model call of a Model action, as the runner makes it: admitted before it is sent (`admit`), each of its
    attempts heard (`attempt`, the driver's `on_attempt`), admitted again before each retry (`again`, what the
    attempts so far cost charged first), and accounted once it is over (`done`, or `cancelled` when the daemon
    stops): one trace record per attempt, its usage charged."""

    oversight: Oversight
    session: str
    profile: Profile
    turn: int
    action: int
    request: bytes  # the request's body, for the estimate
    attempts: list[Attempt] = msgspec.field(default_factory=list)
    reservation: Reservation | None = None
    name: str | None = None  # what the call is for, in its trace records: "summary" for a compaction's
    charged: int = 0  # of `attempts`, those charged already (before a retry)
    counted: bool = False  # whether a charge counted the call in the session's `calls`

    @property
    def output_max(self) -> int | None:
        """The tokens of reply the reservation holds (None: nothing is reserved): reading stops past them."""
        return None if self.reservation is None else self.profile.max_tokens

    async def admit(self, exact: bool = False) -> Refusal | None:
        """None when the call may be sent (`profile` then carries the `max_tokens` to send), else the refusal.
        `exact`: the `max_tokens` admitted before is reserved again as it is (a retry sends the same request)."""
        reservation, max_tokens, refusal = await self.oversight.admit(
            self.session, self.profile, self.turn, self.action, self.request, exact=exact
        )
        self.reservation = reservation
        if refusal is None and max_tokens != self.profile.max_tokens:
            self.profile = msgspec.structs.replace(self.profile, max_tokens=max_tokens)
        return refusal

    def attempt(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)

    async def again(self) -> str | None:
        """Before a retry: the attempts so far are charged (their reservation released in the same transaction), and
        the next is reserved as the first was; None when it may be sent, else the refusal's message (durable as
        `admit`'s). One reservation covered every attempt before, and each was charged against it."""
        await self._settle()
        refusal = await self.admit(exact=True)
        return None if refusal is None else refusal.message

    async def done(self) -> None:
        """The call is over, answered or not (it failed, or was withdrawn by a Cancel): every attempt is traced and
        charged what the model driver says it cost (a stream cut short, a cancelled one, included)."""
        # One after the other, in order: each on disk before the next, so that what a crash leaves is a prefix.
        try:
            for number, attempt in enumerate(self.attempts, start=1):
                await self.oversight.trace(self.session, self._record(number, attempt))
        finally:
            await self._settle()

    async def cancelled(self) -> None:
        """The call was stopped with the daemon (it is asked again when it starts): what its attempts streamed is
        charged and traced as `done` does, shielded and within RELEASE_S; a store that cannot meanwhile is let be,
        and the daemon that starts again releases the reservation (what streamed then goes uncharged)."""
        with anyio.move_on_after(RELEASE_S, shield=True), contextlib.suppress(StoreError, HandleError):
            await self.done()

    async def _settle(self) -> None:
        """Charge the attempts not charged yet, releasing the reservation with them."""
        used = _total([a.usage for a in self.attempts[self.charged :] if a.usage is not None])
        reservation, self.reservation, self.charged = self.reservation, None, len(self.attempts)
        calls = 0 if self.counted else 1
        self.counted = self.counted or used is not None
        await self.oversight.settle(self.session, self.profile, self.turn, self.action, reservation, used, calls)

    def _record(self, number: int, attempt: Attempt) -> TraceRecord:
        ok = attempt.outcome == "ok"
        tokens = attempt.usage
        return TraceRecord(
            action=self.action,
            kind="model",
            started=trace.rfc3339(attempt.started_at),
            duration_ms=round(attempt.duration_s * 1000, 3),
            outcome=_OUTCOMES[attempt.outcome],
            error=None if ok else attempt.error or attempt.outcome,
            attempt=number,
            model=self.profile.model,
            input_tokens=None if tokens is None else tokens.input_tokens,
            output_tokens=None if tokens is None else tokens.output_tokens,
            cached_tokens=None if tokens is None or not tokens.cached_tokens else tokens.cached_tokens,
            estimated=tokens is not None and tokens.estimated,
            instructions=None if self.profile.project is None else trace.digest(self.profile.project),
            name=self.name,
        )


def _total(usages: list[Usage]) -> Usage | None:
    """The usage of a call's attempts together (None: none was charged); estimated if any part was."""
    if not usages:
        return None
    return Usage(
        sum(u.input_tokens for u in usages),
        sum(u.output_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
        estimated=any(u.estimated for u in usages),
    )


def tool_record(
    action: int,
    kind: str,
    name: str | None,
    started: float,
    duration_s: float,
    outcome: Outcome,
    error: str | None,
) -> TraceRecord:
    """The trace record of one tool run (or of one that was denied, or found interrupted, and never ran)."""
    return TraceRecord(
        action=action,
        kind=kind.lower(),  # type: ignore[arg-type]
        started=trace.rfc3339(started),
        duration_ms=round(duration_s * 1000, 3),
        outcome=outcome,
        error=None if error is None else error[:TRACE_ERROR_CHARS],
        name=name,
    )
