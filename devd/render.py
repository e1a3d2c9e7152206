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
- `brief(shown, chars_max)`: one of these lines, shortened when it is too long to be seen whole on a screen (a
  command of 200,000 spaces): long runs of spaces and long words cut, each cut counted where it was
  (`…[199,980 spaces]…`), so that every word's start and end can still be seen;
- `json_safe(raw)`: JSON for people: the characters below that JSON leaves raw, as `\\uXXXX` (the same value).
- `in_devd_terms(text, session)`: a message of the daemon's with each method it names as the `devd` command that
  calls it (`METHOD_COMMANDS`), for every front end that shows one (the command line, and the screen of `devd chat`).

The characters: the C0 controls, DEL, the C1 controls, the line and paragraph separators U+2028/U+2029, the bidi
controls (U+061C, U+200E/U+200F, U+202A–U+202E, U+2066–U+2069 and the deprecated U+206A–U+206F), the default-ignorable
and invisible code points that could make a changed text read the same (U+00AD, U+034F, the Hangul fillers U+115F,
U+1160, U+3164 and U+FFA0, U+17B4/5, U+180B–U+180F, U+200B, U+2060–U+2064, U+FEFF, U+1D173–U+1D17A, the tags
U+E0000–U+E007F and the rest of U+E0000–U+E0FFF), and lone surrogates (which cannot be written at all). Where a text
is shown exactly (`argv`, `inline`, `block`, `json_safe`), also the joiners U+200C/U+200D, the variation selectors and
the spaces other than U+0020 (U+00A0, U+2000–U+200A, U+3000, ...); prose keeps these, which scripts and emoji need.
An emoji sequence (pictographs joined by U+200D, with a variation selector, a skin tone, a keycap or a flag's tags) is
shown as it is everywhere. Every other character (é, 日本) is shown as it is.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

__all__ = ["Streamed", "argv", "block", "brief", "inline", "json_safe", "prose"]

# Beside the controls: what reorders text or hides in it, escaped wherever it is shown. The bidi controls; the line
# and paragraph separators; the default-ignorable code points that no text shown here needs (a soft hyphen, the
# combining grapheme joiner, the Hangul fillers, Khmer's inherent vowels, Mongolian's selectors and vowel separator,
# U+200B, the invisible operators U+2060-U+206F, U+FEFF, U+FFF0-U+FFF8, the shorthand and musical format controls, the
# unassigned U+E0000-U+E0FFF), and lone surrogates. Each can make two different texts read the same.
_UNSEEN = (
    "\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b\u200e\u200f\u2028-\u202e\u2060-\u206f"
    "\u3164\ufeff\uffa0\ufff0-\ufff8\ud800-\udfff\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e001f"
    "\U000e0080-\U000e00ff\U000e01f0-\U000e0fff"
)
# The tag characters, which hide whole ASCII texts: shown only as the end of an emoji flag (see _EMOJI).
_TAGS = "\U000e0020-\U000e007f"
# What emoji and some scripts need but reads as nothing alone (ZWNJ, ZWJ, the variation selectors), and the spaces
# other than U+0020 that read as one: kept in prose, escaped where a text is shown exactly (a path, a command, a diff)
# unless they are part of an emoji.
_EXACT_ONLY = "\u200c\u200d\ufe00-\ufe0f\U000e0100-\U000e01ef\u00a0\u1680\u2000-\u200a\u202f\u205f\u2800\u3000"


# An emoji sequence (approximately Unicode's: pictographs, a keycap, a presentation selector or skin tone, joined by
# ZWJ, a flag's tags), kept whole: what it holds is part of one picture.
class _Later:
    """A regular expression compiled at its first use: a daemon imports this module (for the CLI's words) and renders
    nothing as it starts, and the seven of them took about 10 ms of its start."""

    __slots__ = ("_source", "_compiled")

    def __init__(self, source: str) -> None:
        self._source = source
        self._compiled: re.Pattern[str] | None = None

    @property
    def pattern(self) -> re.Pattern[str]:
        if self._compiled is None:
            self._compiled = re.compile(self._source)
        return self._compiled


_PICTOGRAPH = (
    "\u00a9\u00ae\u203c\u2049\u2122\u2139\u2194-\u21aa\u231a-\u23ff\u24c2\u25aa-\u27bf\u2934\u2935\u2b05-\u2b55"
    "\u3030\u303d\u3297\u3299\U0001f000-\U0001faff"
)
_ELEMENT = f"(?:[{_PICTOGRAPH}][\ufe0f\U0001f3fb-\U0001f3ff]?|[0-9#*]\ufe0f?\u20e3)"
_EMOJI = f"(?P<emoji>{_ELEMENT}(?:\u200d{_ELEMENT})*(?:[\U000e0020-\U000e007e]+\U000e007f)?)"
_INLINE = _Later(f"{_EMOJI}|[\x00-\x1f\x7f-\x9f{_UNSEEN}{_TAGS}{_EXACT_ONLY}]")
_BLOCK = _Later(f"{_EMOJI}|[\x00-\x08\x0b-\x1f\x7f-\x9f{_UNSEEN}{_TAGS}{_EXACT_ONLY}]")  # keeps \t and \n
_PROSE = _Later(f"{_EMOJI}|[\x00-\x08\x0b-\x1f\x7f-\x9f{_UNSEEN}{_TAGS}]")  # keeps joiners and spaces too
# JSON escapes the C0 controls itself; outside strings it has only ASCII
_JSON = _Later(f"{_EMOJI}|[\x7f-\x9f{_UNSEEN}{_TAGS}{_EXACT_ONLY}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

# ECMA-48's sequences: a CSI (ESC [, parameters, intermediates, a final byte); a control string (OSC ESC ], DCS ESC P,
# SOS ESC X, PM ESC ^, APC ESC _) up to BEL or ST (ESC \ or U+009C), an OSC 8 hyperlink among them; any other ESC
# sequence (intermediates, then a final byte: ESC 7, ESC ( B, ESC c).
_SEQUENCE = _Later(
    r"\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"
    r"|[\]PX^_][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|[\x20-\x2f]*[\x30-\x4f\x51-\x57\x59\x5a\x5c\x60-\x7e])"
)
# The beginning of one of them, cut off by the end of the text so far (the next piece of a stream may finish it).
_BEGUN = _Later(r"\x1b(?:\[[\x30-\x3f]*[\x20-\x2f]*|[\]PX^_][^\x07\x1b\x9c]*\x1b?|[\x20-\x2f]*)\Z")
HELD_CHARS_MAX = 4096  # of a sequence begun and not finished, held for the next piece; past it, it is shown


def _escaped(found: re.Match[str]) -> str:
    char = found[0]
    if found["emoji"] is not None:
        return char
    code = ord(char)
    if code > 0xFFFF:
        return f"\\U{code:08x}"  # as bash's $'...' and Python write it
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}")


def inline(text: str) -> str:
    """One line of text as it may be shown: every control, line end, tab and bidi or invisible character escaped."""
    return _INLINE.pattern.sub(_escaped, text)


def block(text: str) -> str:
    """Lines of text shown exactly: as `inline`, but line ends and tabs stay."""
    return _BLOCK.pattern.sub(_escaped, text)


def _word(word: str) -> str:
    if inline(word) == word:
        return shlex.quote(word)
    # bash's ANSI-C quoting, which a shell reads back as the same word: \\ and \' first, then the escapes.
    return "$'" + _INLINE.pattern.sub(_escaped, word.replace("\\", "\\\\").replace("'", "\\'")) + "'"


def argv(words: Sequence[str]) -> str:
    """A command as a shell would take it: `shlex.join`'s quoting, and `$'...'` for a word that needs escapes."""
    return " ".join(_word(word) for word in words)


SPACES_RUN_MAX = 8  # spaces in a row that a shortened line keeps as they are
WORD_CHARS_MAX = 160  # of a word that a shortened line keeps whole; a longer one keeps its first 100 and last 40
_WORD_HEAD, _WORD_TAIL = 100, 40


def brief(shown: str, chars_max: int) -> str:
    """A line as shown (by `argv`, `inline` or `block`), shortened when it is longer than `chars_max` characters so
    that its whole shape fits on a screen: each run of more than SPACES_RUN_MAX spaces becomes `…[N spaces]…`, each
    word longer than WORD_CHARS_MAX keeps its start and end around `…[N characters]…`, and when that is still too
    long, the words in the middle become `…[N words, M characters]…`. What was cut is always counted where it was."""
    if len(shown) <= chars_max:
        return shown
    tokens = re.findall(r" +|[^ ]+", shown)
    pieces = [_shortened(token) for token in tokens]
    if sum(map(len, pieces)) <= chars_max:
        return "".join(pieces)
    room = max(chars_max - 40, 0)  # 40 for the count of what is cut
    head_max, tail_max = room * 2 // 3, room // 3
    start, used = 0, 0
    while used + len(pieces[start]) <= head_max:
        used += len(pieces[start])
        start += 1
    end, used = len(pieces), 0
    while end > start and used + len(pieces[end - 1]) <= tail_max:
        used += len(pieces[end - 1])
        end -= 1
    cut = tokens[start:end]
    words = sum(1 for token in cut if token[0] != " ")
    counted = f"…[{words:,} word{'' if words == 1 else 's'}, {sum(map(len, cut)):,} characters]…"
    return "".join(pieces[:start]) + counted + "".join(pieces[end:])


def _shortened(token: str) -> str:
    if token[0] == " ":
        return token if len(token) <= SPACES_RUN_MAX else f"…[{len(token):,} spaces]…"
    if len(token) <= WORD_CHARS_MAX:
        return token
    return f"{token[:_WORD_HEAD]}…[{len(token) - _WORD_HEAD - _WORD_TAIL:,} characters]…{token[-_WORD_TAIL:]}"


def _read(text: str, final: bool) -> tuple[str, int]:
    """The shown form of the longest beginning of `text` that does not end inside a terminal sequence (or a `\\r`
    that a `\\n` may follow), and that beginning's length; when `final`, of all of it."""
    shown: list[str] = []
    at = 0
    while (escape := text.find("\x1b", at)) >= 0:
        shown.append(_prose_chars(text[at:escape]))
        sequence = _SEQUENCE.pattern.match(text, escape)
        if sequence is not None:
            at = sequence.end()
            continue
        if not final and len(text) - escape <= HELD_CHARS_MAX and _BEGUN.pattern.match(text, escape) is not None:
            return "".join(shown), escape
        shown.append("\\x1b")
        at = escape + 1
    end = len(text) - 1 if not final and text.endswith("\r") else len(text)
    shown.append(_prose_chars(text[at:end]))
    return "".join(shown), end


def _prose_chars(text: str) -> str:
    return _PROSE.pattern.sub(_escaped, text.replace("\r\n", "\n"))


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
    shown = _JSON.pattern.sub(_json_escaped, text)
    return raw if shown == text else shown.encode()


def _json_escaped(found: re.Match[str]) -> str:
    if found["emoji"] is not None:
        return found[0]
    code = ord(found[0])
    if code > 0xFFFF:  # JSON writes it as its UTF-16 surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


# The command that does what a method does, for messages that name the method; {session} is the session the command
# at hand was given, else SESSION.
METHOD_COMMANDS: dict[str, str] = {
    "session/list": "devd ls",
    "session/new": "devd new",
    "session/step": "devd step {session} EVENT",
    "session/snapshot": "devd snapshot {session}",
    "session/restore": "devd restore SNAPSHOT",
    "session/fork": "devd fork {session}",
    "session/pending": "devd pending {session}",
    "session/info": "devd info {session}",
    "session/transcript": "devd transcript {session}",
    "session/recover": "devd recover {session}",
    "session/close": "devd close {session}",
    "session/watch": "devd watch {session}",
    "session/approve": "devd approve {session} ACTION",
    "session/usage": "devd usage {session}",
    "session/compact": "devd compact {session}",
    "session/model": "devd model {session} MODEL",
    "session/trace": "devd trace {session}",
    "session/resume": "devd resume {session}",
    "session/budget": "devd budget {session} TOKENS",
    "daemon/status": "devd status",
}

_METHOD_NAMED = _Later(r"`?\b((?:session|daemon)/[a-z]+)\b`?")


def in_devd_terms(text: str, session: str) -> str:
    """text with each method it names (`session/resume`) as the `devd` command that calls it for `session`."""

    def command(found: re.Match[str]) -> str:
        template = METHOD_COMMANDS.get(found[1])
        return found[0] if template is None else f"`{template.format(session=session)}`"

    return _METHOD_NAMED.pattern.sub(command, text)
