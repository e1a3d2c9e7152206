"""MCP servers over Streamable HTTP, and the reference server-everything (npm) over stdio and HTTP, end to end: the
real daemon, the stand-in model, real servers on loopback (tests/mcp_http.py). The SDK's server speaks the 2026-07-28
revision (`server/discover`); server-everything refuses it and is spoken to in the handshake era."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devd.messages import Cancel, Event
from tests.agents import Agentd, conversation, next_notice, run_turn, until_done, watch_raw
from tests.mcp_http import everything_server, free_port, sdk_server, serving
from tests.mcp_npm import everything
from tests.mcp_place import SERVER
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (a fixture)
from tests.test_agent_mcp import call_once, offered_names, servers, start, tool_results, wait_for


@pytest.fixture
def sdk_url() -> Iterator[str]:
    with sdk_server() as url:
        yield url


def _echo_at(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, url: str, settings: str = ""
) -> dict[str, Any]:
    """A turn whose model calls web__echo of the HTTP server at url (allowed, with the table's other `settings`), then
    answers; the server's status after it (what the tool answered is `tool_results(standin, 1)`)."""
    table = f'[agent.coder.mcp.web]\nurl = "{url}"\ndecision = "allow"\n{settings}'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("web__echo", {"text": "hi"})]), Scripted(text="done"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "go")
        return servers(agentd)[0]


def test_a_profiles_http_server_is_called_with_its_header_from_the_daemons_variable(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str
) -> None:
    monkeypatch.setenv("DEVD_TEST_MCP_TOKEN", "token-from-the-daemon")
    table = f'[agent.coder.mcp.web]\nurl = "{sdk_url}"\nheaders = {{ X-Token = "DEVD_TEST_MCP_TOKEN" }}\n'
    with start(tmp_path, standin, monkeypatch, table + 'decision = "allow"\n').daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        result = call_once(agentd, "web__header", {"name": "X-Token"})
        status = servers(agentd)[0]
    assert (result, status["name"], status["state"], status["pid"], status["mode"]) == (
        {"id": 2, "text": "token-from-the-daemon"},
        "web",
        "ready",
        None,
        "2026-07-28",
    )


def test_an_http_server_that_is_not_there_fails_the_call_saying_where(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    _echo_at(tmp_path, standin, monkeypatch, "http://127.0.0.1:9/mcp")
    assert tool_results(standin, 1) == [
        "error: web__echo is a tool of the MCP server web, which cannot serve now: the MCP server web stopped: the "
        "connection failed (ConnectError: All connection attempts failed); its URL is http://127.0.0.1:9/mcp"
    ]


def test_a_sessions_own_http_server_is_called_with_the_headers_it_gave(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str
) -> None:
    own = {"type": "http", "name": "web", "url": sdk_url, "headers": [{"name": "X-Token", "value": "the-editors"}]}
    with start(tmp_path, standin, monkeypatch, session_mcp="true").daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("web__header", {"name": "X-Token"})]), Scripted(text="done"))
        with agentd.client() as c:
            made = c.call("session/new", {"agent": "coder", "workspace": str(agentd.workspace), "mcp_servers": [own]})
            session = made["session"]
            watch_raw(c, session, since=0)
            turn = c.prompt(session, "go")
            asked = next_notice(c, "session/approval").params
            c.approve(session, asked["action"], asked["digest"], "allow")
            until_done(c, turn)
            assert conversation(c, session)[2] == {"Tool": {"id": 2, "text": "the-editors"}}


