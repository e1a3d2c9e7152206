"""Child runs (issue 34): an agent delegates a task to another agent, run as a child session linked durably before it
asks the model, held to its parent, answered as the delegating call's result. The twins of the delegated-turn tests
of the WebSocket coordinator's seed (002) and of the auxiliary-run service's (003), through the real daemon and the
stand-in model."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from devd import errors, failpoints
from devd.client import Client
from devd.messages import Cancel, Event
from devd.messages import turn as turn_event
from devd.protocol import ChildNotice
from tests.agents import conversation, until_done, watch_raw
from tests.children import Family, delegation, echo, family, notices
from tests.helpers import until
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["standin_fixture"]

DELEGATES = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {}}


def results(c: Client, session: str) -> list[tuple[str, bool]]:
    """Every call's result in the session's conversation: (text, failed)."""
    return [(m["Tool"]["text"], m["Tool"].get("failed", False)) for m in conversation(c, session) if "Tool" in m]


def delegated_turn(f: Family, c: Client, session: str, prompt: str = "review it") -> int:
    watch_raw(c, session, since=c.info(session).seq)
    turn = c.prompt(session, prompt)
    until_done(c, turn)
    return turn


# -- 002: delegated turns --------------------------------------------------------------------------------------------


def test_delegated_turns_link_distinct_child_runs_before_inference(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each delegating call makes a child of its own, linked both ways before the child's first model call, and the
    child's final answer is the call's result."""
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as probe:
        links: list[tuple[str | None, list[str] | None]] = []

        def linked(body: dict[str, Any]) -> None:  # the child's first request: its links must be durable already
            child = next(s for s in probe.list().sessions if s.parent is not None and s.session not in links_seen)
            links_seen.add(child.session)
            links.append((child.parent, probe.info(str(child.parent)).children))

        links_seen: set[str] = set()
        f.router.hooks["reviewer"] = linked
        session = f.session(c)
        for n in (1, 2):
            f.router.script("coder", delegation("reviewer", f"review part {n}"), echo)
            f.router.script("reviewer", Scripted(text=f"part {n} looks right"))
            delegated_turn(f, c, session)
        children = c.info(session).children
        assert (results(c, session), links, children, f.router.seen) == (
            [("part 1 looks right", False), ("part 2 looks right", False)],
            [(session, [f"{session}.d2"]), (session, [f"{session}.d2", f"{session}.d8"])],
            [f"{session}.d2", f"{session}.d8"],
            {"coder": 4, "reviewer": 2, "tester": 0, "auditor": 0},
        )


