"""Context windows and compaction (issue 32): the window of a model, where a conversation is cut, the summary request,
and end to end against the real daemon and the stand-in model server: a request past `compact_at` of the window is
compacted before it is sent, and one the server refuses as too long (as OpenAI does, as llama.cpp does) is compacted
and asked again once, then stalls saying the context is full."""

from __future__ import annotations

from pathlib import Path

import pytest

from devd.agent import context
from devd.agent.profiles import Profile
from devd.agent.runner import _context_full
from devd.messages import Agent, Call, Dispatch, Message, Read, Summary, Tool
from tests.agents import conversation, run_turn, stalled, watch_raw
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.test_agent_limits import _traced, agentd

__all__ = ["standin_fixture"]

SUMMARY_SENT = "(A summary of the conversation before this point.)\n"


def profile(**keys: object) -> Profile:
    base: dict[str, object] = {"name": "coder", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    return Profile(**(base | {"workspace_roots": ("/",)} | keys))  # type: ignore[arg-type]


# -- pure parts ---------------------------------------------------------------------------------------------------


def test_a_models_window_is_its_profiles_else_known_by_the_longest_prefix_of_its_name_else_none() -> None:
    assert (
        context.window(profile(model="gpt-4o-mini")),
        context.window(profile(model="openai/gpt-4-turbo-2024")),
        context.window(profile(model="gpt-4-0613")),
        context.window(profile(model="gpt-4o", context_tokens=5000)),
        context.window(profile(model="my-local-model")),
    ) == (128_000, 128_000, 8_192, 5000, None)


READ = Call(Read=Read(path="a"))
TALK = [
    Message(User="u" * 400),
    Message(Agent=Agent(text="a" * 400, calls=[Dispatch(id=2, call=READ)])),
    Message(Tool=Tool(id=2, text="t" * 400)),
    Message(Agent=Agent(text="b" * 40)),
    Message(User="v" * 40),
]


def test_a_cut_keeps_the_newest_messages_that_fit_and_never_a_result_without_its_call() -> None:
    assert (
        context.cut(TALK, 40),  # the last two fit
        context.cut(TALK, 150),  # the result fits too, but not its call: it goes with it
        context.cut(TALK, 0),  # nothing kept
        context.cut(TALK, 150, before=1),  # calls waited for: their Agent message stays
    ) == (3, 3, 5, 1)


def test_a_cut_never_replaces_only_an_earlier_summary() -> None:
    summarised = [Message(Summary=Summary(text="s" * 4000, replaced=10)), Message(User="u")]
    assert context.cut(summarised, 10) is None


def test_the_summary_request_has_no_tools_and_asks_for_the_summary_last() -> None:
    body = context.summary_body(profile(system="Be careful.", max_tokens=500), TALK, 100_000)
    assert (
        "tools" in body,
        [m["role"] for m in body["messages"]],
        body["messages"][-1]["content"],
        body["max_tokens"],
    ) == (False, ["system", "user", "user"], context.SUMMARY_ASK, 500)


def test_the_summary_request_cuts_what_would_not_fit_the_window() -> None:
    long = [Message(User="x" * 100_000), Message(Agent=Agent(text="y" * 100_000))]
    body = context.summary_body(profile(max_tokens=100), long, 2000)
    assert context.measure(body) < 2000 - 100


# -- end to end ---------------------------------------------------------------------------------------------------


def test_a_request_past_compact_at_of_the_window_is_compacted_by_a_summary_before_it_is_sent(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 2,000-token window: the second prompt's request (~1,900 tokens by devd's estimate) passes 80% of it.
    standin.context_tokens = 2000
    standin.script(Scripted(text="ok"), Scripted(text="THE SUMMARY", split=4), Scripted(text="done"))
    with agentd(tmp_path, standin, monkeypatch, context_tokens="2000") as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "a" * 3000)
        seen = run_turn(c, session, "b" * 3000)
        transcript = conversation(c, session)
        records = _traced(c, session, 3)
    summary_request, asked_again = standin.requests[1].body, standin.requests[2].body
    streamed = "".join(n.params["text"] for n in seen if n.method == "session/delta" and n.params.get("kind"))
    assert (
        summary_request["messages"][-1]["content"],
        "tools" in summary_request,
        asked_again["messages"][1:],
        transcript,
        [r.get("name") for r in records],
        streamed,
    ) == (
        context.SUMMARY_ASK,
        False,
        [{"role": "user", "content": SUMMARY_SENT + "THE SUMMARY"}],
        [{"Summary": {"text": "THE SUMMARY", "replaced": 3}}, {"Agent": {"text": "done"}}],
        [None, "summary", None],
        "THE SUMMARY",
    )


