"""`devd run` and `devd attach`: a turn the daemon drives, shown as it happens.

`devd run [--agent NAME] [--workspace DIR] [--session NAME] PROMPT` starts a session of an agent (or continues the
session `--session` names, made if there is none), prompts it, and shows the turn: the model's text as it streams,
each call and its result, and the outcome; while the model thinks, a progress line on stderr when it is a terminal.
It exits 0 when the turn is done, 1 when it ended otherwise (cancelled by another client, the session closed), and
130 after Ctrl-C, which cancels the turn (a `Cancel` step). `devd attach SESSION` shows the same of a session someone
else drives, until its running turn ends (or Ctrl-C, which leaves the turn alone).

Rendering is a pure function of the notices (`Screen`), so that what people see is tested without a terminal. What
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

import argparse
import difflib
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

import anyio
import anyio.abc
import anyio.to_thread

from devd.agent import kinds, tools
from devd.agent.kinds.base import LINE_CHARS_MAX
from devd.client import ActionsNotice, AsyncClient, Notice, UnwatchedNotice
from devd.errors import BusyError, ConflictError, HandleError
from devd.messages import Action, Cancel, Event, Op, Output
from devd.protocol import ApprovalNotice, DecidedNotice, DeltaNotice, Remember, StalledNotice
from devd.render import Streamed, argv, block, brief, inline, prose

EXIT_OK = 0
EXIT_ENDED = 1
EXIT_INTERRUPTED = 130
RESULT_LINES = 8  # of a call's output shown; the rest is counted
DIFF_LINES = 50  # of a write's diff shown (hunk headers, changed lines, context), every change counted where it is
DIFF_CONTEXT = 3  # unchanged lines shown around a change, while the diff fits in DIFF_LINES
# Lines of the file and of the text compared past what they begin and end with alike: difflib's time grows with
# their product when changes are many (30,000 lines, every third changed: 154 s; 2,000: 0.25 s).
DIFF_COMPARED_LINES_MAX = 2000
DIFF_BYTES_MAX = 256 * 1024  # of the file a write's diff reads, and characters of the text it compares
DIFF_LINE_CHARS_MAX = 320  # of one line of a diff shown (4 rows of 80 columns)
PROGRESS_EVERY_S = 0.25
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


@dataclass
class Screen:
    """What a turn looks like, built from the session's notices: text is written as it streams, calls and results as
    lines. `turn` is the turn being shown (None: the next Done ends it)."""

    out: TextIO
    turn: int | None = None
    asking: int | None = None  # the Model action being asked, while its answer is not in
    calls: dict[int, Action] = field(default_factory=dict)
    at_line_start: bool = True
    outcome: str | None = None  # "complete" or "cancelled", once the turn's Done came
    interrupted: bool = False  # Ctrl-C: the turn was cancelled from here
    texts: dict[int, str] = field(default_factory=dict)  # what was streamed of each Model action
    streams: dict[int, Streamed] = field(default_factory=dict)  # each Model action's text being shown as it streams
    workspace: str | None = None  # where a write's diff is taken against, when known

    def show(self, notice: Notice) -> None:
        if isinstance(notice, DeltaNotice) and notice.kind != "text":
            self.asking = None
            # The model's reasoning (or a summary it writes): dimmed on a terminal, left out of a pipe's output.
            if self.out.isatty():
                self._write(f"{DIM}{prose(notice.text)}{UNDIM}")
        elif isinstance(notice, DeltaNotice):
            self.asking = None
            self.texts[notice.action] = self.texts.get(notice.action, "") + notice.text
            self._write(self.streams.setdefault(notice.action, Streamed()).add(notice.text))
        elif isinstance(notice, StalledNotice):
            self._line(
                f"[the turn waits: {brief(inline(notice.why), LINE_CHARS_MAX)}]"
            )  # each why says what stalled it and what carries on
        elif isinstance(notice, ApprovalNotice):
            why = "" if notice.why is None else f": {brief(inline(notice.why), LINE_CHARS_MAX)}"  # why it asks
            self._line(f"[approval needed for action {notice.action}{why}]")
            for line in approval_lines(notice, self.workspace):
                self._line(line)
        elif isinstance(notice, DecidedNotice):
            said = {"allow": "allowed", "deny": "denied", "cancelled": "withdrawn: its turn was cancelled"}
            self._line(f"[action {notice.action} {said[notice.decision]} by {inline(notice.by)}{_kept(notice)}]")
        elif isinstance(notice, ActionsNotice):
            self._step(notice)
        self.out.flush()

    def _step(self, notice: ActionsNotice) -> None:
        event = notice.event
        answered = event.Model.id if event.Model is not None else None
        if answered is not None and self.asking == answered:
            self.asking = None
        if answered is not None and answered in self.streams:
            self._write(self.streams.pop(answered).end())  # a sequence its stream left unfinished, shown
        output = _result(event)
        if output is not None and output.id in self.calls:
            for line in result_lines(output):
                self._line(line)
        for action in notice.actions:
            op = action.op
            if op.Model is not None:
                self.asking = action.id
            elif op.Emit is not None:
                streamed = self.texts.get(answered, "") if answered is not None else ""
                if streamed != op.Emit:  # not streamed here, or only its end (attached while it was written)
                    self._end_line()
                    self._write(prose(op.Emit))
                self._end_line()
            elif op.Done is not None and (self.turn is None or op.Done.turn == self.turn):
                for stream in self.streams.values():  # cut off by a cancel: what they hold is shown
                    self._write(stream.end())
                self.streams.clear()
                self.outcome = "complete" if op.Done.outcome.Complete else "cancelled"
                self._line(f"[turn {op.Done.turn} {self.outcome}]")
            elif (called := call_line(action)) is not None:
                self.calls[action.id] = action
                self._line(called)

    def _write(self, text: str) -> None:
        self.out.write(text)
        if text:
            self.at_line_start = text.endswith("\n")

    def _end_line(self) -> None:
        if not self.at_line_start:
            self._write("\n")

    def _line(self, text: str) -> None:
        self._end_line()
        self._write(text + "\n")


async def _progress(screen: Screen, err: TextIO) -> None:
    """While the model is asked and has written nothing yet: `⋯ the model is thinking (3.2 s)` on stderr, redrawn."""
    since: float | None = None
    drawn = False
    while True:
        if screen.asking is not None:
            since = since or time.monotonic()
            err.write(f"\r⋯ the model is thinking ({time.monotonic() - since:.1f} s)")
            err.flush()
            drawn = True
        elif drawn:
            err.write("\r\033[K")
            err.flush()
            since, drawn = None, False
        await anyio.sleep(PROGRESS_EVERY_S)


async def _follow(
    client: AsyncClient, session: str, since: int | None, screen: Screen, subscribed: anyio.Event | None = None
) -> int:
    """Show the session's notices until the turn's Done, asking `[y/N/a]` for each approval when a terminal is
    attached; the exit status. `subscribed` is set once the watch has begun."""
    async with anyio.create_task_group() as tg:
        status = await _notices(client, session, since, screen, tg, subscribed)
        tg.cancel_scope.cancel()
    return status


async def _notices(
    client: AsyncClient,
    session: str,
    since: int | None,
    screen: Screen,
    tg: anyio.abc.TaskGroup,
    subscribed: anyio.Event | None,
) -> int:
    asking: dict[int, anyio.CancelScope] = {}
    async for notice in client.watch(session, since=since, subscribed=subscribed):
        screen.show(notice)
        if isinstance(notice, ApprovalNotice) and notice.action not in asking:
            if sys.stdin.isatty():
                asking[notice.action] = scope = anyio.CancelScope()
                tg.start_soon(_ask, client, notice, screen, scope)
            else:
                screen._line(f"[answer it with `devd approve {session} {notice.action}` or `devd deny ...`]")
        elif isinstance(notice, DecidedNotice) and notice.action in asking:
            asking.pop(notice.action).cancel()  # decided elsewhere: the question is withdrawn
        if screen.outcome is not None:
            return EXIT_OK if screen.outcome == "complete" else EXIT_ENDED
        if isinstance(notice, UnwatchedNotice):
            screen._line(f"[the watch ended: {inline(notice.reason)}]")
            return EXIT_ENDED
    return EXIT_ENDED


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


async def _ask(client: AsyncClient, notice: ApprovalNotice, screen: Screen, scope: anyio.CancelScope) -> None:
    """Ask the person at the terminal; their answer goes to the daemon unless another client decided first."""
    with scope:
        screen.out.write(prompt_line(notice))
        screen.out.flush()
        screen.at_line_start = False
        answer = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        screen.at_line_start = True
        decision, remember = decision_of(answer)
        try:
            await client.approve(notice.session, notice.action, notice.digest, decision, remember=remember)
        except ConflictError as e:
            screen._line(f"[{inline(str(e))}]")


async def _seq(client: AsyncClient, session: str) -> int | None:
    from devd.driver import _just_before

    page = await client.list(1, _just_before(session))
    return page.sessions[0].seq if page.sessions and page.sessions[0].session == session else None


async def _run(client: AsyncClient, args: argparse.Namespace, screen: Screen) -> int:
    session = args.session
    seq = None if session is None else await _seq(client, session)
    if seq is None:
        workspace = os.path.abspath(args.workspace or os.getcwd())
        session = await client.new(session=session, agent=args.agent, workspace=workspace)
        seq = 0
    screen.workspace = (await client.agent(session)).workspace  # the binding's: --workspace is only for a new one
    subscribed, prompted = anyio.Event(), anyio.Event()
    statuses: list[int] = []

    async def follow(scope: anyio.CancelScope) -> None:
        statuses.append(await _follow(client, session, seq, screen, subscribed))
        await prompted.wait()  # a turn done before its prompt's answer was read: the answer is read first
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            if sys.stderr.isatty():
                tg.start_soon(_progress, screen, sys.stderr)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                # Watched before the prompt: the text the model streams (`session/delta`) is not journalled, so
                # what streamed before the watch began would never be shown. Until the prompt answers, the next Done
                # is the turn's (the watch starts after the session's last step).
                tg.start_soon(follow, tg.cancel_scope)
                await subscribed.wait()
                screen.turn = turn = await client.prompt(session, args.prompt)
                prompted.set()
                tg.start_soon(_cancel_on, signals, client, session, turn, screen, tg.cancel_scope)
                await anyio.sleep_forever()
    except* ConnectionError as lost:
        raise _lost(lost, session) from None
    status = statuses[0] if statuses else EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if screen.interrupted else status


async def _cancel_on(
    signals: AsyncIterator[int],
    client: AsyncClient,
    session: str,
    turn: int,
    screen: Screen,
    scope: anyio.CancelScope,
) -> None:
    """Ctrl-C: cancel the turn (a Cancel step, keyed: a retry sends nothing new), then stop showing it."""
    async for _ in signals:
        screen.interrupted = True
        with anyio.CancelScope(shield=True):
            await _cancel(client, session, turn)
        if screen.outcome is None:
            screen.outcome = "cancelled"
            screen._line(f"[turn {turn} cancelled]")
        scope.cancel()
        return


async def _cancel(client: AsyncClient, session: str, turn: int) -> None:
    """Step the turn's Cancel (keyed: a retry sends nothing new), waiting out BUSY: the daemon may be stepping it."""
    for delay in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 1.0, 1.0):
        try:
            await client.step(session, Event(Cancel=Cancel(turn=turn)), key=f"devd run:{session}:cancel:{turn}")
            return
        except BusyError:
            await anyio.sleep(delay)
    await client.step(session, Event(Cancel=Cancel(turn=turn)), key=f"devd run:{session}:cancel:{turn}")


