"""The approval ledger, the spend ceilings and trace records, pure: exact outcomes with exact numbers."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from devd.agent import approvals, spend, trace
from devd.agent.approvals import Answer, Asked, Decided, Grant, Ledger, action_digest
from devd.agent.spend import Ceilings, Refusal, Scope
from devd.errors import ConflictError, InvalidParamsError
from devd.messages import Exec, Git, Op, Write
from devd.protocol import Remember, Remembered
from devd.storage.store import Counter

RM = Op(Exec=Exec(argv=["rm", "-rf", "build"]))
SCOPE = Scope(session="s", profile="coder", turn=1, day="2026-12-01")


def test_a_digest_is_the_sha256_of_the_action_and_op_with_members_sorted() -> None:
    canonical = b'{"action":5,"op":{"Exec":{"argv":["rm","-rf","build"]}}}'
    assert action_digest(5, RM) == hashlib.sha256(canonical).hexdigest()


def test_the_same_op_under_another_action_id_has_another_digest() -> None:
    assert action_digest(5, RM) != action_digest(6, RM)


def test_the_first_answer_decides() -> None:
    ledger = Ledger()
    asked = ledger.ask(5, RM)
    assert ledger.answer(5, asked.digest, "allow", "ui-1") == Decided(5, "allow", "ui-1")


def test_a_later_answer_is_a_conflict_naming_who_decided() -> None:
    ledger = Ledger()
    asked = ledger.ask(5, RM)
    ledger.answer(5, asked.digest, "allow", "ui-1")
    with pytest.raises(ConflictError, match="already decided: allow by ui-1"):
        ledger.answer(5, asked.digest, "deny", "ui-2")


def test_a_wrong_digest_is_invalid_params_and_decides_nothing() -> None:
    ledger = Ledger()
    ledger.ask(5, RM)
    with pytest.raises(InvalidParamsError, match="does not name action 5"):
        ledger.answer(5, "0" * 64, "allow", "ui-1")
    assert list(ledger.pending) == [5]


def test_an_action_never_asked_about_is_invalid_params() -> None:
    with pytest.raises(InvalidParamsError, match="action 9 awaits no approval"):
        Ledger().answer(9, "0" * 64, "allow", "ui-1")


def test_asking_again_after_a_restart_is_the_same_approval() -> None:
    ledger = Ledger()
    assert ledger.ask(5, RM) is ledger.ask(5, RM)


def test_cancel_withdraws_only_what_is_pending() -> None:
    ledger = Ledger()
    ledger.ask(5, RM)
    ledger.answer(6, ledger.ask(6, RM).digest, "allow", "ui-1")
    assert ledger.cancel([5, 6], "ui-1") == [Decided(5, "cancelled", "ui-1")]


def test_an_answer_after_cancel_is_a_conflict_saying_so() -> None:
    ledger = Ledger()
    asked = ledger.ask(5, RM)
    ledger.cancel([5], "ui-1")
    with pytest.raises(ConflictError, match="its turn was cancelled"):
        ledger.answer(5, asked.digest, "allow", "ui-2")


def remembered(op: Op, decision: Answer = "allow", remember: bool | Remember = True) -> Ledger:
    """A ledger where op was decided with remember."""
    ledger = Ledger()
    ledger.answer(5, ledger.ask(5, op).digest, decision, "ui", remember=remember)
    return ledger


def argv(*words: str) -> Op:
    return Op(Exec=Exec(argv=list(words)))


RM_AO = argv("rm", "a.o")


@pytest.mark.parametrize(
    ("remember", "later", "recalled"),
    [
        (True, RM_AO, "allow"),
        (True, argv("rm", "a.o", "b.o"), None),
        (True, argv("rm", "a.o", "-rf", "src"), None),
        ("exact", argv("rm", "a.o", "-rf", "src"), None),
        ("exact", argv("rm"), None),
        ("prefix", RM_AO, "allow"),
        ("prefix", argv("rm", "a.o", "b.o"), "allow"),
        ("prefix", argv("rm", "a.o", "-rf", "src"), None),
        ("prefix", argv("rm", "a.o", "b.o", "--force"), None),
        ("prefix", argv("rm", "a.o", "--", "b.o"), None),
        ("prefix", argv("rm", "a.obj"), None),
        ("prefix", argv("/bin/rm", "a.o"), None),
        (False, RM_AO, None),
    ],
)
def test_an_allowance_remembered_covers_exactly_what_its_scope_says(
    remember: bool | Remember, later: Op, recalled: Answer | None
) -> None:
    assert remembered(RM_AO, remember=remember).recall(later) == recalled


@pytest.mark.parametrize(
    ("granted", "later", "recalled"),
    [
        (("env",), ("env", "rm", "x"), None),
        (("env",), ("env",), "allow"),
        (("timeout", "60", "make"), ("timeout", "60", "make", "install"), None),
        (("ssh", "devbox"), ("ssh", "devbox", "reboot"), None),
        (("watch", "date"), ("watch", "date", "; rm -rf src"), None),
        (("sh", "-c", "ls"), ("sh", "-c", "ls", "x"), None),
        (("python3", "x.py"), ("python3", "x.py", "y"), None),
        (("make",), ("make", "test"), "allow"),
        (("make",), ("make", "x;rm -rf src"), None),
        (("make",), ("make", "rm"), None),
        (("git", "add"), ("git", "add", "a.txt"), "allow"),
        (("git", "bisect"), ("git", "bisect", "run", "make"), None),
    ],
)
def test_a_prefix_allowance_never_settles_a_command_runners_or_an_argv_the_policy_cannot_see_through(
    granted: tuple[str, ...], later: tuple[str, ...], recalled: Answer | None
) -> None:
    assert remembered(argv(*granted), remember="prefix").recall(argv(*later), frozenset({"rm"})) == recalled


def test_a_prefix_allowance_of_a_command_runner_is_kept_exact_saying_why() -> None:
    assert remembered(argv("timeout", "60", "make"), remember="prefix").remembered == [
        Grant(
            "argv",
            ("timeout", "60", "make"),
            "exact",
            "allow",
            "kept exact, not as a prefix: timeout runs a command given in its arguments",
        )
    ]


def test_a_remembered_prefix_denial_covers_every_extension_even_options() -> None:
    assert remembered(RM_AO, "deny", "prefix").recall(argv("rm", "a.o", "-rf", "src")) == "deny"


def test_a_remembered_exact_denial_covers_only_that_argv() -> None:
    assert remembered(RM_AO, "deny", "exact").recall(argv("rm", "a.o", "b.o")) is None


def test_a_remembered_denial_wins_over_a_remembered_allowance() -> None:
    ledger = remembered(RM_AO, "allow", "prefix")
    ledger.answer(6, ledger.ask(6, argv("rm", "a.o", "b.o")).digest, "deny", "ui", remember="prefix")
    assert ledger.recall(argv("rm", "a.o", "b.o", "c.o")) == "deny"


def test_remember_true_is_kept_as_exact() -> None:
    ledger = Ledger()
    assert ledger.answer(5, ledger.ask(5, RM_AO).digest, "allow", "ui", remember=True) == Decided(
        5, "allow", "ui", "exact"
    )


def test_an_old_record_of_remember_true_replays_as_an_exact_grant() -> None:
    ledger = Ledger()
    ledger.replay(approvals.ASKED, msgspec.json.encode(Asked(5, RM_AO, action_digest(5, RM_AO))))
    ledger.replay(approvals.DECIDED, b'{"action":5,"decision":"allow","by":"ui","remember":true}')
    assert ledger.remembered == [Grant("argv", ("rm", "a.o"), "exact", "allow")]


def test_a_grant_is_shown_as_its_scope_and_argv() -> None:
    assert Grant("argv", ("rm", "a.o"), "prefix", "allow").shown() == Remembered("prefix", argv=["rm", "a.o"])


def test_remember_does_not_reach_another_command() -> None:
    ledger = remembered(argv("make", "test"), remember="prefix")
    assert ledger.recall(argv("make", "install")) is None


def test_remember_of_a_git_call_is_the_git_argv() -> None:
    ledger = remembered(Op(Git=Git(argv=["status"])))
    assert ledger.recall(argv("git", "status")) == "allow"


def test_remember_of_a_write_is_that_path_only_even_as_a_prefix() -> None:
    ledger = remembered(Op(Write=Write(path="a.txt", text="1")), remember="prefix")
    assert ledger.recall(Op(Write=Write(path="a.txt.bak", text="2"))) is None


def test_a_ledger_replayed_from_its_records_is_the_one_lost() -> None:
    ledger = Ledger()
    asked = ledger.ask(5, RM)
    second = ledger.ask(6, Op(Exec=Exec(argv=["ls"])))
    decided = ledger.answer(6, second.digest, "deny", "ui-2")
    again = Ledger()
    again.replay(approvals.ASKED, msgspec.json.encode(asked))
    again.replay(approvals.ASKED, msgspec.json.encode(second))
    again.replay(approvals.DECIDED, msgspec.json.encode(decided))
    assert (again.pending, again.decided) == ({5: asked}, {6: decided})


# -- spend (the counters themselves are the store's: tests/test_store.py) -------------------------------------------


def test_the_ceilings_set_are_checked_the_sessions_own_budget_first_each_on_its_counter() -> None:
    found = [(c.ceiling, c.limit, c.counter) for c in spend.checks(SCOPE, Ceilings(100, None, 300, 50))]
    assert found == [
        ("the session's budget", 50, Counter("session", "s", "")),
        ("tokens_per_turn of agent 'coder'", 100, Counter("turn", "s", "1")),
        ("tokens_per_day of agent 'coder' (UTC day 2026-12-01)", 300, Counter("day", "coder", "2026-12-01")),
    ]


def test_a_refusal_says_which_ceiling_what_is_spent_and_the_limit() -> None:
    refusal = Refusal("the session's budget", 100, 90, 0, 20, "raise it with session/budget")
    assert refusal.message == (
        "spend ceiling reached: the session's budget is 100 tokens, 90 spent, and the next model call needs up to "
        "20; the call was not sent: raise it with session/budget, then session/resume"
    )


def test_the_estimate_is_four_characters_a_token_rounded_up() -> None:
    assert spend.estimate_tokens(b"x" * 9) == 3


# -- trace ---------------------------------------------------------------------------------------------------------


def test_a_trace_record_round_trips_through_its_body_with_its_number() -> None:
    record = trace.TraceRecord(
        action=4, kind="model", started="2026-12-01T09:00:00.000Z", duration_ms=12.5, outcome="error", error="503"
    )
    assert trace.decode(trace.encode(msgspec.structs.replace(record, n=9)), 3) == msgspec.structs.replace(record, n=3)
