"""Child runs: a session delegates a task to another agent, run as a child session of its own (issue 34).

What it promises:
- A child is made by a `delegate` call (`devd.agent.kinds.delegate`) or by `session/spawn`. Its name comes from its
  parent and the delegating action (`d<ACTION>`) or the spawn's id (`s-<ID>`) (`child_name`), so one action never
  makes two children and a restart finds it again: carrying the delegation out again waits for the same child.
- Linked before it thinks: the parent's `child` record (the child's name, agent, task digest, depth, limits) is
  durable before the child session is made, and the child's `parent` record (its parent, action, depth and the
  parent's effective profile) before its turn is started; a write of either that fails leaves the child without a
  turn (it never asks the model) and fails the delegating call saying why.
- Held to the parent: the child runs with its own profile narrowed by its parent's effective one
  (`devd.agent.profiles.narrow`: each decision the stricter, the network only if both allow it, the stricter
  sandbox, the lesser bounds, the delegation limits the strictest along the chain), in the parent's workspace. A
  delegation to an agent not in `delegates`, past `max_depth`, `max_children` (running at once) or
  `max_children_per_turn`, with a budget past what the parent has left, or to an agent whose roots do not hold the
  parent's workspace, is refused naming the rule, and no child is made.
- The result: the delegating call waits for the child's turn to end. Its final answer (cut at the parent's
  `output_bytes_max`, saying so; checked against `output_schema`, a mismatch failing the child) is the call's
  result; a failed, cancelled or disconnected child fails the call saying which and why (a spend ceiling it was
  stalled at when cancelled, say). A child ends in exactly one terminal state, kept in its own log and its parent's
  (`ended`) and told to the parent's watchers (`session/child`), as is its usage after each model call.
- Cancel cascades: a Cancel step of the parent (or its close) first journals a `cascade` record, then cancels every
  running descendant, deepest first (each one's pending approvals withdrawn first, then its turn cancelled, then its
  terminal state recorded), before the parent's own Cancel is stepped; a daemon killed mid-cascade finishes it at
  start (`resume_cascades`).
- One budget tree: a child's model call is reserved against the turn and session ceilings of every ancestor too
  (`lineage`, read by `devd.agent.oversight`), and charged to their counters, so children running at once cannot pass
  an ancestor's ceiling together; the parent's `session/usage` carries its descendants' usage (`usage`).
- A crashed child driver is a failed child (`failed`): its turn is cancelled and the parent's call fails saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from devd import failpoints
from devd.agent import jsonschemas, records, tools
from devd.agent.kinds.delegate import DelegateInput
from devd.agent.profiles import Profile
from devd.agent.records import Binding, Cascade, ChildEnded, ChildLink, ChildState, ParentLink
from devd.errors import ConflictError, DevdError, HandleError, InvalidParamsError
from devd.messages import Cancel, Config, Event, Message, encode
from devd.protocol import ChildNotice, UsageTotals
from devd.sessions.entry import Family
from devd.storage.store import Counter, Record

if TYPE_CHECKING:
    from devd.agent.runner import Runtime

log = structlog.get_logger("devd.agent.children")

CHILD_NOTICE = "session/child"
TASK_KEY = "delegated"  # the key of a child's one turn: started once, however often its making is carried out
NAME_CHARS_MAX = 64
CLOSED_WHY = "its session was closed"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
FORK_CHARS_MAX = 64 * 1024  # of the parent's conversation a `fork` child starts with (its newest part)
CUT_NOTE = (
    "\n\n[devd: the answer of delegated run {child} was cut at {limit} bytes (output_bytes_max of agent {agent!r}); "
    "it was {size} bytes]"
)


def child_name(parent: str, part: str) -> str:
    """The child session's name: `PARENT.PART` when that is a session name, else one made from a digest of both."""
    name = f"{parent}.{part}"
    if _NAME.fullmatch(name) and name not in (".", ".."):
        return name
    return "child-" + hashlib.sha256(f"{parent}\0{part}".encode()).hexdigest()[:40]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Ancestor(msgspec.Struct, frozen=True):
    """A session above a child, as its spend is checked: its name, its agent's profile, and the turn the branch to the
    child was made in."""

    session: str
    profile: Profile
    turn: int


