"""Text a model chose, made safe to show on a terminal (or in an editor's terminal-like panel): pure, no I/O.

A terminal takes some characters as orders: a carriage return and an escape sequence rewrite what the screen shows,
a bidi control reorders it. Shown as they are, a model's words could make `devd run`'s approval read `$ ls -la`
while `y` runs something else. So everything a model chose (a command's words, a path, a URL, the text it streams,
what its commands print, a reason that quotes any of these) is shown through one of these:

- `argv(words)`: a command as a shell takes it, each word quoted as `shlex.join` quotes it; a word holding a character
  below is written in bash's `$'...'` form instead, so that what is shown is exactly what would run, and shows it;
- `inline(text)`: one line (a path, a URL, a title, a reason): each character below as a visible escape (`\\x1b`,
  `\\u202e`), a line end and a tab too;
- `block(text)`: lines shown exactly (a diff of a write): the same, but line ends and tabs stay;
- `prose(text)` and `Streamed`: text to be read (the model's words, a command's output, whole or as it streams):
  terminal sequences (CSI, OSC such as a hyperlink, any other ESC sequence) removed, so that coloured or linked text
  still reads well; a line end written `\\r\\n` is a line end; any other character below is shown as an escape;
- `json_safe(raw)`: JSON for people: the characters below that JSON leaves raw, as `\\uXXXX` (the same value).

The characters: the C0 controls, DEL, the C1 controls, the line and paragraph separators U+2028/U+2029, the bidi
controls (U+061C, U+200E/U+200F, U+202A–U+202E, U+2066–U+2069 and the deprecated U+206A–U+206F), the invisible
U+200B, U+2060–U+2064 and U+FEFF, and lone surrogates (which cannot be written at all). Every other character (é, 日本,
emoji, and the joiners U+200C/U+200D that emoji and scripts need) is shown as it is.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

__all__ = ["Streamed", "argv", "block", "inline", "json_safe", "prose"]

# Beside the controls: what reorders text or hides in it.
_UNSEEN = "\u061c\u200b\u200e\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ud800-\udfff"
_INLINE = re.compile(f"[\x00-\x1f\x7f-\x9f{_UNSEEN}]")
_BLOCK = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_UNSEEN}]")  # keeps \t and \n
_JSON = re.compile(f"[\x7f-\x9f{_UNSEEN}]")  # JSON escapes the C0 controls itself; outside strings it has only ASCII
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

# ECMA-48's sequences: a CSI (ESC [, parameters, intermediates, a final byte); a control string (OSC ESC ], DCS ESC P,
# SOS ESC X, PM ESC ^, APC ESC _) up to BEL or ST (ESC \ or U+009C), an OSC 8 hyperlink among them; any other ESC
# sequence (intermediates, then a final byte: ESC 7, ESC ( B, ESC c).
_SEQUENCE = re.compile(
    r"\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"
    r"|[\]PX^_][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|[\x20-\x2f]*[\x30-\x4f\x51-\x57\x59\x5a\x5c\x60-\x7e])"
)
# The beginning of one of them, cut off by the end of the text so far (the next piece of a stream may finish it).
_BEGUN = re.compile(r"\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*|[\]PX^_][^\x07\x1b\x9c]*\x1b?|[\x20-\x2f]*)\Z")
HELD_CHARS_MAX = 4096  # of a sequence begun and not finished, held for the next piece; past it, it is shown


def _escaped(found: re.Match[str]) -> str:
    char = found[0]
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}")


def inline(text: str) -> str:
    """One line of text as it may be shown: every control, line end, tab and bidi or invisible character escaped."""
    return _INLINE.sub(_escaped, text)


def block(text: str) -> str:
    """Lines of text shown exactly: as `inline`, but line ends and tabs stay."""
    return _BLOCK.sub(_escaped, text)


def _word(word: str) -> str:
    if _INLINE.search(word) is None:
        return shlex.quote(word)
    # bash's ANSI-C quoting, which a shell reads back as the same word: \\ and \' first, then the escapes.
    return "$'" + _INLINE.sub(_escaped, word.replace("\\", "\\\\").replace("'", "\\'")) + "'"


def argv(words: Sequence[str]) -> str:
    """A command as a shell would take it: `shlex.join`'s quoting, and `$'...'` for a word that needs escapes."""
    return " ".join(_word(word) for word in words)


def _read(text: str, final: bool) -> tuple[str, int]:
    """The shown form of the longest beginning of `text` that does not end inside a terminal sequence (or a `\\r`
    that a `\\n` may follow), and that beginning's length; when `final`, of all of it."""
    shown: list[str] = []
    at = 0
    while (escape := text.find("\x1b", at)) >= 0:
        shown.append(_prose_chars(text[at:escape]))
        sequence = _SEQUENCE.match(text, escape)
        if sequence is not None:
            at = sequence.end()
            continue
        if not final and len(text) - escape <= HELD_CHARS_MAX and _BEGUN.match(text, escape) is not None:
            return "".join(shown), escape
        shown.append("\\x1b")
        at = escape + 1
    end = len(text) - 1 if not final and text.endswith("\r") else len(text)
    shown.append(_prose_chars(text[at:end]))
    return "".join(shown), end


def _prose_chars(text: str) -> str:
    return _BLOCK.sub(_escaped, text.replace("\r\n", "\n"))


def prose(text: str) -> str:
    """Whole text to be read: terminal sequences removed, `\\r\\n` a line end, any other control or bidi character
    escaped; line ends and tabs stay."""
    return _read(text, final=True)[0]


class Streamed:
    """Text to be read as it streams, piece by piece, shown as `prose` shows it whole: a sequence cut between two
    pieces is held until the next (up to HELD_CHARS_MAX characters), and `end` shows what is still held."""

    def __init__(self) -> None:
        self._held = ""

    def add(self, piece: str) -> str:
        """What to show of `piece` now."""
        text = self._held + piece
        shown, used = _read(text, final=False)
        self._held = text[used:]
        return shown

    def end(self) -> str:
        """What to show of what is held, the stream being over."""
        shown, self._held = prose(self._held), ""
        return shown


def json_safe(raw: bytes) -> bytes:
    """JSON (UTF-8) with the characters above that JSON leaves raw written as `\\uXXXX`: the same value."""
    text = raw.decode()
    if _JSON.search(text) is None:
        return raw
    return _JSON.sub(lambda found: f"\\u{ord(found[0]):04x}", text).encode()
