"""The registry when calls overlap: expiry, fork, close, rebuilds and deadlines meeting, in process (real core, real
SQLite). Each test is the reproduction of a defect an independent review found."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from devd import errors, failpoints
from devd.host import Core
from devd.messages import encode, turn
from devd.sessions.registry import Registry
from devd.sessions.state import State
from devd.storage.store import Step
from tests import modules
from tests.helpers import Sink
from tests.stores import opened

TIMER = b'{"Timer":true}'


async def outcome(call: object) -> object:
    try:
        return await call  # type: ignore[misc]
    except errors.DevdError as e:
        return type(e)


def states(registry: Registry) -> list[tuple[str, State, int]]:
    return [(i.name, i.state, i.seq) for i in registry.page()[0]]


async def test_expiry_racing_closes_deletes_each_session_once(tmp_path: Path, core: Core) -> None:
    async with opened("sqlite", tmp_path, core) as registry:
        names = [f"s{n:03}" for n in range(40)]
        for name in names:
            await registry.new(name, b"{}")
        closed: list[object] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(registry.expire, 0.0)
            for name in reversed(names):
                tg.start_soon(lambda n=name: _collect(closed, registry.close(n)))
        expired = registry.statistics().expired
        assert (states(registry), await registry.store.sessions(), expired + closed.count(None)) == (
            [],
            [],
            40,
        )


async def _collect(into: list[object], call: object) -> None:
    result = await outcome(call)
    into.append(result if result is not None else None)


async def test_expiry_skips_a_session_inside_a_call(tmp_path: Path, core: Core) -> None:
    async with opened("sqlite", tmp_path, core, max_live=1) as registry:
        await registry.new("b", b"{}")
        await registry.new("a", b"{}")  # b hibernates: its next step rebuilds it, awaiting a worker thread
        results: dict[str, object] = {}

        async def step() -> None:
            results["step"] = await outcome(registry.step("b", encode(turn(1, "x")), None, None))

        async with anyio.create_task_group() as tg:
            tg.start_soon(step)
            await anyio.sleep(0)
            results["expired"] = await registry.expire(0.0)
        assert (results["expired"], results["step"][1], [n for n, _, _ in states(registry)]) == (  # type: ignore[index]
            ["a"],
            False,
            ["b"],
        )


async def test_a_fork_racing_a_close_of_its_source_is_stored_whenever_it_is_answered(
    tmp_path: Path, core: Core
) -> None:
    async with opened("sqlite", tmp_path, core) as registry:
        await registry.new("src", b"{}")
        await registry.step("src", encode(turn(1, "x")), None, None)
        results: dict[str, object] = {}

        async def run(key: str, call: object) -> None:
            results[key] = await outcome(call)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "fork", registry.fork("src", None, "copy"))
            tg.start_soon(run, "close", registry.close("src"))
        on_disk = [r.name for r in await registry.store.sessions()]
        assert (results, on_disk) == ({"fork": "copy", "close": errors.BusyError}, ["copy", "src"])


async def test_a_short_deadline_on_a_hibernated_session_is_not_spent_rebuilding_it(tmp_path: Path, core: Core) -> None:
    async with opened("sqlite", tmp_path, core, max_live=1) as registry:
        await registry.new("long", b"{}")
        for t in range(1, 301):  # a journal long enough that rebuilding takes longer than the step's deadline
            await registry.step("long", encode(turn(t, "x")), None, None)
            await registry.step("long", encode({"Cancel": {"turn": t}}), None, None)  # type: ignore[arg-type]
        await registry.new("other", b"{}")  # long hibernates
        actions, replayed, _ = await registry.step("long", encode(turn(301, "again")), 1, None)
        assert (actions.startswith(b'[{"id":'), replayed, states(registry)[0]) == (
            True,
            False,
            ("long", State.LIVE, 601),
        )


@pytest.fixture(scope="module")
def spin_core() -> Iterator[Core]:
    c = Core.open(modules.SPIN_ON_TIMER, call_timeout=0.3)
    yield c
    c.close()


async def test_a_rebuild_that_runs_past_its_deadline_ends_the_session_rather_than_poisoning_it(
    tmp_path: Path, spin_core: Core
) -> None:
    async with opened("sqlite", tmp_path, spin_core, call_timeout_s=0.3, max_live=1) as registry:
        await registry.new("s", b"{}")
        await registry.store.append(Step("s", 1, TIMER, b"[]"))  # replaying it spins
        registry.get("s").seq = 1  # type: ignore[union-attr]
        await registry.new("other", b"{}")  # s hibernates
        with pytest.raises(errors.DeadlineError):
            await registry.step("s", b"{}", None, None)
        assert (states(registry)[1], [r.health.value for r in await registry.store.sessions()]) == (
            ("s", State.ENDED, 1),
            ["ok", "ended"],
        )


async def test_a_failed_fsync_while_pruning_is_healed_by_a_reopen_before_the_next_acknowledgement(
    tmp_path: Path, core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(failpoints._POINTS, "prune", ("eio", 1))
    async with opened("sqlite", tmp_path, core, prune_every_steps=1, snapshot_floor_bytes=0) as registry:
        await registry.new("s", b"{}")
        await registry.step("s", encode(turn(1, "x")), None, None)  # its snapshot (no floor) prunes, which fails
        await registry.new("t", b"{}")  # the store reopened the database first
        assert registry.store.reopened == 1


async def test_watching_since_a_step_no_longer_kept_is_invalid_params_naming_the_oldest(
    tmp_path: Path, core: Core
) -> None:
    async with opened(
        "sqlite", tmp_path, core, steps_kept_per_session=2, prune_every_steps=1, snapshot_floor_bytes=0
    ) as registry:
        await registry.new("s", b"{}")
        for t in range(1, 4):
            await registry.step("s", encode(turn(t, "x")), None, None)
            await registry.step("s", encode({"Cancel": {"turn": t}}), None, None)  # type: ignore[arg-type]
        # Two steps are promised behind the latest snapshot (at 6); the snapshot at 4 derives them, and stays. The
        # pruning a commit calls for runs after it: wait for it (a loaded CI run watched before the last one ran).
        await registry.store.flush()
        with pytest.raises(errors.InvalidParamsError, match="before step 4 is no longer kept; watch since 3 or later"):
            await registry.watch("s", Sink(), 0)
        sink = Sink()
        await registry.watch("s", sink, 3)
        assert len(sink.lines) == 3


async def test_watching_since_a_step_not_yet_taken_is_invalid_params(tmp_path: Path, core: Core) -> None:
    async with opened("memory", tmp_path, core) as registry:
        await registry.new("s", b"{}")
        with pytest.raises(errors.InvalidParamsError, match="has answered 0 steps; watch since 0 or earlier"):
            await registry.watch("s", Sink(), 7)
