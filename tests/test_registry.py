"""The session registry (devd.sessions.registry) in process, wired as the daemon wires it, over every store and the
real core."""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest

from devd.config import Settings
from devd.errors import (
    BusyError,
    ConflictError,
    DeadlineError,
    DevdError,
    HandleError,
    InvalidParamsError,
    MalformedError,
    PoisonError,
    StoreError,
)
from devd.host import Core
from devd.messages import Call, Event, Exec, Output, answer, encode, turn
from devd.server.daemon import build
from devd.server.rpc import encode_notice
from devd.sessions.compaction import snapshot_due
from devd.sessions.entry import STEP_BYTES
from devd.sessions.registry import Registry, made_up_name
from devd.sessions.state import State
from devd.sessions.watchers import Stepped
from devd.storage.memory import MemoryStore
from devd.storage.sqlite import SQLiteStore
from devd.storage.store import Health, Stored
from tests import modules
from tests.helpers import Sink, seed_turn
from tests.stores import opened, running

SEED = seed_turn(1, 1)  # a prompt, an answer with Exec and Read, their two results, a text answer (with Save)
USER = b'{"User":"fix the build"}'
CALLS = (
    b'{"Agent":{"text":"Let me look.","calls":[{"id":2,"call":{"Exec":{"argv":["cargo","build"]}}},'
    b'{"id":3,"call":{"Read":{"path":"src/lib.rs"}}}]}}'
)
RESULTS = b'{"Tool":{"id":2,"text":"error[E0425]","failed":true}},{"Tool":{"id":3,"text":"pub fn f() -> u8 { x }"}}'
SEED_ACTIONS = [
    b'[{"id":1,"op":{"Model":{"messages":[' + USER + b"]}}}]",
    b'[{"id":2,"op":{"Exec":{"argv":["cargo","build"]}}},{"id":3,"op":{"Read":{"path":"src/lib.rs"}}}]',
    b"[]",
    b'[{"id":4,"op":{"Model":{"messages":[' + USER + b"," + CALLS + b"," + RESULTS + b"]}}}]",
    b'[{"id":5,"op":{"Emit":"`x` was never declared."}},{"id":6,"op":{"Save":true}},'
    b'{"id":7,"op":{"Done":{"turn":1,"outcome":{"Complete":true}}}}]',
]
AGAIN = encode(turn(2, "again"))
AGAIN_ACTIONS = (
    b'[{"id":8,"op":{"Model":{"messages":[' + USER + b"," + CALLS + b"," + RESULTS + b","
    b'{"Agent":{"text":"`x` was never declared."}},{"User":"again"}]}}}]'
)
TIMER = b'{"Timer":true}'  # SPIN_ON_TIMER spins on this (14 bytes) until its deadline
CALM = b'{"Timer":false}'  # and answers [] to anything else


_AT = re.compile(rb',"at":"[^"]*"')  # a notice's time, checked where it is the point (tests/test_client.py)


def untimed(lines: list[bytes]) -> list[bytes]:
    return [_AT.sub(b"", line) for line in lines]


def stepped(session: str, seq: int, event: bytes, actions: bytes) -> bytes:
    """The `session/actions` line of a step, without its time."""
    return _AT.sub(b"", encode_notice(Stepped(session, seq, event, actions, 0.0)))


def unwatched(session: bytes, seq: int, reason: bytes) -> bytes:
    return b'{"jsonrpc":"2.0","method":"session/unwatched","params":{"session":"%s","seq":%d,"reason":"%s"}}\n' % (
        session,
        seq,
        reason,
    )


