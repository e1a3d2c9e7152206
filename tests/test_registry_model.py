"""A model-based stateful test of the session registry (shared/RELIABILITY.md, R5).

A hypothesis `RuleBasedStateMachine` drives a real `Registry` (wired by `devd.server.daemon.build`, `max_live` 3 so
sessions
hibernate) over a real `SQLiteStore` in a directory of its own, on the real packaged core, with the store's `run()`
going on an asyncio loop in a blocking portal. Beside it runs a reference model written here: for each session its
origin (a config or a snapshot), the events it answered, their answers and its keys, and an `Instance` of its own on
a second `Core`. The model's expected answers come from that instance only, never from the registry.

Rules: new (chosen names collide: EXISTS; or random ones), bursts of steps (keyed or not) with events aimed at what
the session waits for, whole turns, a keyed retry (same key, same event, maybe in another layout), a keyed conflict
(same key, another event), a step past its deadline (the session ends until recovered), snapshot, restore (from a
snapshot taken earlier; also damaged or not base64), fork (at the latest step, an earlier one, before the source's own
fork point, or past the last; optionally probed by forking the fork again), pending, recover, close, list by pages,
calls on unknown names, and restart (registry and store closed, the same file opened again, `load()`).

Invariants, after every rule: the registry lists exactly the model's names, seqs, standing (callable or ended) and
reasons, with at most `max_live` instances; the store lists the same names, seqs, health and reasons; its journal
holds exactly the model's events and answers; every kept key answers the model's seq and actions; every live session's
pending is the model instance's pending. The rules check the rest as they go: every step is answered the model
instance's bytes, a keyed retry the first answer's bytes, a snapshot the model instance's snapshot, a session a call
has just used is live, a fork continues as its source would have from the step it was taken at, and after a restart
every session is stored (or still ended) and continues where it was.

`DEVD_FUZZ=long` runs 500 random (not derandomized) examples of 60 steps (about two minutes).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as tally
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from devd.config import Settings
from devd.errors import (
    ConflictError,
    DeadlineError,
    DevdError,
    ExistsError,
    HandleError,
    InvalidParamsError,
    MalformedError,
)
from devd.host import Core, Instance
from devd.messages import (
    Call,
    Cancel,
    Event,
    Exec,
    Output,
    Read,
    answer,
    decode_actions,
    encode,
    turn,
)
from devd.server.daemon import build
from devd.sessions.compaction import kept_answer
from devd.sessions.entry import Info
from devd.sessions.registry import Registry
from devd.sessions.state import State
from devd.storage.memory import MemoryStore
from devd.storage.sqlite import SQLiteStore
from devd.storage.store import Health, Row, Store, answer_digest
from tests.helpers import running

T = TypeVar("T")
# A known bug, kept out of the machine's way while it is open (its regression tests are at the end of this file):
# a fork of a session that is itself a fork of a restored one, at a step before that session's fork point, is built
# from the config instead of the restored snapshot. Set True once fixed, and the machine checks it again.
FORK_OF_A_FORK_OF_A_RESTORE_FIXED = True
LONG = os.environ.get("DEVD_FUZZ") == "long"
MACHINE_SETTINGS = settings(
    max_examples=500 if LONG else 50,
    stateful_step_count=60 if LONG else 30,
    deadline=None,
    derandomize=not LONG,
    print_blob=LONG,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

MAX_LIVE = 3  # instances held at once: past it the least recently used idle session hibernates (rebuilt on use)
SESSIONS_MAX = 8  # sessions the model lets live at once: enough for collisions, forks of forks and restores
NAMES = ["a", "b", "c", "d"]  # chosen names collide often; None asks the registry for a random one
KEYS = ["k1", "k2", "k3", "k4", "k5"]
KINDS = ["turn"] * 2 + ["model"] * 3 + ["result"] * 4 + ["cancel", "timer", "malformed"]  # weighted by repetition
CONFIGS = [b"{}", b'{"model":"gpt-x"}']
PROMPTS = ["fix the build", "ünïcödé ☃", 'say "hi"\nthen stop', ""]
TEXTS = [None, "Let me look.", "done ✓", "line\nbreak"]
CALLS = [
    Call(Exec=Exec(argv=["cargo", "build"])),
    Call(Exec=Exec(argv=["sh", "-c", 'echo "x"'])),
    Call(Read=Read(path="src/lib.rs")),
    Call(Read=Read(path="/etc/passwd")),  # outside the workspace: refused by the core, never dispatched
]
MALFORMED = [b'{"Turn":{"id":"one","prompt":"p"}}', b'{"Nope":1}', b"[]"]


def canonical(event: bytes) -> str | bytes:
    """What makes two events the same event for a key: their JSON, whatever its layout (bytes when not JSON)."""
    try:
        return json.dumps(json.loads(event), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return event


def relayout(event: bytes) -> bytes:
    """The same event in another layout: members sorted, indented, non-ASCII escaped."""
    return json.dumps(json.loads(event), sort_keys=True, indent=1).encode()


def turn_ids(events: list[bytes]) -> list[int]:
    ids = []
    for e in events:
        try:
            parsed = json.loads(e)
        except ValueError:
            continue
        if (
            isinstance(parsed, dict)
            and isinstance(parsed.get("Turn"), dict)
            and isinstance(parsed["Turn"].get("id"), int)
        ):
            ids.append(parsed["Turn"]["id"])
    return ids


@dataclass(frozen=True)
class Kept:
    """A keyed step as the model answered it."""

    event: bytes
    canonical: str | bytes
    actions: bytes
    seq: int


@dataclass(frozen=True)
class Snapshot:
    b64: str  # as the registry gave it
    state: bytes  # as the model's instance gave it (the registry's, decoded, must be the same bytes)
    turns: list[int]  # the turn ids its session had seen, to draw realistic events after a restore
    depth: int  # its session's forks and restores, counted back to a `new`


@dataclass
class Model:
    """One session as the model knows it: enough to rebuild it independently of devd's registry and store."""

    origin: tuple[str, bytes]  # ("config", config) or ("snapshot", state)
    instance: Instance
    base_turns: list[int] = field(default_factory=list)  # turn ids seen before origin (a snapshot's)
    events: list[bytes] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)
    keys: dict[str, Kept] = field(default_factory=dict)
    forked_at: int = 0  # a fork's history up to here was copied from its source's
    depth: int = 0  # forks and restores, counted back to a `new`
    reason: str | None = None  # ENDED (a deadline passed), and why, as the registry said when it did

    @property
    def callable(self) -> bool:
        return self.reason is None

    @property
    def seq(self) -> int:
        return len(self.events)

    def turns(self) -> list[int]:
        return self.base_turns + turn_ids(self.events)


