"""The model driver against the stand-in server over real HTTP: the request, the stream, retries, cancellation."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from devd.agent import http
from devd.agent.model import (
    Attempt,
    Completion,
    Inserted,
    ModelUnavailable,
    Rejected,
    StreamError,
    ToolCall,
    Usage,
    _retry_after,
    complete,
    parse_sse,
    rejected_messages,
    request_body,
    to_reply,
)
from devd.agent.otel import Exporter
from devd.agent.profiles import Profile
from devd.agent.spend import Usage as SpendUsage
from devd.agent.spend import estimate_tokens
from devd.client import Client
from devd.messages import Agent, Call, Cancel, Dispatch, Event, Exec, Message, Read, Reply, Tool, Write
from tests.agents import SECRET, Agentd, agentd, next_notice, run_turn, stalled, watch_raw
from tests.standin_model import Scripted, Standin, check_request, standin_fixture

__all__ = ["agentd", "standin_fixture"]  # the fixtures


@pytest.fixture
async def client() -> AsyncIterator[http.Client]:
    async with http.new_client() as c:
        yield c


def profile(base_url: str = "http://127.0.0.1:9/v1", **fields: Any) -> Profile:
    base: dict[str, Any] = {"name": "coder", "base_url": base_url, "model": "m1", "workspace_roots": ("/",)}
    return Profile(**(base | fields))


CONVERSATION = [
    Message(User="fix the build"),
    Message(
        Agent=Agent(
            text="Looking.",
            calls=[
                Dispatch(id=2, call=Call(Exec=Exec(argv=["make"]))),
                Dispatch(id=3, call=Call(Write=Write(path="a.c", text="int x;"))),
            ],
        )
    ),
    Message(Tool=Tool(id=2, text="cc: error", failed=True)),
    Message(Tool=Tool(id=3, text="wrote a.c")),
]


def test_request_body_is_the_system_prompt_then_the_conversation() -> None:
    body = request_body(profile(system="Be careful."), CONVERSATION, exec_available=True)
    assert body["messages"] == [
        {"role": "system", "content": "Be careful."},
        {"role": "user", "content": "fix the build"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "call_2", "type": "function", "function": {"name": "exec", "arguments": '{"argv":["make"]}'}},
                {
                    "id": "call_3",
                    "type": "function",
                    "function": {"name": "write", "arguments": '{"path":"a.c","text":"int x;"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "error: cc: error"},
        {"role": "tool", "tool_call_id": "call_3", "content": "wrote a.c"},
    ]


def test_request_body_streams_with_usage_and_the_profiles_max_tokens() -> None:
    body = request_body(profile(max_tokens=99), CONVERSATION[:1])
    assert {k: v for k, v in body.items() if k not in ("messages", "tools")} == {
        "model": "m1",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 99,
    }


def test_the_tools_offered_are_those_the_profile_allows() -> None:
    def names(p: Profile, exec_available: bool) -> list[str]:
        return [t["function"]["name"] for t in request_body(p, [], exec_available=exec_available)["tools"]]

    assert [
        names(profile(), True),
        names(profile(), False),
        names(profile(exec="deny", write="deny", tools=("browse",)), True),
    ] == [["exec", "read", "write", "git"], ["read", "write"], ["read", "browse"]]


def test_a_tool_has_a_json_schema_of_its_parameters() -> None:
    tools = request_body(profile(), [])["tools"]
    assert tools[1] == {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a text file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a path relative to the workspace"}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    }


def test_inserted_messages_go_before_their_index_and_the_request_stays_valid() -> None:
    rejected = [Rejected(call_id="call_x", name="shell", arguments="{}", why="there is no tool named shell")]
    extra = [Inserted(before=1, messages=rejected_messages(None, rejected))]
    body = request_body(profile(), CONVERSATION, extra)
    roles = [(m["role"], m.get("tool_call_id")) for m in body["messages"]]
    assert (roles[:4], check_request(body)) == (
        [("user", None), ("assistant", None), ("tool", "call_x"), ("assistant", None)],
        None,
    )


SPLIT_STREAM = [
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}',
    "",
    'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}',
    ": keep-alive",
    'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c0","type":"function",'
    '"function":{"name":"read","arguments":"{\\"pa"}}]},"finish_reason":null}]}',
    'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c1","type":"function",'
    '"function":{"name":"exec","arguments":""}}]},"finish_reason":null}]}',
    'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"th\\": \\"a\\"}"}}]},'
    '"finish_reason":null}]}',
    'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{\\"argv\\":[]}"}}]},'
    '"finish_reason":"tool_calls"}]}',
    'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,'
    '"prompt_tokens_details":{"cached_tokens":8}}}',
    "data: [DONE]",
]


def test_sse_concatenates_text_and_tool_call_fragments_by_index() -> None:
    assert parse_sse(SPLIT_STREAM) == Completion(
        text="Hello",
        tool_calls=[
            ToolCall(id="c0", name="read", arguments='{"path": "a"}'),
            ToolCall(id="c1", name="exec", arguments='{"argv":[]}'),
        ],
        usage=Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8),
        finish_reason="tool_calls",
    )


def completion(*calls: tuple[str, str], text: str | None = None) -> Completion:
    return Completion(
        text=text, tool_calls=[ToolCall(id=f"c{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)]
    )


def test_to_reply_maps_tool_calls_to_the_cores_calls() -> None:
    reply, rejected = to_reply(completion(("read", '{"path": "a"}'), ("exec", '{"argv": ["ls"]}'), text="ok"))
    assert (reply, rejected) == (
        Reply(text="ok", calls=[Call(Read=Read(path="a")), Call(Exec=Exec(argv=["ls"]))]),
        [],
    )


def test_an_unknown_tool_is_rejected_saying_which_tools_there_are() -> None:
    _, rejected = to_reply(completion(("shell", "{}")))
    assert rejected == [
        Rejected(
            "c0",
            "shell",
            "{}",
            'there is no tool named "shell"; the tools are exec, read, write, git, browse, delegate',
        )
    ]


def test_arguments_that_are_not_json_are_rejected_saying_what_is_expected() -> None:
    _, rejected = to_reply(completion(("read", '{"path": ')))
    assert rejected[0].why == (
        'the arguments of read are not JSON (Expecting value: line 1 column 10 (char 9)); read expects {"path": '
        '"relative/path"}'
    )


def test_arguments_that_do_not_fit_are_rejected_saying_what_is_wrong() -> None:
    reply, rejected = to_reply(completion(("write", '{"path": "a"}'), ("read", '{"path": "b"}')))
    assert (reply.calls, rejected[0].why) == (
        [Call(Read=Read(path="b"))],
        "the arguments of write do not fit (Object missing required field `text`); write expects "
        '{"path": "relative/path", "text": "the whole new content"}',
    )


def test_an_exec_without_a_program_is_rejected() -> None:
    _, rejected = to_reply(completion(("exec", '{"argv": []}')))
    assert rejected[0].why.startswith("exec needs a program to run, argv is empty")


DEEP = 200_000  # levels of JSON nesting: far past Python's recursion limit


def test_arguments_nested_past_the_recursion_limit_are_rejected_saying_so() -> None:
    _, rejected = to_reply(completion(("exec", '{"argv": ' + "[" * DEEP + "]" * DEEP + "}")))
    assert rejected[0].why == (
        'the arguments of exec are nested too deeply to be read; exec expects {"argv": ["command", "arg", ...]}'
    )


def test_arguments_with_an_escaped_lone_surrogate_are_rejected_saying_so() -> None:
    reply, rejected = to_reply(completion(("exec", '{"argv": ["echo", "\\udcff"]}')))
    assert (reply.calls, rejected[0].why) == (
        None,
        "the arguments of exec hold an escaped lone surrogate (a \\ud800-\\udfff escape not part of a pair), which "
        'is no character; write the text as it is; exec expects {"argv": ["command", "arg", ...]}',
    )


async def test_complete_streams_each_fragment_in_order(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="The build is fixed now.", split=4))
    fragments: list[str] = []
    done = await complete(
        client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, on_text=fragments.append
    )
    assert (fragments, "".join(fragments)) == (
        ["The ", "buil", "d is", " fix", "ed n", "ow."],
        done.text,
    )


async def test_complete_sends_the_key_as_a_bearer_token(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="hi"))
    keyed = profile(standin.url, api_key_env="MODEL_KEY")
    await complete(client, keyed, CONVERSATION[:1], environ={"MODEL_KEY": "sk-1"}, exec_available=True)
    assert standin.requests[0].headers["authorization"] == "Bearer sk-1"


async def test_complete_returns_tool_calls_and_usage(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="Reading.", tool_calls=[("read", {"path": "Makefile"})], usage=(30, 7, 16)))
    done = await complete(client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True)
    assert done == Completion(
        text="Reading.",
        tool_calls=[ToolCall(id="call_standin_0", name="read", arguments='{"path": "Makefile"}')],
        usage=Usage(30, 7, 16),
        finish_reason="tool_calls",
        response_model="m1",
    )


async def test_a_500_is_retried_and_the_next_attempt_answers(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(status=500), Scripted(text="ok"))
    outcomes: list[Attempt] = []
    await complete(
        client,
        profile(standin.url),
        CONVERSATION[:1],
        environ={},
        exec_available=True,
        on_attempt=outcomes.append,
        backoff_s=0,
    )
    assert ([(a.outcome, a.status) for a in outcomes], standin.count) == ([("retry", 500), ("ok", 200)], 2)


async def test_a_429_waits_for_its_retry_after_not_the_backoff(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(status=429, retry_after="0"), Scripted(text="ok"))
    with anyio.fail_after(30):  # the backoff would wait 100 s
        done = await complete(
            client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, backoff_s=100
        )
    assert (done.text, standin.count) == ("ok", 2)


def test_a_retry_after_that_is_an_http_date_is_read_as_the_seconds_until_it() -> None:
    # email.utils is imported only for this form: it must still be read.
    until = _retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert until is not None and round(until + time.time()) == 1445412480


async def test_spent_attempts_raise_model_unavailable_saying_why(standin: Standin, client: http.Client) -> None:
    standin.script(*[Scripted(status=503, message="overloaded")] * 3)
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, attempts=3, backoff_s=0
        )
    assert e.value.why == f"model server {standin.url}: 503 overloaded after 3 attempts"


async def test_a_refused_connection_is_retried_then_unavailable(client: http.Client) -> None:
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client, profile("http://127.0.0.1:9/v1"), CONVERSATION[:1], environ={}, exec_available=True, backoff_s=0
        )
    assert e.value.why.endswith("after 4 attempts")


async def test_a_400_is_not_retried_and_says_the_servers_message(standin: Standin, client: http.Client) -> None:
    bad = [Message(Tool=Tool(id=7, text="orphan"))]
    with pytest.raises(ModelUnavailable) as e:
        await complete(client, profile(standin.url), bad, environ={}, exec_available=True)
    assert (e.value.why, standin.count) == (
        f"model server {standin.url}: 400 Invalid parameter: messages with role 'tool' must be a response to a "
        "preceeding message with 'tool_calls'. (messages[0].tool_call_id = \"call_7\")",
        1,
    )


async def test_a_server_that_does_not_stream_is_read_whole(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="whole", tool_calls=[("read", {"path": "a"})], usage=(3, 2, None), whole=True))
    fragments: list[str] = []
    done = await complete(
        client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, on_text=fragments.append
    )
    assert (done, fragments) == (
        Completion(
            text="whole",
            tool_calls=[ToolCall(id="call_standin_0", name="read", arguments='{"path": "a"}')],
            usage=Usage(3, 2),
            finish_reason="tool_calls",
            response_model="m1",
        ),
        ["whole"],
    )


def test_a_chunk_of_another_shape_is_a_stream_error() -> None:
    with pytest.raises(StreamError, match="a chunk is not one of a chat completion"):
        parse_sse(['data: {"choices": [{"delta": "text"}]}', "data: [DONE]"])


def _usage_stream(usage: str) -> list[str]:
    return ['data: {"choices":[{"delta":{"content":"hi"}}]}', f'data: {{"choices":[],"usage":{usage}}}', "data: [DONE]"]


def test_a_negative_token_count_is_a_stream_error_not_spend_given_back() -> None:
    with pytest.raises(StreamError) as raised:
        parse_sse(_usage_stream('{"prompt_tokens":-1000000,"completion_tokens":0}'))
    assert str(raised.value) == (
        "a chunk is not one of a chat completion (the usage's prompt_tokens is -1000000, not a whole number of "
        'tokens from 0 to 1000000000): {"choices": [], "usage": {"prompt_tokens": -1000000, "completion_tokens": 0}}'
    )


def test_a_token_count_past_a_billion_is_a_stream_error_however_it_is_written() -> None:
    refused = []
    for usage in (
        f'{{"prompt_tokens":{2**70},"completion_tokens":1}}',
        '{"prompt_tokens":1,"completion_tokens":1e300}',
        f'{{"prompt_tokens":1,"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":{2**63}}}}}',
    ):
        with pytest.raises(StreamError) as raised:
            parse_sse(_usage_stream(usage))
        refused.append(raised.value.why.removeprefix("a chunk is not one of a chat completion (the usage's "))
    assert refused == [
        "prompt_tokens is a number of 22 digits, not a whole number of tokens from 0 to 1000000000)",
        "completion_tokens is a number of 301 digits, not a whole number of tokens from 0 to 1000000000)",
        "cached_tokens is 9223372036854775808, not a whole number of tokens from 0 to 1000000000)",
    ]


def test_a_stream_line_nested_past_the_recursion_limit_is_a_stream_error() -> None:
    with pytest.raises(StreamError) as raised:
        parse_sse(['data: {"choices": [{"delta": {"content": ' + "[" * DEEP + "]" * DEEP + "}}]}", "data: [DONE]"])
    assert raised.value.why == "a stream line is JSON nested too deeply to be read"


def test_an_infinite_or_fractional_token_count_is_a_stream_error() -> None:
    refused = []
    for count in ("1e999", "2.5", '"12"', "true"):
        with pytest.raises(StreamError) as raised:
            parse_sse(_usage_stream(f'{{"prompt_tokens":1,"completion_tokens":{count}}}'))
        refused.append("the usage's completion_tokens is" in str(raised.value))
    assert refused == [True, True, True, True]


def test_a_token_count_written_as_a_whole_float_counts() -> None:
    assert parse_sse(_usage_stream('{"prompt_tokens":12.0,"completion_tokens":5}')).usage == Usage(12, 5)


def test_a_tool_call_index_that_is_not_a_whole_number_is_a_stream_error() -> None:
    call = '"id":"a","function":{"name":"read","arguments":"{}"}'
    stream = [
        'data: {"choices":[{"delta":{"tool_calls":[{"index":0,' + call + "}]}}]}",
        'data: {"choices":[{"delta":{"tool_calls":[{"index":"x",' + call + "}]}}]}",
        "data: [DONE]",
    ]
    with pytest.raises(StreamError, match='a tool call\'s index is "x", not a whole number 0 or more'):
        parse_sse(stream)


def test_a_pair_of_surrogates_split_across_chunks_is_joined_and_a_lone_one_made_a_replacement() -> None:
    stream = [
        'data: {"choices":[{"delta":{"content":"a\\ud83d"}}]}',
        'data: {"choices":[{"delta":{"content":"\\ude00b\\ud800c"}}]}',
        'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"i\\udc00","function":{"name":"read",'
        '"arguments":"{\\"path\\": \\"x\\ud800\\"}"}}]}}]}',
        "data: [DONE]",
    ]
    assert parse_sse(stream) == Completion(
        text="a\U0001f600b\ufffdc",
        tool_calls=[ToolCall(id="i\ufffd", name="read", arguments='{"path": "x\ufffd"}')],
    )


async def cancelled_once_streaming(standin: Standin, client: http.Client) -> list[Attempt]:
    """A call to the stand-in cancelled once its first text has arrived; the attempts it reported."""
    started = anyio.Event()
    attempts: list[Attempt] = []

    async def ask() -> None:
        await complete(
            client,
            profile(standin.url),
            CONVERSATION[:1],
            environ={},
            exec_available=True,
            on_text=lambda _: started.set(),
            on_attempt=attempts.append,
        )

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await started.wait()
            tg.cancel_scope.cancel()
    return attempts


async def test_cancelling_closes_the_stream(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="never finished", hang=True))
    outcomes = await cancelled_once_streaming(standin, client)
    closed = await anyio.to_thread.run_sync(standin.wait_closed)
    assert (closed, [a.outcome for a in outcomes]) == (True, ["cancelled"])


async def test_an_async_on_text_is_awaited_for_each_fragment(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="abcdef", split=2))
    seen: list[str] = []

    async def on_text(fragment: str) -> None:
        await anyio.sleep(0)
        seen.append(fragment)

    await complete(client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, on_text=on_text)
    assert seen == ["ab", "cd", "ef"]


def test_the_standin_refuses_calls_without_their_results() -> None:
    body = request_body(profile(), CONVERSATION[:3])
    assert check_request(body) == (
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        "'tool_call_id'. The following tool_call_ids did not have response messages: call_3"
    )


def test_the_standin_refuses_a_result_not_answering_the_message_before_it() -> None:
    body = request_body(profile(), [*CONVERSATION, Message(User="again"), Message(Tool=Tool(id=2, text="late"))])
    assert check_request(body) == (
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with "
        "'tool_calls'. (messages[5].tool_call_id = \"call_2\")"
    )


def test_the_standin_refuses_a_request_without_a_model() -> None:
    assert check_request({"messages": [{"role": "user", "content": "hi"}]}) == "you must provide a model parameter"


async def test_proxies_in_the_environment_are_not_used(standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    standin.script(Scripted(text="direct"))
    async with http.new_client() as c:
        done = await complete(c, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True)
    assert done.text == "direct"


def test_the_daemon_does_not_load_httpx_before_an_agent_first_calls_out() -> None:
    code = "import sys, devd.cli, devd.cli.serve, devd.server.daemon; print('httpx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False\n"


# -- secrets ------------------------------------------------------------------------------------------------------

KEY = "sk-live-0123456789abcdef"


async def test_a_key_ending_in_cr_is_refused_naming_its_variable_and_never_sent(
    standin: Standin, client: http.Client
) -> None:
    keyed = profile(standin.url, api_key_env="MODEL_KEY")
    with pytest.raises(ModelUnavailable) as e:
        await complete(client, keyed, CONVERSATION[:1], environ={"MODEL_KEY": KEY + "\r"}, exec_available=True)
    assert (e.value.why, standin.count) == (
        f"model server {standin.url}: the API key in MODEL_KEY (api_key_env of agent 'coder') holds a carriage "
        "return (CR) (the key is not shown); a key is printable ASCII without spaces: set the variable again without "
        "it (a file written with Windows line ends adds one) and restart the daemon",
        0,
    )


async def test_a_key_variable_that_is_not_set_is_refused_saying_so(standin: Standin, client: http.Client) -> None:
    keyed = profile(standin.url, api_key_env="MODEL_KEY")
    with pytest.raises(ModelUnavailable) as e:
        await complete(client, keyed, CONVERSATION[:1], environ={}, exec_available=True)
    assert (e.value.why, standin.count) == (
        f"model server {standin.url}: the API key variable MODEL_KEY (api_key_env of agent 'coder') is not set in "
        "the daemon's environment; set it where the daemon starts and restart the daemon, or remove api_key_env if "
        "the server needs no key",
        0,
    )


async def test_a_key_the_server_echoes_is_redacted_from_the_error_and_the_attempt(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(status=401, message=f"Incorrect API key provided: {KEY}"))
    attempts: list[Attempt] = []
    keyed = profile(standin.url, api_key_env="MODEL_KEY")
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client, keyed, CONVERSATION[:1], environ={"MODEL_KEY": KEY}, exec_available=True, on_attempt=attempts.append
        )
    assert (e.value.why, [a.error for a in attempts]) == (
        f"model server {standin.url}: 401 Incorrect API key provided: [redacted]",
        ["401 Incorrect API key provided: [redacted]"],
    )


async def test_a_base_urls_user_and_password_are_in_no_error_text(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(status=400, message="no user me:hunter22 here, nor hunter22"))
    attempts: list[Attempt] = []
    with_userinfo = profile(standin.url.replace("http://", "http://me:hunter22@"))
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client, with_userinfo, CONVERSATION[:1], environ={}, exec_available=True, on_attempt=attempts.append
        )
    assert (e.value.why, [a.error for a in attempts]) == (
        f"model server {standin.url}: 400 no user [redacted] here, nor [redacted]",
        ["400 no user [redacted] here, nor [redacted]"],
    )


async def test_what_a_broken_stream_sent_is_said_in_the_error_but_kept_from_the_attempts_record(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(text="hi", garbage="data: {the model's own words}"))
    attempts: list[Attempt] = []
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client,
            profile(standin.url),
            CONVERSATION[:1],
            environ={},
            exec_available=True,
            on_attempt=attempts.append,
            attempts=1,
        )
    why = "a stream line is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    assert (e.value.why, [a.error for a in attempts]) == (
        f"model server {standin.url}: {why} after 1 attempts (it sent: {{the model's own words}})",
        [why],
    )


# -- bounds -------------------------------------------------------------------------------------------------------

REPLY_BYTES_MAX = 1024 * 1024


async def _bounded(standin: Standin, client: http.Client, **fields: Any) -> tuple[str, list[Attempt], int]:
    """complete() against the stand-in's script, which must fail: why, the attempts, and the peak of the memory
    Python allocated meanwhile (the stand-in's thread included)."""
    attempts: list[Attempt] = []
    tracemalloc.start()
    try:
        with anyio.fail_after(60), pytest.raises(ModelUnavailable) as e:
            await complete(
                client,
                profile(standin.url, **fields),
                CONVERSATION[:1],
                environ={},
                exec_available=True,
                on_attempt=attempts.append,
                backoff_s=0,
            )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return e.value.why, attempts, peak


async def test_a_line_that_never_ends_fails_at_reply_bytes_max_without_a_retry(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(endless="line"))
    why, attempts, peak = await _bounded(standin, client, reply_bytes_max=REPLY_BYTES_MAX)
    assert (why, [(a.outcome, a.status) for a in attempts], standin.count, peak < 8 * REPLY_BYTES_MAX) == (
        f"model server {standin.url}: a line of the reply passed reply_bytes_max (1048576 bytes) and was dropped; "
        "it is not asked for again: if agent 'coder' needs replies this large, raise its reply_bytes_max in the "
        "agents file",
        [("failed", 200)],
        1,
        True,
    )


async def test_chunks_without_done_fail_at_reply_bytes_max_without_a_retry(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(endless="chunks"))
    why, attempts, peak = await _bounded(standin, client, reply_bytes_max=REPLY_BYTES_MAX)
    assert (why, [(a.outcome, a.status) for a in attempts], standin.count, peak < 8 * REPLY_BYTES_MAX) == (
        f"model server {standin.url}: the reply passed reply_bytes_max (1048576 bytes) and was dropped; it is not "
        "asked for again: if agent 'coder' needs replies this large, raise its reply_bytes_max in the agents file",
        [("failed", 200)],
        1,
        True,
    )


async def test_a_reply_that_trickles_on_fails_at_model_timeout_s_without_a_retry(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(endless="trickle", delay_s=0.05))
    t0 = time.monotonic()
    why, attempts, _ = await _bounded(standin, client, model_timeout_s=1.0)
    took = time.monotonic() - t0
    assert (why, [(a.outcome, a.status) for a in attempts], standin.count, 1.0 <= took < 10) == (
        f"model server {standin.url}: the reply took longer than model_timeout_s (1 s) and was dropped; it is not "
        "asked for again: if agent 'coder' needs longer, raise its model_timeout_s in the agents file",
        [("failed", 200)],
        1,
        True,
    )


async def test_a_whole_reply_past_reply_bytes_max_fails_without_a_retry(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="x" * 5000, whole=True))
    why, attempts, _ = await _bounded(standin, client, reply_bytes_max=4096)
    assert (why, [a.outcome for a in attempts]) == (
        f"model server {standin.url}: the reply passed reply_bytes_max (4096 bytes) and was dropped; it is not "
        "asked for again: if agent 'coder' needs replies this large, raise its reply_bytes_max in the agents file",
        ["failed"],
    )


