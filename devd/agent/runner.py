"""The agent runtime: the daemon carries out the actions of the sessions made with an agent profile.

What it promises:
- A session made with `agent` and `workspace` keeps both (an `agent` record, which a fork carries); `prompt` starts a
  turn above every turn id the session had and answers once its `Turn` step is durable (a key used before answers
  that turn again, or CONFLICT when it was used for another prompt); the runtime then carries out
  every action the core waits for, in order, stepping each result as a client would (`agent:<turn>:<action>` keys),
  until nothing is pending. One driver task per session does so, in the runtime's task group.
- The workspace is pinned: its directory's identity is kept in the `agent` record and checked at every Read, Write,
  Exec and Git (`tools.Workspace`); a session recorded before identities were takes the directory at its path at its
  first call. `check` refuses a workspace inside the daemon's own paths or holding one of them.
- An Exec, Write or Git starts only after its claim is durable; a claim found without its result (a restart, a move)
  is never run again: the call is stepped as failed, saying it may have partly run. Read and Model are carried out
  again. An MCP call whose server asked a question it kept a sealed state for (MCP 2026-07-28) is the exception: the
  server ran nothing of it yet, and it is sent again from that state with the answer (`devd.agent.questions`); a
  legacy question left open is declined, saying so.
- A call the profile denies (or, when it asks, a client denies) is never started; it is stepped as failed, with
  why. A tool call the core cannot take is answered to the model as a failed call, and the tool calls of a reply past
  the profile's `max_calls_per_reply` as one failed call (the first of them, without its arguments, saying how many
  were not run), kept in an `inserted` record so that every later request carries it at the same place.
- While the model streams, the session's watchers receive `session/delta`. When the model cannot be reached after
  the retries, the ask stays pending, the session is stalled (`stalled`, and `session/stalled` to its watchers) until
  `resume`.
- A step of the session by another client (a `Cancel`, a result) that leaves the action in flight no longer pending
  stops its work at once: the stream is closed, the command's process group killed; a claimed effect so stopped is
  stepped as failed, saying it was cancelled. Nothing of a cancelled turn starts afterwards: what runs next is what the
  core still waits for.
- A session that ends under its running turn (a call past its deadline, a trap in the core: kept until `recover`) is
  never left silent: its watchers' subscriptions end once (`session/unwatched`, saying why and what carries it on),
  a `session/wait` on its turns answers the error that says it ended, and a child so ended fails.
- At start, every agent session that owes work is driven again (`run`).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
import msgspec
import structlog
from msgspec import Raw

from devd import failpoints
from devd.agent import cgroups, context, effects, http, instructions, kinds, model, records, rewind, spend, tools
from devd.agent import sandbox as sandboxes
from devd.agent.children import Children
from devd.agent.known import Known, Table
from devd.agent.mcp.own import own_servers
from devd.agent.model import Inserted, ModelUnavailable
from devd.agent.oversight import Gate, ModelCall, Oversight, tool_record
from devd.agent.port import DELTA_NOTICE, Sessions, action_ids
from devd.agent.profiles import McpServer, Profile, api_key, check_workspace, narrow, offered_models
from devd.agent.questions import LAPSED, Questions
from devd.agent.records import Binding, Claim, ModelChosen, ParentLink, Thought, TurnStarted
from devd.agent.titles import Titles, from_prompt
from devd.errors import (
    ConflictError,
    DevdError,
    HandleError,
    InvalidParamsError,
    MovedError,
    PanicError,
    PoisonError,
)
from devd.messages import Action, Answer, Call, Event, Message, Reply, Summarize, ToolCall, Turn, encode
from devd.protocol import (
    CompactResult,
    DeltaNotice,
    InstructionsNotice,
    ModelResult,
    Outcome,
    SessionMcpServer,
    StalledNotice,
)
from devd.sessions.watchers import Stepped
from devd.storage.store import Record

if TYPE_CHECKING:
    from devd.agent.kinds.named import NamedTool
    from devd.agent.mcp.broker import Broker

log = structlog.get_logger("devd.agent")
OwnServers = tuple[tuple[McpServer, dict[str, str]], ...]
T = TypeVar("T")

SCAN_ROWS = 256  # journal rows read at a time when a session's turn ids are first looked for
REASKS_MAX = 3  # asks again after a reply whose every call was rejected, before its text is taken as the answer
INTERRUPTED = (
    "interrupted: the daemon stopped while this {what} ran, so it may have partly run; it was not run again "
    "(check the workspace before you run it again)"
)
INSTRUCTIONS_NOTICE = "session/instructions"
CANCELLED = "cancelled: the turn was cancelled while this {what} ran{how}"
GO_ON = "Your answer was cut at the token limit. Continue exactly where it stopped, without repeating anything."
CUT_ANSWER = (
    "\n\n[devd: this answer was cut at the token limit, after {n} continuations; for longer answers raise max_tokens "
    "or continuations_max of agent {agent!r}]"
)
CUT_CALL = (
    "cut: your reply reached the token limit while this call's arguments were being written, so it was not run; "
    "make the call again with shorter arguments (write a long file in parts)"
)


def _prepare_cgroups() -> None:
    """Say once how a command's memory and processes are bounded here (`devd.agent.cgroups`), and remove the groups a
    daemon killed mid-command left in this one's cgroup."""
    where = cgroups.place()
    if isinstance(where, str):
        log.info(
            "agent.no_cgroups",
            why=where,
            bound="memory_bytes_max is each process's RLIMIT_DATA and processes_max is RLIMIT_NPROC; shared memory is "
            "bounded only by the cgroup the daemon runs in",
        )
        return
    log.info("agent.cgroups", memory=where.memory, pids=where.pids, left=cgroups.sweep(where) or None)


class RuntimeStatistics(msgspec.Struct, frozen=True):
    """What the runtime holds: a record per session it knows (`devd.agent.known`), and the drivers running."""

    sessions: int
    driving: int


def _awaited(action: Action) -> bool:
    op = action.op
    return op.Emit is None and op.Save is None and op.Done is None


