"""Questions from MCP servers: an elicitation a server sends while a tool call runs (the legacy `elicitation/create`
request, or the 2026-07-28 revision's `input_required` result), asked of every client that watches the session and
decided by the first answer from any of them.

What it promises:
- a question is durable (a `question` record of the session's record log) before any client is told of it
  (`session/input`), and every watcher that starts watching while it is open is told again (`announcements`);
- the first answer decides (`answer`): it is checked against the question's schema (INVALID_PARAMS, deciding
  nothing, when the schema does not admit it), made durable (an `answered` record) before anyone is told
  (`session/answered`) or the server is sent it; a later answer is CONFLICT naming who answered;
- a question of the 2026-07-28 revision keeps its round's sealed `request_state`: after a daemon restart its call is
  sent again with that state and the answer (`kept`, `wait`), unless the call was sent with them already (`sending`
  keeps that, durably, before it is sent: the server may have run it then, and it is never sent twice); a legacy
  question cannot be (its server process and call are gone with the daemon) and is declined after a restart, saying
  so (`lapse`);
- a question still open when its turn is cancelled (or its call ends) is withdrawn (`withdraw`: decided `cancel`).

What it keeps of a session in memory is in the session's record of the runtime's table (`devd.agent.known`), read
from the record log the first time it is needed, so that forgetting the session forgets it too.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import anyio
import msgspec

from devd.agent import jsonschemas
from devd.agent.known import Questioned, Table
from devd.agent.oversight import Keeper
from devd.errors import ConflictError, HandleError, InvalidParamsError
from devd.protocol import ANSWER_BYTES_MAX, AnsweredNotice, InputNotice
from devd.storage.store import Record

QUESTION = "question"  # the record kinds of the session's record log
ANSWERED = "answered"
SENT = "answers_sent"
INPUT_NOTICE = "session/input"
ANSWERED_NOTICE = "session/answered"
MESSAGE_CHARS_MAX = 4000  # of a server's message, as a client is told it
Decision = Literal["accept", "decline", "cancel"]
LAPSED = (
    "declined: the daemon restarted while this question waited, and its MCP server asked it with the legacy "
    "elicitation request, which cannot be answered after a restart (its call ended with the daemon)"
)


class Question(msgspec.Struct, frozen=True, omit_defaults=True):
    """Question `request` of tool call `action`: the server's message and schema; for the 2026-07-28 revision, the
    server's key for it among its round's questions (`key`), the round (`round`, from 1) and its sealed state
    (`state`), which lets the call be sent again with the answer after a restart."""

    action: int
    request: int
    message: str
    schema: dict[str, Any]
    round: int = 0  # 0: a legacy question (elicitation/create)
    key: str | None = None
    state: str | None = None


class Answered(msgspec.Struct, frozen=True, omit_defaults=True):
    """How question `request` of action `action` was decided, by whom, with what (`answer`, when accepted), and why
    when devd decided it."""

    action: int
    request: int
    decision: Decision
    by: str
    answer: dict[str, Any] | None = None
    why: str | None = None


class Sent(msgspec.Struct, frozen=True):
    """The call of action `action` was sent with the answers to the round whose state has this digest."""

    action: int
    state: str


class Questions:
    """Every session's questions, for one daemon."""

    def __init__(self, keeper: Keeper, table: Table) -> None:
        self.keeper, self.table = keeper, table

    async def _state(self, session: str) -> Questioned:
        known = self.table.get(session)
        if known.questioned is not None:
            return known.questioned
        state = Questioned()
        for record in await self.keeper.records(session, (QUESTION, ANSWERED, SENT)):
            if record.kind == QUESTION:
                q = _question.decode(record.body)
                state.asked[(q.action, q.request)] = q
            elif record.kind == SENT:
                sent = _sent.decode(record.body)
                state.sent.add((sent.action, sent.state))
            else:
                a = _answered.decode(record.body)
                state.answered[(a.action, a.request)] = a
        if known.questioned is None:  # another reader may have finished first: one state only
            known.questioned = state
        return known.questioned

    # -- the call's side ------------------------------------------------------------------------------------------

    async def ask(
        self,
        session: str,
        action: int,
        message: str,
        schema: dict[str, Any],
        *,
        round: int = 0,
        key: str | None = None,
        state: str | None = None,
    ) -> Answered:
        """Ask the session's clients; the first answer (durable), once one is given."""
        questioned = await self._state(session)
        async with questioned.lock:
            request = 1 + max((r for a, r in questioned.asked if a == action), default=0)
            question = Question(action, request, message[:MESSAGE_CHARS_MAX], schema, round, key, state)
            await self._keep(session, QUESTION, action, question)
            questioned.asked[(action, request)] = question
        self.keeper.tell(session, INPUT_NOTICE, _notice(session, question))
        return await self.wait(session, action, request)

    async def wait(self, session: str, action: int, request: int) -> Answered:
        """The answer to a question asked (before a restart, too), once it is given."""
        questioned = await self._state(session)
        done: Answered | None = questioned.answered.get((action, request))
        if done is None:
            event = questioned.waiters.setdefault((action, request), anyio.Event())
            await event.wait()
            done = questioned.answered[(action, request)]
        return done

    async def kept(self, session: str, action: int) -> list[Question]:
        """The questions of the action's last round, when they carry a sealed state (the 2026-07-28 revision), so
        that its call can be sent again with it and their answers; [] when there are none, or they are legacy."""
        questioned = await self._state(session)
        mine = [q for (a, _), q in sorted(questioned.asked.items()) if a == action]
        last = mine[-1].state if mine else None
        if last is None or (action, _digest(last)) in questioned.sent:
            return []
        return [q for q in mine if q.state == last]

    async def sending(self, session: str, action: int, state: str | None) -> None:
        """The call of `action` is about to be sent with the answers to the round of `state`: kept durably first, so
        that a restart never sends it with them again (the server may have run it)."""
        if state is None:
            return
        questioned = await self._state(session)
        sent = Sent(action, _digest(state))
        await self._keep(session, SENT, action, sent)
        questioned.sent.add((sent.action, sent.state))

    async def open(self, session: str, action: int) -> list[Question]:
        """The action's questions not yet decided."""
        questioned = await self._state(session)
        return [
            q for (a, r), q in sorted(questioned.asked.items()) if a == action and (a, r) not in questioned.answered
        ]

    async def awaiting(self, session: str) -> set[int]:
        """The actions with a question open."""
        questioned = await self._state(session)
        return {a for (a, r) in questioned.asked if (a, r) not in questioned.answered}

    async def lapse(self, session: str, action: int) -> list[Answered]:
        """After a restart: the action's open questions that cannot be answered now are declined, saying why."""
        return await self._settle_open(session, action, "decline", "devd", LAPSED)

    async def withdraw(self, session: str, action: int, by: str | None = None) -> list[Answered]:
        """The action's turn was cancelled (or its call ended): its open questions are withdrawn."""
        known = self.table.find(session)
        if known is None or known.questioned is None:  # none asked in this daemon's life, nor read (a session gone)
            return []
        by = by or known.cancelling or "unknown"
        return await self._settle_open(session, action, "cancel", by, None)

    async def _settle_open(
        self, session: str, action: int, decision: Decision, by: str, why: str | None
    ) -> list[Answered]:
        questioned = await self._state(session)
        settled = []
        async with questioned.lock:
            for question in await self.open(session, action):
                done = Answered(action, question.request, decision, by, None, why)
                await self._keep(session, ANSWERED, action, done)
                questioned.answered[(action, question.request)] = done
                settled.append(done)
        for done in settled:
            self._told(session, questioned, done)
        return settled

    # -- the clients' side ----------------------------------------------------------------------------------------

    async def answer(
        self, session: str, action: int, request: int, answer: dict[str, Any] | None, decline: bool, by: str
    ) -> Answered:
        """A client's answer: durable before anyone is told; CONFLICT or INVALID_PARAMS decides nothing."""
        if (answer is None) == (not decline):
            raise InvalidParamsError(
                "give either answer (the JSON object the question's schema asks for) or decline: true, not both and "
                "not neither; nothing was decided"
            )
        questioned = await self._state(session)
        async with questioned.lock:  # one answer at a time: the first is durable before a second is checked
            question = questioned.asked.get((action, request))
            if question is None:
                raise InvalidParamsError(
                    f"action {action} has no question {request}; the questions waiting are told as session/input to "
                    "every watcher of the session"
                )
            done = questioned.answered.get((action, request))
            if done is not None:
                raise ConflictError(_conflict(done))
            if answer is not None:
                _check(question, answer)
            done = Answered(action, request, "decline" if decline else "accept", by, answer)
            await self._keep(session, ANSWERED, action, done)
            questioned.answered[(action, request)] = done
        self._told(session, questioned, done)
        return done

    async def announcements(self, session: str) -> list[bytes]:
        """The `session/input` params of every open question, for a watcher that has just started watching."""
        questioned = await self._state(session)
        return [
            msgspec.json.encode(_notice(session, q))
            for key, q in sorted(questioned.asked.items())
            if key not in questioned.answered
        ]

    def _told(self, session: str, questioned: Questioned, done: Answered) -> None:
        notice = AnsweredNotice(session, done.action, done.request, done.decision, done.by, done.why)
        self.keeper.tell(session, ANSWERED_NOTICE, notice)
        event = questioned.waiters.pop((done.action, done.request), None)
        if event is not None:
            event.set()

    async def _keep(self, session: str, kind: str, action: int, body: msgspec.Struct) -> None:
        seq = self.keeper.seq(session)
        if seq is None:
            raise HandleError(f"no session is named {session!r}; `session/list` shows the sessions there are")
        await self.keeper.add_record(Record(session, seq, kind, action, msgspec.json.encode(body)))


