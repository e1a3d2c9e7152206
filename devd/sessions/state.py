"""A session's lifecycle as an explicit state machine: the states, the inputs, one table, one function.

    STORED --load--> LIVE --drop--> STORED         an instance is built from durable state, or let go of
    LIVE|STORED --end--> ENDED                      a deadline passed, or the answer was lost
    LIVE|STORED|ENDED|POISONED --poison--> POISONED a trap, or rebuilding from durable state failed
    any but CLOSED --recover--> LIVE                rebuilt from durable state on request
    any but CLOSED --close--> CLOSED                deleted, for good

Whether a session is inside a call is not a state: it is the registry's `busy` flag, orthogonal to all of these.
"""

from __future__ import annotations

import enum

from devd.errors import InternalError


class State(enum.Enum):
    LIVE = "live"  # its instance is in memory
    STORED = "stored"  # durable only; its next call rebuilds the instance
    ENDED = "ended"  # its deadline passed or its answer was lost; only recover, close (and reads) work
    POISONED = "poisoned"  # it trapped or could not be rebuilt; only recover, close (and reads) work
    CLOSED = "closed"


class Input(enum.Enum):
    LOAD = "load"
    DROP = "drop"
    END = "end"
    POISON = "poison"
    RECOVER = "recover"
    CLOSE = "close"


S, In = State, Input
TRANSITIONS: dict[tuple[State, Input], State] = {
    (S.STORED, In.LOAD): S.LIVE,
    (S.LIVE, In.DROP): S.STORED,
    (S.LIVE, In.END): S.ENDED,
    (S.STORED, In.END): S.ENDED,
    **{(s, In.POISON): S.POISONED for s in (S.LIVE, S.STORED, S.ENDED, S.POISONED)},
    **{(s, In.RECOVER): S.LIVE for s in (S.LIVE, S.STORED, S.ENDED, S.POISONED)},
    **{(s, In.CLOSE): S.CLOSED for s in (S.LIVE, S.STORED, S.ENDED, S.POISONED)},
}

CALLABLE = frozenset({S.LIVE, S.STORED})  # states in which a session takes steps, snapshots and pending


def next_state(state: State, input: Input) -> State:
    """The state after `input`; an input the table does not allow is a bug in the registry, not a client error."""
    try:
        return TRANSITIONS[state, input]
    except KeyError:
        raise InternalError(f"a session cannot {input.value} while {state.value}") from None