class Runtime:
    """The agent profiles, the sessions driven, and the task group their drivers run in."""

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        sessions: Sessions,
        environ: Mapping[str, str],
        private: Sequence[Path] = (),
    ) -> None:
        self.profiles = dict(profiles)
        self.private = tuple(str(p) for p in private)  # the daemon's own paths, hidden from its commands
        self._private_real = tuple(Path(os.path.realpath(p)) for p in private)  # and never a tool's, nor in a workspace
        self.sessions = sessions
        self.environ = environ  # where API keys are read from, when a request is made; never copied elsewhere
        self.table = Table()  # one record per session known here: forgetting one is one removal (devd.agent.known)
        self._tg: anyio.abc.TaskGroup | None = None
        self._sandboxes: dict[str, sandboxes.Sandbox | sandboxes.Refusal | None] = {}  # by profile
        self._probing = anyio.Lock()
        self.http: http.Client | None = None
        self.mcp: Broker | None = None  # the MCP broker, when a profile names servers (its SDK is loaded only then)
        self.oversight = Oversight(sessions, table=self.table)  # approvals, spend and trace (devd.agent.oversight)
        self.questions = Questions(sessions, self.table)  # MCP servers' questions (devd.agent.questions)
        self.titles = Titles(sessions, sessions.seq)
        self.ledger = effects.Ledger(sessions)  # what effects ran, and what a Write replaced (session/rewind)
        self.children = Children(self)  # delegated runs (devd.agent.children)
        self.oversight.lineage = self.children.lineage  # a child's calls count against its ancestors' ceilings
        self.oversight.ancestors = self.children.ancestors
        sessions.observe(self)

    def statistics(self) -> RuntimeStatistics:
        """How many sessions the runtime keeps a record of, and how many it drives now."""
        return RuntimeStatistics(len(self.table), self.table.driving())

    def stalled(self, session: str) -> str | None:
        """Why the session's driver stopped, until it is resumed (None: it has not)."""
        known = self.table.find(session)
        return None if known is None else known.stalled

    # -- what the methods call ----------------------------------------------------------------------------------

    def check(self, agent: str, workspace: str | None) -> Binding:
        """The binding of a new session, or InvalidParamsError naming what is wrong."""
        profile = self.profiles.get(agent)
        if profile is None:
            known = ", ".join(sorted(self.profiles)) or "none: start the daemon with --agents FILE"
            raise InvalidParamsError(f"there is no agent {agent!r}; the agents are {known}")
        if workspace is None:
            raise InvalidParamsError(f"a session of agent {agent!r} needs a workspace: an absolute directory path")
        real = check_workspace(profile, workspace)
        for own in self._private_real:
            if real == own or real.is_relative_to(own):  # covered under the sandbox: its commands would find nothing
                raise InvalidParamsError(
                    f"workspace {real} is inside the daemon's own {own}, which its commands cannot see; use a "
                    "directory outside it"
                )
            if own.is_relative_to(real):  # its token, database, socket or backups within reach of Read and a command
                raise InvalidParamsError(
                    f"workspace {real} holds the daemon's own {own}, which no session may reach; use a directory "
                    "that does not hold it"
                )
        try:
            identity = tools.pin(real)
        except tools.Refused as e:  # changed since check_workspace looked: a link swapped in meanwhile, say
            raise InvalidParamsError(f"workspace {real} changed as the session was made ({e.why}); try again") from None
        return Binding(agent, str(real), identity)

    def own_mcp(self, agent: str, given: list[SessionMcpServer]) -> OwnServers:
        """A session's own MCP servers, checked against the profile (InvalidParamsError saying what is wrong)."""
        return own_servers(self.profiles[agent], given)

    def bring_mcp(self, session: str, servers: OwnServers) -> None:
        """The session's own MCP servers from now (in memory: a restart forgets them, `session/mcp` gives them)."""
        if self.mcp is not None:
            self.mcp.own(session, servers)

    async def bind(self, session: str, binding: Binding | None) -> None:
        """Keep the new session's binding, durably. A session of no agent is not remembered here at all (there may be
        a million of them): what is known of a name made again is forgotten."""
        self.table.forget(session)
        if binding is not None:
            await self.sessions.add_record(Record(session, 0, records.AGENT, 0, records.encode(binding)))
            known = self.table.get(session)
            known.binding, known.bound = binding, True

    async def binding(self, session: str, known: Known | None = None) -> Binding | None:
        """The session's agent and workspace (None: it has none), read from its record log once (with its turns and
        the model `session/model` set); `known`, its record when the caller holds it (a driver: it never makes one
        again for a session forgotten meanwhile)."""
        known = self.table.get(session) if known is None else known
        if not known.bound:
            found = await self.sessions.records(session, (records.AGENT, records.TURN, records.MODEL, records.PARENT))
            bound = [records.decode(r.body, Binding) for r in found if r.kind == records.AGENT]
            linked = [records.decode(r.body, ParentLink) for r in found if r.kind == records.PARENT]
            if linked:
                known.link = linked[-1]
            turns = [records.decode(r.body, TurnStarted).turn for r in found if r.kind == records.TURN]
            chosen = [records.decode(r.body, ModelChosen).model for r in found if r.kind == records.MODEL]
            known.turn = max([known.turn, *turns])
            known.binding, known.bound = (bound[-1] if bound else None), True
            if chosen:
                known.model = chosen[-1]
        return known.binding

    async def workspace(self, session: str, known: Known) -> tools.Workspace:
        """The session's workspace as its tools reach it (see `tools.Workspace`). A session made before identities
        were recorded takes the directory at its path now, reached without following a link, as its own: recorded
        durably at this first call (a record of seq 0, which every fork carries, as the first) and checked at every
        call after. Refused when no directory can be reached there that way."""
        binding = await self.binding(session, known)
        assert binding is not None, "a driver runs only for a session made with an agent"
        identity = binding.identity
        if identity is None:
            try:
                identity = await anyio.to_thread.run_sync(tools.pin, Path(binding.workspace))
            except tools.Refused as e:
                raise tools.Refused(
                    f"the workspace {binding.workspace} of this session (made before workspaces were pinned) cannot "
                    f"be reached without following a link ({e.why}); nothing was done: make a new session "
                    "(session/new) with the workspace as it is now"
                ) from None
            binding = msgspec.structs.replace(binding, identity=identity)
            await self.sessions.add_record(Record(session, 0, records.AGENT, 0, records.encode(binding)))
            known.binding = binding
            log.info("agent.workspace_pinned", session=session, workspace=binding.workspace, identity=identity)
        return tools.Workspace(Path(binding.workspace), identity, self._private_real)

    async def prompt(self, session: str, prompt: str, key: str | None) -> int:
        """Start a turn of the session with prompt (once per key); its id, once its Turn step is durable."""
        binding = await self._bound(session)
        self._profile(session, binding)
        known = self.table.get(session)
        async with known.lock:
            step_key = None if key is None else f"prompt:{key}"
            if step_key is not None and (kept := await self.sessions.keyed_turn(session, step_key)) is not None:
                if kept.prompt != prompt:  # as a keyed step with another event is: never the old turn, silently
                    raise ConflictError(
                        f"key {key!r} was used for another prompt (turn {kept.id}); use a new key for a new prompt"
                    )
                self.drive(session)
                return kept.id
            if not known.scanned:
                await self._scan_turns(session, known)
            seq = self.sessions.seq(session) or 0
            turn = max(seq, known.turn) + 1
            await self.sessions.add_record(Record(session, seq, records.TURN, 0, records.encode(TurnStarted(turn))))
            known.turn = turn
            await self.sessions.step(session, Event(Turn=Turn(id=turn, prompt=prompt)), step_key)
            title = from_prompt(prompt)
            if title is not None:
                await self.titles.set(session, title, prompt=True)
        self.drive(session)
        return turn

    async def compact(self, session: str) -> CompactResult:
        """Compact the session's conversation now (`session/compact`): the model summarises its start (all of it
        when no window is known; else what leaves the newest messages within half of `compact_at` of the window),
        the Summary is stepped (a turn waiting on its ask is asked again with what is left), and the number of
        messages replaced is answered; 0 and why when nothing was (nothing to replace, a ceiling refused the
        summary, the model failed). While calls are waited for, the message that made them stays."""
        binding = await self._bound(session)
        profile = self.with_model(session, self._profile(session, binding))
        known = self.table.get(session)
        async with known.lock:
            return await Driver(self, session, known).compact_now(profile)

    async def set_model(self, session: str, name: str) -> ModelResult:
        """Set the model of the session's next calls (`session/model`), durably: one of its profile's `models` (or
        its `model`); INVALID_PARAMS naming those otherwise."""
        binding = await self._bound(session)
        profile = self._profile(session, binding)
        offered = offered_models(profile)
        if name not in offered:
            raise InvalidParamsError(
                f"agent {profile.name!r} offers no model {name!r}; its models are {', '.join(offered)} (add it to "
                "models in the agents file and restart the daemon)"
            )
        await self.sessions.add_record(Record(session, 0, records.MODEL, 0, records.encode(ModelChosen(name))))
        known = self.table.find(session)  # None: closed meanwhile, and nothing of it is kept again
        if known is not None:
            known.model = name
        log.info("agent.model_set", session=session, model=name)
        return ModelResult(name, list(offered))

    async def window(self, session: str) -> int | None:
        """The context window of the model the session's next call names (None: unknown, or no agent's session)."""
        binding = await self.binding(session)
        if binding is None or binding.agent not in self.profiles:
            return None
        return context.window(self.with_model(session, self.profiles[binding.agent]))

    def with_model(self, session: str, profile: Profile) -> Profile:
        """The profile as the session's calls are made: its model the one `session/model` set, when one is (and the
        profile still offers it)."""
        known = self.table.find(session)
        chosen = None if known is None else known.model
        if chosen is None or chosen == profile.model or chosen not in profile.models:
            return profile
        return msgspec.structs.replace(profile, model=chosen)

    async def _scan_turns(self, session: str, known: Known) -> None:
        """Learn the highest turn id of the session's kept journal, once per daemon life: a client may have stepped a
        Turn of its own with a higher id than any step count (the steps since are observed as they happen)."""
        since, highest = 0, known.turn
        while True:
            rows = await self.sessions.steps(session, since, SCAN_ROWS)
            highest = max([highest, *(_turn_id(e) for _, e in rows if e.startswith(b'{"Turn"'))])
            if len(rows) < SCAN_ROWS:
                break
            since = rows[-1][0]
        known.turn = max(known.turn, highest)
        known.scanned = True

    async def resume(self, session: str) -> None:
        """Try a stalled session again (or drive one that owes work and is not driven)."""
        await self._bound(session)
        known = self.table.get(session)
        known.stalled = None
        self.children.resumed(session)
        if known.driver is not None:
            known.driver.resumed.set()
        self.drive(session)

    async def _bound(self, session: str) -> Binding:
        if not await self.sessions.known(session):
            raise HandleError(f"no session is named {session!r}; `session/list` shows the sessions there are")
        binding = await self.binding(session)
        if binding is None:
            raise InvalidParamsError(
                f"session {session!r} was not made with an agent, so the daemon does not drive it: step it with "
                "`session/step`, or make a session with `session/new` and an `agent`"
            )
        return binding

    def _profile(self, session: str, binding: Binding) -> Profile:
        profile = self.profiles.get(binding.agent)
        if profile is None:
            known = ", ".join(sorted(self.profiles)) or "none"
            raise InvalidParamsError(
                f"session {session!r} is of agent {binding.agent!r}, which the agents file no longer has (the agents "
                f"are {known}); put the profile back and restart the daemon"
            )
        held = self.table.find(session)
        if held is not None and held.link is not None:  # a child: never wider than the session that delegated it
            return narrow(profile, held.link.ceiling)
        return profile

    # -- the drivers --------------------------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Drive the sessions until cancelled: first every agent session that owes work (after a restart)."""
        if self.profiles:
            await anyio.to_thread.run_sync(_prepare_cgroups)
        async with http.new_client() as client, anyio.create_task_group() as tg:
            self.http, self._tg = client, tg
            if any(p.mcp or p.session_mcp for p in self.profiles.values()):
                from devd.agent.mcp.broker import Broker

                self.mcp = Broker(self.environ, self.questions)
                await tg.start(self.mcp.run)
            self._check_keys()
            task_status.started()
            tg.start_soon(self._probe_sandboxes)
            try:
                owing = await self.sessions.recorded(records.AGENT)
            except DevdError as e:  # the daemon serves anyway; each session is driven at its next prompt or resume
                log.error("agent.resume_failed", error=f"{e.kind}: {e}"[:500])
                owing = []
            try:
                await rewind.finish_left(self)  # before any of their turns is driven
            except DevdError as e:
                log.error("agent.rewinds_not_finished", error=f"{e.kind}: {e}"[:500])
            try:
                await self.children.resume_cascades()  # a cancel cut short goes on before its parent is driven
            except DevdError as e:
                log.error("agent.cascades_not_finished", error=f"{e.kind}: {e}"[:500])
            for name in owing:
                if self.sessions.seq(name) is not None:
                    self.drive(name)
            await anyio.sleep_forever()

    def _check_keys(self) -> None:
        """Say at start which profiles' keys cannot be sent (the variable, never its value): their sessions would
        stall at their first model call."""
        for profile in self.profiles.values():
            try:
                api_key(profile, self.environ)
            except ValueError as e:
                log.warning("agent.key_unusable", agent=profile.name, why=str(e))

    def stop(self) -> None:
        """Stop every driver where it stands (a claimed effect cut short is found interrupted at the next start)."""
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def driving(self, session: str) -> bool:
        """Whether a driver of the daemon's is carrying out the session's actions now."""
        known = self.table.find(session)
        return known is not None and known.driver is not None

    def drive(self, session: str) -> None:
        """Make sure a driver carries out what the session waits for."""
        known = self.table.get(session)
        if known.driver is not None:
            known.driver.dirty = True
            return
        if self._tg is None:
            return  # not running (a test's daemon without a runtime task): nothing is driven
        driver = known.driver = Driver(self, session, known)
        self._tg.start_soon(self._run_driver, driver)

    async def _run_driver(self, driver: Driver) -> None:
        try:
            await driver.run()
        except (HandleError, PoisonError, PanicError, MovedError) as e:  # closed, ended, poisoned or moved away
            log.warning("agent.driver_stopped", session=driver.session, error=f"{e.kind}: {e}"[:500])
            # Closed, expired or moved, the session is forgotten and its watchers were told; else it ended or was
            # poisoned here (a call past its deadline, a trap) and is kept until `session/recover`.
            if not isinstance(e, MovedError) and self.table.find(driver.session) is driver.known:
                self._ended_under(driver, f"{e.kind}: {e}"[:300])
        except Exception as e:
            # A fault (the store refused a write) or a bug must not end the daemon, nor leave the turn waiting with
            # no word to anyone (a prompt waited for ever): the session is stalled, its watchers are told why, and
            # `session/resume` carries on from what is durable (a claimed effect is not run again).
            error = f"{e.kind}: {e}" if isinstance(e, DevdError) else f"{type(e).__name__}: {e}"
            log.error("agent.driver_failed", session=driver.session, action=driver.carrying, error=error[:500])
            if driver.known.link is not None and self._tg is not None:  # a crashed child is a failed child
                self._tg.start_soon(self.children.failed, driver.session, error[:300])
                return
            why = f"the daemon failed carrying out action {driver.carrying} ({error[:300]}); `session/resume` retries"
            self.stall(driver.session, driver.known, driver.carrying, why)
        finally:
            if driver.known.driver is driver:
                driver.known.driver = None

    def _ended_under(self, driver: Driver, error: str) -> None:
        """The session ended under its running turn, which cannot end by itself now: nothing is left silent (a client
        that prompted waited for ever). Its watchers' subscriptions end once, saying why and what carries it on, each
        `session/wait` on its turns answers (the error that says it ended), and a child ends `failed`."""
        session = driver.session
        if driver.known.link is not None and self._tg is not None:
            self._tg.start_soon(self.children.failed, session, error)
            why = f"ended while its turn ran ({error}); the delegated run failed"
        else:
            why = f"ended while its turn ran ({error}); after `session/recover`, `session/resume` carries the turn on"
        self.sessions.unwatched(session, why)
        self.children.session_ended(session)

    def stall(self, session: str, known: Known, action: int, why: str) -> None:
        known.stalled = why
        self.children.stalled(session, why)
        log.warning("agent.stalled", session=session, action=action, why=why[:500])
        self.sessions.tell(session, "session/stalled", StalledNotice(session, action, why))

    async def sandbox(self, profile: Profile) -> sandboxes.Sandbox | sandboxes.Refusal | None:
        """How the profile's commands run; bubblewrap is probed the first time, on a worker thread (at start, in the
        background: `_probe_sandboxes`), one profile at a time: a turn that asks meanwhile waits for that probe."""
        key = profile.name if profile.ceiling is None else f"{profile.name} {profile.sandbox} {profile.network}"
        if key not in self._sandboxes:  # a child's narrowed profile may be confined more than its agent's own
            async with self._probing:
                if key not in self._sandboxes:
                    self._sandboxes[key] = await anyio.to_thread.run_sync(
                        lambda: sandboxes.choose(profile, hidden=self.private)
                    )
        return self._sandboxes[key]

    async def _probe_sandboxes(self) -> None:
        """Probe every profile's sandbox once the daemon serves, so that the first turn does not wait for it (the
        processes it starts took a cold daemon's first model call 30-90 ms later than a warm one's)."""
        for profile in self.profiles.values():
            await self.sandbox(profile)

    # -- observing the sessions ---------------------------------------------------------------------------------

    def stepped(self, stepped: Stepped) -> None:
        known = self.table.find(stepped.session)
        if known is None:  # nothing known of it here: no driver, and its binding is read when it is needed
            return
        driver = known.driver
        if driver is not None and stepped.event is not driver.sent:
            driver.foreign_step()
        if b'"Done"' in stepped.actions:
            _ended_turns(self.children, stepped)
        if stepped.event.startswith(b'{"Turn"') and known.bound:
            known.turn = max(known.turn, _turn_id(stepped.event))
            if driver is None and known.binding is not None:
                self.drive(stepped.session)  # a client started a turn of an agent session: the daemon drives it

    def ended(self, session: str) -> None:
        """Forget the session, in one removal: a session made again under the name inherits nothing of it (no
        approvals, no spend, no turns, no model); its driver is stopped, and the MCP broker forgets its own servers."""
        known = self.table.forget(session)
        if known is not None and known.driver is not None:
            known.driver.scope.cancel()
        if known is not None and known.link is not None and self._tg is not None:  # a child gone: its parent is told
            self._tg.start_soon(self.children.gone, session, known.link.parent)
        self.children.session_ended(session)  # its waiters look again, and are answered that it is gone
        if self.mcp is not None:
            self.mcp.forget(session)
        self.titles.forget(session)  # the caches of titles and of kept contents, beside the record
        self.ledger.forget(session)