def schema_problem(schema: Any) -> str | None:
    """Why a server's schema cannot be asked with (None: it can): `devd.agent.jsonschemas` says what is taken."""
    problem = jsonschemas.problem(schema)
    return None if problem is None else f"its schema {problem}"


def _check(question: Question, answer: dict[str, Any]) -> None:
    if len(msgspec.json.encode(answer)) > ANSWER_BYTES_MAX:
        raise InvalidParamsError(f"the answer is longer than {ANSWER_BYTES_MAX} bytes; nothing was decided")
    found = jsonschemas.mismatch(question.schema, answer)
    if found is not None:
        where, why = found
        raise InvalidParamsError(
            f"the answer does not fit question {question.request}'s schema: at {where or 'the answer'}, {why}; "
            "nothing was decided"
        )


def _digest(state: str) -> str:
    return hashlib.sha256(state.encode()).hexdigest()


def _notice(session: str, q: Question) -> InputNotice:
    return InputNotice(session, q.action, q.request, q.message, q.schema)


def _conflict(done: Answered) -> str:
    if done.decision == "cancel":
        return f"question {done.request} of action {done.action} is no longer asked: it was withdrawn (by {done.by})"
    if done.why is not None:
        return f"question {done.request} of action {done.action} was already decided: {done.why}"
    said = "answered" if done.decision == "accept" else "declined"
    return f"question {done.request} of action {done.action} was already {said} by {done.by}; the first answer stands"


_question = msgspec.json.Decoder(Question)
_answered = msgspec.json.Decoder(Answered)
_sent = msgspec.json.Decoder(Sent)
