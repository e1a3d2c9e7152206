"""`devd chat`, `devd run` and `devd attach`: a session the daemon drives, shown as it happens, and talked to.

`devd chat [--session NAME]` (and `devd run` without a prompt) is an interactive session: a line entered is a
prompt, a line starting with `/` a command (`/help` lists them; each does what a `devd` verb does), Ctrl-C cancels
the running turn, and a second Ctrl-C or Ctrl-D leaves with status 0 (the session stays, `devd chat --session NAME`
comes back to it). `devd run PROMPT` shows one turn: 0 when it is done, 1 when it ended otherwise, 130 after Ctrl-C
(which cancels it). `devd attach SESSION` shows a turn someone else prompted, from what was dispatched before it
attached, until it ends (0) or Ctrl-C (130; the turn goes on).

What it promises: one `Console` per session shown, whose watch feeds the screen model (devd.agent.cli.Screen), and
whose terminal (devd.cli.terminal) is the one writer and the one reader of the person's terminal. An approval is
asked inline and answered by the first answer anywhere: decided in another terminal, its question is withdrawn and
no line typed is taken for it. Without a terminal (a pipe), the turn's text goes to stdout as lines and approvals
are left to `devd approve`. The session's name is said at the start, so that another terminal can attach to it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import msgspec

from devd.agent.cli import TERMINAL, Nested, Screen, answer_of, decision_of, input_prompt, prompt_line
from devd.client import ActionsNotice, AsyncClient, UnwatchedNotice
from devd.errors import BusyError, ConflictError, DevdError, HandleError, InvalidParamsError, MethodNotFoundError
from devd.messages import Action, Cancel, Event
from devd.protocol import (
    ApprovalNotice,
    ChildNotice,
    DeltaNotice,
    InputNotice,
    StalledNotice,
    UsageResult,
    UsageTotals,
)
from devd.render import argv, in_devd_terms, inline

if TYPE_CHECKING:
    from devd.cli.terminal import Asked, Terminal

EXIT_OK = 0
EXIT_ENDED = 1
EXIT_INTERRUPTED = 130
CHILD_CATCH_UP_S = 5.0  # a delegated run's end waits this long at most for what it did to be shown above it
Mode = Literal["run", "attach", "chat"]


class Console:
    """One session shown on one terminal (`term`; None: a plain stream) or stdout, in one mode: `run` ends at its
    turn's Done, `attach` at the running turn's end, `chat` when the person leaves."""

    def __init__(self, client: AsyncClient, session: str, mode: Mode, term: Terminal | None) -> None:
        self.client, self.session, self.mode, self.term = client, session, mode, term
        self.screen = self._screen()
        self.status: int | None = None  # how the command ends, once it is known
        self.scope = anyio.CancelScope()  # the whole console's: cancelled when it ends
        self.following = anyio.CancelScope()  # the current session's watch (`/attach` moves it)
        self.prompted = mode != "run"  # devd run: its turn is known (before it, the next Done is its turn's)
        self.usage: UsageResult | None = None
        self.budget: int | None = None  # the ceiling set from here, the one the daemon's answers do not say
        self.armed = False  # a Ctrl-C with no turn running: the next one leaves
        self.cancelling: int | None = None  # the turn a Ctrl-C cancelled
        self.title: str | None = None  # the session's, when the daemon keeps one
        self.nested: dict[str, Screen] = {}  # the delegated runs followed (at any depth): each one's own screen
        self.followed: dict[str, anyio.Event] = {}  # set when a delegated run's screen has shown its turn's end
        self.found: list[ChildNotice] = []  # delegated runs running when this console began, to follow

    def _screen(self) -> Screen:
        return Screen(
            self.term if self.term is not None else sys.stdout, session=self.session, prompts=self.mode == "chat"
        )

    # -- what the terminal shows beside the text ------------------------------------------------------------------

    def status_line(self) -> str | None:
        """The status line: what the turn does, and the tokens used (against the ceiling set from here)."""
        doing = self.screen.status()
        if self.mode == "chat":
            doing = doing or "idle"
        if doing is None or self.usage is None:
            return doing
        used = self.usage.input_tokens + self.usage.output_tokens
        ceiling = "" if self.budget is None else f" of {self.budget:,}"
        return f"{doing} · {used:,} tokens used{ceiling}"

    def question(self) -> tuple[Asked, str] | None:
        """What is asked now: the first undecided approval (the session's own, then its delegated runs', naming the
        delegated run it is asked in), else the first open question of an MCP server."""
        for action, notice in self._questions():
            where = "" if notice.session == self.session else f"[in {inline(notice.session)}] "
            return action, where + prompt_line(notice)
        for key, asked in self.screen.asks.items():
            return key, input_prompt(asked)
        return None

    def _questions(self) -> list[tuple[int, ApprovalNotice]]:
        """The approvals that wait, the session's own first, then each delegated run's in the order they started."""
        found = list(self.screen.questions.items())
        for screen in self.nested.values():
            found += list(screen.questions.items())
        return found

    def line(self, text: str) -> None:
        """A line of devd's own on the screen (it is shown as given: callers escape what they quote)."""
        self.screen.note(text)

    # -- ending ---------------------------------------------------------------------------------------------------

    def finish(self, status: int) -> None:
        """End the command with `status` (the first one given wins): the terminal is given back, or the watch ends."""
        if self.status is None:
            self.status = status
        if self.term is not None:
            self.term.leave(self.status)
        else:
            self.scope.cancel()

    # -- following the session ------------------------------------------------------------------------------------

    async def follow(self, since: int | None, subscribed: anyio.Event | None = None) -> None:
        """Show the session's notices from after step `since` until the console ends or moves to another session;
        each delegated run under the call that made it, followed as it runs."""
        with self.following:
            async with anyio.create_task_group() as tg:
                for found in self.found:
                    self._follow_child(found, self.screen, tg)
                self.found = []
                await self._follow(since, subscribed, tg)
                tg.cancel_scope.cancel()

    def _follow_child(self, notice: ChildNotice, parent: Screen, tg: anyio.abc.TaskGroup) -> None:
        """Follow a delegated run seen running (once): its calls, results and approvals under its parent's lines."""
        if notice.state != "running" or notice.child in self.followed:
            return
        self.followed[notice.child] = anyio.Event()
        screen = Screen(Nested(parent), session=notice.child, nested=True, workspace=parent.workspace)
        self.nested[notice.child] = screen
        tg.start_soon(self._nested, notice.child, screen, tg)

    async def _nested(self, child: str, screen: Screen, tg: anyio.abc.TaskGroup) -> None:
        """A delegated run's notices, from its first step, until its turn's end is shown; its text as each answer
        is whole (not as it streams: several runs may write at once)."""
        try:
            try:
                notices = self.client.watch(child, since=0)
                async for notice in notices:
                    if isinstance(notice, DeltaNotice):
                        continue
                    if isinstance(notice, ChildNotice) and notice.state in TERMINAL:
                        await self._shown_whole(notice.child)
                    screen.show(notice)
                    if isinstance(notice, ChildNotice):
                        self._follow_child(notice, screen, tg)
                    if isinstance(notice, ApprovalNotice) and self.term is None:
                        self._answer_elsewhere(notice)
                    if screen.outcome is not None or isinstance(notice, UnwatchedNotice):
                        break
            except (HandleError, InvalidParamsError):
                pass  # gone already: its line under its parent's says how it ended
        finally:
            self.followed[child].set()

    async def _shown_whole(self, child: str) -> None:
        """Before a delegated run's end is shown: what it did, shown under its line (its turn's end came first)."""
        done = self.followed.get(child)
        if done is not None:
            with anyio.move_on_after(CHILD_CATCH_UP_S):
                await done.wait()

    def _answer_elsewhere(self, notice: ApprovalNotice) -> None:
        self.line(
            f"[answer it with `{argv(['devd', 'approve', notice.session, str(notice.action)])}` or `devd deny ...`]"
        )

    async def _follow(self, since: int | None, subscribed: anyio.Event | None, tg: anyio.abc.TaskGroup) -> None:
        async for notice in self.client.watch(self.session, since=since, subscribed=subscribed):
            if isinstance(notice, ChildNotice) and notice.state in TERMINAL:
                await self._shown_whole(notice.child)
            self.screen.show(notice)
            if isinstance(notice, ChildNotice):
                self._follow_child(notice, self.screen, tg)
            if isinstance(notice, ActionsNotice) and notice.event.Model is not None:
                await self.refresh_usage()  # a model call was charged
            if isinstance(notice, ApprovalNotice) and self.term is None:
                self._answer_elsewhere(notice)
            if isinstance(notice, InputNotice) and self.term is None:
                words = ["devd", "answer", self.session, str(notice.action), str(notice.request)]
                self.line(f"[answer it with `{argv(words)} field=value ...` or `{argv(words)} --decline`]")
            if self.screen.outcome is not None:
                await self._turn_over()
            if isinstance(notice, UnwatchedNotice):  # closed, say, or ended under its turn: the reason says what now
                self.line(f"[the watch ended: {in_devd_terms(inline(notice.reason), self.session)}]")
                self.finish(EXIT_ENDED)
                return

    async def _turn_over(self) -> None:
        outcome = self.screen.outcome
        self.cancelling = None
        if self.mode == "chat":
            self.screen.outcome = None
            await self.refresh_usage()
        elif self.prompted:
            self.finish(EXIT_OK if outcome == "complete" else EXIT_ENDED)

    async def refresh_usage(self) -> None:
        try:
            self.usage = await self.client.usage(self.session)
        except DevdError:
            self.usage = None  # a session the daemon does not drive has none

    async def begin(self) -> int | None:
        """Follow the session from its latest step, with what it already waits for shown; its latest step."""
        seq = await _seq(self.client, self.session)
        if seq is None:
            raise HandleError(f"no session is named {self.session!r}; `devd ls` shows the sessions there are")
        # As JSON, not InfoResult: `title` comes with a newer daemon, and is shown when it is there.
        info = await self.client.call("session/info", {"session": self.session})
        self.title = info.get("title")
        self.screen.workspace = (await self.client.agent(self.session)).workspace
        owed = await self.client.pending(self.session)
        self.screen.attached(owed)
        await self._running_children(info.get("children") or [], owed)
        if info.get("stalled") is not None:  # as its notice would have said it (-1: the action is not named)
            self.screen.show(StalledNotice(self.session, -1, info["stalled"]))
        await self.refresh_usage()
        return seq

    async def _running_children(self, children: list[str], owed: list[Action]) -> None:
        """The delegated runs of the session still running when this console began: shown under their calls, and
        followed from their first step (`follow`)."""
        if not children:
            return
        # Here, not at the top: devd.agent.children brings the sessions' core (wasmtime) with it, which `devd run`
        # would load at every start (about 25 ms) for a session that has no delegated runs.
        from devd.agent.children import child_name

        by_name = {child_name(self.session, f"d{a.id}"): a.id for a in owed}
        for child in children:
            try:
                if (await self.client.wait(child, 1, timeout_ms=0)).done:
                    continue
                agent = (await self.client.agent(child)).agent or "?"
                usage = await self.client.usage(child)
            except DevdError:
                continue  # gone meanwhile: nothing of it to follow
            used = (usage.children or UsageTotals()).plus(usage)  # with its own delegated runs', as notices say it
            notice = ChildNotice(self.session, by_name.get(child, 0), child, agent, "running", used)
            self.screen.show(notice)
            self.found.append(notice)

    # -- the person's keys ----------------------------------------------------------------------------------------

    async def inputs(self, term: Terminal, tg: anyio.abc.TaskGroup) -> None:
        from devd.cli.terminal import Answer, EndOfInput, Interrupt, Line

        async for given in term.inputs:
            if isinstance(given, Answer):
                await self.answer(given.action, given.text)
            elif isinstance(given, Interrupt):
                await self.interrupt(tg)
            elif isinstance(given, EndOfInput) and self.mode == "chat":
                self.finish(EXIT_OK)
            elif isinstance(given, Line):
                self.armed = False
                await self.entered(given.text, tg)

    async def answer(self, action: Asked, text: str) -> None:
        if isinstance(action, tuple):
            await self.reply(action, text)
            return
        notice = next((n for a, n in self._questions() if a == action), None)  # the one `question` asked
        if notice is None:
            return  # decided meanwhile
        decision, remember = decision_of(text)
        try:
            await self.client.approve(notice.session, action, notice.digest, decision, remember=remember)
        except ConflictError as e:
            self.line(f"[{inline(str(e))}]")

    async def reply(self, key: tuple[int, int], text: str) -> None:
        """A line given to an MCP server's question: its answer (or, empty, its decline)."""
        asked = self.screen.asks.get(key)
        if asked is None:
            return  # decided meanwhile
        try:
            answer = answer_of(asked, text)
        except ValueError as e:
            self.line(f"[not an answer: {inline(str(e))}; the question still waits]")
            return
        try:
            await self.client.answer(self.session, key[0], key[1], answer, decline=answer is None)
        except InvalidParamsError as e:
            self.line(f"[{inline(str(e))}; the question still waits]")
        except ConflictError as e:
            self.line(f"[{inline(str(e))}]")

    async def interrupt(self, tg: anyio.abc.TaskGroup) -> None:
        """Ctrl-C: devd run cancels its turn and ends (130); devd attach ends (130); devd chat cancels the running
        turn, and a second Ctrl-C leaves (0)."""
        turn = self.screen.running_turn if self.screen.turn is None else self.screen.turn
        if self.mode == "attach":
            self.finish(EXIT_INTERRUPTED)
        elif self.mode == "run":
            await self.cancel_turn(turn)
            self.finish(EXIT_INTERRUPTED)
        elif turn is not None and self.cancelling is None and not self.armed:
            self.cancelling, self.armed = turn, True  # the next Ctrl-C leaves, whether the cancel is done or not
            self.line(f"[cancelling turn {turn}; Ctrl-C again or Ctrl-D leaves, the session stays]")
            tg.start_soon(_cancel, self.client, self.session, turn)
        elif self.armed:
            self.finish(EXIT_OK)
        else:
            self.armed = True
            self.line("[Ctrl-C again or Ctrl-D leaves; the session stays]")

    async def cancel_turn(self, turn: int | None) -> None:
        self.screen.interrupted = True
        if turn is None:
            return
        with anyio.CancelScope(shield=True):
            await _cancel(self.client, self.session, turn)
        if self.screen.outcome is None:
            self.line(f"[turn {turn} cancelled]")

    async def entered(self, text: str, tg: anyio.abc.TaskGroup) -> None:
        """A line entered in devd chat: a command, or a prompt."""
        if text.startswith("/"):
            word, _, rest = text[1:].partition(" ")
            command = COMMANDS.get(word.strip())
            if command is None:
                self.line(f"[no command /{inline(word)}: /help lists them]")
                return
            try:
                await command.run(self, rest.strip(), tg)
            except DevdError as e:
                self.line(f"[/{word}: {_said(e, self.session)}]")
            return
        if not text.strip():
            return
        try:
            await self.client.prompt(self.session, text)
        except DevdError as e:
            self.line(f"[the prompt was not taken: {_said(e, self.session)}]")

    async def move(self, session: str, tg: anyio.abc.TaskGroup) -> None:
        """Show another session here (`/attach NAME`)."""
        if await _seq(self.client, session) is None:
            self.line(f"[no session is named {inline(session)}: /sessions lists them]")
            return
        self.following.cancel()
        self.following = anyio.CancelScope()
        self.session = session
        self.screen = self._screen()
        self.nested, self.followed, self.found = {}, {}, []  # the other session's delegated runs, from its own
        self.line(f"[session {inline(session)}]")
        subscribed = anyio.Event()
        since = await self.begin()
        tg.start_soon(self.follow, since, subscribed)
        await subscribed.wait()


