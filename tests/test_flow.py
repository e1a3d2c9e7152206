"""Flow control (devd.server.flow) over a stand-in transport: what it reads, pauses, closes and refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from devd.config import Settings
from devd.server.flow import Flow, Outboxes

SETTINGS = Settings(state_dir=Path("/nonexistent"), socket_path=None, requests_in_flight_max=2, outbox_bytes_soft=100)


class Transport:
    """What Flow asks of asyncio's transport, recorded."""

    def __init__(self) -> None:
        self.reading = True
        self.buffered = 0
        self.written: list[bytes] = []
        self.closed = False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


def flow(transport: Transport, outboxes: Outboxes | None = None) -> Flow:
    return Flow(cast(asyncio.Transport, transport), SETTINGS, outboxes or Outboxes())


def test_reading_pauses_at_the_in_flight_cap_and_resumes_when_one_answers() -> None:
    transport = Transport()
    f = flow(transport)
    seen = []
    for step in (f.started, f.started, f.ended):
        step()
        seen.append(transport.reading)
    assert seen == [True, False, True]


def test_a_connection_told_to_close_is_read_no_more_and_closes_after_its_last_answer() -> None:
    transport = Transport()
    f = flow(transport)
    f.started()
    f.close_when_answered()
    before = (transport.reading, transport.closed)
    f.ended()
    assert (before, transport.reading, transport.closed) == ((False, False), False, True)


def test_a_notice_is_refused_past_the_outbox_bound_unless_nothing_is_queued() -> None:
    transport = Transport()
    f = flow(transport)
    empty = f.offer(b"x" * 500)
    transport.buffered = 50
    assert (empty, f.offer(b"y" * 40), f.offer(b"z" * 60)) == (True, True, False)


def test_the_outboxes_count_every_flow_until_it_is_lost() -> None:
    outboxes, a, b = Outboxes(), Transport(), Transport()
    fa, _ = flow(a, outboxes), flow(b, outboxes)
    a.buffered, b.buffered = 10, 20
    total = outboxes.unsent_bytes()
    fa.connection_lost()
    assert (total, len(outboxes.flows)) == (30, 1)
