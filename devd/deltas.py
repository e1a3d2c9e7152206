"""The text of one streamed reply as `session/delta` tells it: the fragments told so far, kept as fragments (a reply
of many small ones is never copied whole per fragment), and, when the reply streams again from its beginning (a
retried model call, a re-ask, a watch resumed after a reconnect), only what goes past the text already told.

The daemon's fan-out tells its watchers through one; the ACP bridge tells its editor through one. Pure: no I/O.
"""

from __future__ import annotations

import msgspec

__all__ = ["Stream"]


class Stream(msgspec.Struct):
    """The text told of one Model action, kept as its fragments (a reply of many small ones is never copied whole per
    fragment); while a retry repeats it, the text told and how far the retry has come."""

    fragments: list[str] = msgspec.field(default_factory=list)
    repeating: tuple[str, int] | None = None

    def text(self) -> str:
        return "".join(self.fragments)

    def again(self) -> None:
        self.repeating = (self.text(), 0)

    def add(self, text: str) -> str:
        """Keep `text`; what of it is new to the watchers (empty while a retry repeats what they were told). Past
        what was told, only the rest is new; a retry that says something else is told as it comes (the step's reply
        is the text then)."""
        if self.repeating is not None:
            told, at = self.repeating
            end = at + len(text)
            if end <= len(told) and told.startswith(text, at):
                self.repeating = (told, end)  # nothing new yet
                return ""
            self.repeating = None
            if told.startswith(text[: len(told) - at], at):
                text = text[len(told) - at :]
        self.fragments.append(text)
        return text
