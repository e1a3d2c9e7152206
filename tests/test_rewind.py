"""Sessions that say what they are, the effect ledger and rewind (issue 31): end to end against the real daemon, the
stand-in model server and real files."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from devd import errors
from devd.client import Client
from devd.protocol import Effect, NotUndone
from tests.agents import (
    SYSTEM,
    Agentd,
    agentd,
    agentd_process_fixture,  # noqa: F401 (the fixture)
    conversation,
    next_notice,
    run_turn,
    start,
    until_done,
    watch_raw,
)
from tests.helpers import devd
from tests.standin_model import Scripted, Standin, standin_fixture

__all__ = ["agentd", "standin_fixture"]


def write(path: str, text: str) -> tuple[str, dict[str, str]]:
    return ("write", {"path": path, "text": text})


def two_turns(agentd: Agentd, c: Client) -> str:
    """A session whose turn 1 writes a.txt and whose turn 2 rewrites it, makes b.txt and runs a command."""
    agentd.standin.script(
        Scripted(tool_calls=[write("a.txt", "one")]),
        Scripted(text="wrote a"),
        Scripted(tool_calls=[write("a.txt", "two"), write("b.txt", "new"), ("exec", {"argv": ["true"]})]),
        Scripted(text="done"),
    )
    session = agentd.session(c)
    run_turn(c, session, "write a")
    run_turn(c, session, "change things")
    return session


# -- titles ----------------------------------------------------------------------------------------------------------


def test_a_session_is_titled_with_its_first_prompt_on_one_line_cut_to_60_characters(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="ok"), Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "fix the failing test\nin  tests/test_x.py, then run the whole suite and report back")
        run_turn(c, session, "a second prompt does not retitle it")
        listed = {s.session: s.title for s in c.list().sessions}
        assert (listed[session], c.info(session).title) == (
            ("fix the failing test in tests/test_x.py, then run the whole…",) * 2
        )


def test_session_title_sets_a_title_that_outlives_a_restart(agentd_process: Agentd) -> None:
    with agentd_process.client() as c:
        session = agentd_process.session(c)
        c.set_title(session, "the flaky CI job")
    agentd_process.daemon.kill()
    agentd_process.daemon.start()
    with agentd_process.client() as c:
        assert [s.title for s in c.list().sessions if s.session == session] == ["the flaky CI job"]


def test_a_fork_carries_its_sources_title(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = agentd.session(c)
        c.list()  # titles known here before the fork exists
        c.set_title(session, "the flaky CI job")
        fork = c.fork(session)
        assert c.info(fork).title == "the flaky CI job"


def test_a_title_with_a_control_character_is_refused_saying_which(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = agentd.session(c)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.set_title(session, "fine\x1b[2Jgone")
    assert str(refused.value) == (
        "the title holds '\\x1b', which is not printable (a control, format or line-breaking character); send it "
        "without"
    )


# -- the effect ledger -------------------------------------------------------------------------------------------------


def test_effects_lists_each_effect_of_the_session_in_order_with_its_turn_kind_subject_and_outcome(
    agentd: Agentd,
) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        effects = c.effects(session)
        assert [(e.kind, e.subject, e.outcome, e.undoable) for e in effects] == [
            ("Write", "a.txt", "ok", True),
            ("Write", "a.txt", "ok", True),
            ("Write", "b.txt", "ok", True),
            ("Exec", ["true"], "ok", False),
        ]
        assert [e.action for e in c.effects(session, since=effects[1].turn)] == [e.action for e in effects[1:]]


# -- rewind --------------------------------------------------------------------------------------------------------


def test_rewind_puts_back_changed_files_removes_made_ones_and_moves_the_conversation_back(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        second = c.effects(session)[1].turn
        before = conversation(c, session)
        answer = c.rewind(session, second)
        ws = agentd.workspace
        assert (answer.restored, answer.removed, answer.not_undone) == (
            ["a.txt"],
            ["b.txt"],
            [NotUndone(c.effects(session)[3].action, "Exec", ["true"])],
        )
        assert ((ws / "a.txt").read_text(), (ws / "b.txt").exists()) == ("one", False)
        assert [m for m in conversation(c, session) if "User" in m] == [{"User": "write a"}]
        assert conversation(c, answer.kept_as) == before


def test_a_watcher_of_a_rewound_session_is_told_the_step_it_went_back_to(agentd: Agentd) -> None:
    with agentd.client() as c, agentd.client() as watcher:
        session = two_turns(agentd, c)
        watch_raw(watcher, session)
        c.rewind(session, c.effects(session)[1].turn)  # turn 2's Turn step is step 5: four steps of turn 1 before it
        assert next_notice(watcher, "session/unwatched").params == {
            "session": session,
            "seq": 4,
            "reason": "rewound to step 4",
        }


def test_a_rewound_session_takes_its_next_turn_from_where_it_went_back_to(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        c.rewind(session, c.effects(session)[1].turn)
        agentd.standin.script(Scripted(text="again"))
        run_turn(c, session, "try something else")
        assert [m for m in conversation(c, session) if "User" in m] == [
            {"User": "write a"},
            {"User": "try something else"},
        ]


def test_a_stalled_turn_may_be_rewound_and_its_fork_keeps_no_turn_to_carry_on(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(tool_calls=[write("a.txt", "one")]), Scripted(text="wrote a"))
    with agentd.client() as c, agentd.client() as ui:
        session = agentd.session(c)
        run_turn(c, session, "write a")
        agentd.standin.script(Scripted(tool_calls=[write("a.txt", "two")]), *[Scripted(status=500)] * 4)
        watch_raw(ui, session)
        second = c.prompt(session, "change it")
        next_notice(ui, "session/stalled")
        kept_as = c.rewind(session, second).kept_as
        last = conversation(c, kept_as)[-1]
        assert ((agentd.workspace / "a.txt").read_text(), c.pending(session), c.pending(kept_as), last) == (
            "one",
            [],
            [],
            {"Tool": {"id": 8, "text": "wrote 3 bytes to a.txt"}},
        )


def test_rewind_is_conflict_naming_a_file_someone_else_changed_since_and_puts_nothing_back(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        (agentd.workspace / "a.txt").write_text("edited by hand")
        with pytest.raises(errors.ConflictError) as refused:
            c.rewind(session, c.effects(session)[1].turn)
        assert str(refused.value) == (
            f"not rewound: a.txt changed since session {session!r} last wrote it (someone else wrote there); "
            "nothing was put back: look at the changes, then rewind with force: true to put every file back "
            "regardless"
        )
        assert ((agentd.workspace / "b.txt").read_text(), len(c.effects(session))) == ("new", 4)


def test_rewind_with_force_puts_back_a_file_someone_else_changed_since(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        (agentd.workspace / "a.txt").write_text("edited by hand")
        c.rewind(session, c.effects(session)[1].turn, force=True)
        assert (agentd.workspace / "a.txt").read_text() == "one"


def test_a_link_put_in_place_of_a_made_file_is_removed_itself_never_what_it_points_to(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        ws = agentd.workspace
        (ws / "keep.txt").write_text("new")  # what b.txt held, so that through the link it would look unchanged
        (ws / "b.txt").unlink()
        (ws / "b.txt").symlink_to("keep.txt")
        with pytest.raises(errors.ConflictError):  # a link in its place is a change
            c.rewind(session, c.effects(session)[1].turn)
        c.rewind(session, c.effects(session)[1].turn, force=True)
        assert ((ws / "b.txt").is_symlink(), (ws / "keep.txt").read_text()) == (False, "new")


def test_a_directory_swapped_for_a_link_outside_is_never_written_through(agentd: Agentd, tmp_path: Path) -> None:
    outside = tmp_path / "outside"  # a directory the session's tools never reach
    outside.mkdir()
    (outside / "a.txt").write_text("theirs")
    (agentd.workspace / "sub").mkdir()
    (agentd.workspace / "sub" / "a.txt").write_text("before")
    agentd.standin.script(Scripted(tool_calls=[write("sub/a.txt", "after")]), Scripted(text="done"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "change it")
        (agentd.workspace / "sub").rename(agentd.workspace / "sub.old")
        (agentd.workspace / "sub").symlink_to(outside)  # as a command could, between the turn and the rewind
        with pytest.raises(errors.DevdError) as refused:
            c.rewind(session, c.effects(session)[0].turn, force=True)
    said = (
        f"the rewind of session {session!r} to before turn 1 stopped at sub/a.txt (sub became a link while it was used"
    )
    assert (
        str(refused.value).startswith(said),
        (outside / "a.txt").read_text(),
        (agentd.workspace / "sub.old" / "a.txt").read_text(),
    ) == (
        True,
        "theirs",
        "after",
    )


def test_a_large_file_is_kept_apart_and_put_back_whole(agentd: Agentd) -> None:
    big = "".join(f"line {i}\n" for i in range(2000))  # 17 KB: past what a claim holds inline
    (agentd.workspace / "big.txt").write_text(big)
    agentd.standin.script(Scripted(tool_calls=[write("big.txt", "small")]), Scripted(text="done"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "shrink it")
        c.rewind(session, c.effects(session)[0].turn)
        assert (agentd.workspace / "big.txt").read_text() == big


def test_the_effects_a_rewind_undid_are_no_longer_undoable_and_the_rewind_is_listed(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        second = c.effects(session)[1].turn
        c.rewind(session, second)
        assert [(e.kind, e.subject, e.undoable) for e in c.effects(session)] == [
            ("Write", "a.txt", True),
            ("Write", "a.txt", False),
            ("Write", "b.txt", False),
            ("Exec", ["true"], False),
            ("Rewind", ["a.txt", "b.txt"], False),
        ]


def test_a_rewind_the_daemon_was_killed_during_is_finished_at_its_next_start(tmp_path: Path, standin: Standin) -> None:
    running = start(tmp_path, standin, env={"DEVD_FAILPOINTS": "agent.rewinding=kill@1"})
    with running.client() as c:
        session = two_turns(running, c)
        second = c.effects(session)[1].turn
        with pytest.raises((errors.DevdError, OSError, EOFError)):
            c.rewind(session, second)  # killed after the first file was put back
    running.daemon.proc.wait(20)  # type: ignore[union-attr]
    ws = running.workspace
    half = ((ws / "a.txt").read_text(), (ws / "b.txt").exists())
    running.daemon.env = {k: v for k, v in running.daemon.env.items() if k != "DEVD_FAILPOINTS"}
    with running.daemon.start(), running.client() as c:
        listed = wait_for_rewind(c, session)
        assert (half, (ws / "a.txt").read_text(), (ws / "b.txt").exists(), listed) == (
            ("two", False),  # b.txt, the newest, went first
            "one",
            False,
            Effect(second, 0, "Rewind", ["a.txt", "b.txt"], listed.at, "ok", False),
        )
        assert [m for m in conversation(c, session) if "User" in m] == [{"User": "write a"}]


def wait_for_rewind(c: Client, session: str) -> Effect:
    """The session's last rewind once it is finished (the daemon finishes one left at its start, as it serves)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rewinds = [e for e in c.effects(session) if e.kind == "Rewind"]
        if rewinds and rewinds[-1].outcome == "ok":
            return rewinds[-1]
        time.sleep(0.05)
    raise AssertionError(f"the rewind was not finished: {c.effects(session)}")


