"""What `devd chat`, `devd run` and `devd attach` show of a session the daemon drives (devd.cli.chat drives them).

`Screen` is the one model of the screen: fed the session's notices, it writes the model's text as it streams, each
call and its result under its own header, approvals and decisions, MCP servers' questions (`session/input`, each with
the fields it asks for) and how they were decided, and each turn's outcome, and it knows what a status line shows
beside them (stalled and why, waiting for approval or an answer, thinking, running a command) and which approvals and
questions wait for an answer. A question is answered with a line (`answer_of`): a JSON object, `field=value` words
(each value read as its field's type says), or for a question of one field just its value; an empty line declines.
It does no I/O of its own: devd.cli.terminal owns a terminal, or the text goes to a stream as lines.

What people see is tested from the notices alone, without a terminal. What
a model chose (its text, a command's words, paths, URLs, what its calls printed, a reason quoting them) is shown
through devd.render, so that nothing in it acts on the terminal: an approval shows the command that `y` runs. A
write's diff is taken against the file the Write tool would replace, in the workspace the session's binding names,
reached as that tool reaches it and read only when it is a regular file, at most DIFF_BYTES_MAX of it (`replaced`):
a link out of the workspace, a FIFO or a device is said to be one, never read. The diff shows every change with its
context and counts the unchanged lines between, in at most about DIFF_LINES lines: what does not fit is counted where
it is (`… 12 more changed lines here`, `… 40 more changed lines in 20 more places, from line 37`), never left unsaid;
difflib's work is bounded by DIFF_COMPARED_LINES_MAX, and the approval says when it compared only part. A command,
path or reason longer than LINE_CHARS_MAX, and a diff line longer than DIFF_LINE_CHARS_MAX, is shortened to its shape
(devd.render.brief: long words and runs of spaces cut, each cut counted), and an approval says so and that
`devd pending` shows it whole.
"""

from __future__ import annotations

import difflib
import json
import os
import shlex
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from msgspec import Struct, field

from devd.agent import kinds
from devd.agent.kinds.base import LINE_CHARS_MAX
from devd.client import ActionsNotice, Notice
from devd.messages import Action, Event, Op, Output
from devd.protocol import (
    AnsweredNotice,
    ApprovalNotice,
    ChildNotice,
    DecidedNotice,
    DeltaNotice,
    InputNotice,
    Remember,
    StalledNotice,
    UsageTotals,
)
from devd.render import Streamed, argv, block, brief, in_devd_terms, inline, prose

RESULT_LINES = 8  # of a call's output shown; the rest is counted
DIFF_LINES = 50  # of a write's diff shown (hunk headers, changed lines, context), every change counted where it is
DIFF_CONTEXT = 3  # unchanged lines shown around a change, while the diff fits in DIFF_LINES
# Lines of the file and of the text compared past what they begin and end with alike: difflib's time grows with
# their product when changes are many (30,000 lines, every third changed: 154 s; 2,000: 0.25 s).
DIFF_COMPARED_LINES_MAX = 2000
DIFF_BYTES_MAX = 256 * 1024  # of the file a write's diff reads, and characters of the text it compares
DIFF_LINE_CHARS_MAX = 320  # of one line of a diff shown (4 rows of 80 columns)
DIM, UNDIM = "\x1b[2m", "\x1b[22m"  # SGR faint and normal intensity: reasoning shown apart from the answer


def _result(event: Event) -> Output | None:
    return kinds.result_of(event)


def call_line(action: Action) -> str | None:
    """A call the model made, as a line: `$ make -C 'my dir'` (the words a shell would take), `read src/a.py`,
    `write notes.txt (12 bytes)`; any control or bidi character in it escaped, and shortened to LINE_CHARS_MAX
    (`brief`: each cut counted where it was)."""
    whole = _whole_line(action.op)
    return None if whole is None else brief(whole, LINE_CHARS_MAX)


def _whole_line(op: Op) -> str | None:
    found = kinds.of(op)
    return None if found is None else found[0].line(found[1])


def _lines(text: str) -> list[str]:
    """text's lines, split at line feeds alone: a carriage return or another separator stays in its line, shown."""
    return text.removesuffix("\n").split("\n") if text else []