def _said(e: DevdError, session: str) -> str:
    """A daemon's error, as a person reads it here: a method it names as its `devd` verb; a method this daemon does
    not have yet said so."""
    from devd.cli.common import in_devd_terms

    said = f"{e.kind}: {in_devd_terms(inline(str(e)), session)}"
    if isinstance(e, MethodNotFoundError):
        said += " (this daemon does not have that method yet: it comes with a newer devd)"
    return said


# -- slash commands -------------------------------------------------------------------------------------------------


class Command(msgspec.Struct, frozen=True):
    """A slash command of devd chat: its arguments, what it does, the `devd` verb that does the same, and how."""

    args: str
    does: str
    verb: str
    run: Callable[[Console, str, anyio.abc.TaskGroup], Awaitable[None]]


async def _help(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    console.line("[a line is a prompt; `\\` then Enter, or Esc then Enter, goes on to a new line]")
    for name, command in COMMANDS.items():
        usage = f"/{name}{' ' + command.args if command.args else ''}"
        console.line(f"  {usage:<16} {command.does} ({command.verb.format(session=console.session)})")
    console.line("  Ctrl-C cancels the running turn; a second Ctrl-C, or Ctrl-D, leaves (the session stays)")


async def _usage(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    from devd.cli.sessions import usage_table

    await console.refresh_usage()
    if console.usage is not None:
        for line in usage_table(console.usage).splitlines():
            console.line(line)


async def _budget(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    from devd.cli.sessions import budget_tokens

    try:
        tokens = budget_tokens(rest)
    except ValueError as e:
        console.line(f"[/budget: {inline(str(e))}]")
        return
    await console.client.set_budget(console.session, tokens)
    console.budget = tokens
    console.line(f"[spend ceiling: {'none' if tokens is None else f'{tokens:,} tokens'}; /resume carries a stall on]")


async def _resume(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    await console.client.resume(console.session)
    if console.screen.stalled is not None:
        console.screen.stalled = None
        console.line("[resumed: the action is tried again]")
    else:
        console.line("[resumed: nothing was stalled]")


def _decide(decision: Literal["allow", "deny"]) -> Callable[[Console, str, anyio.abc.TaskGroup], Awaitable[None]]:
    async def run(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
        from devd.agent.approvals import action_digest

        action = int(rest)
        found = [a for a in await console.client.pending(console.session) if a.id == action]
        op = msgspec.structs.replace(found[0], awaiting=None).op if found else None
        digest = "0" * 64 if op is None else action_digest(action, op)
        await console.client.approve(console.session, action, digest, decision)

    return run


def _method(method: str, param: str | None = None) -> Callable[[Console, str, anyio.abc.TaskGroup], Awaitable[None]]:
    """A command that calls `method` with the session and `param` from the rest of the line, and shows its answer (a
    daemon of an older release may not have the method: its METHOD_NOT_FOUND is shown as any refusal is)."""

    async def run(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
        params: dict[str, Any] = {"session": console.session}
        if param is not None and rest:
            params[param] = int(rest) if param == "turn" else rest
        answer = msgspec.json.decode(await console.client.call_raw(method, params))
        for line in _shown_answer(answer):
            console.line(line)

    return run


def _shown_answer(answer: Any) -> list[str]:
    """A method's answer for people: each member on a line of its own, a list's items below it."""
    if not isinstance(answer, dict) or not answer:
        return ["[done]"]
    lines = []
    for key, value in answer.items():
        if isinstance(value, list):
            lines.append(f"{inline(key)}: {len(value)}")
            lines += [f"  {inline(msgspec.json.encode(item).decode())}" for item in value]
        else:
            lines.append(f"{inline(key)}: {inline(msgspec.json.encode(value).decode())}")
    return lines


async def _sessions(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    from devd.cli.sessions import described_sessions

    page = await console.client.call("session/list", {})
    rows = await described_sessions(console.client, page["sessions"])
    for line in rows.splitlines():
        console.line(line)


async def _attach_to(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    await console.move(rest, tg)


async def _quit(console: Console, rest: str, tg: anyio.abc.TaskGroup) -> None:
    console.finish(EXIT_OK)


COMMANDS: dict[str, Command] = {
    "help": Command("", "list these commands", "devd --help", _help),
    "usage": Command("", "tokens and calls used so far", "devd usage {session}", _usage),
    "budget": Command("N|none", "set the session's spend ceiling", "devd budget {session} N", _budget),
    "resume": Command("", "try a stalled action again", "devd resume {session}", _resume),
    "approve": Command("ID", "allow an action that waits", "devd approve {session} ID", _decide("allow")),
    "deny": Command("ID", "deny an action that waits", "devd deny {session} ID", _decide("deny")),
    "title": Command("TEXT", "name the session", "devd title {session} TEXT", _method("session/title", "title")),
    "model": Command(
        "NAME", "ask another of the profile's models", "devd model {session} NAME", _method("session/model", "model")
    ),
    "compact": Command("", "summarize the conversation so far", "devd compact {session}", _method("session/compact")),
    "rewind": Command(
        "[TURN]", "undo the session back to a turn", "devd rewind {session} TURN", _method("session/rewind", "turn")
    ),
    "effects": Command("", "list what the session changed", "devd effects {session}", _method("session/effects")),
    "sessions": Command("", "list the sessions", "devd ls", _sessions),
    "attach": Command("NAME", "show another session here", "devd attach NAME", _attach_to),
    "quit": Command("", "leave (the session stays)", "Ctrl-D", _quit),
}


# -- the commands ---------------------------------------------------------------------------------------------------


async def _seq(client: AsyncClient, session: str) -> int | None:
    from devd.driver import _just_before

    page = await client.list(1, _just_before(session))
    return page.sessions[0].seq if page.sessions and page.sessions[0].session == session else None


async def _cancel(client: AsyncClient, session: str, turn: int) -> None:
    """Step the turn's Cancel (keyed: a retry sends nothing new), waiting out BUSY: the daemon may be stepping it."""
    key = f"devd run:{session}:cancel:{turn}"
    for delay in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 1.0, 1.0):
        try:
            await client.step(session, Event(Cancel=Cancel(turn=turn)), key=key)
            return
        except BusyError:
            await anyio.sleep(delay)
    await client.step(session, Event(Cancel=Cancel(turn=turn)), key=key)


def _terminal(console: Console, prompt: str | None) -> Terminal | None:
    """The terminal's front end, when stdin and stdout are a terminal (else None: lines on stdout)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    from devd.cli.terminal import Terminal
    from devd.config import default_state_dir

    history = default_state_dir() / "chat-history" if prompt is not None else None
    return Terminal(console.status_line, console.question, prompt, history)


async def _session_of(client: AsyncClient, args: argparse.Namespace) -> tuple[str, bool]:
    """The session --session names (made when there is none), else a new one; and whether it was made."""
    session = args.session
    if session is not None and await _seq(client, session) is not None:
        return session, False
    workspace = os.path.abspath(args.workspace or os.getcwd())
    return await client.new(session=session, agent=args.agent, workspace=workspace), True


async def _console(client: AsyncClient, args: argparse.Namespace, mode: Mode) -> int:
    if mode == "attach":
        session, made = args.session, False
    else:
        session, made = await _session_of(client, args)
    console = Console(client, session, mode, None)
    console.term = _terminal(console, "› " if mode == "chat" else None)
    console.screen = console._screen()
    try:
        return await _shown(console, args, made)
    except* ConnectionError as lost:
        raise _lost(lost, session) from None


async def _shown(console: Console, args: argparse.Namespace, made: bool) -> int:
    client, session = console.client, console.session
    async with anyio.create_task_group() as tg:
        with console.scope, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            tg.start_soon(_on_signals, signals, console, tg)
            if console.term is not None:
                # The terminal is ours (raw, its keys read by prompt_toolkit) before anything is said: a key typed
                # after the first line is shown is the input line's, not echoed by the terminal into the text.
                await tg.start(_own, console, console.term, tg)
            subscribed = anyio.Event()
            since = await console.begin()
            agent = await client.agent(session)
            titled = "" if not console.title else f" ({inline(console.title)})"
            about = (
                f"[session {inline(session)}{titled}{' (new)' if made else ''}: agent {inline(agent.agent or '?')} in "
            )
            about += f"{inline(agent.workspace or '?')}]"
            elsewhere = f"[`{argv(['devd', 'attach', session])}` shows it in another terminal"
            elsewhere += "; /help lists the commands]" if console.mode == "chat" else "]"
            if console.mode == "run" and console.term is None:
                print(about, file=sys.stderr)
            elif console.mode != "attach":
                console.line(about)
                console.line(elsewhere)
            if console.mode == "attach" and not console.screen.calls and console.screen.asking is None:
                console.line(f"[session {inline(session)} has no turn running; waiting for one, Ctrl-C to stop]")
            tg.start_soon(console.follow, since, subscribed)
            await subscribed.wait()
            if console.mode == "run":
                # Watched before the prompt: the text the model streams (`session/delta`) is not journalled, so what
                # streamed before the watch began would never be shown.
                console.screen.turn = await client.prompt(session, args.prompt)
                console.prompted = True
                if console.screen.outcome is not None:
                    await console._turn_over()
            await anyio.sleep_forever()  # until console.scope is cancelled: by finish(), or when the terminal is left
        tg.cancel_scope.cancel()
    if console.mode == "run" and console.screen.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if console.status is None else console.status


async def _own(
    console: Console,
    term: Terminal,
    tg: anyio.abc.TaskGroup,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Own the terminal (started once its keys are read) until it is left; then the console ends."""
    tg.start_soon(console.inputs, term, tg)
    status = await term.run(started=lambda: task_status.started())
    if console.status is None:
        console.status = status
    console.scope.cancel()


async def _on_signals(signals: AsyncIterator[int], console: Console, tg: anyio.abc.TaskGroup) -> None:
    """SIGINT (Ctrl-C where no terminal is in raw mode): as Ctrl-C. SIGTERM: leave, the turn left alone (devd chat
    with 0, as Ctrl-D; devd run and attach with 130, as before)."""
    async for signum in signals:
        if signum == signal.SIGINT:
            await console.interrupt(tg)
        else:
            console.finish(EXIT_OK if console.mode == "chat" else EXIT_INTERRUPTED)


def _lost(group: BaseExceptionGroup[ConnectionError], session: str) -> ConnectionError:
    """The daemon went away while a turn was shown: one error (not the task groups' nesting), saying that the turn
    is the daemon's and how to follow it again."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return ConnectionError(
        f"{first}; the turn is the daemon's: once it answers again, `devd attach -- {session}` shows it"
    )


def main(args: argparse.Namespace, address: str, token: str | None) -> int:
    """Run `devd chat`, `devd run` or `devd attach`; the exit status (errors are raised, for the caller to show)."""
    mode: Mode = "attach" if args.command == "attach" else "run" if getattr(args, "prompt", None) else "chat"
    if mode == "chat" and not (sys.stdin.isatty() and sys.stdout.isatty()):
        from devd.cli.common import LocalError

        raise LocalError("devd chat needs a terminal; for a script, `devd run PROMPT` runs one turn and exits")

    async def go() -> int:
        async with AsyncClient.connect(address, token=token, peers=args.peer or ()) as client:
            from devd.cli.sessions import cli_client_name  # who answers approvals from here

            await client.initialize(token=token, name=cli_client_name())
            return await _console(client, args, mode)

    return anyio.run(go)