def start(core: Core, origin: tuple[str, bytes]) -> Instance:
    kind, data = origin
    return core.new(data) if kind == "config" else core.restore(data)


def replay(core: Core, origin: tuple[str, bytes], events: list[bytes]) -> tuple[Instance, list[bytes]]:
    """A fresh model instance from origin, stepped through events (well-formed ones only are ever journalled)."""
    instance = start(core, origin)
    return instance, [instance.step_raw(e) for e in events]


def draw_event(data: st.DataObject, m: Model) -> bytes:
    """An event from a small realistic alphabet, aimed mostly at what the model's session waits for."""
    pending = decode_actions(m.instance.pending())
    asked = [a.id for a in pending if a.op.Model is not None]
    calls = [a for a in pending if a.op.Exec is not None or a.op.Read is not None]
    turns = m.turns()
    top = max(turns, default=0)
    kind = data.draw(st.sampled_from(KINDS))
    if kind == "turn":
        tid = data.draw(st.one_of(st.just(top + 1), st.integers(1, top + 2)))
        return encode(turn(tid, data.draw(st.sampled_from(PROMPTS))))
    if kind == "model":
        aid = data.draw(st.sampled_from(asked) if asked else st.integers(1, 12))
        replies = st.lists(st.sampled_from(CALLS), max_size=3).map(lambda c: c or None)
        return encode(answer(aid, data.draw(st.sampled_from(TEXTS)), data.draw(replies)))
    if kind == "result":
        failed = data.draw(st.booleans())
        text = data.draw(st.sampled_from(["ok", "error[E0425]", "pub fn f() -> u8 { x }", ""]))
        if calls and data.draw(st.integers(0, 4)):
            action = data.draw(st.sampled_from(calls))
            family = "Exec" if action.op.Exec is not None else "File"
            if not data.draw(st.integers(0, 5)):
                family = "File" if family == "Exec" else "Exec"  # the wrong family: ignored by the core
            cid = action.id
        else:
            family, cid = data.draw(st.sampled_from(["Exec", "File"])), data.draw(st.integers(1, 12))
        return encode(Event(**{family: Output(id=cid, text=text, failed=failed)}))
    if kind == "cancel":
        return encode(Event(Cancel=Cancel(turn=data.draw(st.sampled_from(turns) if turns else st.integers(1, 3)))))
    if kind == "timer":
        return b'{"Timer":true}'
    return data.draw(st.sampled_from(MALFORMED))


