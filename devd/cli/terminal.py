"""The terminal of `devd chat`, `devd run` and `devd attach`: one writer and one reader, on prompt_toolkit.

What it promises: the terminal has one owner. Text the screen model (devd.agent.cli.Screen) writes goes through
`Terminal.write`: each finished line is printed above the live area and stays in the scrollback; the line being
streamed, the status line, the question an approval asks and the input line are the live area below it, redrawn by
prompt_toolkit, so that none of them can erase text, nor the text them, whatever order notices come in. Keys are
read by prompt_toolkit on the event loop, never by a thread: a question withdrawn (decided elsewhere) leaves the
prompt at once and takes no line with it; a line typed goes to the first question waiting, else to the chat
(`Line`). Ctrl-C and Ctrl-D are `Interrupt` and `EndOfInput`, for the caller to decide what they mean.

Why prompt_toolkit (not Textual, not readline): it draws an inline live area under the scrollback rather than taking
the whole screen (so what a turn printed is still there after the process exits, in the terminal's own scrollback
and copy-paste), it runs on asyncio (the anyio loop of devd's clients) with no thread reading the terminal, and it
brings multi-line editing, history and key bindings that are its own well-kept code.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from prompt_toolkit.application import Application
from prompt_toolkit.buffer import Buffer
from prompt_toolkit.filters import Condition
from prompt_toolkit.formatted_text import ANSI
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.layout import ConditionalContainer, HSplit, Layout, Window
from prompt_toolkit.layout.controls import BufferControl, FormattedTextControl
from prompt_toolkit.layout.processors import BeforeInput
from prompt_toolkit.output import Output, create_output
from prompt_toolkit.output.vt100 import Vt100_Output
from prompt_toolkit.utils import get_cwidth

STATUS_EVERY_S = 0.25  # how often the status line's clock is redrawn
INPUTS_MAX = 64  # lines and keys waiting for the caller; more are dropped (nobody types that far ahead)
LINE_STYLE = "reverse"
PARTIAL_ROWS_MAX = 3  # rows of the terminal the line being streamed may take in the live area; more go above


class Line(msgspec.Struct, frozen=True):
    """A line (or lines) the person entered, not an answer to a question."""

    text: str


Asked = int | tuple[int, int]  # what a question is about: an approval's action, or an MCP question's (action, request)


class Answer(msgspec.Struct, frozen=True):
    """The answer to the question about `action` (an approval's action, or an MCP question's (action, request))."""

    action: Asked
    text: str


class Interrupt(msgspec.Struct, frozen=True):
    """Ctrl-C."""


class EndOfInput(msgspec.Struct, frozen=True):
    """Ctrl-D on an empty line."""


Input = Line | Answer | Interrupt | EndOfInput


class Terminal(io.TextIOBase):
    """The live area and the text above it. `status` says what the status line shows (None: no line), `question`
    the approval asked (its action and the question; None: none), `prompt` the chat's input label (None: no input
    line except for questions: devd run, devd attach). A writable text stream, for the screen model."""

    def __init__(
        self,
        status: Callable[[], str | None],
        question: Callable[[], tuple[Asked, str] | None],
        prompt: str | None,
        history: Path | None = None,
    ) -> None:
        self._status, self._question, self._prompt = status, question, prompt
        self._left: int | None = None  # the status `leave` gave, once it was called
        self._partial = ""  # what was written after the last line end: shown in the live area until it ends
        self._sends: MemoryObjectSendStream[Input]
        self._sends, self.inputs = anyio.create_memory_object_stream[Input](INPUTS_MAX)
        self.buffer = Buffer(history=_history(history), multiline=True)
        self.app: Application[int] = Application(
            layout=self._layout(),
            key_bindings=self._keys(),
            erase_when_done=True,
            output=_output(),
        )

    # -- the text -------------------------------------------------------------------------------------------------

    def write(self, text: str) -> int:
        """Text of the screen: finished lines go above the live area now, the rest waits there for its end (a line
        longer than PARTIAL_ROWS_MAX rows of the terminal goes above row by row: the live area stays on the screen)."""
        done, ended, self._partial = (self._partial + text).rpartition("\n")
        rows, self._partial = full_rows(self._partial, self.app.output.get_size().columns, PARTIAL_ROWS_MAX)
        if ended or rows:
            self._above((done + "\n" if ended else "") + "".join(row + "\n" for row in rows))
        self.app.invalidate()
        return len(text)

    def flush(self) -> None:
        self.app.invalidate()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return True  # the screen model dims the model's reasoning here, with SGR sequences (what it writes is safe)

    def _above(self, text: str) -> None:
        """Print text above the live area: the area is erased, the text written where it began, the area drawn
        again below it (as prompt_toolkit's in_terminal does, without giving the terminal back to cooked mode,
        where keys typed meanwhile would be echoed)."""
        app = self.app
        if app.is_running:
            app.renderer.erase()
        app.output.write_raw(text.replace("\n", "\r\n"))
        app.output.flush()
        app.invalidate()

    def end(self) -> None:
        """The screen is done: what is still waiting for its line end is printed (with one)."""
        if self._partial:
            self._partial, rest = "", self._partial
            self._above(rest + "\n")

    # -- the live area --------------------------------------------------------------------------------------------

    def _layout(self) -> Layout:
        # ANSI: the screen model's own SGR sequences (reasoning dimmed) drawn, not shown; the model's text has none
        streaming = Window(FormattedTextControl(lambda: ANSI(self._partial)), wrap_lines=True, dont_extend_height=True)
        status = Window(
            FormattedTextControl(lambda: f" {self._status() or ''} "), height=1, style=LINE_STYLE, wrap_lines=False
        )
        entry = Window(
            BufferControl(self.buffer, input_processors=[BeforeInput(self._label)]),
            wrap_lines=True,
            dont_extend_height=True,
        )
        return Layout(
            HSplit(
                [
                    ConditionalContainer(streaming, filter=Condition(lambda: bool(self._partial))),
                    ConditionalContainer(status, filter=Condition(lambda: self._status() is not None)),
                    ConditionalContainer(entry, filter=Condition(lambda: self._label() != "")),
                ]
            ),
            focused_element=entry,
        )

    def _label(self) -> str:
        asked = self._question()
        if asked is not None:
            return asked[1]
        return self._prompt or ""

    def _keys(self) -> KeyBindings:
        keys = KeyBindings()

        @keys.add("enter")
        def _enter(event: KeyPressEvent) -> None:
            text = self.buffer.text
            if self._question() is None and text.endswith("\\"):  # a line continued: `\` then Enter
                self.buffer.text = text[:-1] + "\n"
                self.buffer.cursor_position = len(self.buffer.text)
                return
            self._entered(text)

        @keys.add("escape", "enter")
        def _newline(event: KeyPressEvent) -> None:
            self.buffer.insert_text("\n")

        @keys.add("c-c")
        def _interrupt(event: KeyPressEvent) -> None:
            self.buffer.reset()
            self._send(Interrupt())

        @keys.add("c-d")
        def _end(event: KeyPressEvent) -> None:
            if self.buffer.text:
                self.buffer.delete()
            else:
                self._send(EndOfInput())

        return keys

    def _entered(self, text: str) -> None:
        asked = self._question()
        if asked is not None and not (self._prompt is not None and text.startswith("/")):  # a command is not an answer
            self.buffer.reset()
            self._send(Answer(asked[0], text))
        elif self._prompt is not None:
            if text.strip():
                self.buffer.append_to_history()
            self.buffer.reset()
            self._send(Line(text))

    def _send(self, given: Input) -> None:
        try:
            self._sends.send_nowait(given)
        except anyio.WouldBlock:
            pass  # INPUTS_MAX ahead of the caller: this one is dropped

    # -- running --------------------------------------------------------------------------------------------------

    async def run(self, started: Callable[[], None] = lambda: None) -> int:
        """Own the terminal until `leave`; the status given there. `started` is called once it is ours."""

        def pre_run() -> None:
            started()
            self._leave_if_left()

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._tick)
            try:
                status = await self.app.run_async(pre_run=pre_run)
            finally:
                tg.cancel_scope.cancel()
                self.end()
        return status

    async def _tick(self) -> None:
        """Redraw the status line when what it says changed (its clock, `thinking (3.2 s)`), and only then: an idle
        chat draws nothing (prompt_toolkit's refresh_interval redrew the whole live area four times a second)."""
        shown = self._status()
        while True:
            await anyio.sleep(STATUS_EVERY_S)
            if (now := self._status()) != shown:
                shown = now
                self.app.invalidate()

    def leave(self, status: int) -> None:
        """Give the terminal back (what `run` answers), now or as soon as it runs."""
        self._left = status
        if self.app.is_running and not self.app.is_done:
            self.app.exit(result=status)

    def _leave_if_left(self) -> None:
        if self._left is not None:
            self.app.exit(result=self._left)


_SHOWN = re.compile(r"(?P<sgr>\x1b\[[0-9;]*m)|.", re.DOTALL)  # an SGR sequence of the screen model's, or a character


def full_rows(text: str, columns: int, rows_max: int) -> tuple[list[str], str]:
    """`text` (no line end in it) as a terminal of `columns` would wrap it: the rows past the last `rows_max` it
    would take, each whole, and what is left (at most `rows_max` rows). Widths as the terminal counts them (a wide
    character two columns, a combining one none, an SGR sequence none)."""
    rows: list[str] = []
    start, width = 0, 0
    for found in _SHOWN.finditer(text):
        if found["sgr"] is not None:
            continue  # takes no column, and is never cut
        i, w = found.start(), get_cwidth(found[0])
        if width + w > columns and i > start:
            rows.append(text[start:i])
            start, width = i, 0
        width += w
    if len(rows) < rows_max:
        return [], text
    cut = len(rows) - rows_max + 1  # rows before the last rows_max (the last row may be partly filled)
    return rows[:cut], text[sum(map(len, rows[:cut])) :]


def _output() -> Output:
    """The terminal's output, without cursor-position requests: with them prompt_toolkit stretches the live area down
    to the bottom of the screen, measured once, and each line printed above then scrolls the top of the screen away
    under a live area that no longer fits; without, the live area is as tall as what it shows."""
    output = create_output()
    if isinstance(output, Vt100_Output):
        output.enable_cpr = False
    return output


def _history(path: Path | None) -> History:
    """The chat's history: kept in `path` across runs when it can be (its directory made), else for this run."""
    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    except OSError:
        return InMemoryHistory()
    return FileHistory(str(path))
