"""The agent runtime end to end, shared by its tests: the real daemon with an agents file whose one profile talks to
the stand-in model server, a workspace on disk, and helpers that wait for a turn's end through a watch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devd.client import Client, Reply
from tests.daemon import Daemon
from tests.harness import InProcess
from tests.standin_model import Standin

SECRET = "sk-devd-test-0123456789abcdef"  # the profile's API key: it must never show up anywhere but the request
SYSTEM = "You are a careful coding agent."
NOTICE_TIMEOUT_S = 30.0


def agents_toml(url: str, root: Path, **extra: str) -> str:
    """An agents file of one profile, `coder`; extra keys are TOML values as written (e.g. sandbox='"none"')."""
    lines = [
        "[agent.coder]",
        f'base_url = "{url}"',
        'model = "standin-model"',
        'api_key_env = "DEVD_TEST_KEY"',
        f'system = "{SYSTEM}"',
        f'workspace_roots = ["{root}"]',
        "exec_timeout_s = 60",
        *(f"{key} = {value}" for key, value in extra.items()),
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Agentd:
    """A daemon with agents, its workspace, and the stand-in its profile asks."""

    daemon: Daemon | InProcess
    workspace: Path
    standin: Standin

    def client(self) -> Client:
        return self.daemon.client()

    def session(self, c: Client) -> str:
        return c.new(agent="coder", workspace=self.workspace)


def start(tmp_path: Path, standin: Standin, *args: str, env: dict[str, str] | None = None, **extra: str) -> Agentd:
    """The daemon with agents as a process of its own (for a test that kills it or reads its log), started."""
    agents = _agents_file(tmp_path, standin, **extra)
    daemon = Daemon(tmp_path / "d", "--agents", str(agents), *args, env={"DEVD_TEST_KEY": SECRET, **(env or {})})
    return Agentd(daemon.start(), tmp_path / "roots" / "ws", standin)


def _agents_file(tmp_path: Path, standin: Standin, **extra: str) -> Path:
    """The agents file of one profile asking the stand-in, and its workspace (tmp_path/roots/ws)."""
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", **extra))
    return agents


@pytest.fixture
def agentd(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agentd]:
    """The daemon with agents, in this process (the profile's key in this process's environment for the test)."""
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    agents = _agents_file(tmp_path, standin)
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon:
        yield Agentd(daemon, tmp_path / "roots" / "ws", standin)


@pytest.fixture(name="agentd_process")
def agentd_process_fixture(tmp_path: Path, standin: Standin) -> Iterator[Agentd]:
    """The daemon with agents as a process of its own, for a test that kills it or reads its log."""
    running = start(tmp_path, standin)
    with running.daemon:
        yield running


def watch_raw(c: Client, session: str, since: int | None = None) -> None:
    params: dict[str, Any] = {"session": session}
    if since is not None:
        params["since"] = since
    c.call("session/watch", params)


def next_notice(c: Client, method: str) -> Reply:
    """The next notice of that method c receives (it watches the session); the others before it are passed over."""
    while True:
        notice = c.wait_notification(NOTICE_TIMEOUT_S)
        if notice.method == method:
            return notice


def stalled(c: Client) -> str:
    """Why the watched session stalled, from its next `session/stalled` notice."""
    return str(next_notice(c, "session/stalled").params["why"])


def until_done(c: Client, turn: int) -> list[Reply]:
    """The notices c receives (it watches the session) up to the step that answers the turn's Done."""
    seen = []
    while True:
        notice = c.wait_notification(NOTICE_TIMEOUT_S)
        seen.append(notice)
        if notice.method == "session/actions" and any(
            a["op"].get("Done", {}).get("turn") == turn for a in notice.params["actions"]
        ):
            return seen


def run_turn(c: Client, session: str, prompt: str) -> list[Reply]:
    """Prompt the session and wait (watching it from before the prompt) for the turn's Done; the notices."""
    watch_raw(c, session, since=c.list().sessions[[s.session for s in c.list().sessions].index(session)].seq)
    turn = c.prompt(session, prompt)
    return until_done(c, turn)


def conversation(c: Client, session: str) -> list[Any]:
    """The session's transcript as plain JSON."""
    import msgspec

    # Through JSON, not to_builtins: a Tool call's input is msgspec.Raw, which to_builtins does not take.
    return msgspec.json.decode(msgspec.json.encode(c.transcript(session)))  # type: ignore[no-any-return]
