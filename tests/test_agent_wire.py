"""The agent beside the wire (devd.agent.wire, devd.agent.known): what the runtime keeps of a session is one record,
and closing the session removes it, whatever the session went through (a driven turn, an approval withdrawn by a
Cancel, a budget, watchers, pending marks; a session of no agent Cancelled and watched). Against the real daemon in
this process, its real socket and the stand-in model server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devd.agent.runner import RuntimeStatistics
from devd.agent.wire import AgentPort
from devd.messages import Cancel, Event
from devd.server.dispatch import Dispatcher
from tests.agents import SECRET, agents_toml, next_notice, watch_raw
from tests.harness import InProcess
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]


@pytest.fixture
def daemon(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcess]:
    """The daemon with one agent, `coder`, whose commands need a client's decision."""
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", exec='"ask"'))
    with InProcess(tmp_path / "d", "--agents", str(agents)) as running:
        yield running


def runtime_statistics(dispatcher: Dispatcher) -> RuntimeStatistics:
    port = dispatcher.app.sessions
    assert isinstance(port, AgentPort)
    return port.runtime.statistics()


def test_closing_its_sessions_leaves_the_runtime_no_record_of_them(
    daemon: InProcess, standin: Standin, tmp_path: Path
) -> None:
    standin.script(Scripted(tool_calls=[("exec", {"argv": ["true"]})]), Scripted(text="done"))
    with daemon.client() as c:
        c.initialize(name="ui")
        driven = c.new(agent="coder", workspace=tmp_path / "roots" / "ws")
        plain = c.new()
        for session in (driven, plain):
            watch_raw(c, session)
        c.set_budget(driven, 100_000)
        turn = c.prompt(driven, "run it")
        next_notice(c, "session/approval")
        c.pending(driven)  # marked awaiting approval
        c.step(driven, Event(Cancel=Cancel(turn=turn)))
        next_notice(c, "session/decided")  # withdrawn, by ui
        c.step(plain, Event(Cancel=Cancel(turn=1)))
        c.pending(plain)
        held = daemon.on_loop(runtime_statistics)
        c.close_session(driven)
        c.close_session(plain)
        after = daemon.on_loop(runtime_statistics)
    assert (held.sessions, after) == (2, RuntimeStatistics(sessions=0, driving=0))
