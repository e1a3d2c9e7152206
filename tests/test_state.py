"""The session lifecycle table (devd.sessions.state), walked pair by pair."""

from __future__ import annotations

import pytest

from devd.errors import InternalError
from devd.sessions.state import CALLABLE, TRANSITIONS, Input, State, next_state

S, In = State, Input

# The lifecycle as the module's docstring draws it, written out by hand.
DRAWN = {
    (S.STORED, In.LOAD): S.LIVE,
    (S.LIVE, In.DROP): S.STORED,
    (S.LIVE, In.END): S.ENDED,
    (S.STORED, In.END): S.ENDED,
    (S.LIVE, In.POISON): S.POISONED,
    (S.STORED, In.POISON): S.POISONED,
    (S.ENDED, In.POISON): S.POISONED,
    (S.POISONED, In.POISON): S.POISONED,
    (S.LIVE, In.RECOVER): S.LIVE,
    (S.STORED, In.RECOVER): S.LIVE,
    (S.ENDED, In.RECOVER): S.LIVE,
    (S.POISONED, In.RECOVER): S.LIVE,
    (S.LIVE, In.CLOSE): S.CLOSED,
    (S.STORED, In.CLOSE): S.CLOSED,
    (S.ENDED, In.CLOSE): S.CLOSED,
    (S.POISONED, In.CLOSE): S.CLOSED,
}
REFUSED = [(s, i) for s in State for i in Input if (s, i) not in TRANSITIONS]
OPEN = [s for s in State if s is not S.CLOSED]


def test_the_table_is_the_lifecycle_the_module_draws() -> None:
    assert TRANSITIONS == DRAWN


@pytest.mark.parametrize(("state", "input"), REFUSED)
def test_a_pair_not_in_the_table_is_an_internal_error(state: State, input: Input) -> None:
    with pytest.raises(InternalError) as refused:
        next_state(state, input)
    assert (type(refused.value), str(refused.value)) == (
        InternalError,
        f"a session cannot {input.value} while {state.value}",
    )


@pytest.mark.parametrize(("pair", "after"), list(TRANSITIONS.items()))
def test_a_pair_in_the_table_moves_to_the_listed_state(pair: tuple[State, Input], after: State) -> None:
    assert next_state(*pair) is after


def test_closed_has_no_way_out() -> None:
    assert [i for i in Input if (S.CLOSED, i) in TRANSITIONS] == []


@pytest.mark.parametrize("state", OPEN)
def test_every_state_but_closed_can_be_closed_and_recovered(state: State) -> None:
    assert (next_state(state, In.CLOSE), next_state(state, In.RECOVER)) == (S.CLOSED, S.LIVE)


def test_only_live_and_stored_sessions_take_calls() -> None:
    assert CALLABLE == {S.LIVE, S.STORED}
