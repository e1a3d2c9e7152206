"""The bounded conversation, on the daemon's side: what a `Summary` event replaced stays readable.

The core forgets the messages a `Summary` event replaces (that is what bounds its asks and its memory); the daemon
keeps them, one `replaced` record per summary, written with the step: `{"from": F, "messages": [...]}`, the replaced
messages of the whole conversation from its message F on, a leading Summary of an earlier summary left out. The
whole conversation is those records' messages, in order, then what the core holds after its Summary. What this module
promises: pure functions, no I/O; a whole conversation is given only when the records account for every message the
core's Summary says it replaced, else `InternalError` says which are missing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from devd.errors import InternalError
from devd.messages import Event, Message

__all__ = ["REPLACED", "Replaced", "is_summary", "replaced", "whole"]

REPLACED = "replaced"  # the record kind

# An event's first member's name, as written: the core reads its escapes (`"\u0053ummary"` is "Summary").
_FIRST_NAME = re.compile(rb'\A\s*\{\s*("(?:[^"\\]|\\.)*")\s*:')
_SUMMARY_MESSAGE = b'{"Summary":'  # the core writes its messages compact


class Replaced(msgspec.Struct, frozen=True):
    """One summary's record: the messages it replaced, from message `from` of the whole conversation on."""

    from_: int = msgspec.field(name="from")
    messages: list[msgspec.Raw]


_event = msgspec.json.Decoder(Event)
_messages = msgspec.json.Decoder(list[msgspec.Raw])
_message = msgspec.json.Decoder(Message)
_encoder = msgspec.json.Encoder()


def is_summary(event: bytes) -> bool:
    """Whether the event is a Summary (a cheap look at its start: every step passes here), its name read as the core
    reads it, escapes and all: one the core takes and this missed would have what it replaced lost."""
    if event.startswith(b'{"'):  # compact, as the core and every client write it: read without the pattern
        end = event.find(b'"', 2)
        if end > 2 and event[end + 1 : end + 2] == b":" and b"\\" not in event[2:end]:
            return event[2:end] == b"Summary"
    first = _FIRST_NAME.match(event)
    if first is None:
        return False
    name = first.group(1)
    if b"\\" not in name:
        return name == b'"Summary"'
    try:
        return bool(msgspec.json.decode(name) == "Summary")
    except msgspec.DecodeError:  # an escape the core refuses too
        return False


def _leads(messages: Sequence[msgspec.Raw]) -> bool:
    """Whether the transcript starts with a Summary (only ever its first message)."""
    return bool(messages) and bytes(messages[0]).startswith(_SUMMARY_MESSAGE)


def _count(messages: Sequence[msgspec.Raw]) -> int:
    """How many messages of the whole conversation a leading Summary stands for (0: none leads)."""
    summary = _message.decode(messages[0]).Summary if _leads(messages) else None
    return 0 if summary is None else summary.replaced


def replaced(before: bytes, event: bytes) -> bytes:
    """The record of a Summary event the core took: the messages it replaced of `before` (the core's transcript
    just before it), a leading Summary left out, and where they start in the whole conversation."""
    summary = _event.decode(event).Summary
    assert summary is not None, "replaced() of an event that is not a Summary"
    messages = _messages.decode(before)
    return _encoder.encode(Replaced(_count(messages), messages[int(_leads(messages)) : summary.upto]))


def whole(records: Sequence[bytes], current: bytes, start: int) -> bytes:
    """The whole conversation from message `start` on (none past its end), as a JSON array: the records' messages,
    then `current` (the core's transcript) after its Summary. A record of a summary whose step was written again (a
    retry after a failed commit) is one the others already cover, and is skipped."""
    kept: list[msgspec.Raw] = []
    for body in records:
        record = msgspec.json.decode(body, type=Replaced)
        if record.from_ + len(record.messages) <= len(kept):
            continue
        if record.from_ != len(kept):
            raise InternalError(
                f"messages {len(kept)} to {record.from_ - 1} of the conversation, replaced by a summary, were not "
                "kept (the daemon stopped between the step and its record); session/transcript without `whole` "
                "gives the conversation as the model sees it"
            )
        kept += record.messages
    messages = _messages.decode(current)
    count = _count(messages)
    if count != len(kept):
        raise InternalError(
            f"the session's summary stands for {count} messages and {len(kept)} were kept; session/transcript "
            "without `whole` gives the conversation as the model sees it"
        )
    kept += messages[int(_leads(messages)) :]
    return _encoder.encode(kept[start:])