_events = msgspec.json.Decoder(Event)
_actions = msgspec.json.Decoder(list[Action])


def _ended_turns(children: Children, stepped: Stepped) -> None:
    """Tell the children's keeper of every turn the step ended (a waiter of `session/wait`, a child's end)."""
    try:
        answered = _actions.decode(stepped.actions)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return
    for action in answered:
        done = action.op.Done
        if done is not None:
            children.turn_ended(stepped.session, done.turn, done.outcome.Cancelled is not None)


def _capped(
    profile: Profile, completion: model.Completion, named: Collection[str] = (), down: Mapping[str, str] | None = None
) -> tuple[Reply, list[model.Rejected]]:
    """The reply the core is stepped with and the calls it does not take: of the reply's tool calls, the first
    `max_calls_per_reply` are taken (those it can take); the rest are never run, answered as one: the first of them,
    its arguments left out, refused for all (what is kept in the conversation, and sent in every later request, stays
    bounded however many calls a reply makes)."""
    limit = profile.max_calls_per_reply
    calls = completion.tool_calls
    if completion.finish_reason == "length" and calls:  # the last call was being written when the limit came
        *calls, last = calls
        reply, rejected = _capped(
            profile, msgspec.structs.replace(completion, tool_calls=calls, finish_reason=None), named, down
        )
        return reply, [*rejected, model.Rejected(last.id, last.name, "{}", CUT_CALL)]
    reply, rejected = model.to_reply(msgspec.structs.replace(completion, tool_calls=calls[:limit]), named, down)
    if len(calls) <= limit:
        return reply, rejected
    why = (
        f"not run: the reply made {len(calls)} tool calls and at most {limit} of one reply are carried out (agent "
        f"{profile.name!r} has max_calls_per_reply = {limit}); this call and the {len(calls) - limit - 1} after it "
        "were not run, and are left out of the conversation; make the calls still needed in your next reply"
    )
    first = calls[limit]
    return reply, [*rejected, model.Rejected(first.id, first.name, "{}", why)]


