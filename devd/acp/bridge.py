"""The `devd acp` process: ACP requests from the editor carried out on the daemon, and the daemon's notices of the
sessions the editor attached told back to it as `session/update`s.

What it promises:

- The ACP `sessionId` is the devd session name; every session, turn, approval and result is the daemon's. What this
  process holds (the sessions attached, the permission requests in flight, a `SessionView` per session) is derived
  from the daemon's notices and can be derived again: a fresh process, or another one, shows the same session.
- `session/prompt` starts a turn with an idempotency key and answers once the turn's `Done` is seen (`end_turn`,
  `cancelled`), or `refusal` when the session stalls (its reason in `_meta.devd.stalled`) or ends under the turn (a
  call past its deadline, a trap in the core: its reason, saying what carries it on, in `_meta.devd.ended`). The
  next prompt to a stalled session resumes it first; to an ended or poisoned one, recovers it from its last step and
  resumes it first.
- A daemon that goes away is reconnected (retrying for as long as it takes); each session is watched again from the
  last step seen, so the turns in flight are still answered, and a call lost on the way is sent again (each is
  idempotent: a prompt by its key, a cancel by its key, an approval by its digest). A prompt whose daemon stays away
  past OFFLINE_PATIENCE_S is answered with an error saying how to start it; reconnecting goes on.
- `session/load` replays the session's whole history (the daemon's journal) before it answers; after `load` or
  `resume`, the turns other clients drive on the session are told too, and either editor may answer a permission
  request: the first answer wins, and the other editor's request is withdrawn (`$/cancel_request`).
- An MCP server's question (`session/input`) is asked of the editor as a form where it offers one (its
  `clientCapabilities.elicitation.form`: ACP's `elicitation/create`, the MCP request's own shape, tied to the tool
  call), else, when a yes or a no answers it (every field it requires is a boolean, or has a default), as a
  permission request (Yes, No) about the tool call, titled with the question; one it cannot put to the editor is
  left to the other clients (`devd answer`), with a log line. The first answer anywhere wins: the editor's request
  is withdrawn when the question is decided elsewhere, and an editor's dismissal decides nothing.
- Errors are JSON-RPC errors: an unknown session is -32602 naming it; the daemon's own errors keep their code.
- Child sessions (delegated runs, the daemon's `session/child`): for an editor that opted in with
  `clientCapabilities.subagents`, each child is announced on its immediate parent with a `subagent_update`
  (`running`, its agent as `name`, its `task`, `capabilities: {cancel: true}`) before any update of its own, which
  then come under its own `sessionId` (its history from its first step, then live); its one terminal
  `subagent_update` (`completed`, `failed`, `cancelled`, `disconnected`) is sent after every update of it and after
  its permission requests are resolved (and after its own children's: deepest first), before its parent's prompt is
  answered. An editor may cancel a child, never prompt, load, resume or close it (-32602 saying so). Loading (or
  resuming) a parent announces its children too, each with its history, and the end of each that has ended (one
  whose session is gone: `disconnected`), deepest first. For an editor without subagents, a child is its delegate
  call's progress (the call's content: the child, its state and usage), and a child's permission requests are asked
  on the session the editor has.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc
import msgspec
import structlog

from devd import errors, protocol
from devd.acp import commands, wire
from devd.acp.translate import (
    AnsweredNotice,
    ApprovalNotice,
    DecidedNotice,
    InputNotice,
    Notice,
    SessionView,
    StalledNotice,
    StopReason,
    collapse,
    notice,
    tool_call_id,
    transcript_updates,
)
from devd.acp.wire import Id, Request, Response, Update
from devd.client import ActionsNotice, AsyncClient, NotRunningError, Reply
from devd.protocol import ChildNotice
from devd.render import in_devd_terms

log = structlog.get_logger("devd.acp")

# A session in these states (`session/list`'s `state`) takes no step until recovered: an editor's next prompt
# recovers it, since its user has no `devd recover` at hand.
ENDED_STATES = ("ended", "poisoned")
LIST_PAGE = 200  # daemon sessions scanned per `session/list` page
RECONNECT_FIRST_S = 0.05  # backoff while the daemon is away: from this, doubling, up to RECONNECT_MAX_S
RECONNECT_MAX_S = 1.0
BUSY_FIRST_S = 0.005  # a call answered BUSY is sent again after this, doubling, until past BUSY_MAX_S
BUSY_MAX_S = 2.0
OFFLINE_PATIENCE_S = 60.0  # a prompt waiting on a daemon that has been away this long is answered with an error
Stop = StopReason | Literal["refusal"]  # how a prompt ends: its turn's outcome, or a stall
MCP_ACCEPTED = "the daemon starts it when the session first needs its tools"
_MCP_KEYS = ("name", "command", "args", "env", "type", "url", "headers")  # of ACP's shape, as session/new takes it
TERMINAL = ("completed", "failed", "cancelled", "disconnected")
CHILD_SETTLE_S = 30.0  # a child's end waits this long at most for its updates and permission requests to be done
CHILD_LOOK_MS = 0  # `session/wait` asking whether a child has ended: a look, answered done at once if it has


# -- the editor's side ----------------------------------------------------------------------------------------------


class Withdrawn(Exception):
    """A request of ours to the editor was withdrawn before it was answered."""


class Editor:
    """Our end of the ACP connection: lines out, and the requests we sent, waiting for their answers."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        self._ids = itertools.count(1)
        self._waiting: dict[Id, tuple[anyio.Event, list[Response]]] = {}

    async def send(self, line: bytes) -> None:
        await self._write(line)

    async def update(self, session: str, update: Update) -> None:
        await self.send(
            wire.notification_line("session/update", wire.to_builtins(wire.session_update(session, update)))
        )

    def new_id(self) -> int:
        return next(self._ids)

    async def request(self, id: int, method: str, params: Any) -> Response:
        """Send a request and wait for its answer; Withdrawn if `withdraw(id)` came first."""
        event, slot = anyio.Event(), list[Response]()
        self._waiting[id] = (event, slot)
        try:
            await self.send(wire.request_line(id, method, params))
            await event.wait()
        finally:
            self._waiting.pop(id, None)
        if not slot:
            raise Withdrawn(id)
        return slot[0]

    def answered(self, response: Response) -> None:
        waiter = self._waiting.pop(response.id, None)
        if waiter is not None:  # else withdrawn already: its late answer has nothing left to decide
            waiter[1].append(response)
            waiter[0].set()

    async def withdraw(self, id: int) -> None:
        """Withdraw a request of ours (ACP's `$/cancel_request`); whoever waits on it gets Withdrawn."""
        waiter = self._waiting.pop(id, None)
        if waiter is None:
            return
        waiter[0].set()
        await self.send(wire.notification_line("$/cancel_request", {"requestId": id}))