def result_lines(output: Output) -> list[str]:
    """A call's result, indented: its first lines, how many more, and whether it failed; read as prose (terminal
    sequences removed, other controls escaped)."""
    lines = _lines(prose(output.text).rstrip("\n")) or ["(no output)"]
    shown = [f"  {line}" for line in lines[:RESULT_LINES]]
    if len(lines) > RESULT_LINES:
        shown.append(f"  … {len(lines) - RESULT_LINES} more lines")
    if output.failed:
        shown[0] = "  ✗" + shown[0][1:]
    return shown


CHILD_MARK = "⤷"  # a delegated run's line, under the call that made it
NESTED = "  │ "  # before each line a delegated run's own screen shows, under its parent's
TERMINAL = ("completed", "failed", "cancelled", "disconnected")


def used(usage: UsageTotals) -> str:
    """A delegated run's usage, as its line says it: `1,234 tokens in 2 calls` (input and output tokens)."""
    calls = f"{usage.calls:,} call{'' if usage.calls == 1 else 's'}"
    return f"{usage.input_tokens + usage.output_tokens:,} tokens in {calls}"


def child_line(notice: ChildNotice) -> str:
    """A delegated run's line, under the call that made it: its name, agent, state (why it did not complete) and
    what it used (with its own children's)."""
    why = "" if notice.why is None else f": {brief(inline(notice.why), LINE_CHARS_MAX)}"
    usage = "" if notice.state == "running" and not notice.usage.calls else f", {used(notice.usage)}"
    return f"  {CHILD_MARK} {inline(notice.child)} ({inline(notice.agent)}): {notice.state}{why}{usage}"


STALL_ADVICE = (
    "[`devd resume {session}` tries it again (after `devd budget {session} TOKENS` when a spend ceiling refused it);"
    " in devd chat: /resume, /budget N]"
)