def test_delegated_storage_failure_prevents_child_inference_and_parent_success(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes = failpoints._passes.get("children.parent_link", 0) + 1
    monkeypatch.setitem(failpoints._POINTS, "children.parent_link", ("eio", passes))
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review it"), Scripted(text="it could not be reviewed"))
        session = f.session(c)
        delegated_turn(f, c, session)
        assert (results(c, session), f.router.seen["reviewer"], c.info(session).children) == (
            [
                (
                    "the delegated run was not started: its link could not be kept in this session's log (OSError: "
                    "[Errno 5] Input/output error (failpoint children.parent_link))",
                    True,
                )
            ],
            0,
            None,
        )


def test_delegated_append_failure_prevents_child_action_and_parent_resume(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's own link cannot be kept: it never asks the model, and the delegating call fails saying why."""
    passes = failpoints._passes.get("children.child_link", 0) + 1
    monkeypatch.setitem(failpoints._POINTS, "children.child_link", ("eio", passes))
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review it"), Scripted(text="it could not be reviewed"))
        session = f.session(c)
        delegated_turn(f, c, session)
        assert (results(c, session), f.router.seen["reviewer"]) == (
            [
                (
                    "the delegated run was not started: its link could not be kept in its own session's log "
                    "(OSError: [Errno 5] Input/output error (failpoint children.child_link))",
                    True,
                )
            ],
            0,
        )


def test_delegated_inline_policy_prevents_the_effect(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's own profile allows commands; its parent's denies them: the child's command is denied, never run."""
    profiles = {"coder": {"delegates": '["reviewer"]', "exec": '"deny"'}, "reviewer": {"sandbox": '"none"'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "check health"), echo)
        f.router.script(
            "reviewer",
            Scripted(tool_calls=[("exec", {"argv": ["touch", "ran"]})]),
            echo,
        )
        session = f.session(c)
        delegated_turn(f, c, session)
        child = f"{session}.d2"
        assert (results(c, child), (f.workspace / "ran").exists()) == (
            [
                (
                    "denied by the policy: agent 'coder' has exec = \"deny\" (a delegated run is held to the session "
                    "that delegated it)",
                    True,
                )
            ],
            False,
        )


def test_a_delegation_to_an_agent_not_in_delegates_is_a_failed_call_and_makes_no_child(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {**DELEGATES, "tester": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("tester", "test it"), Scripted(text="no"))
        session = f.session(c)
        delegated_turn(f, c, session)
        assert (results(c, session), c.list_children(session).sessions) == (
            [
                (
                    "denied by the policy: agent 'coder' may delegate only to the agents its delegates list "
                    "(reviewer), not to 'tester'",
                    True,
                )
            ],
            [],
        )


def test_a_delegation_past_max_depth_is_refused_naming_the_rule(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {
        "coder": {"delegates": '["reviewer"]', "max_depth": "1"},
        "reviewer": {"delegates": '["tester"]'},
        "tester": {},
    }
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review"), echo)
        f.router.script("reviewer", delegation("tester", "test"), echo)
        session = f.session(c)
        delegated_turn(f, c, session)
        assert (results(c, f"{session}.d2"), f.router.seen["tester"]) == (
            [
                (
                    "refused: the delegated run would be at depth 2 of its tree, past max_depth = 1 (the strictest of "
                    "the agents along its chain; the first session is depth 0)",
                    True,
                )
            ],
            0,
        )


# -- 003: the auxiliary-run service ----------------------------------------------------------------------------------


def test_spawn_runs_the_child_once_and_is_idempotent_by_id(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text='{"decision": "ok"}'))
        parent = f.session(c)
        first = c.spawn(parent, "aux-1", "reviewer", "inspect")
        again = c.spawn(parent, "aux-1", "reviewer", "inspect")
        waited = c.wait(first.session, first.turn)
        assert (first, again, waited.done, waited.outcome, waited.answer, f.router.seen["reviewer"]) == (
            again,
            first,
            True,
            "completed",
            '{"decision": "ok"}',
            1,
        )


def test_spawn_of_a_parent_that_does_not_exist_is_invalid_params(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        with pytest.raises(errors.InvalidParamsError, match="there is no session 'nobody' to spawn a child of"):
            c.spawn("nobody", "aux-1", "reviewer", "inspect")


def test_capability_ceiling_rejects_escalation(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawn of an agent the parent's profile may not delegate to is refused, and no child is made."""
    profiles = {**DELEGATES, "tester": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.spawn(parent, "aux-1", "tester", "inspect")
        assert (str(refused.value), c.list_children(parent).sessions) == (
            f"refused: agent 'coder' of session {parent!r} may delegate only to the agents its delegates list "
            "(reviewer), not to 'tester'; no child was made",
            [],
        )


def test_output_schema_is_enforced(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text='{"wrong": true}'))
        parent = f.session(c)
        child = c.spawn(parent, "aux-schema", "reviewer", "return an object", output_schema=schema)
        waited = c.wait(child.session, child.turn)
        assert (waited.outcome, waited.why) == (
            "failed",
            "its final answer does not satisfy the output_schema: 'answer' is a required property",
        )


def test_an_output_schema_with_a_regular_expression_is_refused_and_no_child_is_made(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attack: a schema whose pattern backtracks for minutes on the child's answer would hold the daemon's loop."""
    schema = {"type": "string", "pattern": "^(a+)+$"}
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.spawn(parent, "aux-redos", "reviewer", "say " + "a" * 40 + "b", output_schema=schema)
        assert (str(refused.value), c.list_children(parent).sessions) == (
            "refused: the output_schema uses `pattern`: devd runs no regular expression a model or a server wrote "
            "(one can hold the daemon's CPU for minutes); describe the format in `description` instead; "
            "no child was made",
            [],
        )


def test_an_answer_past_output_bytes_max_is_cut_saying_so(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]', "output_bytes_max": "10"}, "reviewer": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "say a lot"), Scripted(text="done"))
        f.router.script("reviewer", Scripted(text="0123456789abcdef"))
        session = f.session(c)
        delegated_turn(f, c, session)
        assert results(c, session) == [
            (
                f"0123456789\n\n[devd: the answer of delegated run {session}.d2 was cut at 10 bytes (output_bytes_max "
                "of agent 'coder'); it was 16 bytes]",
                False,
            )
        ]


def test_concurrent_waiters_cannot_miss_the_terminal_state(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        outcomes: list[str | None] = []
        for index in range(8):
            f.router.script("reviewer", Scripted(text=f"ok {index}"))
            child = c.spawn(parent, f"aux-wait-race-{index}", "reviewer", "return")

            def wait(child_name: str = child.session, turn: int = child.turn) -> None:
                with f.client() as w:
                    outcomes.append(w.wait(child_name, turn, timeout_ms=20_000).outcome)

            waiters = [threading.Thread(target=wait) for _ in range(4)]
            for t in waiters:
                t.start()
            for t in waiters:
                t.join()
        assert outcomes == ["completed"] * 32


def test_a_wait_that_times_out_says_not_done(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    held = threading.Event()
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="late", held=held, held_after=1))
        parent = f.session(c)
        child = c.spawn(parent, "aux-slow", "reviewer", "take your time")
        waited = c.wait(child.session, child.turn, timeout_ms=200)
        held.set()
        assert (waited.done, c.wait(child.session, child.turn).outcome) == (False, "completed")


def test_a_wait_of_no_time_for_an_ended_child_says_it_has_ended(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review it"), echo)
        session = f.session(c)
        assert c.wait(session, c.prompt(session, "go")).done
        assert c.wait(f"{session}.d2", 1, timeout_ms=0).outcome == "completed"


def test_a_child_whose_driver_fails_is_a_failed_child_and_fails_the_call(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes = failpoints._passes.get("agent.claimed", 0) + 1
    monkeypatch.setitem(failpoints._POINTS, "agent.claimed", ("eio", passes))
    profiles = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"sandbox": '"none"'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "run it"), Scripted(text="it failed"))
        f.router.script("reviewer", Scripted(tool_calls=[("exec", {"argv": ["touch", "ran"]})]))
        session = f.session(c)
        delegated_turn(f, c, session)
        assert results(c, session) == [
            (
                f"the delegated run {session}.d2 (agent 'reviewer') failed: the daemon failed carrying it out: "
                "OSError: [Errno 5] Input/output error (failpoint agent.claimed)",
                True,
            )
        ]


def test_a_child_may_be_watched_but_not_prompted(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="done"))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect")
        c.wait(child.session, child.turn)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.prompt(child.session, "and now this")
        assert str(refused.value) == (
            f"session {child.session!r} is a delegated run of session {parent!r}: it may not be prompted (its one turn "
            "is the task it was given); watch it, approve its calls, or cancel it or its parent's turn instead"
        )


# -- cancel ------------------------------------------------------------------------------------------------------------


def test_parent_cancellation_is_propagated_before_the_parents_turn_ends(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's terminal state reaches the parent's watchers before the step that ends the parent's turn."""
    held = threading.Event()
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("coder", delegation("reviewer", "wait"))
        f.router.script("reviewer", Scripted(text="never", held=held, held_after=1))
        session = f.session(c)
        watch_raw(ui, session)
        turn = c.prompt(session, "go")
        notices(ui, "session/child", lambda n: n.params["state"] == "running")
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        seen = [  # the child's end, and the step that ends the parent's turn (a usage notice may come between)
            n.params.get("state") if n.method == "session/child" else "parent done"
            for n in until_done(ui, turn)
            if (n.method == "session/child" and n.params["state"] != "running")
            or any("Done" in a["op"] for a in n.params.get("actions", []))
        ]
        held.set()
        waited = c.wait(f"{session}.d2", 1)
        assert (seen, waited.outcome, waited.why) == (
            ["cancelled", "parent done"],
            "cancelled",
            f"the turn of its parent {session} was cancelled",
        )


def test_usage_of_the_children_is_summed_in_the_parents_usage(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="a", usage=(10, 5, None)), Scripted(text="b", usage=(20, 7, None)))
        parent = f.session(c)
        for n in (1, 2):
            child = c.spawn(parent, f"aux-{n}", "reviewer", "inspect")
            c.wait(child.session, child.turn)
        children = c.usage(parent).children
        assert (children.input_tokens, children.output_tokens, children.calls) == (30, 12, 2)  # type: ignore[union-attr]


def test_list_of_a_parent_gives_its_children_and_each_names_its_parent(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent, other = f.session(c), f.session(c)
        for n in (1, 2):
            child = c.spawn(parent, f"aux-{n}", "reviewer", "inspect")
            c.wait(child.session, child.turn)
        c.spawn(other, "aux-1", "reviewer", "inspect")
        listed = c.list_children(parent).sessions
        assert [(s.session, s.parent) for s in listed] == [(f"{parent}.s-aux-1", parent), (f"{parent}.s-aux-2", parent)]


def test_a_tree_three_deep_cancelled_from_the_top_ends_deepest_first(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {
        "coder": {"delegates": '["reviewer"]', "max_depth": "3"},
        "reviewer": {"delegates": '["tester"]', "max_depth": "3"},
        "tester": {"delegates": '["auditor"]', "max_depth": "3"},
        "auditor": {},
    }
    held, asked = threading.Event(), threading.Event()
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("coder", delegation("reviewer", "review"))
        f.router.script("reviewer", delegation("tester", "test"))
        f.router.script("tester", delegation("auditor", "audit"))
        f.router.script("auditor", Scripted(text="never", held=held, held_after=1))
        f.router.hooks["auditor"] = lambda body: asked.set()
        session = f.session(c)
        turn = c.prompt(session, "go")
        assert asked.wait(30)
        tree = [session, f"{session}.d2", f"{session}.d2.d2", f"{session}.d2.d2.d2"]
        for name in tree[:3]:
            watch_raw(ui, name, since=c.info(name).seq)
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        ended = notices(ui, "session/child", lambda n: n.params["child"] == tree[1] and n.params["state"] != "running")
        held.set()
        cancelled = [n.params["child"] for n in ended if n.params["state"] == "cancelled"]
        outcomes = [c.wait(name, 1).outcome for name in tree[1:]]
        assert (cancelled, outcomes, f.router.seen) == (
            [tree[3], tree[2], tree[1]],
            ["cancelled"] * 3,
            {"coder": 1, "reviewer": 1, "tester": 1, "auditor": 1},
        )


def test_closing_the_parent_cancels_its_running_children(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = threading.Event()
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="never", held=held, held_after=1))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "wait")
        c.close_session(parent)
        held.set()
        waited = c.wait(child.session, child.turn)
        assert (waited.outcome, waited.why) == ("cancelled", f"its parent {parent} was closed")


def test_a_delegation_past_max_children_running_is_refused(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = threading.Event()
    profiles = {"coder": {"delegates": '["reviewer"]', "max_children": "1"}, "reviewer": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="slow", held=held, held_after=1))
        parent = f.session(c)
        c.spawn(parent, "aux-1", "reviewer", "wait")
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.spawn(parent, "aux-2", "reviewer", "wait")
        held.set()
        assert str(refused.value) == (
            "refused: 1 delegated runs of this session are running, and max_children = 1 (the strictest along its "
            "chain); wait for one to end; no child was made"
        )


def test_a_childs_approval_is_announced_to_its_parents_watchers_who_may_decide_it(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"exec": '"ask"', "sandbox": '"none"'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("coder", delegation("reviewer", "make it"), echo)
        f.router.script("reviewer", Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})]), Scripted(text="made"))
        session = f.session(c)
        watch_raw(ui, session)
        turn = c.prompt(session, "go")
        asked = notices(ui, "session/approval", lambda n: True)[0].params
        c.approve(asked["session"], asked["action"], asked["digest"], "allow")
        until_done(ui, turn)
        assert (asked["session"], results(c, session), (f.workspace / "made").exists()) == (
            f"{session}.d2",
            [("made", False)],
            True,
        )


# -- one budget tree -------------------------------------------------------------------------------------------------


def test_two_children_racing_cannot_pass_their_parents_ceiling_together(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first child's call holds its reservation on the parent's ceiling; the second's cannot fit beside it and
    stalls saying which ceiling; once the first is over, a resume carries the second on."""
    held, asked = threading.Event(), threading.Event()
    profiles = {
        "coder": {"delegates": '["reviewer"]', "budget": "{ tokens_per_session = 3000 }"},
        "reviewer": {"max_tokens": "100000"},
    }
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script(
            "reviewer",
            Scripted(text="first", held=held, held_after=1, usage=(10, 5, None)),
            Scripted(text="second", usage=(10, 5, None)),
        )
        f.router.hooks["reviewer"] = lambda body: asked.set()
        parent = f.session(c)
        first = c.spawn(parent, "aux-1", "reviewer", "one")
        assert asked.wait(30)
        second = c.spawn(parent, "aux-2", "reviewer", "two")
        until(lambda: c.info(second.session).stalled is not None)
        why = str(c.info(second.session).stalled)
        held.set()
        done_first = c.wait(first.session, first.turn).outcome
        c.resume(second.session)
        waited = c.wait(second.session, second.turn)
        assert (why.split(" is ")[0], done_first, waited.outcome, waited.answer, f.router.seen["reviewer"]) == (
            f"spend ceiling reached: tokens_per_session of agent 'coder' of session {parent!r}, which this run was "
            "delegated from",
            "completed",
            "completed",
            "second",
            2,
        )


def test_a_child_cancelled_while_stalled_at_a_ceiling_fails_the_call_saying_which(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]', "budget": "{ tokens_per_session = 2000 }"}, "reviewer": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", Scripted(**delegation("reviewer", "review").__dict__ | {"usage": (1990, 5, None)}))
        session = f.session(c)
        c.prompt(session, "go")
        child = f"{session}.d2"
        until(lambda: child in (c.info(session).children or []) and c.info(child).stalled is not None)
        stall = str(c.info(child).stalled)
        c.step(child, Event(Cancel=Cancel(turn=1)))
        until(lambda: bool(results(c, session)))
        assert results(c, session) == [
            (
                f"the delegated run {child} (agent 'reviewer') cancelled: its turn was cancelled while it was stalled: "
                f"{stall}",
                True,
            )
        ]


def test_a_child_whose_session_is_closed_while_its_parent_waits_is_disconnected(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    held, asked = threading.Event(), threading.Event()
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review"), Scripted(text="gone"))
        f.router.script("reviewer", Scripted(text="never", held=held, held_after=1))
        f.router.hooks["reviewer"] = lambda body: asked.set()
        session = f.session(c)
        watch_raw(c, session)
        turn = c.prompt(session, "go")
        assert asked.wait(30)
        c.close_session(f"{session}.d2")
        held.set()
        until_done(c, turn)
        assert results(c, session) == [
            (f"the delegated run {session}.d2 (agent 'reviewer') disconnected: its session was closed", True)
        ]


def test_a_budget_past_what_the_parent_has_left_is_refused(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent = c.new(agent="coder", workspace=f.workspace, budget=500)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.spawn(parent, "aux-1", "reviewer", "inspect", budget=501)
        assert str(refused.value) == (
            "refused: a budget of 501 tokens is more than this session has left (500 tokens, under the tightest of "
            "its and its ancestors' ceilings); no child was made"
        )


def test_a_child_is_held_to_its_own_budget(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect", budget=5)
        until(lambda: c.info(child.session).stalled is not None)
        assert str(c.info(child.session).stalled).split(" is ")[0] == "spend ceiling reached: the session's budget"


def test_max_children_per_turn_is_held(tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]', "max_children_per_turn": "1"}, "reviewer": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "one"), delegation("reviewer", "two"), Scripted(text="done"))
        f.router.script("reviewer", Scripted(text="one done"))
        session = f.session(c)
        delegated_turn(f, c, session)
        assert results(c, session) == [
            ("one done", False),
            (
                "refused: this turn has made 1 delegated runs, and max_children_per_turn = 1 (the strictest along its "
                "chain)",
                True,
            ),
        ]


def test_a_delegation_to_an_agent_whose_roots_do_not_hold_the_workspace_is_refused(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    profiles = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"workspace_roots": f'["{elsewhere}"]'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.spawn(parent, "aux-1", "reviewer", "inspect")
        assert str(refused.value).startswith(
            "refused: the delegated run would work in this session's workspace, which agent 'reviewer' may not: "
            f"workspace {f.workspace} is not inside a workspace root of agent 'reviewer'"
        )


def test_the_tools_a_child_is_offered_are_those_its_parent_is_offered_too(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]', "write": '"deny"'}, "reviewer": {"sandbox": '"none"'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="ok"))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect")
        c.wait(child.session, child.turn)
        offered = [t["function"]["name"] for t in standin.requests[-1].body["tools"]]
        assert offered == ["exec", "read", "git"]


def test_a_fork_child_starts_from_its_parents_conversation(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "check it", context="fork"), Scripted(text="done"))
        f.router.script("reviewer", Scripted(text="checked"))
        session = f.session(c)
        delegated_turn(f, c, session, "the colour is blue")
        prompt = [m["content"] for m in standin.requests[1].body["messages"] if m["role"] == "user"][0]
        assert prompt == (
            "The conversation of the session that delegated this task to you, so far:\nuser: the colour is blue\n\n"
            "Your task: check it"
        )


def test_a_child_may_not_be_stepped_a_turn_nor_forked(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="done"))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect")
        c.wait(child.session, child.turn)
        refusals = []
        for attempt in (lambda: c.step(child.session, turn_event(9, "more")), lambda: c.fork(child.session)):
            with pytest.raises(errors.InvalidParamsError) as refused:
                attempt()
            refusals.append(str(refused.value).split(": it may not be ")[1].split(" ")[0])
        assert refusals == ["stepped", "forked"]


def test_a_fork_of_a_parent_has_none_of_its_children(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="done"))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect")
        c.wait(child.session, child.turn)
        forked = c.fork(parent)
        assert (c.info(parent).children, c.info(forked).children, c.usage(forked).children) == (
            [child.session],
            None,
            None,
        )


def test_a_childs_usage_is_told_to_its_parents_watchers_as_it_runs(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("reviewer", Scripted(text="done", usage=(10, 5, None)))
        parent = f.session(c)
        watch_raw(ui, parent)
        c.spawn(parent, "aux-1", "reviewer", "inspect")
        told = notices(ui, "session/child", lambda n: n.params["state"] == "completed")
        assert [(n.params["state"], n.params["usage"]["calls"], n.params["usage"]["input_tokens"]) for n in told] == [
            ("running", 0, 0),
            ("running", 1, 10),
            ("completed", 1, 10),
        ]


def test_a_grandchilds_usage_is_told_to_the_first_sessions_watchers_as_it_runs(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root's watchers are told its child's usage, summed over the child's own children, at each model call of
    any of them (the grandchild's call was told only to the child's watchers)."""
    profiles = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"delegates": '["tester"]'}, "tester": {}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("reviewer", delegation("tester", "test it"), echo)
        f.router.script("tester", Scripted(text="tests pass"))
        parent = f.session(c)
        watch_raw(ui, parent)
        c.spawn(parent, "aux-1", "reviewer", "inspect")
        told = notices(ui, "session/child", lambda n: n.params["state"] == "completed")
        assert [(n.params["state"], n.params["usage"]["calls"]) for n in told] == [
            ("running", 0),
            ("running", 1),
            ("running", 2),
            ("running", 3),
            ("completed", 3),
        ]


def test_a_childs_pending_approval_is_withdrawn_before_it_ends_cancelled(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"exec": '"ask"', "sandbox": '"none"'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("coder", delegation("reviewer", "make it"))
        f.router.script("reviewer", Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})]))
        session = f.session(c)
        watch_raw(ui, session)
        turn = c.prompt(session, "go")
        notices(ui, "session/approval", lambda n: True)
        c.step(session, Event(Cancel=Cancel(turn=turn)))
        told = []
        while not told or told[-1] != "session/child cancelled":
            n = ui.wait_notification(30)
            if n.method == "session/decided":
                told.append(f"session/decided {n.params['decision']}")
            elif n.method == "session/child":
                told.append(f"session/child {n.params['state']}")
        assert (told, (f.workspace / "made").exists()) == (
            ["session/decided cancelled", "session/child cancelled"],
            False,
        )


