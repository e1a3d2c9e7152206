"""Limits answered honestly (issue 32): an answer cut at the token limit is continued or said to be cut, a tool call
cut there is told to the model as cut, the token limit sent is the least of what binds it and under the name the
server takes, usage a server did not count is said to be estimated, and a refusal is shown with the server's words
and not asked again. End to end: the real daemon and the stand-in model server playing real servers' ways."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from devd.agent.model import ToolCall, Usage, parse_sse, request_body
from devd.agent.otel import Exporter
from devd.agent.profiles import Profile
from devd.agent.runner import CUT_ANSWER, CUT_CALL, GO_ON
from devd.agent.spend import estimate_tokens
from devd.cli.sessions import trace_line
from devd.client import Client
from devd.protocol import TraceRecord
from tests.agents import SECRET, Agentd, _agents_file, conversation, run_turn, stalled, watch_raw
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, prompt_tokens, standin_fixture

__all__ = ["standin_fixture"]


@contextmanager
def agentd(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, key: str | None = SECRET, **keys: str
) -> Iterator[Agentd]:
    """The daemon with agents in this process, its one profile `coder` given these keys (TOML values as written),
    its API key variable DEVD_TEST_KEY set to `key` (None: not set)."""
    if key is None:
        monkeypatch.delenv("DEVD_TEST_KEY", raising=False)
    else:
        monkeypatch.setenv("DEVD_TEST_KEY", key)
    agents = _agents_file(tmp_path, standin, **keys)
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon:
        yield Agentd(daemon, tmp_path / "roots" / "ws", standin)


def _last(c: Client, session: str) -> Any:
    return conversation(c, session)[-1]


def _traced(c: Client, session: str, count: int) -> list[dict[str, Any]]:
    """The session's trace records, once there are `count` (they are written after the step that ends a call)."""
    deadline = time.monotonic() + 30
    while len(records := c.call("session/trace", {"session": session})["records"]) < count:
        assert time.monotonic() < deadline, records
        time.sleep(0.02)
    return list(records)


# -- an answer cut at the limit -----------------------------------------------------------------------------------


def test_an_answer_cut_at_the_limit_is_continued_and_the_pieces_joined(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_tokens 5: the stand-in writes 20 characters, then stops with finish_reason "length".
    standin.script(Scripted(text="A" * 25), Scripted(text="B" * 25), Scripted(text="C" * 10))
    with agentd(tmp_path, standin, monkeypatch, max_tokens="5") as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "write a lot")
        answer = _last(c, session)
    assert (answer, standin.requests[2].body["messages"][-2:]) == (
        {"Agent": {"text": "A" * 20 + "B" * 20 + "C" * 10}},
        [{"role": "assistant", "content": "A" * 20 + "B" * 20}, {"role": "user", "content": GO_ON}],
    )


def test_an_answer_still_cut_after_its_continuations_says_it_was_cut(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(text="A" * 25), Scripted(text="B" * 25))
    with agentd(tmp_path, standin, monkeypatch, max_tokens="5", continuations_max="1") as d, d.client() as c:
        session = d.session(c)
        seen = run_turn(c, session, "write a lot")
        answer = _last(c, session)
    streamed = "".join(n.params["text"] for n in seen if n.method == "session/delta")
    whole = "A" * 20 + "B" * 20 + CUT_ANSWER.format(n=1, agent="coder")
    assert (answer, streamed, standin.count) == ({"Agent": {"text": whole}}, whole, 2)


def test_a_tool_call_cut_at_the_limit_is_told_to_the_model_as_cut_not_run(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(
        Scripted(tool_calls=[("write", {"path": "big.txt", "text": "x" * 400})]), Scripted(text="I will write less.")
    )
    with agentd(tmp_path, standin, monkeypatch, max_tokens="20") as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "write a big file")
        written = (d.workspace / "big.txt").exists()
    assert (standin.requests[1].body["messages"][-2:], written) == (
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_standin_0", "type": "function", "function": {"name": "write", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_standin_0", "content": f"error: {CUT_CALL}"},
        ],
        False,
    )


# -- the limit sent -----------------------------------------------------------------------------------------------