class Out(Protocol):
    """Where the screen's text goes: a stream, or the terminal (devd.cli.terminal.Terminal)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...

    def isatty(self) -> bool: ...


class Screen(Struct):  # a Struct, not a dataclass: building that was about 1.5 ms of each `devd run`
    """What a session looks like, built from its notices: the one model of the screen, fed notices and writing text
    to `out` (sans-I/O: a terminal front end, devd.cli.terminal, or a plain stream owns the writing). Text is written
    as it streams; calls, results and devd's own lines (in brackets) on lines of their own; a result under its call's
    header (repeated, `↳ read a.txt`, when another line came between). Beside the text, what a status line shows
    (`status`: stalled and why, waiting for approval, thinking, running a command) and the approvals that wait for an
    answer (`questions`), which a front end shows apart from the text so that neither erases the other. `turn` is the
    turn being shown (None: any turn's Done ends one)."""

    out: Out
    turn: int | None = None
    asking: int | None = None  # the Model action being asked, while its answer is not in
    calls: dict[int, Action] = field(default_factory=dict)
    at_line_start: bool = True
    outcome: str | None = None  # "complete" or "cancelled", once the turn's Done came
    interrupted: bool = False  # Ctrl-C: the turn was cancelled from here
    texts: dict[int, str] = field(default_factory=dict)  # what was streamed of each Model action
    streams: dict[int, Streamed] = field(default_factory=dict)  # each Model action's text being shown as it streams
    workspace: str | None = None  # where a write's diff is taken against, when known
    session: str = "SESSION"  # named in the advice a stall gets
    prompts: bool = False  # each turn's prompt shown (`› fix it`): devd chat, where several terminals may prompt
    clock: Callable[[], float] = time.monotonic
    since: float = 0.0  # when the model was asked (by `clock`)
    running: dict[int, float] = field(default_factory=dict)  # calls dispatched and not answered: since when
    stalled: tuple[int, str] | None = None  # the action the turn waits on and why, until it goes on
    questions: dict[int, ApprovalNotice] = field(default_factory=dict)  # approvals not yet decided, in order
    asks: dict[tuple[int, int], InputNotice] = field(default_factory=dict)  # MCP servers' open questions, in order
    running_turn: int | None = None  # the turn under way, as its Turn step showed it
    header: int | None = None  # the call whose header is the last line shown
    children: dict[str, ChildNotice] = field(default_factory=dict)  # the delegated runs seen: each one's latest state
    decided: list[DecidedNotice] = field(default_factory=list)  # the decisions shown
    nested: bool = False  # a delegated run's own screen, under its parent's: its turn's end is its parent's line
    early: dict[int, ApprovalNotice] = field(default_factory=dict)  # a nested screen's approvals ahead of their call

    def show(self, notice: Notice) -> None:
        if isinstance(notice, DeltaNotice) and notice.kind != "text":
            self._going_on(notice.action)
            # The model's reasoning (or a summary it writes): dimmed on a terminal, left out of a pipe's output.
            if self.out.isatty():
                self._write(f"{DIM}{prose(notice.text)}{UNDIM}")
        elif isinstance(notice, DeltaNotice):
            self._going_on(notice.action)
            self.texts[notice.action] = self.texts.get(notice.action, "") + notice.text
            self._write(self.streams.setdefault(notice.action, Streamed()).add(notice.text))
        elif isinstance(notice, StalledNotice):
            why = in_devd_terms(brief(inline(notice.why), LINE_CHARS_MAX), self.session)
            self.stalled = (notice.action, why)
            self._line(f"[the turn waits: {why}]")  # each why says what stalled it and what carries on
            self._line(STALL_ADVICE.format(session=argv([self.session])))
        elif isinstance(notice, ApprovalNotice) and self.questions.get(notice.action) == notice:
            pass  # told again: a delegated run's approval comes to a watcher of its parent too
        elif isinstance(notice, ApprovalNotice) and self.nested and notice.action not in self.calls:
            # A delegated run's approval told to its parent's watch came ahead of the run's own history (which holds
            # its call: a nested screen follows it from its first step): shown under its call once that is shown.
            self.early[notice.action] = notice
        elif isinstance(notice, DecidedNotice) and notice in self.decided:
            pass
        elif isinstance(notice, ApprovalNotice):
            why = "" if notice.why is None else f": {brief(inline(notice.why), LINE_CHARS_MAX)}"  # why it asks
            self.questions[notice.action] = notice
            shown = approval_lines(notice, self.workspace)
            if self.header == notice.action and shown[:1] == [call_line(Action(id=notice.action, op=notice.op))]:
                shown = shown[1:]  # the command is the line above: not shown twice
            self._line(f"[approval needed for action {notice.action}{why}]")
            for line in shown:
                self._line(line)
        elif isinstance(notice, InputNotice):
            self.asks[(notice.action, notice.request)] = notice
            message = brief(inline(notice.message), LINE_CHARS_MAX)
            self._line(f"[question {notice.request} of action {notice.action}, from its MCP server: {message}]")
            for line in field_lines(notice.schema):
                self._line(line)
        elif isinstance(notice, AnsweredNotice):
            self.asks.pop((notice.action, notice.request), None)
            done = {"accept": "answered", "decline": "declined", "cancel": "withdrawn"}[notice.decision]
            why = "" if notice.why is None else f": {brief(inline(notice.why), LINE_CHARS_MAX)}"
            self._line(f"[question {notice.request} of action {notice.action} {done} by {inline(notice.by)}{why}]")
        elif isinstance(notice, DecidedNotice):
            self.early.pop(notice.action, None)
            self.decided.append(notice)
            self.questions.pop(notice.action, None)
            said = {"allow": "allowed", "deny": "denied", "cancelled": "withdrawn: its turn was cancelled"}
            self._line(f"[action {notice.action} {said[notice.decision]} by {inline(notice.by)}{_kept(notice)}]")
        elif isinstance(notice, ActionsNotice):
            self._step(notice)
        elif isinstance(notice, ChildNotice):
            self._child(notice)
        self.out.flush()

    def _child(self, notice: ChildNotice) -> None:
        """A delegated run of this session: a line under its call as it starts and as it ends (its usage as it runs
        goes to the status line)."""
        before = self.children.get(notice.child)
        self.children[notice.child] = notice
        if before is not None and (before.state in TERMINAL or notice.state == "running"):
            return  # its usage as it runs (the status line shows it), or told again
        call = self.calls.get(notice.action)
        if call is not None and self.header != notice.action:  # another line came between: whose child this is
            self._line(f"↳ {call_line(call)}")
        self._line(child_line(notice))
        self.header = notice.action if call is not None else None  # its result comes under it, not repeated

    def running_children(self) -> list[ChildNotice]:
        """The delegated runs seen running and not yet ended, in the order they started."""
        return [c for c in self.children.values() if c.state == "running"]

    def status(self) -> str | None:
        """What the turn is doing, for a status line (None: nothing is under way); the delegated runs running
        beside it, with what they used."""
        doing = self._doing()
        kids = self.running_children()
        if doing is None or not kids:
            return doing
        total = sum(c.usage.input_tokens + c.usage.output_tokens for c in kids)
        runs = f"{len(kids)} delegated run{'' if len(kids) == 1 else 's'}"
        return f"{doing} · {runs} running, {total:,} tokens"

    def _doing(self) -> str | None:
        now = self.clock()
        if self.stalled is not None:
            return f"stalled: {self.stalled[1]}"
        if self.questions:
            first = next(iter(self.questions))
            more = f" (and {len(self.questions) - 1} more)" if len(self.questions) > 1 else ""
            return f"waiting for approval of action {first}{more}"
        if self.asks:
            action, request = next(iter(self.asks))
            return f"waiting for an answer to question {request} of action {action}"
        if self.asking is not None:
            doing = "writing" if self.asking in self.texts else "thinking"
            return f"{doing} ({now - self.since:.1f} s)"
        if self.running:
            first, since = next(iter(self.running.items()))
            return f"running {call_line(self.calls[first])} ({now - since:.1f} s)"
        return None

    def attached(self, owed: list[Action]) -> None:
        """What the turn already waited for when this screen began to follow it: the model being asked, and the calls
        dispatched (shown, so that their results come under them). The approvals asked the daemon tells every new
        watcher itself."""
        for action in owed:
            if action.op.Model is not None:
                self.asking, self.since = action.id, self.clock()
            elif (line := call_line(action)) is not None:
                self.calls[action.id] = action
                self.running[action.id] = self.clock()
                self._line(f"{line}  [dispatched before this terminal attached]")
                self.header = action.id

    def begin(self, turn: int) -> None:
        """A turn prompted from here: its Done ends what is shown."""
        self.turn, self.outcome, self.running_turn = turn, None, turn

    def _going_on(self, action: int) -> None:
        """Action `action` is being carried out: a stall of it (or one of an action not known: -1) is over."""
        if self.stalled is not None and self.stalled[0] in (action, -1):
            self.stalled = None

    def _step(self, notice: ActionsNotice) -> None:
        event = notice.event
        if event.Turn is not None:
            self.running_turn = event.Turn.id
            if self.prompts:
                self._line("› " + prose(event.Turn.prompt).replace("\n", "\n  "))
        answered = event.Model.id if event.Model is not None else None
        if answered is not None:
            self._going_on(answered)
        if answered is not None and self.asking == answered:
            self.asking = None
        if answered is not None and answered in self.streams:
            self._write(self.streams.pop(answered).end())  # a sequence its stream left unfinished, shown
        output = _result(event)
        if output is not None:
            self._going_on(output.id)
            self.running.pop(output.id, None)
            self.questions.pop(output.id, None)
            for key in [k for k in self.asks if k[0] == output.id]:  # its call is over: so are its questions
                del self.asks[key]
        if output is not None and output.id in self.calls:
            if self.header != output.id:  # another line came between: whose result this is, said again
                self._line(f"↳ {call_line(self.calls[output.id])}")
            for line in result_lines(output):
                self._line(line)
        for action in notice.actions:
            op = action.op
            if op.Model is not None:
                self.asking, self.since = action.id, self.clock()
            elif op.Emit is not None:
                streamed = self.texts.get(answered, "") if answered is not None else ""
                if streamed != op.Emit:  # not streamed here, or only its end (attached while it was written)
                    self._end_line()
                    self._write(prose(op.Emit))
                self._end_line()
            elif op.Done is not None:
                self._done(op.Done.turn, "complete" if op.Done.outcome.Complete else "cancelled")
            elif (called := call_line(action)) is not None:
                self.calls[action.id] = action
                self.running[action.id] = self.clock()
                self._line(called)
                self.header = action.id
                held = self.early.pop(action.id, None)
                if held is not None:
                    self.show(held)

    def _done(self, turn: int, outcome: str) -> None:
        if self.turn is not None and turn != self.turn:
            return  # another turn's (devd run shows its own)
        for stream in self.streams.values():  # cut off by a cancel: what they hold is shown
            self._write(stream.end())
        self.streams.clear()
        self.asking, self.stalled, self.running_turn = None, None, None
        self.running.clear()
        self.questions.clear()
        self.early.clear()
        self.asks.clear()
        self.outcome = outcome
        if not self.nested:
            self._line(f"[turn {turn} {outcome}]")

    def _write(self, text: str) -> None:
        self.out.write(text)
        if text:
            self.at_line_start = text.endswith("\n")
            self.header = None

    def _end_line(self) -> None:
        if not self.at_line_start:
            self._write("\n")

    def _line(self, text: str) -> None:
        self._end_line()
        self._write(text + "\n")

    def note(self, text: str) -> None:
        """A line of the front end's own (a command's answer, a hint), after what is shown so far."""
        self._line(text)
        self.out.flush()


class Nested(Struct):
    """Where a delegated run's own screen writes: into its parent's screen, each line after NESTED, never in the
    middle of a line of the parent's."""

    parent: Screen
    at_line_start: bool = True

    def write(self, text: str, /) -> int:
        if not text:
            return 0
        if self.at_line_start:
            self.parent._end_line()
            text = NESTED + text
        body, end = (text[:-1], "\n") if text.endswith("\n") else (text, "")
        shown = body.replace("\n", "\n" + NESTED) + end
        self.at_line_start = bool(end)
        self.parent._write(shown)
        return len(text)

    def flush(self) -> None:
        self.parent.out.flush()

    def isatty(self) -> bool:
        return self.parent.out.isatty()


def approval_lines(notice: ApprovalNotice, workspace: str | None) -> list[str]:
    """What an approval would do: the command, or a diff of the write (against the file it would replace, when that
    can be read: see `replaced`), shown exactly: a control or bidi character in it is escaped, never taken by the
    terminal."""
    op = notice.op
    if op.Write is None:
        whole = _whole_line(op)
        if whole is None:
            return []
        line = brief(whole, LINE_CHARS_MAX)
        return [line] if line == whole else [line, _whole_elsewhere(notice, "command")]
    data, why = replaced(workspace, op.Write.path)
    before = data[:DIFF_BYTES_MAX].decode(errors="replace")  # its \r\n as it is
    after = op.Write.text[:DIFF_BYTES_MAX]
    path = brief(inline(op.Write.path), LINE_CHARS_MAX)
    shown = [f"write {path} ({len(op.Write.text.encode(errors='surrogatepass'))} bytes)"]
    if why is not None:
        shown.append(f"  (no old content shown: {inline(why)})")
    cut = len(data) > DIFF_BYTES_MAX or len(op.Write.text) > DIFF_BYTES_MAX
    if cut:
        before, after = _to_line_end(before), _to_line_end(after)  # a line cut short would read as changed
        shown.append(f"  (only the first {DIFF_BYTES_MAX:,} bytes of the file and characters of the text compared)")
    if why is None and before == after:
        return [*shown, "  (no change in what was compared)" if cut else "  (no change: the file holds this text)"]
    old, new = _lines(before), _lines(after)
    if old == new:  # split at line feeds, they differ only there
        return [*shown, "  (the only change: whether the last line ends with a line feed)"]
    old, new, compared = _compared(old, new)
    if compared is not None:
        shown.append(f"  (only the first {compared:,} lines of the file and of the text compared)")
    lines, long, hidden = _diff(old, new)
    lines = [f"  --- a/{path}", f"  +++ b/{path}", *lines]
    if hidden:
        pending = argv(["devd", "pending", notice.session])
        lines.append(f"  ({_count(hidden, 'changed line')} not shown: `{pending}` shows the whole text)")
    elif long or path != inline(op.Write.path):
        lines.append(_whole_elsewhere(notice, "text"))
    return [*shown, *lines]


def _compared(old: list[str], new: list[str]) -> tuple[list[str], list[str], int | None]:
    """The lines of each to compare: all of them when what differs between the lines they begin and end with alike
    is at most DIFF_COMPARED_LINES_MAX lines, else the first lines up to that much past the beginning alike, and how
    many lines that is (None: all)."""
    same = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        same += 1
    ends = 0
    for a, b in zip(reversed(old[same:]), reversed(new[same:]), strict=False):
        if a != b:
            break
        ends += 1
    if max(len(old), len(new)) - same - ends <= DIFF_COMPARED_LINES_MAX:
        return old, new, None
    upto = same + DIFF_COMPARED_LINES_MAX
    return old[:upto], new[:upto], upto


class _Hunk:
    """Changed lines and their context, as a unified diff shows them: its `@@` header and lines."""

    def __init__(self, group: list[tuple[str, int, int, int, int]], old: list[str], new: list[str]) -> None:
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        self.first, self.last = i1, i2  # of the old lines it covers
        self.header = f"@@ -{_span(i1, i2 - i1)} +{_span(j1, j2 - j1)} @@"
        self.body: list[str] = []
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                self.body += [" " + line for line in old[a1:a2]]
                continue
            self.body += ["-" + line for line in old[a1:a2]]
            self.body += ["+" + line for line in new[b1:b2]]

    def changed(self, start: int = 0) -> int:
        return sum(1 for line in self.body[start:] if line[0] != " ")


def _span(start: int, length: int) -> str:
    """A unified diff's range, as difflib writes it: `3` for one line, `3,4`, and `2,0` for none after line 2."""
    if length == 1:
        return f"{start + 1}"
    return f"{start + 1 if length else start},{length}"


def _diff(old: list[str], new: list[str]) -> tuple[list[str], bool, int]:
    """Every change between `old` and `new`, in at most about DIFF_LINES lines (escaped, each shortened): with
    DIFF_CONTEXT lines of context, less when that does not fit, none when that does not either; then each change
    gets a fair share of the lines, and what does not fit is counted where it was. Unchanged stretches are counted
    too. The lines, whether one was shortened, and how many changed lines were not shown."""
    matcher = difflib.SequenceMatcher(None, old, new)
    for context in (DIFF_CONTEXT, 1, 0):
        hunks = [_Hunk(group, old, new) for group in matcher.get_grouped_opcodes(context)]
        if sum(1 + len(hunk.body) for hunk in hunks) <= DIFF_LINES:
            break
    shown: list[str] = []
    at, hidden = 0, 0
    shares = _shares([1 + len(hunk.body) for hunk in hunks], DIFF_LINES)
    for hunk, share in zip(hunks, shares, strict=True):
        if share == 0:  # this and every later one: counted below
            break
        if hunk.first > at:
            shown.append(f"… {_count(hunk.first - at, 'unchanged line')}")
        shown.append(hunk.header)
        if share > len(hunk.body):
            shown += [block(line) for line in hunk.body]
        else:
            kept = share - 2  # the header and the count
            shown += [block(line) for line in hunk.body[:kept]]
            shown.append(f"… {_count(hunk.changed(kept), 'more changed line')} here")
            hidden += hunk.changed(kept)
        at = hunk.last
    unshown = hunks[shares.index(0) :] if 0 in shares else []
    if unshown:
        changed = sum(hunk.changed() for hunk in unshown)
        hidden += changed
        places = _count(len(unshown), "more place")
        shown.append(f"… {_count(changed, 'more changed line')} in {places}, from line {unshown[0].first + 1}")
    elif at < len(old):
        shown.append(f"… {_count(len(old) - at, 'unchanged line')}")
    long = any(len(line) > DIFF_LINE_CHARS_MAX for line in shown)
    return [f"  {brief(line, DIFF_LINE_CHARS_MAX)}" for line in shown], long, hidden


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}{'' if n == 1 else 's'}"


