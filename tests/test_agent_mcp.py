"""MCP tools end to end: the real daemon, the stand-in model, and a real MCP server (tests/mcp_server.py, written with
the official SDK) started by the daemon's broker under the profile's sandbox."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agents import SECRET, Agentd, agents_toml, conversation, run_turn
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture  # noqa: F401 (a fixture)

SERVER = Path(__file__).with_name("mcp_server.py")
# The server runs as the sandbox's unprivileged user, who cannot reach this interpreter under /root: it runs under the
# system's python3 of the same version, with the SDK's packages on its PYTHONPATH (the daemon's variable passed to it
# by name, as a profile passes a token).
PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
SITE = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "mcp").is_dir())


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