def test_openais_own_endpoint_is_sent_max_completion_tokens_and_any_other_max_tokens() -> None:
    def sent(base_url: str, **keys: Any) -> list[str]:
        p = Profile(name="a", base_url=base_url, model="m", workspace_roots=("/",), max_tokens=100, **keys)
        return [k for k in request_body(p, []) if k.startswith("max_")]

    assert (
        sent("https://api.openai.com/v1"),
        sent("http://127.0.0.1:8080/v1"),
        sent("http://127.0.0.1:8080/v1", token_param="max_completion_tokens"),
    ) == (["max_completion_tokens"], ["max_tokens"], ["max_completion_tokens"])


def test_a_server_that_demands_max_completion_tokens_is_sent_it_under_token_param(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.token_param = "max_completion_tokens"
    standin.script(Scripted(text="fine"))
    keys = {"max_tokens": "100", "token_param": '"max_completion_tokens"'}
    with agentd(tmp_path, standin, monkeypatch, **keys) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "hello")
        answer = _last(c, session)
    body = standin.requests[0].body
    assert (answer, body.get("max_completion_tokens"), "max_tokens" in body) == (
        {"Agent": {"text": "fine"}},
        100,
        False,
    )


def test_a_refusal_of_the_request_stalls_with_the_servers_words_and_is_not_asked_again(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.token_param = "max_completion_tokens"  # and the profile sends max_tokens
    with agentd(tmp_path, standin, monkeypatch, max_tokens="100") as d, d.client() as c:
        session = d.session(c)
        watch_raw(c, session)
        c.prompt(session, "hello")
        why = stalled(c)
    assert (why, standin.count) == (
        f"the model server refused the request: model server {standin.url}: 400 Unsupported parameter: 'max_tokens' "
        "is not supported with this model. Use 'max_completion_tokens' instead.; asking again would be refused the "
        "same way: fix what it names (agent 'coder''s model, key or limits in the agents file, then restart the "
        "daemon), then `session/resume`",
        1,
    )


def test_the_limit_sent_is_what_the_window_leaves_when_that_is_least(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.context_tokens = 2000  # refuses as OpenAI does past prompt + limit
    standin.script(Scripted(text="fits"))
    keys = {"max_tokens": "4000", "context_tokens": "2000"}
    with agentd(tmp_path, standin, monkeypatch, **keys) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "hello")
        answer = _last(c, session)
    body = standin.requests[0].body
    assert (answer, body["max_tokens"] + prompt_tokens(body) <= 2000, body["max_tokens"] > 1500) == (
        {"Agent": {"text": "fits"}},
        True,
        True,
    )


def test_the_limit_sent_is_the_ceilings_headroom_when_that_is_least(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(text="fits"))
    keys = {"max_tokens": "4000", "budget": "{ tokens_per_turn = 1000 }"}
    with agentd(tmp_path, standin, monkeypatch, **keys) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "hello")
    body = standin.requests[0].body
    # Admitted with the profile's 4000 in it: the headroom is the ceiling less the estimate of that request.
    request = json.dumps({k: v for k, v in body.items() if k != "max_tokens"} | {"max_tokens": 4000})
    assert body["max_tokens"] == 1000 - estimate_tokens(request.encode())


# -- usage said as estimated --------------------------------------------------------------------------------------


def test_usage_a_server_did_not_count_is_said_to_be_estimated_in_usage_and_trace(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.usage_in_stream = False  # as llama.cpp's server: include_usage ignored
    standin.script(Scripted(text="counted by nobody"))
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "hello")
        [record] = _traced(c, session, 1)
        usage = c.call("session/usage", {"session": session})
    assert (usage["estimated"], record["estimated"], "~" in trace_line(record)) == (True, True, True)


