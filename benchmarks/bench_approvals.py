"""`python -m benchmarks.bench approvals`: what approvals and accounting add to a step of a turn the daemon drives.

The same turn is run two ways, alternated, in one process on a real SQLite store against the stand-in model server
(`tests/standin_model.py`, so run it from the repository): **bare**, with an oversight that only applies the
profile's decision (no approval, no reservation, no usage or trace record), and **overseen**, with every call asked
about (`exec = "ask"`, answered by an in-process client the moment it is announced), a session budget checked
before every model call, usage charged and a trace record kept for every attempt and run. A turn is `--calls`
commands (`true`, unsandboxed) and a final answer, so 2 x calls + 2 steps. It prints each side's median turn, the
ratio, and what oversight adds per action, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from devd import log
from devd.agent.approvals import Answer, call_of
from devd.agent.kinds import decide
from devd.agent.oversight import Gate, Oversight
from devd.agent.profiles import Profile
from devd.agent.spend import Refusal, Reservation, Usage
from devd.agent.wire import AgentPort
from devd.config import Settings
from devd.host import Core
from devd.messages import Op
from devd.protocol import ApprovalNotice, TraceRecord
from devd.server.daemon import build
from devd.storage.sqlite import SQLiteStore
from devd.storage.store import Record


class Bare(Oversight):
    """Oversight that does nothing beyond the profile's own decision: the turn as it would run without it."""

    async def gate(self, session: str, action: int, op: Op, profile: Profile) -> Gate:
        found = call_of(op)
        return Gate(True, "bare") if found is None else Gate(decide(profile, found)[0] != "deny", "bare")

    async def admit(
        self, session: str, profile: Profile, turn: int, action: int, request: bytes, *, exact: bool = False
    ) -> tuple[Reservation | None, int | None, Refusal | None]:
        return None, profile.max_tokens, None

    async def settle(
        self,
        session: str,
        profile: Profile,
        turn: int,
        action: int,
        reservation: Reservation | None,
        used: Usage | None,
        calls: int = 1,
    ) -> None:
        return None

    async def trace(self, session: str, record: TraceRecord, beside: Sequence[Record] = ()) -> None:
        if beside:  # an effect's ledger record is the runtime's own, not oversight's: kept as ever
            await self.keeper.add_records(beside)


class _Watcher:
    """A watcher's sink, as a client would be: it answers every approval it is told of at once (when `approve`),
    and says when a turn is done."""

    def __init__(self, oversight: Oversight, tg: anyio.abc.TaskGroup, approve: bool) -> None:
        self.oversight, self.tg, self.approve = oversight, tg, approve
        self.done = anyio.Event()

    def offer(self, data: bytes) -> bool:
        if self.approve and b'"session/approval"' in data:
            notice = msgspec.convert(msgspec.json.decode(data, type=dict[str, Any])["params"], ApprovalNotice)
            allow: Answer = "allow"
            self.tg.start_soon(self.oversight.answer, notice.session, notice.action, notice.digest, allow, "bench")
        elif b'"Done"' in data:
            self.done.set()
        return True

    def force(self, data: bytes) -> None:
        pass


def _script(standin: Any, scripted: Any, calls: int) -> None:
    replies = [scripted(tool_calls=[("exec", {"argv": ["true"]})], usage=(100, 10, None)) for _ in range(calls)]
    standin.script(*replies, scripted(text="done", usage=(100, 10, None)))


async def _turn(runtime: Any, watcher: _Watcher, session: str, prompt: str) -> float:
    watcher.done = anyio.Event()
    t0 = time.perf_counter()
    await runtime.prompt(session, prompt, None)
    await watcher.done.wait()
    return time.perf_counter() - t0


async def _side(
    core: Core, root: Path, standin: Any, scripted: Any, overseen: bool, calls: int, turns: int
) -> list[float]:
    from devd.agent.records import Binding

    profile = Profile(
        name="bench",
        base_url=standin.url,
        model="standin-model",
        workspace_roots=(str(root),),
        exec="ask" if overseen else "allow",
        sandbox="none",
        max_tokens=200,
    )
    state = Path(tempfile.mkdtemp(dir=root))
    store = SQLiteStore(state / "devd.sqlite3", keys_kept=1000, steps_kept=1000, prune_every_steps=256)
    settings = Settings(state_dir=state, socket_path=None)
    registry, dispatcher = build(settings, core, store, agents={"bench": profile})
    port = dispatcher.app.sessions
    assert isinstance(port, AgentPort)
    runtime = port.runtime
    if not overseen:
        runtime.oversight = Bare(runtime.sessions)
    times = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.run)
        await tg.start(runtime.run)
        session = await registry.new(None, b'{"model":"standin-model"}')
        await runtime.bind(session, Binding("bench", str(root)))
        watcher = _Watcher(runtime.oversight, tg, approve=overseen)
        await registry.watch(session, watcher, None)
        if overseen:
            await runtime.oversight.set_budget(session, 1 << 40)
        for i in range(turns):
            _script(standin, scripted, calls)
            times.append(await _turn(runtime, watcher, session, f"turn {i}"))
        runtime.stop()
        tg.cancel_scope.cancel()
    store.close()
    return times


async def _bench(calls: int, rounds: int, turns: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.standin_model import Scripted, Standin

    core = Core.open()
    bare: list[float] = []
    overseen: list[float] = []
    with Standin() as standin, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for _ in range(rounds):  # alternated, so a load that comes and goes weighs on both sides alike
            bare += await _side(core, root, standin, Scripted, False, calls, turns)
            overseen += await _side(core, root, standin, Scripted, True, calls, turns)
    core.close()
    b, o = statistics.median(bare), statistics.median(overseen)
    actions = 2 * calls + 1  # the model asks and the calls
    return {
        "calls_per_turn": calls,
        "turns_each": len(bare),
        "bare_turn_ms_p50": round(b * 1e3, 2),
        "overseen_turn_ms_p50": round(o * 1e3, 2),
        "ratio": round(o / b, 3),
        "added_ms_per_action": round((o - b) * 1e3 / actions, 3),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=20, help="commands in each turn (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two sides (default 3)")
    p.add_argument("--turns", type=int, default=3, help="turns of each side in a round (default 3)")


def run(args: argparse.Namespace) -> int:
    log.configure("json", "warning")
    result = anyio.run(_bench, args.calls, args.rounds, args.turns)
    print(msgspec.json.encode(result).decode())
    return 0