class Waited:
    """A turn someone waits for: set, with how it ended, when a Done of it is stepped."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.cancelled: bool | None = None


class Children:
    """The runtime's delegated runs: making, waiting, ending, cancelling and counting them."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._ended: dict[str, anyio.Event] = {}  # by child: set when its terminal state is durable
        self._turns: dict[tuple[str, int], Waited] = {}  # (session, turn) waited for: told when a Done of it is stepped
        self._outcomes: dict[
            tuple[str, int], bool
        ] = {}  # a child's turn seen ended (cancelled?), until its end is kept
        self._cascading: set[str] = set()  # parents whose descendants are being cancelled
        self._because: dict[str, tuple[ChildState, str]] = {}  # a child being ended by the daemon: as what, why
        self._stalls: dict[str, str] = {}  # why a child is stalled, until resumed
        self._locks: dict[str, anyio.Lock] = {}
        self._busy: dict[str, int] = {}  # children the daemon is making, reading or ending: a client waits out BUSY

    @property
    def sessions(self) -> Any:
        return self.runtime.sessions

    # -- the links ------------------------------------------------------------------------------------------------

    async def parent_link(self, session: str) -> ParentLink | None:
        """The session's link to its parent (None: it is no child), read with its binding once."""
        known = self.runtime.table.get(session)
        await self.runtime.binding(session, known)
        return known.link

    async def held_parent(self, session: str) -> str | None:
        """The parent of a session the runtime knows (None: it knows none, or the session is no child), read
        without making a record of a session it does not know (a raw session stepped a Turn)."""
        known = self.runtime.table.find(session)
        if known is None:
            return None
        await self.runtime.binding(session, known)
        return None if known.link is None else known.link.parent

    def parent_of(self, session: str) -> str | None:
        """The parent of a session whose link is in memory (a driven child's)."""
        known = self.runtime.table.find(session)
        return None if known is None or known.link is None else known.link.parent

    async def links(self, parent: str) -> list[tuple[int, ChildLink]]:
        """The parent's children, each with its delegating action (0: spawned), in the order they were made."""
        found = await self.sessions.records(parent, (records.CHILD,))
        links = [(r.action, records.decode(r.body, ChildLink)) for r in found]
        return [(action, link) for action, link in links if link.parent == parent]  # a fork's are its source's

    async def ends(self, session: str) -> dict[str, ChildEnded]:
        """The terminal states kept in the session's log: its children's (in a parent's), or its own (a child's)."""
        found = await self.sessions.records(session, (records.ENDED,))
        return {e.child: e for e in (records.decode(r.body, ChildEnded) for r in found)}

    async def family(self, names: list[str]) -> dict[str, Family]:
        """The parent and children of each named session that has either (read only for those: a list of many
        sessions asks the store twice, then once for each session of a family)."""
        parents, children = (
            set(await self.sessions.recorded(records.CHILD)),
            set(await self.sessions.recorded(records.PARENT)),
        )
        found: dict[str, Family] = {}
        for name in names:
            if name not in parents and name not in children:
                continue
            kept = await self.sessions.records(name, (records.CHILD, records.PARENT))
            up = [records.decode(r.body, ParentLink).parent for r in kept if r.kind == records.PARENT]
            links = [records.decode(r.body, ChildLink) for r in kept if r.kind == records.CHILD]
            down = [link.child for link in links if link.parent == name]
            found[name] = Family(up[-1] if up else None, down)
        return found

    # -- delegating -----------------------------------------------------------------------------------------------

    async def delegate(self, parent: str, action: int, profile: Profile, ask: DelegateInput) -> tools.Result:
        """Carry out action `action` of `parent`, a delegation: make its child (or find it again) and wait for its
        end; the result the model is told."""
        name = child_name(parent, f"d{action}")
        link = next((kept for _, kept in await self.links(parent) if kept.child == name), None)
        if link is None:
            admitted = await self._admit(parent, profile, ask, name, None)
            if isinstance(admitted, str):
                return tools.Result(admitted, failed=True)
            link = admitted
        why = await self._make(parent, action, profile, ask, link)
        if why is not None:
            return tools.Result(why, failed=True)
        ended = await self._wait_end(parent, action, link)
        return self._result(profile, link, ended)

    async def spawn(self, parent: str, spawn_id: str, ask: DelegateInput) -> tuple[str, int]:
        """`session/spawn`: the child of `parent` for the caller's id, made (once) and started; its name and turn.
        INVALID_PARAMS naming what is wrong (no such parent, a rule it would break, a link that could not be kept)."""
        if not await self.sessions.known(parent):
            raise InvalidParamsError(f"there is no session {parent!r} to spawn a child of; `session/list` shows them")
        binding = await self.runtime.binding(parent)
        if binding is None:
            raise InvalidParamsError(
                f"session {parent!r} was not made with an agent: only an agent's session has children"
            )
        profile = self.runtime._profile(parent, binding)
        name = child_name(parent, f"s-{spawn_id}")
        found = [(a, kept) for a, kept in await self.links(parent) if kept.child == name]
        if found:
            link = found[0][1]
            if (link.agent, link.task_digest) != (ask.agent, digest(ask.task)):
                raise ConflictError(
                    f"id {spawn_id!r} was used for another run of session {parent!r} (agent {link.agent!r}, another "
                    f"task): its child is {name}; use a new id for a new run"
                )
        else:
            if ask.agent not in profile.delegates:
                allowed = ", ".join(profile.delegates) or "none"
                raise InvalidParamsError(
                    f"refused: agent {profile.name!r} of session {parent!r} may delegate only to the agents its "
                    f"delegates list ({allowed}), not to {ask.agent!r}; no child was made"
                )
            admitted = await self._admit(parent, profile, ask, name, spawn_id)
            if isinstance(admitted, str):
                raise InvalidParamsError(f"{admitted}; no child was made")
            link = admitted
        why = await self._make(parent, 0, profile, ask, link)
        if why is not None:
            raise InvalidParamsError(why)
        known = self.runtime.table.get(name)
        return name, max(known.turn, 1)

    async def _admit(
        self, parent: str, profile: Profile, ask: DelegateInput, name: str, spawn_id: str | None
    ) -> ChildLink | str:
        """The link of a new child, or why it is refused (naming the rule): nothing is written either way."""
        runtime = self.runtime
        if ask.agent not in runtime.profiles:
            return f"refused: there is no agent {ask.agent!r} in the daemon's agents file"
        above = await self.parent_link(parent)
        depth = (0 if above is None else above.depth) + 1
        if depth > profile.max_depth:
            return (
                f"refused: the delegated run would be at depth {depth} of its tree, past max_depth = "
                f"{profile.max_depth} (the strictest of the agents along its chain; the first session is depth 0)"
            )
        kids = await self.links(parent)
        ended = await self.ends(parent)
        running = [kept for _, kept in kids if kept.child not in ended]
        if profile.max_children is not None and len(running) >= profile.max_children:
            return (
                f"refused: {len(running)} delegated runs of this session are running, and max_children = "
                f"{profile.max_children} (the strictest along its chain); wait for one to end"
            )
        turn = runtime.table.get(parent).turn
        this_turn = [kept for _, kept in kids if kept.turn == turn]
        if profile.max_children_per_turn is not None and len(this_turn) >= profile.max_children_per_turn:
            return (
                f"refused: this turn has made {len(this_turn)} delegated runs, and max_children_per_turn = "
                f"{profile.max_children_per_turn} (the strictest along its chain)"
            )
        if ask.budget is not None:
            left = await runtime.oversight.headroom(parent, profile, turn)
            if left is not None and ask.budget > left:
                return (
                    f"refused: a budget of {ask.budget} tokens is more than this session has left ({left} tokens, "
                    "under the tightest of its and its ancestors' ceilings)"
                )
        binding = await runtime.binding(parent)
        assert binding is not None
        try:
            runtime.check(ask.agent, binding.workspace)
        except InvalidParamsError as e:
            return (
                f"refused: the delegated run would work in this session's workspace, which agent {ask.agent!r} "
                f"may not: {e}"
            )
        if ask.output_schema is not None:
            problem = jsonschemas.problem(ask.output_schema)
            if problem is not None:
                return f"refused: the output_schema {problem}"
        return ChildLink(
            parent=parent,
            child=name,
            agent=ask.agent,
            task_digest=digest(ask.task),
            depth=depth,
            turn=turn,
            max_depth=profile.max_depth,
            max_children=profile.max_children,
            max_children_per_turn=profile.max_children_per_turn,
            budget=ask.budget,
            id=spawn_id,
            output_schema=ask.output_schema,
        )

    async def _make(
        self, parent: str, action: int, profile: Profile, ask: DelegateInput, link: ChildLink
    ) -> str | None:
        """Make the child as far as it is not made yet (the links, its session, its turn): None, or why it could not
        be (it never asks the model; its terminal state says so)."""
        with self._holding(link.child):
            try:
                return await self._made(parent, action, profile, ask, link)
            except HandleError:
                if await self.sessions.known(link.child):
                    raise
            # Closed by a client while it was being made: it ends disconnected (never a HANDLE error out of the
            # parent's call, which stopped the parent's driver and left its turn waiting for ever).
            await self.finish(parent, action, link, "disconnected", CLOSED_WHY)
            return None

    async def _made(
        self, parent: str, action: int, profile: Profile, ask: DelegateInput, link: ChildLink
    ) -> str | None:
        runtime, name = self.runtime, link.child
        binding = await runtime.binding(parent)
        assert binding is not None
        kept = [kept for _, kept in await self.links(parent) if kept.child == name]
        if not kept:
            try:
                failpoints.hit("children.parent_link")
                await self._record(parent, records.CHILD, action, link)
            except (OSError, DevdError) as e:
                return (
                    f"the delegated run was not started: its link could not be kept in this session's log ({_why(e)})"
                )
            log.info("agent.child_linked", session=parent, action=action, child=name, agent=link.agent)
        ended = (await self.ends(parent)).get(name)
        if ended is not None:
            return None  # it ended already (before a restart): its end is its result
        try:
            if not await self.sessions.known(name):
                await self.sessions.new(name, encode(Config(model=runtime.profiles[link.agent].model)))
                await runtime.bind(name, Binding(link.agent, binding.workspace, binding.identity))
            known = runtime.table.get(name)
            made = await runtime.binding(name, known)
            mine = (
                made is not None
                and (made.agent, made.workspace) == (link.agent, binding.workspace)
                and (known.link.parent == parent if known.link is not None else known.turn == 0)
            )
            if not mine:  # a session of that name that is no child of this run's (a client made it first)
                why = f"the delegated run was not started: a session named {name} exists already and is not its own"
                await self.finish(parent, action, link, "failed", why, own=False)
                return why
            if known.link is None:
                up = ParentLink(
                    parent=parent,
                    action=action,
                    depth=link.depth,
                    turn=link.turn,
                    ceiling=msgspec.structs.replace(profile, project=None),
                )
                failpoints.hit("children.child_link")
                await self.sessions.add_record(Record(name, 0, records.PARENT, 0, records.encode(up)))
                known.link = up
            if link.budget is not None:
                await runtime.oversight.set_budget(name, link.budget)
        except (OSError, DevdError) as e:
            if isinstance(e, HandleError) and not await self.sessions.known(name):
                raise  # closed meanwhile, not a write that failed: `_make` ends it disconnected
            why = f"the delegated run was not started: its link could not be kept in its own session's log ({_why(e)})"
            await self.finish(parent, action, link, "failed", why)
            return why
        # Its one turn, under its key: started once, however often this is carried out (a restart between the
        # turn's record and its step finds no step under the key, and starts it).
        started = await self.sessions.keyed_turn(name, f"prompt:{TASK_KEY}") is not None
        task = ask.task if ask.context == "task" else await self._forked(parent, ask.task)
        await runtime.prompt(name, task, TASK_KEY)
        if not started:
            self._tell(parent, action, link, "running", UsageTotals())
        return None

    async def _forked(self, parent: str, task: str) -> str:
        """The prompt of a `fork` child: the parent's conversation so far (its newest FORK_CHARS_MAX), then the task."""
        lines = [_line(m) for m in await self.sessions.transcript(parent)]
        told = "\n".join(line for line in lines if line)[-FORK_CHARS_MAX:]
        return f"The conversation of the session that delegated this task to you, so far:\n{told}\n\nYour task: {task}"

    async def _wait_end(self, parent: str, action: int, link: ChildLink) -> ChildEnded:
        """The child's terminal state, once it has one (at once when it has one already). While the parent's
        descendants are being cancelled, a cancelled child's end is no result: the parent's Cancel comes next."""
        name = link.child
        while True:
            event = self._ended.setdefault(name, anyio.Event())  # before the look: an end meanwhile sets it
            ended = (await self.ends(parent)).get(name)
            if ended is None:
                ended = await self.settle(parent, action, link)
            if ended is not None:
                if ended.state == "cancelled" and parent in self._cascading:
                    await anyio.sleep_forever()  # stopped by the parent's Cancel, which is stepped next
                return ended
            await event.wait()

    def _result(self, profile: Profile, link: ChildLink, ended: ChildEnded) -> tools.Result:
        """What the delegating call is answered."""
        if ended.state == "completed":
            answer = ended.answer or ""
            data = answer.encode()
            limit = profile.output_bytes_max
            if len(data) > limit:
                cut = data[:limit].decode(errors="ignore")
                answer = cut + CUT_NOTE.format(child=link.child, limit=limit, agent=profile.name, size=len(data))
            return tools.Result(answer)
        why = f": {ended.why}" if ended.why else ""
        return tools.Result(
            f"the delegated run {link.child} (agent {link.agent!r}) {ended.state}{why}",
            failed=True,
            why=f"child {ended.state}",
        )

    # -- ending -----------------------------------------------------------------------------------------------------

    def holds(self, session: str) -> bool:
        """Whether the daemon's own calls on a child (making, reading or ending it) may hold it now: a client's call
        answered BUSY waits them out, as it does a driver's."""
        return session in self._busy

    @contextlib.contextmanager
    def _holding(self, child: str) -> Iterator[None]:
        self._busy[child] = self._busy.get(child, 0) + 1
        try:
            yield
        finally:
            self._busy[child] -= 1
            if not self._busy[child]:
                del self._busy[child]

    async def settle(self, parent: str, action: int, link: ChildLink) -> ChildEnded | None:
        """The child's terminal state, recorded now if its turn has ended (or its session is gone) and none was; None
        while it runs."""
        with self._holding(link.child):
            try:
                return await self._settle(parent, action, link)
            except HandleError:  # closed between the look at whether it is there and a read of it
                if await self.sessions.known(link.child):
                    raise
            return await self.finish(parent, action, link, "disconnected", CLOSED_WHY)

    async def _settle(self, parent: str, action: int, link: ChildLink) -> ChildEnded | None:
        name = link.child
        if not await self.sessions.known(name):
            return await self.finish(parent, action, link, "disconnected", CLOSED_WHY)
        known = self.runtime.table.get(name)
        await self.runtime.binding(name, known)
        if known.turn == 0 or await self.sessions.keyed_turn(name, f"prompt:{TASK_KEY}") is None:
            return None  # not started yet (its making goes on)
        pending = [a for a in await self.sessions.pending(name) if a.op.Emit is None and a.op.Save is None]
        if any(a.op.Done is None for a in pending):
            return None
        because = self._because.get(name)
        if because is not None:
            return await self.finish(parent, action, link, *because)
        if await self._cancelled(name, known.turn):
            stall = self._stalls.get(name)
            why = "its turn was cancelled" + (f" while it was stalled: {stall}" if stall else "")
            return await self.finish(parent, action, link, "cancelled", why)
        return await self.finish(parent, action, link, "completed", None)

    async def _cancelled(self, session: str, turn: int) -> bool:
        seen = self._outcomes.get((session, turn))
        if seen is not None:
            return seen
        since = 0
        while True:
            rows = await self.sessions.steps(session, since, 256)
            for _, event in rows:
                if event.startswith(b'{"Cancel"') and cancel_turn(event) == turn:
                    return True
            if len(rows) < 256:
                return False
            since = rows[-1][0]

    async def finish(
        self, parent: str, action: int, link: ChildLink, state: ChildState, why: str | None, *, own: bool = True
    ) -> ChildEnded:
        """Record the child's one terminal state (a completed one's answer, checked against its schema) in its log
        and its parent's, tell the parent's watchers, and wake whoever waits; the state kept already if it has one."""
        name = link.child
        lock = self._locks.setdefault(name, anyio.Lock())
        async with lock:
            kept = (await self.ends(parent)).get(name)
            if kept is None and own and self.sessions.seq(name) is not None:  # a closed parent's log is gone: the
                # child's own keeps its end (a second end of a cancelled child said "its turn was cancelled")
                kept = (await self.ends(name)).get(name)
            if kept is not None:
                return kept
            answer = None
            if state == "completed":
                answer = await self._answer(name)
                problem = None if link.output_schema is None else _mismatch(link.output_schema, answer)
                if problem is not None:
                    state, why = "failed", f"its final answer does not satisfy the output_schema: {problem}"
            ended = ChildEnded(name, state, why, answer)
            body = records.encode(ended)
            seq = self.sessions.seq(name) if own else None  # not `own`: the session of its name is another's
            if seq is not None:  # else its session is gone: the parent's record is its end
                with contextlib.suppress(HandleError):
                    await self.sessions.add_record(Record(name, seq, records.ENDED, 0, body))
            await self.sessions.add_record(Record(parent, self.sessions.seq(parent) or 0, records.ENDED, action, body))
            failpoints.hit("children.ended")
            log.info("agent.child_ended", session=parent, child=name, state=state, why=(why or "")[:300])
            self._because.pop(name, None)
            self._stalls.pop(name, None)
            for key in [k for k in self._outcomes if k[0] == name]:
                del self._outcomes[key]
        self._tell(parent, action, link, state, await self._used(name), why)
        event = self._ended.pop(name, None)
        if event is not None:
            event.set()
        return ended

    async def _answer(self, child: str) -> str:
        """The child's final answer: the text of the last answer of its conversation."""
        for message in reversed(await self.sessions.transcript(child)):
            if message.Agent is not None:
                return message.Agent.text or ""
        return ""

    async def failed(self, child: str, why: str) -> None:
        """The child's driver failed (a fault, a bug, its core poisoned): its own running children are cancelled and
        its turn too (nothing more of it runs), and it ends `failed`. Run as a task of the runtime's: what goes wrong
        here is logged, never raised into the runtime."""
        try:
            link = await self.parent_link(child)
            if link is None:
                return
            because = f"the daemon failed carrying it out: {why}"
            self._because[child] = ("failed", because)
            before = set(self._cascading)
            self._cascading.add(child)
            try:  # its own running children first: nothing below a failed child goes on
                await self._cancel_below(child, f"the delegated run {child} above it failed")
            finally:
                self._cascading = before
            await self._end_turn(child)
            found = [(a, kept) for a, kept in await self.links(link.parent) if kept.child == child]
            if found:
                await self.finish(link.parent, found[0][0], found[0][1], "failed", because)
        except Exception as e:
            log.error("agent.child_failure_not_kept", child=child, error=_why(e)[:300])

    async def _end_turn(self, child: str) -> None:
        """Cancel the child's turn (a session that cannot be stepped any more, closed or poisoned, is let be)."""
        known = self.runtime.table.get(child)
        turn = max(known.turn, 1)
        with self._holding(child):
            try:
                await self.sessions.step(child, Event(Cancel=Cancel(turn=turn)), f"ended:{turn}")
            except DevdError as e:
                log.warning("agent.child_turn_not_cancelled", child=child, error=_why(e)[:300])

    # -- observing ----------------------------------------------------------------------------------------------------

    def turn_ended(self, session: str, turn: int, cancelled: bool) -> None:
        """A Done of the session's turn was stepped (called by the runtime's observer; must not block)."""
        waited = self._turns.pop((session, turn), None)
        if waited is not None:
            waited.cancelled = cancelled
            waited.event.set()
        known = self.runtime.table.find(session)
        if known is not None and known.link is not None and self.runtime._tg is not None:
            self._outcomes[(session, turn)] = cancelled
            self.runtime._tg.start_soon(self._ended_child, session)

    def session_ended(self, session: str) -> None:
        """The session ended under its running turn (kept until `session/recover`), or was closed: no Done can come,
        so every waiter of its turns looks again, and is answered the error that says it ended (or is gone)."""
        for key in [k for k in self._turns if k[0] == session]:
            self._turns.pop(key).event.set()

    async def gone(self, child: str, parent: str) -> None:
        """The child's session ended (closed, say) while its parent may wait for it: it ends `disconnected` unless it
        had ended already."""
        try:
            if not await self.sessions.known(parent):
                return
            found = [(a, kept) for a, kept in await self.links(parent) if kept.child == child]
            if found and not await self.sessions.known(child):
                await self.settle(parent, found[0][0], found[0][1])
        except Exception as e:  # a task of the runtime's: logged, never raised into it
            log.warning("agent.child_end_not_kept", child=child, error=_why(e)[:300])

    async def _ended_child(self, child: str) -> None:
        link = await self.parent_link(child)
        if link is None:
            return
        try:
            found = [(a, kept) for a, kept in await self.links(link.parent) if kept.child == child]
            if found:
                await self.settle(link.parent, found[0][0], found[0][1])
        except Exception as e:  # the parent gone meanwhile (nothing waits for it), a fault: never into the runtime
            log.warning("agent.child_end_not_kept", child=child, error=_why(e)[:300])

    def ancestors(self, session: str) -> list[str]:
        """The session's ancestors whose links are in memory, nearest first."""
        found: list[str] = []
        parent = self.parent_of(session)
        while parent is not None and parent not in found:
            found.append(parent)
            parent = self.parent_of(parent)
        return found

    def stalled(self, session: str, why: str) -> None:
        if self.parent_of(session) is not None:
            self._stalls[session] = why

    def resumed(self, session: str) -> None:
        self._stalls.pop(session, None)

    async def used(self, child: str) -> None:
        """A model call of a child was charged: its parent's watchers are told its usage, and each ancestor's watchers
        the usage of the run below them it is part of (summed over its descendants), so a grandchild's use is live to
        the first session's watchers too. A notice, never a reason to stop the child: what goes wrong reading it is
        logged."""
        try:
            while True:
                link = await self.parent_link(child)
                if link is None:
                    return
                found = [(a, kept) for a, kept in await self.links(link.parent) if kept.child == child]
                usage = await self._used(child)
                ended = (await self.ends(link.parent)).get(child)
                # Looked at after the last read, with no await before the notice: a running notice is never told
                # after its terminal one (read before the usage, an end recorded meanwhile came first, then running).
                if not found or ended is not None or child in self._because:  # being ended: its end is told next
                    return
                self._tell(link.parent, found[0][0], found[0][1], "running", usage)
                child = link.parent
        except DevdError as e:
            log.warning("agent.child_usage_not_told", child=child, error=_why(e)[:300])

    def _tell(
        self, parent: str, action: int, link: ChildLink, state: ChildState, usage: UsageTotals, why: str | None = None
    ) -> None:
        self.sessions.tell(parent, CHILD_NOTICE, ChildNotice(parent, action, link.child, link.agent, state, usage, why))

    # -- waiting for a turn (`session/wait`) ------------------------------------------------------------------------

    async def wait(
        self, session: str, turn: int, timeout_s: float | None
    ) -> tuple[bool, str | None, str | None, str | None]:
        """Whether the session's turn has ended within the timeout: (done, outcome, answer, why). Each look at the
        turn is made whatever the timeout (only the waiting between looks is timed), so a turn that has ended is
        answered done at once, even to a wait of no time: a waiter cannot miss the end."""
        deadline = anyio.current_time() + (timeout_s if timeout_s is not None else float("inf"))
        while True:
            waited = self._turns.setdefault((session, turn), Waited())  # before the look: an end meanwhile sets it
            up = await self.parent_link(session)
            if up is not None:  # a child's turn ends with its terminal state
                ended_event = self._ended.setdefault(session, anyio.Event())
                ended = (await self.ends(session)).get(session)
                if ended is None:
                    found = [(a, k) for a, k in await self.links(up.parent) if k.child == session]
                    if found:
                        ended = await self.settle(up.parent, found[0][0], found[0][1])
                if ended is not None:
                    return True, ended.state, ended.answer, ended.why
                event = ended_event
            else:
                done = await self._ended_turn(session, turn)
                if done is not None:
                    return True, ("cancelled" if done else "completed"), None, None
                event = waited.event
            with anyio.CancelScope(deadline=deadline):
                await event.wait()
            if not event.is_set():
                # its waiter stays, for another waiter of the same turn (told at its end)
                return False, None, None, None
            if up is None and not await self.sessions.known(session):  # closed meanwhile: no end can come (a
                # child's is `disconnected`, kept in its parent's log)
                raise HandleError(f"session {session!r} was closed while its turn {turn} was waited for")
            if up is None and waited.cancelled is not None:
                return True, ("cancelled" if waited.cancelled else "completed"), None, None

    async def _ended_turn(self, session: str, turn: int) -> bool | None:
        """Whether the turn has ended, read from the session (cancelled?); None while it has not."""
        known = self.runtime.table.get(session)
        if not known.scanned:
            await self.runtime._scan_turns(session, known)
        if turn > known.turn:
            return None
        if any(
            a.op.Emit is None and a.op.Save is None and a.op.Done is None for a in await self.sessions.pending(session)
        ):
            return None
        return await self._cancelled(session, turn)

    # -- cancelling -------------------------------------------------------------------------------------------------

    async def cascade(self, parent: str, why: str, turn: int | None = None, close: bool = False) -> None:
        """Before a Cancel of the parent is stepped (or it is closed): cancel every running descendant, deepest
        first, the cascade journalled before it starts and marked done after."""
        if not await self._running(parent):
            return
        await self._record(parent, records.CASCADE, 0, Cascade(why, turn, close))
        before = set(self._cascading)
        self._cascading.add(parent)
        try:
            await self._cancel_below(parent, why)
            failpoints.hit("children.cascaded")
            await self._record(parent, records.CASCADED, 0, Cascade(why, turn, close))
        finally:
            self._cascading = before

    async def running_below(self, parent: str) -> list[str]:
        """The session's running descendants, each before its own children."""
        found: list[str] = []
        for _, link in await self._running(parent):
            if await self.sessions.known(link.child):
                found += [link.child, *await self.running_below(link.child)]
        return found

    async def _running(self, parent: str) -> list[tuple[int, ChildLink]]:
        ended = await self.ends(parent)
        return [(a, kept) for a, kept in await self.links(parent) if kept.child not in ended]

    async def _cancel_below(self, parent: str, why: str) -> None:
        for action, link in await self._running(parent):
            name = link.child
            if await self.sessions.known(name):
                # A child whose own child ends cancelled does not go on with that as a result: it is cancelled next.
                self._cascading.add(name)
                await self._cancel_below(name, why)  # deepest first
                asked = await self.runtime.oversight.awaiting(name)
                if asked:
                    await self.runtime.oversight.withdraw(name, [a.action for a in asked], "the cancel of its parent")
                self._because[name] = ("cancelled", why)
                await self._end_turn(name)
                await self.finish(parent, action, link, "cancelled", why)
            else:
                await self.finish(parent, action, link, "disconnected", CLOSED_WHY)

    async def resume_cascades(self) -> None:
        """At start: finish every cascade a stopped daemon left unfinished, then the Cancel (or close) it led to."""
        for parent in await self.sessions.recorded(records.CASCADE):
            kept = await self.sessions.records(parent, (records.CASCADE, records.CASCADED))
            if not kept or kept[-1].kind != records.CASCADE:
                continue
            cascade = records.decode(kept[-1].body, Cascade)
            log.info("agent.cascade_resumed", session=parent, why=cascade.why[:300])
            before = set(self._cascading)
            self._cascading.add(parent)
            try:
                await self._cancel_below(parent, cascade.why)
                await self._record(parent, records.CASCADED, 0, cascade)
                if cascade.close:
                    await self.sessions.close(parent)
                elif cascade.turn is not None:
                    await self.sessions.step(parent, Event(Cancel=Cancel(turn=cascade.turn)), f"cascade:{cascade.turn}")
            finally:
                self._cascading = before

    # -- spend ------------------------------------------------------------------------------------------------------

    async def lineage(self, session: str) -> list[Ancestor]:
        """The session's ancestors, nearest first, each with the turn its branch was made in."""
        chain: list[Ancestor] = []
        link = await self.parent_link(session)
        while link is not None:
            binding = await self.runtime.binding(link.parent)
            if binding is None or binding.agent not in self.runtime.profiles:
                break
            chain.append(Ancestor(link.parent, self.runtime.profiles[binding.agent], link.turn))
            link = await self.parent_link(link.parent)
        return chain

    async def usage(self, parent: str) -> UsageTotals | None:
        """What the session's descendants used, summed (None: it has none)."""
        links = await self.links(parent)
        if not links:
            return None
        total = UsageTotals()
        for _, link in links:
            total = total.plus(await self._used(link.child))
        return total

    async def _used(self, child: str) -> UsageTotals:
        """What the child and its descendants used."""
        t = await self.sessions.tally(child)
        own = UsageTotals(t.input_tokens, t.output_tokens, t.cached_tokens, t.calls, t.refused)
        below = await self.usage(child) if await self.sessions.known(child) else None
        return own if below is None else own.plus(below)

    async def _record(self, session: str, kind: str, action: int, body: msgspec.Struct) -> None:
        seq = self.sessions.seq(session) or 0
        await self.sessions.add_record(Record(session, seq, kind, action, records.encode(body)))