async def _serve(store: SQLiteStore, *, task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        await store.run()


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self, core: Core, model_core: Core, root: Path) -> None:
        super().__init__()
        self.core = core
        self.model_core = model_core
        self.model: dict[str, Model] = {}
        self.snapshots: list[Snapshot] = []
        self._running: Future[None] | None = None
        # The portal is closed here or in teardown, never left to the garbage collector: a portal finalised inside a
        # collection waits on its loop thread from whatever thread the collection ran in, and can deadlock.
        self._exit = ExitStack()
        try:
            self.dir = Path(self._exit.enter_context(tempfile.TemporaryDirectory(dir=root)))
            self.portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
            self.settings = Settings(state_dir=self.dir, socket_path=None, max_live=MAX_LIVE)
            self._open()
        except BaseException:
            self._exit.close()
            raise

    # -- the system under test ----------------------------------------------------------------------------------------

    def _open(self) -> None:
        def parts() -> tuple[SQLiteStore, Registry]:
            store = SQLiteStore(
                self.dir / "devd.sqlite3",
                keys_kept=self.settings.keys_kept_per_session,
                steps_kept=self.settings.steps_kept_per_session,
                prune_every_steps=self.settings.prune_every_steps,
            )
            registry, _ = build(self.settings, self.core, store)
            return store, registry

        self.store, self.registry = self.portal.call(parts)
        self._running, self._scope = self.portal.start_task(_serve, self.store)
        self.call(self.registry.load)

    def _shut(self) -> None:
        """Close the registry (every instance), stop the store's commit task, and close the store."""
        if self._running is None:
            return
        running, self._running = self._running, None
        try:
            self.portal.call(self.registry.close_all)
            self.portal.call(self._scope.cancel)
            running.result(timeout=30)
        finally:
            self.store.close()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self.portal.call(fn, *args)

    def fails(self, kind: type[DevdError], fn: Callable[..., Awaitable[Any]], *args: Any) -> DevdError:
        with pytest.raises(DevdError) as raised:
            self.call(fn, *args)
        assert type(raised.value) is kind, f"{fn.__name__}{args!r} raised {raised.value!r}, not {kind.__name__}"
        return raised.value

    def listed(self) -> dict[str, Info]:
        return {i.name: i for i in self.registry.page()[0]}

    def is_live(self, name: str) -> None:
        """A session a call has just used holds an instance (another may have hibernated to make room for it)."""
        state = self.listed()[name].state
        assert state is State.LIVE, f"{name!r} is {state.value} right after a call used it"

    def teardown(self) -> None:
        with self._exit:
            try:
                self._shut()
            finally:
                for m in self.model.values():
                    m.instance.close()

    # -- helpers -------------------------------------------------------------------------------------------------------

    def existing(self, data: st.DataObject, *, callable_only: bool = False) -> tuple[str, Model]:
        """A session: the newest or the most derived (so restores and forks get stepped and forked in turn), or any,
        in the order they were made (not by name: random names must not steer what is drawn)."""
        names = [n for n, m in self.model.items() if m.callable or not callable_only]
        which = data.draw(st.sampled_from(["newest", "deepest", "any", "any"]), label="which")
        if which == "newest":
            name = names[-1]
        elif which == "deepest":
            name = max(names, key=lambda n: self.model[n].depth)
        else:
            name = data.draw(st.sampled_from(names), label="session")
        return name, self.model[name]

    def step_both(self, name: str, event: bytes, key: str | None, timeout_ms: int | None = None) -> None:
        """Step the registry and the model; the model decides the answer: executed, replayed, conflict or refused.

        timeout_ms=0 is a deadline that has passed before the call starts: deterministically DEADLINE, whatever the
        machine's speed, and nothing is applied."""
        m = self.model[name]
        step = self.registry.step
        if not m.callable:
            tally("step: refused, ended")
            self.fails(HandleError, step, name, event, timeout_ms, key)
            return
        if key is not None and key in m.keys:
            kept = m.keys[key]
            if canonical(event) == kept.canonical:
                tally("step: keyed replay")
                got = self.call(step, name, event, timeout_ms, key)
                assert got == (kept.actions, True, None), "a keyed retry was not replayed with the first answer's bytes"
            else:
                tally("step: keyed conflict")
                self.fails(ConflictError, step, name, event, timeout_ms, key)
            return
        was = self.listed()[name].state.value
        if timeout_ms == 0:
            tally(f"step: deadline on a {was} session")
            m.reason = str(self.fails(DeadlineError, step, name, event, timeout_ms, key))
            return
        try:
            expected = m.instance.step_raw(event)
            ignored = m.instance.ignored()
        except MalformedError:
            tally("step: malformed")
            self.fails(MalformedError, step, name, event, timeout_ms, key)
            self.is_live(name)  # it reached the core (rebuilt first, if stored) and changed nothing
            return
        tally(f"step: executed on a {was} session")
        got = self.call(step, name, event, timeout_ms, key)
        assert got == (expected, False, ignored), f"step {m.seq + 1} of {name!r} ({event!r}) answered other bytes"
        self.is_live(name)
        m.events.append(event)
        m.answers.append(expected)
        if key is not None:
            m.keys[key] = Kept(event, canonical(event), expected, m.seq)

    def add(self, name: str, m: Model) -> None:
        assert name not in self.model, f"the registry answered {name!r}, a name that is taken"
        self.model[name] = m
        self.is_live(name)

    # -- rules ---------------------------------------------------------------------------------------------------------

    @initialize(config=st.sampled_from(CONFIGS))
    def first_session(self, config: bytes) -> None:
        self.new("a", config)

    @precondition(lambda self: len(self.model) < SESSIONS_MAX)
    @rule(name=st.none() | st.sampled_from(NAMES), config=st.sampled_from(CONFIGS))
    def new(self, name: str | None, config: bytes) -> None:
        if name in self.model:
            self.fails(ExistsError, self.registry.new, name, config)
            return
        got = self.call(self.registry.new, name, config)
        assert name is None or got == name
        self.add(got, Model(("config", config), self.model_core.new(config)))

    @precondition(lambda self: any(m.callable for m in self.model.values()))
    @rule(data=st.data(), n=st.integers(1, 8))
    def step(self, data: st.DataObject, n: int) -> None:
        """A burst of steps on one session, most without a key."""
        name, m = self.existing(data, callable_only=True)
        for _ in range(n):
            key = data.draw(st.sampled_from([*[None] * 10, *KEYS]), label="key")
            self.step_both(name, draw_event(data, m), key)

    @precondition(lambda self: any(m.callable for m in self.model.values()))
    @rule(data=st.data(), prompt=st.sampled_from(PROMPTS), rounds=st.integers(0, 2))
    def whole_turn(self, data: st.DataObject, prompt: str, rounds: int) -> None:
        """A turn as a client runs it: the prompt, `rounds` model answers with calls (each call's result sent, in a
        drawn order), then a text answer; each step keyed or not. Queued behind a running turn, it waits its turn."""
        name, m = self.existing(data, callable_only=True)

        def key() -> str | None:
            return data.draw(st.sampled_from([*[None] * 3, *KEYS]), label="key")

        self.step_both(name, encode(turn(max(m.turns(), default=0) + 1, prompt)), key())
        for last in [False] * rounds + [True]:
            asked = [a.id for a in decode_actions(m.instance.pending()) if a.op.Model is not None]
            if not asked or not m.callable:
                return
            calls = None if last else data.draw(st.lists(st.sampled_from(CALLS), min_size=1, max_size=3))
            self.step_both(name, encode(answer(asked[0], data.draw(st.sampled_from(TEXTS)), calls)), key())
            waiting = [a for a in decode_actions(m.instance.pending()) if a.op.Model is None]
            for a in data.draw(st.permutations(waiting)):
                family = "Exec" if a.op.Exec is not None else "File"
                self.step_both(name, encode(Event(**{family: Output(id=a.id, text="ok")})), key())

    @precondition(lambda self: any(m.callable for m in self.model.values()))
    @rule(data=st.data(), n=st.integers(1, 3))
    def keyed_step(self, data: st.DataObject, n: int) -> None:
        """A burst of keyed steps on one session: keys are few, so some are new and some are taken."""
        name, m = self.existing(data, callable_only=True)
        for _ in range(n):
            self.step_both(name, draw_event(data, m), data.draw(st.sampled_from(KEYS), label="key"))

    @precondition(lambda self: any(m.keys for m in self.model.values()))
    @rule(data=st.data(), layout=st.booleans())
    def keyed_retry(self, data: st.DataObject, layout: bool) -> None:
        """The same key and the same event (maybe laid out otherwise): the first answer's bytes, stepped once."""
        name = data.draw(st.sampled_from([n for n, m in self.model.items() if m.keys]))
        key = data.draw(st.sampled_from(sorted(self.model[name].keys)))
        kept = self.model[name].keys[key]
        self.step_both(name, relayout(kept.event) if layout else kept.event, key)

    @precondition(lambda self: any(m.keys for m in self.model.values()))
    @rule(data=st.data())
    def keyed_conflict(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n, m in self.model.items() if m.keys]))
        key = data.draw(st.sampled_from(sorted(self.model[name].keys)))
        self.step_both(name, draw_event(data, self.model[name]), key)  # the same event again is a replay

    @precondition(lambda self: self.model)
    @rule(data=st.data(), key=st.sampled_from([None, *KEYS]))
    def step_past_its_deadline(self, data: st.DataObject, key: str | None) -> None:
        """A step whose deadline has passed ends its session (durably) and is not applied; a keyed retry of a step
        already answered is still replayed."""
        name, m = self.existing(data)
        self.step_both(name, draw_event(data, m), key, timeout_ms=0)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        name, m = self.existing(data)
        if not m.callable:
            self.fails(HandleError, self.registry.snapshot, name)
            return
        b64 = self.call(self.registry.snapshot, name)
        state = m.instance.snapshot()
        assert base64.b64decode(b64) == state, f"the snapshot of {name!r} is not the model's state"
        self.is_live(name)
        self.snapshots.append(Snapshot(b64, state, m.turns(), m.depth))

    @precondition(lambda self: self.snapshots and len(self.model) < SESSIONS_MAX)
    @rule(data=st.data(), name=st.none() | st.sampled_from(NAMES))
    def restore(self, data: st.DataObject, name: str | None) -> None:
        snap = data.draw(st.sampled_from(self.snapshots))
        if name in self.model:
            self.fails(ExistsError, self.registry.restore, snap.b64, name)
            return
        got = self.call(self.registry.restore, snap.b64, name)
        assert name is None or got == name
        origin = ("snapshot", snap.state)
        self.add(got, Model(origin, start(self.model_core, origin), base_turns=snap.turns, depth=snap.depth + 1))

    @precondition(lambda self: self.snapshots)
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def restore_damaged(self, data: st.DataObject, name: str) -> None:
        """A damaged snapshot (one byte flipped, or cut short) or one not in base64 starts nothing, claims nothing."""
        state = data.draw(st.sampled_from(self.snapshots)).state
        how = data.draw(st.sampled_from(["flip", "cut", "not base64"]))
        if how == "not base64":
            b64, kind = "not base64!", InvalidParamsError
        else:
            at = data.draw(st.integers(0, len(state) - 1))
            bad = state[:at] + bytes([state[at] ^ 0x5A]) + state[at + 1 :] if how == "flip" else state[:at]
            b64, kind = base64.b64encode(bad).decode(), MalformedError
        if name in self.model and kind is MalformedError:
            kind = ExistsError  # the name is claimed before the snapshot is read
        self.fails(kind, self.registry.restore, b64, name)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), into=st.none() | st.sampled_from(NAMES), probe=st.booleans())
    def fork(self, data: st.DataObject, into: str | None, probe: bool) -> None:
        """A fork of any session (an ended one's history too) at its latest step, an earlier one, or past its last."""
        source, src = self.existing(data)
        where = data.draw(st.sampled_from(["latest", "at", "at", "before its own fork point", "past"]), label="where")
        steps = {
            "at": st.integers(0, src.seq),
            "before its own fork point": st.integers(0, max(0, src.forked_at - 1)),
            "past": st.just(src.seq + 1),
        }
        at = None if where == "latest" else data.draw(steps[where], label="at")
        if at is not None and at > src.seq:
            self.fails(InvalidParamsError, self.registry.fork, source, at, into)
            return
        if into in self.model:
            self.fails(ExistsError, self.registry.fork, source, at, into)
            return
        if len(self.model) >= SESSIONS_MAX:
            return
        upto = src.seq if at is None else at
        if upto < src.forked_at:
            tally("fork: below its source's own fork point" + (", restored" if src.origin[0] == "snapshot" else ""))
        if src.origin[0] == "snapshot" and upto < src.forked_at and not FORK_OF_A_FORK_OF_A_RESTORE_FIXED:
            tally("fork: not tried, a known bug")
            return
        got = self.call(self.registry.fork, source, at, into)
        assert into is None or got == into
        tally(
            "fork: "
            + ("latest" if upto == src.seq else "earlier")
            + (" of a restored session" if src.origin[0] == "snapshot" else "")
        )
        # The fork's model is its source's history replayed from the source's origin: what the source would do next
        # from step `upto` is what the fork must do.
        instance, answers = replay(self.model_core, src.origin, src.events[:upto])
        assert answers == src.answers[:upto], "the model core is not deterministic"
        keys = {k: v for k, v in src.keys.items() if v.seq <= upto}
        fork = Model(src.origin, instance, src.base_turns, src.events[:upto], answers, keys, upto, src.depth + 1)
        self.add(got, fork)
        if probe:
            self.probe_history(data, got)

    def probe_history(self, data: st.DataObject, name: str) -> None:
        """The fork's history is its source's: forked again at any step k of it, it is the state at step k (the
        probe is closed after)."""
        m = self.model[name]
        k = data.draw(st.integers(0, m.seq), label="probe at")
        if m.origin[0] == "snapshot" and k < m.forked_at and not FORK_OF_A_FORK_OF_A_RESTORE_FIXED:
            tally("fork: probe not tried, a known bug")
            return
        tally("fork: probed")
        probe = self.call(self.registry.fork, name, k, None)
        expected, _ = replay(self.model_core, m.origin, m.events[:k])
        try:
            got = (base64.b64decode(self.call(self.registry.snapshot, probe)), self.call(self.registry.pending, probe))
            assert got == (expected.snapshot(), expected.pending()), f"{name!r} forked again at step {k}"
        finally:
            expected.close()
        self.call(self.registry.close, probe)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pending(self, data: st.DataObject) -> None:
        name, m = self.existing(data)
        tally("pending: " + self.listed()[name].state.value)
        if not m.callable:
            self.fails(HandleError, self.registry.pending, name)
            return
        assert self.call(self.registry.pending, name) == m.instance.pending()
        self.is_live(name)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def recover(self, data: st.DataObject) -> None:
        name, m = self.existing(data)
        tally("recover: " + self.listed()[name].state.value)
        self.call(self.registry.recover, name)
        m.reason = None
        self.is_live(name)

    @precondition(lambda self: len(self.model) > 1)  # the last is kept: a machine with no sessions tests little
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        name, m = self.existing(data)
        self.call(self.registry.close, name)
        del self.model[name]
        m.instance.close()

    @rule(limit=st.integers(1, 3))
    def list_by_pages(self, limit: int) -> None:
        """Paging through the list, `limit` at a time, gives every session once, by name: the whole list."""
        pages, after = [], None
        while True:
            infos, after = self.registry.page(limit, after)
            assert len(infos) <= limit
            pages += infos
            if after is None:
                break
        assert pages == self.registry.page()[0]
        assert [i.name for i in pages] == sorted(self.model)
        counts = self.registry.counts()
        assert counts == {s.value: sum(i.state is s for i in pages) for s in State if s is not State.CLOSED}

    @rule(
        name=st.sampled_from([*NAMES, "nobody"]),
        op=st.sampled_from(["step", "snapshot", "pending", "recover", "close", "fork"]),
    )
    def unknown_name(self, name: str, op: str) -> None:
        if name in self.model:
            return
        r = self.registry
        calls: dict[str, tuple[Callable[..., Awaitable[Any]], tuple[Any, ...]]] = {
            "step": (r.step, (name, b'{"Timer":true}', None, None)),
            "snapshot": (r.snapshot, (name,)),
            "pending": (r.pending, (name,)),
            "recover": (r.recover, (name,)),
            "close": (r.close, (name,)),
            "fork": (r.fork, (name, None, None)),
        }
        fn, args = calls[op]
        self.fails(HandleError, fn, *args)

    @precondition(lambda self: self.model)
    @rule(probe=st.booleans())
    def restart(self, probe: bool) -> None:
        """The daemon stops and starts again over the same file: every session is known, none is in memory, and an
        ended one is still ended, for the same reason. Probed, each callable one is rebuilt and waits for exactly
        what it waited for before."""
        self._shut()
        self._open()
        listed = self.listed()
        for name, m in self.model.items():
            assert listed[name].state is (State.STORED if m.callable else State.ENDED), f"{name!r} after a restart"
        if probe:
            for name, m in self.model.items():
                if m.callable:
                    assert self.call(self.registry.pending, name) == m.instance.pending(), f"{name!r} after a restart"
                    self.is_live(name)

    # -- invariants ----------------------------------------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        keyed = sorted((n, k) for n, m in self.model.items() for k in m.keys)

        async def observe() -> tuple[Any, ...]:
            listed = self.registry.page()[0]
            rows = await self.store.sessions()
            journals = {n: await self.store.steps_since(n, 0, 10_000) for n in self.model}
            kept = {(n, k): await self.store.keyed(n, k) for n, k in keyed}
            # Only sessions holding an instance: asking a stored one would rebuild it, and change what is observed.
            pendings = {i.name: await self.registry.pending(i.name) for i in listed if i.state is State.LIVE}
            return listed, rows, journals, kept, pendings

        listed, rows, journals, kept, pendings = self.call(observe)
        model = sorted(self.model.items())
        # Callable sessions are LIVE or STORED: which one depends on the least-recently-used order hibernation
        # follows, which the model leaves to the registry (`is_live` checks the session each call has just used).
        standing = {State.LIVE: "callable", State.STORED: "callable", State.ENDED: "ended"}
        assert [(i.name, standing[i.state], i.seq, i.watchers, i.reason) for i in listed] == [
            (n, "callable" if m.callable else "ended", m.seq, 0, m.reason) for n, m in model
        ]
        assert sum(i.state is State.LIVE for i in listed) <= MAX_LIVE, "more instances than max_live"
        health = {True: Health.OK, False: Health.ENDED}
        assert [(r.name, r.health, r.reason, r.seq) for r in rows] == [
            (n, health[m.callable], m.reason, m.seq) for n, m in model
        ]
        assert journals == {
            n: [
                Row(i + 1, e, kept_answer(e, a), answer_digest(a))
                for i, (e, a) in enumerate(zip(m.events, m.answers, strict=True))
            ]
            for n, m in model
        }
        for (n, k), row in kept.items():
            want = self.model[n].keys[k]
            assert row is not None and (row.seq, row.actions, row.answer) == (
                want.seq,
                kept_answer(want.event, want.actions),
                answer_digest(want.actions),
            ), f"key {k!r} of {n!r}"
        assert pendings == {n: self.model[n].instance.pending() for n in pendings}


