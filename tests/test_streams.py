"""The agent runtime's fan-out keeps the text each Model action has streamed so far, so a watcher that joins while the
model writes is sent it first as one `session/delta` (devd.agent.port.ObservedFanout): no daemon, no socket."""

from __future__ import annotations

import asyncio

import msgspec

from devd.agent.port import ObservedFanout
from devd.server.rpc import encode_notice, notification
from devd.sessions.watchers import Stepped
from tests.helpers import Sink


def deltas(sink: Sink) -> list[tuple[int, str]]:
    return [(n["params"]["action"], n["params"]["text"]) for n in map(msgspec.json.decode, sink.lines)]


def test_a_watcher_that_joins_mid_stream_is_sent_the_text_so_far_then_the_rest() -> None:
    fanout, late = ObservedFanout(encode_notice, notify=notification), Sink()
    fanout.stream("s", 3, "Hello, ")
    fanout.stream("s", 3, "wor")
    fanout.subscribe("s", late, 0, catching_up=False)
    fanout.stream("s", 3, "ld.")
    assert deltas(late) == [(3, "Hello, wor"), (3, "ld.")]


def test_a_watcher_catching_up_on_history_is_sent_the_text_so_far_once_caught_up() -> None:
    fanout, late = ObservedFanout(encode_notice, notify=notification), Sink()
    sub = fanout.subscribe("s", late, 0, catching_up=True)
    fanout.stream("s", 3, "Hi")
    before = list(late.lines)
    fanout.caught_up(sub)
    assert (before, deltas(late)) == ([], [(3, "Hi")])


def test_a_stream_that_is_over_is_not_sent_to_a_watcher_that_joins_after() -> None:
    fanout, late = ObservedFanout(encode_notice, notify=notification), Sink()
    fanout.stream("s", 3, "done")
    fanout.streamed("s", 3)
    fanout.subscribe("s", late, 0, catching_up=False)
    assert (late.lines, fanout.streams) == ([], {})


def test_a_retry_that_repeats_the_text_told_is_told_only_past_it() -> None:
    fanout, watcher = ObservedFanout(encode_notice, notify=notification), Sink()
    fanout.subscribe("s", watcher, 0, catching_up=False)
    fanout.stream("s", 3, "Hello, wo")
    fanout.stream_again("s", 3)
    for fragment in ("Hel", "lo, ", "world."):
        fanout.stream("s", 3, fragment)
    assert deltas(watcher) == [(3, "Hello, wo"), (3, "rld.")]


def test_a_retry_that_says_something_else_is_told_as_it_comes() -> None:
    fanout, watcher = ObservedFanout(encode_notice, notify=notification), Sink()
    fanout.subscribe("s", watcher, 0, catching_up=False)
    fanout.stream("s", 3, "Hello")
    fanout.stream_again("s", 3)
    fanout.stream("s", 3, "Bye")
    assert deltas(watcher) == [(3, "Hello"), (3, "Bye")]


# -- batched on a running loop: what comes in one turn of the loop goes out after it, one write per watcher ----------


async def test_fragments_of_one_loop_turn_go_to_a_watcher_as_one_delta_after_it() -> None:
    fanout, watcher = ObservedFanout(encode_notice, notify=notification), Sink()
    fanout.subscribe("s", watcher, 0, catching_up=False)
    for fragment in ("Hel", "lo", "."):
        fanout.stream("s", 3, fragment)
    during = list(watcher.lines)
    await asyncio.sleep(0)
    assert (during, deltas(watcher)) == ([], [(3, "Hello.")])


async def test_a_watcher_of_two_sessions_takes_both_deltas_of_a_loop_turn_in_one_write() -> None:
    fanout, watcher = ObservedFanout(encode_notice, notify=notification), Sink()
    for session in ("a", "b"):
        fanout.subscribe(session, watcher, 0, catching_up=False)
    for session in ("a", "b"):
        fanout.stream(session, 3, f"to {session}")
    await asyncio.sleep(0)
    assert [line.count(b"\n") for line in watcher.lines] == [2]


async def test_a_step_published_after_fragments_of_its_turn_reaches_the_watcher_after_them() -> None:
    fanout, watcher = ObservedFanout(encode_notice, notify=notification), Sink()
    fanout.subscribe("s", watcher, 0, catching_up=False)
    fanout.stream("s", 3, "Hi")
    fanout.publish(Stepped("s", 4, b"{}", b"[]", 0.0))
    methods = [msgspec.json.decode(line)["method"] for line in watcher.lines]
    assert methods == ["session/delta", "session/actions"]


async def test_a_watcher_joining_while_text_is_batched_is_told_it_once() -> None:
    fanout, first, late = ObservedFanout(encode_notice, notify=notification), Sink(), Sink()
    fanout.subscribe("s", first, 0, catching_up=False)
    fanout.stream("s", 3, "Hel")
    fanout.subscribe("s", late, 0, catching_up=False)
    fanout.stream("s", 3, "lo")
    await asyncio.sleep(0)
    assert (deltas(first), deltas(late)) == ([(3, "Hel"), (3, "lo")], [(3, "Hel"), (3, "lo")])