def gzip_bomb(mib: int = 32) -> bytes:
    """`mib` MiB of one letter under two layers of gzip: about 2 KiB on the wire (`Content-Encoding: gzip, gzip`)."""
    return gzip.compress(gzip.compress(b"data: " + b"A" * (mib << 20), 9), 9)


ENCODED = (
    "the server sent its answer in content encoding 'gzip, gzip', which devd does not decode (it asks for identity: "
    "a compressed body can inflate past every bound); make the server answer uncompressed"
)


async def test_a_gzip_bomb_is_refused_unread_without_a_retry(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(encoded=("gzip, gzip", gzip_bomb())))
    why, attempts, peak = await _bounded(standin, client, reply_bytes_max=REPLY_BYTES_MAX)
    assert (why, [(a.outcome, a.status) for a in attempts], standin.count, peak < 4 * REPLY_BYTES_MAX) == (
        f"model server {standin.url}: {ENCODED}",
        [("failed", 200)],
        1,
        True,
    )


async def test_a_gzip_bomb_in_an_error_answer_is_refused_unread_without_a_retry(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(status=503, encoded=("gzip, gzip", gzip_bomb())))
    why, attempts, peak = await _bounded(standin, client)
    assert (why, [(a.outcome, a.status) for a in attempts], standin.count, peak < 4 * REPLY_BYTES_MAX) == (
        f"model server {standin.url}: 503 {ENCODED}",
        [("failed", 503)],
        1,
        True,
    )