@pytest.fixture(scope="module")
def model_core() -> Iterator[Core]:
    """The model's own Core: its instances share nothing with the registry's."""
    c = Core.open()
    yield c
    c.close()


def test_the_registry_behaves_as_its_model(core: Core, model_core: Core, tmp_path: Path) -> None:
    run_state_machine_as_test(lambda: RegistryMachine(core, model_core, tmp_path), settings=MACHINE_SETTINGS)


# -- known bugs, as regression tests ----------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@asynccontextmanager
async def registry_over(kind: str, tmp_path: Path, core: Core) -> AsyncIterator[Registry]:
    settings = Settings(state_dir=tmp_path, socket_path=None)
    store: Store = (
        MemoryStore()
        if kind == "memory"
        else SQLiteStore(tmp_path / "devd.sqlite3", keys_kept=1000, steps_kept=1000, prune_every_steps=256)
    )
    async with running(store):
        registry, _ = build(settings, core, store)
        try:
            yield registry
        finally:
            registry.close_all()


async def fork_of_a_restore(registry: Registry) -> bytes:
    """A session restored from a snapshot ("r": at step 0 it waits for the model), two steps on, forked at its latest
    step ("f", whose history before step 2 is copied from r's); the snapshot "r" was restored from."""
    await registry.new("src", b"{}")
    await registry.step("src", encode(turn(1, "fix the build")), None, None)
    snapshot = await registry.snapshot("src")
    await registry.restore(snapshot, "r")
    await registry.step("r", encode(answer(1, "done")), None, None)  # Emit, Save, Done: only from the restored state
    await registry.step("r", b'{"Timer":true}', None, None)
    await registry.fork("r", None, "f")
    return base64.b64decode(snapshot)