def test_usage_the_server_counted_is_not_said_to_be_estimated(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin.script(Scripted(text="counted", usage=(10, 2, None)))
    with agentd(tmp_path, standin, monkeypatch) as d, d.client() as c:
        session = d.session(c)
        run_turn(c, session, "hello")
        [record] = _traced(c, session, 1)
        usage = c.call("session/usage", {"session": session})
    assert ("estimated" in usage, "estimated" in record, trace_line(record).split(" tokens")[0][-5:]) == (
        False,
        False,
        " 10+2",
    )


def test_an_estimated_model_calls_span_says_its_usage_is_estimated() -> None:
    record = TraceRecord(
        action=1,
        kind="model",
        started="2026-12-06T00:00:00.000Z",
        duration_ms=1.0,
        outcome="ok",
        model="m",
        input_tokens=40,
        output_tokens=902,
        estimated=True,
    )
    spans = InMemorySpanExporter()
    exporter = Exporter(exporter=spans)
    exporter.export("s", record)
    exporter.shutdown()
    [span] = spans.get_finished_spans()
    attributes = span.attributes or {}
    assert (attributes["gen_ai.usage.output_tokens"], attributes["devd.usage.estimated"]) == (902, True)


def test_a_trace_line_marks_each_estimated_count_with_a_tilde() -> None:
    record = {
        "n": 3,
        "started": "2026-12-06T00:00:00.000Z",
        "action": 1,
        "kind": "model",
        "model": "m",
        "outcome": "ok",
        "duration_ms": 1.0,
        "input_tokens": 40,
        "output_tokens": 902,
        "estimated": True,
    }
    assert trace_line(record) == "   3 2026-12-06T00:00:00.000Z action 1 model m ok 1.0 ms ~40+~902 tokens\n"


# -- keys and refusals --------------------------------------------------------------------------------------------


def test_a_key_variable_not_set_is_named_at_start_and_as_the_stall_before_any_request(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with capture_logs() as logs, agentd(tmp_path, standin, monkeypatch, key=None) as d:
        with d.client() as c:
            session = d.session(c)
            watch_raw(c, session)
            c.prompt(session, "hello")
            why = stalled(c)
    warned = [entry["why"] for entry in logs if entry["event"] == "agent.key_unusable"]
    said = (
        "the API key variable DEVD_TEST_KEY (api_key_env of agent 'coder') is not set in the daemon's environment; "
        "set it where the daemon starts and restart the daemon, or remove api_key_env if the server needs no key"
    )
    assert (warned, why, standin.count) == (
        [said],
        f"the model call was not sent: model server {standin.url}: {said}; `session/resume` tries again",
        0,
    )


# -- streams shaped as real servers send them ---------------------------------------------------------------------
# Not recordings (none could be made here): streams built to the shapes seen from LiteLLM's proxy 1.108.7 and
# llama.cpp's server (llama-cpp-python 0.3.36) on 2026-12-05, as /work/shared/RUNTIME-FACTS.md describes them.

LITELLM_TOOL_CALL = [
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,"delta":'
    '{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_abc","type":"function","function":'
    '{"name":"read","arguments":"{\\"path\\": \\"a.txt\\"}"}}]},"finish_reason":null}]}',
    "",
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,"delta":{},'
    '"finish_reason":"tool_calls"}]}',
    "",
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,"delta":{}}],'
    '"usage":{"prompt_tokens":812,"completion_tokens":17,"total_tokens":829}}',
    "",
    "data: [DONE]",
]
LLAMACPP_TEXT = [
    'data: {"id":"chatcmpl-2","object":"chat.completion.chunk","model":"qwen","choices":[{"index":0,"delta":'
    '{"role":"assistant"},"finish_reason":null}]}',
    *[
        f'data: {{"id":"chatcmpl-2","object":"chat.completion.chunk","model":"qwen","choices":[{{"index":0,"delta":'
        f'{{"content":{json.dumps(piece)}}},"finish_reason":null}}]}}'
        for piece in ["", "Hel", "", "lo", "", "."]
    ],
    'data: {"id":"chatcmpl-2","object":"chat.completion.chunk","model":"qwen","choices":[{"index":0,"delta":{},'
    '"finish_reason":"length"}]}',
    "data: [DONE]",
]


def test_litellms_one_chunk_tool_call_and_its_usage_chunk_with_a_choice_are_read() -> None:
    completion = parse_sse(LITELLM_TOOL_CALL)
    assert (completion.tool_calls, completion.usage, completion.finish_reason) == (
        [ToolCall("call_abc", "read", '{"path": "a.txt"}')],
        Usage(812, 17),
        "tool_calls",
    )


def test_llamacpps_stream_without_usage_and_cut_at_the_limit_is_read_as_cut_and_uncounted() -> None:
    completion = parse_sse(LLAMACPP_TEXT)
    assert (completion.text, completion.usage, completion.finish_reason) == ("Hello.", None, "length")