@pytest.fixture(params=["memory", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def registry(kind: str, tmp_path: Path, core: Core) -> AsyncIterator[Registry]:
    async with opened(kind, tmp_path, core) as r:
        yield r


@pytest.fixture(scope="module")
def spin_core() -> Iterator[Core]:
    c = Core.open(modules.SPIN_ON_TIMER)
    yield c
    c.close()


async def steps(registry: Registry, name: str, events: list[bytes]) -> list[bytes]:
    return [(await registry.step(name, e, None, None))[0] for e in events]


async def seeded(registry: Registry, name: str = "src") -> None:
    """A session that ran the seed's whole turn: five steps, the last of which saved a snapshot."""
    await registry.new(name, b"{}")
    await steps(registry, name, SEED)


def states(registry: Registry) -> list[tuple[str, State, int]]:
    return [(i.name, i.state, i.seq) for i in registry.page()[0]]


# -- steps ----------------------------------------------------------------------------------------------------------


async def test_the_seed_turn_answers_the_exact_actions(registry: Registry) -> None:
    await registry.new("s", b"{}")
    assert await steps(registry, "s", SEED) == SEED_ACTIONS


async def test_a_keyed_retry_is_replayed_byte_for_byte_and_not_stepped_again(registry: Registry) -> None:
    await registry.new("s", b"{}")
    first = await registry.step("s", SEED[0], None, "turn-1")
    again = await registry.step("s", SEED[0], None, "turn-1")
    assert (first, again, states(registry)) == (
        (SEED_ACTIONS[0], False, None),
        (SEED_ACTIONS[0], True, None),
        [("s", State.LIVE, 1)],
    )


async def test_a_keyed_retry_that_differs_only_in_layout_is_replayed(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await registry.step("s", b'{"Turn":{"id":1,"prompt":"fix the build"}}', None, "turn-1")
    assert await registry.step("s", b'{ "Turn" : { "prompt":"fix the build", "id":1 } }', None, "turn-1") == (
        SEED_ACTIONS[0],
        True,
        None,
    )


async def test_a_key_reused_with_another_event_is_a_conflict(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await registry.step("s", SEED[0], None, "turn-1")
    with pytest.raises(ConflictError):
        await registry.step("s", AGAIN, None, "turn-1")


async def test_a_malformed_event_is_refused_and_the_session_goes_on(registry: Registry) -> None:
    await registry.new("s", b"{}")
    with pytest.raises(MalformedError):
        await registry.step("s", b'{"Turn":{"id":1}}', None, None)
    assert (await steps(registry, "s", SEED[:1]), states(registry)) == (SEED_ACTIONS[:1], [("s", State.LIVE, 1)])


async def test_a_call_on_a_session_inside_another_call_is_busy(kind: str, tmp_path: Path, spin_core: Core) -> None:
    async with opened(kind, tmp_path, spin_core) as registry:
        await registry.new("spin", b"{}")
        raised: list[type[DevdError]] = []

        async def call(event: bytes, timeout_ms: int | None) -> None:
            try:
                await registry.step("spin", event, timeout_ms, None)
            except DevdError as e:
                raised.append(type(e))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, TIMER, 400)  # past its inline budget it spins on a worker thread until its deadline
            await anyio.sleep(0.1)
            await call(CALM, None)
        assert raised == [BusyError, DeadlineError]


async def test_a_deadline_ends_the_session_until_it_is_recovered(kind: str, tmp_path: Path, spin_core: Core) -> None:
    async with opened(kind, tmp_path, spin_core) as registry:
        await registry.new("spin", b"{}")
        await registry.step("spin", CALM, None, None)
        with pytest.raises(DeadlineError):
            await registry.step("spin", TIMER, 50, None)
        ended = (states(registry), await registry.store.sessions())
        with pytest.raises(HandleError) as refused:
            await registry.step("spin", CALM, None, None)
        await registry.recover("spin")
        stepped = await registry.step("spin", CALM, None, None)
        rows = [(r.name, r.health, r.reason, r.seq) for r in await registry.store.sessions()]
        recovered = (stepped, states(registry), rows)
        assert (ended[0], ended[1][0].health, type(refused.value), recovered) == (
            [("spin", State.ENDED, 1)],
            Health.ENDED,
            HandleError,
            ((b"[]", False, None), [("spin", State.LIVE, 2)], [("spin", Health.OK, None, 2)]),
        )


async def test_a_deadline_says_that_session_recover_brings_the_session_back(
    kind: str, tmp_path: Path, spin_core: Core
) -> None:
    async with opened(kind, tmp_path, spin_core) as registry:
        await registry.new("spin", b"{}")
        with pytest.raises(DeadlineError) as stopped:
            await registry.step("spin", TIMER, 50, None)
        assert str(stopped.value) == (
            "the call ran past its deadline and was stopped; session 'spin' ended: `session/recover` brings it back "
            "from its last step"
        )


async def test_a_deadline_a_client_asks_for_is_cut_to_the_longest_allowed(
    kind: str, tmp_path: Path, spin_core: Core
) -> None:
    async with opened(kind, tmp_path, spin_core, max_call_timeout_s=0.2) as registry:
        await registry.new("spin", b"{}")
        started = time.monotonic()
        with pytest.raises(DeadlineError):
            await registry.step("spin", TIMER, 60_000, None)
        assert time.monotonic() - started < 2


async def test_a_step_the_store_cannot_keep_fails_and_the_next_continues_from_disk(tmp_path: Path, core: Core) -> None:
    store = MemoryStore()
    async with running(store):
        registry, _ = build(Settings(state_dir=tmp_path, socket_path=None), core, store)
        await registry.new("s", b"{}")
        await registry.step("s", SEED[0], None, None)
        store.fail_writes = "disk full"
        with pytest.raises(StoreError, match="disk full"):
            await registry.step("s", SEED[1], None, None)
        after_failure = states(registry)
        store.fail_writes = None
        assert (after_failure, await registry.step("s", SEED[1], None, None), states(registry)) == (
            [("s", State.STORED, 1)],
            (SEED_ACTIONS[1], False, None),
            [("s", State.LIVE, 2)],
        )
        registry.close_all()


# -- close and watchers ---------------------------------------------------------------------------------------------


async def test_close_tells_each_watcher_once_and_frees_the_name(registry: Registry) -> None:
    sink = Sink()
    await registry.new("s", b"{}")
    await registry.watch("s", sink, None)
    await registry.step("s", SEED[0], None, None)
    await registry.close("s")
    await registry.new("s", b"{}")
    await registry.step("s", SEED[0], None, None)
    assert (untimed(sink.lines), states(registry)) == (
        [stepped("s", 1, SEED[0], SEED_ACTIONS[0]), unwatched(b"s", 1, b"closed")],
        [("s", State.LIVE, 1)],
    )


async def test_watch_since_sends_the_journal_then_live_steps_in_order(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await steps(registry, "s", SEED[:3])
    sink = Sink()
    await registry.watch("s", sink, 1)
    await registry.step("s", SEED[3], None, None)
    assert untimed(sink.lines) == [stepped("s", n + 1, SEED[n], SEED_ACTIONS[n]) for n in (1, 2, 3)]


async def test_a_watcher_catching_up_while_steps_are_taken_misses_none_and_gets_none_twice(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await steps(registry, "s", [b'{"Timer":true}'] * 5)
    sink = Sink()

    async def more() -> None:
        await steps(registry, "s", [b'{"Timer":true}'] * 20)

    async with anyio.create_task_group() as tg:
        tg.start_soon(more)
        await registry.watch("s", sink, 0)
    assert [msgspec.json.decode(line)["params"]["seq"] for line in sink.lines] == list(range(1, 26))


async def test_a_watcher_that_refuses_a_notice_gets_one_unwatched_and_nothing_after(registry: Registry) -> None:
    sink = Sink(refuses=True)
    await registry.new("s", b"{}")
    await registry.watch("s", sink, None)
    await steps(registry, "s", SEED[:3])
    assert (sink.lines, [i.watchers for i in registry.page()[0]]) == (
        [unwatched(b"s", 0, b"fell too far behind")],
        [0],
    )


# -- forks ------------------------------------------------------------------------------------------------------------


async def test_a_fork_at_the_latest_step_continues_exactly_as_its_source(registry: Registry) -> None:
    await seeded(registry)
    await registry.fork("src", None, "f")
    assert [await steps(registry, name, [AGAIN]) for name in ("src", "f")] == [[AGAIN_ACTIONS], [AGAIN_ACTIONS]]


async def test_a_fork_at_an_earlier_step_replays_from_there(registry: Registry) -> None:
    await seeded(registry)
    await registry.fork("src", 3, "early")
    assert await steps(registry, "early", SEED[3:]) == SEED_ACTIONS[3:]


async def test_a_fork_leaves_its_source_where_it_was(registry: Registry) -> None:
    await seeded(registry)
    await registry.fork("src", 3, "early")
    stored = await registry.store.load("src")
    assert (states(registry), stored.seq if stored else None, await steps(registry, "src", [AGAIN])) == (
        [("early", State.LIVE, 3), ("src", State.LIVE, 5)],
        5,
        [AGAIN_ACTIONS],
    )


async def test_a_fork_answers_the_source_keys_up_to_its_step_as_replays(registry: Registry) -> None:
    await registry.new("src", b"{}")
    await registry.step("src", SEED[0], None, "turn-1")
    await registry.step("src", SEED[1], None, "answer-1")
    await registry.fork("src", 1, "f")
    assert [await registry.step("f", SEED[0], None, "turn-1"), await registry.step("f", SEED[1], None, "answer-1")] == [
        (SEED_ACTIONS[0], True, None),
        (SEED_ACTIONS[1], False, None),
    ]


async def test_a_fork_of_an_unknown_session_is_a_handle_error(registry: Registry) -> None:
    with pytest.raises(HandleError) as refused:
        await registry.fork("nobody", None, "f")
    assert (type(refused.value), states(registry)) == (HandleError, [])


async def test_a_fork_past_the_last_step_is_invalid_params(registry: Registry) -> None:
    await seeded(registry)
    with pytest.raises(InvalidParamsError) as refused:
        await registry.fork("src", 6, "f")
    assert (str(refused.value), states(registry)) == (
        "session 'src' has answered 5 steps; fork at 5 or earlier",
        [("src", State.LIVE, 5)],
    )


# -- rebuilding from durable state ----------------------------------------------------------------------------------


async def test_a_registry_rebuilt_over_the_same_file_lists_its_sessions_and_continues_them(
    tmp_path: Path, core: Core
) -> None:
    async with opened("sqlite", tmp_path, core) as before:
        await seeded(before, "saved")  # rebuilt from its snapshot
        await before.new("journalled", b"{}")  # rebuilt from its config and journal
        await before.step("journalled", SEED[0], None, "turn-1")
        await steps(before, "journalled", SEED[1:3])
    async with opened("sqlite", tmp_path, core) as after:
        await after.load()
        listed = [(i.name, i.state, i.seq, i.watchers, i.reason) for i in after.page()[0]]
        assert (
            listed,
            await steps(after, "saved", [AGAIN]),
            await steps(after, "journalled", [SEED[3]]),
            await after.step("journalled", SEED[0], None, "turn-1"),
        ) == (
            [("journalled", State.STORED, 3, 0, None), ("saved", State.STORED, 5, 0, None)],
            [AGAIN_ACTIONS],
            [SEED_ACTIONS[3]],
            (SEED_ACTIONS[0], True, None),
        )


async def test_an_ended_session_is_still_ended_after_a_rebuild(tmp_path: Path, spin_core: Core) -> None:
    async with opened("sqlite", tmp_path, spin_core) as before:
        await before.new("spin", b"{}")
        with pytest.raises(DeadlineError):
            await before.step("spin", TIMER, 30, None)
    async with opened("sqlite", tmp_path, spin_core) as after:
        await after.load()
        listed = states(after)
        await after.recover("spin")
        assert (listed, await after.step("spin", CALM, None, None)) == (
            [("spin", State.ENDED, 0)],
            (b"[]", False, None),
        )


# -- long sessions: what a step writes, and what a rebuild replays -------------------------------------------------

LONG = encode(turn(1, "p" * 2000))  # a turn cancelled at once: the transcript is now longer than any event after it
CANCEL = b'{"Cancel":{"turn":1}}'
SEED_2 = seed_turn(2, 4)  # the seed's turn again, after LONG's ask (1), Save (2) and Done (3)


async def test_an_answer_as_large_as_the_transcript_is_journalled_as_its_digest(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await steps(registry, "s", [LONG, CANCEL, *SEED_2])
    rows = await registry.store.steps_since("s", 0, 100)
    assert [r.actions is None for r in rows] == [False, False, True, False, False, True, False]


async def test_a_watcher_since_0_gets_every_answer_as_given_even_those_kept_as_digests(registry: Registry) -> None:
    await registry.new("s", b"{}")
    events = [LONG, CANCEL, *SEED_2]
    answers = await steps(registry, "s", events)
    sink = Sink()
    await registry.watch("s", sink, 0)
    assert untimed(sink.lines) == [stepped("s", n + 1, events[n], answers[n]) for n in range(len(events))]


async def test_a_keyed_retry_of_a_step_kept_as_a_digest_answers_the_same_bytes(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await steps(registry, "s", [LONG, CANCEL])
    asked = await registry.step("s", SEED_2[0], None, "turn-2")
    await steps(registry, "s", SEED_2[1:])
    assert await registry.step("s", SEED_2[0], None, "turn-2") == (asked[0], True, None)


async def test_a_session_rebuilt_from_digests_answers_as_if_it_never_stopped(
    kind: str, tmp_path: Path, core: Core
) -> None:
    events = [LONG, CANCEL, *SEED_2]
    # No inline budget to pass (a busy machine could make a call pass 2 ms): the one rebuild is the wake.
    async with opened(kind, tmp_path, core, max_live=1, inline_budget_s=60.0) as registry:
        await registry.new("s", b"{}")
        await steps(registry, "s", events[:-2])
        await registry.new("twin", b"{}")  # s hibernates: its next call rebuilds it from the journal
        twin = await steps(registry, "twin", events)
        assert (await steps(registry, "s", events[-2:]), registry.statistics().rebuilt) == (twin[-2:], 1)


async def test_a_session_whose_call_passed_the_budget_runs_the_next_on_a_worker_without_a_rebuild(
    tmp_path: Path, core: Core
) -> None:
    async with opened("memory", tmp_path, core, inline_budget_s=1e-9) as registry:
        await registry.new("s", b"{}")
        # Offloaded: the start, the first step (stopped inline, then rebuilt), the second (on a worker at once).
        await steps(registry, "s", SEED[:2])
        assert (registry.statistics().offloaded, registry.statistics().rebuilt) == (3, 1)


@pytest.mark.parametrize(
    ("since", "snapshot", "actions", "due"),
    [
        (64 << 10, 0, b'[{"id":6,"op":{"Save":true}}]', True),  # the floor reached, at a Save
        (64 << 10, 0, b"[]", False),  # the floor reached, mid-turn: wait for a Save
        (128 << 10, 0, b"[]", True),  # twice the floor, mid-turn: now
        (1 << 19, 4 << 20, b'[{"id":6,"op":{"Save":true}}]', False),  # an eighth of a 4 MiB snapshot: cheap to replay
        (1 << 20, 4 << 20, b'[{"id":6,"op":{"Save":true}}]', True),  # a quarter of it, at a Save
        (1 << 20, 4 << 20, b"[]", False),  # a quarter of it, mid-turn: wait for a Save
        (2 << 20, 4 << 20, b"[]", True),  # half of it, mid-turn: now
    ],
)
def test_a_snapshot_is_due_when_the_journal_since_the_last_outgrows_a_fraction_of_it(
    since: int, snapshot: int, actions: bytes, due: bool
) -> None:
    assert snapshot_due(since, snapshot, 64 << 10, actions) is due


async def test_a_core_that_cannot_snapshot_steps_on_past_any_snapshot_threshold(tmp_path: Path) -> None:
    core = Core.open(modules.SPIN_ON_TIMER)
    try:
        async with opened("memory", tmp_path, core, snapshot_floor_bytes=0) as registry:
            await registry.new("s", b"{}")
            assert await steps(registry, "s", [CALM] * 3) == [b"[]"] * 3
    finally:
        core.close()


async def test_past_the_live_memory_budget_the_least_recently_used_idle_sessions_hibernate(
    tmp_path: Path, core: Core
) -> None:
    # A fresh instance holds 512 KiB; a budget of two and a half holds two of them, so a third hibernates the oldest.
    async with opened("memory", tmp_path, core, live_memory_bytes=(5 << 20) // 4) as registry:
        for name in ("a", "b", "c"):
            await registry.new(name, b"{}")
        live = [i.name for i in registry.page()[0] if i.state is State.LIVE]
        assert (live, registry.memory, registry.statistics().hibernated) == (["b", "c"], 1 << 20, 1)


async def test_a_session_that_grows_past_the_budget_hibernates_the_others_not_itself(
    tmp_path: Path, core: Core
) -> None:
    async with opened("memory", tmp_path, core, live_memory_bytes=1 << 20) as registry:
        await registry.new("a", b"{}")
        await registry.new("b", b"{}")
        await registry.step("b", encode(turn(1, "x" * 100_000)), None, None)  # b grows to 1.2 MiB
        live = [i.name for i in registry.page()[0] if i.state is State.LIVE]
        assert (live, registry.statistics().hibernated) == (["b"], 1)


async def test_a_heavy_session_runs_inline_again_after_sixteen_quick_calls_in_a_row(tmp_path: Path, core: Core) -> None:
    async with opened("memory", tmp_path, core, inline_budget_s=1e-9) as registry:
        await registry.new("s", b"{}")
        await registry.step("s", TIMER, None, None)  # stopped inline, rebuilt: the session is heavy
        registry.runner.inline_budget_s = 60.0  # from now on every call is quick
        await steps(registry, "s", [TIMER] * 17)
        # Offloaded: the start and the first step, then 16 quick calls on a worker; the 17th ran inline.
        assert registry.statistics().offloaded == 2 + 16


async def test_a_keyed_retry_of_a_large_kept_answer_answers_the_same_bytes(registry: Registry) -> None:
    await registry.new("s", b"{}")
    await registry.step("s", encode(turn(1, "x")), None, None)
    text = encode(answer(1, "y" * 100_000))  # its Emit is as large as it: kept whole, read off the event loop
    first = await registry.step("s", text, None, "big")
    assert await registry.step("s", text, None, "big") == (first[0], True, None)


async def test_a_woken_session_with_a_long_transcript_runs_its_calls_on_a_worker_from_the_start(
    tmp_path: Path, core: Core
) -> None:
    async with opened("memory", tmp_path, core, max_live=1) as registry:
        await registry.new("s", b"{}")
        await steps(registry, "s", [encode(turn(1, "p" * (4 << 20))), CANCEL])  # an instance of over 8 MiB
        await registry.new("t", b"{}")  # s hibernates
        rebuilt, offloaded = registry.statistics().rebuilt, registry.statistics().offloaded
        await registry.step("s", encode(turn(2, "again")), None, None)  # a 4 MiB ask: far past the inline budget
        # One rebuild (the wake), then the step on a worker: not stopped inline and rebuilt a second time.
        assert (registry.statistics().rebuilt - rebuilt, registry.statistics().offloaded - offloaded) == (1, 1)


async def test_a_snapshot_of_a_large_session_is_taken_on_a_worker_and_leaves_its_calls_inline(
    tmp_path: Path, core: Core
) -> None:
    async with opened("memory", tmp_path, core, inline_budget_s=60.0, snapshot_floor_bytes=0) as registry:
        await registry.new("s", b'{"asks":"delta"}')
        await registry.step("s", encode(turn(1, "p" * (4 << 20))), None, None)  # over 4 MiB, snapshotted inline
        before = registry.statistics().offloaded
        done = encode(answer(1, "d" * (5 << 18)))  # past a quarter of that snapshot, then Save: another is due
        await registry.step("s", done, None, None)
        saved = registry.statistics().offloaded
        await registry.step("s", encode(turn(2, "next")), None, None)  # a small ask: inline again
        assert (saved - before, registry.statistics().offloaded - saved) == (1, 0)


async def test_the_first_step_after_a_restart_that_takes_a_snapshot_runs_on_a_worker(
    tmp_path: Path, core: Core
) -> None:
    async with opened("sqlite", tmp_path, core, inline_budget_s=60.0) as registry:
        await registry.new("s", b'{"asks":"delta"}')
        await registry.step("s", encode(turn(1, "p" * (3 << 19))), None, None)  # 1.5 MiB: snapshotted at once
        await registry.step("s", encode(answer(1, calls=[Call(Exec=Exec(argv=["make"]))])), None, None)
        # Past a quarter of the snapshot, and no Save: the next Save takes one.
        await registry.step("s", encode(Event(Exec=Output(id=2, text="o" * (400 << 10)))), None, None)
    async with opened("sqlite", tmp_path, core, inline_budget_s=60.0) as registry:
        await registry.load()
        # Rebuilt (an instance of 4 to 8 MiB: not heavy), then a Save, and the snapshot the journal read back makes due.
        await registry.step("s", encode(answer(3, "done")), None, None)
        assert (registry.statistics().offloaded, registry.statistics().rebuilt) == (1, 1)


async def test_a_journal_this_core_did_not_write_is_refused_when_the_session_is_rebuilt(
    tmp_path: Path, core: Core
) -> None:
    async with opened("sqlite", tmp_path, core) as registry:
        await registry.new("s", b"{}")
        await steps(registry, "s", [encode(turn(1, "p" * 2000)), encode(answer(1, "done"))])
        await registry.step("s", encode(turn(2, "again")), None, None)  # an ask kept as its digest: checked last
    db = sqlite3.connect(tmp_path / "devd.sqlite3")
    with db:
        db.execute("UPDATE journal SET actions = CAST('[]' AS BLOB) WHERE session = 's' AND seq = 2")
    db.close()
    async with opened("sqlite", tmp_path, core) as registry:
        await registry.load()
        with pytest.raises(PoisonError, match="replaying step 2 gave other actions than were answered"):
            await registry.step("s", CANCEL, None, None)


class _ClosedWhileRead(SQLiteStore):
    """The real store, whose session is closed just as a watcher's catch-up reads the state it derives answers from
    (the race the soak found: a close between two reads of one catch-up)."""

    closing: Registry | None = None

    async def load_at(self, name: str, at: int) -> Stored | None:
        if self.closing is not None:
            registry, self.closing = self.closing, None
            await registry.close(name)
        return await super().load_at(name, at)


async def test_a_watch_whose_session_is_closed_during_its_catch_up_is_told_no_such_session(
    tmp_path: Path, core: Core
) -> None:
    settings = Settings(state_dir=tmp_path, socket_path=None)
    store = _ClosedWhileRead(tmp_path / "devd.sqlite3", keys_kept=1000, steps_kept=1000, prune_every_steps=256)
    async with running(store):
        registry, _ = build(settings, core, store)
        await registry.new("s", b"{}")
        prompt = encode(turn(1, "p" * 2000))  # the asks after it carry 2 KB: kept as digests, derived on catch-up
        await steps(registry, "s", [prompt, encode(answer(1, calls=[Call(Exec=Exec(argv=["make"]))]))])
        await registry.step("s", encode(Event(Exec=Output(id=2, text="ok"))), None, None)
        store.closing = registry
        with pytest.raises(HandleError, match="^no session is named 's'"):
            await registry.watch("s", Sink(), 0)
        registry.close_all()


async def test_a_stop_whose_time_runs_out_mid_snapshot_leaves_the_session_free(tmp_path: Path, core: Core) -> None:
    async with opened("memory", tmp_path, core) as registry:
        await registry.new("s", b"{}")
        await registry.step("s", encode(turn(1, "p" * (5 << 20))), None, None)  # large (snapshotted on a worker)
        await registry.step("s", encode(turn(2, "q" * 20_000)), None, None)  # queued: 20 KB since that snapshot
        with anyio.CancelScope() as scope:
            scope.cancel()  # the stop's time is up at its first wait
            await registry.save_all()
        assert await registry.step("s", b'{"Timer":true}', None, None) == (b"[]", False, None)


async def test_a_keyed_retry_spelled_otherwise_derives_the_answer_from_the_event_as_journalled(
    registry: Registry,
) -> None:
    await registry.new("s", b"{}")
    await steps(registry, "s", [LONG, CANCEL])
    asked = await registry.step("s", b'{"Turn":{"id":2,"prompt":"again"}}', None, "t2")  # a Model ask: a digest
    # The same event for keys (the last of a repeated member counts), though the core would refuse these bytes.
    again = await registry.step("s", b'{"Turn":{"id":2,"prompt":"x","prompt":"again"}}', None, "t2")
    assert again == (asked.actions, True, None)


async def test_a_session_reopened_counts_its_journal_since_the_snapshot_and_each_step_after(
    tmp_path: Path, core: Core
) -> None:
    async with opened("sqlite", tmp_path, core) as registry:
        await registry.new("s", b"{}")
        await steps(registry, "s", SEED)
    async with opened("sqlite", tmp_path, core) as registry:
        await registry.load()
        await registry.step("s", AGAIN, None, None)  # rebuilt from disk, then stepped
        stored = await registry.store.load("s")
        assert stored is not None
        expected = sum(len(row.event) + STEP_BYTES for row in stored.journal)
        assert registry.get("s").since_bytes == expected


async def test_a_quick_call_that_missed_its_budget_does_not_wait_behind_slow_calls_filling_the_workers(
    tmp_path: Path, spin_core: Core
) -> None:
    """Two heavy sessions' calls spin on both worker threads until their deadline; a light session's call, stopped
    inline (as contention can make any call miss 2 ms), is answered before either ends."""
    answered: list[str] = []
    async with opened("memory", tmp_path, spin_core, inline_budget_s=1e-9, call_threads_max=2) as registry:
        for name in ("slow1", "slow2", "fast"):
            await registry.new(name, b"{}")
        for name in ("slow1", "slow2"):
            await registry.step(name, CALM, None, None)  # stopped inline and rebuilt: heavy from now on

        async def call(name: str, event: bytes, timeout_ms: int) -> None:
            with contextlib.suppress(DeadlineError):
                await registry.step(name, event, timeout_ms, None)
            answered.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "slow1", TIMER, 2000)
            tg.start_soon(call, "slow2", TIMER, 2000)
            await anyio.sleep(0.2)  # both workers spin
            tg.start_soon(call, "fast", CALM, 5000)
    assert answered[0] == "fast"


@pytest.mark.parametrize("lane", ["heavy", "rebuilt"])
async def test_a_call_that_waits_for_a_worker_longer_than_its_deadline_still_runs(
    tmp_path: Path, spin_core: Core, lane: str
) -> None:
    """A loaded daemon makes a call wait for a worker thread; the wait is not the call's time. One session spins on
    the only worker for a second; another's call, of a 0.3 s deadline, queued behind it (a heavy session's, or one
    stopped inline and to be rebuilt), is answered: it ended its session as DEADLINE without having run."""
    threads = {"call_threads_max": 1} if lane == "heavy" else {"quick_threads_max": 1}
    async with opened("memory", tmp_path, spin_core, inline_budget_s=1e-9, **threads) as registry:
        await registry.new("slow", b"{}")
        await registry.new("waits", b"{}")
        await registry.step("slow", CALM, None, None)  # stopped inline and rebuilt: heavy, on the worker from now on
        if lane == "heavy":
            await registry.step("waits", CALM, None, None)
        else:  # a spin that holds the quick lane's one thread: a start of a session stopped inline goes there
            registry.get("slow").heavy = False
            registry.runner.inline_budget_s = 1e-9

        async def spin() -> None:
            with contextlib.suppress(DeadlineError):
                await registry.step("slow", TIMER, 1000, None)

        async with anyio.create_task_group() as tg:
            tg.start_soon(spin)
            await anyio.sleep(0.1)  # the worker spins
            answer = await registry.step("waits", CALM, 300, None)
    assert answer[0] == b"[]"


async def most_live_while_eight_sessions_step_at_once(registry: Registry) -> int:
    """Make eight sessions (each new one hibernates the oldest past max_live), step them all at once, and return the
    most instances live or being rebuilt at any point meanwhile."""
    names = [f"s{n}" for n in range(8)]
    for name in names:
        await registry.new(name, b"{}")
    most = 0

    async def watch_live() -> None:
        nonlocal most
        while True:
            most = max(most, len(registry.residency.names()) + registry.residency.waking)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_live)
        async with anyio.create_task_group() as steps:
            for name in names:
                steps.start_soon(registry.step, name, encode(turn(1, "x")), None, None)
        tg.cancel_scope.cancel()
    return most


async def test_concurrent_wakes_never_hold_more_instances_than_max_live(tmp_path: Path, core: Core) -> None:
    async with opened("sqlite", tmp_path, core, max_live=2) as registry:
        most = await most_live_while_eight_sessions_step_at_once(registry)
    assert most <= 2


def test_a_made_up_name_never_starts_with_a_dash_which_a_command_line_takes_for_a_flag() -> None:
    # One name in 64 started so; of 2,000 names, none does.
    assert [n for n in (made_up_name() for _ in range(2000)) if n.startswith("-") or len(n) != 22] == []


async def test_calls_stopped_at_their_inline_budget_are_rebuilt_within_max_live(tmp_path: Path, core: Core) -> None:
    """A call stopped inline drops its instance and rebuilds it on a worker. That rebuild held no room: a wake took
    the room meanwhile, and the rebuilt instance was attached beside live sessions all inside calls (3 of 2; CI saw
    it once under load, where the 2 ms budget is missed)."""
    async with opened("sqlite", tmp_path, core, max_live=2, inline_budget_s=1e-9) as registry:
        most = await most_live_while_eight_sessions_step_at_once(registry)
    assert most <= 2
