"""Session titles: what a session is about, in a line a person can tell sessions apart by.

A title is a record of the session's log (kind `title`, body `Title`), so it is durable before it is answered, goes
with the session (deleted with it, carried by a fork made after it was set) and needs nothing of the stores but what
every record has. The last one written is the session's. A session of an agent is titled with its first prompt, cut
to `FIRST_PROMPT_CHARS` characters on one line, unless a title was set before; `session/title` sets one at any time.

`Titles` keeps what it has read, so that `session/list` reads the store once per titled session a daemon's life, not
once per page (which sessions have a title record at all is read once, at the first look): a title is known here once
read or set here, and forgotten when the session ends here (closed, expired, moved); a fork is told (`made`). In a
fleet, a title another daemon sets is seen here once the session ends here or the daemon starts again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

import anyio
import anyio.lowlevel
import msgspec

from devd.agent import records
from devd.agent.port import RecordLog
from devd.storage.store import Record

TITLE = "title"  # the record kind
FIRST_PROMPT_CHARS = 60  # a title taken from a first prompt is cut to this many characters
LOOKUPS_BETWEEN_YIELDS = 100  # titles read from the store for a list page before other calls get a turn


class Title(msgspec.Struct, frozen=True):
    """A session's title; `prompt`: it was taken from the first prompt (a title set later replaces it)."""

    title: str
    prompt: bool = False


def from_prompt(prompt: str) -> str | None:
    """The title a first prompt gives: its words on one line (every run of white space, control characters included,
    one space; characters that are not printable left out), cut to FIRST_PROMPT_CHARS with an ellipsis; None when
    nothing printable is left."""
    words = "".join(c if c.isprintable() else " " for c in prompt).split()
    line = " ".join(words)
    if not line:
        return None
    return line if len(line) <= FIRST_PROMPT_CHARS else line[: FIRST_PROMPT_CHARS - 1].rstrip() + "…"


class Titles:
    """The sessions' titles, read from their record logs and kept."""

    def __init__(self, log: RecordLog, seq: Callable[[str], int | None]) -> None:
        self.log = log
        self.seq = seq  # a session's last step (a record is written at it)
        self._known: dict[str, Title | None] = {}
        # The sessions that may have a title (read once, from the store's index of record kinds): any other is known
        # to have none without a read, so a first `session/list` of 100,000 untitled sessions reads nothing more.
        self._titled: set[str] | None = None
        self._reading: anyio.Event | None = None  # set once the read of `_titled` under way ends
        # Sessions that may have a title made known before `_titled` was read (a fork while it is read): the read's
        # scan may have run before their records were written.
        self._meanwhile: set[str] = set()

    async def set(self, session: str, title: str, *, prompt: bool = False) -> None:
        """Keep the session's title durably (a title from a prompt only where none was there)."""
        if prompt and await self.get_kept(session) is not None:
            return
        kept = Title(title, prompt)
        await self.log.add_record(Record(session, self.seq(session) or 0, TITLE, 0, records.encode(kept)))
        self._known[session] = kept
        if self._titled is not None:
            self._titled.add(session)

    def made(self, session: str) -> None:
        """A session was made from another's records (a fork): it may have a title, read when it is asked for."""
        self._known.pop(session, None)
        if self._titled is not None:
            self._titled.add(session)
        else:
            self._meanwhile.add(session)

    async def get_kept(self, session: str) -> Title | None:
        titled = await self._titled_sessions()
        if session not in self._known and session not in titled:
            return None
        if session not in self._known:
            found = await self.log.records(session, (TITLE,))
            self._known[session] = records.decode(found[-1].body, Title) if found else None
        return self._known[session]

    async def _titled_sessions(self) -> AbstractSet[str]:
        """The sessions that may have a title, read once: the looks that come while it is read wait for that read
        (300 first prompts at once each read every title record of the store)."""
        while self._titled is None:
            if self._reading is not None:
                await self._reading.wait()
                continue  # read, or that read failed: this look tries again
            self._reading = reading = anyio.Event()
            try:
                self._titled = set(await self.log.recorded(TITLE)) | self._meanwhile
                self._meanwhile.clear()
            finally:
                self._reading = None
                reading.set()
        return self._titled

    async def get(self, session: str) -> str | None:
        kept = await self.get_kept(session)
        return None if kept is None else kept.title

    async def of(self, sessions: Sequence[str]) -> dict[str, str]:
        """The titles of those of `sessions` that have one."""
        titled: dict[str, str] = {}
        for i, session in enumerate(sessions):
            if i and session not in self._known and i % LOOKUPS_BETWEEN_YIELDS == 0:
                await anyio.lowlevel.checkpoint()
            title = await self.get(session)
            if title is not None:
                titled[session] = title
        return titled

    def forget(self, session: str) -> None:
        self._known.pop(session, None)