# -- what an attempt is charged -----------------------------------------------------------------------------------


def _request_tokens(standin: Standin, n: int = 0) -> int:
    return estimate_tokens(json.dumps(standin.requests[n].body, ensure_ascii=False).encode())


async def test_a_stream_cut_short_is_charged_the_request_and_what_streamed_as_estimated(
    standin: Standin, client: http.Client
) -> None:
    # The role chunk, then 4 chunks of 40 characters: 160 characters streamed, 40 tokens.
    standin.script(*[Scripted(text="y" * 400, split=40, cut_after=5)] * 2)
    attempts: list[Attempt] = []
    with pytest.raises(ModelUnavailable):
        await complete(
            client,
            profile(standin.url),
            CONVERSATION[:1],
            environ={},
            exec_available=True,
            on_attempt=attempts.append,
            attempts=2,
            backoff_s=0,
        )
    charged = SpendUsage(_request_tokens(standin), 40, estimated=True)
    assert [(a.outcome, a.usage) for a in attempts] == [("retry", charged), ("failed", charged)]


async def test_an_attempt_with_a_token_count_past_the_bound_is_charged_the_estimate(
    standin: Standin, client: http.Client
) -> None:
    standin.script(*[Scripted(text="y" * 40, usage=(2**70, 1, None))] * 4)
    _, attempts, _ = await _bounded(standin, client)
    charged = SpendUsage(_request_tokens(standin), 10, estimated=True)
    assert [(a.outcome, a.usage) for a in attempts] == [("retry", charged)] * 3 + [("failed", charged)]