# -- sessions attached ----------------------------------------------------------------------------------------------


@dataclass
class Waiter:
    """A `session/prompt` waiting for its turn's end."""

    key: str
    turn: int | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    stop: Stop | None = None
    stalled: str | None = None
    ended: str | None = None  # the session ended under the turn: why (`session/unwatched`)
    error: errors.DevdError | None = None
    cancel: bool = False  # the editor cancelled before the turn's id was known

    def end(
        self,
        stop: Stop | None,
        *,
        stalled: str | None = None,
        ended: str | None = None,
        error: errors.DevdError | None = None,
    ) -> None:
        if not self.done.is_set():
            self.stop, self.stalled, self.ended, self.error = stop, stalled, ended, error
            self.done.set()


@dataclass
class Asked:
    """A permission request in flight to the editor."""

    request: int
    digest: str


@dataclass
class Attached:
    view: SessionView
    held: list[Notice] | None = None  # while a load replays: the notices kept back until the replay is sent
    waiters: list[Waiter] = field(default_factory=list)
    asked: dict[int, Asked] = field(default_factory=dict)  # by action id
    approvals: dict[int, ApprovalNotice] = field(default_factory=dict)  # undecided, by action id
    inputs: dict[tuple[int, int], InputNotice] = field(default_factory=dict)  # MCP questions open, (action, request)
    queried: dict[tuple[int, int], int] = field(default_factory=dict)  # the editor's request in flight for each
    traced: int = 0  # the session's last trace record read (for `usage_update`)
    requested: set[int] = field(default_factory=set)  # actions the editor was asked about: a child's approval comes
    # twice to a watcher of it and of its parent (and may come again after its request was answered): asked once


@dataclass
class Kid:
    """A child session the editor was told of (or shown as a call's progress)."""

    parent: str
    agent: str
    delegated: bool = True  # made by a delegate call of its parent's turn (else by `session/spawn`)
    announced: bool = False  # its `subagent_update` running was sent
    ended: bool = False  # its terminal update is being sent (once)
    followed: anyio.Event = field(default_factory=anyio.Event)  # its history was sent: from then on, live
    done: anyio.Event = field(default_factory=anyio.Event)  # its terminal update was sent


def _unknown(session: str) -> errors.InvalidParamsError:
    return errors.InvalidParamsError(
        f"no session is named {session!r} in the daemon; `session/list` shows the sessions there are"
    )


# -- the bridge -----------------------------------------------------------------------------------------------------


