"""Child runs as people see them (issue 34): `devd run`, `devd attach` and `devd chat` show each delegated run nested
under the call that made it, with its state and usage, and `devd tree` prints a session's tree of children; through
the real CLI (chat in a real pseudo-terminal read with pyte) against the real daemon and the stand-in model."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devd import errors
from devd.client import Client
from tests.children import Family, delegation, echo, process
from tests.daemon import ROOT
from tests.helpers import until
from tests.standin_model import Scripted, Standin, standin_fixture
from tests.terminal import Terminal

__all__ = ["standin_fixture"]

DELEGATES = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"delegates": '["tester"]'}, "tester": {}}


@pytest.fixture
def kin(tmp_path: Path, standin: Standin) -> Iterator[Family]:
    """The daemon as a process of its own, with coder delegating to reviewer and reviewer to tester."""
    f = process(tmp_path, standin, DELEGATES, {})
    with f.daemon:
        yield f


def devd(f: Family, command: str, *args: str) -> list[str]:
    """`devd COMMAND ARGS` against the daemon without a terminal: its status, stdout and stderr."""
    where = ["--connect", str(f.daemon.socket)]
    if command == "run":
        where += ["--agent", "coder", "--workspace", str(f.workspace)]
    done = subprocess.run(
        [sys.executable, "-m", "devd", command, *where, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    return [str(done.returncode), done.stdout, done.stderr]


def session_of(shown: str) -> str:
    found = re.search(r"\[session (\S+) ", shown)
    assert found is not None, shown
    return found[1]


def test_run_shows_a_child_under_its_delegate_call_with_its_state_and_usage(kin: Family) -> None:
    kin.router.script("coder", delegation("reviewer", "review it"), echo)
    kin.router.script("reviewer", Scripted(text="it looks right", usage=(100, 20, 0)))
    status, out, err = devd(kin, "run", "review it")
    child = f"{session_of(err)}.d2"
    assert (status, out.splitlines()) == (
        "0",
        [
            "delegate to reviewer: review it",
            f"  ⤷ {child} (reviewer): running",
            "  │ it looks right",
            "↳ delegate to reviewer: review it",
            f"  ⤷ {child} (reviewer): completed, 120 tokens in 1 call",
            "  it looks right",
            "it looks right",
            "[turn 1 complete]",
        ],
    )


def test_run_shows_a_grandchild_under_its_childs_delegate_call(kin: Family) -> None:
    kin.router.script("coder", delegation("reviewer", "review it"), echo)
    kin.router.script("reviewer", delegation("tester", "test it"), echo)
    kin.router.script("tester", Scripted(text="tests pass", usage=(50, 5, 0)))
    status, out, err = devd(kin, "run", "review it")
    child = f"{session_of(err)}.d2"
    assert (status, out.splitlines()[:6]) == (
        "0",
        [
            "delegate to reviewer: review it",
            f"  ⤷ {child} (reviewer): running",
            "  │ delegate to tester: test it",
            f"  │   ⤷ {child}.d2 (tester): running",
            "  │   │ tests pass",
            "  │ ↳ delegate to tester: test it",
        ],
    )


def test_run_shows_a_failed_child_and_why(kin: Family) -> None:
    schema = {"type": "object", "required": ["ok"]}
    kin.router.script("coder", delegation("reviewer", "review it", output_schema=schema), echo)
    kin.router.script("reviewer", Scripted(text="not json", usage=(10, 2, 0)))
    status, out, err = devd(kin, "run", "review it")
    child = f"{session_of(err)}.d2"
    assert (status, out.splitlines()[4]) == (
        "0",
        f"  ⤷ {child} (reviewer): failed: its final answer does not satisfy the output_schema: it is not JSON, "
        "12 tokens in 1 call",
    )


# -- devd tree ------------------------------------------------------------------------------------------------------


def counted(agent: str, task: str) -> Scripted:
    """A delegation that costs 1 + 1 tokens."""
    return dataclasses.replace(delegation(agent, task), usage=(1, 1, 0))


def echoed(body: dict[str, Any]) -> Scripted:
    """`echo`, costing 2 + 2 tokens."""
    return dataclasses.replace(echo(body), usage=(2, 2, 0))


def test_tree_prints_the_sessions_children_each_under_its_parent(kin: Family) -> None:
    kin.router.script("coder", counted("reviewer", "review it"), echoed, counted("reviewer", "again"), echoed)
    kin.router.script("reviewer", counted("tester", "test it"), echoed, Scripted(text="fine", usage=(7, 3, 0)))
    kin.router.script("tester", Scripted(text="tests pass", usage=(50, 5, 0)))
    with kin.client() as c:
        session = kin.session(c)
        for prompt in ("review it", "again"):
            assert c.wait(session, c.prompt(session, prompt)).done
    status, out, err = devd(kin, "tree", session)
    assert (status, out.splitlines(), err) == (
        "0",
        [
            f"{session}  coder  idle  119 tokens in 8 calls",
            f"├── {session}.d2  reviewer  completed  73 tokens in 3 calls",
            f"│   └── {session}.d2.d2  tester  completed  55 tokens in 1 call",
            f"└── {session}.d8  reviewer  completed  10 tokens in 1 call",
        ],
        "",
    )


def closed(c: Client, session: str) -> bool:
    """Whether the session was closed now (False: BUSY, the daemon stepping it: try again)."""
    try:
        c.call("session/close", {"session": session})
    except errors.BusyError:
        return False
    return True


def test_tree_says_why_a_child_did_not_complete(kin: Family) -> None:
    kin.router.script("coder", counted("reviewer", "review it"), echoed)
    with kin.client() as c:
        session = kin.session(c)
        turn = c.prompt(session, "review it")
        until(lambda: c.info(session).children)
        until(lambda: closed(c, f"{session}.d2"))
        assert c.wait(session, turn).done
    status, out, _ = devd(kin, "tree", session)
    assert (status, out.splitlines()[1:]) == (
        "0",
        [f"└── {session}.d2  -  disconnected: its session was closed  0 tokens in 0 calls"],
    )


def test_tree_of_a_session_that_does_not_exist_says_so(kin: Family) -> None:
    status, out, err = devd(kin, "tree", "nosuch")
    assert (status, out, err) == (
        "1",
        "",
        "devd: HANDLE: no session is named 'nosuch'; `devd ls` shows the sessions there are\n",
    )


# -- a terminal ------------------------------------------------------------------------------------------------------

ASKING = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"exec": '"ask"', "sandbox": '"none"'}}


@pytest.fixture
def asking(tmp_path: Path, standin: Standin) -> Iterator[Family]:
    """coder delegates to reviewer, whose profile asks before each command."""
    f = process(tmp_path, standin, ASKING, {})
    with f.daemon:
        yield f


def terminal(f: Family, command: str, *args: str) -> Terminal:
    where = ["--connect", str(f.daemon.socket)]
    if command in ("run", "chat"):
        where += ["--agent", "coder", "--workspace", str(f.workspace)]
    state = f.workspace.parent.parent / "state"
    return Terminal(command, *where, *args, env={"XDG_STATE_HOME": str(state)})


def make_it(f: Family) -> None:
    f.router.script("coder", delegation("reviewer", "make it"), echo)
    f.router.script(
        "reviewer",
        Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})], usage=(30, 3, 0)),
        Scripted(text="made", usage=(10, 1, 0)),
    )


def test_chat_asks_a_childs_approval_inline_and_shows_the_child_under_its_call(asking: Family) -> None:
    make_it(asking)
    with terminal(asking, "chat") as t:
        session = session_of(t.wait_for("/help"))
        t.type("make it\r")
        t.wait_for(f"[in {session}.d2] allow")
        t.type("y\r")
        shown = t.wait_for(lambda s: re.search(r"^\[turn \d+ complete\]$", s, re.MULTILINE) is not None)
        t.type("\x04")
        status = t.exit_status()
    child = f"{session}.d2"
    start = lines(shown).index("› make it")
    assert (status, lines(shown)[start : start + 12], (asking.workspace / "made").exists()) == (
        0,
        [
            "› make it",
            "delegate to reviewer: make it",
            f"  ⤷ {child} (reviewer): running",
            "  │ $ touch made",
            "  │ [approval needed for action 2: agent 'reviewer' has exec = \"ask\"]",
            f"  │ [action 2 allowed by devd cli: root (uid 0, pid {t.proc.pid})]",
            "  │ ↳ $ touch made",
            "  │   (no output)",
            "  │ made",
            "↳ delegate to reviewer: make it",
            f"  ⤷ {child} (reviewer): completed, 49 tokens in 2 calls",
            "  made",
        ],
        True,
    )


def test_attach_shows_a_child_running_before_it_attached_and_answers_its_approval(asking: Family) -> None:
    make_it(asking)
    with asking.client() as c:
        session = asking.session(c)
        turn = c.prompt(session, "make it")
        until(lambda: c.info(session).children == [f"{session}.d2"])
        until(lambda: any(a.awaiting == "approval" for a in c.pending(f"{session}.d2")))
        with terminal(asking, "attach", session) as t:
            t.wait_for(f"[in {session}.d2] allow")
            t.type("y\r")
            status = t.exit_status()
            shown = t.shown()
        assert c.wait(session, turn).done
    child = f"{session}.d2"
    assert (status, lines(shown)[:3]) == (
        0,
        [
            "delegate to reviewer: make it  [dispatched before this terminal attached]",
            f"  ⤷ {child} (reviewer): running, 38 tokens in 1 call",
            "  │ $ touch made",
        ],
    )


def lines(shown: str) -> list[str]:
    return shown.splitlines()