async def test_a_reply_is_charged_at_least_the_estimate_of_what_streamed_whatever_usage_says(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(text="y" * 400, usage=(10, 1, None)))
    attempts: list[Attempt] = []
    await complete(
        client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, on_attempt=attempts.append
    )
    assert [(a.outcome, a.usage) for a in attempts] == [("ok", SpendUsage(10, 100, estimated=True))]


async def test_a_reply_streaming_past_its_reserved_tokens_fails_there_charged_what_streamed(
    standin: Standin, client: http.Client
) -> None:
    # 40 characters (10 tokens) a chunk: the sixth passes 50 tokens, and nothing after it is read.
    standin.script(Scripted(text="y" * 400_000, split=40, ignores_limit=True))
    shown: list[str] = []
    attempts: list[Attempt] = []
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client,
            profile(standin.url, max_tokens=50),
            CONVERSATION[:1],
            environ={},
            exec_available=True,
            on_text=shown.append,
            on_attempt=attempts.append,
            output_max=50,
        )
    assert (e.value.why, [(a.outcome, a.usage) for a in attempts], "".join(shown), standin.count) == (
        f"model server {standin.url}: the reply passed the 50 tokens reserved for it (the max_tokens sent, by devd's "
        "estimate of 4 characters a token) and was dropped, charged what streamed; it is not asked for again: the "
        "server may ignore max_tokens; if agent 'coder' needs longer replies, raise its max_tokens in the agents file",
        [("failed", SpendUsage(_request_tokens(standin), 60, estimated=True))],
        "y" * 200,
        1,
    )