def _limited(profile: Profile, window: int | None, size: int) -> Profile:
    """The profile as the call is sent: its max_tokens the least of its own and what the window leaves past the
    request (for a profile that sets none, only when that is less than MAX_TOKENS_DEFAULT: a server's own default is
    the model's, which a window of room does not bind). The spend ceilings' headroom lowers it further (admit)."""
    if window is None:
        return profile
    left = max(window - size, 1)
    if profile.max_tokens is None and left >= spend.MAX_TOKENS_DEFAULT:
        return profile
    return msgspec.structs.replace(profile, max_tokens=min(profile.max_tokens or left, left))


# A summary refused as too long is refused again on resume: the way on is to go back, or to start again.
_TOO_LONG_TO_SUMMARISE = (
    "even the request for a summary is past the model's window, so `session/resume` would be refused again; to go "
    "on, rewind the session to an earlier turn (`devd rewind SESSION TURN`) or start a new session with what matters"
)


def _unsummarised(failed: ModelUnavailable | spend.Refusal | None) -> str:
    """Why a summary was not had (None: a Cancel withdrew its call)."""
    if failed is None:
        return "withdrawn by a cancel"
    return failed.message if isinstance(failed, spend.Refusal) else failed.why


def _going_on(before: int, text: str) -> Inserted:
    """The answer so far, cut at the token limit, and the ask to go on, sent after the conversation (never kept)."""
    return Inserted(before, [{"role": "assistant", "content": text}, {"role": "user", "content": GO_ON}])


