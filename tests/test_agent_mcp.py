"""MCP tools end to end: the real daemon, the stand-in model, and a real MCP server (tests/mcp_server.py, written with
the official SDK) started by the daemon's broker under the profile's sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from devd import errors
from devd.messages import Cancel, Event
from tests.agents import SECRET, Agentd, agents_toml, conversation, next_notice, run_turn, until_done, watch_raw
from tests.daemon import Daemon
from tests.harness import InProcess
from tests.mcp_place import PYTHON, placed
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (a fixture)

PLACED = placed()  # the server and the SDK's packages, where the sandbox's unprivileged user reaches them
SERVER, SITE = PLACED.server, PLACED.site


def server_table(name: str = "demo", *extra: str, args: tuple[str, ...] = ()) -> str:
    command = ", ".join(f'"{a}"' for a in (PYTHON, str(SERVER), *args))
    env = 'env = { PYTHONPATH = "DEVD_TEST_MCP_PATH", MCP_TEST_VALUE = "DEVD_TEST_MCP_VALUE" }'
    return "\n".join([f"[agent.coder.mcp.{name}]", f"command = [{command}]", env, *extra]) + "\n"


def start(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, *tables: str, **extra: str) -> Agentd:
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    monkeypatch.setenv("DEVD_TEST_MCP_PATH", SITE)
    monkeypatch.setenv("DEVD_TEST_MCP_VALUE", "value-from-the-daemon")
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", **extra) + "\n" + "\n".join(tables))
    return Agentd(InProcess(tmp_path / "d", "--agents", str(agents)), tmp_path / "roots" / "ws", standin)


@pytest.fixture
def mcpd(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agentd]:
    """The daemon with one profile whose MCP server `demo` is the test server, its calls allowed."""
    agentd = start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"'))
    with agentd.daemon:
        yield agentd


def tool_results(standin: Standin, request: int) -> list[Any]:
    return [m["content"] for m in standin.requests[request].body["messages"] if m["role"] == "tool"]


def test_a_turn_calls_an_mcp_tool_by_server_and_name_with_its_schema(mcpd: Agentd) -> None:
    mcpd.standin.script(Scripted(tool_calls=[("demo__echo", {"text": "hi there"})]), Scripted(text="done"))
    with mcpd.client() as c:
        session = mcpd.session(c)
        run_turn(c, session, "say hi")
        offered = {t["function"]["name"]: t["function"] for t in mcpd.standin.requests[0].body["tools"]}
        assert (offered["demo__echo"]["parameters"]["properties"], conversation(c, session)[1:]) == (
            {"text": {"title": "Text", "type": "string"}},
            [
                {
                    "Agent": {
                        "calls": [{"id": 2, "call": {"Tool": {"name": "demo__echo", "input": {"text": "hi there"}}}}]
                    }
                },
                {"Tool": {"id": 2, "text": "hi there"}},
                {"Agent": {"text": "done"}},
            ],
        )


def test_an_mcp_call_is_in_the_effect_ledger_by_its_tools_name_and_input(mcpd: Agentd) -> None:
    mcpd.standin.script(Scripted(tool_calls=[("demo__echo", {"text": "hi there"})]), Scripted(text="done"))
    with mcpd.client() as c:
        session = mcpd.session(c)
        run_turn(c, session, "say hi")
        effects = c.effects(session)
    assert [(e.turn, e.action, e.kind, e.subject, e.outcome, e.undoable) for e in effects] == [
        (1, 2, "demo__echo", '{"text": "hi there"}', "ok", False)
    ]


def call_once(agentd: Agentd, tool: str, arguments: dict[str, Any], session: str | None = None) -> Any:
    """Script one call of the tool and an answer, run the turn, and give the call's result as the transcript has it."""
    agentd.standin.script(Scripted(tool_calls=[(tool, arguments)]), Scripted(text="done"))
    with agentd.client() as c:
        session = session or agentd.session(c)
        run_turn(c, session, "go")
        return conversation(c, session)[-2]["Tool"]


