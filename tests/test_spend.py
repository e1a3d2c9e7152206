"""Spend ceilings through the real daemon: what was spent is kept by the store, so it counts after a restart (for a
session closed since as for any other), and in a fleet for every daemon: a session taken over, another session of the
profile's day (devd.agent.oversight, devd.storage)."""

from __future__ import annotations

from pathlib import Path

from devd.client import Client
from tests.agents import NOTICE_TIMEOUT_S, SECRET, agents_toml, run_turn, start, watch_raw
from tests.daemon import Daemon
from tests.postgres import postgres, postgres_url  # noqa: F401  (the fixtures)
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]


def stalled(c: Client) -> str:
    """Why the watched session stalled, from its `session/stalled` notice."""
    while True:
        notice = c.wait_notification(NOTICE_TIMEOUT_S)
        if notice.method == "session/stalled":
            return str(notice.params["why"])


def test_a_restart_keeps_the_days_spend_of_a_closed_session_so_the_ceiling_still_refuses(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin, max_tokens="1000", budget="{ tokens_per_day = 5000 }")
    standin.script(Scripted(text="spent", usage=(4000, 500, None)), Scripted(text="never sent"))
    with agentd.daemon:
        with agentd.client() as c:
            spender = agentd.session(c)
            run_turn(c, spender, "spend")
            c.call("session/close", {"session": spender})  # its records go; what it spent today does not
        agentd.daemon.stop()
        agentd.daemon.start()
        with agentd.client() as c:
            session = agentd.session(c)
            watch_raw(c, session, since=0)
            c.prompt(session, "again")
            why = stalled(c)
    assert (standin.count, why.split(", ")[:2]) == (
        1,
        [f"spend ceiling reached: tokens_per_day of agent 'coder' (UTC day {why.split('UTC day ')[1][:10]}) is 5000 "
         "tokens", "4500 spent"],
    )  # fmt: skip


def _fleet(tmp_path: Path, standin: Standin, url: str, budget: str) -> tuple[Daemon, Daemon, Path]:
    """Two daemons of one fleet, with agents of the given budget (and max_tokens 1000); the workspace."""
    workspace = tmp_path / "roots" / "ws"
    workspace.mkdir(parents=True)
    agents = tmp_path / "agents.toml"
    agents.write_text(agents_toml(standin.url, tmp_path / "roots", max_tokens="1000", budget=budget))
    args = ("--store", url, "--agents", str(agents))
    env = {"DEVD_TEST_KEY": SECRET}
    return (
        Daemon(tmp_path / "a", *args, "--node", "a", env=env),
        Daemon(tmp_path / "b", *args, "--node", "b", env=env),
        workspace,
    )


def test_a_session_taken_over_by_another_daemon_counts_what_it_spent_on_the_first(
    tmp_path: Path,
    standin: Standin,
    postgres_url: str,  # noqa: F811
) -> None:
    a, b, workspace = _fleet(tmp_path, standin, postgres_url, "{ tokens_per_session = 5000 }")
    standin.script(Scripted(text="spent", usage=(4000, 500, None)), Scripted(text="never sent"))
    with a.start(), b.start():
        with a.client() as c:
            session = c.new(agent="coder", workspace=workspace)
            run_turn(c, session, "spend")
            c.call("daemon/drain")  # a gives its sessions back to the fleet
        with b.client() as c:
            watch_raw(c, session, since=0)
            c.prompt(session, "again")  # b takes it over
            why = stalled(c)
    assert (standin.count, why.split(", ")[:2]) == (
        1,
        ["spend ceiling reached: tokens_per_session of agent 'coder' is 5000 tokens", "4500 spent"],
    )


def test_what_one_daemon_spent_of_a_day_counts_for_another_daemons_sessions(
    tmp_path: Path,
    standin: Standin,
    postgres_url: str,  # noqa: F811
) -> None:
    a, b, workspace = _fleet(tmp_path, standin, postgres_url, "{ tokens_per_day = 5000 }")
    standin.script(Scripted(text="spent", usage=(4000, 500, None)), Scripted(text="never sent"))
    with a.start(), b.start():
        with a.client() as c:
            run_turn(c, c.new(agent="coder", workspace=workspace), "spend")
        with b.client() as c:
            session = c.new(agent="coder", workspace=workspace)
            watch_raw(c, session, since=0)
            c.prompt(session, "again")
            why = stalled(c)
    assert (standin.count, why.split(" is ")[0].split(" (")[0], why.split(", ")[1]) == (
        1,
        "spend ceiling reached: tokens_per_day of agent 'coder'",
        "4500 spent",
    )
