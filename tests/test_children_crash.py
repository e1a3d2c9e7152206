"""Child runs through a SIGKILL (issue 34): the daemon killed before a delegated run's link, between its two links,
during its command, after it ended and before its parent's call was answered, and in the middle of a cancel's
cascade. After a restart each child is found again and continues or ends exactly once, its effects never run twice,
and the parent's call is answered once."""

from __future__ import annotations

from pathlib import Path

import pytest

from devd.client import Client
from devd.errors import DevdError
from devd.messages import Cancel, Event
from tests.agents import conversation, until_done, watch_raw
from tests.children import Family, delegation, echo, notices, process
from tests.helpers import until
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]

PROFILES = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"sandbox": '"none"'}}


def results(c: Client, session: str) -> list[tuple[str, bool]]:
    return [(m["Tool"]["text"], m["Tool"].get("failed", False)) for m in conversation(c, session) if "Tool" in m]


def restarted(f: Family) -> None:
    """Wait for the daemon's death at its failure point, and start it again without it."""
    f.daemon.proc.wait(30)  # type: ignore[union-attr]
    f.daemon.env = {k: v for k, v in f.daemon.env.items() if k != "DEVD_FAILPOINTS"}  # type: ignore[union-attr]
    f.daemon.start()


@pytest.mark.parametrize("point", ["children.parent_link", "children.child_link", "children.ended"])
def test_a_delegation_the_daemon_was_killed_around_makes_one_child_and_answers_the_call_once(
    tmp_path: Path, standin: Standin, point: str
) -> None:
    f = process(tmp_path, standin, PROFILES, {"DEVD_FAILPOINTS": f"{point}=kill@1"})
    with f.daemon:
        f.router.script("coder", delegation("reviewer", "review it"), echo)
        f.router.script("reviewer", Scripted(text="it looks right"))
        with f.client() as c:
            session = f.session(c)
            c.prompt(session, "go")
        restarted(f)
        with f.client() as c:
            watch_raw(c, session, since=0)
            until_done(c, 1)
            children = c.info(session).children
            assert (results(c, session), children, f.router.seen["reviewer"], f.router.seen["coder"]) == (
                [("it looks right", False)],
                [f"{session}.d2"],
                1,
                2,
            )


def test_a_childs_command_the_daemon_was_killed_during_is_not_run_again_and_the_call_is_answered_once(
    tmp_path: Path, standin: Standin
) -> None:
    f = process(tmp_path, standin, PROFILES, {})
    marker = f.workspace / "runs"
    with f.daemon:
        f.router.script("coder", delegation("reviewer", "run it"), echo)
        f.router.script(
            "reviewer", Scripted(tool_calls=[("exec", {"argv": ["sh", "-c", "echo run >> runs; sleep 60"]})]), echo
        )
        with f.client() as c:
            session = f.session(c)
            c.prompt(session, "go")
        until(lambda: marker.exists() and marker.read_text() == "run\n")
        f.daemon.kill()
        f.daemon.start()
        with f.client() as c:
            watch_raw(c, session, since=0)
            until_done(c, 1)
            assert (marker.read_text(), results(c, session)) == (
                "run\n",
                [
                    (
                        "error: interrupted: the daemon stopped while this command ran, so it may have partly run; it "
                        "was not run again (check the workspace before you run it again)",
                        False,
                    )
                ],
            )


def test_a_cascade_the_daemon_was_killed_in_is_finished_at_start(tmp_path: Path, standin: Standin) -> None:
    f = process(tmp_path, standin, PROFILES, {"DEVD_FAILPOINTS": "children.cascaded=kill@1"})
    with f.daemon:
        f.router.script("coder", delegation("reviewer", "wait"))
        f.router.script("reviewer", Scripted(text="never", hang=True))
        with f.client() as c, f.client() as ui:
            session = f.session(c)
            watch_raw(ui, session)
            turn = c.prompt(session, "go")
            notices(ui, "session/child", lambda n: n.params["state"] == "running")
            with pytest.raises((DevdError, OSError)):
                c.step(session, Event(Cancel=Cancel(turn=turn)))
        restarted(f)
        with f.client() as c:
            watch_raw(c, session, since=0)
            until_done(c, turn)
            waited = c.wait(f"{session}.d2", 1)
            assert (waited.outcome, waited.why, results(c, session), f.router.seen) == (
                "cancelled",
                f"the turn of its parent {session} was cancelled",
                [("cancelled", True)],  # the core's answer to the call its Cancel withdrew: once
                {"coder": 1, "reviewer": 1, "tester": 0, "auditor": 0},
            )


def test_a_close_the_daemon_was_killed_in_the_cascade_of_is_finished_at_start(tmp_path: Path, standin: Standin) -> None:
    f = process(tmp_path, standin, PROFILES, {"DEVD_FAILPOINTS": "children.cascaded=kill@1"})
    with f.daemon:
        f.router.script("reviewer", Scripted(text="never", hang=True))
        with f.client() as c:
            parent = f.session(c)
            child = c.spawn(parent, "aux-1", "reviewer", "wait")
            until(lambda: f.router.seen["reviewer"] == 1)
            with pytest.raises((DevdError, OSError)):
                c.close_session(parent)
        restarted(f)
        with f.client() as c:
            until(lambda: parent not in [s.session for s in c.list().sessions])
            waited = c.wait(child.session, child.turn)
            assert (waited.outcome, waited.why, f.router.seen["reviewer"]) == (
                "cancelled",
                f"its parent {parent} was closed",
                1,
            )