async def test_a_retry_the_ceilings_refuse_is_not_sent(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(text="y" * 400, split=40, cut_after=3), Scripted(text="never sent"))
    asked: list[int] = []

    async def readmit() -> str | None:
        asked.append(standin.count)
        return "spend ceiling reached: (the test's)"

    with pytest.raises(ModelUnavailable) as e:
        await complete(client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, readmit=readmit)
    assert (e.value.why, asked, standin.count) == (
        f"model server {standin.url}: the stream ended before data: [DONE]; it was not tried again: spend ceiling "
        "reached: (the test's)",
        [1],
        1,
    )


async def test_an_attempt_the_server_refused_is_charged_nothing(standin: Standin, client: http.Client) -> None:
    standin.script(Scripted(status=429, retry_after="0"), Scripted(text="ok", usage=(30, 7, None)))
    attempts: list[Attempt] = []
    await complete(
        client, profile(standin.url), CONVERSATION[:1], environ={}, exec_available=True, on_attempt=attempts.append
    )
    assert [(a.outcome, a.usage) for a in attempts] == [("retry", None), ("ok", SpendUsage(30, 7))]


async def test_a_cancelled_attempt_is_charged_the_request_and_what_streamed(
    standin: Standin, client: http.Client
) -> None:
    standin.script(Scripted(text="abcdefgh", split=8, hang=True))
    attempts = await cancelled_once_streaming(standin, client)
    assert [(a.outcome, a.usage) for a in attempts] == [
        ("cancelled", SpendUsage(_request_tokens(standin), 2, estimated=True))
    ]


