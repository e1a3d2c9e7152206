"""The loop every UI needs: carry out a turn's actions through handlers until the turn is done, whatever a dropped
connection or a restarting daemon does meanwhile.

`await run_turn(client, session, prompt, handlers)` starts a turn and returns its `Done`. It promises:

- Each action is carried out by the handler of its kind (`Handlers`: model, exec, read, write, git, browse; a `Tool`
  action by the handler of its name in `tools`; `emit` for text; `Save` needs nothing), and each result is reported
  in a step of its own, in the order the actions came.
- No step runs twice. Each step carries a key derived from the session and what it answers (`turn_key`,
  `result_key`), so a step sent again after a lost connection is answered from the journal (`replayed`) instead.
- `BUSY` is retried with bounded exponential backoff (`Retry`). A lost connection (a daemon restart, say) is
  reconnected with the same bounded backoff; the step in flight is sent again under its key, and the work left is
  what the core itself still waits for (`session/pending`), plus the text and `Done` of the answer that was lost.
- A session in the middle of another turn (a UI that stopped half-way) is carried along: the new turn waits behind
  that one in the core, so run_turn carries out the earlier turn's actions too, then its own.

A handler that raises (a named tool's too) stops the loop with its exception; the session still waits for that
action, and the next run_turn on it carries it out: a call that failed is a result the handler answers
(`ToolOutput(text, failed=True)`). `run_turn` started again with the same `turn` after a crash goes on from
`session/pending` (its Turn step is answered `replayed`) and carries out nothing that already has a result;
`resume_turn` does the same for whatever turn is running. Each handler gets the action's op and the action itself
(a handler that takes only the op still works); a named tool's handler gets the call's input, parsed, for the op.
`run_turn_blocking` is the same loop for callers without an event loop.

A function rather than a `Driver` class: everything a turn needs in order to resume lives in the daemon (the
journal, the keys, `session/pending`), so there is no state to keep between turns, and none to go stale across a
reconnect; the handlers and the retry policy are plain values passed in.
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import anyio
import msgspec

from devd import errors
from devd.client import AsyncClient
from devd.messages import (
    Action,
    Answer,
    Ask,
    Browse,
    Done,
    Event,
    Exec,
    Git,
    Output,
    Read,
    Reply,
    ToolCall,
    Turn,
    Write,
)

T = TypeVar("T")
C = TypeVar("C")

NAME_CHARS_MAX = 64  # a session name's length limit (devd.protocol.SESSION_NAME_PATTERN)


class ToolOutput(msgspec.Struct, frozen=True):
    """What a tool handler answers: the text the model will see, and whether the call failed."""

    text: str
    failed: bool = False


ToolResult: TypeAlias = ToolOutput | str  # a str is output that did not fail
# A handler takes the action's op and the action itself (`(op, action)`); one that takes only the op still works.
ToolHandler: TypeAlias = (
    Callable[[C, Action], ToolResult | Awaitable[ToolResult]] | Callable[[C], ToolResult | Awaitable[ToolResult]]
)
# A named tool's handler takes the call's input, parsed (a JSON object: the core dispatches no other), and the action:
# `action.op.Tool` has the name, and the input byte for byte as the model wrote it.
NamedTool: TypeAlias = ToolHandler[dict[str, Any]]


@dataclass(frozen=True)
class Handlers:
    """One callable per kind of action, each a plain function or a coroutine function.

    `model` answers the core's ask with a reply: text, calls, or both. The ask carries the whole conversation; in a
    session made with `Config(asks="delta")`, only the messages since the previous ask, from message `ask.from_` on
    (the handler keeps the rest, and reads `client.transcript` when `from_` is not the number it holds). A tool
    handler gets the action's op (`Exec`, `Read`, ...) and the action (for its id), and answers a `ToolOutput` or a
    str; a handler that takes only the op is called with the op alone. A kind without a handler
    is answered as a failed call ("this client cannot browse the web"), so the model learns it and the turn goes on.
    `tools` holds the handlers of named tools (the model's `{"Tool": {"name": N, "input": {...}}}` calls), by name:
    each gets the call's input as a dict (`NamedTool`); a name not there is answered as a failed call ("this client
    has no tool named N"). `emit` receives text for the user.
    """

    model: Callable[[Ask, Action], Reply | Awaitable[Reply]] | Callable[[Ask], Reply | Awaitable[Reply]]
    exec: ToolHandler[Exec] | None = None
    read: ToolHandler[Read] | None = None
    write: ToolHandler[Write] | None = None
    git: ToolHandler[Git] | None = None
    browse: ToolHandler[Browse] | None = None
    tools: Mapping[str, NamedTool] = field(default_factory=dict)
    emit: Callable[[str, Action], object] | Callable[[str], object] | None = None


class Retry(msgspec.Struct, frozen=True):
    """How long to keep trying: up to `attempts` tries of a call answered `BUSY`, and of each reconnect, waiting
    `first_delay_s` after the first, then twice as long each time, up to `max_delay_s`. The defaults wait about 13 s
    in all: enough for a daemon to restart."""

    attempts: int = 12
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def delays(self) -> list[float]:
        """The waits between tries, in seconds: one fewer than the tries."""
        return [min(self.first_delay_s * 2**i, self.max_delay_s) for i in range(self.attempts - 1)]

    async def call(
        self, attempt: Callable[[], Awaitable[T]], reconnect: Callable[[], Awaitable[None]]
    ) -> tuple[T, bool]:
        """attempt()'s answer, and whether the connection was replaced on the way. BUSY is tried again after each
        delay; a lost connection is reconnected (`reconnect_with`), at most `attempts` times. Raises the last
        BusyError, or the NotRunningError of the last reconnect, when the tries run out."""
        busy = iter(self.delays())
        reconnects = 0
        while True:
            try:
                return await attempt(), reconnects > 0
            except errors.BusyError:
                delay = next(busy, None)
                if delay is None:
                    raise
                await anyio.sleep(delay)
            except ConnectionError:
                reconnects += 1
                if reconnects > self.attempts:
                    raise
                await self.reconnect_with(reconnect)

    async def reconnect_with(self, reconnect: Callable[[], Awaitable[None]]) -> None:
        """reconnect() until it succeeds, waiting each delay after a refusal; the last refusal is raised."""
        for delay in self.delays():
            try:
                await reconnect()
                return
            except ConnectionError:  # NotRunningError included: the daemon is not back yet
                await anyio.sleep(delay)
        await reconnect()


class TurnError(errors.DevdError):
    """The turn cannot go on as asked: its id was ignored, or it ended without its `Done` reaching this client."""

    kind = "TURN"


def turn_key(session: str, turn: int) -> str:
    """The key of the step that starts turn `turn`. Keys name the session too: a fork inherits its source's keys,
    and must not take the source's answers for its own."""
    return f"devd.driver:{session}:turn:{turn}"


def result_key(session: str, action: int) -> str:
    """The key of the step that reports action `action`'s result (action ids never repeat within a session)."""
    return f"devd.driver:{session}:result:{action}"


async def run_turn(
    client: AsyncClient,
    session: str,
    prompt: str,
    handlers: Handlers,
    *,
    turn: int | None = None,
    retry: Retry | None = None,
) -> Done:
    """Start a turn of session with prompt, carry out its actions through handlers, and return its `Done`.

    `turn` defaults to the session's last step number plus one: each turn takes at least one step, so turns
    numbered this way always rise (a turn id not above one the session has had is ignored by the core). Raises
    TurnError when the turn is ignored or ends elsewhere, the `devd.errors` class of any other refusal, what a
    handler raises, and BusyError or NotRunningError once `retry` runs out."""
    retry = retry or Retry()
    if turn is None:
        turn = await _next_turn(client, session, retry)
    start = Event(Turn=Turn(id=turn, prompt=prompt))
    step = functools.partial(client.step_answer, session, start, key=turn_key(session, turn))
    answer, reconnected = await retry.call(step, client.reconnect)
    if not answer.actions:
        raise TurnError(
            f"turn {turn} was ignored: session {session!r} has had a turn id at least as high; pass a higher turn="
        )
    if answer.replayed or reconnected:
        # Started before (by a driver that stopped, or just before the connection went): the work left is what the
        # session waits for, and nothing that has its result is carried out again.
        owed, _ = await retry.call(functools.partial(client.pending, session), client.reconnect)
        if not owed:
            raise TurnError(f"turn {turn} of session {session!r} ran before and is over; its steps are in the journal")
        return await _carry_out(client, session, turn, deque(owed), handlers, retry)
    return await _carry_out(client, session, turn, deque(answer.actions), handlers, retry)


async def resume_turn(
    client: AsyncClient, session: str, handlers: Handlers, *, retry: Retry | None = None
) -> Done | None:
    """Carry out what the session still waits for (`session/pending`) through to the `Done` of its running turn: what
    a client does after a crash, whatever the turn. None when no turn is running. Nothing that has its result is
    carried out again."""
    retry = retry or Retry()
    owed, _ = await retry.call(functools.partial(client.pending, session), client.reconnect)
    if not owed:
        return None
    return await _carry_out(client, session, None, deque(owed), handlers, retry)


def run_turn_blocking(
    session: str,
    prompt: str,
    handlers: Handlers,
    *,
    address: str | Path | None = None,
    token: str | None = None,
    turn: int | None = None,
    retry: Retry | None = None,
) -> Done:
    """run_turn on a connection of its own (to `address`, default `devd.client.default_address()`), for callers
    without an event loop; the handlers may still be coroutine functions."""

    async def main() -> Done:
        async with AsyncClient.connect(address, token=token) as client:
            return await run_turn(client, session, prompt, handlers, turn=turn, retry=retry)

    return anyio.run(main)


async def _next_turn(client: AsyncClient, session: str, retry: Retry) -> int:
    """The session's last step number plus one, from a daemon that holds it: in a fleet, one that does not (it lists
    the session `held: false`, or not at all when it was made elsewhere since) knows only an old number, so the
    session is first called by name there (`session/pending`), which takes it or follows MOVED to its owner."""
    listed = functools.partial(client.list, 1, _just_before(session))
    page, _ = await retry.call(listed, client.reconnect)
    if not page.sessions or page.sessions[0].session != session or page.sessions[0].held is False:
        await retry.call(functools.partial(client.pending, session), client.reconnect)  # HANDLE if there is none
        page, _ = await retry.call(listed, client.reconnect)
    if not page.sessions or page.sessions[0].session != session:
        raise errors.HandleError(f"no session is named {session!r}; `session/list` shows the sessions there are")
    return page.sessions[0].seq + 1


def _just_before(name: str) -> str:
    """A cursor whose `session/list` page starts at `name`. Pages start after their cursor, and names are at most 64
    of A-Z a-z 0-9 . _ - ('z' the greatest), so no name lies between this string and `name`: name with its last
    character lowered by one, then 'z' up to 64 characters."""
    return name[:-1] + chr(ord(name[-1]) - 1) + "z" * (NAME_CHARS_MAX - len(name))


async def _report(
    client: AsyncClient, session: str, event: Event, key: str, queue: deque[Action], retry: Retry
) -> deque[Action]:
    """Step event under key; the work left after it: the queue, then the answer. After a reconnect, the queue is
    stale (the step may or may not have run before the connection went), and so is a replayed answer's (the step ran
    before, and its actions may have been carried out since), so the work left is the answer's own text and Done
    (its asks and calls are waited for, so pending has them), then what the core waits for now."""
    step = functools.partial(client.step_answer, session, event, key=key)
    try:
        answer, reconnected = await retry.call(step, client.reconnect)
    except errors.ConflictError:
        return queue  # another driver reported this result first: pending catches up with what it left
    if not reconnected and not answer.replayed:
        queue.extend(answer.actions)
        return queue
    pending, _ = await retry.call(functools.partial(client.pending, session), client.reconnect)
    return deque([a for a in answer.actions if not _awaited(a)] + pending)


async def _carry_out(
    client: AsyncClient, session: str, turn: int | None, queue: deque[Action], handlers: Handlers, retry: Retry
) -> Done:
    """Carry out actions until the `Done` of `turn` (of the running turn, when None)."""
    owed_before: list[int] = []
    while True:
        if not queue:
            # Answers ran out before this turn's Done: another client stepped the session (or a turn this one waited
            # behind is owed actions); what the core waits for now is the truth. The same debts twice: no way on.
            pending, _ = await retry.call(functools.partial(client.pending, session), client.reconnect)
            owed = [a.id for a in pending]
            if not pending or owed == owed_before:
                which = "its turn" if turn is None else f"turn {turn}"
                raise TurnError(
                    f"{which} of session {session!r} ended without its Done reaching this client: another "
                    "client stepped the session (a Cancel, say)"
                )
            owed_before = owed
            queue.extend(pending)
        action = queue.popleft()
        op = action.op
        if op.Done is not None:
            if turn is None or op.Done.turn == turn:
                return op.Done
            continue  # the end of a turn this one waited behind
        if op.Emit is not None:
            if handlers.emit is not None:
                shown = _handle(handlers.emit, op.Emit, action)
                if isinstance(shown, Awaitable):
                    await shown
            continue
        result = await _carry(handlers, action)
        if result is not None:
            queue = await _report(client, session, result, result_key(session, action.id), queue, retry)


def _awaited(action: Action) -> bool:
    """Whether the core waits for this action's result (as opposed to Emit, Save and Done)."""
    op = action.op
    return op.Emit is None and op.Save is None and op.Done is None


async def _carry(handlers: Handlers, action: Action) -> Event | None:
    """Carry out one action through its handler; the event that reports its result (None: nothing to report)."""
    op, id = action.op, action.id
    if op.Model is not None:
        reply = _handle(handlers.model, op.Model, action)
        return Event(Model=Answer(id=id, reply=await reply if isinstance(reply, Awaitable) else reply))
    if op.Exec is not None:
        return Event(Exec=await _tool(handlers.exec, op.Exec, action, "this client cannot run commands"))
    if op.Read is not None:
        return Event(File=await _tool(handlers.read, op.Read, action, "this client cannot read files"))
    if op.Write is not None:
        return Event(File=await _tool(handlers.write, op.Write, action, "this client cannot write files"))
    if op.Git is not None:
        return Event(Git=await _tool(handlers.git, op.Git, action, "this client cannot run git"))
    if op.Browse is not None:
        return Event(Browse=await _tool(handlers.browse, op.Browse, action, "this client cannot browse the web"))
    if op.Tool is not None:
        missing = f"this client has no tool named {op.Tool.name}"
        return Event(Tool=await _tool(handlers.tools.get(op.Tool.name), _input(op.Tool), action, missing))
    return None  # Save: the daemon has saved the session already


@functools.lru_cache(maxsize=256)
def _takes_action(handler: Callable[..., object]) -> bool:
    """Whether handler takes the action too (`(op, action)`), or only the op, as handlers written before did."""
    try:
        parameters = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2  # `print`-like (*args) handlers get the op alone, as before


def _handle(handler: Callable[..., T], op: object, action: Action) -> T:
    """handler(op, action), or handler(op) for a handler that takes only the op."""
    return handler(op, action) if _takes_action(handler) else handler(op)


def _input(call: ToolCall) -> dict[str, Any]:
    """A named tool call's input, parsed: always a JSON object, since the core dispatches no other."""
    parsed: dict[str, Any] = msgspec.json.decode(call.input, type=dict[str, Any])
    return parsed


async def _tool(handler: ToolHandler[C] | None, call: C, action: Action, missing: str) -> Output:
    """Carry out a call through handler; without one, a failed result saying `missing` (the model hears of it, and
    the turn goes on)."""
    id = action.id
    if handler is None:
        return Output(id=id, text=missing, failed=True)
    result = _handle(handler, call, action)
    if isinstance(result, Awaitable):
        result = await result
    if isinstance(result, str):
        return Output(id=id, text=result)
    return Output(id=id, text=result.text, failed=result.failed)