def test_a_wait_on_a_turn_of_any_agent_session_says_how_it_ended(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = threading.Event()
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as w:
        f.router.script("coder", Scripted(text="first"), Scripted(text="second", held=held, held_after=1))
        session = f.session(c)
        first = c.prompt(session, "one")
        done_first = c.wait(session, first)
        second = c.prompt(session, "two")
        waiting = w.wait(session, second, timeout_ms=100)
        c.step(session, Event(Cancel=Cancel(turn=second)))
        held.set()
        assert (done_first.outcome, waiting.done, c.wait(session, second).outcome) == ("completed", False, "cancelled")


def test_a_wait_of_no_time_for_an_ended_turn_of_any_agent_session_says_how_it_ended(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", Scripted(text="done"))
        session = f.session(c)
        turn = c.prompt(session, "go")
        assert c.wait(session, turn).done
        assert c.wait(session, turn, timeout_ms=0).outcome == "completed"


def test_a_child_stalled_at_its_budget_carries_on_once_it_is_raised_and_resumed(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="done at last"))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect", budget=5)
        until(lambda: c.info(child.session).stalled is not None)
        c.set_budget(child.session, 100_000)
        c.resume(child.session)
        waited = c.wait(child.session, child.turn)
        assert (waited.outcome, waited.answer) == ("completed", "done at last")


def test_a_delegating_call_waits_for_its_stalled_child_and_gets_its_answer_once_it_is_raised_and_resumed(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review it", budget=5), echo)
        f.router.script("reviewer", Scripted(text="reviewed at last"))
        session = f.session(c)
        turn = c.prompt(session, "go")
        child = f"{session}.d2"
        until(lambda: child in (c.info(session).children or []) and c.info(child).stalled is not None)
        waiting = [a.id for a in c.pending(session)]
        c.set_budget(child, 100_000)
        c.resume(child)
        assert (waiting, c.wait(session, turn).outcome, results(c, session)) == (
            [2],
            "completed",
            [("reviewed at last", False)],
        )


def test_a_spawn_id_used_for_another_task_is_a_conflict(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        c.spawn(parent, "aux-1", "reviewer", "inspect")
        with pytest.raises(errors.ConflictError) as refused:
            c.spawn(parent, "aux-1", "reviewer", "something else")
        assert str(refused.value) == (
            f"id 'aux-1' was used for another run of session {parent!r} (agent 'reviewer', another task): its child is "
            f"{parent}.s-aux-1; use a new id for a new run"
        )


def test_a_session_made_first_under_a_childs_name_is_never_taken_for_the_child(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        parent = f.session(c)
        squatter = c.new(agent="coder", workspace=f.workspace, session=f"{parent}.s-aux-1")
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.spawn(parent, "aux-1", "reviewer", "inspect")
        assert (str(refused.value), c.info(squatter).parent, f.router.seen["reviewer"]) == (
            f"the delegated run was not started: a session named {squatter} exists already and is not its own",
            None,
            0,
        )


def test_a_watcher_of_the_parent_is_told_of_a_childs_approval_asked_before_it_watched(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {"coder": {"delegates": '["reviewer"]'}, "reviewer": {"exec": '"ask"', "sandbox": '"none"'}}
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("reviewer", Scripted(tool_calls=[("exec", {"argv": ["touch", "made"]})]))
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "make it")
        until(lambda: bool(c.info(child.session).waiting) and c.pending(child.session)[0].awaiting == "approval")
        watch_raw(ui, parent)
        asked = notices(ui, "session/approval", lambda n: True)[0].params
        assert (asked["session"], asked["action"]) == (child.session, 2)


def test_a_client_watching_the_parent_reads_the_session_child_notices_typed(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `devd.client` raised on the notice it did not know: `devd chat` watching a parent would have failed."""
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("reviewer", Scripted(text="done"))
        parent = f.session(c)
        c.wait(parent, c.prompt(parent, "hello"))
        states = []
        watching = ui.watch(parent, since=0, timeout=30)
        next(watching)  # its first step, from the history: subscribed before the spawn
        child = c.spawn(parent, "aux-1", "reviewer", "inspect")
        for notice in watching:
            if isinstance(notice, ChildNotice):
                states.append((notice.child, notice.state))
                if notice.state != "running":
                    break
        assert states[-1] == (child.session, "completed")


def test_a_child_never_runs_an_mcp_tool_its_parents_profile_denies_even_a_trusted_read(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.mcp_place import PYTHON, placed

    server = placed()
    monkeypatch.setenv("DEVD_TEST_MCP_PATH", server.site)
    table = "\n".join(
        [
            "[agent.reviewer.mcp.demo]",
            f'command = ["{PYTHON}", "{server.server}"]',
            'env = { PYTHONPATH = "DEVD_TEST_MCP_PATH" }',
            'decision = "allow"',
            "trust_read_only = true",
        ]
    )
    with family(tmp_path, standin, DELEGATES, monkeypatch, table + "\n") as f, f.client() as c:
        f.router.script("reviewer", Scripted(tool_calls=[("demo__readme", {})]), echo)
        parent = f.session(c)
        child = c.spawn(parent, "aux-1", "reviewer", "read it")
        waited = c.wait(child.session, child.turn)
        offered = [t["function"]["name"] for t in standin.requests[0].body["tools"]]
        assert ("demo__readme" in offered, waited.answer) == (
            False,
            'error: there is no tool named "demo__readme"; the tools are exec, read, write, git, browse, delegate',
        )


def test_a_wait_on_a_turn_of_a_session_closed_meanwhile_answers_that_it_is_gone(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = threading.Event()
    answered: list[BaseException | object] = []
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as w:
        f.router.script("coder", Scripted(text="never", held=held, held_after=1))
        session = f.session(c)
        turn = c.prompt(session, "go")

        def wait() -> None:
            try:
                answered.append(w.wait(session, turn, timeout_ms=20_000))
            except errors.DevdError as e:
                answered.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)  # the wait is waiting (closed before it asked, it is answered the same)
        c.close_session(session)
        held.set()
        waiter.join(30)
        assert [type(a) for a in answered] == [errors.HandleError]


def test_a_wait_that_times_out_is_answered_done_false_alone_on_the_wire(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = threading.Event()
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("reviewer", Scripted(text="late", held=held, held_after=1))
        child = c.spawn(f.session(c), "aux-raw", "reviewer", "take your time")
        raw = c.call_raw("session/wait", {"session": child.session, "turn": child.turn, "timeout_ms": 100})
        held.set()
        assert raw == b'{"done":false}'


def test_a_list_of_the_children_of_a_session_that_does_not_exist_says_so(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        with pytest.raises(errors.HandleError, match="nobody"):
            c.list_children("nobody")


def test_max_depth_is_2_by_default_counting_the_first_session_as_0(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiles = {
        "coder": {"delegates": '["reviewer"]'},
        "reviewer": {"delegates": '["tester"]'},
        "tester": {"delegates": '["auditor"]'},
        "auditor": {},
    }
    with family(tmp_path, standin, profiles, monkeypatch) as f, f.client() as c:
        f.router.script("coder", delegation("reviewer", "review"), echo)
        f.router.script("reviewer", delegation("tester", "test"), echo)
        f.router.script("tester", delegation("auditor", "audit"), echo)
        session = f.session(c)
        delegated_turn(f, c, session)
        assert (results(c, f"{session}.d2.d2"), f.router.seen["tester"], f.router.seen["auditor"]) == (
            [
                (
                    "refused: the delegated run would be at depth 3 of its tree, past max_depth = 2 (the strictest of "
                    "the agents along its chain; the first session is depth 0)",
                    True,
                )
            ],
            2,
            0,
        )


def test_a_spawned_childs_session_child_notices_carry_exactly_the_contracts_fields(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c, f.client() as ui:
        f.router.script("reviewer", Scripted(text="done", usage=(10, 5, None)))
        parent = f.session(c)
        watch_raw(ui, parent)
        child = c.spawn(parent, "aux-1", "reviewer", "inspect")
        told = notices(ui, "session/child", lambda n: n.params["state"] != "running")
        usage = {"input_tokens": 10, "output_tokens": 5, "cached_tokens": 0, "calls": 1, "refused": 0}
        assert told[-1].params == {
            "session": parent,
            "action": 0,
            "child": child.session,
            "agent": "reviewer",
            "state": "completed",
            "usage": usage,
        }


def test_a_profile_with_delegates_offers_the_model_the_delegate_tool_of_the_contracts_shape(
    tmp_path: Path, standin: Standin, monkeypatch: pytest.MonkeyPatch
) -> None:
    with family(tmp_path, standin, DELEGATES, monkeypatch) as f, f.client() as c:
        f.router.script("coder", Scripted(text="done"))
        session = f.session(c)
        c.wait(session, c.prompt(session, "go"))
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in standin.requests[-1].body["tools"]}
        shape = offered["delegate"]
        assert (list(shape["properties"]), shape["required"], shape["properties"]["context"]["enum"]) == (
            ["agent", "task", "context", "output_schema", "budget"],
            ["agent", "task"],
            ["task", "fork"],
        )