def test_server_everything_over_stdio_echoes(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    table = f'[agent.coder.mcp.ev]\ncommand = ["node", "{everything()}", "stdio"]\ndecision = "allow"\n'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        assert call_once(agentd, "ev__echo", {"message": "over stdio"}) == {"id": 2, "text": "Echo: over stdio"}


def test_server_everything_over_http_refuses_discover_and_is_spoken_to_in_the_handshake_era(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with everything_server() as url:
        table = f'[agent.coder.mcp.ev]\nurl = "{url}"\ndecision = "allow"\n'
        with start(tmp_path, standin, monkeypatch, table).daemon as d:
            agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
            first = call_once(agentd, "ev__echo", {"message": "over http"})
            sum_ = call_once(agentd, "ev__get-sum", {"a": 2, "b": 3})
            status = servers(agentd)[0]
    assert (first, sum_["text"], status["mode"], status["restarts"]) == (
        {"id": 2, "text": "Echo: over http"},
        "The sum of 2 and 3 is 5.",
        "legacy",
        0,
    )


def test_a_profiles_url_server_offers_its_tools(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str
) -> None:
    with start(tmp_path, standin, monkeypatch, f'[agent.coder.mcp.web]\nurl = "{sdk_url}"\n').daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(text="done"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "go")
    offered = {t["function"]["name"] for t in standin.requests[0].body["tools"]}
    assert {"web__echo", "web__header", "web__slow"} <= offered


def test_a_50_mb_answer_over_http_ends_the_connection_and_fails_the_call(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str
) -> None:
    table = f'[agent.coder.mcp.web]\nurl = "{sdk_url}"\ndecision = "allow"\n'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        result = call_once(agentd, "web__big", {"size": 50 * 1024 * 1024})
        again = call_once(agentd, "web__echo", {"text": "still there"})
    assert (result, again["text"]) == (
        {
            "id": 2,
            "text": "the MCP server web stopped: it sent a response longer than 8388608 bytes, which devd does not "
            f"read; its URL is {sdk_url}",
            "failed": True,
        },
        "still there",
    )


def test_a_tools_list_changed_over_subscriptions_listen_is_offered_at_the_next_turn(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str
) -> None:
    # In the 2026-07-28 revision the change comes on the listen stream, not with the call's answer: the test waits
    # for the listing to have grown by one before the next turn, as a person's next prompt would.
    table = f'[agent.coder.mcp.web]\nurl = "{sdk_url}"\ndecision = "allow"\n'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session = agentd.session(c)
        call_once(agentd, "web__relist", {}, session)
        listed = len(offered_names(standin, 0))
        wait_for(lambda: servers(agentd)[0]["tools"] == listed + 1, "the listing after list_changed")
        fresh = call_once(agentd, "web__fresh", {}, session)
    assert ("web__fresh" in offered_names(standin, 0), "web__fresh" in offered_names(standin, 2), fresh) == (
        False,
        True,
        {"id": 8, "text": "fresh"},
    )


def test_cancel_reaches_an_http_server_and_steps_the_call_cancelled(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str
) -> None:
    log = tmp_path / "slow.log"  # the server runs outside the sandbox: it writes where it is told
    table = f'[agent.coder.mcp.web]\nurl = "{sdk_url}"\ndecision = "allow"\n'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("web__slow", {"name": str(log), "seconds": 60})]))
        with agentd.client() as c:
            session = agentd.session(c)
            watch_raw(c, session, since=0)
            turn = c.prompt(session, "sleep")
            wait_for(lambda: log.exists() and log.read_text() == "started\n", "the call")
            c.step(session, Event(Cancel=Cancel(turn=turn)))
            until_done(c, turn)
            wait_for(lambda: log.read_text() == "started\ncancelled\n", "the server's cancellation")
            assert conversation(c, session)[2] == {"Tool": {"id": 2, "text": "cancelled", "failed": True}}


def test_an_http_server_answering_what_is_not_json_rpc_fails_the_call_saying_so(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    with serving([sys.executable, str(SERVER), "--http", str(port), "--garbage"], port) as url:
        _echo_at(tmp_path, standin, monkeypatch, url, "start_timeout_s = 5\n")
    [said] = tool_results(standin, 1)
    assert (said.split(": 1 validation error")[0], said.endswith(f"; its URL is {url}")) == (
        "error: web__echo is a tool of the MCP server web, which cannot serve now: the MCP server web stopped: the "
        "connection failed (MCPError: Failed to parse JSON response",
        True,
    )


def test_a_server_that_leaves_discover_unanswered_is_spoken_to_in_the_handshake_era_within_start_timeout_s(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    with serving([sys.executable, str(SERVER), "--http", str(port), "--mute"], port) as url:
        table = f'[agent.coder.mcp.web]\nurl = "{url}"\ndecision = "allow"\nstart_timeout_s = 2\n'
        with start(tmp_path, standin, monkeypatch, table).daemon as d:
            agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
            result = call_once(agentd, "web__echo", {"text": "heard"})
            status = servers(agentd)[0]
    assert (result, status["mode"]) == ({"id": 2, "text": "heard"}, "legacy")


def test_server_everythings_read_only_image_tool_runs_unasked_when_trusted_and_is_summarized(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = f'[agent.coder.mcp.ev]\ncommand = ["node", "{everything()}", "stdio"]\ntrust_read_only = true\n'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session = agentd.session(c)
        result = call_once(agentd, "ev__get-tiny-image", {}, session)  # decision is ask: asked, it would wait
        with agentd.client() as c:
            effects = c.effects(session)
    assert (result["text"], effects) == (
        "Here's the image you requested:\n[image/png, 4 KB]\nThe image above is the MCP logo.",
        [],
    )


def test_a_secret_in_a_servers_url_query_is_never_shown(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, sdk_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A server that answers 404 at the URL given: the HTTP client's error names the whole URL, query included."""
    url = sdk_url.replace("/mcp", "/elsewhere") + "?token=s3cret&v=2"
    status = _echo_at(tmp_path, standin, monkeypatch, url, "start_timeout_s = 5\n")
    [said] = tool_results(standin, 1)
    shown = url.replace("token=s3cret&v=2", "token=***&v=***")
    assert (said, status["last_error"], "s3cret" in "".join(capfd.readouterr())) == (
        "error: web__echo is a tool of the MCP server web, which cannot serve now: the MCP server web stopped: the "
        f"connection failed (MCPError: Not Found); its URL is {shown}",
        f"the MCP server web stopped: the connection failed (MCPError: Not Found); its URL is {shown}",
        False,
    )