@pytest.mark.parametrize("server", ["openai", "llamacpp"])
def test_a_request_the_server_refuses_as_too_long_is_compacted_and_asked_again(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    # No window is known for the stand-in's model: only the server's refusal says the request is too long. The
    # second prompt's request (~1,900 tokens with the tools) passes its 1,800; the summary request, without tools,
    # does not.
    standin.context_tokens, standin.too_long = 1800, server  # type: ignore[assignment]
    standin.script(Scripted(text="ok"), Scripted(text="THE SUMMARY"), Scripted(text="done"))
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "a" * 3000)
        run_turn(c, session, "b" * 3000)
        transcript = conversation(c, session)
    assert (standin.count, standin.requests[2].body["messages"][-1]["content"], transcript) == (
        4,  # the first turn, the refused request, the summary, the request asked again
        context.SUMMARY_ASK,
        [{"Summary": {"text": "THE SUMMARY", "replaced": 3}}, {"Agent": {"text": "done"}}],
    )


def test_a_request_refused_as_too_long_again_after_compacting_stalls_saying_the_context_is_full(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    too_long = "This model's maximum context length is 1000 tokens. However, you requested 3000 tokens."
    standin.script(
        Scripted(text="ok"),
        Scripted(status=400, message=too_long),
        Scripted(text="THE SUMMARY"),
        Scripted(status=400, message=too_long),
    )
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "a" * 3000)
        watch_raw(c, session)
        c.prompt(session, "b" * 3000)
        why = stalled(c)
    size = int(why.split("measures ~")[1].split(" ")[0])
    refused = f"model server {standin.url}: 400 {too_long}"
    assert (why, standin.count) == (_context_full(profile(), size, None, refused), 4)


def test_session_compact_summarises_the_conversation_now(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(text="ok"), Scripted(text="THE SUMMARY"), Scripted(text="done"))
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "first")
        compacted = c.call("session/compact", {"session": session})
        run_turn(c, session, "second")
        transcript = conversation(c, session)
    assert (compacted, standin.requests[2].body["messages"][1:]) == (
        {"replaced": 2},
        [{"role": "user", "content": SUMMARY_SENT + "THE SUMMARY"}, {"role": "user", "content": "second"}],
    )
    assert transcript == [
        {"Summary": {"text": "THE SUMMARY", "replaced": 2}},
        {"User": "second"},
        {"Agent": {"text": "done"}},
    ]


def test_session_compact_with_nothing_to_replace_says_so(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        compacted = c.call("session/compact", {"session": d.session(c)})
    assert (compacted, standin.count) == (
        {"replaced": 0, "why": "nothing to replace: the conversation is empty, or only a summary"},
        0,
    )


def test_a_summary_that_fails_stalls_saying_the_conversation_could_not_be_compacted(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(text="ok"), Scripted(status=400, message="no summaries today"))
    with agentd(tmp_path, standin, monkeypatch, context_tokens="2000") as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "a" * 3000)
        watch_raw(c, session)
        c.prompt(session, "b" * 3000)
        why = stalled(c)
    assert (why, standin.count) == (
        "the conversation could not be compacted: the model's summary failed (model server "
        f"{standin.url}: 400 no summaries today); `session/resume` tries again",
        2,
    )