# -- through the daemon -------------------------------------------------------------------------------------------


def _traced(c: Client, session: str, count: int) -> list[dict[str, Any]]:
    """The session's trace records, once there are `count` (they are written after the step that ends a call)."""
    deadline = time.monotonic() + 30
    while len(records := c.call("session/trace", {"session": session})["records"]) < count:
        assert time.monotonic() < deadline, records
        time.sleep(0.02)
    return list(records)


def _usage(c: Client, session: str) -> dict[str, int]:
    """The session's usage, once a call is charged (after its trace records are written)."""
    deadline = time.monotonic() + 30
    while (usage := msgspec.to_builtins(c.usage(session)))["calls"] == 0:
        assert time.monotonic() < deadline, usage
        time.sleep(0.02)
    return dict(usage)


def test_a_key_ending_in_cr_stalls_the_session_naming_its_variable_and_shows_the_key_nowhere(
    agentd: Agentd, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET + "\r")  # read when the request is made
    with capture_logs() as logs, agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        c.prompt(session, "hello")
        why = stalled(ui)
        shown = [why, str(c.list().sessions[0].stalled), str(c.call("session/trace", {"session": session})), str(logs)]
    assert (why, [SECRET in text for text in shown], agentd.standin.count) == (
        f"the model call was not sent: model server {agentd.standin.url}: the API key in DEVD_TEST_KEY (api_key_env "
        "of agent 'coder') holds a carriage return (CR) (the key is not shown); a key is printable ASCII without "
        "spaces: set the variable again without it (a file written with Windows line ends adds one) and restart the "
        "daemon; `session/resume` tries again",
        [False, False, False, False],
        0,
    )