class Bridge:
    """One editor, one daemon connection, and the sessions the editor attached."""

    def __init__(self, client: AsyncClient, editor: Editor, *, agent: str | None, token: str | None) -> None:
        self.client = client
        self.editor = editor
        self.agent = agent
        self.token = token
        self.editor_name = "an editor"
        self.forms = False  # the editor shows a form for an MCP question (its clientCapabilities.elicitation.form)
        self.sessions: dict[str, Attached] = {}
        self._tasks: anyio.abc.TaskGroup | None = None
        self._generation = 0  # connections made so far; a call that lost one waits for the next
        self._reconnected = anyio.Event()
        self._taken = 0  # notices taken from the client, and finished with: what `_caught_up()` compares
        self._finished = 0
        self._progress = anyio.Event()
        self.subagents = False  # the editor opted in to ACP subagents (`clientCapabilities.subagents`)
        self.kids: dict[str, Kid] = {}  # the child sessions seen, by name
        self.asked_for: dict[str, Attached] = {}  # without subagents: a child's approvals, asked on its ancestor

    # -- running

    async def run(self, lines: AsyncIterator[bytes]) -> None:
        """Serve the editor until its input ends; sessions go on in the daemon."""
        async with anyio.create_task_group() as tg:
            self._tasks = tg
            tg.start_soon(self._pump)
            tg.start_soon(self._supervise)
            async for line in lines:
                await self._incoming(line)
            tg.cancel_scope.cancel()

    async def _incoming(self, line: bytes) -> None:
        assert self._tasks is not None
        try:
            message = wire.decode(line)
        except errors.DevdError as e:
            await self.editor.send(wire.error_line(None, e))
            return
        if isinstance(message, Response):
            self.editor.answered(message)
        elif isinstance(message, Request):
            self._tasks.start_soon(self._answer, message)
        elif message.method == "session/cancel":
            self._tasks.start_soon(self._cancel_notified, message.params)

    async def _answer(self, request: Request) -> None:
        try:
            result = await self.handle(request.method, request.params)
        except errors.DevdError as e:
            await self.editor.send(wire.error_line(request.id, e))
        except Exception as e:  # a bug here must not end the editor's connection: say it, and go on
            log.exception("acp.request_failed", method=request.method)
            await self.editor.send(wire.error_line(request.id, errors.InternalError(f"devd acp failed: {e!r}")))
        else:
            await self.editor.send(wire.result_line(request.id, result))

    async def handle(self, method: str, raw: msgspec.Raw) -> Any:
        handler = METHODS.get(method)
        if handler is None:
            raise errors.MethodNotFoundError(f"devd acp does not implement {method!r}")
        return await handler(self, raw)

    # -- the daemon connection

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        """A daemon call, sent again on the next connection when this one is lost, and again while the session is
        BUSY (the daemon stepping it; every call made here is idempotent). An unknown session is the editor's -32602."""
        busy_wait = BUSY_FIRST_S
        while True:
            generation = self._generation
            try:
                return await self.client.call(method, params)
            except errors.BusyError:
                if busy_wait > BUSY_MAX_S:
                    raise
                await anyio.sleep(busy_wait)  # the daemon's own step of the session takes a moment: ask again
                busy_wait *= 2
            except ConnectionError:
                with anyio.move_on_after(OFFLINE_PATIENCE_S):
                    while self._generation == generation:
                        await self._reconnected.wait()
                if self._generation == generation:
                    raise self._away() from None
            except errors.DeadlineError:
                raise
            except errors.HandleError as e:
                session = params.get("session")
                if isinstance(session, str) and "no session" in str(e):
                    raise _unknown(session) from None
                raise

    async def hello(self) -> None:
        # The editor's name is its own free text: kept to what a client's name may hold (devd.protocol).
        editor = "".join(c for c in self.editor_name if c.isprintable() and c not in protocol.CLIENT_NAME_FORGING)
        client = {"name": f"devd acp: {editor}"[: protocol.CLIENT_NAME_CHARS_MAX]}
        await self.client.call("initialize", {"client": client, "token": self.token})

    async def _supervise(self) -> None:
        """Reconnect whenever the daemon goes away, and watch every attached session again from its last step."""
        while True:
            await self.client.wait_lost()
            log.warning("acp.daemon_lost", sessions=len(self.sessions))
            for attached in self.sessions.values():
                attached.view.reconnected()
            await self._reconnect()
            for name, attached in list(self.sessions.items()):
                await self._rewatch(name, attached)
            self._generation += 1
            self._reconnected.set()
            self._reconnected = anyio.Event()
            log.info("acp.daemon_back", sessions=len(self.sessions))
            assert self._tasks is not None
            self._tasks.start_soon(self._recheck_kids)

    async def _reconnect(self) -> None:
        delay = RECONNECT_FIRST_S
        away_since = anyio.current_time()
        told = False
        while True:
            try:
                await self.client.reconnect()
                await self.hello()
                return
            except (NotRunningError, ConnectionError, OSError):
                await anyio.sleep(delay)  # the daemon is away: try again, less often as it stays away
                delay = min(delay * 2, RECONNECT_MAX_S)
            if not told and anyio.current_time() - away_since > OFFLINE_PATIENCE_S:
                told = True  # the prompts waiting are answered; reconnecting goes on for the next ones
                for attached in self.sessions.values():
                    for waiter in attached.waiters:
                        waiter.end(None, error=self._away())

    @staticmethod
    def _away() -> errors.InternalError:
        return errors.InternalError(
            f"the devd daemon went away and has not come back within {OFFLINE_PATIENCE_S:.0f} s; start it again "
            "(`devd serve`, or `systemctl --user start devd`): its sessions and turns are kept, and loading the "
            "session shows where it stands"
        )

    async def _rewatch(self, name: str, attached: Attached) -> None:
        try:
            await self.client.call("session/watch", {"session": name, "since": attached.view.last_seq})
        except errors.HandleError:
            self._gone(name, "it no longer exists in the daemon")
        except errors.InvalidParamsError:  # history since then not kept: from now on
            await self.client.call("session/watch", {"session": name})
        except ConnectionError:
            pass  # lost again: the next round watches it

    # -- notices

    async def _pump(self) -> None:
        async for reply in self.client.notifications:
            self._taken += 1
            try:
                await self._notice(reply)
            except (msgspec.ValidationError, TypeError) as e:
                log.warning("acp.notice_unreadable", method=reply.method, error=str(e))
            finally:
                self._finished += 1
                self._progress.set()
                self._progress = anyio.Event()

    async def _caught_up(self) -> None:
        """Wait until every notice received before now has been dealt with."""
        target = self._taken + self.client.notifications.statistics().current_buffer_used
        while self._finished < target:
            await self._progress.wait()

    async def _notice(self, reply: Reply) -> None:
        params = reply.params if isinstance(reply.params, dict) else {}
        name = params.get("session")
        attached = self.sessions.get(name) if isinstance(name, str) else None
        if attached is not None and isinstance(name, str) and reply.method == "session/child":
            await self._child(name, attached, msgspec.convert(params, ChildNotice))
            return
        if attached is None and isinstance(name, str) and reply.method in ("session/approval", "session/decided"):
            await self._kid_approval(name, reply.method, params)  # a child's, told to its ancestors' watchers
            return
        if attached is None or not isinstance(name, str):
            return
        if reply.method == "session/unwatched":
            reason = str(params.get("reason", ""))
            if reason == "closed":
                self._gone(name, "it was closed")
            else:
                if reason.startswith("ended"):  # under its turn (kept until recovered): no Done comes
                    for waiter in attached.waiters:
                        waiter.end("refusal", ended=reason)
                if reason.startswith("rewound"):  # its steps after `seq` are gone: new ones
                    attached.view.last_seq = int(params.get("seq", 0))  # will be numbered from there

                assert self._tasks is not None
                self._tasks.start_soon(self._rewatch, name, attached)
            return
        n = notice(reply.method or "", params)
        if n is None:
            return
        if attached.held is not None:
            attached.held.append(n)
            return
        await self._live(name, attached, n)

    async def _live(self, name: str, attached: Attached, n: Notice) -> None:
        for update in attached.view.take(n):
            await self.editor.update(name, update)
        if isinstance(n, ActionsNotice):
            self._settle(attached)
            if n.event.Model is not None:  # a model call answered: how full the conversation is now
                assert self._tasks is not None
                self._tasks.start_soon(self._report_usage, name, attached)
        elif isinstance(n, ApprovalNotice):
            self._ask(name, attached, n)
        elif isinstance(n, DecidedNotice):
            attached.approvals.pop(n.action, None)
            asked = attached.asked.pop(n.action, None)
            if asked is not None:
                await self.editor.withdraw(asked.request)
        elif isinstance(n, StalledNotice):
            for waiter in attached.waiters:
                waiter.end("refusal", stalled=n.why)
        elif isinstance(n, InputNotice):
            self._query(name, attached, n)
        elif isinstance(n, AnsweredNotice):
            attached.inputs.pop((n.action, n.request), None)
            queried = attached.queried.pop((n.action, n.request), None)
            if queried is not None:
                await self.editor.withdraw(queried)

    def offer_commands(self, name: str) -> None:
        """Tell the editor the slash commands it may offer for the session (once attached)."""
        assert self._tasks is not None
        self._tasks.start_soon(self.editor.update, name, commands.OFFERED)

    async def _report_usage(self, name: str, attached: Attached) -> None:
        """`usage_update` after a model call: its request's and reply's tokens, from the session's newest trace
        records (those after the last read)."""
        try:
            page = await self.call("session/trace", {"session": name, "since": attached.traced})
        except errors.DevdError:  # a daemon without a trace, or the session went meanwhile
            return
        records = page.get("records", [])
        if records:
            attached.traced = max(attached.traced, int(records[-1]["n"]))
        calls = [r for r in records if r.get("kind") == "model" and r.get("input_tokens") is not None]
        if calls:
            used = int(calls[-1]["input_tokens"]) + int(calls[-1].get("output_tokens") or 0)
            await self.editor.update(name, wire.UsageUpdate(used, await self._window(name)))

    async def _window(self, name: str) -> int:
        """The model's context window, as `session/usage` says it (0: the daemon does not know it)."""
        try:
            usage = await self.call("session/usage", {"session": name})
        except errors.DevdError:
            return 0
        return int(usage.get("window") or 0)

    def _settle(self, attached: Attached) -> None:
        """End the prompts whose turn is done."""
        for waiter in list(attached.waiters):
            if waiter.turn is not None and waiter.turn in attached.view.outcomes:
                waiter.end(attached.view.outcomes[waiter.turn])

    def _gone(self, name: str, why: str) -> None:
        attached = self.sessions.pop(name, None)
        if attached is None:
            return
        for waiter in attached.waiters:
            waiter.end(None, error=errors.InvalidParamsError(f"session {name!r} ended: {why}"))

    # -- child sessions

    async def _child(self, parent: str, attached: Attached, n: ChildNotice) -> None:
        """A child of an attached session started, used tokens, or ended."""
        kid = self.kids.get(n.child)
        if kid is None:
            kid = self.kids[n.child] = Kid(parent, n.agent, delegated=n.action != 0)
            if self.subagents:
                await self._announce(parent, n.child, n.agent, _task(attached, n.action))
                self._follow(n.child, attached.view.workspace, kid)
        if not self.subagents:
            await self._progress_of(parent, attached, n)
        elif n.state in TERMINAL and not kid.ended:
            kid.ended = True
            assert self._tasks is not None
            self._tasks.start_soon(self._end_kid, parent, n.child, n.state, kid)

    async def _announce(self, parent: str, child: str, agent: str, task: str | None) -> None:
        kid = self.kids[child]
        kid.announced = True
        caps = wire.SubagentCapabilities(cancel=True)
        await self.editor.update(parent, wire.SubagentUpdate(child, agent, task, caps, "running"))

    def _follow(self, child: str, workspace: str | None, kid: Kid) -> None:
        """Tell the child's updates under its own id: its history from its first step, then as they come."""
        attached = Attached(SessionView(child, workspace), held=[])
        self.sessions[child] = attached
        assert self._tasks is not None
        self._tasks.start_soon(self._replay_kid, child, attached, kid)

    async def _replay_kid(self, child: str, attached: Attached, kid: Kid) -> None:
        try:
            try:
                await self.call("session/watch", {"session": child, "since": 0})
            except errors.InvalidParamsError:  # its oldest steps pruned: from now on
                await self.call("session/watch", {"session": child})
            await self._caught_up()
        except errors.DevdError:  # gone already: its end says how it ended
            attached.held = None
            self.sessions.pop(child, None)
        else:
            await self._replay(child, attached)
        finally:
            kid.followed.set()

    async def _end_kid(self, parent: str, child: str, state: str, kid: Kid) -> None:
        """The child's one terminal update, on its parent: after its history and every update of it, its permission
        requests resolved, and its own children's ends (deepest first)."""
        with anyio.move_on_after(CHILD_SETTLE_S):
            await kid.followed.wait()
            for below in [k for k in self.kids.values() if k.parent == child and k.ended]:
                await below.done.wait()
            while (attached := self.sessions.get(child)) is not None and attached.asked:
                await anyio.sleep(0.01)  # the daemon withdraws a cancelled child's approvals: their notices come
        await self._caught_up()
        attached = self.sessions.pop(child, None)
        if attached is not None:
            for asked in list(attached.asked.values()):
                await self.editor.withdraw(asked.request)
            for waiter in attached.waiters:
                waiter.end(None, error=errors.InvalidParamsError(f"subagent {child!r} ended {state}"))
            try:
                await self.client.call("session/unwatch", {"session": child})
            except (errors.DevdError, ConnectionError):
                pass  # gone, or the connection is: nothing more of it comes either way
        await self.editor.update(parent, wire.SubagentUpdate(child, state=state))  # type: ignore[arg-type]
        kid.done.set()

    async def _recheck_kids(self) -> None:
        """After a reconnect: a child announced and not ended whose end the daemon kept while it was away (its
        `session/child` never sent) is ended now, as the daemon says (gone: `disconnected`)."""
        for child, kid in list(self.kids.items()):
            if kid.ended or not kid.announced or not self.subagents:
                continue
            await self._settle_kid(child, kid, CHILD_LOOK_MS)

    async def _settle_kid(self, child: str, kid: Kid, timeout_ms: int) -> None:
        """Ask the daemon whether a child announced and not ended has ended (its notice lost with a connection, or
        with a daemon killed before it sent it); if so, its terminal update (gone: `disconnected`)."""
        try:
            waited = await self.call("session/wait", {"session": child, "turn": 1, "timeout_ms": timeout_ms})
        except errors.InvalidParamsError:  # -32602: no such session (closed)
            waited = {"done": True, "outcome": "disconnected"}
        except (errors.DevdError, ConnectionError):
            return  # asked again at the next reconnect; its notice may yet come
        if waited.get("done") and not kid.ended:
            kid.ended = True
            await self._end_kid(kid.parent, child, str(waited.get("outcome") or "disconnected"), kid)

    async def kids_told(self, parent: str) -> None:
        """Wait until every child of `parent` that has ended has had its terminal update sent. A child its turn
        delegated (not a spawned one, which may outlive the turn) has ended once the turn has: its end is asked of
        the daemon when its notice never came (a daemon killed before it sent it)."""
        with anyio.move_on_after(CHILD_SETTLE_S):
            for child, kid in list(self.kids.items()):
                if kid.parent == parent and kid.announced and not kid.ended and kid.delegated:
                    await self._settle_kid(child, kid, int(CHILD_SETTLE_S * 1000))
            for kid in [k for k in self.kids.values() if k.parent == parent and k.ended]:
                await kid.done.wait()

    async def announce_children(self, parent: str, workspace: str | None, ended_too: bool) -> None:
        """A parent loaded or resumed by an editor with subagents: each of its children not told of yet announced,
        with its history, then (`ended_too`) the end of each that has ended, its own children's first; a child whose
        session is gone ends `disconnected`. One still running goes on live."""
        if not self.subagents:
            return
        entry = await self.entry(parent)
        for child in (entry or {}).get("children") or []:
            if child in self.kids:
                continue
            try:
                bound = await self.call("session/agent", {"session": child})
                waited = await self.call("session/wait", {"session": child, "turn": 1, "timeout_ms": CHILD_LOOK_MS})
            except errors.DevdError:
                bound, waited = {}, {"done": True, "outcome": "disconnected"}
            if waited.get("done") and not ended_too:
                continue
            spawned = child.startswith(f"{parent}.s-")  # `session/spawn`'s children may outlive a turn
            kid = self.kids[child] = Kid(parent, str(bound.get("agent") or "?"), delegated=not spawned)
            await self._announce(parent, child, kid.agent, await self._first_prompt(child))
            if bound:
                self._follow(child, workspace, kid)
                await kid.followed.wait()
                await self.announce_children(child, workspace, ended_too)
            else:
                kid.followed.set()
            if waited.get("done"):
                kid.ended = True
                await self._end_kid(parent, child, str(waited.get("outcome") or "disconnected"), kid)

    async def _first_prompt(self, child: str) -> str | None:
        """A child's task: the prompt of its turn."""
        try:
            found = await self.call("session/transcript", {"session": child, "whole": True})
        except errors.DevdError:
            return None
        for message in found.get("messages", []):
            if isinstance(message, dict) and isinstance(message.get("User"), str):
                return str(message["User"])
        return None

    async def _progress_of(self, parent: str, attached: Attached, n: ChildNotice) -> None:
        """Without subagents: the child is its delegate call's progress (a spawned child: a call of its own)."""
        said = _child_said(n)
        call = attached.view.calls.get(n.action)
        if call is not None:
            content: list[wire.ToolContent] = [wire.ContentItem(wire.TextBlock(said))]
            await self.editor.update(parent, wire.ToolCallUpdate(call_id(n.action), content=content))
            return
        if n.action != 0:
            return  # its call has its result already
        spawned = f"child_{n.child}"
        if n.state == "running" and not self.kids[n.child].announced:
            self.kids[n.child].announced = True
            title = f"delegated run {n.child} ({n.agent})"
            await self.editor.update(parent, wire.ToolCall(spawned, title, kind="other", status="in_progress"))
        status: wire.ToolStatus | None = None if n.state == "running" else "failed"
        if n.state == "completed":
            status = "completed"
        update = wire.ToolCallUpdate(spawned, status=status, content=[wire.ContentItem(wire.TextBlock(said))])
        await self.editor.update(parent, update)

    async def _kid_approval(self, child: str, method: str | None, params: dict[str, Any]) -> None:
        """Without subagents: a child's approval (told to its ancestors' watchers) asked on the ancestor the editor
        has, under a call id of its own; its decision withdraws the request."""
        shown = self._shown_on(child)
        if shown is None or self.subagents:
            return
        n = notice(method or "", params)
        attached = self.asked_for.setdefault(child, Attached(SessionView(child, self.sessions[shown].view.workspace)))
        if isinstance(n, ApprovalNotice):
            self._ask(child, attached, n, shown)
        elif isinstance(n, DecidedNotice):
            attached.approvals.pop(n.action, None)
            asked = attached.asked.pop(n.action, None)
            if asked is not None:
                await self.editor.withdraw(asked.request)

    def _shown_on(self, child: str) -> str | None:
        """The attached session a child's permission request is asked on: its nearest ancestor the editor has (by
        the links seen, else by its name, `PARENT.dN`)."""
        kid = self.kids.get(child)
        while kid is not None:
            if kid.parent in self.sessions:
                return kid.parent
            kid = self.kids.get(kid.parent)
        found = [name for name in self.sessions if child.startswith(name + ".")]
        return max(found, key=len) if found else None

    # -- approvals

    def _ask(self, name: str, attached: Attached, n: ApprovalNotice, shown: str | None = None) -> None:
        if n.action in attached.asked or n.action in attached.requested:
            return  # announced again (a new watch after a reconnect): the editor is asked once
        attached.requested.add(n.action)
        attached.approvals[n.action] = n
        request = self.editor.new_id()
        attached.asked[n.action] = Asked(request, n.digest)
        assert self._tasks is not None
        self._tasks.start_soon(self._permission, name, attached, n, request, shown)

    async def _permission(
        self, name: str, attached: Attached, n: ApprovalNotice, request: int, shown: str | None = None
    ) -> None:
        call = attached.view.permission_call(n)
        if shown is not None:  # a child's call, asked on its ancestor: an id of its own there
            call = msgspec.structs.replace(call, tool_call_id=f"{name}/{call.tool_call_id}")
        params = {
            "sessionId": shown or name,
            "toolCall": wire.to_builtins(call),
            "options": wire.to_builtins(wire.PERMISSION_OPTIONS),
        }
        try:
            response = await self.editor.request(request, "session/request_permission", params)
        except Withdrawn:
            return
        finally:
            if (asked := attached.asked.get(n.action)) is not None and asked.request == request:
                del attached.asked[n.action]
        decision = _decision(response)
        if decision is None:
            return  # cancelled by the editor: its session/cancel says what to do
        body: dict[str, Any] = {"session": name, "action": n.action, "digest": n.digest, "decision": decision[0]}
        if decision[1]:
            body["remember"] = True
        try:
            await self.call("session/approve", body)
        except errors.ConflictError:
            pass  # decided first elsewhere: its session/decided has told us
        except errors.DevdError as e:
            log.warning("acp.approve_failed", session=name, action=n.action, error=str(e))

    # -- MCP servers' questions

    def _query(self, name: str, attached: Attached, n: InputNotice) -> None:
        key = (n.action, n.request)
        if key in attached.queried:
            return  # announced again (a new watch after a reconnect): the editor is asked once
        attached.inputs[key] = n
        if not self.forms and _yes(n.schema) is None:
            log.warning(
                "acp.question_not_asked",
                session=name,
                action=n.action,
                request=n.request,
                why="the editor shows no form (clientCapabilities.elicitation.form) and a yes or no does not answer it",
            )
            return
        request = self.editor.new_id()
        attached.queried[key] = request
        assert self._tasks is not None
        self._tasks.start_soon(self._question, name, attached, n, request)

    async def _question(self, name: str, attached: Attached, n: InputNotice, request: int) -> None:
        key = (n.action, n.request)
        try:
            if self.forms:
                params = {
                    "sessionId": name,
                    "toolCallId": tool_call_id(n.action),
                    "mode": "form",
                    "message": n.message,
                    "requestedSchema": n.schema,
                }
                answer = _elicited(await self.editor.request(request, "elicitation/create", params))
            else:
                call = msgspec.structs.replace(attached.view.permission_call_of(n.action), title=n.message)
                params = {
                    "sessionId": name,
                    "toolCall": wire.to_builtins(call),
                    "options": wire.to_builtins(wire.QUESTION_OPTIONS),
                }
                answer = _yes_or_no(await self.editor.request(request, "session/request_permission", params), n)
        except Withdrawn:
            return
        finally:
            if attached.queried.get(key) == request:
                del attached.queried[key]
        if answer is None:
            return  # dismissed: left to the other clients (or the editor's session/cancel)
        body: dict[str, Any] = {"session": name, "action": n.action, "request": n.request}
        body |= {"decline": True} if answer is False else {"answer": answer}
        try:
            await self.call("session/answer", body)
        except errors.ConflictError:
            pass  # decided first elsewhere: its session/answered has told us
        except errors.DevdError as e:
            log.warning("acp.answer_failed", session=name, action=n.action, request=n.request, error=str(e))

    # -- attaching

    async def attach(self, name: str, workspace: str | None) -> Attached:
        """Watch the session from now on (no replay)."""
        old = self.sessions.get(name)
        if old is not None and old.held is None:
            return old
        attached = Attached(SessionView(name, workspace))
        self.sessions[name] = attached
        try:
            await self.call("session/watch", {"session": name})
        except BaseException:
            self.sessions.pop(name, None)
            raise
        return attached

    async def load(self, name: str, workspace: str | None) -> None:
        """Watch the session from its first step, and tell the editor its whole history before anything new."""
        attached = Attached(SessionView(name, workspace), held=[])
        previous = self.sessions.get(name)
        if previous is not None:
            attached.waiters = previous.waiters
        self.sessions[name] = attached
        try:
            try:
                await self.call("session/watch", {"session": name, "since": 0})
            except errors.InvalidParamsError:  # the journal's oldest steps are pruned: the transcript tells them
                await self.call("session/watch", {"session": name})
                await self._caught_up()
                messages = await self.call("session/transcript", {"session": name})
                for update in transcript_updates(messages.get("messages", []), workspace):
                    await self.editor.update(name, update)
            await self._caught_up()
        except BaseException:
            self.sessions.pop(name, None)
            raise
        await self._replay(name, attached)

    async def _replay(self, name: str, attached: Attached) -> None:
        """Send what the watch's history said, collapsed, then go live (no await between the last batch and live)."""
        first = True
        while attached.held:
            batch, attached.held = attached.held, []
            updates: list[Update] = []
            for n in batch:
                updates += attached.view.take(n)
                if isinstance(n, ApprovalNotice):
                    attached.approvals[n.action] = n
                elif isinstance(n, DecidedNotice):
                    attached.approvals.pop(n.action, None)
                elif isinstance(n, InputNotice):
                    attached.inputs[(n.action, n.request)] = n
                elif isinstance(n, AnsweredNotice):
                    attached.inputs.pop((n.action, n.request), None)
            for update in collapse(updates) if first else updates:
                await self.editor.update(name, update)
            first = False
        attached.held = None
        self._settle(attached)
        for n in list(attached.approvals.values()):
            self._ask(name, attached, n)
        for q in list(attached.inputs.values()):
            self._query(name, attached, q)

    async def entry(self, name: str) -> dict[str, Any] | None:
        """The daemon's `session/list` entry of one session, or None."""
        cursor = _before(name)
        while True:
            page = await self.call("session/list", {"limit": 16, "cursor": cursor} if cursor else {"limit": 16})
            for entry in page.get("sessions", []):
                if entry.get("session") == name:
                    return dict(entry)
                if entry.get("session", "") > name:
                    return None
            cursor = page.get("next")
            if not cursor:
                return None

    # -- cancel

    async def _cancel_notified(self, raw: msgspec.Raw) -> None:
        try:
            p = wire.params(raw, wire.SessionIdParams, "session/cancel")
            await self.cancel(p.session_id)
        except errors.DevdError as e:
            log.warning("acp.cancel_failed", error=str(e))

    async def cancel(self, name: str) -> None:
        """Cancel the session's turns in flight (Cancel stepped for each) and withdraw its permission requests."""
        attached = self.sessions.get(name)
        if attached is None:
            return
        turns = set(attached.view.running)
        for waiter in attached.waiters:
            if waiter.turn is None:
                waiter.cancel = True
            else:
                turns.add(waiter.turn)
        for asked in list(attached.asked.values()):
            await self.editor.withdraw(asked.request)
        attached.asked.clear()
        for queried in list(attached.queried.values()):
            await self.editor.withdraw(queried)
        attached.queried.clear()
        for turn in sorted(turns):
            await self._step_cancel(name, turn)

    async def _step_cancel(self, name: str, turn: int) -> None:
        event = {"Cancel": {"turn": turn}}
        await self.call("session/step", {"session": name, "event": event, "key": f"acp:cancel:{turn}"})