def _shares(sizes: list[int], total: int) -> list[int]:
    """Lines for each hunk of `sizes` lines, `total` in all with the count of unchanged lines before each: as many
    hunks as can have 3 (a header, a line and a count), in order, each its whole when it fits and otherwise an even
    share of what the smaller ones left."""
    shares = [0] * len(sizes)
    fitting = min(len(sizes), total // 4)
    left = total - fitting  # a line for the unchanged ones before each
    for k, i in enumerate(sorted(range(fitting), key=lambda i: sizes[i])):
        shares[i] = min(sizes[i], left // (fitting - k))
        left -= shares[i]
    return shares


def _whole_elsewhere(notice: ApprovalNotice, what: str) -> str:
    return f"  (shortened to fit the screen: `{argv(['devd', 'pending', notice.session])}` shows the whole {what})"


def _to_line_end(text: str) -> str:
    return text[: text.rfind("\n") + 1]


def replaced(workspace: str | None, path: str) -> tuple[bytes, str | None]:
    """What a write to `path` would replace: its first DIFF_BYTES_MAX + 1 bytes (none for a new file), and why
    nothing was read when it was not. The file is reached as the Write tool reaches it (`devd.agent.tools`: the
    workspace, as the session's binding names it, opened from / without following a link; the path resolved inside
    it, then opened from it one directory at a time without following a link), and read only when it is a regular
    file of one link (opened without following a link or waiting, and checked again once open): a path the Write
    tool would refuse, a link out of the workspace, a hard link, a FIFO or a device is never read. `devd run` runs
    where the daemon does, as a person who may read less (or more) than it: what it cannot read is said so."""
    if workspace is None:
        return b"", "the session's workspace is not known here"
    # Here, not at the top: the tools bring the daemon's logging and sandbox with them, which `devd run` would load
    # at every start (about 20 ms) to show a turn that writes nothing.
    from devd.agent import tools

    try:
        place = tools.Workspace(Path(workspace), tools.pin(Path(workspace)))
    except tools.Refused as e:
        return b"", f"the workspace cannot be reached here: {e.why}"
    try:
        dir_fd, name = tools._reach_file(place, path, for_write=False)  # the Write tool's way, making nothing
    except tools.Refused as e:
        return b"", f"the Write tool will refuse this path: {e.why}"
    except FileNotFoundError:
        return b"", None  # a directory on the way is missing: the write makes it, and a new file
    except OSError as e:
        return b"", f"it cannot be read here: {e.strerror or e}"
    try:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # a device is never opened, even to be checked
        except FileNotFoundError:
            return b"", None
        if (unshown := _unshown(st)) is not None:
            return b"", unshown
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        return b"", f"it cannot be read here: {e.strerror or e}"
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        # made something else between the look and the open
        if (unshown := _unshown(os.fstat(f.fileno()))) is not None:
            return b"", unshown
        return f.read(DIFF_BYTES_MAX + 1), None


def _unshown(st: os.stat_result) -> str | None:
    """Why a file is not read for a diff, or None: it is not a regular file, or it has more than one link, when it
    may be a hard link a command made to a file outside the workspace (/etc/shadow, where fs.protected_hardlinks
    is 0), which a link followed or not would show alike."""
    if not stat.S_ISREG(st.st_mode):
        return _not_regular(st.st_mode)
    if st.st_nlink > 1:
        return (
            f"it has {st.st_nlink} hard links, and may be one to a file outside the workspace; the write replaces "
            "this name alone with a new file"
        )
    return None


def _not_regular(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "it is a directory; the Write tool will refuse it"
    kinds = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
    kind = kinds.get(stat.S_IFMT(mode), "a socket")
    return f"it is {kind}, not a regular file; the write would replace it with a regular file"


def decision_of(answer: str) -> tuple[Literal["allow", "deny"], Remember | Literal[False]]:
    """`[y/N/a/p]`: y allows once, a allows and remembers exactly this call, p this command followed by more words
    (none starting with `-`), anything else denies."""
    word = answer.strip().lower()
    if word in ("a", "always"):
        return "allow", "exact"
    if word in ("p", "prefix"):
        return "allow", "prefix"
    return ("allow" if word in ("y", "yes") else "deny"), False


def _fields(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return {}
    return {str(k): v if isinstance(v, dict) else {} for k, v in properties.items()}


def _required(schema: dict[str, Any]) -> list[str]:
    required = schema.get("required")
    return [str(r) for r in required] if isinstance(required, list) else []


def field_lines(schema: dict[str, Any]) -> list[str]:
    """What a question asks for, a field a line: its name, type (or choices), whether it is required, and its
    description (escaped, shortened)."""
    shown = []
    required = _required(schema)
    for name, spec in _fields(schema).items():
        kind = "one of " + ", ".join(map(str, spec["enum"])) if isinstance(spec.get("enum"), list) else spec.get("type")
        about = spec.get("description") or spec.get("title")
        line = f"  {name}: {kind or 'any'}{', required' if name in required else ''}"
        if about and about != name.title():
            line += f" ({about})"
        shown.append(brief(inline(line), LINE_CHARS_MAX))
    return shown


def input_prompt(notice: InputNotice) -> str:
    """The question a server's elicitation is asked with."""
    only = _only_field(notice.schema)
    how = f"{inline(only)} (or field=value ...)" if only is not None else "field=value ... (or JSON)"
    return f"answer question {notice.request} of action {notice.action}: {how}, Enter declines: "


def _only_field(schema: dict[str, Any]) -> str | None:
    """The field a bare value answers: the only one, or the only required one."""
    fields, required = list(_fields(schema)), _required(schema)
    if len(fields) == 1:
        return fields[0]
    return required[0] if len(required) == 1 else None


def answer_of(notice: InputNotice, text: str) -> dict[str, Any] | None:
    """The answer a line gives (None: declined); ValueError saying what is wrong with it."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            given = json.loads(text)
        except ValueError as e:
            raise ValueError(f"that is not a JSON object ({e})") from None
        if not isinstance(given, dict):
            raise ValueError("that is not a JSON object")
        return given
    fields = _fields(notice.schema)
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"those words cannot be read ({e})") from None
    answer: dict[str, Any] = {}
    only = _only_field(notice.schema)
    if only is not None and not any("=" in w for w in words):
        words = [f"{only}={text}"]
    for word in words:
        name, equals, value = word.partition("=")
        if not equals or name not in fields:
            known = ", ".join(fields) or "none"
            raise ValueError(f"{word!r} is not field=value of a field it asks for ({known})")
        answer[name] = _typed(fields[name], value)
    return answer


def _typed(spec: dict[str, Any], value: str) -> Any:
    """A word as its field's type reads it: yes/no for a boolean, a number for a number; else the word."""
    kind = spec.get("type")
    if kind == "boolean" and value.lower() in ("y", "yes", "true", "1", "n", "no", "false", "0"):
        return value.lower() in ("y", "yes", "true", "1")
    if kind in ("integer", "number"):
        try:
            return int(value) if kind == "integer" else float(value)
        except ValueError:
            return value  # the daemon says what is wrong with it
    return value


def prompt_line(notice: ApprovalNotice) -> str:
    """The question an approval is asked with, saying what `a` (and, for a command, `p`) would remember."""
    found = kinds.of(notice.op)
    if found is None:
        return f"allow action {notice.action}? [y/N] "
    return found[0].prompt(notice.action, found[1])


def _kept(notice: DecidedNotice) -> str:
    """What a decision remembers, as the line that reports it says it."""
    kept = notice.remembered
    if kept is None:
        return ""
    if kept.path is not None:
        return f"; remembered: writes to {brief(inline(kept.path), LINE_CHARS_MAX)}"
    shown = "$ " + brief(argv(kept.argv or []), LINE_CHARS_MAX)
    if kept.scope == "exact":
        return f"; remembered: exactly {shown}"
    return f'; remembered: {shown}, also followed by more words not starting with "-"'
