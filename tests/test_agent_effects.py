"""What a Write's claim keeps of the file it replaces (devd.agent.effects.before_of): pure, no daemon."""

from __future__ import annotations

import hashlib

from devd.agent.effects import CONTENT_BYTES_MAX, FILE_BYTES_MAX, INLINE_BYTES_MAX, before_of
from devd.agent.records import Before

ROOM = CONTENT_BYTES_MAX


def test_a_file_that_was_not_there_is_kept_as_not_there() -> None:
    assert before_of("a.txt", False, None, 0, ROOM) == Before("a.txt", False)


def test_a_small_file_is_kept_in_the_claim_itself() -> None:
    data = b"x" * INLINE_BYTES_MAX
    assert before_of("a.txt", True, data, len(data), ROOM) == Before(
        "a.txt", True, len(data), hashlib.sha256(data).hexdigest(), content=data
    )


def test_a_larger_file_is_kept_apart_by_its_digest() -> None:
    data = b"x" * (INLINE_BYTES_MAX + 1)
    before = before_of("a.txt", True, data, len(data), ROOM)
    assert (before.content, before.stored, before.digest, before.kept) == (
        None,
        True,
        hashlib.sha256(data).hexdigest(),
        True,
    )


def test_content_past_the_sessions_room_is_not_kept_and_says_why_even_a_small_one() -> None:
    data = b"x" * 10
    before = before_of("a.txt", True, data, len(data), 9)
    assert (before.kept, before.why) == (
        False,
        f"the session keeps {CONTENT_BYTES_MAX} bytes of what its writes replaced, and that is used up",
    )


def test_a_file_past_the_file_bound_is_kept_by_its_size_alone() -> None:
    before = before_of("a.txt", True, None, FILE_BYTES_MAX + 1, ROOM)
    assert (before.kept, before.size, before.why) == (
        False,
        FILE_BYTES_MAX + 1,
        f"it is larger than {FILE_BYTES_MAX} bytes, which a rewind does not keep",
    )
