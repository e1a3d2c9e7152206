"""Child runs end to end, shared by tests/test_children*.py: the real daemon with an agents file of several profiles
(`coder`, which delegates, and the agents it delegates to), all asking the one stand-in model server, which answers
each agent from a script of its own (told apart by the system prompt each profile sends)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devd.client import Client, Reply
from tests.agents import NOTICE_TIMEOUT_S, SECRET
from tests.daemon import Daemon
from tests.harness import InProcess
from tests.standin_model import Responder, Scripted, Standin

AGENTS = ("coder", "reviewer", "tester", "auditor")


def system_of(agent: str) -> str:
    return f"You are agent {agent}."


def agents_file(url: str, root: Path, profiles: dict[str, dict[str, str]]) -> str:
    """An agents file of the named profiles, each asking the stand-in; a profile's dict holds extra TOML keys as
    written (e.g. {"delegates": '["reviewer"]'})."""
    lines: list[str] = []
    for name, extra in profiles.items():
        keys = {
            "base_url": f'"{url}"',
            "model": '"standin-model"',
            "api_key_env": '"DEVD_TEST_KEY"',
            "system": f'"{system_of(name)}"',
            "workspace_roots": f'["{root}"]',
            "exec_timeout_s": "60",
        } | extra
        lines += [f"[agent.{name}]", *(f"{key} = {value}" for key, value in keys.items()), ""]
    return "\n".join(lines)


class Router:
    """The stand-in's replies by agent: each request is answered from the script of the agent whose system prompt it
    sends; `seen` counts the requests of each agent, `hooks` run (on the stand-in's thread) before an agent's reply."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.scripts: dict[str, list[Responder]] = {a: [] for a in AGENTS}
        self.seen: dict[str, int] = dict.fromkeys(AGENTS, 0)
        self.hooks: dict[str, Callable[[dict[str, Any]], None]] = {}

    def script(self, agent: str, *replies: Responder) -> None:
        with self._lock:
            self.scripts[agent].extend(replies)

    def __call__(self, body: dict[str, Any]) -> Scripted:
        system = body["messages"][0]["content"]
        agent = next(a for a in AGENTS if system == system_of(a))
        with self._lock:
            self.seen[agent] += 1
            script = self.scripts[agent]
            reply = script.pop(0) if script else Scripted(text=f"{agent} has nothing more to say")
        hook = self.hooks.get(agent)
        if hook is not None:
            hook(body)
        return reply if isinstance(reply, Scripted) else reply(body)


@dataclass
class Family:
    daemon: InProcess | Daemon
    workspace: Path
    standin: Standin
    router: Router

    def client(self) -> Client:
        return self.daemon.client()

    def session(self, c: Client, agent: str = "coder") -> str:
        return c.new(agent=agent, workspace=self.workspace)


def prepare(
    tmp_path: Path, standin: Standin, profiles: dict[str, dict[str, str]], tables: str = ""
) -> tuple[Path, Router]:
    """The workspace, and the agents file (with `tables` after the profiles: an MCP server's, say)."""
    (tmp_path / "roots" / "ws").mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_file(standin.url, tmp_path / "roots", profiles) + tables)
    router = Router()
    standin.default = router
    return agents, router


@contextmanager
def family(
    tmp_path: Path, standin: Standin, profiles: dict[str, dict[str, str]], monkeypatch: Any, tables: str = ""
) -> Iterator[Family]:
    """The daemon (in this process) with those profiles (and `tables` after them)."""
    monkeypatch.setenv("DEVD_TEST_KEY", SECRET)
    agents, router = prepare(tmp_path, standin, profiles, tables)
    with InProcess(tmp_path / "d", "--agents", str(agents)) as daemon:
        yield Family(daemon, tmp_path / "roots" / "ws", standin, router)


def process(tmp_path: Path, standin: Standin, profiles: dict[str, dict[str, str]], env: dict[str, str]) -> Family:
    """The daemon as a process of its own (for a test that kills it), started."""
    agents, router = prepare(tmp_path, standin, profiles)
    daemon = Daemon(tmp_path / "d", "--agents", str(agents), env={"DEVD_TEST_KEY": SECRET, **env})
    return Family(daemon.start(), tmp_path / "roots" / "ws", standin, router)


def delegation(agent: str, task: str, **more: Any) -> Scripted:
    return Scripted(tool_calls=[("delegate", {"agent": agent, "task": task, **more})])


def tool_results(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def notices(c: Client, method: str, until: Callable[[Reply], bool]) -> list[Reply]:
    """The notices of that method c receives up to the first `until` holds of (included)."""
    seen = []
    while True:
        notice = c.wait_notification(NOTICE_TIMEOUT_S)
        if notice.method == method:
            seen.append(notice)
            if until(notice):
                return seen


def echo(body: dict[str, Any]) -> Scripted:
    """A reply that repeats the last call's result (as the model reads it): what a delegating agent answers."""
    return Scripted(text=tool_results(body)[-1])