def _context_full(profile: Profile, size: int, window: int | None, refused: str | None) -> str:
    """Why a session stalls with its context full, and what to do."""
    against = "" if window is None else f" against a window of {window} tokens"
    what = f"the request measures ~{size} tokens (devd's estimate, {spend.CHARS_PER_TOKEN} characters a token){against}"
    if refused is not None:
        what += f", and the server refused it as too long again after the conversation was compacted ({refused})"
    else:
        what += ", and compacting the conversation leaves nothing more to replace"
    return (
        f"the context is full: {what}; to go on, start a new session (session/new) with what matters, or, if the "
        f"model's window is larger, raise context_tokens of agent {profile.name!r} in the agents file and restart the "
        "daemon, then `session/resume`"
    )


def _turn_id(event: bytes) -> int:
    try:
        turn = _events.decode(event).Turn
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return 0
    return 0 if turn is None else turn.id


class _Guard:
    """Work `Driver._guarded` runs for an action: stopped through its scope once the action is no longer pending (or
    the look at what is pending failed: `error`)."""

    __slots__ = ("action", "scope", "error")

    def __init__(self, action: int) -> None:
        self.action = action
        self.scope = anyio.CancelScope()
        self.error: Exception | None = None


class Driver(msgspec.Struct, eq=False):
    """Carries out one session's pending actions, one at a time, until it waits for nothing."""

    runtime: Runtime
    session: str
    known: Known  # the session's record: read and written through it, never looked up (it may be forgotten meanwhile)
    scope: anyio.CancelScope = msgspec.field(default_factory=anyio.CancelScope)
    dirty: bool = False  # the session may wait for other things than the queue says: read pending again
    sent: bytes | None = None  # the event of the step this driver has in flight (its own, not another client's)
    carrying: int = 0  # the action being carried out (0 before the first): what a stall after a failure names
    resumed: anyio.Event = msgspec.field(default_factory=anyio.Event)
    _foreign: anyio.Event = msgspec.field(default_factory=anyio.Event)
    _guards: list[_Guard] = msgspec.field(default_factory=list)  # the work `_guarded` runs now, innermost last
    _checking: bool = False  # a look at what is pending for the guards runs (`_check_guards`)
    _claims: set[int] = msgspec.field(default_factory=set)
    _inserted: list[Inserted] = msgspec.field(default_factory=list)
    _thoughts: dict[int, str] = msgspec.field(default_factory=dict)  # reasoning sent back (send_reasoning)
    compacted_for_length: bool = False  # a refusal as too long compacted once: another stalls the session

    @property
    def sessions(self) -> Sessions:
        return self.runtime.sessions

    def foreign_step(self) -> None:
        self.dirty = True
        self._foreign.set()
        self._check_soon()

    def _check_soon(self) -> None:
        """While work is guarded and another client stepped the session, look (in a task of the runtime's) whether
        each guarded action is still pending; the first look runs only then, never for work no step came during."""
        tg = self.runtime._tg
        if self._guards and self._foreign.is_set() and not self._checking and tg is not None:
            self._checking = True
            tg.start_soon(self._check_guards)

    async def _check_guards(self) -> None:
        try:
            while self._guards and self._foreign.is_set():
                self._foreign = anyio.Event()
                try:
                    still = action_ids(await self.sessions.pending(self.session))
                except Exception as e:  # raised where the guarded work was waited for, as the work's own
                    for guard in self._guards:
                        guard.error = guard.error or e
                        guard.scope.cancel()
                    return
                for guard in self._guards:
                    if guard.action not in still:
                        guard.scope.cancel()
        finally:
            self._checking = False

    async def run(self) -> None:
        with self.scope:
            binding = await self.runtime.binding(self.session, self.known)
            if binding is None:
                return
            profile = self.runtime._profile(self.session, binding)
            await self._load()
            queue = deque(await self.sessions.pending(self.session))
            await self._forget_dead_claims(queue)
            while True:
                if self.dirty:
                    # Another client stepped the session (or a prompt came): what it waits for is the truth.
                    self.dirty = False
                    queue = deque(await self.sessions.pending(self.session))
                if not queue:
                    # The answers of its own steps ran out: the core waits for nothing more (a turn queued behind
                    # comes in the answer that ends the one before), and pending is not asked again, which would
                    # only hold the session from its clients as a turn ends.
                    if self.dirty:
                        continue
                    return
                action = queue.popleft()
                self.carrying = action.id
                answered = await self._carry(profile, binding, action)
                queue.extend(a for a in answered if _awaited(a))

    async def _load(self) -> None:
        found = await self.sessions.records(self.session, (records.CLAIM, records.INSERTED, records.REASONING))
        self._claims = {r.action for r in found if r.kind == records.CLAIM}
        self._inserted = [records.decode(r.body, Inserted) for r in found if r.kind == records.INSERTED]
        thoughts = [records.decode(r.body, Thought) for r in found if r.kind == records.REASONING]
        self._thoughts = {t.at: t.text for t in thoughts}

    async def _forget_dead_claims(self, pending: Sequence[Action]) -> None:
        """A claim of an action no longer pending is of an effect whose result was stepped: it says nothing now, and
        a session of many turns would read more of them at every start."""
        dead = self._claims - action_ids(pending)
        if dead:
            await self.sessions.forget_records(self.session, records.CLAIM, dead)
            self._claims -= dead

    def _key(self, action: int) -> str:
        return f"agent:{self.known.turn}:{action}"

    async def _step(self, event: Event, action: int, key: str | None = None) -> list[Action]:
        data = encode(event)
        self.sent = data
        try:
            return await self.sessions.step_bytes(self.session, data, key or self._key(action))
        finally:
            self.sent = None

    async def _record(self, kind: str, action: int, body: bytes) -> None:
        seq = self.sessions.seq(self.session) or 0
        await self.sessions.add_record(Record(self.session, seq, kind, action, body))

    async def _guarded(self, action: int, work: Callable[[], Awaitable[T]]) -> T | None:
        """work()'s result; None when it was withdrawn: another client's step (a Cancel, a result of its own) left
        the action no longer pending, and the work was stopped where it stood."""
        # A step of another client since the last look (a Cancel while the claim was written, say) is looked at
        # before the work starts: it must not start at all for an action no longer pending.
        if self._foreign.is_set():
            self._foreign = anyio.Event()
            if action not in action_ids(await self.sessions.pending(self.session)):
                return None
        # One that comes while the work runs is looked at then (`foreign_step`), and stops the work if the action is
        # no longer pending. Not a task watching each guarded work: its start and its end were two turns of the
        # event loop at each model call, tool call and gate, and at 300 sessions' turn ends a turn of a busy loop
        # is tens of milliseconds.
        guard = _Guard(action)
        self._guards.append(guard)
        try:
            with guard.scope:
                self._check_soon()  # a step that came while the look above read what is pending
                return await work()
        finally:
            self._guards.remove(guard)
        if guard.error is not None:
            raise guard.error
        return None

    async def _carry(self, profile: Profile, binding: Binding, action: Action) -> list[Action]:
        if action.op.Model is not None:
            return await self._ask(profile, action)
        called = kinds.of(action.op)
        if called is None:
            return []
        kind, call = called
        answered = kind.answered(call)
        if answered is not None:  # answered as failed at once, never left waiting
            return await self._step(kind.event(action.id, answered, True), action.id)
        what = kind.what
        read = self._trusted_read(profile, kind, call)  # an MCP tool its server is trusted to say only reads
        effect = kind.effect and read is None
        gate = Gate(True, read) if read is not None else await self._gate(profile, action)
        if gate is None:  # withdrawn: the turn was cancelled while the call waited for a decision
            return []
        if not gate.allowed:
            await self._traced(action, kind, call, time.time(), 0.0, "denied", gate.reason)
            return await self._step(kind.event(action.id, gate.reason, True), action.id)
        ledger, turn, before = self.runtime.ledger, self.known.turn, None
        resumed = action.id in self._claims and bool(await self.runtime.questions.kept(self.session, action.id))
        if effect and not resumed:
            if action.id in self._claims:
                log.warning("agent.interrupted", session=self.session, action=action.id, kind=kind.member)
                text = INTERRUPTED.format(what=what)
                if await self.runtime.questions.lapse(self.session, action.id):
                    text += f"; its server's question was {LAPSED}"
                before = await ledger.claimed(self.session, action.id)
                entry = ledger.entry(
                    self.session, action.id, turn, kind.member, call, time.time(), "interrupted", before
                )
                await self._traced(action, kind, call, time.time(), 0.0, "interrupted", text, entry)
                return await self._step(kind.event(action.id, text, True), action.id)
            if kind.member == "Write":
                before = await ledger.before(
                    self.session, action.id, lambda: self.runtime.workspace(self.session, self.known), call.path
                )
            claim = Claim(kind.name, turn, before)
            await self._record(records.CLAIM, action.id, records.encode(claim))
            self._claims.add(action.id)
            failpoints.hit("agent.claimed")
        context = kinds.Context(
            profile,
            lambda: self.runtime.workspace(self.session, self.known),
            lambda: self.runtime.sandbox(profile),
            self._named(profile, action.id),
            lambda ask: self.runtime.children.delegate(self.session, action.id, profile, ask),
        )
        started, t0 = time.time(), time.monotonic()
        result = await self._guarded(action.id, lambda: kind.run(context, call))
        took = time.monotonic() - t0
        if effect:
            failpoints.hit("agent.done")
        if result is None:
            await self.runtime.questions.withdraw(self.session, action.id)
            stopped = ledger.entry(self.session, action.id, turn, kind.member, call, started, "interrupted", before)
            why = "cancelled with its turn"
            await self._traced(action, kind, call, started, took, "interrupted", why, stopped if effect else None)
            if not effect:
                return []
            how = "; its process group was killed" if kind.kills else ""
            text = CANCELLED.format(what=what, how=how)
            return await self._step(kind.event(action.id, text, True), action.id)
        outcome: Outcome = "error" if result.failed else "ok"
        # What failed, never what the command printed: the record is exported (OTel) and shown beside others'.
        error = (result.why or result.text) if result.failed else None
        event = kind.event(action.id, result.text, result.failed)
        # The trace record, and an effect's ledger record beside it (one write): durable before the result's step.
        entry = ledger.entry(self.session, action.id, turn, kind.member, call, started, outcome, before)
        await self._traced(action, kind, call, started, took, outcome, error, entry if effect else None)
        return await self._step(event, action.id)

    def _trusted_read(self, profile: Profile, kind: kinds.Kind[Any], call: Any) -> str | None:
        """Why a call of an MCP tool is decided and carried out as a read (allowed, neither claimed nor in the effect
        ledger): its server has `trust_read_only = true` and the tool says `readOnlyHint`; None otherwise, and for a
        call the policy denies."""
        broker = self.runtime.mcp
        if broker is None or kind.name != "tool":  # a delegation is a Tool call too, but no MCP tool's
            return None
        if kinds.decide(profile, Call(Tool=call))[0] == "deny":  # a child's parent decides it too (kinds.decide)
            return None
        return broker.read_only(self.session, call.name)

    def _named(self, profile: Profile, action: int) -> Callable[[str, bytes], Awaitable[tools.Result]] | None:
        """How the call `action` of the session's named (MCP) tools is carried out, when the daemon has a broker."""
        broker = self.runtime.mcp
        if broker is None:
            return None
        known = self.known
        workspace, sandbox = lambda: self.runtime.workspace(self.session, known), lambda: self.runtime.sandbox(profile)
        return lambda name, data: broker.call(self.session, profile, workspace, sandbox, name, data, action)

    async def _offered(self, profile: Profile) -> list[NamedTool]:
        """The session's MCP tools the model is offered now."""
        broker = self.runtime.mcp
        if broker is None:
            return []
        known = self.known
        workspace, sandbox = lambda: self.runtime.workspace(self.session, known), lambda: self.runtime.sandbox(profile)
        offered = await broker.offered(self.session, profile, workspace, sandbox)
        if profile.ceiling is None:
            return offered
        # A child is offered only the MCP tools its parent's profile would not deny it (the intersection).
        return [t for t in offered if kinds.decide(profile, Call(Tool=ToolCall(t.name, Raw(b"{}"))))[0] != "deny"]

    async def _gate(self, profile: Profile, action: Action) -> Gate | None:
        """Whether the call may start: the profile's decision, or for `ask` a client's (waited for); None when the
        approval was withdrawn because a Cancel left the action no longer pending."""
        oversight = self.runtime.oversight
        gate = await self._guarded(action.id, lambda: oversight.gate(self.session, action.id, action.op, profile))
        if gate is None:
            await oversight.withdraw(self.session, [action.id])
        return gate

    async def _traced(
        self,
        action: Action,
        kind: kinds.Kind[Any],
        call: Any,
        started: float,
        took: float,
        outcome: Outcome,
        error: str | None,
        ledger: Record | None = None,
    ) -> None:
        record = tool_record(action.id, kind.name, kind.subject(call), started, took, outcome, error)
        await self.runtime.oversight.trace(self.session, record, () if ledger is None else (ledger,))

    async def _stalled(self, action: int, why: str) -> None:
        """The ask stays pending; carry on when the session is resumed, or when another client's step (a Cancel of
        the turn) leaves it no longer pending: then the stall is over and what the session waits for comes next."""
        self.resumed = anyio.Event()
        self.runtime.stall(self.session, self.known, action, why)
        resumed = self.resumed

        async def until_resumed() -> bool:
            await resumed.wait()
            return True

        if await self._guarded(action, until_resumed) is None:
            self.known.stalled = None
        self.dirty = True

    async def _instructed(self, profile: Profile, action: int) -> Profile:
        """The profile to ask with: carrying the project's instructions as they are now (`devd.agent.instructions`);
        the files skipped are told to the session's watchers."""
        binding = await self.runtime.binding(self.session)
        assert binding is not None
        found = await anyio.to_thread.run_sync(instructions.find, profile, Path(binding.workspace))
        if found.skipped:
            log.warning("agent.instructions_skipped", session=self.session, skipped=[s.path for s in found.skipped])
            self.sessions.tell(
                self.session, INSTRUCTIONS_NOTICE, InstructionsNotice(self.session, action, found.skipped)
            )
        return msgspec.structs.replace(profile, project=found.message())

    async def _admitted(self, profile: Profile, action: Action, body: bytes, name: str | None) -> ModelCall | None:
        """The model call of request `body` (for the estimate), admitted by every spend ceiling; None when one
        refused it (never sent) and the session was stalled and then resumed."""
        turn = self.known.turn
        accounted = ModelCall(self.runtime.oversight, self.session, profile, turn, action.id, body, name=name)
        refusal = await accounted.admit()
        if refusal is None:
            return accounted
        await self._stalled(action.id, refusal.message)
        return None

    async def _call(
        self, profile: Profile, action: Action, request: Callable[[Profile], dict[str, Any]]
    ) -> model.Completion | ModelUnavailable | None:
        """One model call for the ask, its body `request(profile as admitted)`: admitted by the ceilings, streamed to
        the watchers, traced and charged. Its completion; the ModelUnavailable it ended with (the caller says why, or
        compacts); None when a ceiling refused it (stalled, then resumed) or a Cancel withdrew it."""
        accounted = await self._admitted(profile, action, json.dumps(request(profile)).encode(), None)
        if accounted is None:
            return None

        def on_text(text: str) -> None:
            self.sessions.stream(self.session, action.id, text)

        def on_attempt(tried: model.Attempt) -> None:
            accounted.attempt(tried)
            if tried.outcome == "retry":  # the next attempt streams the text again from its beginning
                self.sessions.stream_again(self.session, action.id)

        async def ask_model() -> model.Completion:
            return await self._complete(accounted, request(accounted.profile), on_text, on_attempt)

        return await self._charged(accounted, action.id, ask_model)

    async def _charged(
        self, accounted: ModelCall, action: int, ask: Callable[[], Awaitable[model.Completion]]
    ) -> model.Completion | ModelUnavailable | None:
        """ask(), guarded for `action` (None: withdrawn), or the ModelUnavailable it ended with; what it used charged
        either way and durable before the answer, or given back when it was cancelled."""
        try:
            completion = await self._guarded(action, ask)
        except ModelUnavailable as e:
            await accounted.done()
            return e
        except BaseException:
            await accounted.cancelled()
            raise
        await accounted.done()
        if self.known.link is not None:  # a child's usage is live to its parent's watchers
            await self.runtime.children.used(self.session)
        return completion

    async def _complete(
        self,
        accounted: ModelCall,
        body: dict[str, Any],
        on_text: Callable[[str], None],
        on_attempt: Callable[[model.Attempt], None],
    ) -> model.Completion:
        """The call sent, its reasoning told to the watchers as `kind: "reasoning"` deltas as it streams (never part
        of the answer)."""
        assert self.runtime.http is not None
        action = accounted.action

        def on_reasoning(text: str) -> None:
            self.sessions.tell(self.session, DELTA_NOTICE, DeltaNotice(self.session, action, text, "reasoning"))

        return await model.complete(
            self.runtime.http,
            accounted.profile,
            [],
            environ=self.runtime.environ,
            exec_available=True,
            on_text=on_text,
            on_attempt=on_attempt,
            output_max=accounted.output_max,
            readmit=accounted.again,
            body=body,
            on_reasoning=on_reasoning,
        )

    async def summarised(
        self, profile: Profile, action: int, messages: Sequence[Message], window: int | None
    ) -> str | ModelUnavailable | spend.Refusal | None:
        """The summary the model writes of `messages` (a model call like any other: admitted by the ceilings,
        traced as `name: "summary"`, charged; its text streamed to the watchers as `kind: "summary"` deltas of
        `action`), its request made to fit `window`: the text; the ModelUnavailable it ended with (an answer with no
        text is one); the ceiling's refusal (nothing sent); None when a Cancel withdrew it."""
        output = min(profile.max_tokens or context.SUMMARY_OUTPUT_MAX, context.summary_output(window))
        summarising = msgspec.structs.replace(profile, max_tokens=output)
        body = json.dumps(context.summary_body(summarising, messages, window)).encode()
        turn = self.known.turn
        accounted = ModelCall(self.runtime.oversight, self.session, summarising, turn, action, body, name="summary")
        refusal = await accounted.admit()
        if refusal is not None:
            return refusal

        def on_text(text: str) -> None:
            self.sessions.tell(self.session, DELTA_NOTICE, DeltaNotice(self.session, action, text, "summary"))

        async def ask_model() -> model.Completion:
            request = context.summary_body(accounted.profile, messages, window)
            return await self._complete(accounted, request, on_text, accounted.attempt)

        completion = await self._charged(accounted, action, ask_model)
        if completion is None or isinstance(completion, ModelUnavailable):
            return completion
        text = (completion.text or "").strip()
        return text or ModelUnavailable("the model answered the request for a summary with no text")

    async def _ask(self, profile: Profile, action: Action) -> list[Action]:
        assert action.op.Model is not None
        profile = self.runtime.with_model(self.session, profile)
        ask = action.op.Model
        messages: list[Message] = ask.messages if ask.from_ is None else await self.sessions.transcript(self.session)
        profile = await self._instructed(profile, action.id)
        confined = await self.runtime.sandbox(profile)
        exec_available = not isinstance(confined, sandboxes.Refusal)
        named = await self._offered(profile)
        window = context.window(profile)
        reasks, pieces, going_on = 0, list[str](), list[Inserted]()
        try:
            while True:
                # What goes on after a cut answer is listed first: of messages inserted at the same place, the
                # last listed goes first (model.request_body), and it follows any rejected reply of this ask.
                extra = [*going_on, *self._inserted]

                def request(sent: Profile, extra: list[Inserted] = extra) -> dict[str, Any]:
                    thoughts = self._thoughts
                    return model.request_body(
                        sent, messages, extra, exec_available=exec_available, thoughts=thoughts, named=named
                    )

                size = context.measure(request(profile))
                if window is not None and size > profile.compact_at * window:
                    overhead = context.measure(model.request_body(profile, [], exec_available=exec_available))
                    keep = max(int(profile.compact_at * window / 2) - overhead, 0)
                    compacted = await self._compact(profile, action, messages, keep, window)
                    if compacted is not None:
                        return compacted
                    if size >= window:  # nothing left to replace, and it cannot be sent
                        await self._stalled(action.id, _context_full(profile, size, window, None))
                        return []
                called = await self._call(_limited(profile, window, size), action, request)
                if called is None:
                    return []  # refused by a spend ceiling and resumed, or withdrawn: what is pending comes next
                if isinstance(called, ModelUnavailable):
                    return await self._unavailable(profile, action, messages, called, size)
                self.compacted_for_length = False
                completion = called
                if completion.finish_reason == "length" and not completion.tool_calls:
                    pieces.append(completion.text or "")
                    if len(pieces) <= profile.continuations_max:  # asked to go on; its text streams after this
                        going_on = [_going_on(model.whole_length(messages), "".join(pieces))]
                        continue
                    note = CUT_ANSWER.format(n=len(pieces) - 1, agent=profile.name)
                    self.sessions.stream(self.session, action.id, note)
                    completion = msgspec.structs.replace(completion, text="".join(pieces) + note)
                elif pieces:
                    completion = msgspec.structs.replace(completion, text="".join(pieces) + (completion.text or ""))
                down = {} if self.runtime.mcp is None else self.runtime.mcp.down(self.session)
                reply, rejected = _capped(profile, completion, {t.name for t in named}, down)
                if rejected:
                    again = reply.calls is None and reasks < REASKS_MAX
                    text = reply.text if again else None
                    inserted = Inserted(
                        before=model.whole_length(messages), messages=model.rejected_messages(text, rejected)
                    )
                    await self._record(records.INSERTED, action.id, records.encode(inserted))
                    self._inserted.append(inserted)
                    if again:
                        reasks, pieces, going_on = reasks + 1, [], []
                        self.sessions.stream_again(self.session, action.id)
                        continue
                if profile.send_reasoning and completion.reasoning:  # durable before the answer it goes with
                    thought = Thought(model.whole_length(messages), completion.reasoning)
                    await self._record(records.REASONING, action.id, records.encode(thought))
                    self._thoughts[thought.at] = thought.text
                return await self._step(Event(Model=Answer(id=action.id, reply=reply)), action.id)
        finally:
            self.sessions.streamed(self.session, action.id)  # answered, stalled or stopped: no more text

    async def _unavailable(
        self, profile: Profile, action: Action, messages: list[Message], e: ModelUnavailable, size: int
    ) -> list[Action]:
        """The call failed: a request the server found too long is compacted and asked again once (a quarter of it
        kept, at most what compacting keeps); anything else, or too long again, stalls the session saying why and
        what to do."""
        window = context.window(profile)
        if e.too_long and not self.compacted_for_length:
            self.compacted_for_length = True
            keep = size // 4 if window is None else min(size // 4, int(profile.compact_at * window / 2))
            # The server refused `size` tokens: its window, unknown or smaller than thought, is less than that.
            compacted = await self._compact(profile, action, messages, keep, min(window or size, size))
            if compacted is not None:
                return compacted
        if e.too_long:
            why = _context_full(profile, size, window, e.why)
        elif not e.sent:
            why = f"the model call was not sent: {e.why}; `session/resume` tries again"
        elif e.status is not None and 400 <= e.status < 500 and e.status not in model.RETRIED:
            why = (
                f"the model server refused the request: {e.why}; asking again would be refused the same way: fix "
                f"what it names (agent {profile.name!r}'s model, key or limits in the agents file, then restart the "
                "daemon), then `session/resume`"
            )
        else:
            why = f"the model cannot be reached: {e.why}; `session/resume` tries again"
        await self._stalled(action.id, why)
        return []

    async def compact_now(self, profile: Profile) -> CompactResult:
        """`Runtime.compact`, by a driver of its own (another client's step to the session's driver, if any)."""
        messages = await self.sessions.transcript(self.session)
        pending = [a for a in await self.sessions.pending(self.session) if _awaited(a)]
        asked = next((a.id for a in pending if a.op.Model is not None), 0)
        waited = [i for i, m in enumerate(messages) if m.Agent is not None and m.Agent.calls]
        before = waited[-1] if waited and any(a.op.Model is None for a in pending) else None
        window = context.window(profile)
        keep = 0
        if window is not None:
            overhead = context.measure(model.request_body(profile, []))
            keep = max(int(profile.compact_at * window / 2) - overhead, 0)
        upto = context.cut(messages, keep, before)
        if upto is None:
            return CompactResult(0, "nothing to replace: the conversation is empty, or only a summary")
        summary = await self.summarised(profile, asked, messages[:upto], window)
        if not isinstance(summary, str):
            return CompactResult(0, f"the model's summary failed ({_unsummarised(summary)}); nothing was replaced")
        await self.sessions.step(self.session, Event(Summary=Summarize(upto=upto, text=summary)), None)
        log.info("agent.compacted", session=self.session, action=asked, upto=upto, summary_chars=len(summary))
        return CompactResult(upto)

    async def _compact(
        self, profile: Profile, action: Action, messages: list[Message], keep_tokens: int, window: int | None
    ) -> list[Action] | None:
        """Replace the start of the conversation by a summary the model writes (a model call like any other, its
        text streamed as `kind: "summary"`, its request made to fit `window`), keeping the newest messages that fit
        in `keep_tokens`: the actions of the Summary's step (the core asks again, under a new id, with what is
        left); [] when the summary call was refused, withdrawn or failed (stalled, saying why); None when nothing
        can be replaced."""
        upto = context.cut(messages, keep_tokens)
        if upto is None:
            return None
        summary = await self.summarised(profile, action.id, messages[:upto], window)
        if summary is None:
            return []  # withdrawn: what is pending comes next
        if not isinstance(summary, str):
            why = _unsummarised(summary)
            if not isinstance(summary, spend.Refusal):  # a refusal says what to do itself
                why = f"the conversation could not be compacted: the model's summary failed ({why}); " + (
                    _TOO_LONG_TO_SUMMARISE
                    if isinstance(summary, ModelUnavailable) and summary.too_long
                    else "`session/resume` tries again"
                )
            await self._stalled(action.id, why)
            return []
        text = summary
        log.info("agent.compacted", session=self.session, action=action.id, upto=upto, summary_chars=len(text))
        event = Event(Summary=Summarize(upto=upto, text=text))
        return await self._step(event, action.id, f"{self._key(action.id)}:summary")