def test_a_key_the_server_echoes_is_in_no_stall_trace_or_log(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(status=401, message=f"Incorrect API key provided: {SECRET}"))
    with capture_logs() as logs, agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        c.prompt(session, "hello")
        why = stalled(ui)
        [record] = _traced(c, session, 1)
        listed = str(c.list().sessions[0].stalled)
    assert (why, record["error"], SECRET in listed + str(logs)) == (
        f"the model server refused the request: model server {agentd.standin.url}: 401 Incorrect API key provided: "
        "[redacted]; asking again would be refused the same way: fix what it names (agent 'coder''s model, key or "
        "limits in the agents file, then restart the daemon), then `session/resume`",
        "401 Incorrect API key provided: [redacted]",
        False,
    )


def test_every_attempt_of_a_stream_cut_short_is_charged_and_the_usage_is_their_sum(agentd: Agentd) -> None:
    # Each attempt: the role chunk, then 4 chunks of 40 characters (160 characters: 40 tokens), then the cut.
    agentd.standin.script(*[Scripted(text="y" * 400, split=40, cut_after=5)] * 4)
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        c.prompt(session, "hello")
        stalled(ui)
        records = _traced(c, session, 4)
        usage = _usage(c, session)
    request = _request_tokens(agentd.standin)
    tokens = [(r["outcome"], r.get("input_tokens"), r.get("output_tokens"), r.get("estimated")) for r in records]
    assert (tokens, usage) == (
        [("error", request, 40, True)] * 4,
        {
            "input_tokens": 4 * request,
            "output_tokens": 160,
            "cached_tokens": 0,
            "calls": 1,
            "refused": 0,
            "estimated": True,
        },
    )


