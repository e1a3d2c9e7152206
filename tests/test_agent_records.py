"""The agent runtime's record log through the real daemon: `session/trace` answers a page at a time, and a claim whose
action has its result goes (devd.agent.runner, devd.agent.oversight, devd.server.methods)."""

from __future__ import annotations

import anyio
import pytest

from devd import errors
from devd.agent import records
from devd.storage.sqlite import SQLiteStore
from tests.agents import Agentd, agentd, run_turn
from tests.standin_model import Scripted, standin_fixture
from tests.stores import running

__all__ = ["agentd", "standin_fixture"]


def test_session_trace_answers_a_page_and_the_since_of_the_next(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("read", {"path": "a.txt"})]),
        Scripted(tool_calls=[("read", {"path": "b.txt"})]),
        Scripted(text="done"),
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "read them")
        everything = c.call("session/trace", {"session": session})
        first = c.call("session/trace", {"session": session, "limit": 2})
        rest = c.call("session/trace", {"session": session, "since": first["next"], "limit": 3})
    kinds = [(r["kind"], r["name"] if r["kind"] == "read" else None) for r in everything["records"]]
    numbers = [r["n"] for r in everything["records"]]
    assert (kinds, everything["next"], [r["n"] for r in first["records"]], first["next"], rest) == (
        [("model", None), ("read", "a.txt"), ("model", None), ("read", "b.txt"), ("model", None)],
        None,
        numbers[:2],
        numbers[1],
        {"records": everything["records"][2:], "next": None},
    )


@pytest.mark.parametrize("limit", [0, 10_001])
def test_session_trace_refuses_a_page_of_no_records_or_of_too_many(agentd: Agentd, limit: int) -> None:
    with agentd.client() as c:
        session = agentd.session(c)
        with pytest.raises(errors.InvalidParamsError, match="limit"):
            c.call("session/trace", {"session": session, "limit": limit})


def test_a_claim_goes_once_its_action_has_its_result_and_the_session_is_driven_again(agentd: Agentd) -> None:
    agentd.standin.script(
        Scripted(tool_calls=[("write", {"path": "a.txt", "text": "a"})]),
        Scripted(text="wrote it"),
        Scripted(text="nothing to do"),
    )
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "write it")  # the write's claim, then its result
        run_turn(c, session, "anything else?")  # a driver starts again
    agentd.daemon.stop()

    async def claims() -> list[int]:
        async with running(SQLiteStore(agentd.daemon.state / "devd.sqlite3", **LIMITS)) as store:
            return [r.action for r in await store.records(session, (records.CLAIM,))]

    assert anyio.run(claims) == []


LIMITS = {"keys_kept": 1000, "steps_kept": 1000, "prune_every_steps": 256}


def test_devd_trace_shows_a_page_and_says_how_to_ask_for_the_next(
    agentd: Agentd, capsys: pytest.CaptureFixture[str]
) -> None:
    from devd.cli import main

    agentd.standin.script(Scripted(tool_calls=[("read", {"path": "a.txt"})]), Scripted(text="done"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "read it")
        first = c.call("session/trace", {"session": session})["records"][0]["n"]
    capsys.readouterr()
    status = main(["trace", "--connect", str(agentd.daemon.socket), session, "--limit", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert (status, len(lines), lines[1]) == (0, 2, f"(more: --since {first})")
