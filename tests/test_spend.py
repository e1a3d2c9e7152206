"""Spend ceilings through the real daemon: what a day spent is kept by the store, so it counts after a restart, for
a session closed since as for any other (devd.agent.oversight, devd.storage)."""

from __future__ import annotations

from pathlib import Path

from devd.client import Client
from tests.agents import NOTICE_TIMEOUT_S, run_turn, start, watch_raw
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
