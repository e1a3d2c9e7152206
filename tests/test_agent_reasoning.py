"""Reasoning streamed (issue 32): a server's `reasoning_content` deltas (DeepSeek, vLLM, llama.cpp) reach watchers as
`session/delta` of `kind: "reasoning"`, an editor as `agent_thought_chunk`, a terminal dimmed, and never the answer;
they go back to the model only when the profile's `send_reasoning` asks. The parser, the screen and the ACP view
alone, then end to end against the real daemon and the stand-in model server."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from devd.acp import wire
from devd.acp.translate import DeltaNotice as AcpDelta
from devd.acp.translate import SessionView
from devd.agent.cli import DIM, UNDIM, Screen
from devd.agent.model import parse_sse
from devd.protocol import DeltaNotice
from tests.agents import conversation, run_turn
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.test_agent_limits import agentd

__all__ = ["standin_fixture"]


def _chunk(delta: str) -> str:
    return f'data: {{"choices":[{{"index":0,"delta":{delta}}}]}}'


def test_reasoning_deltas_are_the_completions_reasoning_apart_from_its_text() -> None:
    completion = parse_sse(
        [
            _chunk('{"role":"assistant","content":null,"reasoning_content":"Think"}'),
            _chunk('{"reasoning_content":"ing."}'),
            _chunk('{"content":"Answer."}'),
            "data: [DONE]",
        ]
    )
    assert (completion.reasoning, completion.text) == ("Thinking.", "Answer.")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_shows_reasoning_dimmed_and_a_pipe_leaves_it_out() -> None:
    notices = [DeltaNotice("s", 1, "hmm", "reasoning"), DeltaNotice("s", 1, "Yes.")]
    tty, pipe = Terminal(), io.StringIO()
    for out in (tty, pipe):
        screen = Screen(out, turn=1)
        for notice in notices:
            screen.show(notice)
    assert (tty.getvalue(), pipe.getvalue()) == (f"{DIM}hmm{UNDIM}Yes.", "Yes.")


def test_an_editor_gets_reasoning_as_a_thought_never_as_the_answer() -> None:
    view = SessionView("s", "/ws")
    updates = view.take(AcpDelta("s", 2, "hmm", "reasoning")) + view.take(AcpDelta("s", 2, "Yes."))
    assert updates == [
        wire.AgentThoughtChunk(wire.TextBlock("hmm")),
        wire.AgentMessageChunk(wire.TextBlock("Yes.")),
    ]


def test_reasoning_streams_to_watchers_as_its_own_deltas_and_is_not_sent_back(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(reasoning="Let me think it over.", text="Forty-two."), Scripted(text="Still 42."))
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        session = d.session(c)
        seen = run_turn(c, session, "the answer?")
        run_turn(c, session, "sure?")
        transcript = conversation(c, session)
    deltas = [n.params for n in seen if n.method == "session/delta"]
    assert (
        "".join(p["text"] for p in deltas if p.get("kind") == "reasoning"),
        "".join(p["text"] for p in deltas if "kind" not in p),
        transcript[1],
        standin.requests[1].body["messages"][2],
    ) == (
        "Let me think it over.",
        "Forty-two.",
        {"Agent": {"text": "Forty-two."}},
        {"role": "assistant", "content": "Forty-two."},
    )


def test_send_reasoning_sends_each_answers_reasoning_back_with_it(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(reasoning="Let me think it over.", text="Forty-two."), Scripted(text="Still 42."))
    with agentd(tmp_path, standin, monkeypatch, send_reasoning="true") as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "the answer?")
        run_turn(c, session, "sure?")
    assert standin.requests[1].body["messages"][2] == {
        "role": "assistant",
        "content": "Forty-two.",
        "reasoning_content": "Let me think it over.",
    }
