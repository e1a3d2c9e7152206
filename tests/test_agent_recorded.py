"""Real servers' answers replayed (issue 32): what LiteLLM's proxy and llama-cpp-python's server sent for real
requests, recorded byte for byte by tests/fixtures/models/record.py (status line, headers, body with its chunked
framing), is written back to the real daemon running an agent session, and the outcome devd derives from those bytes
is asserted: the answer text, the tool call carried out, usage counted or estimated, the refusal shown."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devd.agent.runner import CUT_ANSWER
from devd.client import Client
from tests.agents import SECRET, conversation, run_turn, stalled, watch_raw
from tests.harness import InProcess

FIXTURES = Path(__file__).parent / "fixtures" / "models"


class Replay:
    """A loopback HTTP server answering each request with the next recording's bytes as they are (the last one
    again once they run out), keeping the connection for the next request unless the recording says close."""

    def __init__(self, *names: str) -> None:
        self.recordings = [(FIXTURES / f"{name}.http").read_bytes() for name in names]
        self.count = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1"
        self._thread = threading.Thread(target=self._accept, name="replay", daemon=True)

    def __enter__(self) -> Replay:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed at the end of the test
            threading.Thread(target=self._serve, args=(conn,), name="replay-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            while _read_request(reader):
                with self._lock:
                    recorded = self.recordings[min(self.count, len(self.recordings) - 1)]
                    self.count += 1
                conn.sendall(recorded)
                if b"\r\nconnection: close\r\n" in recorded.split(b"\r\n\r\n", 1)[0].lower() + b"\r\n":
                    return


def _read_request(reader: Any) -> bool:
    """Read one request (head and Content-Length body); False at the end of the connection."""
    length = 0
    line = reader.readline()
    if not line:
        return False
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    reader.read(length)
    return True


def _agents_file(tmp_path: Path, url: str) -> Path:
    root = tmp_path / "roots"
    (root / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(
        "[agent.coder]\n"
        f'base_url = "{url}"\n'
        'model = "standin-model"\n'
        'api_key_env = "DEVD_TEST_KEY"\n'
        'system = "You are a careful coding agent."\n'
        f'workspace_roots = ["{root}"]\n'
    )
    return agents


@dataclass
class Replayed:
    """The daemon with agents in this process, its workspace, and the replay its profile asks."""

    daemon: InProcess
    workspace: Path
    replay: Replay

    def session(self, c: Client) -> str:
        return c.new(agent="coder", workspace=self.workspace)


@contextmanager
def _replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Iterator[Replayed]:
    """The daemon whose one profile asks a replay of these recordings, in order."""
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    with Replay(*names) as replay:
        agents = _agents_file(tmp_path, replay.url)
        with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon:
            yield Replayed(daemon, tmp_path / "roots" / "ws", replay)


def _usage(c: Client, session: str) -> dict[str, Any]:
    return dict(c.call("session/usage", {"session": session}))


# LiteLLM's refusal of a request past the window (its error's message, as devd shows it: cut at 500 characters).
PROXYS_WORDS = (
    "litellm.ContextWindowExceededError: litellm.BadRequestError: ContextWindowExceededError: OpenAIException - This "
    "model's maximum context length is 500 tokens. However, you requested 1455 tokens (1455 in the messages, 0 in the "
    "completion). Please reduce the length of the messages or completion.\nmodel=standin-model. "
    "context_window_fallbacks=None. fallbacks=None.\n\nSet 'context_window_fallback' - "
    "https://docs.litellm.ai/docs/routing#fallbacks\n\nLiteLLM: model group 'standin-model' failed with the erro"
)


# -- LiteLLM's proxy ------------------------------------------------------------------------------------------------


def test_litellms_streamed_answer_is_the_turns_answer_with_its_counted_usage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _replayed(tmp_path, monkeypatch, "litellm-text") as d, d.daemon.client() as c:
        session = d.session(c)
        run_turn(c, session, "say hello")
        answer, usage = conversation(c, session)[-1], _usage(c, session)
    assert (answer, usage) == (
        {"Agent": {"text": "Hello from the stand-in."}},
        {"input_tokens": 27, "output_tokens": 7, "cached_tokens": 0, "calls": 1, "refused": 0},
    )


def test_litellms_streamed_tool_call_is_carried_out_and_its_next_answer_ends_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _replayed(tmp_path, monkeypatch, "litellm-tool-1", "litellm-tool-2") as d, d.daemon.client() as c:
        session = d.session(c)
        run_turn(c, session, "write note.txt saying hi")
        answer = conversation(c, session)[-1]
        written = (d.workspace / "note.txt").read_text()
    assert (written, answer, d.replay.count) == ("hi", {"Agent": {"text": "I wrote note.txt."}}, 2)


def test_litellms_answer_from_a_server_that_counted_nothing_carries_litellms_own_count_not_an_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _replayed(tmp_path, monkeypatch, "litellm-text-no-usage") as d, d.daemon.client() as c:
        session = d.session(c)
        run_turn(c, session, "say hello")
        answer, usage = conversation(c, session)[-1], _usage(c, session)
    assert (answer, usage) == (
        {"Agent": {"text": "Hello, uncounted."}},
        {"input_tokens": 20, "output_tokens": 6, "cached_tokens": 0, "calls": 1, "refused": 0},
    )


def test_litellms_too_long_refusal_refused_again_for_the_summary_stalls_with_the_proxys_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _replayed(tmp_path, monkeypatch, "litellm-too-long") as d, d.daemon.client() as c:
        session = d.session(c)
        watch_raw(c, session)
        c.prompt(session, "x" * 4000)
        why = stalled(c)
    assert (why, d.replay.count) == (
        f"the conversation could not be compacted: the model's summary failed (model server {d.replay.url}: 400 "
        f"{PROXYS_WORDS}); even the request for a summary is past the model's window, so `session/resume` would be "
        "refused again; to go on, rewind the session to an earlier turn (`devd rewind SESSION TURN`) or start a new "
        "session with what matters",
        2,
    )


def test_litellms_too_long_refusal_compacted_and_refused_again_stalls_saying_the_context_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        _replayed(tmp_path, monkeypatch, "litellm-too-long", "litellm-summary", "litellm-too-long") as d,
        d.daemon.client() as c,
    ):
        session = d.session(c)
        watch_raw(c, session)
        c.prompt(session, "x" * 4000)
        why = stalled(c)
    assert (why, d.replay.count) == (
        "the context is full: the request measures ~432 tokens (devd's estimate, 4 characters a token), and the "
        f"server refused it as too long again after the conversation was compacted (model server {d.replay.url}: 400 "
        f"{PROXYS_WORDS}); to go on, start a new session (session/new) with what matters, or, if the model's window "
        "is larger, raise context_tokens of agent 'coder' in the agents file and restart the daemon, then "
        "`session/resume`",
        3,
    )


# -- llama-cpp-python's server ----------------------------------------------------------------------------------------


def test_llama_cpp_pythons_stream_cut_at_the_limit_is_continued_and_its_usage_estimated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _replayed(tmp_path, monkeypatch, "llama-cpp-python-text") as d, d.daemon.client() as c:
        session = d.session(c)
        run_turn(c, session, "say hello")
        answer, usage = conversation(c, session)[-1], _usage(c, session)
    # Each replay of the recording is the tiny model's garbage (a NUL among it), cut at 24 tokens; no usage chunk.
    garbage = "u s\x00sj vsq1j/pzAO*}6"
    assert (answer, usage) == (
        {"Agent": {"text": garbage * 3 + CUT_ANSWER.format(n=2, agent="coder")}},
        {"input_tokens": 1345, "output_tokens": 15, "cached_tokens": 0, "calls": 3, "refused": 0, "estimated": True},
    )


def test_llama_cpp_pythons_empty_stream_past_the_window_compacted_and_empty_again_stalls_as_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The summary's answer is LiteLLM's recorded one (the tiny model's would be garbage cut at the limit).
    names = ("llama-cpp-python-too-long", "litellm-summary", "llama-cpp-python-too-long")
    with _replayed(tmp_path, monkeypatch, *names) as d, d.daemon.client() as c:
        session = d.session(c)
        watch_raw(c, session)
        c.prompt(session, "x" * 4000)
        why = stalled(c)
    assert (why, d.replay.count) == (
        "the context is full: the request measures ~432 tokens (devd's estimate, 4 characters a token), and the "
        f"server refused it as too long again after the conversation was compacted (model server {d.replay.url}: the "
        "server answered 200 with an empty stream, as llama.cpp's server answers a request longer than its context "
        "window); to go on, start a new session (session/new) with what matters, or, if the model's window is larger, "
        "raise context_tokens of agent 'coder' in the agents file and restart the daemon, then `session/resume`",
        3,
    )