async def _attach(client: AsyncClient, args: argparse.Namespace, screen: Screen) -> int:
    if await _seq(client, args.session) is None:
        raise HandleError(f"no session is named {args.session!r}; `devd ls` shows the sessions there are")
    screen.workspace = (await client.agent(args.session)).workspace
    owed = await client.pending(args.session)
    if not owed:
        screen._line(f"[session {args.session} has no turn running; waiting for one, Ctrl-C to stop]")
    else:
        screen.asking = next((a.id for a in owed if a.op.Model is not None), None)
    status = EXIT_INTERRUPTED
    try:
        async with anyio.create_task_group() as tg:
            if sys.stderr.isatty():
                tg.start_soon(_progress, screen, sys.stderr)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                tg.start_soon(_stop_on, signals, tg.cancel_scope)
                status = await _follow(client, args.session, None, screen)
            tg.cancel_scope.cancel()
    except* ConnectionError as lost:
        raise _lost(lost, args.session) from None
    return status


def _lost(group: BaseExceptionGroup[ConnectionError], session: str) -> ConnectionError:
    """The daemon went away while a turn was shown: one error (not the task groups' nesting), saying that the turn
    is the daemon's and how to follow it again."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return ConnectionError(
        f"{first}; the turn is the daemon's: once it answers again, `devd attach -- {session}` shows it"
    )


async def _stop_on(signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


def main(args: argparse.Namespace, address: str, token: str | None) -> int:
    """Run `devd run` or `devd attach`; the exit status (errors are raised, for the caller to show)."""
    command: Callable[[AsyncClient, argparse.Namespace, Screen], Awaitable[int]] = (
        _run if args.command == "run" else _attach
    )

    async def go() -> int:
        async with AsyncClient.connect(address, token=token, peers=args.peer or ()) as client:
            from devd.cli.sessions import cli_client_name  # who answers approvals from here

            await client.initialize(token=token, name=cli_client_name())
            return await command(client, args, Screen(sys.stdout))

    return anyio.run(go)