def servers(agentd: Agentd) -> list[dict[str, Any]]:
    with agentd.client() as c:
        return c.call("daemon/mcp")["servers"]  # type: ignore[no-any-return]


def test_a_server_runs_unprivileged_in_the_workspace_offline_with_the_daemons_variable(mcpd: Agentd) -> None:
    _, uid, cwd, value, net = call_once(mcpd, "demo__whoami", {})["text"].split()
    assert (uid, cwd, value, net) == ("65534", str(mcpd.workspace), "value-from-the-daemon", "nonet")


def test_an_image_is_summarized_beside_the_text(mcpd: Agentd) -> None:
    assert call_once(mcpd, "demo__picture", {}) == {"id": 2, "text": "a picture:\n[image/png, 12 KB]"}


def test_an_error_result_is_a_failed_call(mcpd: Agentd) -> None:
    assert call_once(mcpd, "demo__boom", {}) == {
        "id": 2,
        "text": "Error executing tool boom: it went boom",
        "failed": True,
    }


def test_a_result_is_cut_at_output_bytes_max(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    with start(
        tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"'), output_bytes_max="100"
    ).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        assert call_once(agentd, "demo__big", {"size": 5000})["text"] == "x" * 100 + (
            "\n[cut: the result was 5000 bytes; output_bytes_max is 100]"
        )


def test_a_servers_own_output_bytes_max_cuts_its_results_within_the_profiles(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = server_table("demo", 'decision = "allow"', "output_bytes_max = 50")
    with start(tmp_path, standin, monkeypatch, table, output_bytes_max="100").daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        assert call_once(agentd, "demo__big", {"size": 5000})["text"] == "x" * 50 + (
            "\n[cut: the result was 5000 bytes; output_bytes_max is 50]"
        )


def test_sessions_of_a_profile_share_one_server_process(mcpd: Agentd) -> None:
    pids = {call_once(mcpd, "demo__whoami", {})["text"].split()[0] for _ in range(5)}
    assert (len(pids), [(s["name"], s["sessions"], s["restarts"]) for s in servers(mcpd)]) == (1, [("demo", 5, 0)])


def devd_mcp(agentd: Agentd, *args: str) -> str:
    """`devd mcp ARGS` against the daemon, as a shell runs it: its output (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-m", "devd", "mcp", *args, "--connect", str(agentd.daemon.socket)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_devd_mcp_json_gives_daemon_mcps_fields_for_a_profiles_server(mcpd: Agentd) -> None:
    call_once(mcpd, "demo__echo", {"text": "hi"})
    (status,) = json.loads(devd_mcp(mcpd, "--json"))["servers"]
    assert {k: v for k, v in status.items() if k != "pid"} | {"pid": type(status["pid"])} == {
        "name": "demo",
        "agent": "coder",
        "state": "ready",
        "pid": int,
        "sessions": 1,
        "tools": 15,
        "restarts": 0,
        "last_error": None,
        "mode": "legacy",
    }


def test_devd_mcp_lists_a_line_per_server_with_its_agent_state_pid_sessions_tools_and_restarts(mcpd: Agentd) -> None:
    call_once(mcpd, "demo__echo", {"text": "hi"})
    pid = servers(mcpd)[0]["pid"]
    assert devd_mcp(mcpd) == f"demo (agent coder): ready, pid {pid}, 1 sessions, 15 tools, 0 restarts, MCP legacy\n"


def test_a_server_that_dies_mid_call_fails_it_with_its_stderr_and_starts_again_at_the_next(mcpd: Agentd) -> None:
    died = call_once(mcpd, "demo__die", {})
    again = call_once(mcpd, "demo__echo", {"text": "back"})
    assert (died, again["text"], servers(mcpd)[0]["restarts"]) == (
        {
            "id": 2,
            "text": "the MCP server demo stopped: it ended; it exited with status 3; its stderr ends: fatal: the test "
            "server was told to die",
            "failed": True,
        },
        "back",
        1,
    )


def server_processes(workspace: Path) -> list[int]:
    """The live processes working in the workspace (the test server's, under bubblewrap, and bwrap's own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cwd == str(workspace) and state != "Z":
            found.append(int(pid))
    return found


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll a condition outside the daemon's protocol (a file, a process): a deadline, never a bare sleep."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


def test_with_otel_endpoint_an_mcp_call_is_an_execute_tool_span_named_server__tool(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    received: list[ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(request)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    collector = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    try:
        agentd = start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"'))
        endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
        args = (*agentd.daemon.args, "--otel-endpoint", endpoint)  # type: ignore[union-attr]
        daemon = Daemon(tmp_path / "d", *args, env=dict(os.environ))
        standin.script(Scripted(tool_calls=[("demo__echo", {"text": "hi"})]), Scripted(text="done"))
        with daemon.start(), daemon.client() as c:
            run_turn(c, agentd.session(c), "say hi")
            assert daemon.stop() == 0  # a clean stop sends the spans still queued
    finally:
        collector.shutdown()
        thread.join()
        collector.server_close()
    spans = [s for r in received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans if s.name.startswith("execute_tool")] == ["execute_tool demo__echo"]


def test_a_killed_daemon_leaves_no_server_and_its_claimed_call_is_not_sent_again(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    agentd = start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"'))
    daemon = Daemon(tmp_path / "d", *agentd.daemon.args, env=dict(os.environ))  # type: ignore[union-attr]
    log = agentd.workspace / "slow.log"
    standin.script(Scripted(tool_calls=[("demo__slow", {"name": "slow.log", "seconds": 60})]), Scripted(text="after"))
    with daemon, daemon.client() as c:  # killed on the way out, whatever fails before the kill
        session = agentd.session(c)
        c.prompt(session, "sleep")
        wait_for(lambda: log.exists() and log.read_text() == "started\n", "the call")
        running = server_processes(agentd.workspace)
        group = Path("/sys/fs/cgroup/memory") / memory_cgroup(c.call("daemon/mcp")["servers"][0]["pid"]).lstrip("/")
    daemon.kill()
    wait_for(lambda: not server_processes(agentd.workspace), "the server's end", 10)
    with daemon, daemon.client() as c:
        watch_raw(c, session, since=0)
        until_done(c, 1)
        # Its stdin closed with the daemon, the server may have cancelled the call itself before it was killed; its
        # cgroup, left by the killed daemon, was swept by the next.
        assert (bool(running), group.exists(), log.read_text().count("started"), conversation(c, session)[2]) == (
            True,
            False,
            1,
            {
                "Tool": {
                    "id": 2,
                    "text": "interrupted: the daemon stopped while this tool call ran, so it may have partly run; it "
                    "was not run again (check the workspace before you run it again)",
                    "failed": True,
                }
            },
        )


def test_cancel_sends_mcp_cancellation_and_steps_the_call_cancelled(mcpd: Agentd) -> None:
    log = mcpd.workspace / "slow.log"
    mcpd.standin.script(Scripted(tool_calls=[("demo__slow", {"name": "slow.log", "seconds": 60})]))
    with mcpd.client() as c:
        session = mcpd.session(c)
        watch_raw(c, session, since=0)
        turn = c.prompt(session, "sleep")
        wait_for(lambda: log.exists() and log.read_text() == "started\n", "the call")
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        until_done(c, turn)
        wait_for(lambda: log.read_text() == "started\ncancelled\n", "the server's cancellation")
        assert conversation(c, session)[2] == {"Tool": {"id": 2, "text": "cancelled", "failed": True}}


def test_a_call_past_call_timeout_s_is_cancelled_and_failed(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start(
        tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"', "call_timeout_s = 0.5")
    ).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        result = call_once(agentd, "demo__slow", {"name": "slow.log", "seconds": 60})
        wait_for(lambda: (agentd.workspace / "slow.log").read_text() == "started\ncancelled\n", "the cancellation")
        assert result == {
            "id": 2,
            "text": "the MCP server demo did not answer slow within 0.5 s (call_timeout_s); the call was cancelled",
            "failed": True,
        }


def offered_names(standin: Standin, request: int = 0) -> list[str]:
    return [t["function"]["name"] for t in standin.requests[request].body["tools"] if "__" in t["function"]["name"]]


@pytest.mark.parametrize(
    ("table", "why"),
    [
        (
            server_table("demo", "start_timeout_s = 1", args=("--hang",)),
            "the MCP server demo did not finish its handshake within 1 s (start_timeout_s); it is still running; it "
            "wrote nothing to stderr",
        ),
        (
            '[agent.coder.mcp.demo]\ncommand = ["/bin/sh", "-c", "echo this is not JSON-RPC; sleep 60"]\n',
            "the MCP server demo stopped: it wrote a line to stdout that is not a JSON-RPC message: 'this is not "
            "JSON-RPC'; it was killed by SIGTERM; it wrote nothing to stderr",
        ),
        (
            '[agent.coder.mcp.demo]\ncommand = ["no-such-mcp-server"]\n',
            "the MCP server demo cannot start: no-such-mcp-server: command not found (PATH is "
            "/usr/local/bin:/usr/bin:/bin)",
        ),
        (
            '[agent.coder.mcp.demo]\ncommand = ["/bin/true"]\nenv = { TOKEN = "DEVD_TEST_UNSET" }\n',
            "agent 'coder''s MCP server demo cannot start: its variable TOKEN is to be read from the daemon's variable "
            "DEVD_TEST_UNSET, which is not set; set it where the daemon starts and restart the daemon",
        ),
        (
            '[agent.coder.mcp.demo]\nurl = "http://127.0.0.1:9/mcp"\nheaders = { X-Token = "DEVD_TEST_UNSET" }\n',
            "agent 'coder''s MCP server demo cannot start: its header X-Token is to be read from the daemon's variable "
            "DEVD_TEST_UNSET, which is not set; set it where the daemon starts and restart the daemon",
        ),
        (
            '[agent.coder.mcp.demo]\nurl = "http://127.0.0.1:9/mcp"\n',
            "the MCP server demo stopped: the connection failed (ConnectError: All connection attempts failed); its "
            "URL is http://127.0.0.1:9/mcp",
        ),
    ],
    ids=[
        "hangs in its handshake",
        "writes what is not JSON-RPC",
        "will not start",
        "lacks its variable",
        "lacks its header",
        "is not there",
    ],
)
def test_a_server_that_cannot_serve_is_left_out_of_the_tools_and_says_why(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch, table: str, why: str
) -> None:
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(text="done"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "go")
        status = servers(agentd)[0]
        assert (offered_names(standin), status["state"], status["last_error"]) == ([], "failed", why)


def test_a_call_of_a_tool_whose_server_cannot_serve_says_why(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = '[agent.coder.mcp.demo]\ncommand = ["/bin/true"]\nenv = { TOKEN = "DEVD_TEST_UNSET" }\ndecision = "allow"\n'
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("demo__echo", {"text": "hi"})]), Scripted(text="done"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "go")
    assert tool_results(standin, 1) == [
        "error: demo__echo is a tool of the MCP server demo, which cannot serve now: agent 'coder''s MCP server demo "
        "cannot start: its variable TOKEN is to be read from the daemon's variable DEVD_TEST_UNSET, which is not set; "
        "set it where the daemon starts and restart the daemon"
    ]


def test_a_50_mb_message_ends_the_connection_and_fails_the_call(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"')).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        result = call_once(agentd, "demo__big", {"size": 50 * 1024 * 1024})
        assert result["text"].startswith(
            "the MCP server demo stopped: it sent a message longer than 8388608 bytes, which devd does not read;"
        )


def test_an_idle_server_is_stopped_and_started_again_at_its_next_call(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"', "idle_s = 0.5")).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        with agentd.client() as c:
            session = agentd.session(c)
        call_once(agentd, "demo__echo", {"text": "a"}, session)
        wait_for(lambda: servers(agentd)[0]["state"] == "stopped", "the idle stop")
        stopped = server_processes(agentd.workspace)
        again = call_once(agentd, "demo__echo", {"text": "b"}, session)
        assert (stopped, again["text"], servers(agentd)[0]["restarts"]) == ([], "b", 1)


def own_server(name: str = "mine") -> dict[str, Any]:
    """A session's own server in ACP's shape, its variables' values given."""
    return {
        "name": name,
        "command": PYTHON,
        "args": [str(SERVER)],
        "env": [{"name": "PYTHONPATH", "value": SITE}, {"name": "MCP_TEST_VALUE", "value": "the-editors-value"}],
    }


def test_a_sessions_own_server_is_its_alone_and_each_call_is_asked_about(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start(tmp_path, standin, monkeypatch, session_mcp="true").daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("mine__whoami", {})]), Scripted(text="done"))
        with agentd.client() as c:
            made = c.call(
                "session/new", {"agent": "coder", "workspace": str(agentd.workspace), "mcp_servers": [own_server()]}
            )
            session = made["session"]
            watch_raw(c, session, since=0)
            turn = c.prompt(session, "who")
            asked = next_notice(c, "session/approval").params
            c.approve(session, asked["action"], asked["digest"], "allow")
            until_done(c, turn)
            value = conversation(c, session)[2]["Tool"]["text"].split()[3]
        status = servers(agentd)[0]
        assert (value, status["name"], status["agent"], status["sessions"]) == ("the-editors-value", "mine", None, 1)


@pytest.mark.parametrize(
    ("extra", "servers_given", "message"),
    [
        (
            {},
            [own_server()],
            "agent 'coder' does not take a session's own MCP servers (it has no session_mcp = true); leave out "
            "mcp_servers, or set session_mcp = true in its profile",
        ),
        (
            {"session_mcp": "true"},
            [own_server("a__b")],
            "MCP server 'a__b': an MCP server's name is 1-32 letters, digits, - and _ (never two _ in a row, nor one "
            "at either end): the model calls its tools SERVER__TOOL; rename it",
        ),
        (
            {"session_mcp": "true"},
            [own_server(), own_server()],
            "MCP server 'mine' is named like another of this session's (or its profile's); rename it",
        ),
    ],
    ids=["not allowed", "a bad name", "a name twice"],
)
def test_a_sessions_own_server_the_profile_does_not_allow_is_refused(
    tmp_path: Path,
    standin: Standin,
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, str],
    servers_given: list[dict[str, Any]],
    message: str,
) -> None:
    with start(tmp_path, standin, monkeypatch, **extra).daemon as d, d.client() as c:
        params = {"agent": "coder", "workspace": str(tmp_path / "roots" / "ws"), "mcp_servers": servers_given}
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.call("session/new", params)
        assert (str(refused.value), c.list().sessions) == (message, [])


def test_a_server_answering_malformed_json_rpc_is_left_out_saying_so(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start(tmp_path, standin, monkeypatch, server_table("demo", args=("--malformed",))).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(text="done"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "go")
        status = servers(agentd)[0]
    assert (offered_names(standin), status["state"], status["last_error"]) == (
        [],
        "failed",
        'the MCP server demo stopped: it wrote a line to stdout that is not a JSON-RPC message: \'{"jsonrpc": "2.0", '
        '"id": 1, "bogus": true}\'; it was killed by SIGTERM; it wrote nothing to stderr',
    )


def test_a_server_listing_10000_tools_has_all_but_tools_max_refused(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = server_table("demo", "start_timeout_s = 120", args=("--tools", "10000"))
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(text="done"))
        with agentd.client() as c:
            run_turn(c, agentd.session(c), "go")
        assert (len(offered_names(standin)), servers(agentd)[0]["tools"]) == (1000, 1000)


def test_a_tool_named_like_a_built_in_is_offered_under_its_server_beside_the_built_in(mcpd: Agentd) -> None:
    result = call_once(mcpd, "demo__exec", {"argv": ["true"]})
    offered = [t["function"]["name"] for t in mcpd.standin.requests[0].body["tools"]]
    assert (result["text"], offered.count("exec"), offered.count("demo__exec")) == (
        "the server's exec ran nothing",
        1,
        1,
    )


def test_a_tools_list_changed_is_offered_at_the_next_turn(mcpd: Agentd) -> None:
    with mcpd.client() as c:
        session = mcpd.session(c)
    call_once(mcpd, "demo__relist", {}, session)
    fresh = call_once(mcpd, "demo__fresh", {}, session)
    assert (
        "demo__fresh" in offered_names(mcpd.standin, 0),
        "demo__fresh" in offered_names(mcpd.standin, 2),
        fresh,
    ) == (
        False,
        True,
        {"id": 8, "text": "fresh"},
    )


def test_a_crash_looping_server_is_not_started_again_before_its_backoff(mcpd: Agentd) -> None:
    first, second = call_once(mcpd, "demo__die", {}), call_once(mcpd, "demo__die", {})
    third = call_once(mcpd, "demo__echo", {"text": "too soon"})
    died = "the MCP server demo stopped: it ended; it exited with status 3; its stderr ends: fatal: the test server " \
        "was told to die"  # fmt: skip
    assert (
        first["text"],
        second["text"],
        third["text"].split("; it is tried again in")[0],
        servers(mcpd)[0]["restarts"],
    ) == (
        died,
        died,
        f"the MCP server demo ended 2 times in a row within 30 s of its start (last: {died})",
        1,
    )


def memory_cgroup(pid: int) -> str:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line.split(":", 2)[2] for line in lines if line.split(":")[1] == "memory")


def test_a_stdio_server_runs_in_a_cgroup_of_its_own_removed_when_it_stops(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devd.agent import cgroups

    where = cgroups.place()
    assert not isinstance(where, str), where  # a root daemon on cgroup v1, as on these machines
    with start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "allow"', "idle_s = 1")).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        call_once(agentd, "demo__echo", {"text": "a"})
        group = memory_cgroup(servers(agentd)[0]["pid"])
        directory = Path("/sys/fs/cgroup/memory") / group.lstrip("/")
        limit = int((directory / "memory.limit_in_bytes").read_text())
        wait_for(lambda: servers(agentd)[0]["state"] == "stopped", "the idle stop")
        wait_for(lambda: not directory.exists(), "the group's removal")
    assert (Path(group).name.startswith("devd."), limit) == (True, 4 * 1024**3)


def test_a_read_only_tool_of_a_trusted_server_runs_as_a_read_unasked_and_out_of_the_effect_ledger(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = server_table("demo", 'decision = "ask"', "trust_read_only = true")
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("demo__readme", {})]), Scripted(text="done"))
        with agentd.client() as c:
            session = agentd.session(c)
            run_turn(c, session, "read")
            assert (conversation(c, session)[2], c.effects(session), c.pending(session)) == (
                {"Tool": {"id": 2, "text": "read me"}},
                [],
                [],
            )


def test_a_read_only_hint_of_a_server_not_trusted_is_an_effect(mcpd: Agentd) -> None:
    with mcpd.client() as c:
        session = mcpd.session(c)
    call_once(mcpd, "demo__readme", {}, session)
    with mcpd.client() as c:
        assert [(e.kind, e.outcome) for e in c.effects(session)] == [("demo__readme", "ok")]


def test_a_trusted_servers_tool_without_the_hint_is_still_asked_about(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = server_table("demo", 'decision = "ask"', "trust_read_only = true")
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(Scripted(tool_calls=[("demo__echo", {"text": "hi"})]), Scripted(text="done"))
        with agentd.client() as c:
            session = agentd.session(c)
            watch_raw(c, session, since=0)
            turn = c.prompt(session, "echo")
            asked = next_notice(c, "session/approval").params
            c.approve(session, asked["action"], asked["digest"], "allow")
            until_done(c, turn)
            assert [(e.kind, e.outcome) for e in c.effects(session)] == [("demo__echo", "ok")]


def test_always_for_an_mcp_call_settles_the_same_tool_and_input_and_no_other(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with start(tmp_path, standin, monkeypatch, server_table("demo", 'decision = "ask"')).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        standin.script(
            Scripted(tool_calls=[("demo__add", {"a": 1, "b": 2})]),
            Scripted(tool_calls=[("demo__add", {"b": 2, "a": 1})]),  # the same input, its members in another order
            Scripted(tool_calls=[("demo__add", {"a": 1, "b": 3})]),
            Scripted(text="done"),
        )
        with agentd.client() as c:
            session = agentd.session(c)
            watch_raw(c, session, since=0)
            c.prompt(session, "add")
            asked = next_notice(c, "session/approval").params
            c.approve(session, asked["action"], asked["digest"], "allow", remember=True)
            remembered = next_notice(c, "session/decided").params["remembered"]
            again = next_notice(c, "session/approval").params
            results = [m["Tool"]["text"] for m in conversation(c, session) if "Tool" in m]
    assert (remembered["tool"], len(remembered["input_sha256"]), again["op"]["Tool"], results) == (
        "demo__add",
        64,
        {"name": "demo__add", "input": {"a": 1, "b": 3}},
        ["3", "3"],
    )


def test_a_tool_listed_twice_is_offered_once_and_the_second_refused(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = server_table("demo", 'decision = "allow"', args=("--twice",))
    with start(tmp_path, standin, monkeypatch, table).daemon as d:
        agentd = Agentd(d, tmp_path / "roots" / "ws", standin)
        result = call_once(agentd, "demo__dup", {})
    described = [
        t["function"]["description"] for t in standin.requests[0].body["tools"] if "__" in t["function"]["name"]
    ]
    assert (offered_names(standin), described, result["text"]) == (["demo__dup"], ["dup #1"], "the first dup")


def test_a_stdio_server_holds_none_of_the_daemons_descriptors(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The event loop's spawn (uvloop's) closes nothing in the child: what a server holds past its own three is what
    # the daemon left inheritable (its /dev/null and its log are, as its 0, 1 and 2) or its own stdio's duplicates.
    listing = 'ls -l /proc/self/fd > fds.txt; exec "$0" "$@"'
    command = json.dumps(["/bin/sh", "-c", listing, PYTHON, str(SERVER)])
    env = 'env = { PYTHONPATH = "DEVD_TEST_MCP_PATH" }'
    table = "\n".join(["[agent.coder.mcp.demo]", f"command = {command}", env, 'decision = "allow"']) + "\n"
    agentd = start(tmp_path, standin, monkeypatch, table)
    daemon = Daemon(tmp_path / "d", *agentd.daemon.args, env=dict(os.environ))  # type: ignore[union-attr]
    with daemon:
        call_once(Agentd(daemon, agentd.workspace, standin), "demo__echo", {"text": "a"})  # type: ignore[arg-type]
        held = {line.split(" -> ")[1] for line in (agentd.workspace / "fds.txt").read_text().splitlines()[1:]}
        fds = Path(f"/proc/{daemon.proc.pid}/fd")
        daemons = {os.readlink(fd) for fd in fds.iterdir()}
    assert held & daemons == set()
