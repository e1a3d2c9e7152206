"""Spend ceilings through the real daemon: what was spent is kept by the store, so it counts after a restart (for a
session closed since as for any other), and in a fleet for every daemon: a session taken over, another session of the
profile's day (devd.agent.oversight, devd.storage)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from devd.agent.spend import MAX_TOKENS_DEFAULT, estimate_tokens
from devd.messages import Agent, Message
from tests.agents import NOTICE_TIMEOUT_S, SECRET, agents_toml, run_turn, stalled, start, until_done, watch_raw
from tests.daemon import Daemon
from tests.postgres import postgres, postgres_url  # noqa: F401  (the fixtures)
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]


def test_a_restart_keeps_the_days_spend_of_a_closed_session_so_the_ceiling_still_refuses(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin, max_tokens="1000", budget="{ tokens_per_day = 5000 }")
    standin.script(Scripted(text="spent", usage=(4500, 500, None)), Scripted(text="never sent"))
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
         "tokens", "5000 spent"],
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
    standin.script(Scripted(text="spent", usage=(4500, 500, None)), Scripted(text="never sent"))
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
        ["spend ceiling reached: tokens_per_session of agent 'coder' is 5000 tokens", "5000 spent"],
    )


def test_what_one_daemon_spent_of_a_day_counts_for_another_daemons_sessions(
    tmp_path: Path,
    standin: Standin,
    postgres_url: str,  # noqa: F811
) -> None:
    a, b, workspace = _fleet(tmp_path, standin, postgres_url, "{ tokens_per_day = 5000 }")
    standin.script(Scripted(text="spent", usage=(4500, 500, None)), Scripted(text="never sent"))
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
        "5000 spent",
    )


def _request_tokens(standin: Standin, n: int = 0) -> int:
    return estimate_tokens(json.dumps(standin.requests[n].body, ensure_ascii=False).encode())


def test_each_retry_is_reserved_again_so_the_attempts_of_a_call_stay_within_the_ceiling(
    tmp_path: Path, standin: Standin
) -> None:
    # Each attempt streams 36,000 characters (9,000 tokens) of its 10,000 reserved, then is cut before [DONE]: the
    # third attempt would need 10,000 more than the 2 * (request + 9,000) spent, past 25,000.
    agentd = start(tmp_path, standin, max_tokens="10000", budget="{ tokens_per_session = 25000 }")
    standin.script(*[Scripted(text="y" * 36_000, split=400, cut_after=91)] * 4)
    with agentd.daemon, agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        c.prompt(session, "hello")
        why = stalled(c)
        spent = c.call("session/usage", {"session": session})
    request = _request_tokens(standin)
    assert (standin.count, spent["input_tokens"] + spent["output_tokens"], why.split("; ")[1].split(", ")[:2]) == (
        2,
        2 * (request + 9000),
        [
            "it was not tried again: spend ceiling reached: tokens_per_session of agent 'coder' is 25000 tokens",
            f"{2 * (request + 9000)} spent",
        ],
    )


def test_a_call_without_max_tokens_reserves_a_bounded_reply_so_the_days_other_sessions_go_on(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin, budget="{ tokens_per_day = 100000 }")
    release = threading.Event()
    standin.script(Scripted(text="slow", held=release, held_after=1), Scripted(text="quick"))
    try:
        with agentd.daemon, agentd.client() as c:
            c.prompt(agentd.session(c), "first")  # held in flight, its reservation with it
            deadline = time.monotonic() + NOTICE_TIMEOUT_S
            while standin.count < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            other = agentd.session(c)
            run_turn(c, other, "second")
            answered = c.transcript(other)[-1]
    finally:
        release.set()
    assert ([r.body.get("max_tokens") for r in standin.requests], answered) == (
        [MAX_TOKENS_DEFAULT, MAX_TOKENS_DEFAULT],
        Message(Agent=Agent(text="quick")),
    )


def test_a_server_that_ignores_max_tokens_is_read_no_further_than_the_reservation(
    tmp_path: Path, standin: Standin
) -> None:
    # 1,000 characters a chunk: the 17th passes the 4,096 tokens (16,384 characters) sent and reserved.
    agentd = start(tmp_path, standin, budget="{ tokens_per_session = 20000 }")
    standin.script(Scripted(endless="chunks"))
    with agentd.daemon, agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session, since=0)
        c.prompt(session, "hello")
        why = stalled(c)
        spent = c.call("session/usage", {"session": session})
    assert (spent["output_tokens"], why.split(": ", 2)[2].split(";")[0]) == (
        4250,
        "the reply passed the 4096 tokens reserved for it (the max_tokens sent, by devd's estimate of 4 characters a "
        "token) and was dropped, charged what streamed",
    )


def test_a_call_stopped_with_the_daemon_is_charged_what_streamed_before_it_stopped(
    tmp_path: Path, standin: Standin
) -> None:
    agentd = start(tmp_path, standin)
    standin.script(Scripted(text="abcdefgh", split=8, hang=True), Scripted(text="done", usage=(100, 1, None)))
    with agentd.daemon:
        with agentd.client() as c:
            session = agentd.session(c)
            watch_raw(c, session, since=0)
            turn = c.prompt(session, "hello")
            while c.wait_notification(NOTICE_TIMEOUT_S).method != "session/delta":
                pass  # "abcdefgh" streamed: 2 tokens
        agentd.daemon.stop()
        agentd.daemon.start()  # asks again, answered "done"
        with agentd.client() as c:
            watch_raw(c, session, since=0)
            until_done(c, turn)
            spent = c.call("session/usage", {"session": session})
    assert spent == {
        "input_tokens": _request_tokens(standin) + 100,
        "output_tokens": 2 + 1,
        "cached_tokens": 0,
        "calls": 2,
        "refused": 0,
        "estimated": True,  # the first call's: stopped, it was charged devd's estimate
    }