async def test_a_fork_at_step_0_of_a_fork_of_a_restored_session_is_the_restored_state(
    kind: str, tmp_path: Path, core: Core
) -> None:
    async with registry_over(kind, tmp_path, core) as registry:
        restored = await fork_of_a_restore(registry)
        await registry.fork("f", 0, "g")
        assert base64.b64decode(await registry.snapshot("g")) == restored


async def test_a_fork_before_the_fork_point_of_a_fork_of_a_restored_session_continues_it(
    kind: str, tmp_path: Path, core: Core
) -> None:
    async with registry_over(kind, tmp_path, core) as registry:
        await fork_of_a_restore(registry)
        await registry.fork("r", 1, "from-r")  # r keeps its restored snapshot: this fork is right
        await registry.fork("f", 1, "g")
        assert await registry.snapshot("g") == await registry.snapshot("from-r")


async def test_a_fork_at_step_0_of_a_pruned_restored_session_is_the_restored_state_or_refused(
    tmp_path: Path, core: Core
) -> None:
    store = SQLiteStore(tmp_path / "devd.sqlite3", keys_kept=1000, steps_kept=1000, prune_every_steps=2)
    async with running(store):
        registry, _ = build(Settings(state_dir=tmp_path, socket_path=None), core, store)
        try:
            await registry.new("src", b"{}")
            await registry.step("src", encode(turn(1, "fix the build")), None, None)
            snapshot = await registry.snapshot("src")
            await registry.restore(snapshot, "r")
            await registry.step("r", encode(answer(1, "done")), None, None)  # Save at step 1
            await registry.step("r", encode(turn(2, "again")), None, None)
            await registry.step("r", encode(answer(5, "done again")), None, None)  # Save at step 3: r is pruned
            try:
                await registry.fork("r", 0, "g")
            except InvalidParamsError:
                return  # refused as no longer kept: right too
            assert await registry.snapshot("g") == snapshot
        finally:
            registry.close_all()
