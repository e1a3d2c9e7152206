"""devd.cli.terminal: how the line being streamed is kept within the live area (pure), and that such a line reaches
the screen whole (a real pseudo-terminal read through pyte, the real daemon and the stand-in)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devd.cli.terminal import full_rows
from tests.agents import Agentd, start
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (the `standin` fixture)
from tests.terminal import Terminal


def test_a_line_within_the_rows_allowed_stays_whole_in_the_live_area() -> None:
    assert full_rows("a" * 30, 10, 3) == ([], "a" * 30)


def test_the_rows_past_the_last_ones_allowed_go_above_each_whole() -> None:
    assert full_rows("a" * 35, 10, 3) == (["a" * 10], "a" * 25)


def test_wide_characters_take_two_columns_of_a_row() -> None:
    assert full_rows("日本" * 10, 10, 3) == (["日本日本日"], "本日本日本日本日本日本日本日本")


def test_an_sgr_sequence_takes_no_column_and_is_never_cut() -> None:
    dim = "\x1b[2m" + "a" * 12 + "\x1b[22m" + "b" * 23
    assert full_rows(dim, 10, 3) == (["\x1b[2m" + "a" * 10], "a" * 2 + "\x1b[22m" + "b" * 23)


@pytest.fixture
def agentd(tmp_path: Path, standin: Standin) -> Iterator[Agentd]:
    running = start(tmp_path, standin)
    with running.daemon:
        yield running


def test_the_latest_words_of_a_line_longer_than_the_screen_are_on_it_while_it_streams(agentd: Agentd) -> None:
    held = threading.Event()
    words = " ".join(f"w{n:03}" for n in range(300))
    agentd.standin.script(Scripted(text=words, split=40, held=held, held_after=21))  # the role chunk and 800 chars
    where = ["--connect", str(agentd.daemon.socket), "--agent", "coder", "--workspace", str(agentd.workspace)]
    with Terminal("run", *where, "go", rows=12, cols=40) as t:
        t.wait_for("w159")  # the last word of the 800 characters sent: 20 rows, on 12
        held.set()
        assert t.exit_status() == 0


def test_a_line_longer_than_the_screen_streamed_in_pieces_is_shown_whole(agentd: Agentd) -> None:
    words = " ".join(f"w{n:03}" for n in range(300))  # 1,499 characters: 38 rows of 40 columns, on 12 rows
    agentd.standin.script(Scripted(text=words, split=40))
    where = ["--connect", str(agentd.daemon.socket), "--agent", "coder", "--workspace", str(agentd.workspace)]
    with Terminal("run", *where, "go", rows=12, cols=40) as t:
        assert t.exit_status() == 0
        scrolled = "".join(t.history() + t.shown().splitlines()).replace(" ", "")  # a row may end with a space
    assert (words + "[turn 1 complete]").replace(" ", "") in scrolled
