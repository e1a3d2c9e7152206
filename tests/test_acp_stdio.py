"""`devd acp`'s stdin as lines, read from a real pipe the way an editor writes to it."""

from __future__ import annotations

import os
import threading

from devd.acp.stdio import Stdio


async def test_a_line_of_megabytes_written_in_pieces_and_the_line_after_it_arrive_whole() -> None:
    # The reader splits what it holds only when a read brings a newline (it used to join and split at every read,
    # so a long line cost the square of its length).
    read_end, write_end = os.pipe()
    big = b'{"prompt":"' + b"x" * (4 << 20) + b'"}'
    sent = big + b'\n{"id":2}\n'

    def write() -> None:
        for start in range(0, len(sent), 100_000):
            os.write(write_end, sent[start : start + 100_000])
        os.close(write_end)

    out = os.open(os.devnull, os.O_WRONLY)
    writer = threading.Thread(target=write)
    writer.start()
    try:
        lines = [line async for line in Stdio(read_end, out).lines()]
    finally:
        writer.join()
        os.close(read_end)
        os.close(out)
    assert lines == [big, b'{"id":2}']