def test_rewind_to_a_turn_the_conversation_does_not_have_is_invalid_params(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = agentd.session(c)
        with pytest.raises(errors.InvalidParamsError) as refused:
            c.rewind(session, 7)
    assert str(refused.value).startswith(f"session {session!r} has no turn 7 in its conversation")


# -- project instructions ----------------------------------------------------------------------------------------------


def system_messages(standin: Standin, request: int) -> list[str]:
    return [m["content"] for m in standin.requests[request].body["messages"] if m["role"] == "system"]


def test_instructions_of_the_root_and_the_workspace_are_sent_outermost_first_after_the_system_prompt(
    agentd: Agentd,
) -> None:
    roots = agentd.workspace.parent
    (roots.parent / "AGENTS.md").write_text("above the root: never sent")
    (roots / "AGENTS.md").write_text("every project: be brief\n")
    (agentd.workspace / "AGENTS.md").write_text("this project: run make test")
    agentd.standin.script(Scripted(text="ok"))
    with agentd.client() as c:
        run_turn(c, agentd.session(c), "hello")
    assert system_messages(agentd.standin, 0) == [
        SYSTEM,
        "Project instructions from roots/AGENTS.md:\n\nevery project: be brief\n\n"
        "Project instructions from roots/ws/AGENTS.md:\n\nthis project: run make test",
    ]


def test_instructions_are_read_again_at_each_model_call(agentd: Agentd) -> None:
    agentd.standin.script(Scripted(text="ok"), Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "first")
        (agentd.workspace / "AGENTS.md").write_text("new rule")
        run_turn(c, session, "second")
    assert (system_messages(agentd.standin, 0), system_messages(agentd.standin, 1)[1:]) == (
        [SYSTEM],
        ["Project instructions from roots/ws/AGENTS.md:\n\nnew rule"],
    )


def test_the_trace_keeps_the_digest_of_the_instructions_sent_and_info_names_their_files(agentd: Agentd) -> None:
    (agentd.workspace / "AGENTS.md").write_text("rule")
    agentd.standin.script(Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        run_turn(c, session, "hello")
        sent = system_messages(agentd.standin, 0)[1]
        assert (c.trace(session)[0].instructions, c.info(session).instructions) == (
            hashlib.sha256(sent.encode()).hexdigest(),
            [str(agentd.workspace / "AGENTS.md")],
        )


def test_a_linked_or_oversized_instruction_file_is_skipped_with_a_notice_and_the_turn_goes_on(agentd: Agentd) -> None:
    roots = agentd.workspace.parent
    (roots / "AGENTS.md").write_text("x" * (64 * 1024 + 1))
    (agentd.workspace / "AGENTS.md").symlink_to("/etc/passwd")
    agentd.standin.script(Scripted(text="ok"))
    with agentd.client() as c:
        session = agentd.session(c)
        watch_raw(c, session)
        c.prompt(session, "hello")
        notice = next_notice(c, "session/instructions").params
        until_done(c, 1)
    assert (notice["skipped"], system_messages(agentd.standin, 0)) == (
        [
            {"path": str(roots / "AGENTS.md"), "why": "not read: it has 65537 bytes, more than the 65536 sent"},
            {
                "path": str(agentd.workspace / "AGENTS.md"),
                "why": "not read: it is a symbolic link, which is not followed",
            },
        ],
        [SYSTEM],
    )


# -- the command line ------------------------------------------------------------------------------------------------


def test_devd_title_effects_and_rewind_are_the_methods_for_people(agentd: Agentd) -> None:
    with agentd.client() as c:
        session = two_turns(agentd, c)
        second = c.effects(session)[1].turn
        sock = str(agentd.daemon.socket)
        titled = devd("title", session, "the flaky job", "--connect", sock)
        listed = devd("effects", session, "--since", str(second), "--connect", sock)
        rewound = devd("rewind", session, str(second), "--connect", sock)
        info = devd("info", session, "--connect", sock)
    lines = [line.split(" ", 5)[5] for line in listed.stdout.splitlines()]  # past turn, action and time
    assert (titled.stdout, lines, rewound.stdout.splitlines()[:3], info.stdout.splitlines()[-2:]) == (
        "",
        ["Write a.txt ok (undoable)", "Write b.txt ok (undoable)", "Exec true ok"],
        ["restored a.txt", "removed b.txt", f"not undone: action {c_effect_action(listed.stdout, 2)} Exec true"],
        ["instructions: none", "title: the flaky job"],
    )


def c_effect_action(listed: str, row: int) -> str:
    """The action id on a line of `devd effects`."""
    return listed.splitlines()[row].split()[3]