def call_id(action: int) -> str:
    from devd.acp.translate import tool_call_id

    return tool_call_id(action)


def _task(attached: Attached, action: int) -> str | None:
    """The task of the delegate call `action` of the session, as the model gave it (None: not known here)."""
    call = attached.view.calls.get(action)
    given = call.raw_input.get("input") if call is not None else None
    task = given.get("task") if isinstance(given, dict) else None
    return task if isinstance(task, str) else None


def _child_said(n: ChildNotice) -> str:
    """A child's progress as its call shows it: `reviewer S.d2: running, 120 tokens in 1 call`."""
    why = f": {n.why}" if n.why else ""
    calls = f"{n.usage.calls} call{'' if n.usage.calls == 1 else 's'}"
    tokens = n.usage.input_tokens + n.usage.output_tokens
    return f"delegated run {n.child} ({n.agent}): {n.state}{why}, {tokens:,} tokens in {calls}"


def _decision(response: Response) -> tuple[str, bool] | None:
    """The approval an editor's answer means: (decision, remember), or None when it cancelled or failed."""
    return {
        "allow_once": ("allow", False),
        "allow_always": ("allow", True),
        "reject_once": ("deny", False),
        "reject_always": ("deny", False),  # the daemon remembers allowances only; each denial is its own
    }.get(_selected(response) or "")