def test_a_call_cancelled_while_it_streams_is_charged(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="abcdefgh", split=8, hang=True))
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        watch_raw(ui, session)
        turn = c.prompt(session, "hello")
        next_notice(ui, "session/delta")
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        [record] = _traced(c, session, 1)
        usage = _usage(c, session)
    request = _request_tokens(agentd.standin)
    assert ((record["outcome"], record["input_tokens"], record["output_tokens"], record["estimated"]), usage) == (
        ("interrupted", request, 2, True),
        {"input_tokens": request, "output_tokens": 2, "cached_tokens": 0, "calls": 1, "refused": 0, "estimated": True},
    )


def test_a_failing_commands_trace_error_is_its_exit_status_and_its_span_holds_no_output(agentd: Agentd) -> None:
    printed = "sk-live-PRINTED-0123456789"
    argv = ["sh", "-c", f"echo {printed}; exit 1"]
    agentd.standin.script(Scripted(tool_calls=[("exec", {"argv": argv})]), Scripted(text="done"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "run it")
        record = next(r for r in c.trace(session) if r.kind == "exec")
    spans = InMemorySpanExporter()
    exporter = Exporter(exporter=spans)
    exporter.export(session, record)
    exporter.shutdown()
    [span] = spans.get_finished_spans()
    assert (record.outcome, record.error, span.status.description, printed in span.to_json()) == (
        "error",
        "exit status 1",
        "exit status 1",
        False,
    )


async def test_a_base_urls_query_values_are_in_no_error_text(standin: Standin, client: http.Client) -> None:
    """The path is written after the query (`?key=K/chat/completions`): the server answers 404 naming the URL, as
    OpenAI's does."""
    attempts: list[Attempt] = []
    with_query = profile(f"{standin.url}?key=s3cret-q")
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client, with_query, CONVERSATION[:1], environ={}, exec_available=True, on_attempt=attempts.append
        )
    said = "404 Unknown request URL: POST /v1?key=[redacted]/chat/completions."
    assert (e.value.why, [a.error for a in attempts]) == (f"model server {standin.url}?key=***: {said}", [said])


async def test_a_base_urls_query_part_without_a_name_is_in_no_error_text(standin: Standin, client: http.Client) -> None:
    attempts: list[Attempt] = []
    with pytest.raises(ModelUnavailable) as e:
        await complete(
            client,
            profile(f"{standin.url}?s3cretBare"),
            CONVERSATION[:1],
            environ={},
            exec_available=True,
            on_attempt=attempts.append,
        )
    said = "404 Unknown request URL: POST /v1?[redacted]/chat/completions."
    assert (e.value.why, [a.error for a in attempts]) == (f"model server {standin.url}?***: {said}", [said])
