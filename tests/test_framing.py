"""Line framing (devd.server.framing), pure: bytes and times in, lines out (no sockets)."""

from __future__ import annotations

from devd.server.framing import TOO_LONG, LineFramer


def test_lines_split_across_reads_are_joined() -> None:
    framer = LineFramer(100)
    assert [*framer.feed(b'{"a":', 0.0), *framer.feed(b'1}\n{"b"', 0.0), *framer.feed(b":2}\n", 0.0)] == [
        b'{"a":1}',
        b'{"b":2}',
    ]


def test_a_line_over_the_limit_is_reported_once_and_the_rest_of_it_dropped() -> None:
    framer = LineFramer(8)
    got = [*framer.feed(b"0123456789", 0.0), *framer.feed(b"abcdef", 0.0), *framer.feed(b"tail\nok\n", 0.0)]
    assert got == [TOO_LONG, b"ok"]


def test_a_whole_over_long_line_in_one_read_is_too_long_and_the_next_line_survives() -> None:
    assert list(LineFramer(4).feed(b"0123456789\nabc\n", 0.0)) == [TOO_LONG, b"abc"]


def test_the_framer_never_holds_more_than_its_limit() -> None:
    framer = LineFramer(1024)
    for _ in range(1000):
        list(framer.feed(b"x" * 4096, 0.0))
    assert framer.pending_bytes == 0


def test_a_partial_line_is_dated_from_the_read_it_began_in() -> None:
    framer = LineFramer(100)
    dates = []
    for now, chunk in ((10.0, b'{"a":'), (20.0, b"1"), (25.0, b'}\n{"b"'), (26.0, b":2}\n")):
        list(framer.feed(chunk, now))
        dates.append(framer.partial_since)
    assert dates == [10.0, 10.0, 25.0, None]


def test_a_line_being_discarded_is_not_partial() -> None:
    framer = LineFramer(4)
    assert (list(framer.feed(b"0123456789", 1.0)), framer.partial_since) == ([TOO_LONG], None)