def ancestor_counters(ancestors: list[Ancestor]) -> list[Counter]:
    """The turn and session counters of each ancestor, where a descendant's call is reserved and charged too."""
    found: list[Counter] = []
    for a in ancestors:
        found += [Counter("turn", a.session, str(a.turn)), Counter("session", a.session, "")]
    return found


def _why(e: Exception) -> str:
    return f"{e.kind}: {e}" if isinstance(e, DevdError) else f"{type(e).__name__}: {e}"


_cancel = msgspec.json.Decoder(Event)


def cancel_turn(event: bytes) -> int | None:
    """The turn a Cancel event cancels (None: it is no Cancel that can be read)."""
    try:
        found = _cancel.decode(event).Cancel
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    return None if found is None else found.turn


def _line(m: Message) -> str:
    if m.User is not None:
        return f"user: {m.User}"
    if m.Agent is not None:
        return f"agent: {m.Agent.text}" if m.Agent.text else ""
    if m.Tool is not None:
        return f"tool result{' (failed)' if m.Tool.failed else ''}: {m.Tool.text}"
    if m.Summary is not None:
        return f"summary: {m.Summary.text}"
    return ""


_FENCE = re.compile(r"^\s*```(?:json)?\s*\n(.*)\n\s*```\s*$", re.DOTALL)


def _mismatch(schema: dict[str, Any], answer: str) -> str | None:
    """Why the answer does not satisfy the schema (as JSON, a fenced block's content taken), or None."""
    fenced = _FENCE.match(answer)
    text = fenced.group(1) if fenced else answer
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return "it is not JSON"
    found = jsonschemas.mismatch(schema, value)
    if found is None:
        return None
    where, why = found
    return why + (f" (at {where})" if where else "")