def _selected(response: Response) -> str | None:
    """The option an editor selected in its answer to a permission request; None when it cancelled or failed."""
    if response.error is not None or response.result is None:
        return None
    try:
        result = msgspec.json.decode(response.result, type=wire.PermissionResult)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return result.outcome.option_id if result.outcome.outcome == "selected" else None


def _elicited(response: Response) -> dict[str, Any] | Literal[False] | None:
    """What an editor's form answered: the content (accepted), False (declined), or None (dismissed, or failed)."""
    if response.error is not None or not isinstance(response.result, msgspec.Raw):
        return None
    try:
        result = msgspec.json.decode(response.result)
    except msgspec.DecodeError:
        return None
    action = result.get("action") if isinstance(result, dict) else None
    if action == "accept":
        content = result.get("content")
        return content if isinstance(content, dict) else {}
    return False if action == "decline" else None


def _yes(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The answer a "yes" gives a question, when a yes answers it: every required field a boolean (true), the
    others left to their defaults; None when it asks for more."""
    given_fields, given_required = schema.get("properties"), schema.get("required")
    fields: dict[str, Any] = given_fields if isinstance(given_fields, dict) else {}
    required: list[Any] = given_required if isinstance(given_required, list) else []
    answer: dict[str, Any] = {}
    for name in required:
        spec = fields.get(name)
        if not isinstance(spec, dict):
            return None
        if spec.get("type") == "boolean":
            answer[name] = True
        elif "default" in spec:
            answer[name] = spec["default"]
        else:
            return None
    return answer


def _yes_or_no(response: Response, n: InputNotice) -> dict[str, Any] | Literal[False] | None:
    """What a permission request's answer means for a yes-or-no question: the yes answer, False (no), or None."""
    option = _selected(response)
    if option == "accept":
        return _yes(n.schema)
    return False if option == "decline" else None


def _before(name: str) -> str | None:
    """A cursor just below name, so that a page of `session/list` from it begins at name (or what follows it)."""
    if not name:
        return None
    last = name[-1]
    return name[:-1] + chr(ord(last) - 1) + "\U0010ffff" if ord(last) > 0 else name[:-1] or None


# -- the methods ----------------------------------------------------------------------------------------------------


async def _initialize(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.InitializeParams, "initialize")
    bridge.subagents = isinstance((p.client_capabilities or {}).get("subagents"), dict)
    elicitation = (p.client_capabilities or {}).get("elicitation")
    bridge.forms = isinstance(elicitation, dict) and isinstance(elicitation.get("form"), dict)
    if p.client_info is not None:
        bridge.editor_name = p.client_info.name
        await bridge.hello()
    from devd import __version__

    return {
        "protocolVersion": wire.PROTOCOL_VERSION,
        "agentCapabilities": {
            "loadSession": True,
            "promptCapabilities": {"image": False, "audio": False, "embeddedContext": True},
            "mcpCapabilities": {"http": True, "sse": False},
            "sessionCapabilities": {"list": {}, "resume": {}, "close": {}, "subagents": {}},
        },
        "authMethods": [],
        "agentInfo": {"name": "devd", "title": "devd", "version": __version__},
    }


def _absolute(cwd: str | None, method: str) -> str | None:
    if cwd is not None and not os.path.isabs(cwd):
        raise errors.InvalidParamsError(f"{method}: cwd must be an absolute path, not {cwd!r}")
    return os.path.normpath(cwd) if cwd else None


def _mcp_servers(servers: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The editor's MCP servers the daemon can take, in its shape (ACP's, the keys it knows), and why each other one
    cannot be, by name."""
    taken: list[dict[str, Any]] = []
    left: dict[str, str] = {}
    for server in servers:
        name = str(server.get("name", ""))
        if server.get("type") not in (None, "stdio", "http"):
            left[name] = f"devd does not connect to {server.get('type')} MCP servers (stdio and http only)"
        else:
            taken.append({k: server[k] for k in _MCP_KEYS if k in server})
    return taken, left


def _mcp_meta(servers: list[dict[str, Any]], left: dict[str, str], session: str) -> dict[str, Any]:
    """The editor's servers as devd took them: connected (the daemon starts each at first need), or not and why."""
    if left:
        log.warning("acp.mcp_not_connected", session=session, servers=sorted(left), why=next(iter(left.values())))
    shown = [{"name": str(s.get("name", "")), "connected": True, "why": MCP_ACCEPTED} for s in servers]
    return {"mcpServers": shown + [{"name": n, "connected": False, "why": why} for n, why in left.items()]}


async def _new(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.NewSessionParams, "session/new")
    cwd = _absolute(p.cwd, "session/new")
    body: dict[str, Any] = {"workspace": cwd}
    if bridge.agent is not None:
        body["agent"] = bridge.agent
    servers, left = _mcp_servers(p.mcp_servers)
    try:
        try:
            made = await bridge.call("session/new", body | ({"mcp_servers": servers} if servers else {}))
        except errors.InvalidParamsError as e:
            if not servers:
                raise
            # The session starts without them (an editor sends its servers to every agent): each is said not taken.
            made = await bridge.call("session/new", body)
            left |= {str(s.get("name", "")): f"the daemon did not take it: {e}" for s in servers}
            servers = []
    except errors.InvalidParamsError as e:
        raise errors.InvalidParamsError(f"cannot start a devd session in {cwd}: {e}") from None
    name = made["session"]
    await bridge.attach(name, cwd)
    bridge.offer_commands(name)
    return {"sessionId": name, "_meta": {"devd": _mcp_meta(servers, left, name)}}


async def _bring_mcp(bridge: Bridge, session: str, given: list[dict[str, Any]]) -> dict[str, Any]:
    """Give a loaded or resumed session the editor's servers again (the daemon keeps them in memory only)."""
    servers, left = _mcp_servers(given)
    try:
        await bridge.call("session/mcp", {"session": session, "mcp_servers": servers})
    except errors.InvalidParamsError as e:
        left |= {str(s.get("name", "")): f"the daemon did not take it: {e}" for s in servers}
        servers = []
    return _mcp_meta(servers, left, session)


async def _known(bridge: Bridge, name: str) -> dict[str, Any]:
    entry = await bridge.entry(name)
    if entry is None:
        raise _unknown(name)
    return entry


async def _workspace(bridge: Bridge, name: str, cwd: str | None) -> str | None:
    """The session's workspace as the daemon has it (the editor's cwd for a session the daemon does not drive);
    -32602 for a session that does not exist."""
    bound = await bridge.call("session/agent", {"session": name})
    workspace = bound.get("workspace") if isinstance(bound, dict) else None
    return workspace if isinstance(workspace, str) else cwd


async def _not_a_child(bridge: Bridge, name: str, verb: str) -> None:
    """-32602 for a child session (a subagent): an editor may watch and cancel it, not `verb` it."""
    entry = await bridge.entry(name)
    parent = None if entry is None else entry.get("parent")
    if parent is not None:
        raise errors.InvalidParamsError(
            f"session {name!r} is a subagent of session {parent!r} (a delegated run): an editor may watch it and "
            f"cancel it, not {verb} it; {verb} {parent!r} instead"
        )


async def _load(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.LoadSessionParams, "session/load")
    await _not_a_child(bridge, p.session_id, "load")
    workspace = await _workspace(bridge, p.session_id, _absolute(p.cwd, "session/load"))
    await bridge.load(p.session_id, workspace)
    await bridge.announce_children(p.session_id, workspace, ended_too=True)
    bridge.offer_commands(p.session_id)
    return {"_meta": {"devd": await _bring_mcp(bridge, p.session_id, p.mcp_servers)}}


async def _resume(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.LoadSessionParams, "session/resume")
    await _not_a_child(bridge, p.session_id, "resume")
    workspace = await _workspace(bridge, p.session_id, _absolute(p.cwd, "session/resume"))
    await bridge.attach(p.session_id, workspace)
    await bridge.announce_children(p.session_id, workspace, ended_too=False)
    bridge.offer_commands(p.session_id)
    return {"_meta": {"devd": await _bring_mcp(bridge, p.session_id, p.mcp_servers)}}


async def _list(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.ListSessionsParams, "session/list")
    cwd = _absolute(p.cwd, "session/list")
    real = os.path.realpath(cwd) if cwd is not None else None  # the daemon keeps a workspace as its real path
    query: dict[str, Any] = {"limit": LIST_PAGE}
    if p.cursor:
        query["cursor"] = p.cursor
    page = await bridge.call("session/list", query)
    sessions = []
    for entry in page.get("sessions", []):
        if entry.get("parent") is not None:
            continue  # a child session (a subagent): told of under its parent, never loaded by an editor
        try:
            bound = await bridge.call("session/agent", {"session": entry["session"]})
        except errors.InvalidParamsError:
            continue  # closed since the page was read
        workspace = bound.get("workspace")
        if not isinstance(workspace, str) or (real is not None and workspace != real):
            continue  # not a session the daemon drives in a workspace, or another workspace's
        meta = {k: entry[k] for k in ("state", "seq", "stalled") if k in entry} | {"agent": bound.get("agent")}
        sessions.append(
            {
                "sessionId": entry["session"],
                "cwd": workspace,
                "updatedAt": entry.get("last_used"),
                "title": entry.get("title"),
                "_meta": {"devd": meta},
            }
        )
    result: dict[str, Any] = {"sessions": sessions}
    if page.get("next"):
        result["nextCursor"] = page["next"]
    return result


async def _usage(bridge: Bridge, name: str) -> dict[str, int] | None:
    try:
        usage = await bridge.call("session/usage", {"session": name})
    except errors.DevdError:  # a daemon without accounting
        return None
    return dict(usage) if isinstance(usage, dict) else None


def _spent(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    spent = {
        k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in ("input_tokens", "output_tokens", "cached_tokens")
    }
    return {
        "inputTokens": spent["input_tokens"],
        "outputTokens": spent["output_tokens"],
        "cachedReadTokens": spent["cached_tokens"],
        "totalTokens": spent["input_tokens"] + spent["output_tokens"],
    }


async def _prompt(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.PromptParams, "session/prompt")
    name = p.session_id
    text = wire.prompt_text(p.prompt)
    if not text:
        raise errors.InvalidParamsError("session/prompt: the prompt has no text block")
    await _not_a_child(bridge, name, "prompt")
    attached = bridge.sessions.get(name) or await bridge.attach(name, await _workspace(bridge, name, None))
    entry = await _known(bridge, name)
    slash = commands.parse(text)
    if slash is not None:  # carried out here, not a turn
        said = await commands.run(bridge, attached, name, *slash)
        await bridge.editor.update(name, wire.AgentMessageChunk(wire.TextBlock(said)))
        return {"stopReason": "end_turn"}
    if entry.get("state") in ENDED_STATES:  # typing again is asking it to go on from its last step
        await bridge.call("session/recover", {"session": name})
        await bridge.call("session/resume", {"session": name})
    elif entry.get("stalled"):  # typing again is asking it to try again
        await bridge.call("session/resume", {"session": name})
    before = await _usage(bridge, name)
    waiter = Waiter(key=f"acp:{uuid.uuid4().hex}")
    attached.waiters.append(waiter)
    attached.view.expect_prompt(text)
    try:
        try:
            started = await bridge.call("session/prompt", {"session": name, "prompt": text, "key": waiter.key})
        except (errors.HandleError, errors.PoisonError) as e:  # ended again (HANDLE), or poisoned again (POISON)
            if ((await bridge.entry(name)) or {}).get("state") not in ENDED_STATES:
                raise
            # The turn carried on (above) ended the session again before this one could start: said as that end.
            waiter.end("refusal", ended=f"ended before this prompt's turn started ({e.kind}: {e})")
        else:
            waiter.turn = int(started["turn"])
            if waiter.cancel:
                await bridge.cancel(name)
            bridge._settle(attached)
        await waiter.done.wait()
        await bridge.kids_told(name)  # every child that ended is told so before its parent's prompt is answered
    finally:
        if waiter in attached.waiters:
            attached.waiters.remove(waiter)
    if waiter.error is not None:
        raise waiter.error
    meta: dict[str, Any] = {"turn": waiter.turn}
    if waiter.stalled is not None:
        meta["stalled"] = waiter.stalled
        reason = f"devd: the session is stalled: {waiter.stalled}. Prompt again to retry."
        await bridge.editor.update(name, wire.AgentMessageChunk(wire.TextBlock(reason)))
    if waiter.ended is not None:
        meta["ended"] = waiter.ended
        reason = f"devd: the session {in_devd_terms(waiter.ended, name)}. Prompt again to recover it and go on."
        await bridge.editor.update(name, wire.AgentMessageChunk(wire.TextBlock(reason)))
    result: dict[str, Any] = {"stopReason": waiter.stop, "_meta": {"devd": meta}}
    if (usage := _spent(before, await _usage(bridge, name))) is not None:
        result["usage"] = usage
    return result


async def _close(bridge: Bridge, raw: msgspec.Raw) -> Any:
    p = wire.params(raw, wire.SessionIdParams, "session/close")
    name = p.session_id
    await _known(bridge, name)
    await _not_a_child(bridge, name, "close")
    await bridge.cancel(name)
    attached = bridge.sessions.pop(name, None)
    await bridge.call("session/close", {"session": name})
    if attached is not None:
        for waiter in attached.waiters:
            waiter.end("cancelled")
    return {}


METHODS = {
    "initialize": _initialize,
    "session/new": _new,
    "session/load": _load,
    "session/resume": _resume,
    "session/list": _list,
    "session/prompt": _prompt,
    "session/close": _close,
}
